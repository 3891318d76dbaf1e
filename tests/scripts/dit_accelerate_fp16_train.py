"""The Accelerator-based twin of dit_ddp_cuda_train.py: the same tiny DiT and data, trained with
``Accelerator(mixed_precision="fp16")`` as accelerate's examples write it (accelerate picks the scaler:
accelerate.utils.get_grad_scaler) and checkpointed with ``save_state`` on every rank.

Usage: dit_accelerate_fp16_train.py --results-dir DIR [--steps N]
Prints ``RESULT {json}`` per rank at the end.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from dit_ddp_cuda_train import TinyDiT
from torch.utils.data import DataLoader, TensorDataset


def main(args):
    accelerator = Accelerator(mixed_precision="fp16")
    set_seed(args.global_seed, device_specific=True)
    model = TinyDiT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0)
    data = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(
        TensorDataset(data),
        batch_size=args.global_batch_size // accelerator.num_processes,
        shuffle=True,
        drop_last=True,
    )
    inner = []  # what the last layer computes in (accelerate hands the loss back in fp32 either way)
    model.out.register_forward_hook(lambda module, inputs, output: inner.append(str(output.dtype)))
    model, opt, loader = accelerator.prepare(model, opt, loader)
    losses, steps = [], 0
    while steps < args.steps:
        for (x,) in loader:
            t = torch.rand(x.shape[0], device=x.device)
            noise = torch.randn_like(x)
            with accelerator.autocast():
                pred = model(x + t[:, None] * noise, t)
                loss = torch.nn.functional.mse_loss(pred.float(), noise)
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
            steps += 1
            if steps >= args.steps:
                break
    accelerator.save_state(args.results_dir)
    scaler = accelerator.scaler
    rec = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type),
        "autocast_dtype": inner[-1],
        "scaler": None if scaler is None else type(scaler).__module__ + "." + type(scaler).__name__,
        "scaler_enabled": scaler is not None and scaler.is_enabled(),
        "scale": None if scaler is None else scaler.get_scale(),
        "losses": losses,
    }
    print("RESULT " + json.dumps(rec), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--results-dir", type=str, required=True)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--global-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args())

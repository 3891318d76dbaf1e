"""A tiny training script written the way CUDA repos write them. No accel_npu import anywhere.

Prints one `RESULT {json}` line per rank at the end: world, rank, losses, a parameter checksum.
  --steps N          train N steps
  --save_at K DIR    save_state(DIR) after step K (0-based)
  --resume DIR --start K   load_state(DIR) and continue at step K (same batches as an unbroken run)
"""

import argparse
import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # DeepSpeed's "auto" bucket sizes read model.config.hidden_size, as for HF models.
        self.config = type("Cfg", (), {"hidden_size": 16})()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save_at", type=int, default=None)
    p.add_argument("--save_dir", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--start", type=int, default=0)
    a = p.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(256, 8, generator=g)
    ds = torch.utils.data.TensorDataset(data, data.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if a.resume:
        accelerator.load_state(a.resume)
    batches = list(loader)
    losses, first_inputs = {}, None
    for step in range(a.start, a.start + a.steps):
        x, y = batches[step]
        if first_inputs is None:
            first_inputs = x[0].tolist()
        # DeepSpeed bf16 engines hold bf16 weights: feed them their dtype, as DS scripts do.
        out = model(x.to(next(model.parameters()).dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y.float())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = round(loss.item(), 6)
        if a.save_at == step:
            accelerator.save_state(a.save_dir)
    checksum = None
    if accelerator.distributed_type.value != "DEEPSPEED":  # ZeRO-3 params are partitioned
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    rec = {
        "num_processes": accelerator.num_processes,
        "rank": accelerator.process_index,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "losses": losses,
        "first_inputs": first_inputs,
        "checksum": checksum,
        "param_type": type(next(model.parameters())).__name__,
    }
    # One write call per line keeps the two ranks' lines from interleaving on the shared pipe.
    sys.stdout.write("RESULT " + json.dumps(rec) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

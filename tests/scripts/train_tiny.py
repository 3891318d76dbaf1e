"""A tiny training script written the way CUDA repos write them. No accel_npu import anywhere.

Prints one JSON line per rank at the end: world, rank, losses, parameter checksum.
Usage: train_tiny.py --steps N [--save DIR] [--resume DIR]
"""
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": 16})()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=1)
    set_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(64, 8, generator=g)
    target = data.sum(dim=1, keepdim=True)
    ds = torch.utils.data.TensorDataset(data, target)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if a.resume:
        accelerator.load_state(a.resume)
    losses = []
    batches = iter(loader)
    for step in range(a.steps):
        x, y = next(batches)
        with accelerator.accumulate(model):
            # DeepSpeed bf16 engines hold bf16 weights: feed them their dtype, as DS scripts do
            out = model(x.to(next(model.parameters()).dtype))
            loss = torch.nn.functional.mse_loss(out.float(), y.float())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(round(loss.item(), 6))
        if a.save and step == 0:
            accelerator.save_state(a.save)
    first_x = x[0].tolist()
    params = [p for p in model.parameters()]
    checksum = float(sum(p.detach().float().sum() for p in params)) if accelerator.distributed_type.value != "DEEPSPEED" else None
    rec = {"num_processes": accelerator.num_processes, "rank": accelerator.process_index,
           "distributed_type": str(accelerator.distributed_type), "device": str(accelerator.device),
           "losses": losses, "first_x": first_x, "checksum": checksum,
           "env_rank": os.environ.get("RANK"), "world_size": os.environ.get("WORLD_SIZE")}
    line = json.dumps(rec)
    print("RESULT " + line, flush=True)
    if a.out:
        with open(f"{a.out}.rank{os.environ.get('RANK', '0')}.json", "w") as f:
            f.write(line)


if __name__ == "__main__":
    main()

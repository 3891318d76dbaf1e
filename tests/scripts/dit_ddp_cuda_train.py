"""A plain-PyTorch DDP training script written for CUDA, in the shape of facebookresearch/DiT
train.py (and the research repos that copy it). No Accelerator, no accel_npu import, no device
checks: exactly what runs on a GPU box.

Usage: dit_ddp_cuda_train.py --results-dir DIR [--steps N]
Prints ``RESULT {json}`` per rank at the end.
"""

import argparse
import json
import os
from time import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True


class TinyDiT(torch.nn.Module):
    def __init__(self, dim=16, hidden=64):
        super().__init__()
        self.t_embed = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, hidden))
        self.inp = torch.nn.Linear(dim, hidden)
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, hidden), torch.nn.GELU())
        self.out = torch.nn.Linear(hidden, dim)

    def forward(self, x, t):
        h = self.inp(x) + self.t_embed(t[:, None])
        return self.out(h + self.block(h))


def main(args):
    assert torch.cuda.is_available(), "Training currently requires at least one GPU."

    dist.init_process_group("nccl")
    assert args.global_batch_size % dist.get_world_size() == 0, "Batch size must be divisible by world size."
    rank = dist.get_rank()
    device = rank % torch.cuda.device_count()
    seed = args.global_seed * dist.get_world_size() + rank
    torch.manual_seed(seed)
    torch.cuda.set_device(device)
    print(f"Starting rank={rank}, seed={seed}, world_size={dist.get_world_size()}.")

    model = TinyDiT()
    model = DDP(model.to(device), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0)
    scaler = torch.cuda.amp.GradScaler()

    g = torch.Generator().manual_seed(0)
    data = torch.randn(256, 16, generator=g)
    dataset = TensorDataset(data)
    sampler = DistributedSampler(
        dataset, num_replicas=dist.get_world_size(), rank=rank, shuffle=True, seed=args.global_seed
    )
    loader = DataLoader(
        dataset,
        batch_size=args.global_batch_size // dist.get_world_size(),
        shuffle=False,
        sampler=sampler,
        num_workers=0,
        pin_memory=True,
        drop_last=True,
    )

    model.train()
    losses, step_ms = [], []
    start_event = torch.cuda.Event(enable_timing=True)
    end_event = torch.cuda.Event(enable_timing=True)
    train_steps, start_time = 0, time()
    for epoch in range(100):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            x = x.to(device)
            t = torch.rand(x.shape[0], device=device)
            noise = torch.randn_like(x)
            start_event.record()
            with torch.cuda.amp.autocast(dtype=torch.float16):
                pred = model(x + t[:, None] * noise, t)
                loss = torch.nn.functional.mse_loss(pred.float(), noise)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            end_event.record()
            torch.cuda.synchronize()
            step_ms.append(start_event.elapsed_time(end_event))
            losses.append(loss.item())
            train_steps += 1
            if train_steps >= args.steps:
                break
        if train_steps >= args.steps:
            break

    peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    checkpoint_path = None
    if rank == 0:
        checkpoint = {
            "model": model.module.state_dict(),
            "opt": opt.state_dict(),
            "scaler": scaler.state_dict(),
            "args": vars(args),
        }
        os.makedirs(args.results_dir, exist_ok=True)
        checkpoint_path = f"{args.results_dir}/{train_steps:07d}.pt"
        torch.save(checkpoint, checkpoint_path)
    dist.barrier()
    rec = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "device": str(next(model.parameters()).device),
        "autocast_dtype": str(pred.dtype),
        "scaler_enabled": scaler.is_enabled(),
        "scale": scaler.get_scale(),
        "losses": losses,
        "step_ms": step_ms,
        "peak_memory": peak,
        "checkpoint": checkpoint_path,
        "seconds": time() - start_time,
    }
    print("RESULT " + json.dumps(rec), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--results-dir", type=str, required=True)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--global-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args())

"""A 2-rank job in which rank 1 stalls before a collective. No accel_npu import anywhere.

  accelerate launch --config_file launch_configs/cpu_zero2.yaml stall_one_rank.py
      DeepSpeed ZeRO-2: one training step on both ranks, then rank 1 sleeps and rank 0 enters
      `torch.distributed.all_reduce` (gloo blocks in it).
  torchrun --nproc_per_node 2 stall_one_rank.py --plain
      gloo only: rank 0 starts an asynchronous all_gather_single (all_reduce before torch 2.13) and blocks
      on its handle, outside the collective call, as a host does on HCCL/NCCL (the call returns once queued).

Rank 0 prints `RESULT {"rank": 0, "entering": ...}` just before the collective it will wait in.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Cfg", (), {"hidden_size": 16})()  # DeepSpeed's "auto" bucket sizes read it
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


def train_one_step():
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, data.sum(1, keepdim=True)), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    x, y = next(iter(loader))
    loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y.float())
    accelerator.backward(loss)
    optimizer.step()
    return loss.detach().float()


def sum_losses(loss):
    total = loss.clone()
    dist.all_reduce(total)  # rank 0 waits here for rank 1
    return total


#: the asynchronous collective of the plain run: torch >= 2.13's single-tensor gather, by its own name
ASYNC_COLLECTIVE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_reduce"


def sum_asynchronously(value):
    total = torch.tensor([value])
    if ASYNC_COLLECTIVE == "all_gather_single":
        gathered = torch.empty(dist.get_world_size())
        handle = dist.all_gather_single(gathered, total, async_op=True)
    else:
        gathered, handle = None, dist.all_reduce(total, async_op=True)
    handle.wait()  # rank 0 waits here for rank 1
    return total if gathered is None else gathered.sum(0, keepdim=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--plain",
        action="store_true",
        help="gloo without accelerate/DeepSpeed, an async all_gather_single (all_reduce before torch 2.13)",
    )
    p.add_argument("--stall", type=float, default=600.0, help="seconds rank 1 sleeps before the collective")
    a = p.parse_args()
    if a.plain:
        dist.init_process_group("gloo")
        dist.barrier()
    else:
        loss = train_one_step()
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(a.stall)
    else:
        entering = ASYNC_COLLECTIVE if a.plain else "all_reduce"
        print(
            "RESULT " + json.dumps({"rank": rank, "pid": os.getpid(), "entering": entering, "at": time.time()}),
            flush=True,
        )
    total = sum_asynchronously(1.0) if a.plain else sum_losses(loss)
    print("RESULT " + json.dumps({"rank": rank, "total": total.tolist()}), flush=True)


if __name__ == "__main__":
    main()

"""An EMA target updated from a ZeRO-3 engine's parameters() after every optimizer step, as diffusers v0.40.0's
consistency_distillation/train_lcm_distill_sd_wds.py does (update_ema, copied from it), its batches made outside
any prepared DataLoader (that script's webdataset), with a rank-0-only checkpoint right after the EMA update
(that script's `if accelerator.is_main_process: accelerator.save_state(...)`) after step 2: the other rank's
next collective is then its next forward's fetch of the first layer. usage: zero3_engine_reads.py OUT_DIR

The witness needs no collective: each rank updates a reference EMA from its own slice of every parameter, read
from DeepSpeed's partition (``param.ds_tensor``), and compares that slice of the target. At the end rank 0 alone
reads the engine's parameters (`if accelerator.process_index == 0`) and reports the exception it gets.
Prints ``RESULT {json}`` per rank.
"""

import copy
import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

out_dir = sys.argv[1]
accelerator = Accelerator()
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
target = copy.deepcopy(model).requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
rank, rate = accelerator.process_index, 0.9
batches = [(torch.randn(2, 16), torch.randn(2, 4)) for _ in range(3)]


@torch.no_grad()
def update_ema(target_params, source_params, rate=0.99):
    for targ, src in zip(target_params, source_params):
        targ.detach().mul_(rate).add_(src, alpha=1 - rate)


def my_slices():
    """(start, count, partition) of this rank's slice of each parameter, from DeepSpeed's partition."""
    out = []
    for p in model.module.parameters():
        part = p.ds_tensor.reshape(-1)
        start = part.numel() * rank
        out.append((start, max(0, min(part.numel(), p.ds_numel - start)), part))
    return out


reference = [t.detach().clone().reshape(-1) for t in target.parameters()]
equal, moved, steps = True, True, 0
for step, (x, y) in enumerate(batches, start=1):
    loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    before = [t.detach().clone() for t in target.parameters()]
    update_ema(target.parameters(), model.parameters(), rate)
    with torch.no_grad():
        for ref, t, (start, count, part) in zip(reference, target.parameters(), my_slices()):
            ref[start : start + count].mul_(rate).add_(part[:count], alpha=1 - rate)
            equal &= count > 0 and torch.equal(t.reshape(-1)[start : start + count], ref[start : start + count])
    moved &= not any(torch.equal(t, b) for t, b in zip(target.parameters(), before))
    steps = step
    if accelerator.is_main_process:
        if step == 2:  # after step 1 DeepSpeed checks its fetch trace across ranks (a broadcast): not from step 2 on
            accelerator.save_state(os.path.join(out_dir, f"checkpoint-{step}"))
            with open(os.path.join(out_dir, "steps.json"), "w") as f:
                json.dump({"saved_at": step}, f)

outcome = {"rank": rank, "steps": steps, "ema_equal": bool(equal), "ema_moved": moved}
if rank == 0:
    started = time.monotonic()
    try:
        print([tuple(p.shape) for p in model.parameters()])
        outcome["asymmetric"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        outcome.update(
            asymmetric=type(exc).__name__, asymmetric_message=str(exc), asymmetric_seconds=time.monotonic() - started
        )
print("RESULT " + json.dumps(outcome), flush=True)
accelerator.wait_for_everyone()
accelerator.end_training()

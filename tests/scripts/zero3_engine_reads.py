"""An EMA target updated from a ZeRO-3 engine's parameters() after every optimizer step, as diffusers v0.40.0's
consistency_distillation/train_lcm_distill_sd_wds.py does (update_ema, copied from it), with a rank-0-only
checkpoint right after it (that script's `if accelerator.is_main_process: accelerator.save_state(...)`).
usage: zero3_engine_reads.py OUT_DIR

Each rank also computes the EMA from DeepSpeed's documented read (deepspeed.zero.GatheredParameters on every
rank) and compares. At the end rank 0 alone reads the engine's parameters (`if accelerator.process_index == 0`)
and reports the exception it gets. Prints ``RESULT {json}`` per rank.
"""
import copy
import json
import os
import sys
import time

import deepspeed
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

out_dir = sys.argv[1]
accelerator = Accelerator()
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
target = copy.deepcopy(model).requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 4))
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
rate = 0.9


@torch.no_grad()
def update_ema(target_params, source_params, rate=0.99):
    for targ, src in zip(target_params, source_params):
        targ.detach().mul_(rate).add_(src, alpha=1 - rate)


reference = [t.detach().clone() for t in target.parameters()]
equal, moved, steps = True, True, 0
for step, (x, y) in enumerate(loader, start=1):
    loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    params = list(model.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for ref, p in zip(reference, params):
            ref.mul_(rate).add_(p.detach(), alpha=1 - rate)
    before = [t.detach().clone() for t in target.parameters()]
    update_ema(target.parameters(), model.parameters(), rate)
    equal &= all(torch.equal(t, r) for t, r in zip(target.parameters(), reference))
    moved &= not any(torch.equal(t, b) for t, b in zip(target.parameters(), before))
    steps = step
    if accelerator.is_main_process:
        if step == 1:
            accelerator.save_state(os.path.join(out_dir, f"checkpoint-{step}"))
            with open(os.path.join(out_dir, "steps.json"), "w") as f:
                json.dump({"saved_at": step}, f)
    if step == 2:
        break

outcome = {"rank": accelerator.process_index, "steps": steps, "ema_equal": equal, "ema_moved": moved}
if accelerator.process_index == 0:
    started = time.monotonic()
    try:
        print([tuple(p.shape) for p in model.parameters()])
        outcome["asymmetric"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        outcome.update(asymmetric=type(exc).__name__, asymmetric_message=str(exc),
                       asymmetric_seconds=time.monotonic() - started)
print("RESULT " + json.dumps(outcome), flush=True)
accelerator.wait_for_everyone()
accelerator.end_training()

"""A script that saves inside ``if accelerator.is_main_process:`` under DeepSpeed ZeRO-3 or FSDP (a common
mistake: DiT4DiT, diffusers #2606). usage: rank0_only_save.py MODE OUT_DIR

MODE: save_state | save_state_busy | save_state_midstep | save_state_every_rank | save_model | save_model_busy.
Rank 0 saves right after the optimizer step; with ``_busy`` the other ranks are not idle while it does
(they sleep ACCEL_NPU_COLLECTIVE_TIMEOUT + 5 s first, as a rank training on would be elsewhere);
otherwise they wait in ``accelerator.wait_for_everyone()``. ``save_state_midstep``: rank 0 saves between forward
and backward while the others go on into backward (its collectives); the exception propagates.
``save_state_every_rank``: the one-line fix (every rank calls save_state), the reference checkpoint.

Prints ``RESULT {json}`` from the main process: the exception it got, or "saved" with the sum of
every parameter (gathered on every rank afterwards, the documented way) to compare with the file.
"""
import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

mode, out_dir = sys.argv[1], sys.argv[2]
accelerator = Accelerator()
set_seed(0)  # python, numpy and torch: the checkpoint's RNG states compare across runs
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 4)),
                                     batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
x, y = next(iter(loader))
loss = torch.nn.functional.mse_loss(model(x), y)
if mode == "save_state_midstep" and accelerator.is_main_process:
    # mid-step: the other ranks go on into backward's collectives, no step boundary to wait at
    started = time.monotonic()
    try:
        accelerator.save_state(out_dir)
    except Exception as exc:  # noqa: BLE001 - reported, then re-raised
        print("RESULT " + json.dumps({"rank": 0, "error": type(exc).__name__, "message": str(exc),
                                      "seconds": time.monotonic() - started}), flush=True)
        raise
accelerator.backward(loss)
optimizer.step()
if mode == "save_state_every_rank":
    accelerator.save_state(out_dir)
if mode.endswith("_busy") and not accelerator.is_main_process:
    time.sleep(float(os.environ.get("ACCEL_NPU_COLLECTIVE_TIMEOUT", "30")) + 5)
outcome = None
if accelerator.is_main_process:
    started = time.monotonic()
    try:
        if mode == "save_state_every_rank":
            pass  # saved above, on every rank
        elif mode.startswith("save_state"):
            accelerator.save_state(out_dir)
        else:
            accelerator.save_model(model, out_dir)
        outcome = {"result": "saved"}
    except Exception as exc:  # noqa: BLE001 - reported, then re-raised
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    outcome["seconds"] = time.monotonic() - started
    if "error" in outcome:
        print("RESULT " + json.dumps({"rank": 0, **outcome}), flush=True)
        raise SystemExit(1)
accelerator.wait_for_everyone()
state = accelerator.get_state_dict(model)  # every rank: the reference
if accelerator.is_main_process:
    outcome["reference"] = {k: v.float().sum().item() for k, v in state.items()}
    print("RESULT " + json.dumps({"rank": 0, **outcome}), flush=True)

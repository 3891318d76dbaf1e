"""save_state written in the background (ACCEL_NPU_ASYNC_CHECKPOINT=1) under FSDP2 on 2 ranks.
usage: async_save_fsdp.py OUT_DIR

The script switches the variable itself between saves (os.environ), so one launch writes both kinds. Its test
hook: DCP's ``FileSystemWriter.write_data`` called off the main thread (the background writer) is slowed by
``slow`` seconds, or fails on rank 1 while ``fail`` is set.

Two steps; save_state synchronously into OUT_DIR/sync, then asynchronously into OUT_DIR/async with the writer
slowed (is OUT_DIR/async there when save_state returns?); one more step while it is written; save_state into
OUT_DIR/next (is OUT_DIR/async published when that returns?); load_state(sync) and two steps, load_state(async)
and the same two steps (their losses); then an asynchronous save_state into OUT_DIR/async again that fails on
rank 1, and the next save_state (into OUT_DIR/after_failure), whose error every rank reports.

Prints ``RESULT {json}`` from every rank.
"""

import json
import os
import sys
import threading
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.distributed.checkpoint import FileSystemWriter

out_dir = sys.argv[1]
hook = {"slow": 0.0, "fail": False}
_write_data = FileSystemWriter.write_data


def write_data_in_test(self, plan, planner):
    if threading.current_thread() is not threading.main_thread():
        time.sleep(hook["slow"])
        if hook["fail"] and int(os.environ.get("RANK", "0")) == 1:
            raise OSError(28, "No space left on device (injected by the test)")
    return _write_data(self, plan, planner)


FileSystemWriter.write_data = write_data_in_test

accelerator = Accelerator()
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 4))
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = list(loader)
position = [0]


def step():
    x, y = batches[position[0] % len(batches)]
    position[0] += 1
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def losses_after_load(directory):
    accelerator.load_state(directory)
    position[0] = 2
    return [step() for _ in range(2)]


def asynchronous(on: bool):
    os.environ["ACCEL_NPU_ASYNC_CHECKPOINT"] = "1" if on else "0"


def path(name):
    return os.path.join(out_dir, name)


result = {"rank": accelerator.process_index}
step(), step()
asynchronous(False)
accelerator.save_state(path("sync"))
asynchronous(True)
hook["slow"] = 2.0
started = time.monotonic()
accelerator.save_state(path("async"))
result["returned_s"] = time.monotonic() - started
result["published_at_return"] = os.path.isdir(path("async"))
step()  # training goes on (the parameters change) while the staged copies are written
started = time.monotonic()
accelerator.save_state(path("next"))
result["next_s"] = time.monotonic() - started
result["published_when_next_returned"] = os.path.isfile(path("async/accel_npu_checkpoint.json"))
hook["slow"] = 0.0
result["losses_sync"] = losses_after_load(path("sync"))
result["losses_async"] = losses_after_load(path("async"))
hook["fail"] = True
accelerator.save_state(path("async"))  # fails on rank 1, in the background
try:
    accelerator.save_state(path("after_failure"))
except Exception as exc:  # noqa: BLE001 - reported
    result["error"] = type(exc).__name__
    result["message"] = str(exc)
hook["fail"] = False
accelerator.end_training()
print("RESULT " + json.dumps(result), flush=True)

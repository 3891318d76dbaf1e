"""save_state written in the background (ACCEL_NPU_ASYNC_CHECKPOINT=1) on 2 ranks, under DeepSpeed or FSDP2
(the launch config decides). usage: async_save.py MODE OUT_DIR

The script switches the variable itself between saves (os.environ), so one launch writes both kinds.
Its test hook, on the background writer's thread (not the main one): the write of each file (``torch.save``
under DeepSpeed; DCP's ``FileSystemWriter.write_data`` under FSDP2) is slowed by ``slow`` seconds, fails on
rank 1 while ``fail`` is set, or, while ``kill`` is set, SIGKILLs rank 1 once its save_state has returned
(under DeepSpeed after leaving half a file, under FSDP2 after writing its shard of a checkpoint not yet published).
On the thread that copies the state to host memory after save_state returns, the copy (which the next optimizer
step waits for) is made ``hold_copy`` seconds late.

MODE main: two steps; save_state synchronously into OUT_DIR/sync, then asynchronously into OUT_DIR/async
with the writer slowed and the host copy made a second late (is OUT_DIR/async there when save_state returns?);
one more step while it is written (its optimizer step waits for the copy: how long it took);
save_state into OUT_DIR/next (is OUT_DIR/async published when that returns?); load_state(sync) and two steps,
load_state(async) and the same two steps (their losses); then an asynchronous save_state into OUT_DIR/async
again that fails on rank 1, and the next save_state (into OUT_DIR/after_failure), whose error every rank reports;
last, a negative: the optimizer step's wait switched off, save_state synchronously into OUT_DIR/unwaited_sync and
asynchronously into OUT_DIR/unwaited with the copy late, and a step before the copy is made; then a step, an
asynchronous save_state into OUT_DIR/last, a listing of OUT_DIR on rank 0 and wait_for_everyone (their seconds;
is OUT_DIR/last published?).
MODE kill: two steps; save_state synchronously into OUT_DIR/reference and asynchronously into OUT_DIR/ckpt
(published at the next call); one step; save_state into OUT_DIR/ckpt again, during whose background write
rank 1 dies.
MODE resume: load_state(OUT_DIR/ckpt) and two steps, load_state(OUT_DIR/reference) and the same two (losses).

The tiny model's DCP shard files are written past the page cache as a large model's are (direct_io.MIN_BYTES
lowered); in MODE main each rank reports how many of its shard files' pages are cached before load_state.

Prints ``RESULT {json}`` from every rank.
"""

import json
import os
import signal
import sys
import threading
import time

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.distributed.checkpoint import FileSystemWriter

from accel_npu.plugins.checkpoints import background, direct_io

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tests.page_cache import resident_pages

mode, out_dir = sys.argv[1], sys.argv[2]
# the tiny model's DCP shard files (FSDP2) are written past the page cache as a large model's are; DeepSpeed's
# archives of many small tensors stay below direct_io.worth_it's padding bound, so they are written buffered
direct_io.MIN_BYTES = 0
hook = {"slow": 0.0, "fail": False, "kill": False, "hold_copy": 0.0}
returned = threading.Event()  # the main thread is back from save_state: the write is in the background
_save = torch.save
_write_data = FileSystemWriter.write_data


def in_background_write():
    """The hook's slow-down and injected failure; True on the background writer's thread."""
    if threading.current_thread() is threading.main_thread():
        return False
    time.sleep(hook["slow"])
    if hook["fail"] and int(os.environ.get("RANK", "0")) == 1:
        raise OSError(28, "No space left on device (injected by the test)")
    return True


def save_in_test(obj, f, *args, **kwargs):
    if in_background_write():
        if hook["kill"] and int(os.environ.get("RANK", "0")) == 1:
            returned.wait(60)
            _save(obj, f, *args, **kwargs)
            with open(f, "r+b") as half:
                half.truncate(os.path.getsize(f) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
    return _save(obj, f, *args, **kwargs)


def write_data_in_test(self, plan, planner):
    if in_background_write() and hook["kill"] and int(os.environ.get("RANK", "0")) == 1:
        returned.wait(60)
        _write_data(self, plan, planner)  # rank 1's shard written, the checkpoint not yet published
        os.kill(os.getpid(), signal.SIGKILL)
    return _write_data(self, plan, planner)


_fill = background.HostCopy.fill


def fill_in_test(self):
    """The copy of the state the next optimizer step waits for, made late by ``hold_copy`` seconds."""
    time.sleep(hook["hold_copy"])
    return _fill(self)


background.HostCopy.fill = fill_in_test
accelerator = Accelerator()
if accelerator.distributed_type == DistributedType.FSDP:
    FileSystemWriter.write_data = write_data_in_test  # DCP writes FSDP's shards
else:
    torch.save = save_in_test
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
if mode in ("main", "kill"):
    step(), step()
    asynchronous(False)
    accelerator.save_state(path("sync" if mode == "main" else "reference"))
    asynchronous(True)
if mode == "main":
    hook["slow"], hook["hold_copy"] = 2.0, 1.0
    started = time.monotonic()
    accelerator.save_state(path("async"))
    result["returned_s"] = time.monotonic() - started
    result["published_at_return"] = os.path.isdir(path("async"))
    started = time.monotonic()
    step()  # training goes on while the files are written; its optimizer step waits for the late copy
    result["step_after_save_s"] = time.monotonic() - started
    started = time.monotonic()
    accelerator.save_state(path("next"))
    result["next_s"] = time.monotonic() - started
    result["published_when_next_returned"] = os.path.isfile(path("async/accel_npu_checkpoint.json"))
    # the kernel's account of this rank's DCP shard files (FSDP2), before load_state reads them: (cached, pages)
    rank = accelerator.process_index
    for kind in ("sync", "async"):
        folder = path(kind)
        shards = [os.path.join(folder, d, f"__{rank}_0.distcp") for d in sorted(os.listdir(folder))]
        result[f"resident_{kind}"] = [resident_pages(p) for p in shards if os.path.isfile(p)]
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
    # negative: the optimizer step does not wait for the late copy, which then holds the state after the step
    wait_for_snapshot, background.wait_for_snapshot = background.wait_for_snapshot, lambda: None
    asynchronous(False)
    accelerator.save_state(path("unwaited_sync"))
    asynchronous(True)
    accelerator.save_state(path("unwaited"))
    started = time.monotonic()
    step()
    result["unwaited_step_s"] = time.monotonic() - started
    background.wait_for_snapshot = wait_for_snapshot
    hook["hold_copy"] = 0.0
    # the end of a training script: a step, an asynchronous save_state, rank 0 lists the folder, wait_for_everyone
    # (how long both took; the checkpoint is published once it returns), end_training
    step()
    accelerator.save_state(path("last"))
    started = time.monotonic()
    if accelerator.is_main_process:
        os.listdir(out_dir)  # rank 0 prunes old checkpoints (docs/examples/train_dit.py): waits for the publication
    accelerator.wait_for_everyone()
    result["barrier_s"] = time.monotonic() - started
    result["published_after_barrier"] = os.path.isfile(path("last/accel_npu_checkpoint.json"))
    accelerator.end_training()
elif mode == "kill":
    accelerator.save_state(path("ckpt"))
    step()
    # the first save published (its manifest in place) before the hook arms: only the second one's write is killed
    deadline = time.monotonic() + 60
    while not os.path.isfile(path("ckpt/accel_npu_checkpoint.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    hook["kill"] = True
    accelerator.save_state(path("ckpt"))  # rank 1 dies in its background write
    print("RESULT " + json.dumps(dict(result, returned=True)), flush=True)
    returned.set()
    accelerator.end_training()  # rank 0 waits here for rank 1's files, until the launcher stops it
elif mode == "resume":
    result["losses_ckpt"] = losses_after_load(path("ckpt"))
    result["losses_reference"] = losses_after_load(path("reference"))
print("RESULT " + json.dumps(result), flush=True)

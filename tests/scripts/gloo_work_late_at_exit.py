"""Ends while a gloo worker is still finishing a work, on a group that outlives the script (as
DeepSpeed's groups do): the shape of a worker descheduled on a busy machine at the end of a run.

Made deterministic with two stand-ins for timing:
- the worker is late on purpose: a completion callback (``Future.then``, as DDP comm hooks
  register) holds the work on the worker thread until the script is exiting (an atexit handler
  registered after every other one, so it runs first), then ``LATE_S`` more: the other rank, and
  how long this one took to get there, play no part;
- Python's finalization is made long: an object deleted in module teardown sleeps ``HOLD_S``
  there, as large teardowns take time. So the worker asks for the GIL while Python finalizes.
  Stock: its thread is ended inside a noexcept frame, "terminate called without an active
  exception", SIGABRT, although every rank printed its result.

Prints ``RESULT rank=N attempts=K`` when the script body ends and ``CALLBACK_DONE rank=N`` when
the late callback finished. Launch it with torchrun (stock accelerate starts one CPU process).
"""

import atexit
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from accelerate import Accelerator

LATE_S, HOLD_S = 1.0, 4.0


class _LongFinalization:
    def __del__(self, sleep=time.sleep, hold=HOLD_S):  # in module teardown: Python is finalizing
        sleep(hold)


_long_finalization = _LongFinalization()

accelerator = Accelerator()
if not dist.is_initialized():  # stock accelerate does not start gloo on a CPU-only machine
    dist.init_process_group("gloo")
rank = dist.get_rank()
# Held by this module to the end, as deepspeed.utils.groups holds DeepSpeed's groups.
group = dist.new_group(list(range(dist.get_world_size())))


MAIN_THREAD = threading.get_ident()
ran_inline = []
exiting = threading.Event()
kept = {}  # attempt -> Event set once both ranks agreed on it; its callback holds the work only if kept


def _late_callback(fut, attempt):
    if threading.get_ident() == MAIN_THREAD:  # the work had completed before .then(): run here, inline
        ran_inline.append(True)
        return
    kept[attempt].wait(600)  # on gloo's worker thread, which still holds the work
    if not getattr(kept[attempt], "chosen", False):
        return
    exiting.wait(600)
    time.sleep(LATE_S)
    os.write(2, f"CALLBACK_DONE rank={rank}\n".encode())


# Until the callback is attached while the work is pending on both ranks (the rank that joins
# the collective last may see it complete before it attaches; both ranks agree on each attempt).
for attempt in range(20):
    ran_inline.clear()
    kept[attempt] = threading.Event()
    dist.all_reduce(torch.ones(4), group=group, async_op=True).get_future().then(
        lambda fut, attempt=attempt: _late_callback(fut, attempt)
    )
    attached = torch.tensor([0.0 if ran_inline else 1.0])
    dist.all_reduce(attached, op=dist.ReduceOp.MIN)
    kept[attempt].chosen = attached.item() == 1.0
    kept[attempt].set()
    if kept[attempt].chosen:
        break
sys.stdout.write(f"RESULT rank={rank} attempts={attempt + 1}\n")
sys.stdout.flush()
atexit.register(exiting.set)  # the last registered: the first to run at exit

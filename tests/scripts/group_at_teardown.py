"""Says, from the last atexit handler to run, whether the default process group was still open
and how many of gloo's worker threads were still alive (the OS thread names that torch's
ProcessGroupGloo::runLoop sets, "pt_gloo_runloop", read from /proc/self/task/*/comm). A gloo
group still alive here is freed in interpreter teardown, where a worker dropping its last work
needs the GIL and aborts the process.

usage: group_at_teardown.py MODE_RANK0,MODE_RANK1 — each rank, after one all_reduce:
  plain         ends like most training scripts: no end_training(), no destroy_process_group()
  end_training  calls accelerator.end_training() itself
  raise         ends with an unhandled exception, once the other rank has reported (the launcher ends
                every rank when one fails: the other's report would race its SIGTERM)
"""

import atexit
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _gloo_worker_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def _report():
    # Registered before Accelerator() exists, so it runs after every handler registered later.
    sys.stdout.write(
        f"GROUP_AT_TEARDOWN rank={os.environ['RANK']} open={dist.is_initialized()} "
        f"gloo_threads={_gloo_worker_threads()}\n"
    )
    sys.stdout.flush()
    _reported(os.environ["RANK"]).touch()


def _reported(rank: str) -> Path:
    # in the launch's working directory; MASTER_PORT tells concurrent launches there apart
    return Path(f"teardown_reported.{os.environ['MASTER_PORT']}.{rank}")


atexit.register(_report)

from accelerate import Accelerator  # noqa: E402 - after the atexit report is registered, so it runs last

accelerator = Accelerator()
mode = sys.argv[1].split(",")[accelerator.process_index]
total = torch.tensor([accelerator.process_index + 1.0])
dist.all_reduce(total)
sys.stdout.write(f"REDUCED rank={accelerator.process_index} {total.item()}\n")
sys.stdout.flush()
if mode == "end_training":
    accelerator.end_training()
elif mode == "raise":
    deadline = time.monotonic() + 120
    while (
        not all(_reported(str(r)).exists() for r in range(accelerator.num_processes) if r != accelerator.process_index)
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    raise RuntimeError("the script failed after training")

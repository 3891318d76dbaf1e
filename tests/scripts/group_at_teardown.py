"""Says, from the last atexit handler to run, whether the default process group was still open.

usage: group_at_teardown.py MODE_RANK0,MODE_RANK1 — each rank, after one all_reduce:
  plain         ends like most training scripts: no end_training(), no destroy_process_group()
  end_training  calls accelerator.end_training() itself
  raise         ends with an unhandled exception
"""
import atexit
import os
import sys

import torch
import torch.distributed as dist


def _report():
    # Registered before Accelerator() exists, so it runs after every handler registered later.
    sys.stdout.write(f"GROUP_AT_TEARDOWN rank={os.environ['RANK']} open={dist.is_initialized()}\n")
    sys.stdout.flush()


atexit.register(_report)

from accelerate import Accelerator  # noqa: E402

accelerator = Accelerator()
mode = sys.argv[1].split(",")[accelerator.process_index]
total = torch.tensor([accelerator.process_index + 1.0])
dist.all_reduce(total)
sys.stdout.write(f"REDUCED rank={accelerator.process_index} {total.item()}\n")
sys.stdout.flush()
if mode == "end_training":
    accelerator.end_training()
elif mode == "raise":
    raise RuntimeError("the script failed after training")

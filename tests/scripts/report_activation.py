"""A launched worker that reports how accel-npu reached it, without importing accel_npu itself.

Imports accelerate before torch (as 34 of diffusers' 90 training examples do), starts the process
group through Accelerator(), all-reduces its rank, and prints ``RESULT {json}``: the world size and
the sum torch.distributed computed, where ``accel_npu`` and each built-in plugin module were imported
from (read off sys.modules), and whether Accelerator.save_state is wrapped.
"""

import json
import sys

import accelerate  # noqa: F401  (before torch on purpose)
import torch
from accelerate import Accelerator

accelerator = Accelerator()
total = torch.tensor([float(accelerator.process_index)])
if torch.distributed.is_initialized():
    torch.distributed.all_reduce(total)
modules = {
    name: getattr(module, "__file__", None)
    for name, module in list(sys.modules.items())
    if name == "accel_npu" or name.startswith("accel_npu.plugins")
}
rec = {
    "rank": accelerator.process_index,
    "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
    "rank_sum": total.item(),
    "modules": modules,
    "save_state_type": type(Accelerator.__dict__["save_state"]).__name__,
}
print("RESULT " + json.dumps(rec), flush=True)
accelerator.end_training()

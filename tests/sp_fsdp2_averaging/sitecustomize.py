"""The negative of the FSDP2 sequence-parallel test (tests/test_sequence_parallel_fsdp2.py): on a launched rank's
PYTHONPATH, torch's ``FSDPModule.set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms`` do nothing,
so ``fully_shard`` keeps its own reduction (the mean over every rank); then tests/sp_witness/sitecustomize.py runs
as it would. Only in processes with RANK set. Never imports accel_npu.
"""

import os
import runpy

if "RANK" in os.environ:
    from torch.distributed.fsdp import FSDPModule

    FSDPModule.set_gradient_divide_factor = lambda self, factor: None
    FSDPModule.set_force_sum_reduction_for_comms = lambda self, enable: None

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sp_witness", "sitecustomize.py"))

"""The cuda device backend: CUDA is present, so accel-npu changes nothing about devices."""
from __future__ import annotations

from accel_npu import environment
from accel_npu._torch.device import cuda_available
from accel_npu.backend import Backend
from accel_npu.hookspecs import hookimpl


@hookimpl
def accel_npu_select_backend(env):
    forced = environment.forced_backend(env)
    if forced and forced != "cuda":
        return None
    import torch

    if not forced and not cuda_available():
        return None
    return Backend(name="cuda", device_type="cuda", dist_backend="nccl",
                   device_count=torch.cuda.device_count(), ds_accelerator=None, plugin="cuda")

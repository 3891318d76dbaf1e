"""The cuda device backend: CUDA is present, so accel-npu changes nothing about devices."""
from __future__ import annotations

from accel_npu import hookimpl
from accel_npu.backend import Backend


@hookimpl
def accel_npu_select_backend(env):
    forced = env.get("ACCEL_NPU_BACKEND", "").strip().lower()
    if forced and forced != "cuda":
        return None
    import torch

    if not forced and not torch.cuda.is_available():
        return None
    return Backend(name="cuda", device_type="cuda", dist_backend="nccl",
                   device_count=torch.cuda.device_count(), ds_accelerator=None, plugin="cuda")

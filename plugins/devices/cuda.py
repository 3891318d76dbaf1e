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
    return Backend(
        name="cuda",
        device_type="cuda",
        dist_backend="nccl",
        device_count=torch.cuda.device_count(),
        ds_accelerator=None,
        plugin="devices.cuda",
    )


def check_cuda_devices() -> str:
    import torch

    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return f"{torch.cuda.device_count()} device(s): {', '.join(names)} (CUDA {torch.version.cuda})"


@hookimpl
def accel_npu_selftest_checks(backend):
    # CUDA is present: accel-npu passes everything through, and the device checks show it
    if backend.name != "cuda":
        return None
    return [("CUDA devices", f"{__name__}:check_cuda_devices")]

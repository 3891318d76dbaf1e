"""The line after a CUDA error in a process where the façade is off (a plain ``python train.py``)."""

from __future__ import annotations

import linecache

# torch's own messages when a script asks for CUDA that is not there (torch/cuda/__init__.py _lazy_init,
# torch/cuda/streams.py, torch/distributed/distributed_c10d.py, torch/serialization.py)
_CUDA_MISSING = (
    "Torch not compiled with CUDA enabled",
    "Found no NVIDIA driver",
    "PyTorch was compiled without CUDA",
    "Tried to instantiate dummy base class",
    "Distributed package doesn't have NCCL built in",
    "Attempting to deserialize object on a CUDA device",
)


def _failing_line(error: BaseException) -> str:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ""


def met_missing_cuda(error: BaseException) -> bool:
    """The script stopped where CUDA is absent: torch's message, or its own ``assert torch.cuda...``."""
    if any(text in str(error) for text in _CUDA_MISSING):
        return True
    return isinstance(error, AssertionError) and "torch.cuda." in _failing_line(error)


def explain(error: BaseException, why_off: str) -> str:
    return (
        f"this CUDA-written script met torch without CUDA, and accel-npu's torch.cuda façade is off in this "
        f"process ({why_off}). Start it as training starts — `accelerate launch train.py` or `torchrun "
        f"--nproc_per_node N train.py` — or set ACCEL_NPU_CUDA_FACADE=1 for a plain `python` run "
        f"(docs/cuda-compat.md)."
    )


def explain_error(error: BaseException) -> str | None:
    """The line after a CUDA error where the façade is off, or None (the façade is on, or the error is
    not CUDA's absence)."""
    from accel_npu.scopes import cuda_facade_off

    try:
        why_off = cuda_facade_off()
    except Exception:  # noqa: BLE001 - an unreadable ACCEL_NPU_CUDA_FACADE was named when activation read it
        return None
    return explain(error, why_off) if why_off and met_missing_cuda(error) else None

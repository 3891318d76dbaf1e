"""What devices this process really has, asked once (hot paths ask per call)."""

from __future__ import annotations

import functools


@functools.cache
def cuda_available() -> bool:
    """CUDA (or ROCm) devices are really present.

    Asked of torch's C extension, not of ``torch.cuda.is_available()``: torch_npu's
    ``transfer_to_npu`` replaces the ``torch.cuda`` functions with ``torch.npu``'s
    (torch_npu/contrib/transfer_to_npu.py ``_patch_cuda``, Ascend/pytorch master 9e73e708a), after
    which ``torch.cuda.is_available()`` answers for the NPUs.
    """
    import torch

    count = getattr(torch._C, "_cuda_getDeviceCount", None)  # absent from CPU-only builds
    if count is None or (torch.version.cuda is None and getattr(torch.version, "hip", None) is None):
        return False
    try:
        return count() > 0
    except RuntimeError:  # a CUDA build without a driver
        return False

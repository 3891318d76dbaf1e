"""The wrapper of ``Tensor.numpy`` (named by path in this package's patches): on bfloat16, which numpy
has no dtype for, a float32 array (one warning) instead of stock torch's TypeError."""

from __future__ import annotations

import warnings

from accel_npu._torch.once import FirstTime

_once = FirstTime()  # one warning per process


def tensor_numpy(wrapped, instance, args, kwargs):
    import torch

    if instance is None or instance.dtype is not torch.bfloat16:
        return wrapped(*args, **kwargs)
    if _once("numpy-bf16"):
        warnings.warn(
            "accel-npu: .numpy() on a bfloat16 tensor returns a float32 array (numpy has no "
            "bfloat16; stock torch raises TypeError: Got unsupported ScalarType BFloat16)",
            UserWarning,
            stacklevel=2,
        )
    return instance.float().numpy(*args, **kwargs)

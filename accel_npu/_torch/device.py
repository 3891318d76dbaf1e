"""What the process's torch sees of devices, asked once (hot paths ask per call)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    """torch.cuda.is_available(), asked once per process (autocast objects are built per forward)."""
    import torch

    return bool(torch.cuda.is_available())

"""accel-npu: unchanged CUDA-written Accelerate/DeepSpeed/diffusers training on Ascend NPU and CPU.

Importing this package changes nothing. Activation happens through the ``torch.backends``
entry point (inside ``import torch``), through ``import accel_npu.auto``, or explicitly
through :func:`patch`.
"""
from __future__ import annotations

import pluggy

__version__ = "0.1.0"

PROJECT_NAME = "accel_npu"

#: Decorator for hook implementations: ``@accel_npu.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


def patch() -> None:
    """Load plugins and arm every patch in the ledger (idempotent)."""
    from accel_npu import activation

    activation.activate(strict=True)


def unpatch() -> None:
    """Restore every patched object to the exact original and disarm the ledger."""
    from accel_npu import patching

    patching.get_ledger().unpatch_all()


def is_active() -> bool:
    """True when this process has been activated (and not unpatched since)."""
    from accel_npu import activation

    return activation.is_active()


__all__ = ["__version__", "hookimpl", "patch", "unpatch", "is_active"]

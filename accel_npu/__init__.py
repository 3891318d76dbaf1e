"""accel-npu: unchanged CUDA-written Accelerate/DeepSpeed/diffusers training on Ascend NPU and CPU.

Importing this package changes nothing. Activation happens through the ``torch.backends``
entry point (inside ``import torch``), through ``import accel_npu.auto``, or explicitly
through :func:`patch`.
"""
from __future__ import annotations

# Only the standard library at import time: torch imports this package inside `import torch`
# (the torch.backends entry point), before our own error handling can run.

__version__ = "0.1.0"

PROJECT_NAME = "accel_npu"


def __getattr__(name: str):
    if name == "hookimpl":
        import pluggy

        marker = pluggy.HookimplMarker(PROJECT_NAME)
        globals()["hookimpl"] = marker
        return marker
    raise AttributeError(f"module 'accel_npu' has no attribute {name!r}")


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

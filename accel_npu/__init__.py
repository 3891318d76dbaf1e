"""accel-npu: unchanged CUDA-written Accelerate/DeepSpeed/diffusers training on Ascend NPU and CPU.

Importing this package patches nothing (from a source checkout it only maps ``plugins/`` and
``launch_configs/`` as an install would, see :class:`_SourceCheckoutFinder`). Activation happens
through the ``torch.backends`` entry point (inside ``import torch``), through
``import accel_npu.auto``, or explicitly through :func:`patch`.
"""

from __future__ import annotations

# Only the standard library at import time: torch imports this package inside `import torch`
# (the torch.backends entry point), before our own error handling can run.
from accel_npu._version import __version__

#: Subpackages whose source sits at the repository root, beside accel_npu/ (setup.cfg package_dir).
SOURCE_CHECKOUT_PACKAGES = {"accel_npu.plugins": "plugins", "accel_npu.launch_configs": "launch_configs"}


class _SourceCheckoutFinder:
    """Serves ``accel_npu.plugins`` / ``accel_npu.launch_configs`` from a source checkout.

    Why: an installed accel-npu has them inside ``accel_npu/`` (setup.cfg maps the top-level
    ``plugins/`` and ``launch_configs/`` there), but when the repository root comes first on
    ``sys.path`` — ``python -c`` from the root, or accelerate's DeepSpeed launcher, which puts the
    working directory on every worker's PYTHONPATH — the source ``accel_npu/`` shadows the
    installed one and has no such subpackages. This finder applies the same mapping to the source
    tree, as setuptools' editable finder does, so one package is found however it is installed.
    """

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = SOURCE_CHECKOUT_PACKAGES.get(fullname)
        if folder is None:
            return None
        import importlib.util
        import os

        init = os.path.join(self.root, folder, "__init__.py")
        return importlib.util.spec_from_file_location(fullname, init) if os.path.isfile(init) else None


def _map_source_checkout() -> None:
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Only a checkout of this project: an installed copy has no setup.cfg beside it.
    if not (
        os.path.isfile(os.path.join(root, "setup.cfg")) and os.path.isfile(os.path.join(root, "plugins", "__init__.py"))
    ):
        return
    if any(isinstance(f, _SourceCheckoutFinder) for f in sys.meta_path):
        return
    # Before PathFinder, so an editable finder of some other checkout cannot pair this accel_npu
    # with that checkout's plugins.
    position = next(
        (i for i, f in enumerate(sys.meta_path) if getattr(f, "__name__", "") == "PathFinder"), len(sys.meta_path)
    )
    sys.meta_path.insert(position, _SourceCheckoutFinder(root))


_map_source_checkout()


def __getattr__(name: str):
    # `from accel_npu import hookimpl` (what third-party plugins write) without importing pluggy
    # inside every `import accel_npu`.
    if name == "hookimpl":
        from accel_npu.hookspecs import hookimpl

        globals()["hookimpl"] = hookimpl
        return hookimpl
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

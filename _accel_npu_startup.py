"""accel-npu's startup hook: ``accel_npu_startup.pth`` in site-packages imports this module when
Python starts. It explains a failed ``import torch_npu`` on every path, not only after accel-npu
has been activated.

Why: torch >= 2.5 runs every ``torch.backends`` entry point inside ``import torch`` in the order
the distributions are found (torch/__init__.py ``_import_device_backends``) and raises "Failed to
load the backend extension" at the first that fails. When torch_npu's entry point comes before
accel-npu's and CANN's environment is not set up, torch_npu's import fails before accel-npu has
put its import diagnostics (accel_npu.plugins.devices.npu.diagnostics) in front of it; and a
script that imports torch_npu before torch never runs accel-npu's entry point at all (torch_npu
switches autoload off while it imports torch).

Cost: at startup one object on ``sys.meta_path`` whose ``find_spec`` compares one name; nothing
is imported (os, sys and _thread are loaded already). accel-npu's own modules are imported only
when ``torch_npu`` is looked up *and found*, once. With ACCEL_NPU_DISABLE=1 nothing is installed.
Outside the ``accel_npu`` package on purpose: importing ``accel_npu`` at startup would fix which
copy of it a process uses before the script's directory is on ``sys.path``.
"""

import _thread
import os
import sys


def _disabled() -> bool:
    # The stdlib-only copy of accel_npu.environment.disabled() (tests/test_architecture.py allows
    # it): importing accel_npu.environment here would cost every Python process a few milliseconds.
    return os.environ.get("ACCEL_NPU_DISABLE", "0").strip().lower() in {"1", "true", "yes", "on"}


class ExplainTorchNpuImport:
    """A ``sys.meta_path`` entry for the name ``torch_npu`` only (None at once for every other name).

    The first time torch_npu is looked up and some finder finds it, it puts accel-npu's import
    diagnostics in front of that import (unless accel-npu or its npu plugin is switched off) and
    returns their spec: a failed load then raises NpuEnvironmentError, whose message names the
    cause and the fix. After that it is inert (the diagnostics' own finder, now first on
    ``sys.meta_path``, handles later imports); it stays on the list, since removing an entry while
    importlib walks the list would make the walk skip the next finder. Never raises.
    """

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._local = _thread._local()  # the lookups below ask the whole meta path again
        self.waiting = True

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_npu" or not self.waiting or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            return self._diagnosed_spec(fullname, path, target)
        except Exception:  # noqa: BLE001 - the import then goes on exactly as without accel-npu
            return None
        finally:
            self._local.busy = False

    def _diagnosed_spec(self, fullname, path, target):
        if not any(
            finder.find_spec(fullname, path, target) is not None
            for finder in list(sys.meta_path)
            if finder is not self and hasattr(finder, "find_spec")
        ):
            return None  # not installed (or not on sys.path yet): nothing to explain, keep waiting
        with self._lock:
            if not self.waiting:
                return None
            self.waiting = False
        from accel_npu import environment

        if environment.disabled() or environment.disabled_plugins() & {"npu", "*"}:
            return None
        from accel_npu.plugins.devices.npu.diagnostics import install_import_diagnostics

        return install_import_diagnostics().find_spec(fullname, path, target)

    def __repr__(self) -> str:
        state = "waiting for" if self.waiting else "done with"
        return f"<accel-npu startup hook: {state} the first import of torch_npu>"


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once per process), unless ACCEL_NPU_DISABLE=1."""
    if _disabled() or any(isinstance(f, ExplainTorchNpuImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, ExplainTorchNpuImport())


try:
    install()
except Exception:  # noqa: BLE001 - a startup hook must never stop Python from starting
    pass

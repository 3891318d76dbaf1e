"""mx_driving's patcher (ACCEL_NPU_MX_DRIVING=1): applied once, when torch_npu is imported or just
before the first library it must precede, whichever comes first."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading

from accel_npu.plugins.devices.npu.contract import MxDriving

log = logging.getLogger("accel_npu")

_lock = threading.RLock()
state: dict = {"status": "not requested"}
PENDING = "pending: applied when torch_npu is imported, or before the first of {} is"
#: libraries mx_driving's patcher must come before (DrivingSDK docs/zh/features/patcher.md: apply()
#: before any other import; TransformersNPU patches transformers' Qwen3 modules)
PRECEDES = ("transformers", "accelerate", "diffusers", "deepspeed", "peft", "mmcv", "mmdet", "mmdet3d", "mmengine")


def _torch_initializing() -> bool:
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is None or bool(getattr(spec, "_initializing", False))


def apply_mx_driving(_module=None) -> None:
    """Apply mx_driving's patcher once per process (ACCEL_NPU_MX_DRIVING=1). Never raises."""
    with _lock:  # re-entrant: the patcher imports torch_npu, whose post-import hook calls this again
        if not state["status"].startswith("pending"):
            return
        if _torch_initializing():
            # torch_npu is imported inside `import torch` (its autoload): mx_driving imports torch,
            # so wait for the first library the script imports after torch (_ApplyMxDrivingFirst).
            return
        state["status"] = "applying"
        try:
            api, patcher = MxDriving.apply_patcher()
        except Exception as exc:  # noqa: BLE001 - a patcher failure must not stop training
            state["status"] = f"failed: {type(exc).__name__}: {exc}"
            log.warning("accel-npu: mx_driving patcher not applied: %s", exc)
            return
        state.update(status=f"applied: {api}", patcher=patcher)
        log.info("accel-npu: mx_driving patcher applied (%s)", api)


class _AlreadyImported(importlib.abc.Loader):
    """Loader for a module the patcher imported while the script's own import of it was being
    looked up: hands back that module instead of running it a second time."""

    def __init__(self, module, spec):
        self._module, self._spec = module, spec

    def create_module(self, spec):
        return self._module

    def exec_module(self, module):
        module.__spec__ = self._spec  # the import system set ours; give the module its own back


class _ApplyMxDrivingFirst(importlib.abc.MetaPathFinder):
    """Applies the pending patcher just *before* the first of ``PRECEDES`` is imported."""

    _busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if (
            path is not None
            or fullname not in PRECEDES
            or getattr(self._busy, "on", False)
            or not state["status"].startswith("pending")
            or _torch_initializing()
        ):
            return None
        self._busy.on = True
        try:
            apply_mx_driving()
        finally:
            self._busy.on = False
        module = sys.modules.get(fullname)
        if module is None:
            return None
        # The patcher imported it (TransformersNPU imports transformers' Qwen3 modules). The import
        # system would now run it again from its own spec (importlib._bootstrap._find_spec returns
        # sys.modules[name].__spec__): give it a spec whose loader returns the loaded module.
        own = module.__spec__
        module.__spec__ = importlib.util.spec_from_loader(fullname, _AlreadyImported(module, own))
        return module.__spec__


_finder = _ApplyMxDrivingFirst()


def arm() -> None:
    """Apply the patcher when torch_npu is imported, or just before the first of :data:`PRECEDES` is."""
    import wrapt

    state["status"] = PENDING.format(", ".join(PRECEDES))
    wrapt.register_post_import_hook(apply_mx_driving, "torch_npu")
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)

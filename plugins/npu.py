"""The npu device backend (Ascend, torch_npu).

A thin layer: every call into torch_npu goes through :class:`TorchNpu`, and that list is the
contract written down in docs/npu-contract.md. Tests exercise it against a stand-in torch_npu
that only the tests install (tests/contract/).
"""
from __future__ import annotations

import importlib.util
import logging
import os

from accel_npu import hookimpl
from accel_npu.backend import Backend
from accel_npu.errors import LaunchError

log = logging.getLogger("accel_npu")


class TorchNpu:
    """The complete list of torch_npu calls accel-npu makes (docs/npu-contract.md)."""

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("torch_npu") is not None

    @staticmethod
    def module():
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

        return torch_npu

    @staticmethod
    def version() -> str:
        return getattr(TorchNpu.module(), "__version__", "unknown")

    @staticmethod
    def is_available() -> bool:
        import torch

        TorchNpu.module()
        return bool(torch.npu.is_available())

    @staticmethod
    def device_count() -> int:
        import torch

        TorchNpu.module()
        return int(torch.npu.device_count())

    @staticmethod
    def disallow_internal_format() -> None:
        import torch

        torch.npu.config.allow_internal_format = False


def visible_device_count(env) -> int:
    """Devices this process may use, honouring ASCEND_RT_VISIBLE_DEVICES."""
    count = TorchNpu.device_count()
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible:
        count = min(count, len([d for d in visible.split(",") if d.strip()])) if count else \
            len([d for d in visible.split(",") if d.strip()])
    return count


@hookimpl(tryfirst=True)
def accel_npu_select_backend(env):
    forced = env.get("ACCEL_NPU_BACKEND", "").strip().lower()
    if forced and forced != "npu":
        return None
    if not TorchNpu.installed():
        return None
    try:
        if not TorchNpu.is_available():
            return None
        count = visible_device_count(env)
    except Exception as exc:  # a broken torch_npu install is reported by `accel-npu env`
        log.warning("accel-npu: torch_npu is installed but unusable: %s", exc)
        return None
    return Backend(name="npu", device_type="npu", dist_backend="hccl", device_count=count,
                   ds_accelerator="npu", plugin="npu")


#: Ascend defaults for launched workers (field report 001, section 5.1); user values win.
NPU_LAUNCH_DEFAULTS = {
    "TASK_QUEUE_ENABLE": "2",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "CPU_AFFINITY_CONF": "1",
    "HCCL_CONNECT_TIMEOUT": "1200",
    "HCCL_EXEC_TIMEOUT": "1800",
}


@hookimpl
def accel_npu_launch_env(backend, env):
    if backend.name != "npu":
        return None
    return dict(NPU_LAUNCH_DEFAULTS, DS_ACCELERATOR="npu")


@hookimpl
def accel_npu_check_launch(backend, num_processes, env):
    # Pitfall 7.1: accelerate wraps extra ranks onto the same device; HCCL then fails much later.
    if backend.name == "npu" and backend.device_count and num_processes > backend.device_count:
        raise LaunchError(
            f"accel-npu: {num_processes} processes requested but only {backend.device_count} NPU(s) are "
            f"visible (ASCEND_RT_VISIBLE_DEVICES={env.get('ASCEND_RT_VISIBLE_DEVICES', '<unset>')}). "
            f"Use --num_processes {backend.device_count} (one process per NPU)."
        )


@hookimpl
def accel_npu_activate(backend_name):
    if backend_name not in (None, "npu") or not TorchNpu.installed():
        return
    import wrapt

    def _on_torch_npu(_module):
        # Field report 000: "Cannot create tensor with internal format" warnings; base format always.
        try:
            TorchNpu.disallow_internal_format()
        except Exception as exc:  # noqa: BLE001
            log.debug("accel-npu: allow_internal_format not set: %s", exc)

    wrapt.register_post_import_hook(_on_torch_npu, "torch_npu")


@hookimpl
def accel_npu_env_report(backend):
    if not TorchNpu.installed():
        return ("NPU", {"torch_npu": "not installed"})
    info = {}
    try:
        info["torch_npu"] = TorchNpu.version()
        info["devices"] = TorchNpu.device_count()
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    info["ASCEND_HOME_PATH"] = os.environ.get("ASCEND_HOME_PATH", "<unset>")
    info["ASCEND_RT_VISIBLE_DEVICES"] = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
    return ("NPU", info)

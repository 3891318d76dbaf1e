"""The NPU section of ``accel-npu env``: torch_npu and its pairing, CANN's libraries, devices, the
workers' HCCL timeouts and hang-diagnosis switches, mx_driving."""

from __future__ import annotations

import os

from accel_npu import environment
from accel_npu.plugins.devices.npu import mx_patcher
from accel_npu.plugins.devices.npu.contract import MxDriving, TorchNpu
from accel_npu.plugins.devices.npu.diagnostics import (
    NpuEnvironmentError,
    diagnose_import_error,
    library_status,
    pairing_problem,
)
from accel_npu.plugins.devices.npu.worker_env import NPU_LAUNCH_DEFAULTS, worker_defaults


def env_report() -> tuple[str, dict]:
    """The NPU section of ``accel-npu env``."""
    if not TorchNpu.installed():
        return ("NPU", {"torch_npu": "not installed"})
    info = {"torch_npu (installed)": TorchNpu.dist_version() or "unknown"}
    pairing = pairing_problem()
    info["torch/torch_npu pairing"] = f"PROBLEM: {pairing}" if pairing else "ok (same base version)"
    info.update(library_status(os.environ))
    try:
        info["torch_npu"] = TorchNpu.version()
        info["devices"] = TorchNpu.device_count()
    except Exception as exc:  # noqa: BLE001 - a broken torch_npu install is what the report shows
        info["import torch_npu"] = (
            f"PROBLEM: {exc if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc)}"
        )
    exec_timeout = os.environ.get("HCCL_EXEC_TIMEOUT", NPU_LAUNCH_DEFAULTS["HCCL_EXEC_TIMEOUT"])
    ds_minutes = os.environ.get("DEEPSPEED_TIMEOUT", NPU_LAUNCH_DEFAULTS["DEEPSPEED_TIMEOUT"])
    info["HCCL_EXEC_TIMEOUT (workers)"] = f"{exec_timeout} s (CANN's own default: 1836 s)"
    info["process-group timeout (DeepSpeed, DEEPSPEED_TIMEOUT)"] = f"{ds_minutes} min" + (
        ": torch_npu raises the watchdog to HCCL_EXEC_TIMEOUT + 1800 s" if ds_minutes.strip() == "30" else ""
    )
    workers = {**worker_defaults(os.environ), **os.environ}
    torch_npu_default = {"HCCL_ASYNC_ERROR_HANDLING": "1", "HCCL_DESYNC_DEBUG": "0"}
    info["hang diagnosis (workers)"] = ", ".join(
        f"{name}={workers[name]}"
        if name in workers
        else f"{name}=<unset> (torch_npu: {torch_npu_default.get(name, 'off')})"
        for name in (
            "HCCL_ASYNC_ERROR_HANDLING",
            "HCCL_DESYNC_DEBUG",
            "TORCH_HCCL_ENABLE_MONITORING",
            "TORCH_HCCL_TRACE_BUFFER_SIZE",
            "TORCH_HCCL_DUMP_ON_TIMEOUT",
        )
    )
    info["ASCEND_HOME_PATH"] = os.environ.get("ASCEND_HOME_PATH", "<unset>")
    info["ASCEND_RT_VISIBLE_DEVICES"] = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
    info["mx_driving"] = (
        "not installed"
        if not MxDriving.installed()
        else mx_patcher.state["status"]
        if environment.flag("ACCEL_NPU_MX_DRIVING")
        else "installed; patcher off (ACCEL_NPU_MX_DRIVING=1 enables it)"
    )
    return ("NPU", info)

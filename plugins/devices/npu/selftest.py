"""The NPU checks of ``accel-npu env --selftest``: CANN's libraries load, torch_npu imports, the SoC,
the visible devices, mx_driving's patcher."""

from __future__ import annotations

import os

from accel_npu import environment
from accel_npu.plugins.devices.npu import mx_patcher
from accel_npu.plugins.devices.npu.contract import MxDriving, TorchNpu
from accel_npu.plugins.devices.npu.diagnostics import NpuEnvironmentError, cann_set_env, diagnose_import_error
from accel_npu.plugins.devices.npu.selection import no_device_reason
from accel_npu.plugins.devices.npu.visibility import visible_devices

#: CANN libraries libtorch_npu.so links (torch_npu setup.py `cann_dependencies`, v7.2.0-pytorch2.7.1: the
#: runtime, collectives, op compiler, graph engine), and the driver's, which torch_npu opens to count devices
#: (torch_npu/npu/__init__.py `_raw_device_count_ascend_hal`)
CANN_LIBRARIES = ("libascendcl.so", "libhccl.so", "libacl_op_compiler.so", "libge_runner.so", "libascend_hal.so")


def _skipped(reason: str):
    from accel_npu.cli.selftest import CheckSkipped

    return CheckSkipped(reason)


def check_cann_libraries() -> str:
    import ctypes

    missing, first_error = [], None
    for name in CANN_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError as exc:
            missing.append(name)
            first_error = first_error or str(exc)
    if missing:
        driver = (
            " (libascend_hal.so is the NPU driver's: /usr/local/Ascend/driver/lib64/driver belongs on LD_LIBRARY_PATH)"
            if "libascend_hal.so" in missing
            else ""
        )
        raise OSError(
            f"cannot load {', '.join(missing)} ({first_error}). Fix: source {cann_set_env(os.environ)}{driver}"
        )
    return ", ".join(CANN_LIBRARIES) + " load"


def check_import_torch_npu() -> str:
    try:
        return f"torch_npu {TorchNpu.version()}"
    except (ImportError, OSError) as exc:
        raise ImportError(str(exc) if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc)) from exc


def check_soc() -> str:
    return f"CANN {TorchNpu.cann_version() or 'version unknown'}, SoC {TorchNpu.soc_name()}, bf16 " + (
        "supported"
        if TorchNpu.is_bf16_supported()
        else "NOT supported (autocast bf16 runs float32, AdamW uses foreach)"
    )


def check_visible_devices() -> str:
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    count = TorchNpu.device_count()
    if count == 0:
        raise RuntimeError(f"torch_npu sees no NPU: {no_device_reason(os.environ)}")
    listed = len([d for d in (visible or "").split(",") if d.strip()])
    if visible is not None and count != listed:
        seen = visible_devices(visible, TorchNpu.raw_device_count())
        raise RuntimeError(
            f"torch.npu.device_count() is {count} but ASCEND_RT_VISIBLE_DEVICES={visible} lists "
            f"{listed}: {seen.why or 'ids past the machine count are dropped'} "
            "(torch_npu/npu/__init__.py _device_count_ascend_hal)"
        )
    return f"torch.npu.device_count() = {count}" + (
        f" (ASCEND_RT_VISIBLE_DEVICES={visible})" if visible else " (ASCEND_RT_VISIBLE_DEVICES unset)"
    )


def check_mx_driving() -> str:
    if not environment.flag("ACCEL_NPU_MX_DRIVING"):
        raise _skipped("ACCEL_NPU_MX_DRIVING is not 1")
    if not MxDriving.installed():
        raise RuntimeError("ACCEL_NPU_MX_DRIVING=1 but mx_driving is not installed")
    mx_patcher.apply_mx_driving()
    status = mx_patcher.state["status"]
    if not status.startswith("applied"):
        raise RuntimeError(status)
    return status


#: (title, "module:function") of each check, as ``accel_npu_selftest_checks`` returns them
CHECKS = [
    ("CANN libraries", f"{__name__}:check_cann_libraries"),
    ("import torch_npu", f"{__name__}:check_import_torch_npu"),
    ("CANN / SoC / bf16", f"{__name__}:check_soc"),
    ("visible devices", f"{__name__}:check_visible_devices"),
    ("mx_driving", f"{__name__}:check_mx_driving"),
]

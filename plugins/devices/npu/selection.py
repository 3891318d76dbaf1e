"""Whether this machine runs the npu backend: torch_npu installed, loadable and seeing a device, and
why not where it is installed but unusable (a failed load, no device)."""

from __future__ import annotations

import glob
import logging
import os

from accel_npu import environment
from accel_npu.backend import Backend, record_unusable
from accel_npu.plugins.devices.npu.contract import TorchNpu
from accel_npu.plugins.devices.npu.diagnostics import NpuEnvironmentError, diagnose_import_error
from accel_npu.plugins.devices.npu.visibility import suggested_value, visible_devices

log = logging.getLogger("accel_npu")

#: why torch_npu is installed but unusable in this process (set by backend selection)
broken: str | None = None
#: why torch_npu loads but reports no usable NPU here (set by backend selection)
no_device: str | None = None


def no_device_reason(env) -> str:
    """Why torch_npu reports no usable NPU, naming the cause where this process can see it."""
    value = env.get("ASCEND_RT_VISIBLE_DEVICES")
    seen = visible_devices(value, -1)
    if value is not None and seen.count == 0:
        fix = suggested_value(value, -1)
        return f"ASCEND_RT_VISIBLE_DEVICES={value}: {seen.why} (torch_npu/npu/__init__.py _parse_visible_devices). " + (
            f"List the ids ascending: ASCEND_RT_VISIBLE_DEVICES={fix}" if fix else "Unset it or list device ids"
        )
    if not glob.glob("/dev/davinci[0-9]*"):
        return (
            "there are no /dev/davinci* device nodes: this container was started without the NPUs "
            "(docker run --device=/dev/davinci0 ... --device=/dev/davinci_manager --device=/dev/devmm_svm "
            "--device=/dev/hisi_hdc, or your cluster's NPU device plugin)"
        )
    if not os.path.isdir("/usr/local/Ascend/driver"):
        return "the Ascend driver is not installed (/usr/local/Ascend/driver is missing): install the NPU driver"
    return "torch.npu.is_available() is False (check `npu-smi info` and the driver/firmware versions)"


def select_backend(env) -> Backend | None:
    """The npu backend when torch_npu is installed and sees a device; else None, noting why torch_npu
    is unusable here (a failed load, no device) for the launch check and `accel-npu env`."""
    global broken, no_device
    forced = environment.forced_backend(env)
    if forced and forced != "npu":
        return None
    if not TorchNpu.installed():
        return None
    try:
        if not TorchNpu.is_available():
            no_device = no_device_reason(env)
            log.error("accel-npu: torch_npu is installed but no NPU is usable: %s", no_device)
            record_unusable("npu", f"torch_npu is installed but no NPU is usable: {no_device}")
            return None
        count = TorchNpu.device_count()
    except (ImportError, OSError) as exc:
        broken = str(exc) if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc, env)
        log.error("%s", broken)
        record_unusable("npu", broken)
        return None
    except Exception as exc:  # noqa: BLE001 - a broken torch_npu install is reported by `accel-npu env`
        log.warning("accel-npu: torch_npu is installed but unusable: %s", exc)
        return None
    return Backend(
        name="npu",
        device_type="npu",
        dist_backend="hccl",
        device_count=count,
        ds_accelerator="npu",
        plugin="devices.npu",
        device_name=TorchNpu.soc_name,
    )

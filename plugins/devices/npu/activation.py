"""What the npu plugin sets up when accel-npu activates in a process with torch_npu installed."""

from __future__ import annotations

import logging

from accel_npu import environment
from accel_npu.plugins.devices.npu import mx_patcher
from accel_npu.plugins.devices.npu.contract import MxDriving, TorchNpu
from accel_npu.plugins.devices.npu.diagnostics import install_import_diagnostics, pairing_problem

log = logging.getLogger("accel_npu")


def activate(backend_name) -> None:
    """At activation, where torch_npu is installed: its import diagnostics, a startup error for a
    mismatched torch/torch_npu pair, and mx_driving's patcher when asked for."""
    if backend_name not in (None, "npu") or not TorchNpu.installed():
        return
    install_import_diagnostics()
    # A mismatched pair is known from metadata alone: say so at startup, even when nothing imports
    # torch_npu directly (accelerate's is_npu_available() swallows the import error and trains on CPU).
    problem = pairing_problem()
    if problem:
        log.error("accel-npu: %s", problem)

    # allow_internal_format is left alone: "disable" is torch_npu's own default, and that setting is
    # what prints torch_npu's one-time "Cannot create tensor with internal format" notice
    # (csrc/aten/common/TensorFactories.cpp TORCH_WARN_ONCE): setting it again cannot silence it.
    if environment.flag("ACCEL_NPU_MX_DRIVING") and MxDriving.installed():
        mx_patcher.arm()

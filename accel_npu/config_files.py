"""The files `accel-npu config` writes beside an accelerate config (read by the launch plugin too).

``<stem>.yaml`` (accelerate) + ``<stem>.deepspeed.json`` + ``<stem>.accel-npu.yaml`` (the
sidecar: ``env:`` variables for the training processes).
"""

from __future__ import annotations

import os

DEEPSPEED_SUFFIX = ".deepspeed.json"
SIDECAR_SUFFIX = ".accel-npu.yaml"


def sidecar_for(config_file: str) -> str:
    """``launch_configs/cpu_zero3.yaml`` -> ``launch_configs/cpu_zero3.accel-npu.yaml``."""
    base, _ext = os.path.splitext(os.fspath(config_file))
    return base + SIDECAR_SUFFIX

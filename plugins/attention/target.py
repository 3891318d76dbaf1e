"""Where a CUDA attention flag has to land here, and the one log line per process that says so."""

from __future__ import annotations

import logging

from accel_npu._torch.device import cuda_available
from accel_npu._torch.once import FirstTime

log = logging.getLogger("accel_npu")

_once = FirstTime()


def attention_device() -> str | None:
    """ "npu" or "cpu" where xformers / flash_attn cannot run (no CUDA), None where nothing changes
    (CUDA is really present, or the backend is forced to cuda without it)."""
    if cuda_available():
        return None
    from accel_npu.backend import current_backend

    device_type = current_backend().device_type
    return device_type if device_type in ("npu", "cpu") else None


def log_once(key, message: str, *args) -> None:
    if _once(key):
        log.warning(message, *args)

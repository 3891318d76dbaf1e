"""The wrapper of ``torch.distributed``'s ``Backend`` (named by path in this package's patches): a
process group asked for "nccl" without CUDA runs the active backend (hccl on npu, gloo on cpu)."""

from __future__ import annotations

import logging

from accel_npu._torch.once import FirstTime
from accel_npu.patching import argument, with_argument
from accel_npu.plugins.cuda_compat import facade

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and backend


def backend_new(wrapped, instance, args, kwargs):
    # Backend.__new__(cls, name): a staticmethod, so the wrapper sees cls as its first argument
    name = argument(args, kwargs, 1, "name")
    if isinstance(name, str) and "nccl" in name.lower() and facade.target() is not None:
        from accel_npu.backend import current_backend

        backend = current_backend().dist_backend
        if _once(("nccl", backend)):
            log.warning("accel-npu: process-group backend %r runs as %r (no CUDA here)", name, backend)
        # "cuda:nccl,cpu:gloo" and plain "nccl" alike: one backend for the active device
        args, kwargs = with_argument(args, kwargs, 1, "name", backend)
    return wrapped(*args, **kwargs)

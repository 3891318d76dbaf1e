"""The wrapper of ``torch.distributed``'s ``Backend`` (named by path in this package's patches): a
process group asked for "nccl" without CUDA runs the active backend (hccl on npu, gloo on cpu)."""

from __future__ import annotations

import logging

from accel_npu._torch.once import FirstTime
from accel_npu.plugins.cuda_compat import facade

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and backend


def backend_new(wrapped, instance, args, kwargs):
    name = args[1] if len(args) > 1 else kwargs.get("name")
    if isinstance(name, str) and "nccl" in name.lower() and facade.target() is not None:
        from accel_npu.backend import current_backend

        backend = current_backend().dist_backend
        if _once(("nccl", backend)):
            log.warning("accel-npu: process-group backend %r runs as %r (no CUDA here)", name, backend)
        # "cuda:nccl,cpu:gloo" and plain "nccl" alike: one backend for the active device
        args = (args[0], backend, *args[2:]) if len(args) > 1 else args
        kwargs = {**kwargs, "name": backend} if "name" in kwargs else kwargs
    return wrapped(*args, **kwargs)

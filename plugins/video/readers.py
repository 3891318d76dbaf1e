"""Wrappers of decord's readers' ``__init__`` (named by path in this package's patches, one per class):
a GPU ``ctx`` becomes ``decord.cpu(0)`` where CUDA is absent."""

from __future__ import annotations

import logging

from accel_npu._torch.device import cuda_available
from accel_npu._torch.once import FirstTime
from accel_npu.patching import argument, passed, with_argument

log = logging.getLogger("accel_npu")

_KDLGPU = 2  # DLPack device type of decord.gpu(i)
_once = FirstTime()  # one warning per process and decord call


def _cpu_ctx_for(ctx, what: str):
    if isinstance(ctx, (list, tuple)):  # VideoLoader takes a list of contexts
        return type(ctx)(_cpu_ctx_for(c, what) for c in ctx)
    if getattr(ctx, "device_type", None) != _KDLGPU or cuda_available():
        return ctx
    import decord

    if _once(what):
        log.warning(
            "accel-npu: decord.%s(ctx=%r) decodes on decord.cpu(0): no CUDA here (decord has no NPU decoder)", what, ctx
        )
    return decord.cpu(0)


def _with_ctx(position: int, what: str):
    """A wrapper that swaps a GPU ``ctx`` (positional index ``position`` after self, or keyword)."""

    def wrapper(wrapped, instance, args, kwargs):
        if passed(args, kwargs, position, "ctx"):
            ctx = _cpu_ctx_for(argument(args, kwargs, position, "ctx"), what)
            args, kwargs = with_argument(args, kwargs, position, "ctx", ctx)
        return wrapped(*args, **kwargs)

    return wrapper


# one wrapper per reader, named <its module>_init
video_reader_init = _with_ctx(1, "VideoReader")
video_loader_init = _with_ctx(1, "VideoLoader")
av_reader_init = _with_ctx(1, "AVReader")

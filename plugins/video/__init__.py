"""decord without CUDA.

``decord.VideoReader(path, ctx=decord.gpu(i))`` (also ``VideoLoader`` and ``AVReader``) needs a
CUDA build of decord and a GPU; on an NPU or CPU machine it fails in the first dataloader step
with "CUDA not enabled. Requested context GPU(i)". When CUDA is absent the reader decodes on
``decord.cpu(0)`` instead (logged once). Where CUDA is available nothing changes.
"""
from __future__ import annotations

import logging

from accel_npu._torch.device import cuda_available
from accel_npu._torch.once import FirstTime
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument, passed, with_argument

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
        log.warning("accel-npu: decord.%s(ctx=%r) decodes on decord.cpu(0): no CUDA here (decord has no "
                    "NPU decoder)", what, ctx)
    return decord.cpu(0)


def _with_ctx(position: int, what: str):
    """A wrapper that swaps a GPU ``ctx`` (positional index ``position`` after self, or keyword)."""

    def wrapper(wrapped, instance, args, kwargs):
        if passed(args, kwargs, position, "ctx"):
            ctx = _cpu_ctx_for(argument(args, kwargs, position, "ctx"), what)
            args, kwargs = with_argument(args, kwargs, position, "ctx", ctx)
        return wrapped(*args, **kwargs)

    return wrapper


_REASON = ("decord.{0}(..., ctx=decord.gpu(i)) fails without CUDA ('CUDA not enabled. Requested context "
           "GPU(i)'); decodes on decord.cpu(0) instead.")

def _ctx_patch(module: str, cls: str) -> Patch:
    return Patch(
        target=f"decord.{module}:{cls}.__init__",
        supports="decord>=0.6,<0.7",
        reason=_REASON.format(cls),
        remove_when="decord gains an NPU decoder, or the scripts stop hard-coding decord.gpu()",
        wrapper=_with_ctx(1, cls),
    )


VIDEO_READER = _ctx_patch("video_reader", "VideoReader")
VIDEO_LOADER = _ctx_patch("video_loader", "VideoLoader")
AV_READER = _ctx_patch("av_reader", "AVReader")


@hookimpl
def accel_npu_register_patches():
    return [VIDEO_READER, VIDEO_LOADER, AV_READER]

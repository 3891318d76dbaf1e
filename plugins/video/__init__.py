"""decord without CUDA.

``decord.VideoReader(path, ctx=decord.gpu(i))`` (also ``VideoLoader`` and ``AVReader``) needs a
CUDA build of decord and a GPU; on an NPU or CPU machine it fails in the first dataloader step
with "CUDA not enabled. Requested context GPU(i)". When CUDA is absent the reader decodes on
``decord.cpu(0)`` instead (logged once). Where CUDA is available nothing changes.

This module declares the patches; ``readers.py`` holds the wrappers.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

_REASON = (
    "decord.{0}(..., ctx=decord.gpu(i)) fails without CUDA ('CUDA not enabled. Requested context "
    "GPU(i)'); decodes on decord.cpu(0) instead."
)


def _ctx_patch(module: str, cls: str) -> Patch:
    return Patch(
        target=f"decord.{module}:{cls}.__init__",
        supports="decord==0.6.0",
        reason=_REASON.format(cls),
        remove_when="decord gains an NPU decoder, or the scripts stop hard-coding decord.gpu()",
        wrapper=f".readers:{module}_init",
    )


VIDEO_READER = _ctx_patch("video_reader", "VideoReader")
VIDEO_LOADER = _ctx_patch("video_loader", "VideoLoader")
AV_READER = _ctx_patch("av_reader", "AVReader")


@hookimpl
def accel_npu_register_patches():
    return [VIDEO_READER, VIDEO_LOADER, AV_READER]

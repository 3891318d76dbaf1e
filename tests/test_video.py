"""decord readers given decord.gpu(i) decode on the CPU when CUDA is
absent. Real decord 0.6.0 on a tiny uncompressed AVI this test writes (no encoder needed)."""

from __future__ import annotations

import logging
import sys

import decord  # a test dependency: its absence is a failure, not a skip
import numpy as np
import pytest

import accel_npu
from accel_npu.plugins.video import readers
from tests.inprocess import stock
from tests.launch_utils import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from tiny_video import write_raw_avi


def make_frames(n=6):
    frames = []
    for i in range(n):
        f = np.zeros((16, 32, 3), np.uint8)
        f[..., 0], f[..., 1], f[:8, :, 2] = 40 * i, 7, 200
        frames.append(f)
    return frames


@pytest.fixture
def clip(tmp_path):
    frames = make_frames()
    return write_raw_avi(tmp_path / "clip.avi", frames), frames


@pytest.fixture(autouse=True)
def active():
    from accel_npu._torch.device import cuda_available

    assert not cuda_available()  # no real CUDA here (torch.cuda answers for the cpu backend under accel-npu)
    accel_npu.patch()
    readers._once.clear()
    yield
    accel_npu.patch()


def test_video_reader_gpu_ctx_decodes_on_cpu(clip, caplog):
    path, frames = clip
    with stock(), pytest.raises(decord.DECORDError, match=r"CUDA not enabled. Requested context GPU\(0\)"):
        decord.VideoReader(path, ctx=decord.gpu(0))
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        vr = decord.VideoReader(path, ctx=decord.gpu(0))
        vr2 = decord.VideoReader(path, decord.gpu(1))  # positional ctx too
    assert len(vr) == len(vr2) == 6
    assert np.array_equal(vr[3].asnumpy(), frames[3])
    assert np.array_equal(vr.get_batch([0, 5]).asnumpy(), np.stack([frames[0], frames[5]]))
    remaps = [r.getMessage() for r in caplog.records if "decodes on decord.cpu(0)" in r.getMessage()]
    assert len(remaps) == 1  # logged once


def test_video_loader_gpu_ctx_list(clip):
    path, frames = clip
    kwargs = dict(shape=(2, 16, 32, 3), interval=0, skip=0, shuffle=0)
    with stock(), pytest.raises(decord.DECORDError, match="CUDA not enabled"):
        decord.VideoLoader([path], ctx=[decord.gpu(0)], **kwargs)
    loader = decord.VideoLoader([path], ctx=[decord.gpu(0)], **kwargs)
    batch, _ = loader.next()
    assert np.array_equal(batch.asnumpy(), np.stack(frames[:2]))


def test_av_reader_gpu_ctx_decodes_video_and_audio_on_cpu(tmp_path):
    frames = make_frames()
    t = np.arange(6 * 800) / 8000
    audio = (3000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    path = write_raw_avi(tmp_path / "av.avi", frames, audio=audio)
    with stock(), pytest.raises(decord.DECORDError, match="Device API gpu is not enabled"):
        decord.AVReader(path, ctx=decord.gpu(0), sample_rate=8000)
    reader = decord.AVReader(path, ctx=decord.gpu(0), sample_rate=8000)
    samples, video_frames = reader[0:2]
    assert np.array_equal(video_frames.asnumpy(), np.stack(frames[:2]))
    assert np.array_equal(samples[0].asnumpy().ravel(), audio[:800] / 32768)


def test_cpu_ctx_and_cuda_machines_untouched(clip, monkeypatch):
    path, _ = clip
    ctx = decord.cpu(0)
    assert readers._cpu_ctx_for(ctx, "VideoReader") is ctx
    monkeypatch.setattr(
        readers, "cuda_available", lambda: True
    )  # a CUDA machine: the GPU context is passed on as given
    gpu = decord.gpu(0)
    assert readers._cpu_ctx_for(gpu, "VideoReader") is gpu

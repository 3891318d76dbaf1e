"""Issue 3 item 8 (pitfall 7.11): decord readers given decord.gpu(i) decode on the CPU when CUDA is
absent. Real decord 0.6.0 on a tiny uncompressed AVI this test writes (no encoder needed)."""
from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

import decord  # noqa: E402  (a test dependency: its absence is a failure, not a skip)

import accel_npu  # noqa: E402
from tests.inprocess import stock  # noqa: E402
from accel_npu.plugins import video  # noqa: E402


def write_raw_avi(path, frames, fps=10):
    """Uncompressed AVI (BI_RGB: bottom-up BGR24 rows), decodable bit-exactly by decord's ffmpeg."""
    h, w = frames[0].shape[:2]
    assert (w * 3) % 4 == 0, "rows must be 4-byte aligned"
    raw = [np.ascontiguousarray(f[::-1, :, ::-1]).tobytes() for f in frames]
    size = w * h * 3

    def chunk(fourcc, data):
        return fourcc + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")

    def lst(kind, data):
        return b"LIST" + struct.pack("<I", len(data) + 4) + kind + data

    n = len(frames)
    avih = struct.pack("<14I", int(1e6 / fps), size * fps, 0, 0x10, n, 0, 1, size, w, h, 0, 0, 0, 0)
    strh = b"vids" + b"\0\0\0\0" + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 1, fps, 0, n, size, -1, 0, 0, 0, w, h)
    strf = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, size, 0, 0, 0, 0)
    hdrl = lst(b"hdrl", chunk(b"avih", avih) + lst(b"strl", chunk(b"strh", strh) + chunk(b"strf", strf)))
    movi, idx = b"", b""
    for r in raw:
        idx += b"00db" + struct.pack("<III", 0x10, 4 + len(movi), len(r))
        movi += chunk(b"00db", r)
    body = b"AVI " + hdrl + lst(b"movi", movi) + chunk(b"idx1", idx)
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return str(path)


def write_av_avi(path, frames, audio, fps=10, rate=8000):
    """Uncompressed AVI with a BGR24 video stream and a mono 16-bit PCM audio stream."""
    h, w = frames[0].shape[:2]
    raw = [np.ascontiguousarray(f[::-1, :, ::-1]).tobytes() for f in frames]
    size = w * h * 3
    def chunk(fourcc, data):
        return fourcc + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")
    def lst(kind, data):
        return b"LIST" + struct.pack("<I", len(data) + 4) + kind + data
    n = len(frames)
    per_frame = rate // fps
    pcm = [audio[i * per_frame:(i + 1) * per_frame].astype("<i2").tobytes() for i in range(n)]
    avih = struct.pack("<14I", int(1e6 / fps), size * fps, 0, 0x10, n, 0, 2, size, w, h, 0, 0, 0, 0)
    vstrh = b"vids" + b"\0\0\0\0" + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 1, fps, 0, n, size, -1, 0, 0, 0, w, h)
    vstrf = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, size, 0, 0, 0, 0)
    astrh = b"auds" + b"\0\0\0\0" + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 2, 2 * rate, 0, n * per_frame, 2 * per_frame, -1, 2, 0, 0, 0, 0)
    astrf = struct.pack("<HHIIHH", 1, 1, rate, 2 * rate, 2, 16)
    hdrl = lst(b"hdrl", chunk(b"avih", avih) + lst(b"strl", chunk(b"strh", vstrh) + chunk(b"strf", vstrf))
               + lst(b"strl", chunk(b"strh", astrh) + chunk(b"strf", astrf)))
    movi, idx = b"", b""
    for r, a in zip(raw, pcm):
        idx += b"00db" + struct.pack("<III", 0x10, 4 + len(movi), len(r)); movi += chunk(b"00db", r)
        idx += b"01wb" + struct.pack("<III", 0x10, 4 + len(movi), len(a)); movi += chunk(b"01wb", a)
    body = b"AVI " + hdrl + lst(b"movi", movi) + chunk(b"idx1", idx)
    open(path, "wb").write(b"RIFF" + struct.pack("<I", len(body)) + body)


@pytest.fixture
def clip(tmp_path):
    frames = []
    for i in range(6):
        f = np.zeros((16, 32, 3), np.uint8)
        f[..., 0], f[..., 1], f[:8, :, 2] = 40 * i, 7, 200
        frames.append(f)
    return write_raw_avi(tmp_path / "clip.avi", frames), frames


@pytest.fixture(autouse=True)
def active():
    import torch

    assert not torch.cuda.is_available()
    accel_npu.patch()
    video._logged.clear()
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
    frames = []
    for i in range(6):
        f = np.zeros((16, 32, 3), np.uint8)
        f[..., 0], f[..., 1], f[:8, :, 2] = 40 * i, 7, 200
        frames.append(f)
    t = np.arange(6 * 800) / 8000
    audio = (3000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
    path = str(tmp_path / "av.avi")
    write_av_avi(path, frames, audio)
    with stock(), pytest.raises(decord.DECORDError, match="Device API gpu is not enabled"):
        decord.AVReader(path, ctx=decord.gpu(0), sample_rate=8000)
    reader = decord.AVReader(path, ctx=decord.gpu(0), sample_rate=8000)
    samples, video_frames = reader[0:2]
    assert np.array_equal(video_frames.asnumpy(), np.stack(frames[:2]))
    assert np.array_equal(samples[0].asnumpy().ravel(), audio[:800] / 32768)


def test_cpu_ctx_and_cuda_machines_untouched(clip, monkeypatch):
    path, _ = clip
    ctx = decord.cpu(0)
    assert video._cpu_ctx_for(ctx, "VideoReader") is ctx
    monkeypatch.setattr(video, "cuda_available", lambda: True)  # a CUDA machine: the GPU context is passed on as given
    gpu = decord.gpu(0)
    assert video._cpu_ctx_for(gpu, "VideoReader") is gpu

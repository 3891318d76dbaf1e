"""Tiny uncompressed AVI videos that decord (0.6.0, ffmpeg inside) decodes bit-exactly: no encoder needed.
Never imports accel_npu."""

from __future__ import annotations

import struct

import numpy as np


def write_raw_avi(path, frames, fps=10, audio=None, rate=8000):
    """Uncompressed AVI (BI_RGB: bottom-up BGR24 rows), decodable bit-exactly by decord's ffmpeg;
    with ``audio`` (int16 samples) also a mono 16-bit PCM stream at ``rate``, interleaved per frame."""
    h, w = frames[0].shape[:2]
    assert (w * 3) % 4 == 0, "rows must be 4-byte aligned"
    raw = [np.ascontiguousarray(f[::-1, :, ::-1]).tobytes() for f in frames]
    size = w * h * 3

    def chunk(fourcc, data):
        return fourcc + struct.pack("<I", len(data)) + data + (b"\0" if len(data) % 2 else b"")

    def lst(kind, data):
        return b"LIST" + struct.pack("<I", len(data) + 4) + kind + data

    n = len(frames)
    per_frame = rate // fps
    pcm = (
        [] if audio is None else [audio[i * per_frame : (i + 1) * per_frame].astype("<i2").tobytes() for i in range(n)]
    )
    streams = 1 if audio is None else 2
    avih = struct.pack("<14I", int(1e6 / fps), size * fps, 0, 0x10, n, 0, streams, size, w, h, 0, 0, 0, 0)
    strh = b"vids" + b"\0\0\0\0" + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 1, fps, 0, n, size, -1, 0, 0, 0, w, h)
    strf = struct.pack("<IiiHHIIiiII", 40, w, h, 1, 24, 0, size, 0, 0, 0, 0)
    strls = lst(b"strl", chunk(b"strh", strh) + chunk(b"strf", strf))
    if audio is not None:
        astrh = (
            b"auds"
            + b"\0\0\0\0"
            + struct.pack("<IHHIIIIIIiI4h", 0, 0, 0, 0, 2, 2 * rate, 0, n * per_frame, 2 * per_frame, -1, 2, 0, 0, 0, 0)
        )
        astrf = struct.pack("<HHIIHH", 1, 1, rate, 2 * rate, 2, 16)  # PCM, mono, 16 bit
        strls += lst(b"strl", chunk(b"strh", astrh) + chunk(b"strf", astrf))
    hdrl = lst(b"hdrl", chunk(b"avih", avih) + strls)
    movi, idx = b"", b""
    for i, r in enumerate(raw):
        for fourcc, data in [(b"00db", r)] + ([(b"01wb", pcm[i])] if pcm else []):
            idx += fourcc + struct.pack("<III", 0x10, 4 + len(movi), len(data))
            movi += chunk(fourcc, data)
    body = b"AVI " + hdrl + lst(b"movi", movi) + chunk(b"idx1", idx)
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return str(path)

"""safetensors files: headers, indexes, byte sizes, and a writer that streams tensor by tensor.

One reader of shard indexes (:func:`read_index`), one table of dtype sizes (:data:`DTYPE_BYTES`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from accel_npu.errors import CheckpointError, LoadError

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
TRANSFORMERS_INDEX = "model.safetensors.index.json"

#: bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "C64": 8,
}
#: torch dtype name -> safetensors dtype
SAFETENSORS_DTYPE = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def read_index(path: str) -> dict:
    """A shard index (``*.safetensors.index.json``): ``{"weight_map": {key: file}, ...}``.

    Raises OSError / ValueError / KeyError / TypeError for a missing or malformed index.
    """
    with open(path) as f:
        index = json.load(f)
    index["weight_map"] = dict(index["weight_map"])
    return index


def weight_files(directory: str) -> list[str]:
    """The safetensors files of a model directory: those its index names, else every ``*.safetensors``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for index in (TRANSFORMERS_INDEX, DIFFUSERS_INDEX):
        if index in names:
            files = sorted(set(read_index(os.path.join(directory, index))["weight_map"].values()))
            return [os.path.join(directory, n) for n in files]
    return [os.path.join(directory, n) for n in sorted(names) if n.endswith(".safetensors")]


@dataclass
class Checkpoint:
    """A local safetensors checkpoint: which file holds which key (header-level, nothing read)."""

    folder: str
    index_file: str | None
    weight_map: dict[str, str]  # key -> file name (relative to folder)
    headers: dict[str, dict[str, tuple]] = field(default_factory=dict)  # file -> key -> (dtype, shape)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)


def _read_header(path: str) -> dict[str, tuple]:
    """{key: (dtype, shape, first byte, end byte)} of one safetensors file, checked against its size."""
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"file is {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 1024 * 1024):
                raise ValueError(f"header length {n} does not fit the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise LoadError(
            f"accel-npu: {path} is not a readable safetensors file ({exc}). Re-download or re-save this shard."
        ) from exc
    out = {}
    data_len = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise LoadError(f"accel-npu: {path}: header entry for key {key!r} is malformed") from exc
        if end > data_len or begin > end:
            raise LoadError(
                f"accel-npu: {path} is truncated or corrupt: key {key!r} needs bytes {begin}..{end} of the "
                f"data section but the file holds only {data_len}. Re-download or re-save this shard."
            )
        # dtype, shape, and the tensor's byte range in the file (for readahead)
        out[key] = (info.get("dtype"), tuple(info.get("shape", ())), 8 + n + begin, 8 + n + end)
    return out


def open_checkpoint(folder: str) -> Checkpoint | None:
    """The local safetensors checkpoint in ``folder``, or None when it is not one we handle."""
    index_path = os.path.join(folder, DIFFUSERS_INDEX)
    if os.path.isfile(index_path):
        try:
            weight_map = read_index(index_path)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"accel-npu: {index_path} is not a valid checkpoint index ({exc}).") from exc
        return Checkpoint(folder, index_path, weight_map)
    single = os.path.join(folder, DIFFUSERS_WEIGHTS)
    if os.path.isfile(single):
        header = _read_header(single)
        return Checkpoint(folder, None, {k: DIFFUSERS_WEIGHTS for k in header}, {DIFFUSERS_WEIGHTS: header})
    return None


def validate(ckpt: Checkpoint, keys: list[str]) -> list[str]:
    """Check that every key is where the index says, in a readable file; returns the files needed."""
    needed = sorted({ckpt.weight_map[k] for k in keys})
    for name in needed:
        path = ckpt.path(name)
        if not os.path.isfile(path):
            example = next(k for k in keys if ckpt.weight_map[k] == name)
            raise LoadError(
                f"accel-npu: shard {path} named in {ckpt.index_file} is missing (it should hold {example!r} "
                f"and {sum(1 for k in keys if ckpt.weight_map[k] == name) - 1} other needed tensor(s)). "
                "Download the complete checkpoint."
            )
        if name not in ckpt.headers:
            ckpt.headers[name] = _read_header(path)
    for k in keys:
        name = ckpt.weight_map[k]
        if k not in ckpt.headers[name]:
            raise LoadError(
                f"accel-npu: {ckpt.index_file or ckpt.folder} says key {k!r} is in {ckpt.path(name)}, but that "
                "shard has no such tensor. The index and the shards do not belong together: re-download "
                "or re-save the checkpoint."
            )
    return needed


def nbytes_of(ckpt: Checkpoint, keys) -> int:
    total = 0
    for k in keys:
        dtype, shape = ckpt.headers[ckpt.weight_map[k]][k][:2]
        n = 1
        for s in shape:
            n *= s
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


# safetensors written tensor by tensor (safetensors' save_file first serializes the whole shard
# into one bytes object: +1 shard of memory)
class SafetensorsStream:
    """Write a .safetensors file whose header is known up front, one tensor at a time, in order."""

    def __init__(self, path: str, specs: list[tuple[str, Any, tuple]], metadata: dict | None = None):
        import struct

        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            st_dtype = SAFETENSORS_DTYPE[str(dtype).replace("torch.", "")]
            numel = 1
            for dim in shape:
                numel *= int(dim)
            nbytes = numel * DTYPE_BYTES[st_dtype]
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0
        self.total = offset

    def write(self, name: str, tensor) -> None:
        import torch

        expected, dtype, shape, nbytes = self._order[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"internal: wrote {name} {tensor.dtype} {tuple(tensor.shape)}, expected {expected} {dtype} {shape}"
            )
        t = tensor.detach().cpu().contiguous().reshape(-1)
        if nbytes:
            self._f.write(t.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            self._f.close()
            raise CheckpointError(f"internal: {len(self._order) - self._next} tensors were not written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

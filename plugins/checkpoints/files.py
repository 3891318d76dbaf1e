"""Checkpoint files: names, the hidden sibling a save writes into, durable writes, shard plans."""

from __future__ import annotations

import json
import os

from accel_npu._torch.packing import pack_by_budget

MANIFEST = "accel_npu_checkpoint.json"
COMPONENTS_DIR = "accel_npu_components"
PARTIAL_SUFFIX = ".accel-npu-partial"
OLD_SUFFIX = ".accel-npu-old"


def partial_dir(final: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{PARTIAL_SUFFIX}")


def old_dir(final: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{OLD_SUFFIX}")


def is_our_temp(name: str) -> bool:
    return name.startswith(".") and (name.endswith(PARTIAL_SUFFIX) or name.endswith(OLD_SUFFIX))


def fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (its entries); best effort, as some filesystems refuse."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plan_shards(entries: dict, limit: int, nbytes) -> list[list[str]]:
    """Keys packed in order into shards of at most ``limit`` bytes (a larger tensor gets its own).

    A tensor seen under several keys (tied weights) is planned once, under its first key, as
    safetensors requires; from_pretrained re-ties it.
    """
    seen: set[int] = set()
    unique = []
    for key, value in entries.items():
        if id(value) not in seen:
            seen.add(id(value))
            unique.append(key)
    return pack_by_budget(unique, lambda key: nbytes(entries[key]), limit) or [[]]

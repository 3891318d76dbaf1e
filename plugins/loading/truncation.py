"""Truncation before reading: how many repeated blocks a load builds (``num_layers=2``,
``ACCEL_NPU_TRUNCATE=Class:2``), and the one-line summaries of what was skipped."""

from __future__ import annotations

from accel_npu import environment
from accel_npu.errors import ConfigError

#: config keys that set the number of repeated blocks, in lookup order
DEPTH_KEYS = ("num_layers", "num_hidden_layers", "n_layer", "num_blocks", "depth")


def truncation_map(raw: str | None = None) -> dict[str, int]:
    """``ACCEL_NPU_TRUNCATE`` parsed: ``{"QwenImageTransformer2DModel": 2, ...}``."""
    raw = environment.get("ACCEL_NPU_TRUNCATE") if raw is None else raw
    out: dict[str, int] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, layers = item.partition(":")
        try:
            n = int(layers)
        except ValueError:
            n = -1
        if not sep or not name.strip() or n < 1:
            raise ConfigError(
                f"accel-npu: ACCEL_NPU_TRUNCATE={raw!r}: {item!r} is not 'ClassName:layers' with layers >= 1 "
                "(example: ACCEL_NPU_TRUNCATE=QwenImageTransformer2DModel:2)"
            )
        out[name.strip()] = n
    return out


def truncation_for(cls) -> int | None:
    """Layers ACCEL_NPU_TRUNCATE asks for this class (matched on the class or one of its bases)."""
    wanted = truncation_map()
    if not wanted:
        return None
    for klass in getattr(cls, "__mro__", (cls,)):
        if klass.__name__ in wanted:
            return wanted[klass.__name__]
    return None


def depth_key(config: dict) -> str | None:
    return next((k for k in DEPTH_KEYS if isinstance(config.get(k), int)), None)


def short_list(keys, n=8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def layer_indices(keys) -> list[int]:
    """The first numeric path component of each key (``transformer_blocks.7.attn...`` -> 7)."""
    found = set()
    for k in keys:  # every skipped key of a load: string methods, no regex
        for part in k.split(".")[:-1]:
            if part.isdecimal():
                found.add(int(part))
                break
    return sorted(found)


def ranges(nums: list[int]) -> str:
    if not nums:
        return ""
    out, start, prev = [], nums[0], nums[0]
    for n in nums[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
        if n is not None:
            start = prev = n
    return ",".join(out)

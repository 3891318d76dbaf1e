"""What a DeepSpeed config and an accelerate config say about mixed precision (pure; unit-tested).

The DeepSpeed file decides; a real contradiction (fp16 in one, bf16 in the other, both explicit)
is one ConfigError naming both.
"""

from __future__ import annotations

from accel_npu.environment import truthy
from accel_npu.errors import ConfigError

_PRECISIONS = ("fp16", "bf16")


def _enabled(block) -> bool | None:
    """True/False when a DeepSpeed precision block says so explicitly, None for absent/"auto"."""
    if not isinstance(block, dict) or "enabled" not in block:
        return None
    value = block["enabled"]
    if isinstance(value, str):
        low = value.strip().lower()
        if low == "auto":
            return None
        return truthy(low)
    return bool(value)


def file_precision(ds_config: dict) -> str | None:
    """What a DeepSpeed config says about precision: "bf16", "fp16", "no", or None (auto/unset).

    "no" only when every precision block present is explicitly disabled (none says "auto").
    """
    blocks = [ds_config[k] for k in ("bf16", "bfloat16", "fp16") if k in ds_config]
    bf16 = _enabled(ds_config.get("bf16", ds_config.get("bfloat16")))
    fp16 = _enabled(ds_config.get("fp16"))
    if bf16:
        return "bf16"
    if fp16:
        return "fp16"
    if blocks and all(_enabled(b) is False for b in blocks):
        return "no"
    return None


def resolve_precision(
    accelerate_value: str | None, accelerate_source: str, ds_config: dict, ds_source: str
) -> tuple[str, str]:
    """The effective mixed precision and the log line that states it.

    The DeepSpeed file decides; a contradiction (fp16 vs bf16, both explicit) raises ConfigError.
    """
    acc = (accelerate_value or "no").lower()
    ds = file_precision(ds_config)
    if acc == "fp8":
        return acc, ""  # fp8 rides on DeepSpeed's bf16 block; accelerate handles it
    if acc in _PRECISIONS and ds in _PRECISIONS and acc != ds:
        raise ConfigError(
            f"accel-npu: mixed precision contradicts itself: {accelerate_source} says {acc!r} but the "
            f"DeepSpeed config {ds_source} enables {ds!r}. Keep one: set mixed_precision: {ds} (or remove "
            f'it) in the accelerate config, or change the "{ds}"/"{acc}" blocks of {ds_source}.'
        )
    effective = ds if ds is not None else acc
    line = (
        f"accel-npu: mixed precision = {effective} (DeepSpeed config {ds_source}: "
        f"{ds if ds is not None else 'auto/unset'}; {accelerate_source}: {acc}; the DeepSpeed file decides)"
    )
    return effective, line

"""Which NPUs a process started with a given ASCEND_RT_VISIBLE_DEVICES can use, read exactly as
torch_npu reads it (torch_npu/npu/__init__.py ``_parse_visible_devices`` and
``_device_count_ascend_hal``, Ascend/pytorch v7.1.0.2-pytorch2.6.0 .. master 9e73e708a):

- unset: every device the driver reports; set but empty: none;
- only digits and commas are read: the list ends at the first other character ("0, 1" is [0]),
  and at an empty item ("0,,1" is [0]);
- ids must be strictly ascending, else the process sees 0 devices ("3,1");
- the first id at or past the driver's count ends the list ("0,9" on 8 NPUs is one device).
"""

from __future__ import annotations

from dataclasses import dataclass


def parse_visible_devices(value: str | None) -> list[int] | None:
    """The ids torch_npu reads from ``value``; None when the variable is unset (all devices)."""
    if value is None:
        return None
    ids: list[int] = []
    end = len(value)
    for index, char in enumerate(value):
        if not (char.isdigit() or char == ","):
            end = index
            break
    for item in value[:end].split(","):
        if not item:
            return ids
        ids.append(int(item))
    return ids


@dataclass(frozen=True)
class Visibility:
    count: int  # devices the process sees
    why: str  # why fewer than listed, or "" when the list is read as written


def visible_devices(value: str | None, raw_count: int) -> Visibility:
    """What a process with ASCEND_RT_VISIBLE_DEVICES=``value`` sees on a machine with ``raw_count``
    NPUs (the driver's count; negative or 0: unknown here, so the list is taken at its word)."""
    ids = parse_visible_devices(value)
    if ids is None:
        return Visibility(max(raw_count, 0), "")
    listed = [item for item in value.split(",") if item.strip()]
    if not ids:
        if not value:
            return Visibility(0, "it is set but empty")
        return Visibility(0, f"torch_npu reads only digits and commas, and {value!r} starts with neither")
    why = ""
    if len(ids) < len(listed):
        stop = next((i for i, c in enumerate(value) if not (c.isdigit() or c == ",")), None)
        why = (
            f"torch_npu stops reading at {value[stop]!r} (position {stop}), so only {ids} count"
            if stop is not None
            else f"torch_npu stops reading at the empty item, so only {ids} count"
        )
    for index, device in enumerate(ids):
        if index and device <= ids[index - 1]:
            return Visibility(0, "the ids are not in ascending order, and torch_npu then sees no device")
        if raw_count > 0 and device >= raw_count:
            return Visibility(
                index, f"id {device} is past this machine's {raw_count} NPU(s), and torch_npu ends the list there"
            )
    return Visibility(len(ids), why)


def suggested_value(value: str | None, raw_count: int) -> str:
    """The value the user most likely meant: every id listed, ascending, within the machine."""
    digits = "".join(c if c.isdigit() else "," for c in value or "")
    ids = sorted({int(d) for d in digits.split(",") if d})
    if raw_count > 0:
        ids = [d for d in ids if d < raw_count]
    return ",".join(str(d) for d in ids)

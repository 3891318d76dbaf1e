"""Packing items in order into groups of at most a byte budget (one packer for every caller)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def pack_by_budget(items: Iterable[T], size_of: Callable[[T], int], budget: int) -> list[list[T]]:
    """``items`` in order, in consecutive groups of at most ``budget`` bytes.

    An item larger than the budget gets a group of its own; no group is empty (an empty input
    gives no groups).
    """
    groups: list[list[T]] = []
    used = 0
    for item in items:
        size = size_of(item)
        if groups and groups[-1] and used + size <= budget:
            groups[-1].append(item)
            used += size
        else:
            groups.append([item])
            used = size
    return groups

"""Host memory: give freed heap back to the OS, read MemAvailable."""
from __future__ import annotations

import ctypes
import ctypes.util

_libc = None


def malloc_trim() -> bool:
    """Give freed heap memory back to the OS (glibc keeps freed blocks otherwise)."""
    global _libc
    try:
        if _libc is None:
            _libc = _load_libc()
        return bool(_libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return False


def _load_libc():
    # glibc's soname first: find_library("c") runs `ldconfig -p` in a subprocess (~3 ms a load)
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"))


def available_memory() -> int | None:
    """MemAvailable of this node (bytes), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

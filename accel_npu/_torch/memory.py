"""Host memory: give freed heap back to the OS, read MemAvailable, pause the cyclic collector."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import threading

_libc = None
_gc_lock = threading.Lock()
_gc_pauses = 0           # blocks inside cyclic_gc_paused(), all threads together
_gc_was_enabled = False  # the collector's state when the first of them entered


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


@contextlib.contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off inside the block, back as it was after the last one
    (nested and concurrent blocks count; a collector the user disabled stays disabled).

    Building a large model creates tens of thousands of objects, and each full collection they
    trigger walks the whole heap holding the GIL (about 0.3 s for a 60-block DiT) while the load
    threads wait for it. A load frees its tensors by reference counting, so nothing waits on the
    collector; torch.distributed.checkpoint.state_dict's ``_gc_context`` pauses it the same way."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()

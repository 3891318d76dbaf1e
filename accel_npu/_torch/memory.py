"""Host memory: give freed heap back to the OS, read MemAvailable, pause the cyclic collector, copy into
fresh memory with its pages faulted in ahead."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import mmap
import sys
import threading

_libc = None
_gc_lock = threading.Lock()
_gc_pauses = 0  # blocks inside cyclic_gc_paused(), all threads together
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


#: MADV_POPULATE_WRITE (include/uapi/asm-generic/mman-common.h; Linux 5.14)
_MADV_POPULATE_WRITE = 23
#: bytes of the destination faulted in ahead of each copy: the kernel's zeroing leaves them in cache
PREFAULT_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE
_prefault_works: bool | None = None  # None: not tried yet


def prefault(address: int, nbytes: int) -> bool:
    """Fault in the whole pages inside ``[address, address + nbytes)`` of this process's private memory,
    writable, with one ``madvise(MADV_POPULATE_WRITE)`` (contents unchanged; fresh pages arrive zeroed,
    as a first write would have them). False where the call is missing (not Linux 5.14+, not glibc)."""
    global _libc, _prefault_works
    if _prefault_works is False:
        return False
    if not sys.platform.startswith("linux"):  # the advice number is Linux's
        _prefault_works = False
        return False
    try:
        if _libc is None:
            _libc = _load_libc()
        if _prefault_works is None:
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _prefault_works = True
        lo = -(-address // _PAGE) * _PAGE
        hi = (address + nbytes) // _PAGE * _PAGE
        if hi > lo and _libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            _prefault_works = False  # EINVAL before Linux 5.14
    except (OSError, AttributeError):
        _prefault_works = False
    return bool(_prefault_works)


def prefault_available() -> bool:
    """Whether :func:`prefault` works here, tried on one page of a private anonymous mapping."""
    with mmap.mmap(-1, _PAGE) as page:
        view = (ctypes.c_char * _PAGE).from_buffer(page)
        try:
            return prefault(ctypes.addressof(view), _PAGE)
        finally:
            del view  # the mapping closes only once nothing exports it


def copy_prefaulted(dst, src) -> None:
    """``dst.copy_(src)`` for flat tensors, ``dst`` fresh memory: in pieces of ``PREFAULT_BYTES`` of
    ``dst``, each piece's pages faulted in first (:func:`prefault`).

    The copy alone faults each page of ``dst`` as it first writes it, a trap into the kernel a
    page; one madvise faults a piece's pages in the kernel (zeroing them, as either way), and the copy
    right after finds them in cache. Where :func:`prefault` is missing the pieces are copied as they
    are. The same values as ``dst.copy_(src)`` (the same copy, piece by piece)."""
    n = dst.numel()
    step = max(1, PREFAULT_BYTES // dst.element_size())
    if n <= step or _prefault_works is False:
        dst.copy_(src)
        return
    address, itemsize = dst.data_ptr(), dst.element_size()
    for begin in range(0, n, step):
        end = min(n, begin + step)
        prefault(address + begin * itemsize, (end - begin) * itemsize)
        dst[begin:end].copy_(src[begin:end])


def to_fresh(tensor, dtype):
    """``tensor.to(dtype)``, a contiguous CPU tensor's copy made by ``copy_prefaulted`` (which copies
    one smaller than a piece at once): the same values, dtype, shape and device; ``tensor`` itself
    where it has that dtype already."""
    import torch

    if tensor.dtype == dtype:
        return tensor
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return tensor.to(dtype)
    out = torch.empty(tensor.shape, dtype=dtype, device="cpu")  # not the default device
    copy_prefaulted(out.view(-1), tensor.view(-1))
    return out


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

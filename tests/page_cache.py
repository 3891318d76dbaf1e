"""The kernel's own account of a file in the page cache (mincore(2)), and dropping a file from it, for the tests and
the benchmarks that need a witness independent of accel-npu's code (Linux)."""

from __future__ import annotations

import ctypes
import mmap
import os


def resident_pages(path, begin: int = 0, end: int | None = None) -> tuple[int, int]:
    """(pages of ``path``'s bytes [begin, end) in the page cache, pages in all): mincore on a fresh read-only
    mapping, which reads nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = (
        ctypes.c_void_p,
        [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
    )
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    if end is None:
        end = os.path.getsize(path)
    page = mmap.PAGESIZE
    first, size = begin // page * page, end - begin // page * page
    pages = (size + page - 1) // page
    vec = ctypes.create_string_buffer(pages)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw), pages


def resident_fraction(path, begin: int = 0, end: int | None = None) -> float:
    """Share of the pages of ``path``'s bytes [begin, end) in the page cache."""
    resident, pages = resident_pages(path, begin, end)
    return resident / pages


def drop_from_cache(path) -> None:
    """Make ``path`` durable, then drop its pages from the page cache (clean pages go at once)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

"""``torch.save`` files written past the page cache (``O_DIRECT``), for the background checkpoint writer.

A buffered write copies every byte of a checkpoint into the page cache, on the CPU the training shares, and the
kernel later writes those pages back and reclaims them. Written with ``O_DIRECT``, the storage device reads the
host copy of the state itself. This is DeepSpeed's FastPersist design (deepspeed/io/fast_file_writer.py, 0.16+:
``torch.save`` into a file-like object that writes aligned blocks with ``O_DIRECT`` and the unaligned tail through
the page cache), without its libaio extension, and with two differences:

- the host copies are page-aligned (:func:`host_storage`) and ``torch.save`` aligns every storage's record in
  the file to a page (``torch.utils.serialization.config.save.storage_alignment``, torch 2.6+), so each storage's
  bytes go to the disk from the copy itself, not through a staging buffer;
- the files are the same ``torch.save`` zip archives (CRC-32 included), with their records page-aligned:
  ``torch.load`` of any version reads them by the offsets the archive records.

Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and FUSE filesystems: ``EINVAL`` at open or at a
write), :func:`save` returns False having left no file behind, and the caller writes it buffered.
"""

from __future__ import annotations

import errno
import mmap
import os

ALIGN = 4096  # a page: the strictest logical block size O_DIRECT asks of the buffer, offset and length
_STAGING = 8 << 20  # the page-aligned buffer headers, pickles and unaligned bytes gather in
#: below this an archive's page-cache copy costs a few milliseconds: not worth a layout of its own
MIN_BYTES = 16 << 20


def supported() -> bool:
    """Whether this platform and torch can write a page-aligned torch.save archive with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6: records aligned to 64 bytes only
        return False
    return hasattr(config.save, "storage_alignment")


def worth_it(nbytes: int, storages: int) -> bool:
    """Whether an archive of ``storages`` distinct storages holding ``nbytes`` is written past the page cache:
    large enough for the copy to matter, and the page each record is aligned to padding it by at most 1 %
    (a file of many small tensors would grow several times over)."""
    return nbytes >= MIN_BYTES and storages * ALIGN <= nbytes // 100


def host_storage(nbytes: int):
    """A CPU storage of ``nbytes`` whose data starts on a page (anonymous memory map), so :class:`DirectFile`
    writes it without a copy; small ones are ordinary storages (they go through the staging buffer anyway)."""
    import torch

    if nbytes < ALIGN:
        return torch.UntypedStorage(nbytes, device="cpu")
    # the tensor keeps the map alive (torch.frombuffer holds a reference to the buffer), and so does its storage
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).untyped_storage()


def _address(view: memoryview) -> int:
    import numpy

    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


class DirectFile:
    """A write-only file object for ``torch.save``: aligned, page-aligned chunks go to the file with ``O_DIRECT``
    as they are; everything else gathers in a page-aligned staging buffer written in whole pages; :meth:`close`
    writes the unaligned tail through the page cache and fsyncs the file."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        self._staging = mmap.mmap(-1, _STAGING)
        self._view = memoryview(self._staging)
        self._filled = 0  # bytes in the staging buffer, which starts at file offset self._offset
        self._offset = 0  # file offset of the staging buffer's first byte: a multiple of ALIGN
        self.direct_bytes = 0  # written from the caller's memory, without a copy
        self.failed: OSError | None = None  # the first write that failed

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if size >= ALIGN and self._filled % ALIGN == 0 and _address(view) % ALIGN == 0:
            self._drain(self._filled)
            whole = size - size % ALIGN
            self._pwrite(view[:whole])
            self.direct_bytes += whole
            view = view[whole:]
        while len(view):
            take = min(len(view), _STAGING - self._filled)
            self._view[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == _STAGING:
                self._drain(_STAGING)
        return size

    def flush(self) -> None:
        """Nothing: bytes are written in whole pages as they come, the tail at :meth:`close`."""

    def _drain(self, nbytes: int) -> None:
        """Write the staging buffer's first ``nbytes`` (a multiple of ALIGN) and keep what follows."""
        if not nbytes:
            return
        self._pwrite(self._view[:nbytes])
        rest = self._filled - nbytes
        if rest:
            self._view[:rest] = self._view[nbytes : self._filled]
        self._filled = rest

    def _pwrite(self, view: memoryview) -> None:
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], self._offset + done)
        except OSError as exc:
            # torch.save's writer ends the archive as it unwinds, and that fails in turn: the cause is kept here
            self.failed = self.failed or exc
            raise
        self._offset += len(view)

    def close(self) -> None:
        """Write what is left (whole pages directly, the unaligned tail through the page cache, as DeepSpeed's
        FastFileWriter._unaligned_drain does) and make the file durable."""
        self._drain(self._filled - self._filled % ALIGN)
        tail = bytes(self._view[: self._filled])
        self.abort()
        fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            if tail:
                os.pwrite(fd, tail, self._offset)
            os.fsync(fd)
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Close the file and free the staging buffer (idempotent)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        self._view.release()
        try:
            self._staging.close()
        except BufferError:  # a failed write's traceback still views it: unmapped once that is gone
            pass


def save(obj, path: str) -> bool:
    """``torch.save(obj, path)`` (zip format) written with ``O_DIRECT`` and fsynced; False, with no file left at
    ``path``, where the filesystem refuses ``O_DIRECT``."""
    import torch
    from torch.utils.serialization import config

    try:
        out = DirectFile(path)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _remove(path)  # a kernel may create the file before it checks the flag
        return False
    try:
        # the setting is global while it lasts: another thread's torch.save meanwhile aligns its records to a
        # page as well, which only pads its archive
        with config.patch({"save.storage_alignment": ALIGN}):
            torch.save(obj, out)
        out.close()
    except BaseException as exc:
        out.abort()
        cause = out.failed
        if cause is not None and cause.errno == errno.EINVAL:
            _remove(path)
            return False
        if cause is not None and cause is not exc:
            raise cause from exc
        raise
    return True


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""Checkpoint files written past the page cache (``O_DIRECT``), for the background checkpoint writer.

A buffered write copies every byte of a checkpoint into the page cache, on the CPU the training shares, and the
kernel later writes those pages back and reclaims them. Written with ``O_DIRECT``, the storage device reads the
host copy of the state itself. This is DeepSpeed's FastPersist design (deepspeed/io/fast_file_writer.py, 0.16+:
``torch.save`` into a file-like object that writes aligned blocks with ``O_DIRECT`` and the unaligned tail through
the page cache), without its libaio extension, and with two differences:

- the host copies are page-aligned (:func:`host_storage`) and :func:`save` aligns every storage's record in the
  file to a page (torch.save's ``storage_alignment``, torch 2.6+), so each storage's bytes go to the disk from the
  copy itself, not through a staging buffer;
- the files are the same ``torch.save`` zip archives (CRC-32 included), with their records page-aligned:
  ``torch.load`` of any version reads them by the offsets the archive records.

torch.distributed.checkpoint's files (FSDP2's shards) go the same way (:func:`dcp_writer`): the same ``.distcp``
files, their bytes through the staging buffer (DCP appends one archive per tensor, at no particular offset).

Where the filesystem refuses ``O_DIRECT`` (tmpfs, some network and FUSE filesystems: ``EINVAL`` at open or at a
write), the file is written through the page cache from where it was refused, and so are the process's later
files.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import mmap
import os

ALIGN = 4096  # a page: the strictest logical block size O_DIRECT asks of the buffer, offset and length
_STAGING = 8 << 20  # the page-aligned buffer headers, pickles and unaligned bytes gather in
#: below this an archive's page-cache copy costs a few milliseconds: not worth a layout of its own
MIN_BYTES = 16 << 20

_refused = False  # a filesystem refused O_DIRECT: this process's later files are written buffered at once


@functools.cache
def supported() -> bool:
    """Whether this platform and torch can write a page-aligned torch.save archive with O_DIRECT: tried once on
    a small archive in memory (:func:`_torch_save` calls torch.save's own writer, whose arguments changed in 2.6)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        import torch

        buffer = io.BytesIO()
        _torch_save({"probe": torch.arange(3)}, buffer)
        buffer.seek(0)
        return torch.equal(torch.load(buffer, weights_only=True)["probe"], torch.arange(3))
    except Exception:  # noqa: BLE001 - torch < 2.6 (records aligned to 64 bytes only), or its internals moved
        return False


def refused() -> bool:
    """Whether a filesystem refused O_DIRECT in this process (its later files go buffered at once)."""
    return _refused


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
    """A write-only file object (for ``torch.save`` and DCP's writer): aligned, page-aligned chunks go to the
    file with ``O_DIRECT`` as they are; everything else gathers in a page-aligned staging buffer written in whole
    pages; :meth:`close` writes the unaligned tail through the page cache and fsyncs the file. Where the
    filesystem refuses ``O_DIRECT``, the rest of the file is written through the page cache."""

    def __init__(self, path: str):
        global _refused
        self.path = path
        self.direct = not _refused
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _refused, self.direct = True, False
            self.fd = os.open(path, flags, 0o644)  # truncates what a kernel created before it checked the flag
        self._staging = mmap.mmap(-1, _STAGING)
        self._view = memoryview(self._staging)
        self._filled = 0  # bytes in the staging buffer, which starts at file offset self._offset
        self._offset = 0  # file offset of the staging buffer's first byte: a multiple of ALIGN
        self.direct_bytes = 0  # written from the caller's memory, without a copy
        self.failed: OSError | None = None  # the first write that failed
        self.closed = False

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

    def tell(self) -> int:
        return self._offset + self._filled

    def fileno(self) -> int:
        return self.fd

    def writable(self) -> bool:
        return True

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
        global _refused
        done = 0
        try:
            while done < len(view):
                try:
                    done += os.pwrite(self.fd, view[done:], self._offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or not self.direct:
                        raise
                    # a filesystem that takes the flag at open but not the writes: the rest goes buffered
                    buffered = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
                    os.close(self.fd)
                    self.fd, self.direct, _refused = buffered, False, True
        except OSError as exc:
            # torch.save's writer ends the archive as it unwinds, and that fails in turn: the cause is kept here
            self.failed = self.failed or exc
            raise
        self._offset += len(view)

    def close(self) -> None:
        """Write what is left (whole pages directly, the unaligned tail through the page cache, as DeepSpeed's
        FastFileWriter._unaligned_drain does) and make the file durable (idempotent)."""
        if self.closed:
            return
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
        self.closed = True
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        self._view.release()
        try:
            self._staging.close()
        except BufferError:  # a failed write's traceback still views it: unmapped once that is gone
            pass


def _torch_save(obj, out) -> None:
    """``torch.save(obj, out)`` (zip format) with each storage's record on a page: torch.save's own body
    (torch/serialization.py ``save``, 2.6 to 2.13), its writer given the alignment for this file alone. Through
    ``config.patch({"save.storage_alignment": ...})`` it would be the process's where torch's config overrides are
    plain module attributes (before torch/utils/_config_module.py kept them in ContextVar-s), aligning the
    training thread's own torch.save meanwhile too. The CRC-32 follows torch's ``set_crc32_options``."""
    import torch
    from torch import serialization

    writer = torch._C.PyTorchFileWriter(out, serialization.get_crc32_options(), ALIGN)
    serialization._save(obj, writer, serialization.pickle, serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def save(obj, path: str) -> bool:
    """``torch.save(obj, path)`` (zip format) written with ``O_DIRECT`` and fsynced; whether it went past the
    page cache (False: the filesystem refused ``O_DIRECT``, and the file was written through it)."""
    out = DirectFile(path)
    try:
        _torch_save(obj, out)
        out.close()
    except BaseException as exc:
        out.abort()
        cause = out.failed
        if cause is not None and cause is not exc:
            raise cause from exc
        raise
    return out.direct


def dcp_writer(directory: str, nbytes: int):
    """A ``torch.distributed.checkpoint.FileSystemWriter`` (fsyncing its files) for a rank's ``nbytes`` of
    state. Its data files (``.distcp``) are :class:`DirectFile`-s where O_DIRECT is supported, not refused, and
    ``nbytes`` at least MIN_BYTES: DCP writes each rank's file through ``FileSystem.create_stream``
    (torch/distributed/checkpoint/filesystem.py ``_write_files_from_queue``: ``tell``, ``write``, ``fileno`` for
    its fsync, ``close``); its ``.metadata`` goes through the page cache."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    writer = FileSystemWriter(directory, sync_files=True)
    if nbytes < MIN_BYTES or _refused or not supported() or type(writer.fs) is not FileSystem:
        return writer  # (an fsspec filesystem is left as it is)

    class DirectFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "wb" or not os.fspath(path).endswith(".distcp"):
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            out = DirectFile(os.fspath(path))
            try:
                yield out
            except BaseException:
                out.abort()
                raise
            out.close()

    writer.fs = DirectFileSystem()
    return writer

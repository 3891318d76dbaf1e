"""Reading the kept tensors of a checkpoint once, shard by shard, with readahead and cast threads."""
from __future__ import annotations

import os

from accel_npu._torch.dist import is_local_main
from accel_npu._torch.safetensors_io import Checkpoint
from accel_npu.errors import LoadError


def readahead(ckpt: Checkpoint, files: dict[str, list[str]]) -> None:
    """Ask the kernel to start reading the byte ranges of these tensors now (POSIX_FADV_WILLNEED).

    The reads then overlap with casting the tensors before them instead of stalling each
    page fault on storage; only the ranges of the listed tensors are requested. Best effort.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for name, keys in files.items():
        header = ckpt.headers.get(name)
        if header is None:
            continue
        ranges = sorted(header[k][2:4] for k in keys if k in header)
        merged: list[list[int]] = []
        for begin, end in ranges:  # adjacent tensors: one request
            if merged and begin <= merged[-1][1] + (1 << 20):
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([begin, end])
        try:
            fd = os.open(ckpt.path(name), os.O_RDONLY)
        except OSError:
            continue
        try:
            for begin, end in merged:
                os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


#: the progress bar advances every this many bytes, not per tensor
PROGRESS_BYTES = 64 << 20


class LazyTensors:
    """A read-once mapping: ``items()`` reads each kept tensor from its shard as it is consumed.

    Shards are visited in order, one open at a time; only the listed keys are read. With
    ``convert`` (key, tensor -> tensor in its final dtype) and ``threads`` > 1, the reads and
    casts of the next few tensors run in a small thread pool while the caller assigns the
    current one (the cast to fp32 is what bounds loading; torch releases the GIL while casting).
    Results are identical and yielded in the same order.
    """

    def __init__(self, ckpt: Checkpoint, keys: list[str], progress=None, convert=None, threads: int = 1):
        self.ckpt, self.keys, self.progress = ckpt, keys, progress
        self.convert, self.threads = convert, threads
        self.read = 0
        self._unshown = 0  # bytes read but not yet passed to the progress bar

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.keys

    def _by_file(self, only=None) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = {}
        for k in self.keys:
            if only is None or k in only:
                by_file.setdefault(self.ckpt.weight_map[k], []).append(k)
        return {name: by_file[name] for name in sorted(by_file)}

    def order(self) -> list[str]:
        """The keys in the order :meth:`items` reads them (shard by shard)."""
        return [k for keys in self._by_file().values() for k in keys]

    def items(self, only=None):
        from safetensors import safe_open

        files = self._by_file(only)
        readahead(self.ckpt, files)
        pool = None
        if self.convert is not None and self.threads > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="accel-npu-load")
        try:
            for name, keys in files.items():
                path = self.ckpt.path(name)
                try:
                    handle = safe_open(path, framework="pt", device="cpu")
                except Exception as exc:
                    raise LoadError(f"accel-npu: cannot open {path}: {exc}") from exc
                with handle as f:
                    yield from self._read_file(f, path, keys, pool)
            if self.progress is not None and self._unshown:
                self.progress.update(self._unshown)
                self._unshown = 0
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _get(self, f, path: str, key: str):
        try:
            return f.get_tensor(key)  # a view of the file's mmap: nothing is read yet
        except Exception as exc:
            raise LoadError(f"accel-npu: reading {key!r} from {path} failed: {exc}") from exc

    def _read_file(self, f, path: str, keys: list[str], pool):
        import collections

        pending: collections.deque = collections.deque()
        ahead = 2 * self.threads
        todo = iter(keys)
        while True:
            while pool is not None and len(pending) < ahead:
                k = next(todo, None)
                if k is None:
                    break
                pending.append((k, pool.submit(self.convert, k, self._get(f, path, k))))
            if pool is not None:
                if not pending:
                    return
                k, fut = pending.popleft()
                tensor = fut.result()
            else:
                k = next(todo, None)
                if k is None:
                    return
                tensor = self._get(f, path, k)
                if self.convert is not None:
                    tensor = self.convert(k, tensor)
            size = _file_bytes(self.ckpt, self.ckpt.weight_map[k], k, tensor)
            self.read += size
            if self.progress is not None:
                self._unshown += size
                if self._unshown >= PROGRESS_BYTES:  # tqdm per tensor: ~6 % of a 1-thread fp32 load
                    self.progress.update(self._unshown)
                    self._unshown = 0
            yield k, tensor
            del tensor


def _file_bytes(ckpt: Checkpoint, name: str, key: str, tensor) -> int:
    entry = ckpt.headers.get(name, {}).get(key)
    if entry is not None:
        return entry[3] - entry[2]
    return tensor.numel() * tensor.element_size()


def progress_bar(total: int, desc: str, shards: int):
    if not is_local_main() or (shards <= 1 and total < (256 << 20)):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)

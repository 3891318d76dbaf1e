"""Reading the kept tensors of a checkpoint once, shard by shard, with readahead and cast threads."""

from __future__ import annotations

import os

from accel_npu._torch.dist import is_local_main
from accel_npu._torch.safetensors_io import Checkpoint
from accel_npu.errors import LoadError

#: bytes of the checkpoint asked of the kernel (POSIX_FADV_WILLNEED) ahead of the tensor being read
READAHEAD_BYTES = 256 << 20
#: the device readahead size from which a casting load leaves what lies past its first window to the
#: readers' own page faults; below it (Linux's default is 128 KB) the faults keep too little in flight
FAULT_PATH_READAHEAD = 2 << 20


class Readahead:
    """Ask the kernel for the byte ranges of the tensors about to be read, in read order.

    Storage then streams the next tensors while the ones before them are cast (and, from a
    prefetch, while the model is built), instead of each page fault of the cast stalling on a
    read; ranges are requested at most ``window`` bytes ahead of the tensor being read (a
    checkpoint larger than memory must not evict what it has just read), and only the listed
    tensors' ranges. One ``POSIX_FADV_WILLNEED`` reads at most the device's readahead size
    (``force_page_cache_ra`` in Linux's mm/readahead.c caps it at the backing device's
    ``read_ahead_kb``), so a range is requested in pieces of that size. Safe to call from
    several threads (one issues the requests, the others go on); best effort: a failure
    requests nothing more.

    With ``casting`` (a load whose copies, not its reads, bound it), only the first window is
    requested where the device's readahead is at least ``FAULT_PATH_READAHEAD``: past it the
    readers' page faults read ahead themselves (``do_async_mmap_readahead`` in mm/filemap.c, the
    device's readahead size at a time, in large folios), which costs less CPU than WILLNEED's
    single pages (``force_page_cache_ra`` allocates folios of the mapping's minimum order).
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        files: dict[str, list[str]],
        window: int = READAHEAD_BYTES,
        done: dict[str, list[tuple[int, int]]] | None = None,
        casting: bool = False,
    ):
        import threading

        self.ckpt, self.window = ckpt, window
        self.done = done or {}  # file -> byte ranges already requested (by a prefetch): not asked again
        self.ranges: list[tuple[str, int, int]] = []  # (file, begin, end) in read order, adjacent ones merged
        self.starts: dict[str, int] = {}  # key -> bytes of the ranges before it (its position in the stream)
        total = 0
        for name, keys in files.items():
            header = ckpt.headers.get(name, {})
            for k in keys:
                if k not in header:
                    continue
                begin, end = header[k][2:4]
                last = self.ranges[-1] if self.ranges else None
                if last is not None and last[0] == name and last[2] <= begin <= last[2] + (1 << 20):
                    self.starts[k] = total + begin - last[2]  # a small gap: read through it, one request
                    self.ranges[-1] = (name, last[1], max(end, last[2]))
                    total += max(end, last[2]) - last[2]
                else:
                    self.starts[k] = total
                    self.ranges.append((name, begin, end))
                    total += end - begin
        self.next = 0  # the first range not wholly requested
        self.offset = 0  # bytes of that range already requested
        self.requested = 0  # stream bytes requested so far
        self.target = 0  # stream bytes the readers have asked to have requested
        self.casting = casting
        self.limit: int | None = None  # stream bytes requested at most (None: all)
        self.fds: dict[str, int] = {}
        self.pieces: dict[str, int] = {}  # file -> bytes one request reads (its device's readahead size)
        self.enabled = hasattr(os, "posix_fadvise")
        self._issuing = threading.Lock()

    def reached(self, key: str) -> None:
        """``key`` is about to be read: request the ranges up to ``window`` bytes past its start."""
        start = self.starts.get(key)
        if start is None or not self.enabled:
            return
        self.target = max(self.target, start + self.window)
        if not self._issuing.acquire(blocking=False):
            return  # another thread is requesting; it reads ``target`` again before it stops
        try:
            while self.enabled and self.next < len(self.ranges) and self.requested < self._goal():
                self._request_piece()
        finally:
            self._issuing.release()

    def _goal(self) -> int:
        return self.target if self.limit is None else min(self.target, self.limit)

    def _request_piece(self) -> None:
        name, begin, end = self.ranges[self.next]
        at = begin + self.offset
        try:
            fd = self.fds.get(name)
            if fd is None:
                fd = self.fds[name] = os.open(self.ckpt.path(name), os.O_RDONLY)
                self.pieces[name] = _readahead_bytes(fd)
                if self.casting and self.pieces[name] >= FAULT_PATH_READAHEAD:
                    self.limit = self.window
                    if self.requested >= self.limit:
                        return
            size = min(self.pieces[name], end - at)
            if not any(b <= at and at + size <= e for b, e in self.done.get(name, ())):
                os.posix_fadvise(fd, at, size, os.POSIX_FADV_WILLNEED)
        except OSError:
            self.enabled = False
            return
        self.requested += size
        self.offset += size
        if at + size >= end:
            self.next, self.offset = self.next + 1, 0

    def requested_ranges(self) -> dict[str, list[tuple[int, int]]]:
        """file -> the byte ranges requested so far."""
        out: dict[str, list[tuple[int, int]]] = {}
        for name, begin, end in self.ranges[: self.next]:
            out.setdefault(name, []).append((begin, end))
        if self.offset and self.next < len(self.ranges):
            name, begin, _ = self.ranges[self.next]
            out.setdefault(name, []).append((begin, begin + self.offset))
        return out

    def close(self) -> None:
        with self._issuing:
            self.enabled = False
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


#: what one WILLNEED reads where the device's readahead size cannot be read (Linux's default,
#: VM_READAHEAD_PAGES in include/linux/mm.h)
_DEFAULT_READAHEAD = 128 << 10


def _readahead_bytes(fd: int) -> int:
    """The readahead size of the device holding ``fd``'s file (/sys/class/bdi/MAJ:MIN/read_ahead_kb)."""
    dev = os.fstat(fd).st_dev
    try:
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
            kb = int(f.read())
    except (OSError, ValueError):
        return _DEFAULT_READAHEAD
    return kb << 10 if kb > 0 else _DEFAULT_READAHEAD


#: the progress bar advances every this many bytes, not per tensor
PROGRESS_BYTES = 64 << 20


class LazyTensors:
    """A read-once mapping: ``items()`` reads each kept tensor from its shard as it is consumed.

    Shards are visited in order, each open from its first tensor read to its last one consumed
    (two at most at a shard boundary); only the listed keys are read. With
    ``convert`` (key, tensor -> tensor in its final dtype) and ``threads`` > 1, the reads and
    casts of the next few tensors run in a small thread pool while the caller assigns the
    current one (the cast to fp32 is what bounds loading; torch releases the GIL while casting).
    Results are identical and yielded in the same order.
    """

    def __init__(self, ckpt: Checkpoint, keys: list[str], progress=None, convert=None, threads: int = 1, prefetch=None):
        self.ckpt, self.keys, self.progress = ckpt, keys, progress
        self.convert, self.threads = convert, threads
        self.prefetch = prefetch  # prefetch.Prefetch: tensors read and cast while the model was built
        self.read = 0
        self._unshown = 0  # bytes read but not yet passed to the progress bar

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.keys

    def files(self, only=None) -> dict[str, list[str]]:
        """Keys by shard, shards in name order, each shard's keys in file order (where the header
        is known): storage then reads forward, as its readahead and the kernel's expect."""
        by_file: dict[str, list[str]] = {}
        for k in self.keys:
            if only is None or k in only:
                by_file.setdefault(self.ckpt.weight_map[k], []).append(k)
        out = {}
        for name in sorted(by_file):
            header = self.ckpt.headers.get(name)
            keys = by_file[name]
            if header is not None and all(k in header for k in keys):
                keys = sorted(keys, key=lambda k: header[k][2])
            out[name] = keys
        return out

    def order(self) -> list[str]:
        """The keys in the order :meth:`items` reads them (shard by shard)."""
        return [k for keys in self.files().values() for k in keys]

    def items(self, only=None):
        files = self.files(only)
        order = [(name, k) for name, keys in files.items() for k in keys]
        left = {name: len(keys) for name, keys in files.items()}  # tensors of each shard not yet yielded
        ahead = Readahead(
            self.ckpt,
            files,
            done=self.prefetch.hand_over() if self.prefetch is not None else None,
            casting=self.prefetch is not None and self.prefetch.casting,
        )
        shards = _OpenShards(self.ckpt)
        pool = None
        if self.convert is not None and self.threads > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="accel-npu-load")
        try:
            for name, k, tensor in self._read(order, shards, pool, ahead):
                left[name] -= 1
                if not left[name]:
                    shards.close(name)  # its tensors are read (cast) or hold their own mapping
                size = _file_bytes(self.ckpt, name, k, tensor)
                self.read += size
                if self.progress is not None:
                    self._unshown += size
                    if self._unshown >= PROGRESS_BYTES:  # tqdm per tensor: ~6 % of a 1-thread fp32 load
                        self.progress.update(self._unshown)
                        self._unshown = 0
                yield k, tensor
                del tensor
            if self.progress is not None and self._unshown:
                self.progress.update(self._unshown)
                self._unshown = 0
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            shards.close_all()
            ahead.close()

    def _read(self, order: list[tuple[str, str]], shards: _OpenShards, pool, ahead: Readahead):
        """(shard, key, tensor) in ``order``. With a pool, the next ``2 * threads`` tensors are read
        and cast ahead — across shard boundaries, so no thread idles while the last (large) tensor
        of a shard is cast. A tensor the prefetch cast is taken where the real cast leaves it as it
        is (the same result as casting it now), else read again."""
        import collections

        def read_here(name, k):
            tensor = shards.get(name, k)
            return tensor if self.convert is None else self.convert(k, tensor)

        def start(name, k):
            early = self.prefetch.future(k) if self.prefetch is not None else None
            if early is not None:
                return early, True
            if pool is None:
                ahead.reached(k)
                return read_here(name, k), False
            return pool.submit(_read, ahead, shards, name, k, self.convert), False

        def result(name, k, got, early):
            if not early:
                return got.result() if pool is not None else got
            try:
                tensor = got.result()
            except Exception:  # noqa: BLE001 - the prefetch could not cast it: read it here (and report what is wrong)
                return read_here(name, k)
            if self.convert is not None and self.convert(k, tensor) is not tensor:
                return read_here(name, k)  # the dtype was guessed wrong
            return tensor

        todo = iter(order)
        if pool is None:
            for name, k in todo:
                got, early = start(name, k)
                yield name, k, result(name, k, got, early)
            return
        pending: collections.deque = collections.deque()
        depth = 2 * self.threads
        while True:
            while len(pending) < depth:
                nxt = next(todo, None)
                if nxt is None:
                    break
                pending.append((*nxt, *start(*nxt)))
            if not pending:
                return
            name, k, got, early = pending.popleft()
            yield name, k, result(name, k, got, early)


def _read(ahead: Readahead, shards: _OpenShards, name: str, key: str, convert):
    """One tensor in a load thread: its readahead, ``get_tensor`` (which reads the tensor's first
    byte, a page fault when cold, with the GIL held) and the cast all off the main thread."""
    ahead.reached(key)
    return convert(key, shards.get(name, key))


class _OpenShards:
    """The checkpoint's shards opened with ``safe_open`` when first read, closed when done."""

    def __init__(self, ckpt: Checkpoint):
        import threading

        self.ckpt = ckpt
        self.handles: dict = {}
        self._opening = threading.Lock()

    def get(self, name: str, key: str):
        """``key`` from shard ``name``: a view of the file's mmap (safetensors reads only its first
        byte). Threads may share it: the first to need a shard opens it."""
        path = self.ckpt.path(name)
        handle = self.handles.get(name)
        if handle is None:
            from safetensors import safe_open

            with self._opening:
                handle = self.handles.get(name)
                if handle is None:
                    try:
                        handle = safe_open(path, framework="pt", device="cpu").__enter__()
                    except Exception as exc:
                        raise LoadError(f"accel-npu: cannot open {path}: {exc}") from exc
                    self.handles[name] = handle
        try:
            return handle.get_tensor(key)
        except Exception as exc:
            raise LoadError(f"accel-npu: reading {key!r} from {path} failed: {exc}") from exc

    def close(self, name: str) -> None:
        handle = self.handles.pop(name, None)
        if handle is not None:
            handle.__exit__(None, None, None)

    def close_all(self) -> None:
        for name in list(self.handles):
            self.close(name)


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

"""Asynchronous ``save_state`` under DeepSpeed and FSDP2: each rank's state is copied to host memory, its
files are written by a background thread, and the checkpoint is published only once every rank's files are
durable. (FSDP2's shards are staged and written by torch.distributed.checkpoint: ``fsdp_background.py``,
through :func:`queue_job`.)

- :class:`SnapshotCheckpointEngine` stands in for an engine's ``checkpoint_engine`` (DeepSpeed's
  ``CheckpointEngine`` interface, deepspeed/runtime/checkpoint_engine/checkpoint_engine.py) during
  ``save_checkpoint``: its ``save(state_dict, path)`` copies the state dict's tensors to host memory (one copy
  per storage, so views and shared storages are written as ``torch.save`` writes the originals) and queues the
  file. Training may change the originals as soon as ``save_state`` returns.
- One writer thread per process ``torch.save``-s each queued file and fsyncs it. When the save's last file
  is durable, the rank says so in the process group's key-value store (``done/<rank>``: ``ok`` or the error);
  rank 0's writer waits for every rank's word, then publishes (``latest``, manifest, fsync, the atomic rename,
  pruning) or not, and posts the outcome.
- :func:`wait_for_pending` (the next ``save_state``, ``load_state``, ``wait_for_everyone``, ``end_training``, the
  process's exit, and a read of the pending checkpoint through Python: :func:`_read_of_pending`) waits for the
  pending save and raises its failure, on every rank: the previous checkpoint is intact.

At most one save is pending per process (the next waits for it), so the host holds at most one copy of the
rank's own state. A file the host cannot hold (MemAvailable read as it is saved) is written synchronously.
"""

from __future__ import annotations

import atexit
import contextvars
import copy
import functools
import logging
import os
import queue
import sys
import threading
import time

from accel_npu import environment
from accel_npu._torch import dist as _dist
from accel_npu._torch.memory import available_memory
from accel_npu._torch.once import FirstTime
from accel_npu.errors import CheckpointError
from accel_npu.plugins.checkpoints import direct_io
from accel_npu.scopes import launched_rank

log = logging.getLogger("accel_npu")

_KEY = "accel_npu/async_save"
_POLL_S = 1.0  # store waits are made in slices, so a signal still reaches a waiting main thread
_HOST_HEADROOM = 0.9  # a snapshot may take at most this share of MemAvailable; the rest is for training
# on a core training keeps busy a nice-19 thread gets about 1.5 % of it (CFS weights 15 against 1024,
# kernel/sched/core.c sched_prio_to_weight; nice 10's 110 would be about a tenth, the whole 1.1x step budget);
# idle cores it uses whole, and while training waits for it its priority is restored (_stop_yielding)
_WRITER_NICE = 19
_said = FirstTime()


def enabled() -> bool:
    """Whether save_state writes in the background here: by default in a launched rank (a training job), not in a
    plain process (a notebook, a test) that may read what it saved as soon as save_state returns."""
    mode = environment.async_checkpoint()
    return mode == "on" or (mode == "auto" and launched_rank())


def asked_for() -> bool:
    """ACCEL_NPU_ASYNC_CHECKPOINT=1: the background asked for, not merely the default."""
    return environment.async_checkpoint() == "on"


# --------------------------------------------------------------------------------------------
# snapshots
def storage_key(storage):
    # the StorageImpl's address, as torch.save keys storages (torch/serialization.py, persistent_id): empty
    # storages all have data_ptr 0 but are written one by one
    return storage._cdata


def _copyable(tensor) -> bool:
    import torch

    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type != "meta"
    )


def _tensors(obj, out: list, seen: set, sizes: list | None = None) -> None:
    """The tensors inside the containers a checkpoint's state dict is made of (and, into ``sizes``, its
    ``torch.Size`` values)."""
    import torch

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, torch.Size):
        if sizes is not None:
            sizes.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out, seen, sizes)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _tensors(value, out, seen, sizes)


def tensors_of(state_dict) -> list:
    """The tensors of a checkpoint's state dict, each once."""
    found: list = []
    _tensors(state_dict, found, set())
    return found


def storage_sizes(tensors) -> dict:
    """{storage key: bytes} of the distinct storages under ``tensors``: each once, as ``torch.save`` writes them."""
    return {storage_key(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    return sum(storage_sizes(tensors).values())


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return None
    return DTensor


def local_tensor(tensor):
    """A DTensor's shard on this rank (its local tensor); any other tensor itself."""
    dtensor = _dtensor_type()
    return tensor._local_tensor if dtensor is not None and isinstance(tensor, dtensor) else tensor


def snapshot_bytes(state_dict) -> int:
    """Host bytes :func:`snapshot` would copy: each distinct storage once (a DTensor's local shard's)."""
    return storage_bytes(t for t in map(local_tensor, tensors_of(state_dict)) if _copyable(t))


class HostCopy:
    """A host copy of a state dict (:func:`snapshot`): its structure and metadata made at once, the data of the
    storages named ``later`` copied by :meth:`fill` (in the background, before anything changes them)."""

    def __init__(self, state_dict, later_pairs: list, events: list, pageable: list):
        self.state_dict = state_dict
        self._later = later_pairs  # (host storage, source storage)
        self._events = events  # device events recorded after the non-blocking device-to-host copies
        self._pageable = pageable  # the host storages it made, for the next save once its file is written

    def release(self) -> None:
        """Its file is written: its host storages go to the next save's copy (:func:`_host_storage`)."""
        with _pool_lock:
            for storage in self._pageable:
                _pool.setdefault(storage.nbytes(), []).append(storage)
        self._pageable = []

    def fill(self) -> None:
        """Copy the storages left for later, then wait for the device-to-host copies (issued in order on the
        device stream at save time, so they read the state as saved)."""
        while self._later:
            host, source = self._later.pop()
            _byte_view(host).copy_(_byte_view(source))  # Tensor.copy_ releases the GIL: training's thread runs on
        while self._events:
            self._events.pop().synchronize()


def _byte_view(storage):
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


#: nbytes -> host storages of the last save's copy, whose files are written: the next save copies into them. Their
#: pages are already in memory, so that copy is a plain memcpy, about 3x faster than one into fresh pages (whose
#: page faults the kernel serves one by one while training runs); at most one save's copy is held, as before.
_pool: dict[int, list] = {}
_pool_lock = threading.Lock()


def pooled_bytes() -> int:
    with _pool_lock:
        return sum(nbytes * len(storages) for nbytes, storages in _pool.items())


def _drop_pool() -> None:
    """What the last save's copy left unused goes back to the system (this save's copy is made)."""
    with _pool_lock:
        _pool.clear()


def _host_storage(nbytes: int, pinned: bool):
    """(host storage of ``nbytes``, whether it is pinned): pinned for a device's copy where the runtime has
    pinned memory, else pageable, the last save's where it left one of that size."""
    import torch

    if pinned:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage(), True
        except RuntimeError:  # no pinned memory here (no accelerator runtime): pageable, copied synchronously
            pass
    with _pool_lock:
        free = _pool.get(nbytes)
        if free:
            return free.pop(), False
    if direct_io.supported():
        return direct_io.host_storage(nbytes), False
    return torch.UntypedStorage(nbytes, device="cpu"), False


def _device_event(device):
    import torch

    try:
        event = torch.Event(device=device)
        event.record()
        return event
    except (RuntimeError, ValueError, TypeError):  # a backend without generic events: wait for the copies now
        torch.accelerator.synchronize(device)
        return None


def snapshot(state_dict, later=frozenset()) -> HostCopy:
    """A deep copy of ``state_dict`` whose tensors live in host memory of their own: each storage copied
    once, and each tensor a view of its copy with the original's offset, shape, stride, dtype,
    ``requires_grad`` and Python attributes, so ``torch.save`` of the copy writes what it writes of the
    original. A DTensor's local shard is copied so, its placement kept. Other values are deep-copied now (a
    scheduler's lists change as training goes on).

    Host storages whose key (:func:`storage_key`) is in ``later`` are allocated now and copied by
    :meth:`HostCopy.fill`; the caller makes sure nothing changes them in between. Device storages are copied
    now, without waiting: non-blocking into pinned memory, in order on the device's stream, so later kernels
    (the next optimizer step) cannot change what they read; :meth:`HostCopy.fill` waits for them."""
    import torch

    found, sizes = [], []
    _tensors(state_dict, found, set(), sizes)
    # a torch.Size is an immutable tuple: the copy shares it (deepcopy would rebuild each one through
    # __reduce_ex__; ZeRO-3's param_shapes hold one per parameter)
    memo: dict = {id(size): size for size in sizes}
    storages: dict = {}
    later_pairs, devices, pageable = [], set(), []
    dtensors = [t for t in found if local_tensor(t) is not t]
    found = [t for t in found if local_tensor(t) is t] + [local_tensor(t) for t in dtensors]
    for t in found:
        if not _copyable(t) or id(t) in memo:
            continue
        source = t.untyped_storage()
        key = storage_key(source)
        copied = storages.get(key)
        if copied is None:
            on_device = source.device.type != "cpu"
            copied, pinned = _host_storage(source.nbytes(), pinned=on_device)
            if not pinned:
                pageable.append(copied)
            if on_device:
                _byte_view(copied).copy_(_byte_view(source), non_blocking=pinned)
                devices.add(source.device)
            elif key in later:
                later_pairs.append((copied, source))
            else:
                copied.copy_(source)
            storages[key] = copied
        view = torch.empty(0, dtype=t.dtype).set_(copied, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            view = torch.nn.Parameter(view, requires_grad=t.requires_grad)
        elif t.requires_grad:
            view.requires_grad_(True)
        memo[id(t)] = view
    for t in found:
        copied = memo.get(id(t))
        if copied is not None and t.__dict__:
            copied.__dict__.update(copy.deepcopy(t.__dict__, memo))
    for t in dtensors:
        copied = memo.get(id(t._local_tensor))
        if copied is not None:
            # its shard copied, its placement (the spec: mesh, placements, global shape) kept, as DCP's stager
            # keeps it (torch/distributed/checkpoint/_state_dict_stager.py)
            memo[id(t)] = type(t)(copied, t._spec, requires_grad=t.requires_grad)
    events = [e for e in (_device_event(d) for d in devices) if e is not None]
    return HostCopy(copy.deepcopy(state_dict, memo), later_pairs, events, pageable)


# --------------------------------------------------------------------------------------------
# the pending save and the writer thread
class PendingSave:
    """One ``save_state`` written in the background: its files, this rank's outcome, and (rank 0) the
    publication of the whole checkpoint."""

    def __init__(self, seq: int, tmp: str, final: str, store, rank: int, world: int):
        self.seq, self.tmp, self.final = seq, tmp, final
        self.store, self.rank, self.world = store, rank, world
        self.pid = os.getpid()  # a process forked meanwhile (a DataLoader worker) has no writer: it never waits
        self.error: str | None = None  # this rank's first failed write
        self.outcome: str | None = None  # "ok" or why the checkpoint was not published
        self.submitted = False
        self.snapshot_bytes = 0
        self.files = 0
        self.copies: list[HostCopy] = []  # filled by the writer first, before any file is written
        self.writes: list = []  # (write, what, collective): this save's writes, queued by submit() after the copies
        self.copied = threading.Event()  # every copy filled: training may change the state again
        self.waited_s = 0.0  # how long training waited for the copies (wait_for_snapshot)

    def key(self, name: str) -> str:
        return f"{_KEY}/{self.seq}/{name}"


class _Writer:
    """A thread of its own running queued jobs in order (started at the first job, kept for the next saves)."""

    def __init__(self, name: str):
        self.name = name
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.native_id: int | None = None
        self.ident: int | None = None
        self.lock = threading.Lock()

    def put(self, job) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                # a daemon: the interpreter's exit waits for it through at_exit(), not through threading's join
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
        self.jobs.put(job)

    def drain(self) -> None:
        self.jobs.join()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        self.ident = threading.get_ident()
        while True:
            job = self.jobs.get()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - every job records its own failure; this keeps the thread
                log.error("accel-npu: the checkpoint writer failed: %s", exc)
            finally:
                self.jobs.task_done()


def _set_nice(tid: int | None, nice: int) -> None:
    """Linux keeps a nice value per thread (setpriority(2) on its thread id): this sets one thread's alone."""
    if tid is None:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (AttributeError, OSError):  # not Linux; or lowering a nice value without CAP_SYS_NICE: left as it is
        pass


def _yield_to_training() -> None:
    """The writer's first job for a save: while training runs it gets only the CPU training leaves idle, or
    about 1.5 % of a busy core (its serialization, its copies into the page cache, its fsyncs)."""
    _set_nice(threading.get_native_id(), _WRITER_NICE)


def _stop_yielding() -> None:
    """Training waits for the writer now (the next checkpoint call, end_training, the exit): its priority is
    restored where the process may raise it (root, CAP_SYS_NICE), so other processes cannot starve it."""
    _set_nice(_writer.native_id, 0)


_writer = _Writer("accel-npu checkpoint writer")
# the copies training waits for are made at training's priority, on a thread of their own; kept from save to save:
# Thread.start() waits until the new thread runs, a scheduler wake-up inside save_state on a busy host
_copier = _Writer("accel-npu checkpoint copy")
_pending: PendingSave | None = None
_count = 0
_lock = threading.Lock()


def _session():
    """(store, rank, world); store None for a single process. The store is a client of the default store's own
    for the saves (the writer's "done", rank 0's outcome): the main thread's waits on the default store's client
    (a paused or idle rank's, boundary.py and serving.py) would otherwise hold the writer's requests behind them."""
    global _client
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed import distributed_c10d

        default, rank = distributed_c10d._get_default_store(), dist.get_rank()
        if _client is None or _client[0] is not default:
            _client = (default, _dist.own_client(default, rank))
        return _client[1], rank, dist.get_world_size()
    return None, 0, 1


_client = None  # (the default store, the saves' own client of it)


def begin(tmp: str, final: str) -> PendingSave:
    """A new pending save (every rank, in the same order: the store keys pair up by number)."""
    global _count, _pending
    store, rank, world = _session()
    with _lock:
        _count += 1
        _pending = PendingSave(_count, tmp, final, store, rank, world)
    _exit_hooks()
    _watch_reads()
    return _pending


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(obj, path: str, zipfile: bool) -> None:
    """``torch.save`` and fsync: a zip archive past the page cache where the filesystem takes it (direct_io.py)."""
    import torch

    if zipfile and not direct_io.refused() and direct_io.supported() and _direct_worth_it(obj):
        if not direct_io.save(obj, path):
            log.debug("accel-npu: %s refuses O_DIRECT; checkpoint files are written through the page cache", path)
        return
    torch.save(obj, path, _use_new_zipfile_serialization=zipfile)
    _fsync_file(path)


def _direct_worth_it(obj) -> bool:
    sizes = storage_sizes(tensors_of(obj))
    return direct_io.worth_it(sum(sizes.values()), len(sizes))


def queue_job(save: PendingSave, write, what: str, collective: bool = False) -> None:
    """Queue ``write()`` (a callable writing files under ``save.tmp``); its failure fails the save. A
    ``collective`` job (one every rank's writer runs in the same order, e.g. a torch.distributed.checkpoint
    save over a process group) runs even after an earlier failure, so no other rank waits for it in vain; any
    other is skipped then (one failure fails the save: the later files are not worth writing). It runs in the
    context it was queued from (save_state's): its collectives are the save's own, never the clean point after an
    optimizer step where a rank pauses for a save made on rank 0 alone (boundary.py's window is the training's)."""
    context = contextvars.copy_context()

    def job():
        if save.error is not None and not collective:
            return
        try:
            context.run(write)
        except BaseException as exc:  # noqa: BLE001 - recorded: raised at the next checkpoint call on every rank
            if save.error is None:
                save.error = f"writing {what}: {type(exc).__name__}: {exc}"

    _writer.put(job)


def queue_file(save: PendingSave, state_dict, path: str, zipfile: bool, later=frozenset()) -> None:
    """Copy ``state_dict`` to host memory (the storages in ``later`` by the writer thread, before it writes any
    file: :func:`snapshot`) and stage its file, queued at :func:`submit`; written synchronously (one warning) when
    the host cannot hold the copy."""
    nbytes = snapshot_bytes(state_dict)
    free = available_memory()
    # the copies left for the writer take their pages as it fills them: MemAvailable does not count them yet; the
    # last save's copy, kept for this one, is this save's to use
    if free is not None and save.snapshot_bytes + nbytes > (free + pooled_bytes()) * _HOST_HEADROOM:
        if _said("no room"):
            log.warning(
                "accel-npu: asynchronous save_state: %s needs a %s host copy but %s are available; "
                "it is written synchronously (so is any file that does not fit).",
                os.path.basename(path),
                _size(nbytes),
                _size(free),
            )
        try:
            write_file(state_dict, path, zipfile)
        except Exception as exc:
            save.error = f"writing {path}: {type(exc).__name__}: {exc}"
            raise
        return
    try:
        copied = snapshot(state_dict, later)
    except Exception as exc:  # noqa: BLE001 - an object deepcopy refuses: written now, as stock writes it
        log.debug("accel-npu: %s written synchronously (no copy: %s)", path, exc)
        write_file(state_dict, path, zipfile)
        return
    save.snapshot_bytes += nbytes
    save.files += 1
    save.copies.append(copied)
    save.writes.append((functools.partial(_write_copy, copied, path, zipfile), path, False))


def _write_copy(copied: HostCopy, path: str, zipfile: bool) -> None:
    write_file(copied.state_dict, path, zipfile)
    copied.release()


def fill_copies(save: PendingSave) -> None:
    """Every host copy of a save filled (before its files are written); then training may change the state."""
    try:
        for copied in save.copies:
            copied.fill()
    except BaseException as exc:  # noqa: BLE001 - recorded: raised at the next checkpoint call on every rank
        save.error = f"copying the state to host memory: {type(exc).__name__}: {exc}"
    finally:
        save.copies = []  # the queued writes hold their copies until each file is written, no longer
        save.copied.set()


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KB"


def submit(save: PendingSave, publish) -> None:
    """Every rank, after its ``save_checkpoint`` calls returned: once this rank's files are durable it says so;
    rank 0 (``publish``: a callable) then waits for every rank and publishes."""
    save.submitted = True
    _drop_pool()
    if save.copies:
        # the copies training waits for (engine_step), on the copy thread; the writer's first job waits for them
        _copier.put(functools.partial(fill_copies, save))
    else:
        save.copied.set()
    _writer.put(_yield_to_training)
    _writer.put(save.copied.wait)
    for write, what, collective in save.writes:
        queue_job(save, write, what, collective)
    save.writes = []
    if _said("size"):
        log.warning(
            "accel-npu: asynchronous save_state: rank %d holds a %s host copy of its state while its %d "
            "file(s) are written in the background (at most one save pending per rank).",
            save.rank,
            _size(save.snapshot_bytes),
            save.files,
        )
    _writer.put(lambda: _finish(save, publish))


def _finish(save: PendingSave, publish) -> None:
    if save.error is None:
        try:
            _fsync_dirs(save.tmp)
        except OSError as exc:
            save.error = f"fsync of {save.tmp}: {exc}"
    word = "ok" if save.error is None else f"rank {save.rank}: {save.error}"
    if save.store is None:
        words = [word]
    else:
        save.store.set(save.key(f"done/{save.rank}"), word)
        if save.rank != 0:
            return
        keys = [save.key(f"done/{r}") for r in range(save.world)]
        limit = write_timeout()
        # one wait, on the writer's thread: no signal to let through (each timed-out slice is a c10d warning)
        missing = set(_wait_keys(save.store, keys, limit, slice_s=limit))
        words = [
            f"rank {r}: its files were not durable after {limit:g} s (ACCEL_NPU_ASYNC_CHECKPOINT_TIMEOUT)"
            if k in missing
            else _dist.store_get(save.store, k)
            for r, k in enumerate(keys)
        ]
    failed = [w for w in words if w != "ok"]
    outcome = "ok"
    if failed:
        outcome = "; ".join(failed)
    else:
        try:
            publish()
        except BaseException as exc:  # noqa: BLE001 - recorded: raised at the next checkpoint call on every rank
            outcome = f"rank 0: publishing {save.final}: {type(exc).__name__}: {exc}"
    save.outcome = outcome
    if save.store is not None:
        save.store.set(save.key("outcome"), outcome)


def _fsync_dirs(root: str) -> None:
    for dirpath, _, _ in os.walk(root):
        _fsync_file(dirpath)


def write_timeout() -> float:
    return environment.seconds("ACCEL_NPU_ASYNC_CHECKPOINT_TIMEOUT", at_least=1)


def _wait_keys(store, keys, seconds: float, slice_s: float = _POLL_S) -> list[str]:
    """Wait (in slices of ``slice_s``) until ``keys`` are in the store; the keys still missing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not _dist.store_wait(store, keys, min(slice_s, seconds)):
        if time.monotonic() >= deadline:
            return [k for k in keys if not store.check([k])]
    return []


def wait_for_pending(raise_failure: bool = True) -> None:
    """Wait until the pending save's files are written and (every rank) its checkpoint is published or
    refused; raise :class:`CheckpointError` when it was refused. Nothing pending: returns at once."""
    global _pending
    with _lock:
        save = _pending
    if save is None or save.pid != os.getpid():  # nothing pending, or a forked child's copy of its parent's save
        return
    _stop_yielding()
    _writer.drain()
    outcome = "ok"
    if save.submitted:
        if save.store is None:
            outcome = save.outcome or "ok"
        else:
            # rank 0 writes its own files (at most the write timeout), then waits at most that long for the others;
            # the slack covers its publication, so no rank gives up on a checkpoint rank 0 still publishes
            limit = 2 * write_timeout() + 120
            if _wait_keys(save.store, [save.key("outcome")], limit):
                outcome = f"rank 0 published no outcome for {save.final} after {limit:g} s"
            else:
                outcome = _dist.store_get(save.store, save.key("outcome"))
    elif save.error is not None:
        outcome = f"rank {save.rank}: {save.error}"
    with _lock:
        if _pending is save:
            _pending = None
    if outcome != "ok" and raise_failure:
        raise CheckpointError(
            f"the asynchronous save_state into {save.final} failed ({outcome}); it was not published, and the "
            f"checkpoint that was there before is intact. Its partial files are in {save.tmp}."
        )
    if outcome != "ok":
        log.error("accel-npu: the asynchronous save_state into %s failed: %s", save.final, outcome)


# --------------------------------------------------------------------------------------------
# reads of a pending checkpoint
# A script may read the checkpoint it just saved (torch.load of a file, a listing of the folder or of the folder
# holding it) before the background write has published it. Python's audit hooks (PEP 578) see the opens and
# listings made through Python; such a read waits for the pending save first, so it finds what a synchronous
# save_state would have left. A hook cannot be removed: it is added at the first asynchronous save and does nothing
# while no save is pending.
_OPENS = frozenset({"open"})
_LISTINGS = frozenset({"os.listdir", "os.scandir"})
_reads_hooked = False
_waiting_for_read = threading.local()


def _watch_reads() -> None:
    global _reads_hooked
    if not _reads_hooked:
        _reads_hooked = True
        sys.addaudithook(_read_of_pending)


def _read_of_pending(event: str, args: tuple) -> None:
    if event not in _OPENS and event not in _LISTINGS:
        return
    save = _pending
    if save is None or not save.submitted or getattr(_waiting_for_read, "on", False) or save.pid != os.getpid():
        return
    if threading.get_ident() in (_writer.ident, _copier.ident):
        return  # the save's own files
    path = args[0] if args else None
    if path is None and event in _LISTINGS:
        path = "."
    if isinstance(path, int) or path is None:
        return
    try:
        path = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return
    final = os.path.abspath(save.final)
    inside = path == final or path.startswith(final + os.sep)
    # listing the folder that holds it: a synchronous save_state would have listed the new checkpoint there
    beside = event in _LISTINGS and path == os.path.dirname(final)
    if inside or beside:
        _waiting_for_read.on = True
        try:
            wait_for_submitted()
        finally:
            _waiting_for_read.on = False


def wait_for_submitted() -> None:
    """Wait for the pending save once save_state has handed it to the writer (never from inside that save_state)."""
    save = _pending
    if save is not None and save.submitted:
        wait_for_pending()


def wait_for_snapshot() -> None:
    """Training is about to change the state a pending save copies (the next optimizer step): wait until the
    copy is filled. Nothing pending, or filled already: returns at once."""
    save = _pending
    if save is None or save.copied.is_set() or save.pid != os.getpid():
        return
    started = time.monotonic()
    save.copied.wait()
    save.waited_s += time.monotonic() - started


_optimizer_hook = None


def wait_before_optimizer_steps() -> None:
    """From now on every torch optimizer's ``step`` (torch.optim.Optimizer's global step pre-hook) waits for a
    pending save's copies first: under FSDP2 the optimizer step is what changes the shards and states in place."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _optimizer_hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: wait_for_snapshot())


def discard() -> None:
    """The save_state that began the pending save failed before submitting it: its queued jobs finish (their
    files go into the hidden directory, never published) before the next save removes that directory; the
    staged ones are dropped."""
    global _pending
    with _lock:
        save = _pending
    if save is not None:
        save.writes, save.copies = [], []
        save.copied.set()
    _stop_yielding()
    _writer.drain()
    with _lock:
        _pending = None


class SnapshotCheckpointEngine:
    """DeepSpeed's ``CheckpointEngine`` interface over an engine's own: ``save`` snapshots and queues; every
    other call (``load``, ``makedirs``, ``is_data_parallel_writer``, ...) is the engine's own."""

    def __init__(self, inner, save: PendingSave, later=frozenset()):
        self._inner = inner
        self._save = save
        self._later = later
        self._zipfile = getattr(inner, "zipfile_serialization", True)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def create(self, info):
        return self._inner.create(info)

    def commit(self, info):
        return True  # published by rank 0 once every rank's files are durable

    def is_decoupled(self):
        return False

    def save(self, state_dict, path: str):
        queue_file(self._save, state_dict, path, self._zipfile, self._later)


def changed_only_by_step(module, optimizer) -> frozenset:
    """Keys of the host storages that only an optimizer step (or a load) changes in place: ``module``'s
    parameters (their data, ZeRO-3 partitions, FSDP2 shards) and ``optimizer``'s parameters and states (ZeRO's
    fp32 partitions are its base optimizer's parameters). Forward and backward only read them: gradients go to
    buffers of their own (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py ``step``; FSDP2 all-gathers into
    unsharded parameters of their own). Anything else a checkpoint holds (buffers, which a forward may change in
    place: BatchNorm's running statistics) is copied at save time."""
    import torch

    keys = set()

    def add(tensor) -> None:
        if isinstance(tensor, torch.Tensor):
            tensor = local_tensor(tensor)
            if tensor.device.type == "cpu" and _copyable(tensor):
                keys.add(storage_key(tensor.untyped_storage()))

    for param in module.parameters():
        add(param)
        add(getattr(param, "ds_tensor", None))
    # accelerate's wrapper, DeepSpeed's ZeRO optimizer: the base optimizer they step
    while getattr(optimizer, "optimizer", None) not in (None, optimizer):
        optimizer = optimizer.optimizer
    for group in getattr(optimizer, "param_groups", ()):
        for param in group.get("params", ()):
            add(param)
    for param, states in getattr(optimizer, "state", {}).items():
        add(param)
        for value in states.values() if isinstance(states, dict) else ():
            add(value)
    return frozenset(keys)


def _no_tag_validation() -> bool:
    return False


class engines_snapshotting:
    """While active, each DeepSpeed engine in ``models`` saves through a :class:`SnapshotCheckpointEngine`, and
    skips the check that its tag is the same on every rank: accelerate's save_state names the tags itself
    (``pytorch_model``, ``pytorch_model_1``, ...: accelerate/accelerator.py ``save_state``), the same on every
    rank, so DeepSpeed's two all-reduces of the tag's hash (engine.py ``_checkpoint_tag_validation``) cannot
    fail and only hold training up."""

    def __init__(self, models, save: PendingSave):
        self.models, self.save = list(models), save
        self.swapped: list = []

    def __enter__(self):
        from deepspeed import DeepSpeedEngine

        for model in self.models:
            inner = getattr(model, "checkpoint_engine", None)
            # a decoupled engine (DeepSpeed's own background writer) already defers its writes: left alone. DeepSpeed
            # 0.16.9, the lower bound, has neither (checkpoint_engine/checkpoint_engine.py)
            decoupled = getattr(inner, "is_decoupled", lambda: False)
            if isinstance(model, DeepSpeedEngine) and inner is not None and not decoupled():
                later = changed_only_by_step(model.module, model.optimizer)
                model.checkpoint_engine = SnapshotCheckpointEngine(inner, self.save, later)
                model.checkpoint_tag_validation_enabled = _no_tag_validation  # shadows the method, this save only
                self.swapped.append((model, inner))
        return self.save

    def __exit__(self, *exc):
        for model, inner in self.swapped:
            model.checkpoint_engine = inner
            del model.checkpoint_tag_validation_enabled
        return False


def engine_step(wrapped, instance, args, kwargs):
    """``DeepSpeedEngine.step``: an optimizer step changes in place the state a pending asynchronous
    save_state copies in the background (:func:`changed_only_by_step`); it waits for the copy first."""
    wait_for_snapshot()
    return wrapped(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# exit
_hooked = False


def _exit_hooks() -> None:
    global _hooked
    if not _hooked:
        _hooked = True
        atexit.register(at_exit)
    if at_exit not in _dist.before_group_close:
        _dist.before_group_close.append(at_exit)  # while the store is reachable through the group


def at_exit() -> None:
    """The process's exit waits for the pending save (a failure is logged: there is nobody to raise it to)."""
    if at_exit in _dist.before_group_close:
        _dist.before_group_close.remove(at_exit)
    started = time.monotonic()
    try:
        wait_for_pending(raise_failure=False)
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never raise
        log.error("accel-npu: waiting for the asynchronous save_state at exit failed: %s", exc)
    waited = time.monotonic() - started
    if waited > 1.0:
        log.warning("accel-npu: the exit waited %.1f s for the asynchronous save_state to be written", waited)

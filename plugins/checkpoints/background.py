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
- :func:`wait_for_pending` (the next ``save_state``, ``load_state``, ``end_training``, the process's exit)
  waits for the pending save and raises its failure, on every rank: the previous checkpoint is intact.

At most one save is pending per process (the next waits for it), so the host holds at most one copy of the
rank's own state. A file the host cannot hold (MemAvailable read as it is saved) is written synchronously.
"""

from __future__ import annotations

import atexit
import copy
import functools
import logging
import os
import queue
import threading
import time

from accel_npu import environment
from accel_npu._torch import dist as _dist
from accel_npu._torch.memory import available_memory
from accel_npu._torch.once import FirstTime
from accel_npu.errors import CheckpointError

log = logging.getLogger("accel_npu")

_KEY = "accel_npu/async_save"
_POLL_S = 1.0  # store waits are made in slices, so a signal still reaches a waiting main thread
_HOST_HEADROOM = 0.9  # a snapshot may take at most this share of MemAvailable; the rest is for training
_said = FirstTime()


def enabled() -> bool:
    return environment.flag("ACCEL_NPU_ASYNC_CHECKPOINT")


# --------------------------------------------------------------------------------------------
# snapshots
def _storage_key(storage):
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


def _tensors(obj, out: list, seen: set) -> None:
    """The tensors inside the containers a checkpoint's state dict is made of."""
    import torch

    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, out, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _tensors(value, out, seen)


def tensors_of(state_dict) -> list:
    """The tensors of a checkpoint's state dict, each once."""
    found: list = []
    _tensors(state_dict, found, set())
    return found


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``: each once, as ``torch.save`` writes them."""
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        sizes[_storage_key(storage)] = storage.nbytes()
    return sum(sizes.values())


def snapshot_bytes(state_dict) -> int:
    """Host bytes :func:`snapshot` would copy: each distinct storage once."""
    return storage_bytes(t for t in tensors_of(state_dict) if _copyable(t))


def snapshot(state_dict):
    """A deep copy of ``state_dict`` whose tensors live in host memory of their own: each storage copied
    once (device to host on an accelerator), and each tensor a view of its copy with the original's offset,
    shape, stride, dtype, ``requires_grad`` and Python attributes, so ``torch.save`` of the copy writes what it
    writes of the original. Other values are deep-copied (a scheduler's lists change as training goes on)."""
    import torch

    found = tensors_of(state_dict)
    memo: dict = {}
    storages: dict = {}
    for t in found:
        if not _copyable(t) or id(t) in memo:
            continue
        source = t.untyped_storage()
        key = _storage_key(source)
        copied = storages.get(key)
        if copied is None:
            copied = torch.UntypedStorage(source.nbytes(), device="cpu")
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
    return copy.deepcopy(state_dict, memo)


# --------------------------------------------------------------------------------------------
# the pending save and the writer thread
class PendingSave:
    """One ``save_state`` written in the background: its files, this rank's outcome, and (rank 0) the
    publication of the whole checkpoint."""

    def __init__(self, seq: int, tmp: str, final: str, store, rank: int, world: int):
        self.seq, self.tmp, self.final = seq, tmp, final
        self.store, self.rank, self.world = store, rank, world
        self.error: str | None = None  # this rank's first failed write
        self.outcome: str | None = None  # "ok" or why the checkpoint was not published
        self.submitted = False
        self.snapshot_bytes = 0
        self.files = 0

    def key(self, name: str) -> str:
        return f"{_KEY}/{self.seq}/{name}"


class _Writer:
    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def put(self, job) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                # a daemon: the interpreter's exit waits for it through at_exit(), not through threading's join
                self.thread = threading.Thread(target=self._run, name="accel-npu checkpoint writer", daemon=True)
                self.thread.start()
        self.jobs.put(job)

    def drain(self) -> None:
        self.jobs.join()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - every job records its own failure; this keeps the thread
                log.error("accel-npu: the checkpoint writer failed: %s", exc)
            finally:
                self.jobs.task_done()


_writer = _Writer()
_pending: PendingSave | None = None
_count = 0
_lock = threading.Lock()


def _session():
    """(store, rank, world); store None for a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def begin(tmp: str, final: str) -> PendingSave:
    """A new pending save (every rank, in the same order: the store keys pair up by number)."""
    global _count, _pending
    store, rank, world = _session()
    with _lock:
        _count += 1
        _pending = PendingSave(_count, tmp, final, store, rank, world)
    _exit_hooks()
    return _pending


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(obj, path: str, zipfile: bool) -> None:
    import torch

    torch.save(obj, path, _use_new_zipfile_serialization=zipfile)
    _fsync_file(path)


def queue_job(save: PendingSave, write, what: str, collective: bool = False) -> None:
    """Queue ``write()`` (a callable writing files under ``save.tmp``); its failure fails the save. A
    ``collective`` job (one every rank's writer runs in the same order, e.g. a torch.distributed.checkpoint
    save over a process group) runs even after an earlier failure, so no other rank waits for it in vain; any
    other is skipped then (one failure fails the save: the later files are not worth writing)."""

    def job():
        if save.error is not None and not collective:
            return
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - recorded: raised at the next checkpoint call on every rank
            if save.error is None:
                save.error = f"writing {what}: {type(exc).__name__}: {exc}"

    _writer.put(job)


def queue_file(save: PendingSave, state_dict, path: str, zipfile: bool) -> None:
    """Copy ``state_dict`` to host memory and queue its file; written synchronously (one warning) when the
    host cannot hold the copy."""
    nbytes = snapshot_bytes(state_dict)
    free = available_memory()
    if free is not None and nbytes > free * _HOST_HEADROOM:
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
        copied = snapshot(state_dict)
    except Exception as exc:  # noqa: BLE001 - an object deepcopy refuses: written now, as stock writes it
        log.debug("accel-npu: %s written synchronously (no copy: %s)", path, exc)
        write_file(state_dict, path, zipfile)
        return
    save.snapshot_bytes += nbytes
    save.files += 1
    queue_job(save, functools.partial(write_file, copied, path, zipfile), path)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KB"


def submit(save: PendingSave, publish) -> None:
    """Every rank, after its ``save_checkpoint`` calls returned: once this rank's files are durable it says so;
    rank 0 (``publish``: a callable) then waits for every rank and publishes."""
    save.submitted = True
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
        missing = set(_wait_keys(save.store, keys, limit))
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


def _wait_keys(store, keys, seconds: float) -> list[str]:
    """Wait (in slices) until ``keys`` are in the store; the keys still missing after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not _dist.store_wait(store, keys, _POLL_S):
        if time.monotonic() >= deadline:
            return [k for k in keys if not store.check([k])]
    return []


def wait_for_pending(raise_failure: bool = True) -> None:
    """Wait until the pending save's files are written and (every rank) its checkpoint is published or
    refused; raise :class:`CheckpointError` when it was refused. Nothing pending: returns at once."""
    global _pending
    with _lock:
        save = _pending
    if save is None:
        return
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


def discard() -> None:
    """The save_state that began the pending save failed before submitting it: its queued files are written
    (into the hidden directory, never published) before the next save removes that directory."""
    global _pending
    _writer.drain()
    with _lock:
        _pending = None


class SnapshotCheckpointEngine:
    """DeepSpeed's ``CheckpointEngine`` interface over an engine's own: ``save`` snapshots and queues; every
    other call (``load``, ``makedirs``, ``is_data_parallel_writer``, ...) is the engine's own."""

    def __init__(self, inner, save: PendingSave):
        self._inner = inner
        self._save = save
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
        queue_file(self._save, state_dict, path, self._zipfile)


class engines_snapshotting:
    """While active, each DeepSpeed engine in ``models`` saves through a :class:`SnapshotCheckpointEngine`."""

    def __init__(self, models, save: PendingSave):
        self.models, self.save = list(models), save
        self.swapped: list = []

    def __enter__(self):
        from deepspeed import DeepSpeedEngine

        for model in self.models:
            inner = getattr(model, "checkpoint_engine", None)
            # a decoupled engine (DeepSpeed's own background writer) already defers its writes: left alone
            if isinstance(model, DeepSpeedEngine) and inner is not None and not inner.is_decoupled():
                model.checkpoint_engine = SnapshotCheckpointEngine(inner, self.save)
                self.swapped.append((model, inner))
        return self.save

    def __exit__(self, *exc):
        for model, inner in self.swapped:
            model.checkpoint_engine = inner
        return False


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

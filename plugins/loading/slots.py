"""Staggered materialization: at most K ranks of a node read weights at once (flock'ed slot
files: a rank that dies releases its slot), K from free host memory or ACCEL_NPU_LOAD_SLOTS;
and how many threads one rank reads and casts with."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator

from accel_npu import environment
from accel_npu._torch.dist import local_world_size
from accel_npu._torch.memory import available_memory, malloc_trim
from accel_npu.errors import LoadError

log = logging.getLogger("accel_npu")


class LoadSlotTimeout(LoadError):
    """Waited longer than ACCEL_NPU_LOAD_TIMEOUT for a load slot."""


# ------------------------------------------------------------------------------------------------
def slot_count(nbytes: int) -> int | None:
    """How many ranks of this node may materialize at once; None = no staggering."""
    raw = environment.get("ACCEL_NPU_LOAD_SLOTS").strip()
    local = local_world_size()
    if raw:
        return environment.whole_number("ACCEL_NPU_LOAD_SLOTS")
    if local <= 1:
        return None
    avail = available_memory()
    if avail is None or nbytes <= 0:
        return local
    # Each loading rank needs its bytes once more transiently (read + cast); keep 20 % headroom.
    k = int(0.8 * avail // (2 * nbytes))
    return max(1, min(local, k))


def _slot_dir() -> str:
    # torchrun's default run id is "none" for every job (accelerate launch passes no --rdzv_id): the
    # rendezvous address tells this job's ranks from another job's on the same node
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or ""
    job = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    if run_id and run_id != "none":
        job = f"{run_id}-{job}"
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job)
    base = os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, f"accel-npu-load-slots-{os.getuid()}", job)
    os.makedirs(path, exist_ok=True)
    return path


def _who() -> dict:
    return {
        "pid": os.getpid(),
        "rank": os.environ.get("RANK"),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "host": socket.gethostname(),
        "since": time.time(),
    }


def _describe_holders(directory: str, slots: int) -> str:
    parts = []
    for i in range(slots):
        try:
            with open(os.path.join(directory, f"slot-{i}.holder")) as f:
                h = json.load(f)
            alive = _pid_alive(int(h["pid"]))
            parts.append(
                f"slot {i}: rank {h.get('rank')} (pid {h['pid']} on {h.get('host')}, "
                f"holding for {time.time() - float(h['since']):.0f} s{'' if alive else ', process gone'})"
            )
        except (OSError, ValueError, KeyError):
            parts.append(f"slot {i}: holder unknown")
    return "; ".join(parts)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


_held_depth = 0


@contextlib.contextmanager
def load_slot(
    nbytes: int, what: str = "weights", slots: int | None = None, timeout: float | None = None
) -> Iterator[int | None]:
    """Hold one of this node's load slots while materializing ``nbytes``.

    Yields the slot number (None when no staggering applies). A process that dies releases its
    slot (the lock is an OS file lock). Waiting longer than ``ACCEL_NPU_LOAD_TIMEOUT`` raises
    :class:`LoadSlotTimeout` naming the ranks that hold the slots.
    """
    global _held_depth
    if _held_depth:  # nested load (a model whose from_pretrained loads sub-models): already holding
        yield None
        return
    slots = slot_count(nbytes) if slots is None else slots
    if not slots:
        yield None
        return
    from filelock import FileLock, Timeout

    if timeout is None:
        timeout = environment.seconds("ACCEL_NPU_LOAD_TIMEOUT")
    directory = _slot_dir()
    locks = [FileLock(os.path.join(directory, f"slot-{i}.lock")) for i in range(slots)]
    start = time.monotonic()
    first = int(os.environ.get("LOCAL_RANK", "0") or 0) % slots
    order = [(first + i) % slots for i in range(slots)]
    held = None
    reported = False
    while held is None:
        for i in order:
            try:
                locks[i].acquire(timeout=0)
            except Timeout:
                continue
            held = i
            break
        if held is not None:
            break
        waited = time.monotonic() - start
        if waited > timeout:
            raise LoadSlotTimeout(
                f"accel-npu: rank {os.environ.get('RANK', '?')} waited {waited:.0f} s for one of {slots} load "
                f"slot(s) to load {what} and gave up; held by: {_describe_holders(directory, slots)}. "
                "A rank that hangs while loading blocks the others: check that rank's log; raise "
                "ACCEL_NPU_LOAD_TIMEOUT for very slow storage, or ACCEL_NPU_LOAD_SLOTS if memory allows."
            )
        if not reported and waited > 5:
            log.info(
                "accel-npu: rank %s waiting for a load slot (%s)",
                os.environ.get("RANK"),
                _describe_holders(directory, slots),
            )
            reported = True
        time.sleep(0.05)
    holder = os.path.join(directory, f"slot-{held}.holder")
    try:
        with open(holder, "w") as f:
            json.dump(_who(), f)
    except OSError:
        pass
    _held_depth += 1
    try:
        yield held
    finally:
        _held_depth -= 1
        locks[held].release()
        malloc_trim()


def load_threads(loading_ranks: int) -> int:
    """Threads one rank uses to cast while loading: ``ACCEL_NPU_LOAD_THREADS``, else this node's
    cores divided among the ranks loading at the same time (at most 4)."""
    if environment.get("ACCEL_NPU_LOAD_THREADS").strip():
        return environment.whole_number("ACCEL_NPU_LOAD_THREADS")
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, loading_ranks)))

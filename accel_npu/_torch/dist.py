"""torch.distributed helpers that work before, without and after a process group exists."""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import time
from datetime import timedelta

from accel_npu.errors import AccelNpuError


class CollectiveMisuseError(AccelNpuError):
    """A collective (a ZeRO-3 gather, a sharded save) entered by only some of the ranks."""


class CollectiveHooks:
    """Callbacks around every ``torch.distributed`` collective, called by the wrapper that counts them
    (plugins/hang_watch) for the plugins that must act at a rank's first collective (plugins/checkpoints:
    a rank paused at an optimizer-step boundary). ``before(name)`` runs before the collective starts and
    may raise; ``failed(exc)`` gets the collective's exception and may return a clearer one to raise
    instead (the other rank's own error, when that rank stopped on purpose). None: nothing to call."""

    __slots__ = ("before", "failed")

    def __init__(self):
        self.before = None
        self.failed = None


collective_hooks = CollectiveHooks()

_every_rank = contextvars.ContextVar("accel_npu_every_rank_collective", default=False)


@contextlib.contextmanager
def every_rank_collectives():
    """The collectives inside are made by every rank from the same call, checked beforehand (a
    :func:`rendezvous`), and change no training state: e.g. the ZeRO-3 gathers of parameters a script
    reads after an optimizer step. They are no clean point for plugins/checkpoints' step-boundary
    window (a rank-0-only save that follows in the same window is still served)."""
    token = _every_rank.set(True)
    try:
        yield
    finally:
        _every_rank.reset(token)


def every_rank_collective() -> bool:
    """Inside :func:`every_rank_collectives`."""
    return _every_rank.get()


#: callables to run at interpreter exit while the process group is still up, before any plugin closes it
#: (plugins/devices/cpu.py's atexit close re-registers itself at every PartialState(), so atexit's own order
#: cannot put them first): each runs once, from :func:`run_before_group_close`
before_group_close: list = []


def run_before_group_close() -> None:
    """Run (and forget) the :data:`before_group_close` callables; registered with atexit too, by their owners."""
    while before_group_close:
        before_group_close.pop(0)()


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size): from the process group when it is up, else the launcher's env."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def local_world_size() -> int:
    """Processes on this node (the launcher's LOCAL_WORLD_SIZE; 1 when not launched)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def is_local_main() -> bool:
    return os.environ.get("LOCAL_RANK", "0") in ("", "0")


def _store_and_world():
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return None, 1, 0
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store(), world, rank
    except Exception:  # noqa: BLE001 - no store we can use: no guard (never worse than stock)
        return None, 1, 0


def rendezvous(
    op: str, timeout: float, advice="", under: str = "DeepSpeed ZeRO", call: str = "", stock: str = ""
) -> None:
    """Return once every rank has entered ``rendezvous(op)``; else, after ``timeout`` seconds, raise
    :class:`CollectiveMisuseError` naming the ranks that did not come, with ``advice`` (a string, or
    a callable returning one, called only then: e.g. to name the caller's line). ``under`` names what
    makes ``op`` a collective here (DeepSpeed ZeRO, FSDP); ``call`` what the user called (default
    ``accelerator.<op>()``) and ``stock`` what stock does instead (default: waits or gathers to this rank).

    Uses the process group's key-value store (no collective, so it cannot hang). Calls pair up by
    *generation*, not by a per-process call count: a generation ends "done" when the last rank
    arrives, or "aborted" when a waiting rank gives up, and either way the next call of every rank
    starts a fresh one. So a misuse that a script catches (rank 0 alone) does not shift the
    pairing of the calls after it.
    """
    store, world, rank = _store_and_world()
    if store is None:
        return
    base = f"accel_npu/rendezvous/{op}"
    deadline = time.monotonic() + timeout
    while True:
        generation = int(store.add(f"{base}/generation", 0))
        key = f"{base}/{generation}"
        if store.check([f"{key}/state"]):
            time.sleep(0.01)  # that generation just ended; its finisher is advancing the counter
            continue
        store.set(f"{key}/rank{rank}", "1")
        if store.add(f"{key}/arrived", 1) >= world:
            outcome = _finish(store, base, generation, "done")
        else:
            try:
                store.wait([f"{key}/state"], timedelta(seconds=max(0.0, deadline - time.monotonic())))
                outcome = _state(store, key)
            except Exception:  # noqa: BLE001 - the store's timeout error (its type differs between torch versions)
                outcome = _finish(store, base, generation, "aborted")
        if outcome == "done":
            return
        break  # aborted: this generation was misused (possibly by another waiting rank giving up)
    present = [r for r in range(world) if store.check([f"{key}/rank{r}"])]
    missing = [r for r in range(world) if r not in present]
    if callable(advice):
        advice = advice()
    stock = stock or (
        "Stock accelerate would wait here until the process group times out, or gather the whole "
        "model into this rank's memory."
    )
    raise CollectiveMisuseError(
        f"{call or f'accelerator.{op}()'} under {under} is a collective, but only rank(s) {present} "
        f"entered it; rank(s) {missing} did not within {timeout:g} s "
        f"(ACCEL_NPU_COLLECTIVE_TIMEOUT). {stock} "
        f"{advice}"
    )


def own_client(store, rank: int):
    """A client of ``store``'s server for one thread's use (every rank calls it at the same point, once).

    A TCPStore client runs one request at a time: its connection is held through a whole ``wait``, so a thread
    sharing the default store's client waits behind another thread's waits (a background writer's "done" behind
    the main thread's minute-long wait at ``wait_for_everyone``, and the reverse). ``Store.clone`` makes one for
    this (its docstring: "one store per thread"; torch/csrc/distributed/c10d/init.cpp), keeping the prefixes
    that isolate a launch's attempts. A torch without it (2.5) gets a new TCPStore connection to the same
    server, under a prefix rank 0 draws and publishes through ``store`` (whose own prefixes it cannot read
    back). Any other store (a FileStore) is returned as it is."""
    clone = getattr(store, "clone", None)
    if clone is not None:
        return clone()
    import uuid

    import torch.distributed as dist

    tcp = store
    while isinstance(tcp, dist.PrefixStore):
        tcp = tcp.underlying_store
    if not isinstance(tcp, dist.TCPStore):
        return store
    key = "accel_npu/own_client_prefix"
    if rank == 0:
        store.set(key, uuid.uuid4().hex)
    prefix = store_get(store, key)
    client = dist.TCPStore(tcp.host, tcp.port, is_master=False, timeout=store.timeout)
    return dist.PrefixStore(f"accel_npu/{prefix}", client)


def store_wait(store, keys, seconds: float) -> bool:
    """True once ``keys`` exist in the key-value store; False after ``seconds`` (the store's timeout)."""
    try:
        store.wait(keys, timedelta(seconds=max(0.001, seconds)))
        return True
    except Exception as exc:  # the timeout error's type differs between torch versions
        if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            return False
        raise


def store_get(store, key: str) -> str:
    """A key-value store's value as text (``get`` returns bytes)."""
    value = store.get(key)
    return value.decode() if isinstance(value, bytes) else str(value)


def _state(store, key: str) -> str:
    return store.get(f"{key}/state").decode()


def _finish(store, base: str, generation: int, outcome: str) -> str:
    """End a generation as ``outcome`` unless it already ended; returns how it ended.

    The first to set the state wins (compare_set), and only the winner advances the generation.
    """
    key = f"{base}/{generation}"
    final = store.compare_set(f"{key}/state", "", outcome)
    final = final.decode() if isinstance(final, bytes) else str(final)
    if final == outcome:
        store.add(f"{base}/generation", 1)
    return final


def all_ranks_agree(flag: bool) -> bool:
    """True only when ``flag`` is true on every rank (a MIN all-reduce; plain value if not distributed)."""
    try:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([1 if flag else 0], device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())
    except Exception:  # noqa: BLE001 - never let bookkeeping break prepare
        return flag


def collective_device():
    """The device a collective's tensor must live on: CPU for gloo, this rank's device otherwise
    (HCCL/NCCL take no CPU tensors). Its callers run under DeepSpeed, whose accelerator knows it."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return "cpu"
    import deepspeed

    return deepspeed.get_accelerator().current_device_name()


#: CANN's HCCL_EXEC_TIMEOUT when unset or negative (torch_npu v7.3.1-pytorch2.7.1,
#: csrc/distributed/ProcessGroupHCCL.cpp `defaultExecTimeout`); 0 means never.
CANN_EXEC_TIMEOUT = 1836
#: HCCL itself (CANN's libhccl, not torch_npu: no such rounding is in Ascend/pytorch v7.1.0.2 .. master
#: 9e73e708a) applies HCCL_EXEC_TIMEOUT per SoC (CANN environment variable reference, HCCL_EXEC_TIMEOUT,
#: envref_07_0078, canncommercial 8.0.0 .. 9.0.0): Atlas training series (910 first generation) and
#: Atlas inference series (300I Duo, 310P) take it in steps of 68 s, at least 68 s ...
HCCL_EXEC_STEP = 68
#: ... and Atlas A2 / A3 in AIV expansion mode (HCCL_OP_EXPANSION_MODE=AIV) cap it at 1091 s, which is
#: also the value for unset and 0.
HCCL_AIV_EXEC_TIMEOUT = 1091
#: torch_npu's SocVersion names (csrc/core/npu/NpuVariables.h, v7.2.0-pytorch2.7.1 .. master) of each class
_STEPPED_SOCS = ("Ascend910PremiumA", "Ascend910ProA", "Ascend910A", "Ascend910ProB", "Ascend910B", "Ascend310P")


def _soc_class(soc: str | None) -> str:
    """ "stepped" (910 first generation, 310P), "a2a3" (910B1.., 910_93xx) or "" (unknown: as read)."""
    if not soc:
        return ""
    if soc.startswith("Ascend310P") or soc in _STEPPED_SOCS:
        return "stepped"
    if re.fullmatch(r"Ascend910B\d.*|Ascend910_93\d\d", soc):
        return "a2a3"
    return ""


def hccl_exec_timeout(env, soc: str | None = None) -> int | None:
    """Seconds after which HCCL ends a stuck collective; None for never.

    Read from ``env`` as torch_npu reads it (csrc/core/npu/register/OptionsManager.cpp
    ``GetHCCLExecTimeout``: ``strtol``, so "90.5" is 90 and "abc" is 0; negative or unset is CANN's
    default; 0 never times out), then as HCCL applies it on the SoC ``soc`` (``torch.npu.get_device_name()``,
    e.g. Ascend910A; None: not known here, the value as read): rounded down to a multiple of 68 s, at
    least 68, on 910A-class and 310P SoCs; capped at 1091 s (unset and 0 included) on A2/A3 SoCs when
    HCCL_OP_EXPANSION_MODE=AIV. AIV mode set per group through torch_npu's ``hccl_config`` is not seen here.
    """
    raw = env.get("HCCL_EXEC_TIMEOUT")
    if raw is None:
        value = CANN_EXEC_TIMEOUT
    else:
        digits = re.match(r"\s*([+-]?\d+)", raw)
        value = int(digits.group(1)) if digits else 0
        if value < 0:
            value = CANN_EXEC_TIMEOUT
    kind = _soc_class(soc)
    if kind == "stepped":
        return max(value // HCCL_EXEC_STEP, 1) * HCCL_EXEC_STEP
    if kind == "a2a3" and env.get("HCCL_OP_EXPANSION_MODE", "").strip().upper() == "AIV":
        return HCCL_AIV_EXEC_TIMEOUT if raw is None or value == 0 else min(value, HCCL_AIV_EXEC_TIMEOUT)
    return value or None


def first_timeout(timeouts) -> float | None:
    """The earliest of the timeouts that will end a stuck collective; None when none will."""
    found = [float(t) for t in timeouts if t is not None and 0 < t < 10**9]  # LLONG_MAX ms: none
    return min(found) if found else None


def default_group_timeout() -> float | None:
    """The live default group's timeout in seconds: the smallest of its store's and its backends'
    (torch_npu's ProcessGroupHCCL writes the watchdog timeout it settled on back into its options:
    csrc/distributed/ProcessGroupHCCL.cpp, ``options_->timeout``). None without a group or a timeout."""
    from torch.distributed import distributed_c10d as c10d

    found: list[float | None] = []
    try:
        found.append(c10d._get_default_store().timeout.total_seconds())
    except Exception:  # noqa: BLE001 - a store without a timeout
        pass
    try:
        pg = c10d._get_default_group()
        for device in getattr(pg, "_device_types", ()):
            timeout = getattr(getattr(pg._get_backend(device), "options", None), "_timeout", None)
            if isinstance(timeout, timedelta):
                found.append(timeout.total_seconds())
    except Exception:  # noqa: BLE001 - private API
        pass
    return first_timeout(found)

"""Rank-0-only saves of ZeRO-3 partitioned models, completed by the idle ranks.

diffusers' training scripts end with ``accelerator.wait_for_everyone(); if
accelerator.is_main_process: ...; pipeline.save_pretrained(out)``. Under ZeRO-3 with real
partitioning every rank holds 1/N of each parameter, so rank 0 alone writes shape-[0] tensors
(stock: exit 0, unloadable model). Gathering is a collective, but the other ranks are idle then
(in ``wait_for_everyone``, ``end_training``): they can join rank 0's gathers.

The protocol runs over the process group's key-value store (never a collective, so it cannot hang
on a rank that is busy elsewhere), as an ordered event log every rank reads in the same order:

- a rank that must gather while its peers may be elsewhere (``requesting()``: a partitioned
  ``save_pretrained``, ``safetensors.save_file``, ``get_state_dict``, ``save_model``) appends a
  ``gather`` event with the parameters' ``ds_id`` s, waits until every other rank acknowledged it
  (``ACCEL_NPU_COLLECTIVE_TIMEOUT``), then says ``go`` and all of them run the same DeepSpeed
  all-gather. A rank that does not come in time (it is training on: the call was made mid-training
  on rank 0 only) cancels the request: a clear error before anything is written. Ranks calling the
  same save together post identical requests and join the earliest one.
- an idle point (``wait_for_everyone``, ``end_training``) appends an arrival; the last rank to
  arrive appends ``idle_done``; until then an idle rank serves the gather requests it reads.

Requests are made one group of parameters at a time (a quarter of a shard), so no rank ever holds
more than that whole at once. Only under DeepSpeed ZeRO-3 with more than one rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import json
import logging
import time
import weakref

from accel_npu._torch.dist import CollectiveMisuseError, store_get, store_wait
from accel_npu.plugins.checkpoints import callsite
from accel_npu.plugins.checkpoints.state import collective_timeout

log = logging.getLogger("accel_npu")

_P = "accel_npu/serve"
_IDLE_LIMIT = 1800.0  # an idle rank waits for the others as long as a stock barrier would (30 min)
_requesting = contextvars.ContextVar("accel_npu_gather_requests", default=False)
_serving = contextvars.ContextVar("accel_npu_gather_serving", default=False)


class _Log:
    """This process's place in the event log of one process group."""

    def __init__(self):
        self.cursor = 1
        self.idle = 0


_logs: dict[int, _Log] = {}
_params_by_id: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def _session():
    """(store, world, rank, log) when a multi-rank process group is up, else None."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        from torch.distributed import distributed_c10d

        group = distributed_c10d._get_default_group()
        store = distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no protocol (stock behaviour)
        return None
    return store, dist.get_world_size(), dist.get_rank(), _logs.setdefault(id(group), _Log())


#: called with the store before this process appends an event (boundary.py: rank 0 inside a step window
#: tells the waiting ranks to read the log rather than just go on)
before_append = None


def _append(store, event: dict) -> int:
    if before_append is not None:
        before_append(store)
    seq = int(store.add(f"{_P}/seq", 1))
    store.set(f"{_P}/ev/{seq}", json.dumps(event))
    return seq


def _read(store, i: int, seconds: float) -> dict | None:
    if not store_wait(store, [f"{_P}/ev/{i}"], seconds):
        return None
    return json.loads(store_get(store, f"{_P}/ev/{i}"))


def _state(store, i: int) -> str | None:
    key = f"{_P}/ev/{i}/state"
    return store_get(store, key) if store.check([key]) else None


def _decide(store, i: int, outcome: str) -> str:
    final = store.compare_set(f"{_P}/ev/{i}/state", "", outcome)
    return final.decode() if isinstance(final, bytes) else str(final)


# --------------------------------------------------------------------------------------------
# parameters by ds_id (the same on every rank: DeepSpeed numbers them in construction order)
def is_partitioned(param) -> bool:
    """A ZeRO-3 parameter whose data is not on this rank whole right now."""
    if not hasattr(param, "ds_id"):
        return False
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def _params_for(ids: list[int]):
    """(params, problem): this rank's parameters with these ds_ids, or why they cannot be served."""
    missing = [i for i in ids if i not in _params_by_id]
    if missing:
        import torch

        for obj in gc.get_objects():  # once per unseen id: partitioned parameters are few objects
            if isinstance(obj, torch.nn.Parameter) and hasattr(obj, "ds_id"):
                _params_by_id[obj.ds_id] = obj
        missing = [i for i in ids if i not in _params_by_id]
    if missing:
        return None, f"rank has no ZeRO-3 parameter with ds_id {missing[:5]}"
    params = [_params_by_id[i] for i in ids]
    busy = [p.ds_id for p in params if not is_partitioned(p) and not getattr(p, "ds_persist", False)]
    if busy:
        return None, f"parameters {busy[:5]} are gathered on this rank already (it is inside a forward or a gather)"
    return params, None


# --------------------------------------------------------------------------------------------
# the requesting side
@contextlib.contextmanager
def requesting():
    """Inside, every DeepSpeed gather of partitioned parameters is announced to the other ranks
    first, so idle ones join it (see the module docstring)."""
    token = _requesting.set(True)
    try:
        yield
    finally:
        _requesting.reset(token)


def _ack_and_wait(store, i: int, rank: int, problem: str | None) -> str:
    store.set(f"{_P}/ev/{i}/ack/{rank}", problem or "ok")
    while not store_wait(store, [f"{_P}/ev/{i}/state"], _IDLE_LIMIT):
        pass
    return store_get(store, f"{_P}/ev/{i}/state")


def before_gather(params, modifier_rank=None, fetch: bool = False) -> None:
    """Called where ``deepspeed.zero.GatheredParameters(params, modifier_rank)`` is about to start
    in :func:`requesting` mode: returns once every other rank will run the same one, else raises
    before any collective starts. Every parameter is named, persistent ones too: with a
    modifier rank the exit broadcasts them all. With ``fetch``, the gather is a ZeRO-3 forward's
    fetch of a submodule's parameters (``PartitionedParameterCoordinator.fetch_sub_module``: one
    ``all_gather_coalesced``), which the others join with the same call (:func:`_serve_fetch`)."""
    if _serving.get() or not _requesting.get():
        return
    sess = _session()
    if sess is None:
        return
    store, world, rank, lg = sess
    ids = sorted({p.ds_id for p in params if hasattr(p, "ds_id")})
    if not ids or (modifier_rank is None and not any(is_partitioned(p) for p in params)):
        return  # nothing to gather and no broadcast on exit: no collective at all
    for p in params:
        if hasattr(p, "ds_id"):
            _params_by_id[p.ds_id] = p
    event = {"kind": "gather", "rank": rank, "ids": ids, "modifier": modifier_rank}
    if fetch:
        event["fetch"] = True
    seq = _append(store, event)
    timeout = collective_timeout()
    # events before mine: another rank making the same request first (every rank saves together)
    while lg.cursor < seq:
        i = lg.cursor
        ev = _read(store, i, timeout)
        if ev is None:
            break  # an appender died between add and set: handled below as a missing ack
        lg.cursor += 1
        if (
            ev["kind"] == "gather"
            and ev["rank"] != rank
            and ev["ids"] == ids
            and not fetch
            and not ev.get("fetch")
            and _state(store, i) is None
        ):
            _decide(store, seq, "cancelled")
            if _ack_and_wait(store, i, rank, None) != "go":
                raise CollectiveMisuseError(
                    f"a gather of ZeRO-3 parameters started by rank {ev['rank']} was "
                    "cancelled: some rank did not come (see that rank's error)"
                )
            return
    lg.cursor = max(lg.cursor, seq + 1)
    others = [r for r in range(world) if r != rank]
    acks = [f"{_P}/ev/{seq}/ack/{r}" for r in others]
    store_wait(store, acks, timeout)
    came = [r for r, k in zip(others, acks) if store.check([k])]
    problems = {r: store_get(store, f"{_P}/ev/{seq}/ack/{r}") for r in came}
    problems = {r: v for r, v in problems.items() if v != "ok"}
    if len(came) == len(others) and not problems and _decide(store, seq, "go") == "go":
        return
    _decide(store, seq, "cancelled")
    missing = [r for r in others if r not in came]
    where = callsite.describe(
        "a forward of a ZeRO-3 partitioned model" if fetch else "a save of a ZeRO-3 partitioned model"
    )
    if problems:
        reason = "; ".join(f"rank {r}: {v}" for r, v in problems.items())
        raise CollectiveMisuseError(
            f"cannot gather the ZeRO-3 partitioned parameters {ids[:5]}...: {reason}. Nothing was written."
        )
    if fetch:
        raise CollectiveMisuseError(
            f"{where + ': ' if where else ''}the model's parameters are ZeRO-3 partitions (each rank holds 1/{world}); "
            f"a forward on rank {rank} alone needs the other ranks to join its gathers, but rank(s) {missing} did not "
            f"reach their next batch, collective or idle point within {timeout:g} s (ACCEL_NPU_COLLECTIVE_TIMEOUT). "
            f"Run it on every rank (`if accelerator.is_main_process or accelerator.distributed_type == "
            f"DistributedType.DEEPSPEED:`)."
        )
    raise CollectiveMisuseError(
        f"{where + ': ' if where else ''}the model's parameters are ZeRO-3 partitions (each rank holds 1/{world}); "
        f"saving them on rank {rank} alone needs the other ranks to join the gather, but rank(s) {missing} did not "
        f"reach an idle point (wait_for_everyone, end_training) within {timeout:g} s "
        f"(ACCEL_NPU_COLLECTIVE_TIMEOUT): they are still training. Nothing was written. Save after "
        f"accelerator.wait_for_everyone(), or call it on every rank "
        f"(`if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:`)."
    )


# --------------------------------------------------------------------------------------------
# the idle side
def idle(point: str) -> None:
    """Wait until every rank reached an idle point, serving the gathers other ranks request."""
    sess = _session()
    if sess is None:
        return
    store, world, rank, lg = sess
    lg.idle += 1
    generation = lg.idle
    if int(store.add(f"{_P}/idle/{generation}", 1)) >= world:
        _append(store, {"kind": "idle_done", "generation": generation})
    started = time.monotonic()
    while True:
        i = lg.cursor
        ev = _read(store, i, 60.0)
        if ev is None:
            if time.monotonic() - started > _IDLE_LIMIT:
                raise CollectiveMisuseError(f"{point}: not every rank reached it within {_IDLE_LIMIT:g} s")
            continue
        lg.cursor += 1
        if ev["kind"] == "idle_done":
            return
        if ev["kind"] == "gather":
            serve_gather(store, i, ev, rank)


def serve_gather(store, i: int, ev: dict, rank: int) -> None:
    """Join the gather event ``i`` another rank requested (an idle or paused rank), unless it ended."""
    if ev["rank"] != rank and _state(store, i) is None:
        params, problem = _params_for(ev["ids"])
        if _ack_and_wait(store, i, rank, problem) == "go" and params is not None:
            if ev.get("fetch"):
                _serve_fetch(params)
            else:
                _serve(params, ev.get("modifier"))


def in_request() -> bool:
    """Inside :func:`requesting` or serving a request: the collectives are the protocol's own."""
    return _requesting.get() or _serving.get()


def _serve(params, modifier_rank) -> None:
    import deepspeed

    token = _serving.set(True)
    try:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank):
            pass
    finally:
        _serving.reset(token)


def _serve_fetch(params) -> None:
    """Join a forward's fetch on the requesting rank: the one ``all_gather_coalesced`` that DeepSpeed's
    ``PartitionedParameterCoordinator.__all_gather_params_`` makes for a submodule's partitioned parameters
    (both sort them by ds_id), then drop the gathered data again (``partition`` frees it, no collective)."""
    token = _serving.set(True)
    try:
        params[0].all_gather_coalesced(params).wait()
        params[0].partition(param_list=params, has_been_updated=False)
    finally:
        _serving.reset(token)


def zero3_multi_rank() -> bool:
    """accelerate runs DeepSpeed ZeRO-3 on more than one rank (every rank agrees)."""
    try:
        from accelerate.state import AcceleratorState, is_initialized
        from accelerate.utils import DistributedType

        if not is_initialized():
            return False
        state = AcceleratorState()
        if state.distributed_type != DistributedType.DEEPSPEED or state.num_processes < 2:
            return False
        plugin = state.deepspeed_plugin
        return plugin is not None and int(plugin.zero_stage or 0) == 3
    except Exception:  # noqa: BLE001 - not decidable: stock behaviour
        return False


def gathered_enter(wrapped, instance, args, kwargs):
    if getattr(instance, "enabled", False):
        before_gather(instance.params, instance.src_rank)
    return wrapped(*args, **kwargs)


def pin(params) -> tuple:
    """Strong references to these ZeRO-3 parameters (and known by ds_id): a rank that serves rank 0 at
    the end of the script does so after the script's own references are gone."""
    pinned = tuple(p for p in params if hasattr(p, "ds_id"))
    for p in pinned:
        _params_by_id[p.ds_id] = p
    return pinned

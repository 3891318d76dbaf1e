"""Rank-0-only saves at an optimizer-step boundary, completed by the other ranks.

diffusers' official training scripts (v0.40.0's train_*.py) checkpoint with
``if accelerator.is_main_process: accelerator.save_state(path)`` right after the optimizer step.
Under DeepSpeed ``save_state`` is collective (every rank's ``engine.save_checkpoint`` writes its
own shards): stock hangs there (diffusers #2606). But every rank has just finished the same
``step()``, and until a rank draws its next batch or enters its next collective, its model,
optimizer, scheduler and RNG states are exactly what the checkpoint must hold. So:

- after each optimizer step (``Accelerator.backward`` with ``sync_gradients`` under DeepSpeed, whose
  engine steps inside backward; the script's ``optimizer.step()`` under FSDP, where save_state is
  collective too) a *window* opens on every rank;
- a rank other than 0 closes its window at its first clean point: its next batch from a prepared
  DataLoader (a new epoch's ``__iter__`` included: it synchronises RNG states, a collective), its
  first collective, or an idle point (``wait_for_everyone``, ``end_training``). There it *pauses*:
  it reads the process group's event log (``serving.py``, over the TCPStore) and serves what rank 0
  does alone (its ``save_state``, by calling ``save_state`` itself with the same arguments, so it
  writes its own shards and RNG states as of the step boundary; gathers of ZeRO-3 partitions)
  until rank 0 posts ``release``;
- rank 0 never waits: at its own clean point it sets the window's ``release`` key to ``go`` (one
  store write); when it has appended events in the window (a save_state, a gather), it marks the
  key ``log`` first and appends ``release`` to the log instead;
- ``wait_for_everyone`` closes the window and opens a new one after its barrier: every rank is there
  with nothing in flight, so a save rank 0 makes alone right after it (train_llada2.py's
  ``wait_for_everyone(); if accelerator.is_main_process: model.save_pretrained(...)``, the other rank
  training on) is served at the other ranks' next clean point, the end of the script included
  (an atexit hook: the others' clean point when they simply finish).

A ``save_state`` rank 0 makes outside a window (mid-step), or one the others do not come to in
``ACCEL_NPU_COLLECTIVE_TIMEOUT`` seconds, fails as before (``state.rendezvous``) and is published
as ``abort``: a paused rank raises the same error, and a rank whose collective fails because
rank 0 stopped raises it instead of gloo's "Connection closed by peer". A ZeRO-3 forward rank 0 runs
alone inside its window from a line under ``if accelerator.is_main_process:`` (train_unconditional.py
samples with DDPMPipeline after the epoch's wait_for_everyone) is served too: each submodule's
parameter fetch is announced as a ``fetch`` gather the paused ranks join with their partitions
(prefetching is off meanwhile, so the fetches are exactly those); the release after the submodule
stays local, and the coordinator's trace is put back as it was when the window closes, so every
rank's next step fetches (and prefetches) alike. Any other collective rank 0 enters there (one
that cannot be served: a quantized or hpZ fetch, an all_reduce) is refused before it starts: the
others could only answer it with the collectives of their next step.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import sys
import time
import weakref

from accel_npu._torch import dist as _dist
from accel_npu._torch.callsite import guarded_caller
from accel_npu._torch.dist import CollectiveMisuseError
from accel_npu._torch.markers import STEPS_AT_OPTIMIZER_STEP
from accel_npu.patching.arguments import argument
from accel_npu.plugins.checkpoints import background, callsite, data_order, serving

log = logging.getLogger("accel_npu")

_ABORT_KEY = "accel_npu/boundary/abort"
_ACK_WAIT_S = 5.0
_EXIT_WAIT_S = 10.0  # rank 0 at exit, for the others to read its last release (a peer that died is not waited for)
_inside = contextvars.ContextVar("accel_npu_boundary_inside", default=False)


class _Window:
    """This process's view of the optimizer-step boundaries."""

    def __init__(self):
        self.enabled: bool | None = None  # DeepSpeed or FSDP with more than one rank (decided at the first backward)
        self.fsdp = False  # the boundary is after the optimizer step the script calls, not inside backward
        self.main = False
        self.step = 0  # optimizer steps this process finished
        self.open = False  # between the last step and this process's next clean point
        self.saves = 0  # save_state calls made (or served) within the current window
        self.logged = False  # rank 0 appended events to the log within the current window
        self.accelerator = None  # weak reference, for the save_state a paused rank serves
        self.opened_by = "an optimizer step"  # what opened the current window (for the error messages)
        self.pins = False  # a rank other than 0 under ZeRO-3: it may serve rank 0's gathers at its exit
        self.pinned = ()  # its prepared models' ZeRO-3 parameters, kept servable after the script drops them
        self.pinned_for = ()  # ids of the models pinned: re-pinned when the prepared models change
        self.traces = {}  # rank 0: id(coordinator) -> (coordinator, its trace as the window opened) (served forwards)
        self.read = []  # rank 0: partitioned parameters its script read alone in the window, gathered (served reads)


_w = _Window()


def _decide(accelerator) -> bool:
    from accelerate.utils import DistributedType

    sess = serving._session()
    _w.enabled = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP) and sess is not None
    _w.fsdp = accelerator.distributed_type == DistributedType.FSDP
    if _w.enabled:
        _w.main = sess[2] == 0
        if _w.main:
            serving.before_append = _mark_logged
        _dist.collective_hooks.before = _before_collective
        _dist.collective_hooks.failed = collective_failed
        _w.pins = not _w.main and serving.zero3_multi_rank()
        atexit.register(_at_exit)  # and before a plugin closes the group at exit:
        _dist.before_group_close.append(_at_exit)
    return _w.enabled


def before_backward(accelerator) -> bool:
    """Whether the window applies to this run (decided once; installs the collective hooks)."""
    enabled = _w.enabled
    return _decide(accelerator) if enabled is None else enabled


def after_backward(accelerator) -> None:
    """A backward that syncs gradients finished on this rank. Under DeepSpeed the optimizer step ran in it:
    open the window; under FSDP it comes with the script's ``optimizer.step()`` (after_optimizer_step), and so
    for an engine over several models prepared together (it calls back after its step)."""
    if _w.accelerator is None or _w.accelerator() is not accelerator:
        _w.accelerator = weakref.ref(accelerator)
    _pin_prepared_models(accelerator)
    _hook_forwards(accelerator)
    after_step = getattr(getattr(accelerator, "deepspeed_engine_wrapped", None), "__dict__", {}).get(
        STEPS_AT_OPTIMIZER_STEP
    )
    if after_step is not None:  # an engine that steps at the script's optimizer.step() (several models in one)
        if _after_engine_step not in after_step:
            after_step.append(_after_engine_step)
        return
    if not _w.fsdp:
        open_window()


_forward_hooked: weakref.WeakSet = weakref.WeakSet()


def _hook_forwards(accelerator) -> None:
    """The next forward of a prepared ZeRO-3 engine is a clean point, before its first gather: a script that draws
    its batches outside a prepared DataLoader (diffusers' LCM *_wds.py scripts: webdataset) otherwise pauses
    inside ZeRO-3's fetch of its first layer, whose parameters DeepSpeed already marked in flight, and the
    save it serves there fails ("expected to be released", partitioned_param_coordinator.py
    release_and_reset_all)."""
    for model in getattr(accelerator, "_models", ()):
        if model not in _forward_hooked:
            _forward_hooked.add(model)
            partitioned = getattr(model, "zero_optimization_partition_weights", None)
            if partitioned is not None and partitioned():  # a ZeRO-2 forward makes no collective: not a clean point
                model.register_forward_pre_hook(_before_forward, prepend=True)


def _before_forward(module, args):
    if _w.open:
        _before_collective(
            "the forward of a prepared model (its ZeRO-3 / FSDP gathers)", point="the next forward of a prepared model"
        )


def _after_engine_step() -> None:
    if _w.enabled:
        open_window()


def _pin_prepared_models(accelerator) -> None:
    """On a rank that may serve at its exit: hold the prepared models' parameters (the latest ones only:
    after ``free_memory`` and a new ``prepare`` the earlier models are let go)."""
    if not _w.pins:
        return
    models = tuple(getattr(accelerator, "_models", ()))
    ids = tuple(id(m) for m in models)
    if ids != _w.pinned_for:
        _w.pinned = serving.pin([p for m in models for p in m.parameters()])
        _w.pinned_for = ids


def after_optimizer_step() -> None:
    if _w.fsdp:
        open_window()


def open_window(by: str = "an optimizer step") -> None:
    """Open a window (after an optimizer step, or when an epoch's batches ran out: the state is still the
    last step's). Every rank opens the same windows in the same order: their number is the window's name."""
    _w.step += 1
    _w.open = True
    _w.opened_by = by
    _w.saves = 0
    _w.logged = False


def _release_key(step: int) -> str:
    return f"{serving._P}/release/{step}"


def _mark_logged(store) -> None:
    """Rank 0 is about to append an event inside its window: the waiting ranks must read the log
    (until ``release``) instead of going on at the window's one-key ``go``."""
    if _w.open and not _w.logged:
        _w.logged = True
        store.compare_set(_release_key(_w.step), "", "log")


def window_open() -> bool:
    return _w.open


@contextlib.contextmanager
def inside_save():
    """Collectives and idle points inside a save are the save's own, never a clean point."""
    token = _inside.set(True)
    try:
        yield
    finally:
        _inside.reset(token)


def clean_point(where: str) -> None:
    """This rank reached a clean point (``where``): close the window. Rank 0 releases the others;
    another rank pauses and serves rank 0 until it does."""
    if not _w.open or _inside.get():
        return
    _w.open = False
    _restore_traces()
    sess = serving._session()
    if sess is None:
        return
    store, world, rank, lg = sess
    if rank == 0:
        if not _w.logged:
            store.set(_release_key(_w.step), "go")  # the usual step: one store write
            return
        seq = serving._append(store, {"kind": "release", "step": _w.step})
        if lg.cursor == seq:
            lg.cursor = seq + 1  # its own event: nothing for this rank to read
        return
    _pause(store, rank, lg, where)


def _wait_limit() -> float:
    """How long a paused rank waits for rank 0: as long as a stock collective would, the script's own
    process-group timeout where it set a longer one (``InitProcessGroupKwargs(timeout=...)``:
    train_unconditional.py's 7200 s for rank 0's sampling), else 30 minutes."""
    accelerator = _w.accelerator() if _w.accelerator is not None else None
    timeout = getattr(getattr(accelerator, "init_handler", None), "timeout", None)
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else 0.0
    return max(serving._IDLE_LIMIT, seconds)


def _pause(store, rank, lg, where: str) -> None:
    step = _w.step
    started = time.monotonic()
    limit = _wait_limit()
    key = _release_key(step)
    while not _dist.store_wait(store, [key], 60.0):
        if time.monotonic() - started > limit:
            raise CollectiveMisuseError(
                f"rank {rank} waited {limit:g} s at {where} after optimizer "
                f"step {step} for rank 0 to reach its next batch or collective"
            )
    if _dist.store_get(store, key) == "go":
        return
    while True:  # rank 0 serves something in this window: read the log until its release
        i = lg.cursor
        ev = serving._read(store, i, 60.0)
        if ev is None:
            if time.monotonic() - started > limit:
                raise CollectiveMisuseError(
                    f"rank {rank} waited {limit:g} s at {where} after optimizer "
                    f"step {step} for rank 0 to reach its next batch or collective"
                )
            continue
        lg.cursor += 1
        kind = ev["kind"]
        if kind == "release" and ev["step"] >= step:
            return
        if kind == "abort":
            _acknowledge(store, rank)
            raise CollectiveMisuseError(ev["message"])
        if kind == "gather":
            serving.serve_gather(store, i, ev, rank)
        elif (
            kind == "save_state" and ev["step"] == step and ev["index"] > _w.saves and serving._state(store, i) is None
        ):
            _w.saves = ev["index"]
            accelerator = _w.accelerator() if _w.accelerator is not None else None
            if accelerator is None:
                raise CollectiveMisuseError(
                    "rank 0 saves at an optimizer-step boundary, but this rank's Accelerator is gone"
                )
            accelerator.save_state(ev["output_dir"], safe_serialization=ev["safe"], **ev["kwargs"])


def announce_save_state(output_dir, safe_serialization, kwargs) -> int | None:
    """Called on every rank as ``save_state`` starts. Inside rank 0's window, tell the others (a paused
    rank calls save_state itself with these arguments; one that calls it on its own skips it).
    Returns the event's number (to cancel it if the save fails), else None."""
    if not _w.enabled or not _w.open:
        return None
    _w.saves += 1
    if not _w.main:
        return None
    import json

    event = {
        "kind": "save_state",
        "step": _w.step,
        "index": _w.saves,
        "output_dir": None if output_dir is None else str(output_dir),
        "safe": safe_serialization,
        "kwargs": kwargs,
    }
    try:
        json.dumps(event)
    except (TypeError, ValueError):
        return None  # arguments another process cannot be given: the others must call it themselves
    sess = serving._session()
    if sess is None:
        return None
    store, _, _, lg = sess
    seq = serving._append(store, event)
    if lg.cursor == seq:
        lg.cursor = seq + 1
    return seq


def save_failed(seq: int | None, error: Exception) -> None:
    """Rank 0's save_state failed: cancel its announcement and publish the error to the others."""
    sess = serving._session()
    if sess is None:
        return
    store, _, rank, lg = sess
    if seq is not None:
        serving._decide(store, seq, "cancelled")
    publish_abort(str(error))


def publish_abort(message: str) -> None:
    sess = serving._session()
    if sess is None:
        return
    store, world, rank, lg = sess
    try:
        store.set(_ABORT_KEY, message)
        if rank == 0:  # a rank waiting for this window's (or the next one's) release reads the log
            for step in (_w.step, _w.step + 1):
                store.compare_set(_release_key(step), "", "log")
            _w.logged = True
        seq = serving._append(store, {"kind": "abort", "rank": rank, "message": message})
        if lg.cursor == seq:
            lg.cursor = seq + 1
        # a launcher ends every rank once one has failed: give a paused rank (or one whose collective
        # failed) a moment to raise this error itself before this one does
        _dist.store_wait(store, [f"{_ABORT_KEY}/ack/{r}" for r in range(world) if r != rank], _ACK_WAIT_S)
    except Exception:  # noqa: BLE001 - the error itself is what matters; the others fail as stock would
        pass


def _acknowledge(store, rank: int) -> None:
    try:
        store.set(f"{_ABORT_KEY}/ack/{rank}", "1")
    except Exception:  # noqa: BLE001 - the rank that published it may be gone
        pass


# --------------------------------------------------------------------------------------------
# collectives
def _before_collective(name: str, point: str = "") -> None:
    if not _w.open or _inside.get() or serving.in_request() or _dist.every_rank_collective():
        return
    if _w.main:
        site, guard = _guarded_caller()
        if guard is not None:
            _w.open = False
            message = (
                f"{site[0]}:{site[1]} enters {name}, a collective, inside `{guard[1]}` (line {guard[0]}) "
                f"right after {_w.opened_by}: under DeepSpeed ZeRO or FSDP (a sharded model gathers its layers) "
                f"the other ranks cannot join it: they go on to the next step's collectives. Stock accelerate "
                f"waits here until the process group times out. Fix (one line): {site[0]}:{guard[0]}: "
                f"`{callsite.FIX.replace('DEEPSPEED', 'FSDP') if _w.fsdp else callsite.FIX}` "
                f"(from accelerate.utils import DistributedType), so every rank runs it."
            )
            error = CollectiveMisuseError(message)
            publish_abort(message)
            raise error
    clean_point(point or f"torch.distributed.{name}")


# --------------------------------------------------------------------------------------------
# a ZeRO-3 forward rank 0 runs alone in its window
_CO = "_PartitionedParameterCoordinator__"
#: what a forward changes in DeepSpeed's PartitionedParameterCoordinator that outlives it: the recorded trace
#: (runtime/zero/partitioned_param_coordinator.py: trace_prologue invalidates it when the module order differs,
#: reset_step then records a new one with assert_ints_same_as_other_ranks, a collective); the rest is reset at
#: the start of every forward (reset_step)
_TRACE = ("trace_mode", "submodule_order", "param_order", "step_id_module_fetched_for")


def _servable_fetch(coordinator, sub_module):
    """The partitioned parameters DeepSpeed's fetch of ``sub_module`` gathers (a list, maybe empty) when
    that is one plain ``all_gather_coalesced`` the other ranks can join; None when it is not (quantized
    weights, hpZ secondary partitions, NVMe, a fetch already in flight)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if getattr(coordinator, "zero_quantized_weights", False) or getattr(
        coordinator, "zero_quantized_nontrainable_weights", False
    ):
        return None
    params = list(ppc.iter_params(sub_module, recurse=ppc.z3_leaf_module(sub_module)))
    if any(p.ds_status == ZeroParamStatus.INFLIGHT for p in params):
        return None
    fetch = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    if any(
        p.ds_secondary_tensor is not None
        or hasattr(p.ds_tensor, "ds_quant_scale")
        or getattr(p, "nvme_swapper", None) is not None
        for p in fetch
    ):
        return None
    return fetch


def _keep_trace(offload, coordinator) -> None:
    if id(coordinator) not in _w.traces and all(hasattr(coordinator, _CO + f) for f in _TRACE):
        _w.traces[id(coordinator)] = (offload, coordinator, {f: getattr(coordinator, _CO + f) for f in _TRACE})


def _release(offload, coordinator) -> None:
    """Partition again what rank 0's forward left gathered: with a complete trace DeepSpeed keeps a parameter
    its trace reuses soon (in the backward that follows a training forward: __params_to_release,
    stage3_max_reuse_distance), and a forward alone has none. Left gathered, rank 0 would skip gathers the
    others make (its next step's fetches, a save's GatheredParameters). Local: partition() frees the data."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    release = getattr(coordinator, _CO + "release_param")
    for p in offload.module.parameters():
        if (
            p.ds_status == ZeroParamStatus.AVAILABLE
            and not getattr(p, "ds_persist", False)
            and not p.ds_active_sub_modules
            and not getattr(p, "_ds_z3_gathered_param_context_depth", 0)
        ):
            release(p)


def _restore_traces() -> None:
    """Rank 0's window closes: its coordinators' traces as they were before the forwards it ran alone
    (the others' are untouched), so the next step's fetches and prefetches pair up on every rank; the
    parameters it read alone partitioned again."""
    _release_read()
    traces, _w.traces = _w.traces, {}
    for offload, coordinator, trace in traces.values():
        _release(offload, coordinator)
        for field, value in trace.items():
            setattr(coordinator, _CO + field, value)


def pre_sub_module_forward(wrapped, instance, args, kwargs):
    """``DeepSpeedZeRoOffload.pre_sub_module_forward_function``: on rank 0, in its window, from a line under
    ``if accelerator.is_main_process:``, the submodule's fetch is announced so the paused ranks join it."""
    if not (_w.open and _w.main) or _inside.get() or serving.in_request():
        return wrapped(*args, **kwargs)
    _site, guard = _guarded_caller()
    if guard is None:
        return wrapped(*args, **kwargs)
    coordinator = instance.get_param_coordinator()
    sub_module = argument(args, kwargs, 0, "sub_module")
    params = _servable_fetch(coordinator, sub_module)
    if params is None or not all(hasattr(coordinator, _CO + a) for a in ("prefetch_bucket_sz", "release_param")):
        return wrapped(*args, **kwargs)  # not servable: the collective hook refuses its gather, naming the line
    _keep_trace(instance, coordinator)
    if sub_module is instance.module:  # the whole forward: what it leaves gathered goes when it ends

        def after(*_):
            handle.remove()
            _release(instance, coordinator)

        handle = sub_module.register_forward_hook(after, always_call=True)
    # prefetching would gather the next submodules' parameters in this call too, unannounced
    prefetch = getattr(coordinator, _CO + "prefetch_bucket_sz")
    setattr(coordinator, _CO + "prefetch_bucket_sz", 0)
    try:
        if not params:
            return wrapped(*args, **kwargs)  # nothing to gather (a stray collective still meets the hook)
        with serving.requesting():
            serving.before_gather(params, None, fetch=True)
            return wrapped(*args, **kwargs)
    finally:
        setattr(coordinator, _CO + "prefetch_bucket_sz", prefetch)


# --------------------------------------------------------------------------------------------
# a ZeRO-3 parameter rank 0 reads alone in its window
def parameter_read(wrapped, instance, args, kwargs):
    """``ZeROOrderedDict.__getitem__`` (a module's ``self.weight``): on rank 0, in its window, outside a forward,
    from a line under ``if accelerator.is_main_process:``, a partitioned parameter is gathered, the paused ranks
    joining (a ``fetch`` gather, as a served forward's), and stays whole on rank 0 until its window closes.

    diffusers v0.40.0's custom_diffusion/train_custom_diffusion.py saves its new token's embedding after the
    final ``wait_for_everyone`` on the main process alone (save_new_embed: ``get_input_embeddings().weight[x]``,
    lines 311-317): under ZeRO-3 that weight is a shape-[0] partition ("index 85 is out of bounds for dimension 0
    with size 0"). Its rows, sliced or copied while it is whole, keep their values after it is partitioned again
    (partitioning replaces the parameter's ``.data``; a slice keeps the gathered storage)."""
    param = wrapped(*args, **kwargs)
    if not (_w.open and _w.main) or _inside.get() or serving.in_request() or not serving.is_partitioned(param):
        return param
    if getattr(instance, "_in_forward", False) or getattr(
        getattr(getattr(instance, "_parent_module", None), "_parameters", None), "_in_forward", False
    ):
        return param  # a forward's own read: DeepSpeed gathers it (external parameters)
    _site, guard = guarded_caller(sys._getframe(1))
    if guard is None or not _servable_read(param):
        return param  # every rank reads it (their own partitions, as stock), or a fetch the others cannot join
    with serving.requesting():
        serving.before_gather([param], None, fetch=True)
        param.all_gather_coalesced([param]).wait()  # what the paused ranks run (serving._serve_fetch)
    _w.read.append(param)
    return param


def _servable_read(param) -> bool:
    """One plain ``all_gather_coalesced`` the others join: not quantized, no hpZ secondary partition, not on NVMe."""
    return (
        getattr(param, "ds_secondary_tensor", None) is None
        and not hasattr(param.ds_tensor, "ds_quant_scale")
        and getattr(param, "nvme_swapper", None) is None
    )


def _release_read() -> None:
    """Partition again what rank 0 read alone (local: partition() frees the data), unless a forward or a gather
    holds it now."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    read, _w.read = _w.read, []
    for p in read:
        if (
            p.ds_status == ZeroParamStatus.AVAILABLE
            and not p.ds_active_sub_modules
            and not getattr(p, "_ds_z3_gathered_param_context_depth", 0)
        ):
            p.partition(param_list=[p], has_been_updated=False)


def _guarded_caller():
    """((file, line), guard) of the innermost script frame under ``if ...is_main_process...:`` (a
    helper the script calls there counts too: log_validation(...)), else (None, None)."""
    return guarded_caller(sys._getframe(2))


def collective_failed(exc: Exception):
    """A collective failed: if another rank stopped with an accel-npu error, that error."""
    if isinstance(exc, CollectiveMisuseError):
        return None
    try:
        store, world, rank = _dist._store_and_world()
        if store is None or not store.check([_ABORT_KEY]):
            return None
        value = store.get(_ABORT_KEY)
    except Exception:  # noqa: BLE001 - the store went with the rank that stopped
        return None
    message = value.decode() if isinstance(value, bytes) else str(value)
    _acknowledge(store, rank)
    return CollectiveMisuseError(f"another rank stopped with: {message}")


# -- wrappers (named by path in this package's patches) ------------------------------------------------
def _idle_point(name: str, reopens: bool):
    """A wrapper for an accelerate call every rank reaches with nothing in flight (wait_for_everyone,
    end_training): the step-boundary window closes there, and idle ranks serve rank 0's ZeRO-3 gathers.
    With ``reopens``, a new window opens after it: what rank 0 does alone next is served at the others'
    next clean point."""

    def wrapper(wrapped, instance, args, kwargs):
        if window_open():
            clean_point(name)
        if serving.zero3_multi_rank():
            serving.idle(name)
        if not reopens:
            background.wait_for_pending()  # end_training: an asynchronous save_state is published (or raised) first
        elif not _inside.get():
            # a script's barrier after save_state (rank 0 then reads or uploads the checkpoint): as synchronously,
            # every rank's files are there once it returns
            background.wait_for_submitted()
        result = wrapped(*args, **kwargs)
        if reopens and _w.enabled and not _inside.get() and _called_by_the_script():
            open_window(f"accelerator.{name}()")  # every rank calls it from the same line: the windows stay paired
        elif not reopens:
            _w.pinned, _w.pinned_for = (), ()
        return result

    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


def backward(wrapped, instance, args, kwargs):
    if not before_backward(instance):
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        # ZeRO-3 waits for its all-gathers outside torch.distributed's functions (Work.wait): when one fails
        # because rank 0 stopped with an accel-npu error, that error, not the transport's
        clearer = collective_failed(exc)
        if clearer is None:
            raise
        raise clearer from None
    if instance.sync_gradients:
        after_backward(instance)  # DeepSpeed: DeepSpeedEngineWrapper.backward has run engine.step()
    return result


def optimizer_step(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _w.enabled and instance.gradient_state.sync_gradients:
        after_optimizer_step()  # FSDP: the step the script calls after backward
    return result


def dataloader_iter(wrapped, instance, args, kwargs):
    data_order.note_epoch_start(instance)
    if _w.enabled is False:
        return wrapped(*args, **kwargs)
    return _batches_after_clean_points(wrapped(*args, **kwargs), _w)


def _batches_after_clean_points(batches, window):
    """The DataLoader's batches; before each is drawn (a new epoch's RNG synchronisation included),
    a window left open by the last optimizer step is closed: the next batch is a clean point."""
    try:
        while True:
            if window.open:
                clean_point("the next batch of the training DataLoader")
            try:
                batch = next(batches)
            except StopIteration:
                if window.enabled:
                    open_window()  # the epoch ended: what the script does now is at the last step's state
                return
            yield batch
    finally:
        batches.close()


def _called_by_the_script() -> bool:
    """The script called ``wait_for_everyone`` itself (through accelerate's wrappers of the same name),
    not a library inside a call that rank 0 may make alone."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_name in ("wait_for_everyone", "wrapper") or frame.f_code.co_filename.startswith("<wrapt")
    ):
        frame = frame.f_back
    return frame is not None and (frame.f_globals.get("__name__", "") or "").split(".")[0] not in callsite.LIBRARIES


def _at_exit() -> None:
    """At exit, while the process group is up (atexit, and first thing in a plugin's own close of the group):
    the end of the script is a clean point. A rank that finishes while rank 0 saves alone serves it, then says it read
    the release; rank 0, which hosts the store, waits for that (at most _EXIT_WAIT_S) before leaving.
    Skipped after an uncaught exception."""
    if _at_exit in _dist.before_group_close:
        _dist.before_group_close.remove(_at_exit)  # runs once
    if not _w.open or getattr(sys, "last_value", None) is not None:
        return
    try:
        _serve_at_exit()
    finally:
        background.at_exit()  # a save_state served just now is written before the process leaves


def _serve_at_exit() -> None:
    step = _w.step
    try:
        clean_point("the end of the script")
        sess = serving._session()
        if sess is not None:
            store, world, rank, _ = sess
            if rank == 0:
                _dist.store_wait(store, [f"{_release_key(step)}/read/{r}" for r in range(1, world)], _EXIT_WAIT_S)
            else:
                store.set(f"{_release_key(step)}/read/{rank}", "1")
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never raise
        log.warning("accel-npu: serving rank 0 at the end of the script failed: %s", exc)
    finally:
        _w.pinned, _w.pinned_for = (), ()


wait_for_everyone = _idle_point("wait_for_everyone", reopens=True)
end_training = _idle_point("end_training", reopens=False)

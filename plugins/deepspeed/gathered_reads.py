"""A ZeRO-3 engine's ``parameters()`` / ``named_parameters()``, iterated by the user's script: each
partitioned parameter gathered, read-only, for as long as the script holds it.

Under ZeRO-3 every rank keeps 1/N of each parameter; outside the engine's forward and backward a
parameter's ``.data`` is a shape-[0] placeholder (deepspeed/runtime/zero/partition_parameters.py,
``free_param``). A script that reads the engine's weights after the optimizer step, as diffusers
v0.40.0's consistency_distillation/train_lcm_distill_sd_wds.py and train_lcm_distill_sdxl_wds.py do
for their EMA target (``update_ema(target_unet.parameters(), unet.parameters(), args.ema_decay)``,
every rank, every step), stops at "The size of tensor a (3) must match the size of tensor b (0)",
on GPUs too. DeepSpeed's answer for such reads is ``deepspeed.zero.GatheredParameters(params,
modifier_rank=None)`` around them (DeepSpeedExamples' DeepSpeed-Chat ``moving_average``; DeepSpeed
issue #2056): every rank holds its partition and every rank makes the call, so the gather is there
to make. Here the generator the script iterates does it: the parameters are gathered a group at a
time (DeepSpeed's own prefetch bucket size, ``stage3_prefetch_bucket_size``), just before the first
of them is handed out, and partitioned again when the script moves past the group or drops the
iterator. The values are the engine's module weights (bf16 under a bf16 config), what the same
script reads under ZeRO-2.

Only the user's code is served: an iterator created by an installed library (DeepSpeed, accelerate,
torch, diffusers) or consumed by one (``accelerator.clip_grad_norm_``, diffusers' ``EMAModel.step``,
which gathers itself) is stock's. Parameters already whole (persistent ones, below
``stage3_param_persistence_threshold``; inside a forward) are handed out as they are.

Every rank must iterate: before its first gather a rank meets the others over the process group's
store (``accel_npu._torch.dist.rendezvous``, never a collective), so a read only some ranks make is
one clear error within ``ACCEL_NPU_COLLECTIVE_TIMEOUT`` instead of a hang; one under ``if
accelerator.is_main_process:`` is left as stock reads it (shape-[0] partitions), with one warning.

Writes are refused: a parameter changed while gathered (``_version`` or storage changed) would be
lost when it is partitioned again (``modifier_rank=None``), and the optimizer's fp32 master would
overwrite it at the next step anyway; that is one :class:`ParameterWriteError` naming the
parameter and the line.
"""

from __future__ import annotations

import logging
import os
import sys

from accel_npu import environment
from accel_npu._torch import dist
from accel_npu._torch.callsite import caller_is_library, guarded_caller, user_frame
from accel_npu._torch.once import FirstTime
from accel_npu.errors import AccelNpuError

log = logging.getLogger("accel_npu")

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_first = FirstTime()
_END = object()


class ParameterWriteError(AccelNpuError):
    """A script changed a ZeRO-3 parameter it read through the engine's ``parameters()``."""


def parameters(wrapped, instance, args, kwargs):
    """``DeepSpeedEngine.parameters``: gathered while held, when the user's code asks under ZeRO-3."""
    items = wrapped(*args, **kwargs)
    if instance is None or not _partitions_weights(instance) or caller_is_library(skip=(_HERE,)):
        return items
    return _gathered(instance, items, "parameters")


def named_parameters(wrapped, instance, args, kwargs):
    """``DeepSpeedEngine.named_parameters``: gathered while held, when the user's code asks under ZeRO-3."""
    items = wrapped(*args, **kwargs)
    if instance is None or not _partitions_weights(instance) or caller_is_library(skip=(_HERE,)):
        return items
    return _gathered(instance, items, "named_parameters")


def _partitions_weights(engine) -> bool:
    try:
        return bool(engine.zero_optimization_partition_weights())
    except AttributeError:  # an engine still in its __init__ (no config yet)
        return False


def _partitioned(param, not_available) -> bool:
    return getattr(param, "ds_status", None) is not_available


def _gathered(engine, items, method: str):
    """The engine's (named) parameters, those that are partitioned gathered a group at a time."""
    import torch
    import torch.distributed
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus

    named = method == "named_parameters"
    absent = ZeroParamStatus.NOT_AVAILABLE
    budget = max(int(engine.zero_prefetch_bucket_size() or 0), 1)
    serve = None  # decided at the first partitioned parameter: gather (True) or hand out as stock (False)
    items = iter(items)
    while True:
        item = next(items, _END)
        if item is _END:
            return
        param = item[1] if named else item
        if not _partitioned(param, absent):
            yield item
            continue
        if serve is None:
            serve = _serve(method)
        if not serve:
            yield item
            continue
        group, fetch, numel = [item], [param], param.ds_numel
        while numel < budget:
            item = next(items, _END)
            if item is _END:
                break
            group.append(item)
            param = item[1] if named else item
            if _partitioned(param, absent):
                fetch.append(param)
                numel += param.ds_numel
        gathered = GatheredParameters(fetch, modifier_rank=None)
        with dist.every_rank_collectives():
            gathered.__enter__()
        held = [(p, p._version, p.data.data_ptr()) for p in fetch]
        try:
            yield from group
        finally:
            written = [p for p, version, ptr in held if _changed(p, version, ptr, torch)]
            with dist.every_rank_collectives():  # DeepSpeed's sanity checks, when on, all-reduce here
                gathered.__exit__(None, None, None)
            if written:
                raise _write_error(engine, written, method)
        if item is _END:
            return


def _changed(param, version: int, ptr: int, torch) -> bool:
    """``param`` was written while gathered: its version counter or storage changed (``p.mul_()``,
    ``p.detach().add_()``, ``p.data = ...``), or this rank's slice of it no longer equals this rank's
    partition, which the gather left in place (``p.data.copy_()``: ``.data`` has a version counter of its
    own). Every rank checks its own slice, so a write every rank makes is seen by one of them at least."""
    if param._version != version or param.data.data_ptr() != ptr:
        return True
    part = getattr(param, "ds_tensor", None)
    if part is None or hasattr(part, "ds_quant_scale") or part.numel() == 0 or part.dtype != param.dtype:
        return False  # no comparable partition here (NVMe-swapped, quantized)
    size = part.ds_numel if hasattr(part, "ds_numel") else part.numel()
    start = size * torch.distributed.get_rank(group=param.ds_process_group)
    count = min(size, param.ds_numel - start)
    if count <= 0:
        return False  # this rank's partition is padding only
    mine = param.data.reshape(-1).narrow(0, start, count).to(part.device)
    # bytes, not values: NaN never equals itself
    return not torch.equal(mine.view(torch.uint8), part.reshape(-1).narrow(0, 0, count).view(torch.uint8))


def _consumer_frame():
    """The frame iterating the generator (the one that called ``next``), past this module's frames."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith((_HERE, "<wrapt")):
        frame = frame.f_back
    return frame


def _serve(method: str) -> bool:
    """Whether this iteration gathers: the user's code consumes it, not under a rank-0-only `if`, and
    every rank iterates (else :class:`CollectiveMisuseError` after ACCEL_NPU_COLLECTIVE_TIMEOUT)."""
    if caller_is_library(depth=1, skip=(_HERE,)):
        return False  # e.g. list(...) inside diffusers' EMAModel.step, which gathers itself
    site, guard = guarded_caller(_consumer_frame())
    if guard is not None:
        if _first(("guarded", site)):
            log.warning(
                "accel-npu: %s:%d iterates the DeepSpeed engine's %s() inside `%s` (line %d): under ZeRO-3 "
                "gathering them is a collective the other ranks do not join, so this rank reads its "
                "shape-[0] partitions, as stock does. Read them on every rank (the gather is then made "
                "for you), or use accelerator.get_state_dict(model) for the whole weights.",
                site[0],
                site[1],
                method,
                guard[1],
                guard[0],
            )
        return False
    call = f"iterating the DeepSpeed engine's {method}()"

    def advice() -> str:
        where = user_frame()
        at = f"{where[0]}:{where[1]} " if where else "The script "
        return (
            f"{at}reads the engine's ZeRO-3 parameters (each gathered from every rank's partition): make the "
            f"read on every rank, or on none."
        )

    dist.rendezvous(
        "engine_parameters",
        environment.seconds("ACCEL_NPU_COLLECTIVE_TIMEOUT"),
        advice,
        call=call,
        stock="Stock DeepSpeed hands this rank shape-[0] partitions here.",
    )
    where = user_frame()
    if _first(("served", where)):
        log.info(
            "accel-npu: %s reads the DeepSpeed engine's %s() under ZeRO-3: each partitioned parameter is "
            "gathered (read-only, deepspeed.zero.GatheredParameters) while the script holds it.",
            f"{where[0]}:{where[1]}" if where else "the script",
            method,
        )
    return True


def _write_error(engine, written, method: str) -> ParameterWriteError:
    names = {id(p): n for n, p in engine.module.named_parameters()}
    where = user_frame()
    at = f"{where[0]}:{where[1]}" if where else "The script"
    shown = ", ".join(names.get(id(p), "?") for p in written[:3]) + (" ..." if len(written) > 3 else "")
    return ParameterWriteError(
        f"{at} changed {len(written)} ZeRO-3 parameter(s) of the DeepSpeed engine ({shown}) read through its "
        f"{method}(): under ZeRO-3 accel-npu hands them out gathered, read-only (each rank keeps 1/N of a "
        f"parameter, the optimizer its fp32 master), so the change would be lost when they are partitioned again; "
        f"stock DeepSpeed hands out shape-[0] partitions, where it is lost too. Change trained weights through the "
        f"optimizer, or under ZeRO-3 with deepspeed.utils.safe_set_full_fp32_param (its fp32 master)."
    )

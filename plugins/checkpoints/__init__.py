"""Atomic sharded checkpoints, collective-misuse guard, consolidation (issue 5, items 2-4).

Under DeepSpeed:
- ``save_state`` writes into a hidden sibling directory and renames it into place (``latest``
  and a manifest last): a SIGKILL mid-save leaves the previous checkpoint loadable;
- ``load_state`` refuses an incomplete checkpoint with the list of missing files;
- ``get_state_dict`` / ``save_model`` under ZeRO-3 first check, within
  ``ACCEL_NPU_COLLECTIVE_TIMEOUT`` seconds, that every rank called them (field report 7.9:
  DiT4DiT calls ``get_state_dict`` inside ``if accelerator.is_main_process``), and
  ``save_model`` gathers one output shard at a time instead of the whole model on rank 0;
- frozen towers kept out of the engine (plugins/frozen_towers) are added back to
  ``get_state_dict`` results in their own dtype;
- ``accel-npu consolidate`` (a command this plugin adds) turns a checkpoint into
  ``from_pretrained`` directories.
Beside this module: ``state.py`` (atomic save_state, load checks, rendezvous), ``streaming.py``
(save_model one shard at a time), ``consolidate.py``, ``files.py``.
"""
from __future__ import annotations

import logging

from accel_npu import environment
from accel_npu._torch.markers import tower_state_dict
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch
from accel_npu.plugins.checkpoints import consolidate, state as checkpointing
from accel_npu.plugins.checkpoints.streaming import streaming_save_model

log = logging.getLogger("accel_npu")

_SUPPORTS = "accelerate>=1.10,<1.16"
_in_save_model = False


def _arg(args, kwargs, index, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _save_state(wrapped, instance, args, kwargs):
    if not checkpointing.is_deepspeed(instance) or any(
            getattr(m, "use_node_local_storage", lambda: False)() for m in instance._models):
        return wrapped(*args, **kwargs)  # node-local storage: each node's rank 0 publishes its own
    kwargs = dict(kwargs)
    output_dir = kwargs.pop("output_dir", args[0] if args else None)
    safe = kwargs.pop("safe_serialization", args[1] if len(args) > 1 else True)
    if output_dir is None and not instance.project_configuration.automatic_checkpoint_naming:
        return wrapped(*args, **kwargs)  # stock raises its own error
    return checkpointing.atomic_save_state(wrapped, instance, output_dir, safe, **kwargs)


def _load_state(wrapped, instance, args, kwargs):
    if not checkpointing.is_deepspeed(instance):
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    input_dir = kwargs.pop("input_dir", args[0] if args else None)
    rest = args[1:]
    resolved = checkpointing.resolve_load_dir(input_dir, instance)
    return wrapped(resolved if resolved is not None else input_dir, *rest, **kwargs)


def _zero3_multi(instance) -> bool:
    return (checkpointing.is_deepspeed(instance) and checkpointing.zero_stage(instance) == 3
            and instance.num_processes > 1)


def _get_state_dict(wrapped, instance, args, kwargs):
    if not checkpointing.is_deepspeed(instance):
        return wrapped(*args, **kwargs)
    if _zero3_multi(instance) and not _in_save_model:
        checkpointing.rendezvous("get_state_dict")
    state_dict = wrapped(*args, **kwargs)
    if isinstance(state_dict, dict) and state_dict:
        model = _arg(args, kwargs, 0, "model")
        for key, value in tower_state_dict(instance.unwrap_model(model)).items():
            state_dict.setdefault(key, value)
    return state_dict


def _save_model(wrapped, instance, args, kwargs):
    global _in_save_model
    if not _zero3_multi(instance):
        return wrapped(*args, **kwargs)
    model = _arg(args, kwargs, 0, "model")
    save_directory = _arg(args, kwargs, 1, "save_directory")
    max_shard_size = _arg(args, kwargs, 2, "max_shard_size", "10GB")
    safe = _arg(args, kwargs, 3, "safe_serialization", True)
    engine = model if hasattr(model, "zero_gather_16bit_weights_on_model_save") else next(
        (m for m in instance._models if getattr(m, "module", None) is model), None)
    if engine is None:
        return wrapped(*args, **kwargs)
    checkpointing.rendezvous("save_model")
    if not engine.zero_gather_16bit_weights_on_model_save():
        _in_save_model = True
        try:
            return wrapped(*args, **kwargs)  # stock raises its explanation
        finally:
            _in_save_model = False
    streaming_save_model(instance, engine, save_directory, max_shard_size, safe)


def _patch(name, reason, remove_when, wrapper):
    return Patch(target=f"accelerate.accelerator:Accelerator.{name}", supports=_SUPPORTS, reason=reason,
                 remove_when=remove_when, wrapper=wrapper)


SAVE_STATE = _patch(
    "save_state",
    "A crash or SIGKILL during a DeepSpeed save_state leaves a half-written checkpoint in place of the "
    "previous one (or beside it, looking complete); consolidation needs the trained components' configs.",
    "accelerate/DeepSpeed write checkpoints to a temporary directory and publish them atomically",
    _save_state)
LOAD_STATE = _patch(
    "load_state",
    "Resume must refuse an incomplete checkpoint with the missing files named, skip interrupted saves "
    "and recover a checkpoint set aside by an interrupted atomic swap.",
    "accelerate validates DeepSpeed checkpoints before loading them",
    _load_state)
GET_STATE_DICT = _patch(
    "get_state_dict",
    "Under ZeRO-3 get_state_dict is a collective; called inside `if accelerator.is_main_process` "
    "(DiT4DiT, field report 7.9) rank 0 gathers the whole model or waits until the process-group "
    "timeout. Frozen towers kept out of the engine must still appear in the state dict.",
    "accelerate detects a collective entered by one rank (and frozen towers are no longer hidden)",
    _get_state_dict)
SAVE_MODEL = _patch(
    "save_model",
    "Under ZeRO-3 save_model gathers the full 16-bit model into rank 0's memory (+1x model) and hangs "
    "when called by one rank only.",
    "accelerate/DeepSpeed write ZeRO-3 models shard by shard",
    _save_model)


@hookimpl
def accel_npu_register_patches():
    return [SAVE_STATE, LOAD_STATE, GET_STATE_DICT, SAVE_MODEL]


@hookimpl
def accel_npu_env_report(backend):
    return ("checkpoints", {
        "ACCEL_NPU_COLLECTIVE_TIMEOUT": environment.get("ACCEL_NPU_COLLECTIVE_TIMEOUT") + " s",
        "save_state under DeepSpeed": "atomic (temporary directory, rename, `latest` last)",
    })


@hookimpl
def accel_npu_add_commands(subparsers):
    consolidate.add_parser(subparsers)

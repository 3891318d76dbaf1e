"""Checkpoints under DeepSpeed: atomic ``save_state``, checked ``load_state``, saves made on rank 0
alone (diffusers #2606) completed by the other ranks, ZeRO-3 models gathered for a save a group at
a time, and ``accel-npu consolidate``. docs/checkpoints.md describes each.

Beside this module: ``state.py``, ``streaming.py`` (save_model one shard at a time), ``serving.py``
and ``boundary.py`` (idle ranks serve rank 0's gathers and save_state), ``partitioned.py``,
``lora.py``, ``callsite.py``, ``consolidate.py``, ``files.py``.
"""
from __future__ import annotations

import logging

from accel_npu import environment
from accel_npu._torch.markers import tower_state_dict
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument, with_argument

# The modules beside this one are imported by the wrappers when first called (or named by path in
# `wrapper=`), not here: this module is imported inside `import torch` and must stay cheap.
_PKG = "accel_npu.plugins.checkpoints"

log = logging.getLogger("accel_npu")

_SUPPORTS = "accelerate>=1.10,<1.16"


def _save_state(wrapped, instance, args, kwargs):
    from accel_npu.plugins.checkpoints import state as checkpointing

    if checkpointing.is_fsdp(instance) and instance.num_processes > 1:
        return _fsdp_save_state(wrapped, instance, args, kwargs)
    if not checkpointing.is_deepspeed(instance) or any(
            getattr(m, "use_node_local_storage", lambda: False)() for m in instance._models):
        return wrapped(*args, **kwargs)  # node-local storage: each node's rank 0 publishes its own
    output_dir = argument(args, kwargs, 0, "output_dir")
    safe = argument(args, kwargs, 1, "safe_serialization", True)
    if output_dir is None and not instance.project_configuration.automatic_checkpoint_naming:
        return wrapped(*args, **kwargs)  # stock raises its own error
    from accel_npu.plugins.checkpoints import boundary

    model_kwargs = {k: v for k, v in kwargs.items() if k not in ("output_dir", "safe_serialization")}
    announced = boundary.announce_save_state(output_dir, safe, model_kwargs)  # rank 0 at a step boundary: the others serve it
    try:
        with boundary.inside_save():
            return checkpointing.atomic_save_state(wrapped, instance, output_dir, safe, **model_kwargs)
    except checkpointing.CollectiveMisuseError as exc:
        boundary.save_failed(announced, exc)  # every rank stops with this error, not the transport's
        raise


def _fsdp_save_state(wrapped, instance, args, kwargs):
    """Under FSDP save_state is collective too (accelerate's save_fsdp_model / save_fsdp_optimizer: every
    rank writes or gathers its shards). Rank 0 alone at a step boundary is served by the others; anywhere
    else it fails in time, naming the line, instead of hanging."""
    from accel_npu.plugins.checkpoints import boundary, state as checkpointing

    output_dir = argument(args, kwargs, 0, "output_dir")
    safe = argument(args, kwargs, 1, "safe_serialization", True)
    model_kwargs = {k: v for k, v in kwargs.items() if k not in ("output_dir", "safe_serialization")}
    announced = boundary.announce_save_state(output_dir, safe, model_kwargs)
    try:
        with boundary.inside_save():
            checkpointing.rendezvous("save_state", fsdp=True)
            return wrapped(*args, **kwargs)
    except checkpointing.CollectiveMisuseError as exc:
        boundary.save_failed(announced, exc)
        raise


def _load_state(wrapped, instance, args, kwargs):
    from accel_npu.plugins.checkpoints import state as checkpointing

    if not checkpointing.is_deepspeed(instance):
        return wrapped(*args, **kwargs)
    input_dir = argument(args, kwargs, 0, "input_dir")
    resolved = checkpointing.resolve_load_dir(input_dir, instance)
    if resolved is not None:
        args, kwargs = with_argument(args, kwargs, 0, "input_dir", resolved)
    with checkpointing.load_hooks_see_models(instance):
        return wrapped(*args, **kwargs)


def _zero3_multi(instance) -> bool:
    from accel_npu.plugins.checkpoints import state as checkpointing

    return (checkpointing.is_deepspeed(instance) and checkpointing.zero_stage(instance) == 3
            and instance.num_processes > 1)


def _get_state_dict(wrapped, instance, args, kwargs):
    from accel_npu.plugins.checkpoints import serving, state as checkpointing

    if not checkpointing.is_deepspeed(instance):
        return wrapped(*args, **kwargs)
    with serving.requesting():  # a rank-0-only call: the idle ranks join its gathers, busy ones fail it in time
        state_dict = wrapped(*args, **kwargs)
    if isinstance(state_dict, dict) and state_dict:
        model = argument(args, kwargs, 0, "model")
        for key, value in tower_state_dict(instance.unwrap_model(model)).items():
            state_dict.setdefault(key, value)
    return state_dict


def _save_model(wrapped, instance, args, kwargs):
    from accel_npu.plugins.checkpoints import serving
    from accel_npu.plugins.checkpoints.streaming import streaming_save_model

    if not _zero3_multi(instance):
        return wrapped(*args, **kwargs)
    model = argument(args, kwargs, 0, "model")
    save_directory = argument(args, kwargs, 1, "save_directory")
    max_shard_size = argument(args, kwargs, 2, "max_shard_size", "10GB")
    safe = argument(args, kwargs, 3, "safe_serialization", True)
    engine = model if hasattr(model, "zero_gather_16bit_weights_on_model_save") else next(
        (m for m in instance._models if getattr(m, "module", None) is model), None)
    if engine is None:
        return wrapped(*args, **kwargs)
    if not engine.zero_gather_16bit_weights_on_model_save():
        return wrapped(*args, **kwargs)  # stock raises its explanation
    with serving.requesting():  # a rank-0-only call: the idle ranks join its gathers, busy ones fail it in time
        streaming_save_model(instance, engine, save_directory, max_shard_size, safe)


def _idle_point(name: str):
    """A wrapper for an accelerate call every rank reaches with nothing in flight (wait_for_everyone,
    end_training): the step-boundary window closes there, and idle ranks serve rank 0's ZeRO-3 gathers."""

    def wrapper(wrapped, instance, args, kwargs):
        from accel_npu.plugins.checkpoints import boundary, serving

        if boundary.window_open():
            boundary.clean_point(name)
        if serving.zero3_multi_rank():
            serving.idle(name)
        return wrapped(*args, **kwargs)

    wrapper.__name__ = f"_{name}"
    return wrapper


_boundary = None  # plugins/checkpoints/boundary.py, imported by the first backward (not inside `import torch`)


def _backward(wrapped, instance, args, kwargs):
    global _boundary
    if _boundary is None:
        from accel_npu.plugins.checkpoints import boundary as _boundary
    if not _boundary.before_backward(instance):
        return wrapped(*args, **kwargs)
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        # ZeRO-3 waits for its all-gathers outside torch.distributed's functions (Work.wait): when one fails
        # because rank 0 stopped with an accel-npu error, that error, not the transport's
        clearer = _boundary.collective_failed(exc)
        if clearer is None:
            raise
        raise clearer from None
    if instance.sync_gradients:
        _boundary.after_backward(instance)  # DeepSpeed: DeepSpeedEngineWrapper.backward has run engine.step()
    return result


def _optimizer_step(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _boundary is not None and _boundary._w.enabled and instance.gradient_state.sync_gradients:
        _boundary.after_optimizer_step()  # FSDP: the step the script calls after backward
    return result


def _dataloader_iter(wrapped, instance, args, kwargs):
    global _boundary
    if _boundary is None:
        from accel_npu.plugins.checkpoints import boundary as _boundary
    if _boundary._w.enabled is False:
        return wrapped(*args, **kwargs)
    return _batches_after_clean_points(wrapped(*args, **kwargs), _boundary._w)


def _batches_after_clean_points(batches, window):
    """The DataLoader's batches; before each is drawn (a new epoch's RNG synchronisation included),
    a window left open by the last optimizer step is closed: the next batch is a clean point."""
    try:
        while True:
            if window.open:
                _boundary.clean_point("the next batch of the training DataLoader")
            try:
                batch = next(batches)
            except StopIteration:
                if window.enabled:
                    _boundary.open_window()  # the epoch ended: what the script does now is at the last step's state
                return
            yield batch
    finally:
        batches.close()


def _gathered_enter(wrapped, instance, args, kwargs):
    from accel_npu.plugins.checkpoints import serving

    if getattr(instance, "enabled", False):
        serving.before_gather(instance.params, instance.src_rank)
    return wrapped(*args, **kwargs)


def _patch(name, reason, remove_when, wrapper):
    return Patch(target=f"accelerate.accelerator:Accelerator.{name}", supports=_SUPPORTS, reason=reason,
                 remove_when=remove_when, wrapper=wrapper)


SAVE_STATE = _patch(
    "save_state",
    # Also: save hooks get DeepSpeed engines and no weights, so hooks written for DDP fail
    # ('unexpected save model'); consolidation needs the trained components' configs.
    "A crash during a DeepSpeed save_state leaves a half-written checkpoint in place of the previous "
    "one; it is written aside and renamed into place.",
    "accelerate/DeepSpeed write checkpoints to a temporary directory and publish them atomically",
    _save_state)
LOAD_STATE = _patch(
    "load_state",
    # Also: load hooks get an empty models list under DeepSpeed, so hooks written for DDP (diffusers'
    # Sana/SDXL LoRA scripts) fail on None.
    "Resume needs a complete checkpoint: an incomplete one is refused naming the missing files, an "
    "interrupted atomic swap is recovered.",
    "accelerate validates DeepSpeed checkpoints before loading them",
    _load_state)
GET_STATE_DICT = _patch(
    "get_state_dict",
    # Frozen towers kept out of the engine are added back to the state dict.
    "Under ZeRO-3 get_state_dict is a collective: called on rank 0 alone it gathers the whole model "
    "there or waits for the process-group timeout.",
    "accelerate detects a collective entered by one rank (and frozen towers are no longer hidden)",
    _get_state_dict)
SAVE_MODEL = _patch(
    "save_model",
    "Under ZeRO-3 save_model gathers the full 16-bit model into rank 0's memory (+1x model) and hangs "
    "when called by one rank only.",
    "accelerate/DeepSpeed write ZeRO-3 models shard by shard",
    _save_model)


WAIT_FOR_EVERYONE = Patch(
    target="accelerate.state:PartialState.wait_for_everyone", supports=_SUPPORTS,
    reason="Under ZeRO-3 rank 0 saving alone writes shape-[0] tensors while the others wait here; "
           "waiting ranks serve rank 0's gathers.",
    remove_when="accelerate/DeepSpeed gather partitioned parameters for a save made on one rank",
    wrapper=_idle_point("wait_for_everyone"))
END_TRAINING = Patch(
    target="accelerate.accelerator:Accelerator.end_training", supports=_SUPPORTS,
    reason="diffusers' scripts save on rank 0 while the others destroy the process group in "
           "end_training(); under ZeRO-3 they serve rank 0's gathers first.",
    remove_when="accelerate/DeepSpeed gather partitioned parameters for a save made on one rank",
    wrapper=_idle_point("end_training"))
GATHERED_ENTER = Patch(
    target="deepspeed.runtime.zero.partition_parameters:GatheredParameters.__enter__",
    supports="deepspeed>=0.16,<0.20",
    reason="A ZeRO-3 gather made on one rank for a save hangs; it is announced first, so idle ranks "
           "join it and busy ones make it fail in time.",
    remove_when="accelerate/DeepSpeed gather partitioned parameters for a save made on one rank",
    wrapper=_gathered_enter)
DIFFUSERS_SAVE_PRETRAINED = Patch(
    target="diffusers.models.modeling_utils:ModelMixin.save_pretrained", supports="diffusers>=0.35,<0.43",
    reason="save_pretrained of a ZeRO-3 partitioned model writes shape-[0] tensors and exits 0 "
           "(train_text_to_image.py's final save); the trained model is lost.",
    remove_when="diffusers gathers ZeRO-3 partitioned parameters in save_pretrained",
    wrapper=f"{_PKG}.partitioned:diffusers_save_pretrained")
TRANSFORMERS_SAVE_PRETRAINED = Patch(
    target="transformers.modeling_utils:PreTrainedModel.save_pretrained", supports="transformers>=4.50,<5.30",
    reason="save_pretrained of a ZeRO-3 partitioned model writes shape-[0] tensors and exits 0: refused before "
           "writing, saying how to pass the gathered state dict.",
    remove_when="transformers gathers ZeRO-3 partitioned parameters in save_pretrained",
    wrapper=f"{_PKG}.partitioned:transformers_save_pretrained")
SAFETENSORS_SAVE_FILE = Patch(
    target="safetensors.torch:save_file", supports="safetensors>=0.4,<0.9",
    reason="save_file of ZeRO-3 partitioned parameters writes their empty local data (shape [0]).",
    remove_when="never: safetensors knows nothing of ZeRO-3; remove with the save_pretrained patch",
    wrapper=f"{_PKG}.partitioned:save_file")


PEFT_STATE_DICT = Patch(
    target="peft.utils.save_and_load:get_peft_model_state_dict",
    supports="peft>=0.13,<0.22",
    # It hands back the partitioned parameters, which save_file gathers.
    reason="Under ZeRO-3 get_peft_model_state_dict returns empty copies, so save_lora_weights writes "
           "shape-[0] tensors (exit 0) that load_lora_weights refuses.",
    remove_when="peft gathers ZeRO-3 parameters in get_peft_model_state_dict",
    wrapper=f"{_PKG}.lora:peft_state_dict",
)

BACKWARD = _patch(
    "backward",
    # Marks the step boundary (accelerate's DeepSpeedEngineWrapper.backward runs engine.step()).
    "diffusers' scripts call save_state on rank 0 only, which under DeepSpeed hangs (diffusers #2606); "
    "the other ranks serve it at the step boundary.",
    "accelerate saves a main-process-only save_state under DeepSpeed, or diffusers calls it on every rank",
    _backward)


def _iter_patch(cls):
    return Patch(
        target=f"accelerate.data_loader:{cls}.__iter__", supports=_SUPPORTS,
        # The next batch after an optimizer step is a rank's clean point: nothing drawn, RNG as at the step.
        reason="A rank's next batch after an optimizer step is where it waits for rank 0 and serves a "
               "save_state made alone (diffusers #2606).",
        remove_when="with the Accelerator.backward patch", wrapper=_dataloader_iter)


OPTIMIZER_STEP = Patch(
    target="accelerate.optimizer:AcceleratedOptimizer.step", supports=_SUPPORTS,
    reason="Under FSDP the step boundary where the other ranks serve rank 0's save_state (diffusers #2606) is "
           "after the script's optimizer.step(), not in backward.",
    remove_when="with the Accelerator.backward patch", wrapper=_optimizer_step)
DATALOADER_SHARD_ITER = _iter_patch("DataLoaderShard")
DATALOADER_DISPATCHER_ITER = _iter_patch("DataLoaderDispatcher")
SKIP_DATALOADER_ITER = _iter_patch("SkipDataLoader")


@hookimpl
def accel_npu_register_patches():
    return [SAVE_STATE, LOAD_STATE, GET_STATE_DICT, SAVE_MODEL, WAIT_FOR_EVERYONE, END_TRAINING, GATHERED_ENTER,
            DIFFUSERS_SAVE_PRETRAINED, TRANSFORMERS_SAVE_PRETRAINED, SAFETENSORS_SAVE_FILE, PEFT_STATE_DICT,
            BACKWARD, OPTIMIZER_STEP, DATALOADER_SHARD_ITER, DATALOADER_DISPATCHER_ITER, SKIP_DATALOADER_ITER]


@hookimpl
def accel_npu_env_report(backend):
    return ("checkpoints", {
        "ACCEL_NPU_COLLECTIVE_TIMEOUT": environment.get("ACCEL_NPU_COLLECTIVE_TIMEOUT") + " s",
        "save_state under DeepSpeed": "atomic (temporary directory, rename, `latest` last)",
        "rank-0-only save_state right after an optimizer step": "served by the other ranks at their next batch",
    })


@hookimpl
def accel_npu_add_commands(subparsers):
    from accel_npu.plugins.checkpoints import consolidate

    consolidate.add_parser(subparsers)

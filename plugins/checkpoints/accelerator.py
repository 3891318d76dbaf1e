"""Wrappers of accelerate's ``Accelerator`` checkpoint methods (named by path in this package's patches).

``save_state`` is written aside and renamed into place under DeepSpeed, and a rank-0-only call at a step
boundary is served by the other ranks (``boundary.py``); ``load_state`` refuses an incomplete checkpoint;
``get_state_dict`` / ``save_model`` called on rank 0 alone under ZeRO-3 are served by the idle ranks
(``serving.py``) and stream the model shard by shard (``streaming.py``).
"""

from __future__ import annotations

from accel_npu._torch.markers import tower_state_dict
from accel_npu.patching import argument, with_argument
from accel_npu.plugins.checkpoints import background, boundary, fsdp_background, serving
from accel_npu.plugins.checkpoints import state as checkpointing
from accel_npu.plugins.checkpoints.streaming import streaming_save_model


def save_state(wrapped, instance, args, kwargs):
    if checkpointing.is_fsdp(instance) and instance.num_processes > 1:
        return _fsdp_save_state(wrapped, instance, args, kwargs)
    if not checkpointing.is_deepspeed(instance) or any(
        getattr(m, "use_node_local_storage", lambda: False)() for m in instance._models
    ):
        return wrapped(*args, **kwargs)  # node-local storage: each node's rank 0 publishes its own
    output_dir = argument(args, kwargs, 0, "output_dir")
    safe = argument(args, kwargs, 1, "safe_serialization", True)
    if output_dir is None and not instance.project_configuration.automatic_checkpoint_naming:
        return wrapped(*args, **kwargs)  # stock raises its own error
    model_kwargs = {k: v for k, v in kwargs.items() if k not in ("output_dir", "safe_serialization")}
    # rank 0 at a step boundary: the others serve it
    announced = boundary.announce_save_state(output_dir, safe, model_kwargs)
    try:
        with boundary.inside_save():
            return checkpointing.atomic_save_state(wrapped, instance, output_dir, safe, **model_kwargs)
    except checkpointing.CollectiveMisuseError as exc:
        boundary.save_failed(announced, exc)  # every rank stops with this error, not the transport's
        raise


def _fsdp_save_state(wrapped, instance, args, kwargs):
    """Under FSDP save_state is collective too (accelerate's save_fsdp_model / save_fsdp_optimizer: every
    rank writes or gathers its shards). Rank 0 alone at a step boundary is served by the others; anywhere
    else it fails in time, naming the line, instead of hanging. Asynchronously (``background.enabled()``) FSDP2's
    shards are written in the background and published atomically (``fsdp_background.py``)."""
    output_dir = argument(args, kwargs, 0, "output_dir")
    safe = argument(args, kwargs, 1, "safe_serialization", True)
    model_kwargs = {k: v for k, v in kwargs.items() if k not in ("output_dir", "safe_serialization")}
    announced = boundary.announce_save_state(output_dir, safe, model_kwargs)
    try:
        with boundary.inside_save():
            background.wait_for_pending()
            checkpointing.rendezvous("save_state", fsdp=True)
            if background.enabled() and (
                output_dir is not None or instance.project_configuration.automatic_checkpoint_naming
            ):
                why = fsdp_background.why_synchronous(instance)
                if why is None:
                    return fsdp_background.async_save_state(wrapped, instance, output_dir, safe, **model_kwargs)
                fsdp_background.say_synchronous(why)
            return wrapped(*args, **kwargs)
    except checkpointing.CollectiveMisuseError as exc:
        boundary.save_failed(announced, exc)
        raise


def load_state(wrapped, instance, args, kwargs):
    if checkpointing.is_fsdp(instance):
        background.wait_for_pending()  # an asynchronous save_state still being written: published (or raised) first
        input_dir = argument(args, kwargs, 0, "input_dir")
        if input_dir is not None:
            resolved = checkpointing.resolve_load_dir(input_dir, instance, deepspeed=False)
            args, kwargs = with_argument(args, kwargs, 0, "input_dir", resolved)
        return wrapped(*args, **kwargs)
    if not checkpointing.is_deepspeed(instance):
        return wrapped(*args, **kwargs)
    background.wait_for_pending()  # an asynchronous save_state still being written: published (or raised) first
    input_dir = argument(args, kwargs, 0, "input_dir")
    resolved = checkpointing.resolve_load_dir(input_dir, instance)
    if resolved is not None:
        args, kwargs = with_argument(args, kwargs, 0, "input_dir", resolved)
    problem = checkpointing.partition_count_problem(resolved, instance)
    if problem:
        raise checkpointing.CheckpointError(problem)
    with checkpointing.load_hooks_see_models(instance):
        return wrapped(*args, **kwargs)


def _zero3_multi(instance) -> bool:
    return (
        checkpointing.is_deepspeed(instance) and checkpointing.zero_stage(instance) == 3 and instance.num_processes > 1
    )


def get_state_dict(wrapped, instance, args, kwargs):
    if not checkpointing.is_deepspeed(instance):
        return wrapped(*args, **kwargs)
    with serving.requesting():  # a rank-0-only call: the idle ranks join its gathers, busy ones fail it in time
        state_dict = wrapped(*args, **kwargs)
    if isinstance(state_dict, dict) and state_dict:
        model = argument(args, kwargs, 0, "model")
        for key, value in tower_state_dict(instance.unwrap_model(model)).items():
            state_dict.setdefault(key, value)
    return state_dict


def save_model(wrapped, instance, args, kwargs):
    if not _zero3_multi(instance):
        return wrapped(*args, **kwargs)
    model = argument(args, kwargs, 0, "model")
    save_directory = argument(args, kwargs, 1, "save_directory")
    max_shard_size = argument(args, kwargs, 2, "max_shard_size", "10GB")
    safe = argument(args, kwargs, 3, "safe_serialization", True)
    engine = (
        model
        if hasattr(model, "zero_gather_16bit_weights_on_model_save")
        else next((m for m in instance._models if getattr(m, "module", None) is model), None)
    )
    if engine is None:
        return wrapped(*args, **kwargs)
    if not engine.zero_gather_16bit_weights_on_model_save():
        return wrapped(*args, **kwargs)  # stock raises its explanation
    with serving.requesting():  # a rank-0-only call: the idle ranks join its gathers, busy ones fail it in time
        streaming_save_model(instance, engine, save_directory, max_shard_size, safe)

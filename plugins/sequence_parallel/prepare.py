"""Sequence parallelism for a diffusers model at ``accelerator.prepare`` under DeepSpeed (the
``accel_npu_prepare_deepspeed`` hook, before accelerate's ``_prepare_deepspeed`` runs).

accelerate 1.16's ``_prepare_deepspeed`` (accelerator.py) with ``sp_size > 1`` registers DeepSpeed's Ulysses
attention with transformers (``UlyssesSPAttentionHF.register_with_transformers``, which reads
``model.config.get_text_config`` and fails on a diffusers model's FrozenDict) and wraps every DataLoader in
``UlyssesSPDataLoaderAdapter``, which splits each *batch* along its sequence dimension (token ids). A diffusers
script's batch is pixels and prompts; its sequence exists only inside the transformer. For a diffusers model:

- the model's sequence is split inside it by diffusers' own context-parallel hooks and Ulysses attention
  (``ModelMixin.enable_parallelism`` with ``ContextParallelConfig(ulysses_degree=sp_size)``), over DeepSpeed's SP
  groups, with the model's ``_cp_plan`` or ours (plans.py); a token count that does not divide by sp_size is
  refused at the first forward, before the split, naming the fix;
- DeepSpeed gets DeepSpeed's own ``parallel_state_sp`` as ``mpu``: ZeRO reduces gradients over every rank and
  divides by world/sp_size (stage_1_and_2.py ``average_tensor``; stage3.py, its default reduce-scatter
  corrected in zero3.py), i.e. sums the partial gradients of
  one SP group's sequence shards and averages over data-parallel groups: the gradient of the sp=1 run;
- the DataLoader is sharded by data-parallel rank (the ranks of one SP group read the same batch), not wrapped;
- the ranks of one SP group continue from their first rank's random state (groups.py).

A transformers model takes accelerate's path unchanged.
"""

from __future__ import annotations

import logging

from accel_npu.errors import ConfigError
from accel_npu.patching import argument, with_argument
from accel_npu.plugins.sequence_parallel import groups, plans

log = logging.getLogger("accel_npu")


def _diffusers_model(objects):
    import sys

    if "diffusers" not in sys.modules:
        return None
    import torch
    from diffusers import ModelMixin

    def candidates():
        for obj in objects:
            yield obj
            # the models of one prepare call trained by one engine (plugins/deepspeed's container of them)
            if isinstance(obj, torch.nn.Module) and not isinstance(obj, ModelMixin):
                yield from obj.children()

    return next((obj for obj in candidates() if isinstance(obj, ModelMixin)), None)


def before_deepspeed_prepare(accelerator, objects) -> None:
    config = getattr(accelerator, "parallelism_config", None)
    if config is None or config.sp_size <= 1:
        return
    model = _diffusers_model(objects)
    if model is None:
        return  # a transformers model: accelerate's DeepSpeed Ulysses (ALST)
    state = groups.active()
    if state is None:
        enable(accelerator, model, config)
    elif state.model is not model:
        raise ConfigError(
            f"accel-npu: sequence parallelism is already set up for {type(state.model).__name__}; a second "
            f"diffusers model ({type(model).__name__}) cannot be split as well. Prepare one trained transformer."
        )


def enable(accelerator, model, config) -> groups.SequenceParallel:
    """The refusals, then groups, the split model and the shared random state. Raises ConfigError."""
    import torch.distributed as dist

    sp = config.sp_size
    world = dist.get_world_size()
    check_world(sp, world)
    dp = world // sp
    if config.data_parallel_size not in (1, dp):
        raise ConfigError(
            f"accel-npu: parallelism_config gives data-parallel size {config.data_parallel_size} beside sp_size "
            f"{sp} on {world} processes; it must be {dp} (processes / sp_size). Leave parallelism_config_dp_* unset."
        )
    if getattr(accelerator, "_dataloaders", None):
        raise ConfigError(
            "accel-npu: sequence parallelism: a DataLoader was prepared before the model, and so was sharded over "
            "every rank; the ranks of one sequence-parallel group must read the same batch. Prepare the DataLoader "
            "in the same accelerator.prepare call as the model, or after it."
        )
    plan, source = plans.plan_for(model)
    plans.check_heads(model, sp)

    # accelerate's "train_batch_size = micro * accumulation * data_parallel_size" (_prepare_deepspeed) reads
    # the config's data-parallel size, which it leaves at 1 under DeepSpeed SP
    if config.data_parallel_size != dp:
        config._set_size("dp_replicate", dp)
    state = groups.build(model, sp, accelerator.device.type)
    from diffusers.models._modeling_parallel import ContextParallelConfig

    # before enable_parallelism: torch runs a module's forward pre-hooks before diffusers' split (which wraps
    # forward), in the order they were registered: the streams our plans pad are padded, then a token count that
    # does not divide is refused with its fix instead of diffusers' assert
    plans.install_id_forms(model)
    padding = plans.install_padding(model, sp)
    plans.install_processors(model, padding)
    plans.install_token_checks(model, plan, sp)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp, mesh=state.mesh), cp_plan=plan)
    groups.share_random_state(state)
    log.info(
        "accel-npu: sequence parallelism: %s split over %d ranks (Ulysses, %s plan), %d data-parallel group(s)",
        type(model).__name__,
        sp,
        source,
        dp,
    )
    return state


def check_world(sp: int, world: int) -> None:
    if world % sp:
        raise ConfigError(
            f"accel-npu: parallelism_config_sp_size {sp} does not divide the {world} processes: every sequence-"
            f"parallel group needs {sp} ranks. Launch a multiple of {sp} processes (--num_processes) or choose an "
            f"sp_size that divides {world}."
        )


def register_with_transformers(wrapped, instance, args, kwargs):
    """DeepSpeed's ``mpu`` for the diffusers model set up above, instead of transformers' attention registry."""
    state = groups.active()
    model = argument(args, kwargs, 0, "model_name_or_path")
    children = model.children() if hasattr(model, "children") else ()  # a transformers model, or its name
    if state is not None and (model is state.model or any(child is state.model for child in children)):
        return state.mpu
    return wrapped(*args, **kwargs)


def dataloader_adapter(wrapped, instance, args, kwargs):
    """The DataLoader as prepared (sharded by data-parallel rank): the sequence is split inside the model."""
    state = groups.active()
    if state is not None:
        return argument(args, kwargs, 0, "dl")
    return wrapped(*args, **kwargs)


def prepare_data_loader(wrapped, instance, args, kwargs):
    """Shard by data-parallel rank: the ranks of one SP group get the same batches."""
    state = groups.active()
    if state is not None:
        args, kwargs = with_argument(args, kwargs, 2, "num_processes", state.dp_size)
        args, kwargs = with_argument(args, kwargs, 3, "process_index", state.dp_rank)
    return wrapped(*args, **kwargs)


def validate_accelerator(wrapped, instance, args, kwargs):
    """Refuse sp_size > 1 where it cannot run, when the Accelerator is built (before any model is prepared).
    Under FSDP2 accelerate's own check refuses a config with no ``dp_shard`` or ``cp`` dimension to shard over,
    which is every sequence-parallel one (its mesh is not built for sp: fsdp2.py); its other checks do not apply
    to sp there (the world-size check skips ``sp_backend="deepspeed"``, FSDP2 is a compatible type)."""
    accelerator = argument(args, kwargs, 0, "accelerator")
    if instance.sp_size > 1 and getattr(accelerator, "is_fsdp2", False):
        check_world(instance.sp_size, accelerator.num_processes)
        return None
    result = wrapped(*args, **kwargs)
    if instance.sp_size > 1:
        from accelerate.utils import DistributedType

        if accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise ConfigError(
                f"accel-npu: sequence parallelism (parallelism_config_sp_size {instance.sp_size}) runs under "
                f"DeepSpeed or FSDP2 for now; this launch is {accelerator.distributed_type.value}. Launch "
                "with a DeepSpeed config (launch_configs/cpu_zero2.yaml or npu_zero2.yaml) or FSDP2 (fsdp_version: 2)."
            )
        check_world(instance.sp_size, accelerator.num_processes)
    return result


def resolve_parallel_config(wrapped, instance, args, kwargs):
    """diffusers' ``_resolve_parallel_config`` (models/modeling_utils.py) names the rank's device as
    ``torch.device(type, rank % torch.accelerator.device_count())``: a ZeroDivisionError on CPU ranks, where
    the count is 0. There the device is the CPU; the rest is diffusers' own."""
    import torch
    import torch.distributed as dist

    if torch.accelerator.device_count() > 0 or not (dist.is_available() and dist.is_initialized()):
        return wrapped(*args, **kwargs)
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    config = argument(args, kwargs, 0, "config")
    if isinstance(config, ContextParallelConfig):
        config = ParallelConfig(context_parallel_config=config)
    elif isinstance(config, TensorParallelConfig):
        config = ParallelConfig(tensor_parallel_config=config)
    mesh = None
    if config.context_parallel_config is not None:
        cp = config.context_parallel_config
        mesh = cp.mesh or init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    elif config.tensor_parallel_config is not None:
        tp = config.tensor_parallel_config
        mesh = tp.mesh or init_device_mesh("cpu", (tp.tp_degree,), mesh_dim_names=("tp",))
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    instance._parallel_config = config
    return config

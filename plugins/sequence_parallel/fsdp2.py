"""Sequence parallelism for a diffusers model under FSDP2: accelerate 1.16's ``Accelerator._prepare_fsdp2``, with
the split set up before it and the gradient reduction corrected after it.

With ``sp_backend="deepspeed"`` and ``sp_size > 1`` accelerate builds no device mesh
(``ParallelismConfig.build_device_mesh``), so ``fsdp2_prepare_model`` calls ``fully_shard`` without one: every rank
is one shard group, and its reduce-scatter averages the gradients over every rank (torch
``_fsdp_collectives._get_gradient_divide_factors``: ``ReduceOp.AVG``). The ranks of one SP group hold partial
gradients of the same samples (each from its share of the tokens), which must be summed, and the data-parallel
groups averaged: every ``fully_shard``-ed module divides by processes / sp_size instead
(``FSDPModule.set_gradient_divide_factor``), with sum-only collectives
(``set_force_sum_reduction_for_comms``: a custom factor otherwise asks for ``PREMUL_SUM``, which gloo and HCCL
lack) — the gradient of the sp=1 run with the same global batch, as DeepSpeed's SP scaling gives under ZeRO-1/2.
The split, the groups, the DataLoader sharded by data-parallel rank and the shared random state are the DeepSpeed
path's (prepare.enable), set up before accelerate prepares the DataLoaders among the objects.
"""

from __future__ import annotations

import logging

from accel_npu.errors import ConfigError
from accel_npu.plugins.sequence_parallel import groups, prepare

log = logging.getLogger("accel_npu")


def prepare_fsdp2(wrapped, instance, args, kwargs):
    config = getattr(instance, "parallelism_config", None)
    if config is None or config.sp_size <= 1:
        return wrapped(*args, **kwargs)
    model = prepare._diffusers_model(args)
    if model is None:
        import torch

        other = next((obj for obj in args if isinstance(obj, torch.nn.Module)), None)
        if other is not None:
            # accelerate's own sequence parallelism (DeepSpeed's ALST, transformers models) runs in _prepare_deepspeed
            # only: under FSDP2 the model would train unsplit, its DataLoader sharded over every rank
            raise ConfigError(
                f"accel-npu: sequence parallelism (parallelism_config_sp_size {config.sp_size}) under FSDP2 splits "
                f"diffusers models; {type(other).__name__} is not one. For a transformers model launch with a "
                "DeepSpeed config (accelerate's own Ulysses), or without parallelism_config_sp_size."
            )
        return wrapped(*args, **kwargs)
    state = groups.active()
    if state is None:
        state = prepare.enable(instance, model, config)
    result = wrapped(*args, **kwargs)
    sum_gradients_within_sp_groups(result, state)
    return result


def sum_gradients_within_sp_groups(prepared, state: groups.SequenceParallel) -> None:
    """Every FSDP module of the prepared objects divides its reduced gradients by the data-parallel size."""
    from torch.distributed.fsdp import FSDPModule

    objects = prepared if isinstance(prepared, (tuple, list)) else (prepared,)
    count = 0
    for obj in objects:
        if not hasattr(obj, "modules"):
            continue
        for module in obj.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(state.dp_size))
                module.set_force_sum_reduction_for_comms(True)
                count += 1
    log.info(
        "accel-npu: sequence parallelism under FSDP2: %d FSDP module(s) sum gradients over each group of %d rank(s), "
        "divided by the %d data-parallel group(s)",
        count,
        state.sp_size,
        state.dp_size,
    )

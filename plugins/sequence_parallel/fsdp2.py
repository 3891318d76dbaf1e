"""Sequence parallelism for a diffusers model under FSDP2: accelerate 1.16's ``Accelerator._prepare_fsdp2``, with
the split set up before it.

With ``sp_backend="deepspeed"`` and ``sp_size > 1`` accelerate builds no device mesh
(``ParallelismConfig.build_device_mesh``), so ``fsdp2_prepare_model`` calls ``fully_shard`` without one: every rank
is one shard group, and its reduce-scatter averages the gradients over every rank (torch
``_fsdp_collectives._get_gradient_divide_factors``: ``ReduceOp.AVG``). The ranks of one SP group hold partial
gradients of the same samples (each from its share of the tokens), which must be summed. So every backward through
the split model's gather sums the output's gradient over the SP group before diffusers takes the rank's slice
(loss_average.py): the split model's partial gradients come out ``sp_size`` times larger, and FSDP2's mean over
every rank gives their sum averaged over the data-parallel groups, the gradient of the sp=1 run with the same global
batch. A module trained on the gathered output (an action head, prepared in one container with the transformer, as
FSDP2 takes one model) has the same gradient on every rank of a group, and the mean gives it once.
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
    state.sum_every_gathered_gradient = True
    log.info(
        "accel-npu: sequence parallelism under FSDP2: the gathered output's gradient is summed over each group of "
        "%d rank(s); FSDP2 averages over all %d",
        state.sp_size,
        state.world_size,
    )
    return wrapped(*args, **kwargs)

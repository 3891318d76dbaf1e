"""Ulysses sequence parallelism for unchanged diffusers training scripts, switched on by accelerate's own
parallelism config (``accelerate launch --use_parallelism_config --parallelism_config_sp_size N``, or
``parallelism_config:`` with ``parallelism_config_sp_size: N`` in the accelerate YAML), under DeepSpeed ZeRO-0
to 3 or FSDP2.

- the launcher: ``--use_parallelism_config`` beside a DeepSpeed config is accepted (accelerate refuses it
  without FSDP2 before reading the config file); an sp_size that does not divide the processes is refused
  before any worker starts (launch.py, through the accel_npu_launch_args hook);
- the Accelerator: sp_size > 1 outside DeepSpeed and FSDP2 is refused when it is built; under FSDP2 accelerate's
  own refusal of a config without a dimension to shard over (every sp one) is skipped (prepare.py);
- ``prepare`` of a diffusers model: accelerate's DeepSpeed Ulysses registers with transformers only and fails
  on a diffusers model (``'FrozenDict' object has no attribute 'get_text_config'``). Here the transformer's
  sequence is split by diffusers' own context-parallel hooks and Ulysses attention over DeepSpeed's SP groups
  (the model's ``_cp_plan``, or ours for CogVideoX, HunyuanVideo, SD3 and Cosmos:
  plans.py), DeepSpeed gets its own ``parallel_state_sp`` as
  ``mpu`` (gradients summed over an SP group, averaged over data-parallel groups), the DataLoader is sharded by
  data-parallel rank and the ranks of one SP group share their random state (prepare.py, groups.py); under
  ZeRO-3 the default reduce-scatter's gradients are multiplied by sp_size, as stage 1/2 scale them (zero3.py); under
  FSDP2 the same split, and every ``fully_shard``-ed module divides its reduced gradients by the data-parallel
  size instead of averaging over every rank (fsdp2.py);
- under DeepSpeed the engine's backward averages the loss over the SP group and diffusers' gather backward sums over
  it, so a module trained on the gathered output (an action head) gets the gradient of one rank (loss_average.py);
- diffusers' ``enable_parallelism`` on CPU ranks (a division by the accelerator count, 0 there).

This module declares the patches and hook implementations (accel_npu_launch_args; accel_npu_prepare_deepspeed, called
by ``Accelerator.prepare`` before ``_prepare_deepspeed``); the wrappers sit beside it: launch.py, prepare.py, zero3.py,
fsdp2.py, loss_average.py (plans.py, groups.py).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

# accelerate < 1.12 has no parallelism config: nothing to switch on, nothing to fix
_ACCELERATE = "accelerate>=1.12,<1.17"
_ACCELERATE_STOCK = "accelerate<1.12"
# deepspeed < 0.18.2 has no Ulysses for accelerate to call (accelerate refuses sp there)
_DEEPSPEED_STOCK = "deepspeed<0.18.2"
_DIFFUSERS_STOCK = "diffusers<0.42"
_DEEPSPEED = "deepspeed>=0.18.2,<0.20"
_DIFFUSERS = "diffusers>=0.42,<0.43"
_REMOVE_WHEN = "accelerate splits a diffusers model's sequence under DeepSpeed itself"

VALIDATE_ACCELERATOR = Patch(
    target="accelerate.parallelism_config:ParallelismConfig._validate_accelerator",
    supports=_ACCELERATE,
    stock_correct=_ACCELERATE_STOCK,
    reason="sp_size > 1 outside DeepSpeed/FSDP2 or not dividing the processes fails late: refused; FSDP2 sp, which "
    "accelerate refuses, passes.",
    remove_when="accelerate validates sp_size against the backend and the world size",
    wrapper=".prepare:validate_accelerator",
)

REGISTER_WITH_TRANSFORMERS = Patch(
    target="deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPAttentionHF.register_with_transformers",
    supports=_DEEPSPEED,
    stock_correct=_DEEPSPEED_STOCK,
    reason="accelerate gets DeepSpeed's mpu here; for a diffusers model it is DeepSpeed's parallel_state_sp.",
    remove_when=_REMOVE_WHEN,
    wrapper=".prepare:register_with_transformers",
)

DATALOADER_ADAPTER = Patch(
    target="deepspeed.runtime.sequence_parallel.ulysses_sp:UlyssesSPDataLoaderAdapter",
    supports=_DEEPSPEED,
    stock_correct=_DEEPSPEED_STOCK,
    reason="splits each batch's token ids; a diffusers batch has none (the sequence is inside the model): kept "
    "as prepared.",
    remove_when=_REMOVE_WHEN,
    wrapper=".prepare:dataloader_adapter",
)

PREPARE_DATA_LOADER = Patch(
    target="accelerate.accelerator:prepare_data_loader",
    supports=_ACCELERATE,
    stock_correct=_ACCELERATE_STOCK,
    reason="under sequence parallelism the DataLoader is sharded over every rank; one SP group must read one batch: "
    "sharded by data-parallel rank.",
    remove_when=_REMOVE_WHEN,
    wrapper=".prepare:prepare_data_loader",
)

RESOLVE_PARALLEL_CONFIG = Patch(
    target="diffusers.models.modeling_utils:ModelMixin._resolve_parallel_config",
    supports=_DIFFUSERS,
    stock_correct=_DIFFUSERS_STOCK,
    reason="torch.device(type, rank % torch.accelerator.device_count()) divides by zero on CPU ranks; the device "
    "is the CPU there.",
    remove_when="diffusers' _resolve_parallel_config handles a machine without an accelerator",
    wrapper=".prepare:resolve_parallel_config",
)


ZERO3_SCATTER_GRADIENTS = Patch(
    target="deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
    supports=_DEEPSPEED,
    stock_correct=_DEEPSPEED_STOCK,
    reason="ZeRO-3's default reduce-scatter averages gradients over all ranks, without stage 1/2's sp factor: "
    "sp=2 gets half of sp=1's gradient; multiplied by sp_size.",
    remove_when="DeepSpeed's ZeRO-3 __avg_scatter_grads scales by sequence_parallel_size, as its contiguous path does",
    wrapper=".zero3:scatter_gradients_summed_within_sp_groups",
)

PREPARE_FSDP2 = Patch(
    target="accelerate.accelerator:Accelerator._prepare_fsdp2",
    supports=_ACCELERATE,
    stock_correct=_ACCELERATE_STOCK,
    reason="FSDP2 with sp_size > 1 splits no diffusers model and averages the gradients an SP group must sum: "
    "split, every gathered gradient summed.",
    remove_when="accelerate splits a diffusers model's sequence under FSDP2 itself",
    wrapper=".fsdp2:prepare_fsdp2",
)

# loss_average.py: a module trained on the gathered output gets sp_size times its gradient otherwise
BACKWARD_LOSS_AVERAGED = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine.backward",
    supports=_DEEPSPEED,
    stock_correct=_DEEPSPEED_STOCK,
    reason="a module trained on the gathered output (an action head) runs on every SP rank, sp_size times its "
    "gradient: the loss is averaged over the SP group.",
    remove_when=_REMOVE_WHEN,
    wrapper=".loss_average:backward_with_the_loss_averaged",
)


def _gather_backward_patch(function: str) -> Patch:
    # diffusers' context parallelism (0.36) and its uneven gathers (0.37) predate the range this plugin runs at
    return Patch(
        target=f"diffusers.hooks.context_parallel:{function}.backward",
        supports=_DIFFUSERS,
        stock_correct=_DIFFUSERS_STOCK,
        reason="FSDP2 averages an SP group's partial gradients; under DeepSpeed a module on the gathered output "
        "gets sp_size times its gradient: summed over the SP group.",
        remove_when=_REMOVE_WHEN,
        wrapper=".loss_average:gathered_gradient_summed",
    )


GATHER_BACKWARD = _gather_backward_patch("AllGatherFunction")
GATHER_ANYTHING_BACKWARD = _gather_backward_patch("AllGatherAnythingFunction")


@hookimpl
def accel_npu_launch_args(backend, launch_args, resolved):
    from accel_npu.plugins.sequence_parallel import launch

    launch.launch_args(launch_args, resolved)


@hookimpl
def accel_npu_prepare_deepspeed(accelerator, objects):
    from accel_npu.plugins.sequence_parallel import prepare

    prepare.before_deepspeed_prepare(accelerator, objects)


@hookimpl
def accel_npu_register_patches():
    return [
        VALIDATE_ACCELERATOR,
        REGISTER_WITH_TRANSFORMERS,
        DATALOADER_ADAPTER,
        PREPARE_DATA_LOADER,
        RESOLVE_PARALLEL_CONFIG,
        ZERO3_SCATTER_GRADIENTS,
        PREPARE_FSDP2,
        BACKWARD_LOSS_AVERAGED,
        GATHER_BACKWARD,
        GATHER_ANYTHING_BACKWARD,
    ]

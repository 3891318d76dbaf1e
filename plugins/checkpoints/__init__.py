"""Checkpoints under DeepSpeed: atomic (optionally asynchronous) ``save_state``, checked ``load_state``,
saves made on rank 0 alone (diffusers #2606) completed by the other ranks, ZeRO-3 models gathered for a
save a group at a time, ``accel-npu consolidate``, a saved LoRA that loads whole whatever its first key,
and (any backend) a resume that draws the batches the uninterrupted run would have. docs/checkpoints.md
describes each.

This module declares the plugin: its patches, its command and its ``accel-npu env`` section. The
wrappers and machinery sit beside it: ``accelerator.py`` (the wrapped Accelerator methods),
``state.py``, ``background.py`` (asynchronous save_state), ``streaming.py`` (save_model one shard at a
time), ``serving.py`` and ``boundary.py`` (idle ranks serve rank 0's gathers and save_state),
``partitioned.py``, ``lora.py``, ``adapter_reload.py`` (a load hook's second LoRA load on resume),
``callsite.py``, ``consolidate.py``, ``files.py``, ``data_order.py`` (a resume's DataLoader order).
"""

from __future__ import annotations

from accel_npu import environment
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

_SUPPORTS = "accelerate>=1.10.1,<1.17"


def _patch(name, reason, remove_when, wrapper):
    return Patch(
        target=f"accelerate.accelerator:Accelerator.{name}",
        supports=_SUPPORTS,
        reason=reason,
        remove_when=remove_when,
        wrapper=wrapper,
    )


SAVE_STATE = _patch(
    "save_state",
    # Also: save hooks get DeepSpeed engines and no weights, so hooks written for DDP fail
    # ('unexpected save model'); consolidation needs the trained components' configs.
    "A crash during a DeepSpeed save_state leaves a half-written checkpoint in place of the previous "
    "one; it is written aside and renamed into place.",
    "accelerate/DeepSpeed write checkpoints to a temporary directory and publish them atomically",
    ".accelerator:save_state",
)
LOAD_STATE = _patch(
    "load_state",
    # Also: load hooks get an empty models list under DeepSpeed, so hooks written for DDP (diffusers'
    # Sana/SDXL LoRA scripts) fail on None.
    "Resume needs a complete checkpoint: an incomplete one is refused naming the missing files, an "
    "interrupted atomic swap is recovered.",
    "accelerate validates DeepSpeed checkpoints before loading them",
    ".accelerator:load_state",
)
GET_STATE_DICT = _patch(
    "get_state_dict",
    # Frozen towers kept out of the engine are added back to the state dict.
    "Under ZeRO-3 get_state_dict is a collective: called on rank 0 alone it gathers the whole model "
    "there or waits for the process-group timeout.",
    "accelerate detects a collective entered by one rank (and frozen towers are no longer hidden)",
    ".accelerator:get_state_dict",
)
SAVE_MODEL = _patch(
    "save_model",
    "Under ZeRO-3 save_model gathers the full 16-bit model into rank 0's memory (+1x model) and hangs "
    "when called by one rank only.",
    "accelerate/DeepSpeed write ZeRO-3 models shard by shard",
    ".accelerator:save_model",
)


WAIT_FOR_EVERYONE = Patch(
    target="accelerate.state:PartialState.wait_for_everyone",
    supports=_SUPPORTS,
    reason="Under ZeRO-3 rank 0 saving alone writes shape-[0] tensors while the others wait here; "
    "waiting ranks serve rank 0's gathers.",
    remove_when="accelerate/DeepSpeed gather partitioned parameters for a save made on one rank",
    wrapper=".boundary:wait_for_everyone",
)
END_TRAINING = Patch(
    target="accelerate.accelerator:Accelerator.end_training",
    supports=_SUPPORTS,
    reason="diffusers' scripts save on rank 0 while the others destroy the process group in "
    "end_training(); under ZeRO-3 they serve rank 0's gathers first.",
    remove_when="accelerate/DeepSpeed gather partitioned parameters for a save made on one rank",
    wrapper=".boundary:end_training",
)
GATHERED_ENTER = Patch(
    target="deepspeed.runtime.zero.partition_parameters:GatheredParameters.__enter__",
    supports="deepspeed>=0.16.9,<0.20",
    reason="A ZeRO-3 gather made on one rank for a save hangs; it is announced first, so idle ranks "
    "join it and busy ones make it fail in time.",
    remove_when="accelerate/DeepSpeed gather partitioned parameters for a save made on one rank",
    wrapper=".serving:gathered_enter",
)
ZERO3_FORWARD_FETCH = Patch(
    target="deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload.pre_sub_module_forward_function",
    supports="deepspeed>=0.16.9,<0.20",
    # In the step window (boundary.py) the paused ranks join each of rank 0's fetches.
    reason="A ZeRO-3 forward run on rank 0 alone (train_unconditional.py's sampling) hangs in its gathers.",
    remove_when="accelerate/DeepSpeed serve ZeRO-3 forwards made on one rank",
    wrapper=".boundary:pre_sub_module_forward",
)
ZERO3_PARAMETER_READ = Patch(
    target="deepspeed.runtime.zero.parameter_offload:ZeROOrderedDict.__getitem__",
    supports="deepspeed>=0.16.9,<0.20",
    # In the step window (boundary.py) the paused ranks join the gather; rank 0 partitions it again as its
    # window closes.
    # train_custom_diffusion.py's save_new_embed indexes the embedding on rank 0 alone.
    reason="A ZeRO-3 parameter rank 0 reads alone outside a forward is a shape-[0] partition (IndexError); "
    "gathered, served.",
    remove_when="accelerate/DeepSpeed serve ZeRO-3 parameters read on one rank",
    wrapper=".boundary:parameter_read",
)
DIFFUSERS_SAVE_PRETRAINED = Patch(
    target="diffusers.models.modeling_utils:ModelMixin.save_pretrained",
    supports="diffusers>=0.35.2,<0.43",
    reason="save_pretrained of a ZeRO-3 partitioned model writes shape-[0] tensors and exits 0 "
    "(train_text_to_image.py's final save); the trained model is lost.",
    remove_when="diffusers gathers ZeRO-3 partitioned parameters in save_pretrained",
    wrapper=".partitioned:diffusers_save_pretrained",
)
DIFFUSERS_SAVE_ATTN_PROCS = Patch(
    target="diffusers.loaders.unet:UNet2DConditionLoadersMixin.save_attn_procs",
    supports="diffusers>=0.35.2,<0.43",
    # train_custom_diffusion.py's final save.
    reason="save_attn_procs of ZeRO-3 partitioned custom-diffusion processors writes shape-[0] tensors, exit 0; "
    "written gathered.",
    remove_when="diffusers gathers ZeRO-3 partitioned parameters in save_attn_procs",
    wrapper=".partitioned:diffusers_save_attn_procs",
)
TRANSFORMERS_SAVE_PRETRAINED = Patch(
    target="transformers.modeling_utils:PreTrainedModel.save_pretrained",
    supports="transformers>=4.57.6,<5.26",
    reason="save_pretrained of a ZeRO-3 partitioned model writes shape-[0] tensors and exits 0 "
    "(train_llada2.py's checkpoints); the trained model is lost.",
    remove_when="transformers gathers ZeRO-3 partitioned parameters in save_pretrained",
    wrapper=".partitioned:transformers_save_pretrained",
)
SAFETENSORS_SAVE_FILE = Patch(
    # transformers/modeling_utils.py binds its alias safe_save_file at import, after this is applied
    # (safetensors.torch imports torch, which activates accel-npu): save_pretrained's shards come here too
    target="safetensors.torch:save_file",
    supports="safetensors>=0.4.3,<0.9",
    reason="save_file of ZeRO-3 partitioned parameters writes their empty local data (shape [0]).",
    remove_when="never: safetensors knows nothing of ZeRO-3; remove with the save_pretrained patch",
    wrapper=".partitioned:save_file",
)


ENGINE_STEP = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine.step",
    supports="deepspeed>=0.16.9,<0.20",
    # The copy is made in the background after save_state returns; only this step changes what it reads.
    reason="An asynchronous save_state copies the parameters and optimizer states after it returns; the next "
    "step, which updates them in place, waits for that copy.",
    remove_when="never while save_state copies the engine's state in the background (accel-npu's own)",
    wrapper=".background:engine_step",
)


PEFT_STATE_DICT = Patch(
    target="peft.utils.save_and_load:get_peft_model_state_dict",
    supports="peft>=0.17,<0.22",
    # It hands back the partitioned parameters, which save_file gathers.
    reason="Under ZeRO-3 get_peft_model_state_dict returns empty copies, so save_lora_weights writes "
    "shape-[0] tensors (exit 0) that load_lora_weights refuses.",
    remove_when="peft gathers ZeRO-3 parameters in get_peft_model_state_dict",
    wrapper=".lora:peft_state_dict",
)

PEFT_LOAD_ADAPTER = Patch(
    target="peft.peft_model:PeftModel.load_adapter",
    supports="peft>=0.17,<0.22",
    # Only inside load_state's hooks under DeepSpeed, for an adapter the engine-held model already has.
    reason="On resume, a load hook's load_adapter casts the engine's bf16 LoRA to new fp32 parameters the "
    "optimizer does not hold (train_lcm_distill_lora_*_wds.py).",
    remove_when="peft loads an existing adapter without replacing its parameters, or diffusers' LCM LoRA "
    "scripts stop loading the adapter again in their load hook",
    wrapper=".adapter_reload:peft_load_adapter",
)
DIFFUSERS_LOAD_LORA_ADAPTER = Patch(
    target="diffusers.loaders.peft:PeftAdapterMixin.load_lora_adapter",
    supports="diffusers>=0.35.2,<0.43",
    # Keys already in peft's naming are left as they are; the in-place load only inside load_state's hooks
    # under DeepSpeed, for keys matching an adapter the model already has.
    reason="A LoRA mixing old and peft key names loads in part (diffusers #14548); on resume a load hook's "
    "load_lora_into_unet adds an adapter the optimizer lacks.",
    remove_when="diffusers converts every old-style key, and the sd15 advanced script drops its hook's second "
    "load (as #6514 did for SDXL)",
    wrapper=".lora:load_lora_adapter",
)

BACKWARD = _patch(
    "backward",
    # Marks the step boundary (accelerate's DeepSpeedEngineWrapper.backward runs engine.step()).
    "diffusers' scripts call save_state on rank 0 only, which under DeepSpeed hangs (diffusers #2606); "
    "the other ranks serve it at the step boundary.",
    "accelerate saves a main-process-only save_state under DeepSpeed, or diffusers calls it on every rank",
    ".boundary:backward",
)


PREPARE_DATA_LOADER = _patch(
    "prepare_data_loader",
    # The first prepared loader registers the save/load pre-hooks that keep them (data_order.py).
    "save_state leaves out a prepared DataLoader's shuffle generator and epoch: a resume replays epoch 0's "
    "order (accelerate #3158).",
    "accelerate's save_state writes the loaders' shuffle generators and epoch counters (accelerate #3996)",
    ".data_order:prepare_data_loader",
)


def _iter_patch(cls):
    return Patch(
        target=f"accelerate.data_loader:{cls}.__iter__",
        supports=_SUPPORTS,
        # The next batch after an optimizer step is a rank's clean point: nothing drawn, RNG as at the step.
        # Also where an epoch's shuffle generator state is noted before its order is drawn (data_order.py).
        reason="A rank's next batch after an optimizer step is where it waits for rank 0 and serves a "
        "save_state made alone (diffusers #2606).",
        remove_when="with the Accelerator.backward patch",
        wrapper=".boundary:dataloader_iter",
    )


OPTIMIZER_STEP = Patch(
    target="accelerate.optimizer:AcceleratedOptimizer.step",
    supports=_SUPPORTS,
    reason="Under FSDP the step boundary where the other ranks serve rank 0's save_state (diffusers #2606) is "
    "after the script's optimizer.step(), not in backward.",
    remove_when="with the Accelerator.backward patch",
    wrapper=".boundary:optimizer_step",
)
DATALOADER_SHARD_ITER = _iter_patch("DataLoaderShard")
DATALOADER_DISPATCHER_ITER = _iter_patch("DataLoaderDispatcher")
SKIP_DATALOADER_ITER = _iter_patch("SkipDataLoader")


@hookimpl
def accel_npu_register_patches():
    return [
        SAVE_STATE,
        LOAD_STATE,
        GET_STATE_DICT,
        SAVE_MODEL,
        WAIT_FOR_EVERYONE,
        END_TRAINING,
        GATHERED_ENTER,
        ZERO3_FORWARD_FETCH,
        ZERO3_PARAMETER_READ,
        DIFFUSERS_SAVE_PRETRAINED,
        DIFFUSERS_SAVE_ATTN_PROCS,
        TRANSFORMERS_SAVE_PRETRAINED,
        SAFETENSORS_SAVE_FILE,
        ENGINE_STEP,
        PEFT_STATE_DICT,
        PEFT_LOAD_ADAPTER,
        DIFFUSERS_LOAD_LORA_ADAPTER,
        BACKWARD,
        OPTIMIZER_STEP,
        DATALOADER_SHARD_ITER,
        DATALOADER_DISPATCHER_ITER,
        SKIP_DATALOADER_ITER,
        PREPARE_DATA_LOADER,
    ]


@hookimpl
def accel_npu_env_report(backend):
    return (
        "checkpoints",
        {
            "ACCEL_NPU_COLLECTIVE_TIMEOUT": environment.get("ACCEL_NPU_COLLECTIVE_TIMEOUT") + " s",
            "save_state under DeepSpeed": "atomic (temporary directory, rename, `latest` last)",
            "ACCEL_NPU_ASYNC_CHECKPOINT": environment.get("ACCEL_NPU_ASYNC_CHECKPOINT")
            + " (1: files written in the background, published once every rank's are durable)",
            "rank-0-only save_state right after an optimizer step": "served by the other ranks at their next batch",
        },
    )


@hookimpl
def accel_npu_add_commands(subparsers):
    from accel_npu.plugins.checkpoints import consolidate

    consolidate.add_parser(subparsers)

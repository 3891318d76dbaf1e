"""Bounded-memory model loading: truncation, validation, meta-init, staggered slots.

This module declares the plugin (its patches and its ``accel-npu env`` section); the machinery
sits beside it (docs/loading.md): ``diffusers.py`` and ``transformers.py`` (the two
``from_pretrained``), ``frozen.py`` (loads kept outside zero.Init), ``placement/`` (zero3, fsdp,
local), ``slots.py``, ``lazy.py``, ``prefetch.py``, ``truncation.py``, ``job.py``, ``report.py`` (the
section). Every wrapper hands calls it does not improve to the stock implementation (hub ids,
device_map, quantization, variants, pickled checkpoints, ...).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

DIFFUSERS_MODEL = Patch(
    target="diffusers.models.modeling_utils:ModelMixin.from_pretrained",
    supports="diffusers>=0.35.2,<0.43",
    # Stock also opens every shard for num_layers=N, leaves missing keys on meta, half-loads a
    # corrupt checkpoint and ignores zero3_init_flag (docs/loading.md).
    reason="Each rank reads and builds the whole model in fp32 before prepare (host OOM at 2 ranks); "
    "loads are truncated, checked, staggered or partitioned.",
    remove_when="diffusers reads only the tensors of the configured depth, errors on missing keys, "
    "staggers ranks and builds under zero.Init (not as of 0.42)",
    wrapper=".diffusers:from_pretrained",
)

DIFFUSERS_DTYPE = Patch(
    target="diffusers.models.modeling_utils:get_parameter_dtype",
    supports="diffusers>=0.35.2,<0.43",
    # Read outside an engine, the model is made whole first.
    reason="A model loaded into ZeRO-3 partitions reports bf16 before prepare, so train_dreambooth.py "
    "refuses it ('Unet loaded as datatype torch.bfloat16').",
    remove_when="diffusers builds models under zero.Init itself (then its dtype is zero.Init's, as stock)",
    wrapper=".placement.zero3:parameter_dtype",
)

DIFFUSERS_CONFIG_CHANGE = Patch(
    target="diffusers.configuration_utils:ConfigMixin.register_to_config",
    supports="diffusers>=0.35.2,<0.43",
    # Called by the script on a model loaded into ZeRO-3 partitions, before prepare: made whole first.
    reason="train_instruct_pix2pix{,_sdxl}.py set in_channels=8, then copy conv_in.weight into a wider conv: "
    "a model loaded into ZeRO-3 partitions has none.",
    remove_when="diffusers builds models under zero.Init itself (then stock breaks the script alike)",
    wrapper=".placement.zero3:config_changed",
)

TRANSFORMERS_MODEL = Patch(
    target="transformers.modeling_utils:PreTrainedModel.from_pretrained",
    supports="transformers>=4.57.6,<5.26",
    reason="ACCEL_NPU_TRUNCATE for transformers classes, an error instead of random init past the "
    "checkpoint's depth, node-level load slots, malloc_trim.",
    remove_when="never for ACCEL_NPU_TRUNCATE; slots: when transformers staggers per-node loading",
    wrapper=".transformers:from_pretrained",
)

DIFFUSERS_PIPELINE = Patch(
    target="diffusers.pipelines.pipeline_utils:DiffusionPipeline.from_pretrained",
    supports="diffusers>=0.35.2,<0.43",
    reason="Under ZeRO-3 transformers builds a pipeline's inference towers (VAE, text encoders) inside "
    "zero.Init, partitioned and cast (accelerate #3170, diffusers #10743).",
    remove_when="transformers/accelerate stop using zero.Init for pipeline components",
    wrapper=".frozen:pipeline_from_pretrained",
)

FSDP2_LOAD_FULL_STATE_DICT = Patch(
    target="accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict",
    supports="accelerate>=1.10.1,<1.17",
    # Every other rank also receives each whole tensor into a new buffer before its shard is
    # scattered: node peak = full model + all shards + ~half a model per other rank.
    reason="accelerate/utils/fsdp_utils.py keeps rank 0's whole original_sd alive until every shard is "
    "built; each tensor is scattered and freed in turn.",
    remove_when="accelerate frees original_sd entries as it scatters them into the shards",
    wrapper=".placement.fsdp:load_full_state_dict_streaming",
)

ZERO3_INIT_CM = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.zero3_init_context_manager",
    supports="accelerate>=1.10.1,<1.17",
    reason="zero3_init_context_manager(enable=False) leaves transformers' HfDeepSpeedConfig set, so "
    "towers still build under zero.Init (accelerate #3170).",
    remove_when="accelerate clears the weakref when zero.Init is disabled",
    wrapper=".frozen:zero3_init_context_manager",
)


ZERO3_INIT_FLAG = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.set_deepspeed_weakref",
    supports="accelerate>=1.10.1,<1.17",
    # The object is marked with the flag; loads honour it.
    reason="With zero3_init_flag: false accelerate still sets transformers' HfDeepSpeedConfig: towers load "
    "partitioned ('Padding_idx must be within num_embeddings').",
    remove_when="accelerate sets the weakref only when zero3_init_flag is true",
    wrapper=".frozen:set_deepspeed_weakref",
)

TRANSFORMERS_FROM_CONFIG = Patch(
    target="transformers.modeling_utils:PreTrainedModel._from_config",
    supports="transformers>=4.57.6,<5.26",
    reason="AutoModel.from_config builds under zero.Init whenever the HfDeepSpeedConfig weakref is set, "
    "even with accelerate's zero3_init_flag: false.",
    remove_when="accelerate sets the weakref only when zero3_init_flag is true",
    wrapper=".frozen:from_config",
)


@hookimpl
def accel_npu_register_patches():
    return [
        DIFFUSERS_MODEL,
        DIFFUSERS_DTYPE,
        DIFFUSERS_CONFIG_CHANGE,
        TRANSFORMERS_MODEL,
        DIFFUSERS_PIPELINE,
        ZERO3_INIT_CM,
        FSDP2_LOAD_FULL_STATE_DICT,
        ZERO3_INIT_FLAG,
        TRANSFORMERS_FROM_CONFIG,
    ]


@hookimpl
def accel_npu_env_report(backend):
    from accel_npu.plugins.loading import report

    return ("Loading", report.loading_report())

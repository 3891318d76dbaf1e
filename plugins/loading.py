"""Bounded-memory model loading: truncation, validation, meta-init, staggered slots (issue 4).

Only hooks and Patch declarations live here; the machinery is :mod:`accel_npu.loading`
(docs/loading.md). Every wrapper hands calls it does not improve to the stock implementation
(hub ids, device_map, quantization, variants, pickled checkpoints, ...).
"""
from __future__ import annotations

from accel_npu import hookimpl
from accel_npu.patching import Patch


def _diffusers_model(wrapped, instance, args, kwargs):
    from accel_npu.loading import diffusers_from_pretrained

    return diffusers_from_pretrained(wrapped, instance, args, kwargs)


def _transformers_model(wrapped, instance, args, kwargs):
    from accel_npu.loading import transformers_from_pretrained

    return transformers_from_pretrained(wrapped, instance, args, kwargs)


def _diffusers_pipeline(wrapped, instance, args, kwargs):
    from accel_npu.loading import pipeline_from_pretrained

    return pipeline_from_pretrained(wrapped, instance, args, kwargs)


def _zero3_init_cm(wrapped, instance, args, kwargs):
    from accel_npu.loading import zero3_init_context_manager

    return zero3_init_context_manager(wrapped, instance, args, kwargs)


DIFFUSERS_MODEL = Patch(
    target="diffusers.models.modeling_utils:ModelMixin.from_pretrained",
    supports="diffusers>=0.35,<0.43",
    reason="Stock builds/reads every layer even with num_layers=N (all shards opened, dropped blocks "
           "paged in, one warning per key), casts all to fp32 per rank without torch_dtype (field report "
           "000: host OOM with 2 ranks), leaves missing keys on meta, half-loads corrupt checkpoints, and "
           "ignores zero3_init_flag under ZeRO-3 (every rank builds the whole model before prepare).",
    remove_when="diffusers reads only the tensors of the configured depth, errors on missing keys, "
                "staggers ranks and builds under zero.Init (not as of 0.42)",
    wrapper=_diffusers_model,
)

TRANSFORMERS_MODEL = Patch(
    target="transformers.modeling_utils:PreTrainedModel.from_pretrained",
    supports="transformers>=4.50,<5.30",
    reason="ACCEL_NPU_TRUNCATE for transformers classes, a clear error instead of random init when the "
           "requested depth exceeds the checkpoint, node-level load slots and malloc_trim.",
    remove_when="never for ACCEL_NPU_TRUNCATE; slots: when transformers staggers per-node loading",
    wrapper=_transformers_model,
)

DIFFUSERS_PIPELINE = Patch(
    target="diffusers.pipelines.pipeline_utils:DiffusionPipeline.from_pretrained",
    supports="diffusers>=0.35,<0.43",
    reason="Pipeline components (VAE, text encoders) are inference towers: under ZeRO-3 transformers "
           "builds them inside zero.Init (partitioned, cast) — accelerate #3170, diffusers #10743.",
    remove_when="transformers/accelerate stop using zero.Init for pipeline components",
    wrapper=_diffusers_pipeline,
)

def _fsdp2_load_full_state_dict(wrapped, instance, args, kwargs):
    from accel_npu.fsdp_loading import load_full_state_dict_releasing

    return load_full_state_dict_releasing(wrapped, instance, args, kwargs)


FSDP2_LOAD_FULL_STATE_DICT = Patch(
    target="accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict",
    supports="accelerate>=1.10,<1.16",
    reason="FSDP2 prepare with cpu_ram_efficient_loading keeps rank 0's whole model alive (its "
           "original_sd) until every shard is built: node peak = full model + all shards (2 x model). "
           "Each full tensor can go once it is broadcast.",
    remove_when="accelerate releases original_sd entries as it broadcasts them",
    wrapper=_fsdp2_load_full_state_dict,
)

ZERO3_INIT_CM = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.zero3_init_context_manager",
    supports="accelerate>=1.10,<1.16",
    reason="zero3_init_context_manager(enable=False) leaves transformers' HfDeepSpeedConfig weakref set, "
           "so frozen towers are still built under zero.Init (accelerate #3170, diffusers #10743).",
    remove_when="accelerate clears the weakref when zero.Init is disabled",
    wrapper=_zero3_init_cm,
)


@hookimpl
def accel_npu_register_patches():
    return [DIFFUSERS_MODEL, TRANSFORMERS_MODEL, DIFFUSERS_PIPELINE, ZERO3_INIT_CM, FSDP2_LOAD_FULL_STATE_DICT]


@hookimpl
def accel_npu_env_report(backend):
    from accel_npu.loading import loading_report

    return ("Loading", loading_report())

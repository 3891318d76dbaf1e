"""DeepSpeed setup as CUDA repos write it, made to work as written.

- mixed precision: an accelerate config (or ``--mixed_precision``) that sets
  ``mixed_precision`` beside ``deepspeed_config_file`` is rejected by accelerate 1.15 ("the
  following accelerate config variables will be ignored: [...]"), and a value that disagrees
  with the DeepSpeed JSON is another hard ValueError. Here the DeepSpeed file is the source of
  truth for precision: the launcher (and, for scripts that pass ``Accelerator(mixed_precision=...)``,
  each worker) resolves the two, logs the effective value once, and refuses only a real
  contradiction (fp16 in one, bf16 in the other, both explicit) with one error naming both.
- a script's hard-coded ``DeepSpeedPlugin(hf_ds_config="...")``: when
  the launch config names a DeepSpeed file, that file wins (logged); without one the script's
  choice stands.
- ``@torch.inference_mode()`` eval under ZeRO-3: parameters gathered under
  inference mode become inference tensors and the next training forward fails ("Inference
  tensors cannot be saved for backward"). ZeRO-3 parameter fetches run outside inference mode.
- ``"train_micro_batch_size_per_gpu": "auto"`` where accelerate reads no DataLoader.batch_size (a
  ``batch_sampler=`` loader, or no DataLoader in ``prepare`` as the LCM webdataset scripts do): read from
  the sampler, or set from the engine's first training batch (auto_batch_size.py).
- a ZeRO-3 engine's ``parameters()`` / ``named_parameters()`` iterated by the script itself (the LCM
  distillation scripts' EMA update after each step): each partitioned parameter gathered, read-only,
  while the script holds it; writes refused (gathered_reads.py).
- several models and one optimizer over them in one ``accelerator.prepare`` (accelerate: "multiple models
  when using DeepSpeed"): one engine over a container of the models, each position given the model's view
  of it, stepping at the script's ``optimizer.step()`` (models_together.py); a gradient the script reads
  between backward and step shown whole and written back (shown_gradients.py); several models each with its
  own optimizer (a GAN): one engine each, one backward through all (engine_per_model.py).
- ``torch.autograd.grad`` through an engine, or a backward into other engines' parameters only: not taken for
  that engine's backward (torch_style_backward.py).
- spectral norm's ``u``/``v`` buffers cast with their weight; a forward given fp32 activations hands back fp32, as
  accelerate's autocast under DDP does (input_dtype.py).
- inputs of the other half dtype (fp16 activations for a bf16 engine, as diffusers' CogVideoX LoRA
  scripts make them) are cast at the engine's boundary (input_dtype.py).

This module declares the patches; the wrappers sit beside it: mixed_precision.py, config_file.py,
inference_mode.py, prepare.py (auto_batch_size.py, models_together.py, engine_per_model.py, shown_gradients.py),
input_dtype.py, torch_style_backward.py, gathered_reads.py (precision_config.py: what the configs say).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

DEEPSPEED_LAUNCHER = Patch(
    target="accelerate.commands.launch:deepspeed_launcher",
    supports="accelerate>=1.10.1,<1.17",
    # A mismatch with the DeepSpeed JSON is another ValueError; a real fp16/bf16 contradiction is one
    # error naming both files, before any worker starts.
    reason="mixed_precision beside deepspeed_config_file fails in every worker (accelerate's "
    "_deepspeed_config_checks); the launcher lets the DeepSpeed file decide.",
    remove_when="accelerate reconciles mixed_precision with a DeepSpeed config file itself",
    wrapper=".mixed_precision:deepspeed_launcher",
)


CONFIG_CHECKS = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin._deepspeed_config_checks",
    supports="accelerate>=1.10.1,<1.17",
    reason="'the following accelerate config variables will be ignored' for mixed_precision, which "
    "set_mixed_precision reconciles with the DeepSpeed file instead.",
    remove_when="accelerate reconciles mixed_precision with a DeepSpeed config file itself",
    wrapper=".mixed_precision:config_checks",
)

SET_MIXED_PRECISION = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.set_mixed_precision",
    supports="accelerate>=1.10.1,<1.17",
    reason="'`--mixed_precision` arg cannot be set to X when Y is set in the DeepSpeed config file'; the "
    "file decides, a real fp16/bf16 clash is one ConfigError.",
    remove_when="accelerate reconciles mixed_precision with a DeepSpeed config file itself",
    wrapper=".mixed_precision:set_mixed_precision",
)


PLUGIN_POST_INIT = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.__post_init__",
    supports="accelerate>=1.10.1,<1.17",
    # Also where the accel_npu_configure_deepspeed hook sees every DeepSpeed config.
    reason="A script's hard-coded DeepSpeedPlugin(hf_ds_config='...') silently overrides the launch "
    "config's deepspeed_config_file; the launch-side file wins.",
    remove_when="accelerate prefers the launch config's DeepSpeed file (or warns about the override)",
    wrapper=".config_file:plugin_post_init",
)


# -- ZeRO-3 fetch outside inference mode ------------------------------------------------------------
ZERO3_FETCH = Patch(
    target="deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.fetch_sub_module",
    supports="deepspeed>=0.16.9,<0.20",
    # ZeRO-3 keeps parameters gathered after a forward without backward.
    reason="ZeRO-3 parameters gathered under inference_mode() break the next training forward "
    "('Inference tensors cannot be saved for backward', runtime/zero/linear.py).",
    remove_when="DeepSpeed gathers ZeRO-3 parameters outside inference mode itself",
    wrapper=".inference_mode:fetch_sub_module",
)


# -- accelerator.prepare: several models with one optimizer; "auto" micro batch size ------------------
PREPARE = Patch(
    target="accelerate.accelerator:Accelerator.prepare",
    supports="accelerate>=1.10.1,<1.17",
    # Several models with one optimizer over all their trainable parameters (diffusers' custom_diffusion with
    # --modifier_token) become one engine over a container of them (models_together.py); several models each with
    # its own optimizer (vqgan/train_vqgan.py) one engine each (engine_per_model.py); other multi-model calls keep
    # accelerate's assertion, with the reason. "auto" micro batch: diffusers' bucketing DreamBooth
    # LoRA scripts pass batch_sampler=; the LCM *_wds.py scripts prepare no DataLoader (webdataset batches);
    # the engine's first training forward sets the value (a forward pre-hook on that engine, removed after).
    # A data_efficiency config is one error naming the key and file.
    reason="accelerator.py prepare: one model per Accelerator under DeepSpeed, whatever the optimizers; 'auto' "
    "micro batch only from DataLoader.batch_size. Both completed.",
    remove_when="accelerate prepares several models under DeepSpeed and resolves 'auto' micro batch sizes "
    "without a DataLoader.batch_size",
    wrapper=".prepare:prepare",
)


# -- inputs of the other half dtype -----------------------------------------------------------------
ENGINE_INPUT_DTYPE = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine.forward",
    supports="deepspeed>=0.16.9,<0.20",
    # diffusers v0.40.0 examples/cogvideo/train_cogvideox_*lora.py run frozen towers in fp16 under a
    # bf16 config and stop with 'mat1 and mat2 must have the same dtype' (models/embeddings.py).
    reason="DeepSpeed casts inputs only under fp16.auto_cast: other-half inputs are cast; fp32 activations run "
    "under torch.autocast, as accelerate runs them under DDP.",
    remove_when="DeepSpeed casts floating-point inputs to the engine's dtype itself (auto_cast for bf16)",
    wrapper=".input_dtype:cast_other_half_inputs",
)

ZERO3_PARAM_DTYPE = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine._cast_module_mixed_precision",
    supports="deepspeed>=0.19.2,<0.20",
    # Before 0.19.2 _configure_distributed_model called module.bfloat16()/half() on every model, zero.Init
    # partitions and buffers included (deepspeed 0.19.1 runtime/engine.py), which cast what a script cast after
    # loading; 0.19.2 moved the cast into _cast_module_mixed_precision, which skips zero.Init models and keeps
    # buffers fp32.
    stock_correct="deepspeed<0.19.2",
    # diffusers' cogvideo/train_cogvideox_lora.py casts .to(float16) under a bf16 config; vqgan/train_vqgan.py's
    # discriminator is spectral-normed.
    # Spectral norm's u/v stay fp32 beside half weights: "addmv input tensors must have the same dtype".
    reason="runtime/engine.py casts no zero.Init parameter (a cast after loading trains in the wrong dtype) and no "
    "spectral-norm buffer; both cast.",
    remove_when="DeepSpeed casts zero.Init parameters that are not in the configured dtype, and spectral norm's "
    "buffers with their weight",
    wrapper=".input_dtype:cast_what_deepspeed_skips",
)


# -- autograd passes through an engine's outputs that put nothing into its parameters ------------------------
# diffusers v0.40.0's vqgan/train_vqgan.py: torch.autograd.grad for its adaptive weight and gradient penalty, and one
# engine per model (engine_per_model.py) with the generator's loss through the discriminator.
ENGINE_OUTPUT_BACKWARD_HOOK = Patch(
    target="deepspeed.runtime.utils:OutputBackwardHookManager._make_backward_hook",
    supports="deepspeed>=0.18.3,<0.20",
    # OutputBackwardHookManager came in 0.18.3 (not in 0.18.2's runtime/utils.py): before it no backward hook sits
    # on an engine's outputs, so an autograd pass through one never enters the engine's backward.
    stock_correct="deepspeed<0.18.3",
    # Also: the once-per-forward prologue and ZeRO-3's backward gathers are not used up before the real backward, and
    # an engine called twice before one backward enters its optimizer's backward once.
    reason="A torch.autograd.grad through an engine is taken for its backward: its epilogue reduces no gradient "
    "('list index out of range').",
    remove_when="DeepSpeed's PyTorch-style backward hooks skip passes that accumulate into none of the engine's "
    "parameters",
    wrapper=".torch_style_backward:output_backward_hook",
)


# -- a ZeRO-3 engine's parameters read by the script --------------------------------------------------
# DeepSpeedEngine inherits both from torch.nn.Module; the patch sets them on the engine class only (no cost
# for other modules) and removes them again on unpatch. diffusers v0.40.0's train_lcm_distill_sd_wds.py:1371
# and train_lcm_distill_sdxl_wds.py:1474 run update_ema(target_unet.parameters(), unet.parameters()) on the
# engine after every step.
ENGINE_PARAMETERS = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine.parameters",
    supports="deepspeed>=0.16.9,<0.20",
    reason="A script iterating a ZeRO-3 engine's parameters() reads shape-[0] partitions ('size of tensor a (3) "
    "must match ... b (0)'); gathered while held.",
    remove_when="DeepSpeed gathers ZeRO-3 parameters read outside the engine's forward itself",
    wrapper=".gathered_reads:parameters",
)

ENGINE_NAMED_PARAMETERS = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine.named_parameters",
    supports="deepspeed>=0.16.9,<0.20",
    reason="A script iterating a ZeRO-3 engine's named_parameters() reads shape-[0] partitions; gathered while "
    "held (GatheredParameters).",
    remove_when="DeepSpeed gathers ZeRO-3 parameters read outside the engine's forward itself",
    wrapper=".gathered_reads:named_parameters",
)


@hookimpl
def accel_npu_register_patches():
    return [
        DEEPSPEED_LAUNCHER,
        CONFIG_CHECKS,
        SET_MIXED_PRECISION,
        PLUGIN_POST_INIT,
        ZERO3_FETCH,
        PREPARE,
        ENGINE_INPUT_DTYPE,
        ZERO3_PARAM_DTYPE,
        ENGINE_OUTPUT_BACKWARD_HOOK,
        ENGINE_PARAMETERS,
        ENGINE_NAMED_PARAMETERS,
    ]

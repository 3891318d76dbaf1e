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
- inputs of the other half dtype (fp16 activations for a bf16 engine, as diffusers' CogVideoX LoRA
  scripts make them) are cast at the engine's boundary (input_dtype.py).
"""
from __future__ import annotations

import json
import logging
import os

from accel_npu._torch.markers import DS_CONFIG_SOURCE
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument
from accel_npu.plugins.deepspeed.auto_batch_size import prepare_with_auto_micro_batch_size
from accel_npu.plugins.deepspeed.input_dtype import cast_other_half_inputs, cast_partitioned_params
from accel_npu.plugins.deepspeed.precision_config import file_precision, resolve_precision

log = logging.getLogger("accel_npu")

__all__ = ["file_precision", "resolve_precision"]


# -- launcher side -----------------------------------------------------------------------------------
def _accelerate_config_path(args) -> str:
    if getattr(args, "config_file", None):
        return str(args.config_file)
    try:
        from accelerate.commands.config.config_args import default_config_file

        return str(default_config_file)
    except Exception:  # noqa: BLE001
        return "the accelerate config"


def _deepspeed_launcher(wrapped, instance, args, kwargs):
    launch_args = argument(args, kwargs, 0, "args")
    ds_file = getattr(launch_args, "deepspeed_config_file", None)
    if launch_args is None or not ds_file or not os.path.isfile(ds_file):
        return wrapped(*args, **kwargs)
    try:
        with open(ds_file) as f:
            ds_config = json.load(f)
    except (OSError, ValueError):
        return wrapped(*args, **kwargs)  # accelerate/DeepSpeed report unreadable files themselves
    fields = [f for f in str(getattr(launch_args, "deepspeed_fields_from_accelerate_config", "") or "").split(",") if f]
    from_config = "mixed_precision" in fields
    mp = getattr(launch_args, "mixed_precision", None) or "no"
    if from_config:
        source = f"mixed_precision in accelerate config {_accelerate_config_path(launch_args)}"
    elif mp != "no":
        source = "--mixed_precision"
    else:
        source = "accelerate (unset)"
    effective, line = resolve_precision(mp, source, ds_config, ds_file)
    if line:
        (log.warning if (from_config or mp != "no") else log.info)(line)
        launch_args.mixed_precision = effective
        launch_args.deepspeed_fields_from_accelerate_config = ",".join(f for f in fields if f != "mixed_precision")
    return wrapped(*args, **kwargs)


DEEPSPEED_LAUNCHER = Patch(
    target="accelerate.commands.launch:deepspeed_launcher",
    supports="accelerate>=1.10,<1.16",
    # A mismatch with the DeepSpeed JSON is another ValueError; a real fp16/bf16 contradiction is one
    # error naming both files, before any worker starts.
    reason="mixed_precision beside deepspeed_config_file fails in every worker (accelerate's "
           "_deepspeed_config_checks); the launcher lets the DeepSpeed file decide.",
    remove_when="accelerate reconciles mixed_precision with a DeepSpeed config file itself",
    wrapper=_deepspeed_launcher,
)


# -- worker side ---------------------------------------------------------------------------------
def _config_checks(wrapped, instance, args, kwargs):
    raw = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS")
    fields = (raw or "").split(",")
    if "mixed_precision" not in fields:
        return wrapped(*args, **kwargs)
    # mixed_precision is reconciled in set_mixed_precision below; the other fields keep stock checks
    os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(f for f in fields if f != "mixed_precision")
    try:
        return wrapped(*args, **kwargs)
    finally:
        os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = raw


def _set_mixed_precision(wrapped, instance, args, kwargs):
    mixed_precision = argument(args, kwargs, 0, "mixed_precision")
    ds_source = str(getattr(instance, DS_CONFIG_SOURCE, None) or "<DeepSpeedPlugin config>")
    env_mp = os.environ.get("ACCELERATE_MIXED_PRECISION")
    source = ("ACCELERATE_MIXED_PRECISION (accelerate launch)" if env_mp and env_mp.lower() == str(mixed_precision).lower()
              else "Accelerator(mixed_precision=...)")
    effective, line = resolve_precision(mixed_precision, source, instance.deepspeed_config, ds_source)
    if line and effective != (mixed_precision or "no"):
        log.warning(line)
    return wrapped(effective)


CONFIG_CHECKS = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin._deepspeed_config_checks",
    supports="accelerate>=1.10,<1.16",
    reason="'the following accelerate config variables will be ignored' for mixed_precision, which "
           "set_mixed_precision reconciles with the DeepSpeed file instead.",
    remove_when="accelerate reconciles mixed_precision with a DeepSpeed config file itself",
    wrapper=_config_checks,
)

SET_MIXED_PRECISION = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.set_mixed_precision",
    supports="accelerate>=1.10,<1.16",
    reason="'`--mixed_precision` arg cannot be set to X when Y is set in the DeepSpeed config file'; the "
           "file decides, a real fp16/bf16 clash is one ConfigError.",
    remove_when="accelerate reconciles mixed_precision with a DeepSpeed config file itself",
    wrapper=_set_mixed_precision,
)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (TypeError, ValueError):
        return a == b


def _plugin_post_init(wrapped, instance, args, kwargs):
    given = getattr(instance, "hf_ds_config", None)
    launch_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launch_file in (None, "", "none"):
        launch_file = None
    if isinstance(given, str) and given != "none" and launch_file and not _same_file(given, launch_file):
        log.warning("accel-npu: the script's DeepSpeedPlugin(hf_ds_config=%r) is replaced by the launch "
                    "config's DeepSpeed file %r (deepspeed_config_file wins over a hard-coded path)",
                    given, launch_file)
        instance.hf_ds_config = launch_file
        given = launch_file
    if isinstance(given, str) and given != "none":
        source = given
    elif given is None and launch_file:
        source = launch_file
    elif isinstance(given, dict):
        source = "<script>"
    else:
        source = "<accelerate defaults>"
    setattr(instance, DS_CONFIG_SOURCE, source)
    result = wrapped(*args, **kwargs)
    try:
        from accel_npu.manager import get_plugin_manager

        get_plugin_manager().hook.accel_npu_configure_deepspeed(ds_config=instance.deepspeed_config, source=source)
    except AttributeError:  # a plugin built without a config (never in accelerate 1.15)
        pass
    return result


PLUGIN_POST_INIT = Patch(
    target="accelerate.utils.dataclasses:DeepSpeedPlugin.__post_init__",
    supports="accelerate>=1.10,<1.16",
    # Also where the accel_npu_configure_deepspeed hook sees every DeepSpeed config.
    reason="A script's hard-coded DeepSpeedPlugin(hf_ds_config='...') silently overrides the launch "
           "config's deepspeed_config_file; the launch-side file wins.",
    remove_when="accelerate prefers the launch config's DeepSpeed file (or warns about the override)",
    wrapper=_plugin_post_init,
)


# -- ZeRO-3 fetch outside inference mode ------------------------------------------------------------
def _fetch_sub_module(wrapped, instance, args, kwargs):
    import torch

    if not torch.is_inference_mode_enabled():
        return wrapped(*args, **kwargs)
    with torch.inference_mode(False):
        return wrapped(*args, **kwargs)


ZERO3_FETCH = Patch(
    target="deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator.fetch_sub_module",
    supports="deepspeed>=0.16,<0.20",
    # ZeRO-3 keeps parameters gathered after a forward without backward.
    reason="ZeRO-3 parameters gathered under inference_mode() break the next training forward "
           "('Inference tensors cannot be saved for backward', runtime/zero/linear.py).",
    remove_when="DeepSpeed gathers ZeRO-3 parameters outside inference mode itself",
    wrapper=_fetch_sub_module,
)


# -- "auto" micro batch size from a batch_sampler ----------------------------------------------------
AUTO_MICRO_BATCH_SIZE = Patch(
    target="accelerate.accelerator:Accelerator.prepare",
    supports="accelerate>=1.10,<1.16",
    # diffusers' bucketing DreamBooth LoRA scripts pass batch_sampler=; an unresolvable "auto" is one
    # error naming the key and the DeepSpeed file.
    reason="A micro batch size of 'auto' is read from DataLoader.batch_size only, so batch_sampler= "
           "fails prepare ('has `None` as batch size'); read from the sampler.",
    remove_when="accelerate reads a DataLoader's batch_sampler.batch_size for the 'auto' micro batch size",
    wrapper=prepare_with_auto_micro_batch_size,
)


# -- inputs of the other half dtype -----------------------------------------------------------------
ENGINE_INPUT_DTYPE = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine.forward",
    supports="deepspeed>=0.16,<0.20",
    # diffusers v0.40.0 examples/cogvideo/train_cogvideox_*lora.py run frozen towers in fp16 under a
    # bf16 config and stop with 'mat1 and mat2 must have the same dtype' (models/embeddings.py).
    reason="DeepSpeed casts inputs only under fp16.auto_cast (runtime/engine.py _cast_inputs_half): "
           "fp16 inputs to a bf16 engine fail; cast to the engine's dtype.",
    remove_when="DeepSpeed casts floating-point inputs to the engine's dtype itself (auto_cast for bf16)",
    wrapper=cast_other_half_inputs,
)

ZERO3_PARAM_DTYPE = Patch(
    target="deepspeed.runtime.engine:DeepSpeedEngine._cast_module_mixed_precision",
    supports="deepspeed>=0.19,<0.20",
    # diffusers' cogvideo/train_cogvideox_lora.py casts .to(float16) under a bf16 config.
    reason="runtime/engine.py skips the dtype cast for a model built under zero.Init, so a cast after "
           "loading trains in the wrong dtype; partitions are cast.",
    remove_when="DeepSpeed casts zero.Init parameters that are not in the configured dtype",
    wrapper=cast_partitioned_params,
)


@hookimpl
def accel_npu_register_patches():
    return [DEEPSPEED_LAUNCHER, CONFIG_CHECKS, SET_MIXED_PRECISION, PLUGIN_POST_INIT, ZERO3_FETCH,
            AUTO_MICRO_BATCH_SIZE, ENGINE_INPUT_DTYPE, ZERO3_PARAM_DTYPE]

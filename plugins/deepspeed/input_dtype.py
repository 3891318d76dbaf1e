"""Inputs of the other half-precision dtype, cast at a DeepSpeed engine's boundary.

DeepSpeed casts the module it wraps to bf16 (or fp16) when its config enables that precision, and
leaves the inputs as the script made them: only ``fp16.auto_cast`` casts floating-point inputs
(``DeepSpeedEngine._cast_inputs_half`` in deepspeed/runtime/engine.py, called from
``_forward_prologue``). A script whose frozen towers run in the *other* half dtype then hands the
engine fp16 activations for bf16 weights and stops at the first matmul: diffusers v0.40.0's
examples/cogvideo/train_cogvideox_lora.py and train_cogvideox_image_to_video_lora.py pick
``weight_dtype = torch.float16`` when the DeepSpeed config says bf16 ("mat1 and mat2 must have the
same dtype, but got Half and BFloat16", diffusers models/embeddings.py). Such an input can only
fail there, so it is cast to the engine's dtype, as auto_cast would, with one warning per script
line.

fp32 inputs are not cast: timesteps and sigmas reach models in fp32 on purpose (diffusers' timestep
embeddings compute in fp32, then cast). But a script written for accelerate's mixed precision may hand
the engine fp32 *activations* (latents normalised by fp32 statistics in diffusers' Flux2 LoRA scripts,
prompt embeddings rebuilt as fp32 in train_controlnet_sdxl.py, Cosmos 2.5's inputs): under DDP
accelerate runs its forward under ``torch.autocast`` (accelerate/accelerator.py ``native_amp``), under
DeepSpeed it does not, and the first matmul fails ("expected m1 and m2 to have the same dtype"), on GPUs
too. A forward given a floating fp32 tensor of two or more dimensions directly as an argument runs under
``torch.autocast`` of the engine's dtype, and its floating outputs come back in fp32, as that script runs under DDP
(accelerate wraps the model's forward in autocast and ``convert_outputs_to_fp32``): diffusers' vqgan/train_vqgan.py
hands the VQModel's reconstruction to an fp32 timm model outside any engine. Engines given no such input run as
before.
"""

from __future__ import annotations

import logging

from accel_npu._torch.activations import fp32_activations
from accel_npu._torch.callsite import user_frame

log = logging.getLogger("accel_npu")

_warned: set = set()


def _engine_dtype(engine):
    import torch

    try:
        if engine.bfloat16_enabled():
            return torch.bfloat16
        if engine.fp16_enabled():
            return torch.float16
    except AttributeError:  # an engine without a DeepSpeed config (never after initialize)
        return None
    return None


def _cast(value, half, other, found: list, name: str):
    import torch

    if isinstance(value, torch.Tensor):
        if value.dtype == other:
            found.append(name)
            return value.to(half)
        return value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        before = len(found)
        items = [_cast(v, half, other, found, f"{name}[{i}]") for i, v in enumerate(value)]
        return value if len(found) == before else type(value)(items)
    if isinstance(value, dict):
        before = len(found)
        items = {k: _cast(v, half, other, found, f"{name}[{k!r}]") for k, v in value.items()}
        return value if len(found) == before else type(value)(items)
    return value


def cast_other_half_inputs(wrapped, instance, args, kwargs):
    """``DeepSpeedEngine.forward`` with inputs of the other half dtype cast to the engine's, and under
    ``torch.autocast`` of the engine's dtype when it is given fp32 activations."""
    import torch

    half = _engine_dtype(instance)
    device_type = getattr(getattr(instance, "device", None), "type", None) or "cpu"
    if half is None or torch.is_autocast_enabled(device_type):  # the script's own autocast decides
        return wrapped(*args, **kwargs)
    other = torch.float16 if half == torch.bfloat16 else torch.bfloat16
    found: list[str] = []
    new_args = tuple(_cast(v, half, other, found, f"argument {i}") for i, v in enumerate(args))
    new_kwargs = {k: _cast(v, half, other, found, k) for k, v in kwargs.items()}
    fp32 = fp32_activations(new_args, new_kwargs)
    if not found and not fp32:
        return wrapped(*args, **kwargs)
    site = user_frame()
    if found and site not in _warned:
        _warned.add(site)
        where = f"{site[0]}:{site[1]}" if site else "the script"
        names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
        log.warning(
            "accel-npu: %s passes %s %s to a DeepSpeed engine whose weights are %s (the DeepSpeed "
            "config enables %s): cast to %s at the engine's boundary, as DeepSpeed's fp16 auto_cast "
            "casts inputs. Models the script runs in %s outside the engine stay as they are.",
            where,
            names[other],
            ", ".join(found),
            names[half],
            "bf16" if half == torch.bfloat16 else "fp16",
            names[half],
            names[other],
        )
    if fp32:
        from accelerate.utils import convert_to_fp32

        _warn_autocast(fp32, half)
        with torch.autocast(device_type, dtype=half):
            return convert_to_fp32(wrapped(*new_args, **new_kwargs))
    return wrapped(*new_args, **new_kwargs)


def _warn_autocast(names: list[str], half) -> None:
    import torch

    site = user_frame()
    if ("autocast", site) in _warned:
        return
    _warned.add(("autocast", site))
    where = f"{site[0]}:{site[1]}" if site else "the script"
    log.warning(
        "accel-npu: %s passes float32 %s to a DeepSpeed engine whose weights are %s: its forward runs under "
        "torch.autocast(%s) and returns float32, as accelerate runs it under DDP with mixed precision (DeepSpeed "
        "casts no float32 input).",
        where,
        ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""),
        "bfloat16" if half == torch.bfloat16 else "float16",
        "bfloat16" if half == torch.bfloat16 else "float16",
    )


_warned_cast: set = set()


def cast_what_deepspeed_skips(wrapped, instance, args, kwargs):
    """``DeepSpeedEngine._cast_module_mixed_precision`` that also casts what DeepSpeed before 0.19.2 cast with
    ``module.bfloat16()`` / ``half()`` and 0.19.2 skips: spectral norm's power-iteration vectors, and a ZeRO-3
    model built in partitions (zero.Init) whose parameters are not in the configured dtype."""
    result = wrapped(*args, **kwargs)
    names = ("param_dtype", "buffer_dtype", "is_zero_init_model")
    bound = dict(zip(names, args), **kwargs)
    param_dtype = bound.get("param_dtype")
    if param_dtype is None:
        return result
    _cast_spectral_norm_vectors(instance.module, param_dtype)
    if bound.get("is_zero_init_model"):
        _cast_partitioned_params(instance, param_dtype)
    return result


def _cast_spectral_norm_vectors(module, dtype) -> None:
    """Spectral norm's ``u`` / ``v`` buffers in the dtype of the weight they multiply.

    ``torch.nn.utils.spectral_norm`` computes ``torch.mv(weight_mat.t(), u, out=v)`` before each forward
    (torch/nn/utils/spectral_norm.py), the parametrization form ``torch.mv(weight_mat, _v)``: DeepSpeed 0.19.2 casts
    the weight to bf16 and keeps the buffers fp32 ("preserve fp32 buffers (e.g. rotary inv_freq)", runtime/engine.py
    _configure_distributed_model), and the first forward stops ("addmv input tensors must have the same dtype"),
    on GPUs too: diffusers v0.40.0's vqgan/discriminator.py spectral-norms every convolution. Under DDP with mixed
    precision the weight stays fp32 beside them; under DeepSpeed both take the weight's dtype, as before 0.19.2."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    for sub in module.modules():
        names = []
        for hook in sub._forward_pre_hooks.values():
            if isinstance(hook, SpectralNorm):
                names += [hook.name + "_u", hook.name + "_v"]
        if type(sub).__name__ == "_SpectralNorm":  # torch.nn.utils.parametrizations.spectral_norm
            names += ["_u", "_v"]
        for name in names:
            buffer = sub._buffers.get(name)
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                sub._buffers[name] = buffer.to(dtype)


def _cast_partitioned_params(instance, param_dtype) -> None:
    """A ZeRO-3 model built in partitions (zero.Init) whose parameters are not in the configured dtype, cast.

    DeepSpeed skips the parameter cast for such a model ("ZeRO-Init params are already at the configured
    dtype", deepspeed/runtime/engine.py). That holds for a model built under its own zero.Init, not for
    one a script cast afterwards: diffusers' CogVideoX LoRA scripts call ``transformer.to(torch.float16)``
    under a bf16 config, and a transformer loaded into partitions (zero3_init_flag) then trained in fp16,
    where stock (loaded whole, cast at initialize) trains in bf16.
    """
    import torch

    castable = (torch.float16, torch.bfloat16, torch.float32)
    cast = []
    for name, p in instance.module.named_parameters():
        if p.dtype == param_dtype or p.dtype not in castable:
            continue
        ds_tensor = getattr(p, "ds_tensor", None)
        if ds_tensor is not None:
            ds_tensor.data = ds_tensor.data.to(param_dtype)
        p.data = p.data.to(param_dtype)
        cast.append(name)
    if cast and id(instance) not in _warned_cast:
        _warned_cast.add(id(instance))
        log.warning(
            "accel-npu: %d parameter(s) of the ZeRO-3 model given to DeepSpeed (e.g. %s) were not in the "
            "configured %s (cast after loading, e.g. .to(float16)); cast to %s as DeepSpeed casts a model "
            "it partitions itself",
            len(cast),
            cast[0],
            str(param_dtype).removeprefix("torch."),
            str(param_dtype).removeprefix("torch."),
        )

"""Frozen bf16/fp16 models given float32 activations run under ``torch.autocast`` of their dtype.

diffusers' examples freeze the models they do not train and cast them to the mixed-precision dtype
(``unet.requires_grad_(False); unet.to(device, dtype=weight_dtype)``), then call them outside any
wrapper: accelerate runs only the models it prepared under ``torch.autocast`` (accelerate/accelerator.py
``native_amp``), DeepSpeed none. A script that hands such a model fp32 activations stops at its first
matmul ("expected m1 and m2 to have the same dtype"), on GPUs too: v0.40.0's
controlnet/train_controlnet_sdxl.py rebuilds the precomputed prompt embeddings as fp32 in its
collate_fn (``torch.tensor`` of the dataset's lists) and passes them to the frozen bf16 UNet
(t2i_adapter/train_t2i_adapter_sdxl.py does the same to a UNet it never freezes: not covered). A frozen model whose floating parameters are all one half dtype cannot compute on
such an input at all; its forward runs under ``torch.autocast`` of that dtype instead, as a prepared model
runs under DDP with mixed precision, with one warning per model class naming the script's line.

Which calls: the same rule as the DeepSpeed engine's autocast (``accel_npu._torch.activations``). Which
models: diffusers' ModelMixin / transformers' PreTrainedModel cast ``.to(<half dtype>)`` while no
parameter requires grad get a forward pre-hook and an always-called forward hook (the pair enters and
leaves the autocast context). A call given fp32 activations checks again that the model is still frozen
and all half; one found trained (an adapter added after the cast, as diffusers' LoRA scripts add it)
loses the hooks until it is cast while frozen again. Models never cast that way carry no hook; trained
and fp32 models run as before.
"""
from __future__ import annotations

import logging
import threading
import weakref

from accel_npu._torch.activations import fp32_activations
from accel_npu._torch.callsite import user_frame
from accel_npu._torch.once import FirstTime

log = logging.getLogger("accel_npu")

_first = FirstTime()
#: models carrying the hooks: {model: (pre-hook handle, forward-hook handle)}
_hooked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: per thread, the autocast contexts entered by the pre-hook: [(model, context)]
_entered = threading.local()


def _half_dtype_requested(args, kwargs):
    import torch

    halves = (torch.bfloat16, torch.float16)
    dtype = kwargs.get("dtype")
    if dtype in halves:
        return True
    return any(isinstance(a, torch.dtype) and a in halves for a in args)


def _frozen(model) -> bool:
    return not any(p.requires_grad for p in model.parameters())


def cast_to(wrapped, instance, args, kwargs):
    """``ModelMixin.to`` / ``PreTrainedModel.to``: a frozen model cast to bf16/fp16 gets the autocast hooks."""
    result = wrapped(*args, **kwargs)
    if instance is not None and instance not in _hooked and _half_dtype_requested(args, kwargs) and _frozen(instance):
        _hooked[instance] = (
            instance.register_forward_pre_hook(_before_forward, with_kwargs=True),
            instance.register_forward_hook(_after_forward, always_call=True),
        )
    return result


TRAINED = "trained"


def frozen_half_dtype(model):
    """(dtype, device type) of a model no parameter of which requires grad and whose floating parameters
    are all bf16 or all fp16; ``TRAINED`` when a parameter requires grad; None for any other model.

    Walks ``_parameters`` / ``_modules`` itself: ``Module.parameters()`` builds every submodule's dotted
    name, about twice the cost, and this runs on each call given fp32 activations (adapters added after
    the cast, as diffusers' LoRA scripts add them, must be seen)."""
    import torch

    dtype = device = None
    stack = [model]
    while stack:
        module = stack.pop()
        for p in module._parameters.values():
            if p is None:
                continue
            if p.requires_grad:
                return TRAINED
            if dtype is None:
                if p.is_floating_point():
                    dtype, device = p.dtype, p.device
            elif p.dtype != dtype and p.is_floating_point():
                return None
        stack.extend(m for m in module._modules.values() if m is not None)
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return dtype, device.type


def _unhook(model) -> None:
    for handle in _hooked.pop(model, ()):
        handle.remove()


def _before_forward(model, args, kwargs):
    stack = _entered.__dict__.setdefault("stack", [])
    stack.append((model, None))  # one entry per call, popped by _after_forward: re-entrant calls pair up
    names = fp32_activations(args, kwargs)
    if not names:
        return None
    import torch

    found = frozen_half_dtype(model)
    if found is TRAINED:  # trained since its cast (an adapter added, a layer unfrozen): as stock from now on
        stack.pop()  # its post-hook is removed with the pre-hook: this call's entry goes now
        _unhook(model)
        return None
    if found is None:
        return None
    dtype, device_type = found
    if not torch.amp.is_autocast_available(device_type) or torch.is_autocast_enabled(device_type):
        return None  # the script's own autocast decides
    if _first(type(model)):
        site = user_frame()
        where = f"{site[0]}:{site[1]}" if site else "the script"
        half = str(dtype).removeprefix("torch.")
        log.warning("accel-npu: %s passes float32 %s to the frozen %s %s (no parameter requires grad, "
                    "outside any engine or autocast): its forward runs under torch.autocast(%s), as accelerate "
                    "runs a prepared model with mixed precision; stock stops at the first matmul that meets them.", where,
                    ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""), half, type(model).__name__, half)
    context = torch.autocast(device_type, dtype=dtype)
    context.__enter__()
    stack[-1] = (model, context)
    return None


def _after_forward(model, args, output):
    stack = getattr(_entered, "stack", None) or []
    for i in range(len(stack) - 1, -1, -1):  # this model's innermost open call
        if stack[i][0] is model:
            context = stack.pop(i)[1]
            if context is not None:
                context.__exit__(None, None, None)
            break
    return None

"""Frozen bf16/fp16 models given float32 activations run under ``torch.autocast`` of their dtype.

diffusers' examples freeze the models they do not train and cast them to the mixed-precision dtype
(``unet.requires_grad_(False); unet.to(device, dtype=weight_dtype)``), then call them outside any
wrapper: accelerate runs only the models it prepared under ``torch.autocast`` (accelerate/accelerator.py
``native_amp``), DeepSpeed none. A script that hands such a model fp32 activations stops at its first
matmul ("expected m1 and m2 to have the same dtype"), on GPUs too: v0.40.0's
controlnet/train_controlnet_sdxl.py rebuilds the precomputed prompt embeddings as fp32 in its
collate_fn (``torch.tensor`` of the dataset's lists) and passes them to the frozen bf16 UNet. A model whose
floating parameters are all one half dtype cannot compute on such an input at all; its forward runs under
``torch.autocast`` of that dtype instead, as a prepared model runs under DDP with mixed precision, with one
warning per model class naming the script's line.

"Frozen" for this purpose also covers a half model whose parameters require grad but that no optimizer
``accelerator.prepare`` returned (nor any DeepSpeed engine) holds: its gradients are never applied.
v0.40.0's t2i_adapter/train_t2i_adapter_sdxl.py never freezes its UNet (lines 926-930 freeze the VAE and
text encoders, then ``unet.train()``), casts it to bf16 (line 1011), gives only the adapter to the optimizer
and to prepare, and hands the UNet the same fp32 prompt embeddings. That is decided at the call: before any
prepare nothing is known and the call runs as stock; a model some prepared optimizer or engine holds a
parameter of (a layer unfrozen and trained, a LoRA adapter added after the cast, as diffusers' LoRA scripts
add it) runs as stock and loses the hooks.

Which calls: the same rule as the DeepSpeed engine's autocast (``accel_npu._torch.activations``). Which
models: diffusers' ModelMixin / transformers' PreTrainedModel cast ``.to(<half dtype>)`` get a forward
pre-hook and an always-called forward hook (the pair enters and leaves the autocast context); a call given
fp32 activations checks the model again (all half; frozen, or held by no prepared optimizer). Which
optimizers: accelerate's ``AcceleratedOptimizer`` instances, noted as they are built (DeepSpeed's wrapper
included); a DeepSpeed optimizer's groups hold flat partitions, so its engine's module (noted by the
frozen_towers plugin, ``accel_npu._torch.zero.live_engines``) says which parameters it trains, and one whose
engine is not known counts as holding every parameter. Models never cast that way carry no hook; fp32
models run as before.
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
_hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: per thread, the autocast contexts entered by the pre-hook: [(model, context)]
_entered = threading.local()
#: the optimizers accelerator.prepare returned, alive (accelerate's AcceleratedOptimizer and subclasses)
_prepared: weakref.WeakSet = weakref.WeakSet()


def _half_dtype_requested(args, kwargs):
    import torch

    halves = (torch.bfloat16, torch.float16)
    dtype = kwargs.get("dtype")
    if dtype in halves:
        return True
    return any(isinstance(a, torch.dtype) and a in halves for a in args)


def cast_to(wrapped, instance, args, kwargs):
    """``ModelMixin.to`` / ``PreTrainedModel.to``: a model cast to bf16/fp16 gets the autocast hooks (whether
    they act is decided at each call given fp32 activations)."""
    result = wrapped(*args, **kwargs)
    if instance is not None and instance not in _hooked and _half_dtype_requested(args, kwargs):
        _hooked[instance] = (
            instance.register_forward_pre_hook(_before_forward, with_kwargs=True),
            instance.register_forward_hook(_after_forward, always_call=True),
        )
    return result


def note_prepared_optimizer(wrapped, instance, args, kwargs):
    """``AcceleratedOptimizer.__init__``: every optimizer ``accelerator.prepare`` returns is built here
    (accelerate/optimizer.py; DeepSpeedOptimizerWrapper in accelerate/utils/deepspeed.py calls it too)."""
    result = wrapped(*args, **kwargs)
    _prepared.add(instance)
    return result


def half_dtype(model):
    """(dtype, device type, any parameter requires grad) of a model whose floating parameters are all bf16
    or all fp16; None for any other model.

    Walks ``_parameters`` / ``_modules`` itself: ``Module.parameters()`` builds every submodule's dotted
    name, about twice the cost, and this runs on each call given fp32 activations (adapters added after
    the cast, as diffusers' LoRA scripts add them, must be seen)."""
    import torch

    dtype = device = None
    trainable = False
    stack = [model]
    while stack:
        module = stack.pop()
        for p in module._parameters.values():
            if p is None:
                continue
            trainable = trainable or p.requires_grad
            if dtype is None:
                if p.is_floating_point():
                    dtype, device = p.dtype, p.device
            elif p.dtype != dtype and p.is_floating_point():
                return None
        stack.extend(m for m in module._modules.values() if m is not None)
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    return dtype, device.type, trainable


def held_parameter_ids():
    """ids of the parameters the live prepared optimizers and DeepSpeed engines hold; None when none is
    alive (before any prepare) or when one is a DeepSpeed optimizer whose engine is not known."""
    from accel_npu._torch.zero import live_engines

    optimizers, engines = list(_prepared), live_engines()
    if not optimizers and not engines:
        return None
    held: set[int] = set()
    for engine in engines:  # an engine trains its module's parameters (DeepSpeed builds its optimizer from them)
        held.update(id(p) for p in engine.module.parameters())
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)
        # DeepSpeed's ZeRO / bf16 / fp16 optimizers replace param_groups' parameters by flat fp32 partitions
        # (deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__): its engine says which
        if type(inner).__module__.split(".", 1)[0] == "deepspeed" and not any(
            getattr(e, "optimizer", None) is inner for e in engines
        ):
            return None
        held.update(id(p) for group in getattr(inner, "param_groups", ()) for p in group["params"])
    return held


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

    found = half_dtype(model)
    if found is None:
        return None
    dtype, device_type, trainable = found
    if trainable:
        held = held_parameter_ids()
        if held is None:  # before any prepare (or a DeepSpeed optimizer we cannot read): as stock
            return None
        if any(id(p) in held for p in model.parameters()):
            # trained (a layer unfrozen, an adapter added after the cast): as stock from now on
            stack.pop()  # its post-hook is removed with the pre-hook: this call's entry goes now
            _unhook(model)
            return None
    if not torch.amp.is_autocast_available(device_type) or torch.is_autocast_enabled(device_type):
        return None  # the script's own autocast decides
    if _first(type(model)):
        site = user_frame()
        where = f"{site[0]}:{site[1]}" if site else "the script"
        half = str(dtype).removeprefix("torch.")
        what = (
            f"{half} {type(model).__name__}, whose parameters no prepared optimizer holds (its gradients are "
            f"never applied)"
            if trainable
            else f"frozen {half} {type(model).__name__} (no parameter requires grad)"
        )
        log.warning(
            "accel-npu: %s passes float32 %s to the %s, outside any engine or autocast: its forward runs "
            "under torch.autocast(%s), as accelerate runs a prepared model with mixed precision; stock stops "
            "at the first matmul that meets them.",
            where,
            ", ".join(names[:3]) + (" ..." if len(names) > 3 else ""),
            what,
            half,
        )
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

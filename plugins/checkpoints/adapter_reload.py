"""A load hook that loads the checkpoint's LoRA again into a model a DeepSpeed engine holds.

Under DeepSpeed accelerate's ``load_state`` first has each engine restore itself (its module's trainable
parameters and the optimizer's master copies: accelerate/accelerator.py ``load_state``), then runs the
script's load hooks, which written for DDP load the LoRA file the save hook wrote from that same state:

- ``PeftModel.load_adapter(input_dir, "default")`` (diffusers' consistency_distillation
  ``train_lcm_distill_lora_*_wds.py``) copies the values into the adapter in place, then peft's
  ``cast_adapter_dtype`` (peft/tuners/tuners_utils.py) swaps every bf16/fp16 adapter parameter for a new
  fp32 one. The engine's optimizer holds the old ones: ZeRO-2 indexes an empty gradient bucket, ZeRO-3 finds
  a parameter it never partitioned (no ``ds_status``).
- ``load_lora_into_unet(state_dict, unet=unet)`` with no ``adapter_name`` (diffusers'
  ``train_dreambooth_lora_sd15_advanced.py``; diffusers #6514 removed the same call from
  ``train_dreambooth_lora_sdxl.py``) injects a second adapter, ``default_0``, that the optimizer does not hold
  and ZeRO-3 never partitioned.

While accelerate's ``load_state`` runs the load hooks under DeepSpeed (``state.load_hooks_see_models``), a
load into a model an engine holds, of keys matching an adapter the model already has, copies the values into
that adapter's existing parameters in place (ZeRO-3: gathered and re-partitioned, ``state._zero3_loadable``)
and does nothing else: no dtype cast, no new parameter, no new adapter. Anything else (another adapter
name, keys the adapter lacks, hotswap) goes to the library unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re

from accel_npu._torch.once import FirstTime
from accel_npu.patching import argument, with_argument

log = logging.getLogger("accel_npu")
_logged = FirstTime()

#: the models DeepSpeed engines hold, while accelerate's load_state runs the load hooks under DeepSpeed
_RESUMING: contextvars.ContextVar[tuple] = contextvars.ContextVar("accel_npu_resuming_models", default=())


@contextlib.contextmanager
def resuming(models):
    """Marks ``models`` (each engine's module) as restored by DeepSpeed for the duration of a load hook."""
    token = _RESUMING.set(tuple(models))
    try:
        yield
    finally:
        _RESUMING.reset(token)


def held_by_engine(module) -> bool:
    """``module`` is, or is inside, a model an engine restored in the running load_state."""
    models = _RESUMING.get()
    return bool(models) and any(module is m or any(module is s for s in m.modules()) for m in models)


def _say_once(where: str, adapter: str) -> None:
    if _logged((where, adapter)):
        log.info(
            "accel-npu: %s during load_state under DeepSpeed: the checkpoint's LoRA is loaded into the "
            "existing adapter %r in place (DeepSpeed restored it and the optimizer holds its parameters), "
            "not cast or added again",
            where,
            adapter,
        )


# --------------------------------------------------------------------------------------------
# peft: PeftModel.load_adapter
def peft_load_adapter(wrapped, instance, args, kwargs):
    """``PeftModel.load_adapter(model_id, adapter_name, is_trainable, torch_device, autocast_adapter_dtype,
    ephemeral_gpu_offload, low_cpu_mem_usage, ...)`` of an adapter the model has: peft loads it in place
    (``set_peft_model_state_dict``: ``load_state_dict``) unless ``low_cpu_mem_usage`` (``assign=True``, new
    tensors) and then casts it to fp32 (new parameters); both off, the engine's parameters stay its own."""
    adapter_name = argument(args, kwargs, 1, "adapter_name")
    if adapter_name not in (getattr(instance, "peft_config", None) or {}) or not held_by_engine(instance):
        return wrapped(*args, **kwargs)
    args, kwargs = with_argument(args, kwargs, 4, "autocast_adapter_dtype", False)
    args, kwargs = with_argument(args, kwargs, 6, "low_cpu_mem_usage", False)
    _say_once("PeftModel.load_adapter", adapter_name)
    return wrapped(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# diffusers: PeftAdapterMixin.load_lora_adapter (load_lora_into_unet / _transformer / load_lora_weights)
_PARAMETER_PREFIX = "lora_"  # peft's LoRA parameter prefix (peft/utils/constants.py PEFT_TYPE_TO_PREFIX_MAPPING)


def _with_adapter_name(key: str, adapter: str) -> str:
    """The parameter name peft's ``set_peft_model_state_dict`` loads ``key`` into (it inserts the adapter
    name after the ``lora_*`` module: ``x.lora_A.weight`` -> ``x.lora_A.default.weight``)."""
    head, _, suffix = key.partition(_PARAMETER_PREFIX)
    if "." in suffix:
        module, _, rest = suffix.partition(".")
        return f"{head}{_PARAMETER_PREFIX}{module}.{adapter}.{rest}"
    return f"{key}.{adapter}"


def _adapter_parameters(model, adapter: str) -> dict[str, tuple]:
    """{parameter name: full shape} of ``adapter``'s LoRA parameters (ZeRO-3: ``ds_shape``)."""
    pattern = re.compile(rf"\.{_PARAMETER_PREFIX}[^.]+\.{re.escape(adapter)}(\.|$)")
    return {
        name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters() if pattern.search(name)
    }


def _matching_adapter(model, state_dict: dict, candidates) -> str | None:
    """The one adapter among ``candidates`` whose LoRA parameters are exactly ``state_dict``'s keys, with its
    shapes."""
    found = []
    for adapter in candidates:
        have = _adapter_parameters(model, adapter)
        want = {_with_adapter_name(k, adapter): tuple(v.shape) for k, v in state_dict.items()}
        if have and have == want:
            found.append(adapter)
    return found[0] if len(found) == 1 else None


def _peft_keys(state_dict: dict) -> dict | None:
    """``state_dict`` as diffusers' ``load_lora_adapter`` hands it to peft, for a plain LoRA (None for LoKr or
    SAI control LoRA, which it converts otherwise)."""
    if not state_dict or any(".lokr_" in k for k in state_dict) or "lora_controlnet" in state_dict:
        return None
    if "lora_A" not in next(iter(state_dict)):  # diffusers/loaders/peft.py load_lora_adapter: the first key decides
        from diffusers.utils import convert_unet_state_dict_to_peft

        state_dict = convert_unet_state_dict_to_peft(state_dict)
    return state_dict


def diffusers_load_lora_adapter(wrapped, instance, args, kwargs):
    """``load_lora_adapter(state_dict, prefix, hotswap, adapter_name=None, ...)`` whose keys are an adapter
    the engine-held model has: loaded into it in place with peft's ``set_peft_model_state_dict`` (what the
    scripts' own hooks call first), instead of injecting a new adapter. The pipelines' ``load_lora_into_*``
    and ``load_lora_weights`` always pass a state dict (read with ``lora_state_dict``)."""
    source = argument(args, kwargs, 0, "pretrained_model_name_or_path_or_dict")
    prefix = argument(args, kwargs, 1, "prefix", "transformer")
    hotswap = argument(args, kwargs, 2, "hotswap", False)
    requested = kwargs.get("adapter_name")
    adapters = list(getattr(instance, "peft_config", None) or {})
    if (
        hotswap
        or not isinstance(source, dict)
        or not adapters
        or kwargs.get("low_cpu_mem_usage")
        or (requested is not None and requested not in adapters)
        or not held_by_engine(instance)
    ):
        return wrapped(*args, **kwargs)
    state_dict = source
    if prefix is not None:
        state_dict = {k.removeprefix(f"{prefix}."): v for k, v in source.items() if k.startswith(f"{prefix}.")}
    state_dict = _peft_keys(state_dict)
    adapter = (
        None
        if state_dict is None
        else _matching_adapter(instance, state_dict, [requested] if requested is not None else adapters)
    )
    if adapter is None:
        return wrapped(*args, **kwargs)
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(instance, state_dict, adapter_name=adapter)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:  # cannot happen when every key matched a parameter; diffusers would only warn
        log.warning("accel-npu: loading the LoRA into adapter %r left keys unused: %s", adapter, unexpected)
    _say_once(f"{type(instance).__name__}.load_lora_adapter", adapter)
    return None

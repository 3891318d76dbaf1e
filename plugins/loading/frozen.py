"""Loads kept outside ``zero.Init``: frozen towers, and every load when ``zero3_init_flag`` is off.

Inside ``DeepSpeedPlugin.zero3_init_context_manager(enable=False)`` and
``DiffusionPipeline.from_pretrained``, transformers' ``HfDeepSpeedConfig`` weakref is cleared, so
those models are built whole (accelerate #3170).

accelerate sets that weakref for every ZeRO-3 config, whatever ``zero3_init_flag`` says
(``DeepSpeedPlugin.set_deepspeed_weakref``), and transformers builds under ``zero.Init`` whenever it
is set. The weakref's config object is marked here with the flag accelerate had when it set it;
with the flag off, ``from_pretrained`` / ``from_config`` build whole, as the user's config asks.
"""

from __future__ import annotations

import contextlib
import sys

from accel_npu._torch.zero import engine_built, in_frozen_load, outside_zero_init, zero3_weakref_set
from accel_npu.patching import argument

#: attribute set on transformers' HfDeepSpeedConfig object: accelerate's zero3_init_flag when it made it
ZERO3_INIT_FLAG = "_accel_npu_zero3_init_flag"


def pipeline_from_pretrained(wrapped, cls, args, kwargs):
    """Pipeline components are inference towers: load them outside zero.Init, keeping their dtype."""
    if not zero3_weakref_set():
        return wrapped(*args, **kwargs)
    with outside_zero_init():
        return wrapped(*args, **kwargs)


def zero3_init_context_manager(wrapped, instance, args, kwargs):
    """``zero3_init_context_manager(enable=False)`` really disables zero.Init (accelerate #3170)."""
    enable = argument(args, kwargs, 0, "enable", False)
    inner = wrapped(*args, **kwargs)
    if enable:
        return inner

    @contextlib.contextmanager
    def _disabled():
        with inner:
            with outside_zero_init():
                yield

    return _disabled()


def set_deepspeed_weakref(wrapped, instance, args, kwargs):
    """Record ``zero3_init_flag`` on the HfDeepSpeedConfig accelerate hands to transformers."""
    result = wrapped(*args, **kwargs)
    dschf = getattr(instance, "dschf", None)
    if dschf is not None:
        try:
            object.__setattr__(dschf, ZERO3_INIT_FLAG, bool(getattr(instance, "zero3_init_flag", True)))
        except Exception:  # noqa: BLE001 - an object that takes no attributes: transformers decides, as stock
            pass
    return result


def zero3_init_flag_off() -> bool:
    """transformers' weakref is set (ZeRO-3) by an accelerate DeepSpeedPlugin whose ``zero3_init_flag``
    is false: models must be built whole."""
    ds = sys.modules.get("transformers.integrations.deepspeed")
    ref = getattr(ds, "_hf_deepspeed_config_weak_ref", None) if ds is not None else None
    config = ref() if ref is not None else None
    return config is not None and getattr(config, ZERO3_INIT_FLAG, True) is False


def whole_unless_partitioning():
    """A context that builds models whole when ``zero3_init_flag`` is off, or once a DeepSpeed engine
    exists, else does nothing. A model loaded after ``prepare`` can only be used outside the engine,
    where a partitioned one is rebuilt whole anyway; and scripts load it on rank 0 alone (diffusers'
    DreamBooth LoRA scripts' final pipeline: ``AutoencoderKL.from_pretrained`` inside
    ``if accelerator.is_main_process:``), where a partitioned load's collectives wait for ranks that
    never come (train_dreambooth_lora_sdxl.py hung there under ZeRO-3). Stock diffusers loads whole."""
    if not in_frozen_load() and (zero3_init_flag_off() or engine_built()):
        return outside_zero_init()
    return contextlib.nullcontext()


def from_config(wrapped, cls, args, kwargs):
    """``PreTrainedModel._from_config`` (``AutoModel.from_config``) honours ``zero3_init_flag: false``."""
    with whole_unless_partitioning():
        return wrapped(*args, **kwargs)

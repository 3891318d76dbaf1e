"""DeepSpeed ZeRO-3 and module plumbing shared by loading, frozen towers and checkpoints."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any


def param_slots(model) -> dict[int, list[tuple[Any, str, str]]]:
    """{id(parameter): [(owning module, attribute, dotted name), ...]} (tied parameters share an id)."""
    slots: dict[int, list[tuple[Any, str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, pname, f"{mod_name}.{pname}" if mod_name else pname))
    return slots


def is_zero_partitioned(module) -> bool:
    """Some parameter of ``module`` is a ZeRO-3 partition (DeepSpeed marks them with ds_id)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def whole_shape(value) -> tuple:
    """The whole shape of a tensor or of a ZeRO-3 partitioned parameter (ds_shape)."""
    return tuple(value.ds_shape) if hasattr(value, "ds_shape") else tuple(value.shape)


_frozen = contextvars.ContextVar("accel_npu_frozen_load", default=False)


@contextlib.contextmanager
def outside_zero_init() -> Iterator[None]:
    """Clear transformers' HfDeepSpeedConfig weakref for the duration (accelerate #3170): models
    built inside are built whole, not under zero.Init (a frozen tower's load)."""
    token = _frozen.set(True)
    ds = None
    saved = None
    try:
        ds = sys.modules.get("transformers.integrations.deepspeed")
        if ds is not None and hasattr(ds, "_hf_deepspeed_config_weak_ref"):
            saved = ds._hf_deepspeed_config_weak_ref
            ds._hf_deepspeed_config_weak_ref = None
        yield
    finally:
        if ds is not None and saved is not None:
            ds._hf_deepspeed_config_weak_ref = saved
        _frozen.reset(token)


_engines: weakref.WeakSet = weakref.WeakSet()


def note_engine_built(engine) -> None:
    """``engine`` (a DeepSpeed engine ``accelerator.prepare`` returned) now holds the trained model."""
    _engines.add(engine)


def live_engines() -> list:
    """The DeepSpeed engines ``accelerator.prepare`` returned that are still alive."""
    return list(_engines)


def engine_built() -> bool:
    """A DeepSpeed engine is alive: a model loaded now can only be used outside it (a frozen tower,
    the final pipeline a script builds on rank 0 alone)."""
    return len(_engines) > 0


def in_frozen_load() -> bool:
    """Inside :func:`outside_zero_init` (a frozen tower's load)."""
    return _frozen.get()


def zero3_weakref_set() -> bool:
    """transformers' HfDeepSpeedConfig weakref is alive: ZeRO-3 model construction is on."""
    ds = sys.modules.get("transformers.integrations.deepspeed")
    ref = getattr(ds, "_hf_deepspeed_config_weak_ref", None) if ds is not None else None
    return ref is not None and ref() is not None


def on_first_forward(model, callback: Callable[[Any], None]) -> None:
    """Call ``callback(submodule)`` once, before the first forward of any of ``model``'s submodules.

    Any submodule counts (``vae.decode()`` never calls ``vae.forward()``), including those without
    parameters of their own: CLIP's text embeddings read ``position_embedding.weight.shape`` before
    calling it (SD3/Flux's CLIP text encoders would see ``max_position_embeddings: 0``). The hooks are
    removed at that first call.
    """
    handles = []

    def first_call(module, args):
        for h in handles:
            h.remove()
        handles.clear()
        callback(module)
        return None

    for sub in model.modules():
        handles.append(sub.register_forward_pre_hook(first_call))

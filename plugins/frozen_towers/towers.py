"""Frozen towers kept out of the DeepSpeed engine.

A "tower" is a child module whose parameters are all frozen (a VAE, a text encoder) held as an
attribute of the model given to ``accelerator.prepare``. DeepSpeed would cast it to bf16
(``engine._cast_module_mixed_precision``), ZeRO-3 would partition and hook it, although nobody
trains it. Here it is popped from its parent's ``_modules`` before ``deepspeed.initialize`` and
kept as a plain instance attribute for the engine's whole life (re-registering it later breaks
ZeRO-3 ``step()`` and ZeRO-2 ``save_checkpoint``):

- ``model.vae`` still works (instance ``__dict__``), ``model.eval()/.train()`` reach it (the parent's
  class is swapped for a cached subclass whose ``train`` also visits hidden towers),
- ``model.vae = other`` keeps ``other`` hidden too (the subclass's ``__setattr__``),
- a tower that transformers built under ``zero.Init`` (partitioned, bf16) is re-materialized
  whole from the files it was loaded from, in the checkpoint's dtype, bit-identical to them
  (rematerialize.py).

Nothing here imports torch at module level: the plugin imports it lazily.
"""

from __future__ import annotations

import logging
from typing import Any

from accel_npu import environment
from accel_npu._torch import zero
from accel_npu._torch.markers import HIDDEN_TOWERS as HIDDEN
from accel_npu._torch.markers import hidden_towers, tower_state_dict
from accel_npu._torch.zero import is_zero_partitioned
from accel_npu.errors import AccelNpuError, ConfigError
from accel_npu.plugins.frozen_towers.rematerialize import rematerialize

log = logging.getLogger("accel_npu")

__all__ = [
    "select_towers",
    "hide",
    "restore",
    "hidden_towers",
    "tower_state_dict",
    "requested_names",
    "prepare_deepspeed",
]
_GUARDED_CLASSES: dict[type, type] = {}


# --------------------------------------------------------------------------------------------
# selection
def _is_model_like(module) -> bool:
    """A module that is a model of its own (diffusers/transformers), not a plain container."""
    return hasattr(module, "config") and not isinstance(module.config, (int, float, str))


def _all_frozen(module) -> bool:
    seen = False
    for p in module.parameters():
        seen = True
        if p.requires_grad:
            return False
    return seen


def _any_trainable(module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def requested_names() -> list[str] | None:
    """Names from ACCEL_NPU_FROZEN_MODULES: None = auto-detect, [] = feature off ("none")."""
    raw = environment.get("ACCEL_NPU_FROZEN_MODULES").strip()
    if not raw:
        return None
    if raw.lower() == "none" or environment.falsy(raw):
        return []
    return [n.strip() for n in raw.split(",") if n.strip()]


def env_report() -> dict[str, str]:
    """The frozen towers section of ``accel-npu env``: ACCEL_NPU_FROZEN_MODULES and what it selects."""
    names = requested_names()
    return {
        "ACCEL_NPU_FROZEN_MODULES": environment.get("ACCEL_NPU_FROZEN_MODULES") or "(auto-detect)",
        "mode": "off" if names == [] else ("auto-detect" if names is None else ", ".join(names)),
    }


def select_towers(model, names: list[str] | None = None) -> list[str]:
    """Dotted names of the children to keep out of the engine.

    ``names`` (or ACCEL_NPU_FROZEN_MODULES) overrides detection; each must exist and be frozen.
    Auto-detection: children of the model (and of plain container children, which have no
    ``config``) that are, or wrap, models of their own (a ``config``: diffusers/transformers
    models, i.e. what ``from_pretrained`` returns) and whose parameters are all frozen. Plain
    frozen layers (an embedding used inside the trained path) stay in the engine: their output
    feeds bf16 layers, so they must be cast like them; name them in the variable to hide them.
    Nothing is selected when that would leave the engine without a trainable parameter.
    """
    if names is None:
        names = requested_names()
    if names is not None:
        chosen = []
        for name in names:
            try:
                sub = model.get_submodule(name)
            except AttributeError:
                children = ", ".join(n for n, _ in model.named_children())
                raise ConfigError(
                    f"ACCEL_NPU_FROZEN_MODULES names {name!r}, but {type(model).__name__} has no such "
                    f"submodule (its children: {children}). Fix the name or unset the variable."
                ) from None
            if sub is model or not name:
                raise ConfigError("ACCEL_NPU_FROZEN_MODULES cannot name the model itself")
            if _any_trainable(sub):
                raise ConfigError(
                    f"ACCEL_NPU_FROZEN_MODULES names {name!r}, but it has trainable parameters; call "
                    f"{name}.requires_grad_(False) first or remove it from the variable."
                )
            chosen.append(name)
    else:
        chosen = []
        # A submodule holding the config of the model it sits in is a part of that model (transformers'
        # CLIPTextModel.encoder is a CLIPEncoder with the model's own CLIPTextConfig), on its gradient path
        # (textual_inversion.py trains the embeddings through it): it runs in the model's dtype, in the engine.
        own_config = getattr(model, "config", None)

        def separate_model(module) -> bool:
            return _is_model_like(module) and (own_config is None or module.config is not own_config)

        def visit(module, prefix: str, depth: int) -> None:
            for child_name, child in module.named_children():
                full = f"{prefix}{child_name}"
                if _all_frozen(child) and any(separate_model(m) for m in child.modules()):
                    chosen.append(full)
                elif depth < 2 and not _is_model_like(child) and _any_trainable(child):
                    visit(child, full + ".", depth + 1)

        visit(model, "", 0)
    if chosen and not any(
        p.requires_grad for n, p in model.named_parameters() if not any(n == c or n.startswith(c + ".") for c in chosen)
    ):
        log.info(
            "accel-npu: %s has no trainable parameter outside %s; leaving it to DeepSpeed as is",
            type(model).__name__,
            chosen,
        )
        return []
    return chosen


# --------------------------------------------------------------------------------------------
# hiding
def _guarded_class(cls: type) -> type:
    """A subclass of ``cls`` whose instances keep hidden towers hidden and reach them in train()."""
    if getattr(cls, "_accel_npu_guarded", False):
        return cls
    sub = _GUARDED_CLASSES.get(cls)
    if sub is not None:
        return sub

    def __setattr__(self, name, value):
        hidden = self.__dict__.get(HIDDEN)
        if hidden is not None and name in hidden:
            import torch

            if isinstance(value, torch.nn.Module):
                _replace_hidden(self, name, value)
                return
            del hidden[name]
            object.__delattr__(self, name)
        cls.__setattr__(self, name, value)

    def __delattr__(self, name):
        hidden = self.__dict__.get(HIDDEN)
        if hidden is not None and name in hidden:
            del hidden[name]
            object.__delattr__(self, name)
            return
        cls.__delattr__(self, name)

    def train(self, mode: bool = True):
        result = cls.train(self, mode)
        for tower in (self.__dict__.get(HIDDEN) or {}).values():
            tower.train(mode)
        return result

    sub = type(
        cls.__name__,
        (cls,),
        {
            "__setattr__": __setattr__,
            "__delattr__": __delattr__,
            "train": train,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_accel_npu_guarded": True,
            "_accel_npu_original_class": cls,
        },
    )
    _GUARDED_CLASSES[cls] = sub
    return sub


def _replace_hidden(parent, name: str, value) -> None:
    """``parent.<name> = value`` for a hidden tower: the new module stays out of the engine too."""
    if _any_trainable(value):
        raise AccelNpuError(
            f"{type(parent).__name__}.{name} was kept out of the DeepSpeed engine as a frozen tower; the "
            f"module assigned to it now has trainable parameters, which the engine and optimizer built "
            f"at accelerator.prepare() cannot train. Freeze it (requires_grad_(False)) or set "
            f"ACCEL_NPU_FROZEN_MODULES to the towers to hide, without {name!r}."
        )
    old = parent.__dict__[HIDDEN][name]
    device = _device_of(old)
    if device is not None:
        value.to(device)
    object.__setattr__(parent, name, value)
    parent.__dict__[HIDDEN][name] = value
    log.info(
        "accel-npu: %s.%s replaced; the new module is kept out of the DeepSpeed engine too", type(parent).__name__, name
    )


def _device_of(module):
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def hide(model, names: list[str], device=None) -> dict[str, Any]:
    """Pop each named tower from its parent's ``_modules``; keep it as a plain attribute.

    Towers built under ZeRO-3 ``zero.Init`` are re-materialized first (collective: every rank
    calls ``hide`` with the same names, as every rank calls ``accelerator.prepare``).
    Returns {dotted name: tower}.
    """
    hidden: dict[str, Any] = {}
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        tower = parent._modules[attr]
        if is_zero_partitioned(tower):
            rematerialize(tower, attr)
        if device is not None:
            tower.to(device)  # .to() keeps each tensor's dtype
        parent.__dict__.setdefault(HIDDEN + "_order", list(parent._modules))
        del parent._modules[attr]
        object.__setattr__(parent, attr, tower)
        parent.__dict__.setdefault(HIDDEN, {})[attr] = tower
        if not getattr(type(parent), "_accel_npu_guarded", False):
            parent.__class__ = _guarded_class(type(parent))
        hidden[name] = tower
    if hidden:
        log.info(
            "accel-npu: kept out of the DeepSpeed engine (frozen, own dtype): %s",
            ", ".join(f"{n} ({_describe(t)})" for n, t in hidden.items()),
        )
    return hidden


def restore(model) -> None:
    """Put hidden towers back into ``_modules`` (only for a prepare that failed)."""
    for name in list(hidden_towers(model)):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        tower = parent.__dict__[HIDDEN].pop(attr)
        object.__delattr__(parent, attr)
        parent._modules[attr] = tower
        if not parent.__dict__[HIDDEN]:
            order = parent.__dict__.pop(HIDDEN + "_order", [])
            items = sorted(parent._modules.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
            parent._modules.clear()
            parent._modules.update(items)
            del parent.__dict__[HIDDEN]
            original = getattr(type(parent), "_accel_npu_original_class", None)
            if original is not None:
                parent.__class__ = original


def _describe(module) -> str:
    n = sum(p.numel() for p in module.parameters())
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters()})
    return f"{type(module).__name__}, {n / 1e6:.2f}M params, {'/'.join(dtypes)}"


# --------------------------------------------------------------------------------------------
# the wrapper of Accelerator._prepare_deepspeed (named by path in this package's patch)
def prepare_deepspeed(wrapped, instance, args, kwargs):
    from deepspeed import DeepSpeedEngine

    result = _prepare_with_towers_hidden(wrapped, instance, args, kwargs)
    for engine in result if isinstance(result, (tuple, list)) else (result,):
        if isinstance(engine, DeepSpeedEngine):
            zero.note_engine_built(engine)  # models loaded while it lives are used outside it (loading plugin)
    return result


def _prepare_with_towers_hidden(wrapped, instance, args, kwargs):
    import torch

    models = [a for a in args if isinstance(a, torch.nn.Module)]
    if len(models) != 1 or hidden_towers(models[0]):
        return wrapped(*args, **kwargs)
    model = models[0]
    names = select_towers(model)
    if not names:
        return wrapped(*args, **kwargs)
    hide(model, names, device=instance.device)
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        restore(model)
        raise

"""Frozen towers kept out of the DeepSpeed engine (issue 5, item 1).

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
  whole from the files it was loaded from, in the checkpoint's dtype, bit-identical to them.

Nothing here imports torch at module level: the plugin imports it lazily.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from accel_npu import environment
from accel_npu.errors import ConfigError

log = logging.getLogger("accel_npu")

#: instance-dict key holding {attribute name: hidden module} on a parent module
HIDDEN = "_accel_npu_hidden_towers"
_GUARDED_CLASSES: dict[type, type] = {}


# --------------------------------------------------------------------------------------------
# selection
def _is_model_like(module) -> bool:
    """A module that is a model of its own (diffusers/transformers), not a plain container."""
    return hasattr(module, "config") and not isinstance(getattr(module, "config"), (int, float, str))


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
    if raw.lower() in {"none", "0", "off", "false"}:
        return []
    return [n.strip() for n in raw.split(",") if n.strip()]


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
                    f"submodule (its children: {children}). Fix the name or unset the variable.") from None
            if sub is model or not name:
                raise ConfigError("ACCEL_NPU_FROZEN_MODULES cannot name the model itself")
            if _any_trainable(sub):
                raise ConfigError(
                    f"ACCEL_NPU_FROZEN_MODULES names {name!r}, but it has trainable parameters; call "
                    f"{name}.requires_grad_(False) first or remove it from the variable.")
            chosen.append(name)
    else:
        chosen = []

        def visit(module, prefix: str, depth: int) -> None:
            for child_name, child in module.named_children():
                full = f"{prefix}{child_name}"
                if _all_frozen(child) and any(_is_model_like(m) for m in child.modules()):
                    chosen.append(full)
                elif depth < 2 and not _is_model_like(child) and _any_trainable(child):
                    visit(child, full + ".", depth + 1)

        visit(model, "", 0)
    if chosen and not any(p.requires_grad for n, p in model.named_parameters()
                          if not any(n == c or n.startswith(c + ".") for c in chosen)):
        log.info("accel-npu: %s has no trainable parameter outside %s; leaving it to DeepSpeed as is",
                 type(model).__name__, chosen)
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

    sub = type(cls.__name__, (cls,), {
        "__setattr__": __setattr__, "__delattr__": __delattr__, "train": train,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__,
        "_accel_npu_guarded": True, "_accel_npu_original_class": cls,
    })
    _GUARDED_CLASSES[cls] = sub
    return sub


def _replace_hidden(parent, name: str, value) -> None:
    """``parent.<name> = value`` for a hidden tower: the new module stays out of the engine too."""
    if _any_trainable(value):
        from accel_npu.errors import AccelNpuError

        raise AccelNpuError(
            f"{type(parent).__name__}.{name} was kept out of the DeepSpeed engine as a frozen tower; the "
            f"module assigned to it now has trainable parameters, which the engine and optimizer built "
            f"at accelerator.prepare() cannot train. Freeze it (requires_grad_(False)) or set "
            f"ACCEL_NPU_FROZEN_MODULES to the towers to hide, without {name!r}.")
    old = parent.__dict__[HIDDEN][name]
    device = _device_of(old)
    if device is not None:
        value.to(device)
    object.__setattr__(parent, name, value)
    parent.__dict__[HIDDEN][name] = value
    log.info("accel-npu: %s.%s replaced; the new module is kept out of the DeepSpeed engine too",
             type(parent).__name__, name)


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
        log.info("accel-npu: kept out of the DeepSpeed engine (frozen, own dtype): %s",
                 ", ".join(f"{n} ({_describe(t)})" for n, t in hidden.items()))
    return hidden


def hidden_towers(model) -> dict[str, Any]:
    """{dotted name: module} of every tower hidden under ``model`` (searching containers)."""
    out: dict[str, Any] = {}

    def visit(module, prefix: str) -> None:
        for attr, tower in (module.__dict__.get(HIDDEN) or {}).items():
            out[prefix + attr] = tower
        for child_name, child in module.named_children():
            visit(child, f"{prefix}{child_name}.")

    visit(model, "")
    return out


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
            items = sorted(parent._modules.items(),
                           key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))
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


def tower_state_dict(model) -> dict:
    """State-dict entries of hidden towers, prefixed with their names (references, no copy)."""
    out = {}
    for name, tower in hidden_towers(model).items():
        for key, value in tower.state_dict().items():
            out[f"{name}.{key}"] = value
    return out


# --------------------------------------------------------------------------------------------
# towers built under zero.Init
def is_zero_partitioned(module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def source_dir(tower, attr: str = "") -> str | None:
    """The local directory whose weight files ``tower`` was loaded from, or None.

    transformers records the path it was given (``config._name_or_path``), not the subfolder:
    the path itself, then ``path/<attribute name>``, then every subdirectory is tried, and the
    first whose files hold all of the tower's parameters with the right shapes wins.
    """
    candidates = []
    recorded = getattr(tower, "_accel_npu_source", None)  # issue 4's loader may record it
    if recorded:
        candidates.append(str(recorded))
    for value in (getattr(tower, "name_or_path", None), _config_get(tower, "_name_or_path")):
        if value and str(value) not in candidates:
            candidates.append(str(value))
    roots = []
    for cand in candidates:
        if os.path.isdir(cand):
            roots.append(cand)
        else:
            try:  # a hub id already in the local cache
                from huggingface_hub import snapshot_download

                roots.append(snapshot_download(cand, local_files_only=True))
            except Exception:
                pass
    shapes = _param_shapes(tower)
    for root in roots:
        dirs = [root] + ([os.path.join(root, attr)] if attr else [])
        try:
            dirs += [os.path.join(root, d) for d in sorted(os.listdir(root))
                     if os.path.isdir(os.path.join(root, d)) and d != attr]
        except OSError:
            pass
        for d in dirs:
            if _weight_files(d) and _holds(tower, d, shapes):
                return d
    return None


def _param_shapes(tower) -> dict[str, tuple]:
    out = {}
    for name, p in tower.named_parameters():
        out[name] = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
    return out


def _holds(tower, directory: str, shapes: dict[str, tuple]) -> bool:
    """Whether the safetensors files of ``directory`` hold every parameter with its shape."""
    from safetensors import safe_open

    found: dict[str, tuple] = {}
    try:
        for path in _weight_files(directory):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    found[key] = tuple(f.get_slice(key).get_shape())
    except Exception:
        return False
    for name, shape in shapes.items():
        if not any(found.get(k) == shape for k in _candidate_keys(tower, name)):
            return False
    return True


def _config_get(module, key):
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        return cfg.get(key)
    return getattr(cfg, key, None)


def _weight_files(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for index in ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json"):
        if index in names:
            with open(os.path.join(directory, index)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            return [os.path.join(directory, n) for n in files]
    return [os.path.join(directory, n) for n in sorted(names) if n.endswith(".safetensors")]


def _read_tensors(files: list[str], wanted: dict[str, list[str]]) -> dict[str, Any]:
    """{param name: tensor} read from ``files``; ``wanted`` maps a param name to candidate keys."""
    from safetensors import safe_open

    found: dict[str, Any] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            for name, cands in wanted.items():
                if name in found:
                    continue
                for key in cands:
                    if key in keys:
                        found[name] = f.get_tensor(key)
                        break
    return found


def _candidate_keys(tower, name: str) -> list[str]:
    cands = [name]
    prefix = getattr(tower, "base_model_prefix", "") or ""
    if prefix:
        if name.startswith(prefix + "."):
            cands.append(name[len(prefix) + 1:])
        else:
            cands.append(f"{prefix}.{name}")
    return cands


def rematerialize(tower, attr: str = "") -> str:
    """Replace the ZeRO-3 partitioned parameters of ``tower`` by whole, plain ones.

    Read from the safetensors files the tower was loaded from (its checkpoint dtype, bit-exact);
    parameters not found there are gathered from the partitions (a collective: every rank
    reaches this with the same tower). Returns "files" or "gathered".
    """
    import torch

    rebuild = getattr(tower, "_accel_npu_rebuild", None)  # set by accel_npu.zero3_loading
    if _all_ranks_agree(rebuild is not None):
        rebuild()  # stock diffusers' result, from the files; local to each rank
        log.info("accel-npu: %s was loaded into ZeRO-3 partitions; rebuilt whole from %s", attr or
                 type(tower).__name__, getattr(tower, "_accel_npu_source", "its files"))
        return "files"
    directory = source_dir(tower, attr)
    has_files = directory is not None
    # every rank must take the same branch: the gather below is a collective
    has_files = _all_ranks_agree(has_files)
    from accel_npu.zero3_loading import param_slots

    slots = param_slots(tower)  # {id(param): [(module, attribute, dotted name), ...]}
    params = {pid: entries[0][0]._parameters[entries[0][1]] for pid, entries in slots.items()}
    tensors: dict[int, Any] = {}
    if has_files:
        wanted = {entries[0][2]: [k for e in entries for k in _candidate_keys(tower, e[2])]
                  for pid, entries in slots.items()}
        found = _read_tensors(_weight_files(directory), wanted)
        for pid, entries in slots.items():
            if entries[0][2] in found:
                tensors[pid] = found[entries[0][2]]
    missing = [pid for pid in slots if pid not in tensors]
    if missing:
        import deepspeed

        todo = [params[pid] for pid in missing]
        with deepspeed.zero.GatheredParameters(todo, modifier_rank=None):
            for pid in missing:
                tensors[pid] = params[pid].data.detach().clone()
    for pid, entries in slots.items():
        value = tensors[pid]
        if pid not in missing:
            value = _to_load_dtype(tower, entries[0][2], value)
        new = torch.nn.Parameter(value, requires_grad=False)
        for module, pname, _ in entries:
            module._parameters[pname] = new
    how = "files" if not missing else ("gathered" if not has_files or len(missing) == len(slots) else "files+gathered")
    if how == "files":
        log.info("accel-npu: %s was built under ZeRO-3 zero.Init; re-materialized whole from %s", attr or
                 type(tower).__name__, directory)
    else:
        log.warning("accel-npu: %s was built under ZeRO-3 zero.Init and %d of its parameters were not found "
                    "in the files it came from (%s); they were gathered from the partitions in %s. Load it "
                    "before creating the Accelerator to keep its checkpoint dtype.", attr or type(tower).__name__,
                    len(missing), directory or "no local directory recorded",
                    next(iter(tensors.values())).dtype if tensors else "?")
    return how


def _to_load_dtype(tower, name: str, tensor):
    """The dtype from_pretrained would have given this parameter outside zero.Init.

    transformers records the requested (or "auto"-resolved) dtype in ``config.dtype``; modules in
    ``_keep_in_fp32_modules`` stay fp32 for fp16 loads (``..._strict`` ones for bf16 too).
    Without a recorded dtype the file's own dtype is kept.
    """
    import torch

    if not tensor.is_floating_point():
        return tensor
    target = _config_get(tower, "dtype")
    if isinstance(target, str):
        target = getattr(torch, target.replace("torch.", ""), None)
    if not isinstance(target, torch.dtype) or target == tensor.dtype:
        return tensor
    parts = name.split(".")
    strict = set(getattr(tower, "_keep_in_fp32_modules_strict", None) or ())
    loose = set(getattr(tower, "_keep_in_fp32_modules", None) or ())
    keep = strict | loose if target == torch.float16 else strict if target == torch.bfloat16 else set()
    if any(m in parts for m in keep):
        target = torch.float32
    return tensor.to(target)


def _all_ranks_agree(flag: bool) -> bool:
    """True only when ``flag`` is true on every rank (a MIN all-reduce; plain value if not distributed)."""
    try:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        from accel_npu.backend import current_backend

        backend = current_backend()
        device = "cpu"
        if backend.is_accelerator and dist.get_backend() != "gloo":
            import accelerate

            device = accelerate.PartialState().device
        t = torch.tensor([1 if flag else 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())
    except Exception:  # pragma: no cover - never let bookkeeping break prepare
        return flag

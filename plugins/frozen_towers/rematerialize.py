"""Towers built under ZeRO-3 ``zero.Init`` made whole again before they are kept out of the engine.

From the safetensors files the tower was loaded from (its checkpoint dtype, bit-exact), or, for
a diffusers model the loader put into partitions, by the rebuild it attached; parameters found
nowhere are gathered from the partitions (a collective).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from accel_npu._torch import markers
from accel_npu._torch.dist import all_ranks_agree
from accel_npu._torch.safetensors_io import weight_files
from accel_npu._torch.zero import param_slots, whole_shape

log = logging.getLogger("accel_npu")


def source_dir(tower, attr: str = "") -> str | None:
    """The local directory whose weight files ``tower`` was loaded from, or None.

    transformers records the path it was given (``config._name_or_path``), not the subfolder:
    the path itself, then ``path/<attribute name>``, then every subdirectory is tried, and the
    first whose files hold all of the tower's parameters with the right shapes wins.
    """
    candidates = []
    recorded = getattr(tower, markers.SOURCE, None)  # the diffusers loader records it
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
            except Exception:  # noqa: BLE001 - not in the local cache: another root may hold it
                pass
    shapes = _param_shapes(tower)
    for root in roots:
        dirs = [root] + ([os.path.join(root, attr)] if attr else [])
        try:
            dirs += [
                os.path.join(root, d)
                for d in sorted(os.listdir(root))
                if os.path.isdir(os.path.join(root, d)) and d != attr
            ]
        except OSError:
            pass
        for d in dirs:
            if weight_files(d) and _holds(tower, d, shapes):
                return d
    return None


def _param_shapes(tower) -> dict[str, tuple]:
    out = {}
    for name, p in tower.named_parameters():
        out[name] = whole_shape(p)
    return out


def _holds(tower, directory: str, shapes: dict[str, tuple]) -> bool:
    """Whether the safetensors files of ``directory`` hold every parameter with its shape."""
    from safetensors import safe_open

    found: dict[str, tuple] = {}
    try:
        for path in weight_files(directory):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    found[key] = tuple(f.get_slice(key).get_shape())
    except Exception:  # noqa: BLE001 - unreadable weights are not this tower's: stock behaviour
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
            cands.append(name[len(prefix) + 1 :])
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

    rebuild = getattr(tower, markers.REBUILD, None)  # set by the diffusers loader (placement/zero3.py)
    if all_ranks_agree(rebuild is not None):
        rebuild()  # stock diffusers' result, from the files; local to each rank
        log.info(
            "accel-npu: %s was loaded into ZeRO-3 partitions; rebuilt whole from %s",
            attr or type(tower).__name__,
            getattr(tower, markers.SOURCE, "its files"),
        )
        return "files"
    directory = source_dir(tower, attr)
    has_files = directory is not None
    # every rank must take the same branch: the gather below is a collective
    has_files = all_ranks_agree(has_files)
    slots = param_slots(tower)  # {id(param): [(module, attribute, dotted name), ...]}
    params = {pid: entries[0][0]._parameters[entries[0][1]] for pid, entries in slots.items()}
    tensors: dict[int, Any] = {}
    if has_files:
        wanted = {
            entries[0][2]: [k for e in entries for k in _candidate_keys(tower, e[2])] for pid, entries in slots.items()
        }
        found = _read_tensors(weight_files(directory), wanted)
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
        log.info(
            "accel-npu: %s was built under ZeRO-3 zero.Init; re-materialized whole from %s",
            attr or type(tower).__name__,
            directory,
        )
    else:
        log.warning(
            "accel-npu: %s was built under ZeRO-3 zero.Init and %d of its parameters were not found "
            "in the files it came from (%s); they were gathered from the partitions in %s. Load it "
            "before creating the Accelerator to keep its checkpoint dtype.",
            attr or type(tower).__name__,
            len(missing),
            directory or "no local directory recorded",
            next(iter(tensors.values())).dtype if tensors else "?",
        )
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

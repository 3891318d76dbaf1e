"""Sharded checkpoints under DeepSpeed ZeRO that never gather on rank 0 and never hang (issue 5).

- :func:`atomic_save_state`: ``accelerator.save_state(dir)`` writes every rank's shards into a
  hidden sibling directory, then rank 0 writes ``latest``, a manifest and the trained
  components' configs, and renames it into place. A crash or SIGKILL at any point leaves the
  previous checkpoint as it was (:func:`resolve_load_dir` also recovers the one moment where
  the old directory is set aside).
- :func:`rendezvous`: a bounded check that every rank entered a collective
  (``get_state_dict``/``save_model``/``save_state``) before anything is gathered; a rank-0-only
  call fails within ``ACCEL_NPU_COLLECTIVE_TIMEOUT`` seconds with what to call instead.
- :func:`streaming_save_model`: ``save_model`` under ZeRO-3 gathers one output shard at a time.
- :func:`consolidate`: a checkpoint -> a diffusers-style directory per trained component,
  built on ``deepspeed.utils.zero_to_fp32``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from datetime import timedelta
from typing import Any

from accel_npu import environment
from accel_npu.errors import AccelNpuError

log = logging.getLogger("accel_npu")

MANIFEST = "accel_npu_checkpoint.json"
COMPONENTS_DIR = "accel_npu_components"
PARTIAL_SUFFIX = ".accel-npu-partial"
OLD_SUFFIX = ".accel-npu-old"


class CheckpointError(AccelNpuError):
    """A checkpoint that is incomplete, or a checkpoint operation that cannot work."""


class CollectiveMisuseError(AccelNpuError):
    """A collective (a ZeRO-3 gather, a sharded save) entered by only some of the ranks."""


# --------------------------------------------------------------------------------------------
# bounded rendezvous
_counters: dict[str, int] = {}

_INSTEAD = {
    "get_state_dict": (
        "Call it on every rank (it is a collective under ZeRO-3) and save on the main process only:\n"
        "    state_dict = accelerator.get_state_dict(model)      # all ranks\n"
        "    if accelerator.is_main_process: save(state_dict)\n"
        "or, without gathering the model into one rank's memory:\n"
        "    accelerator.save_state(output_dir)                   # all ranks; sharded, atomic\n"
        "    accel-npu consolidate output_dir export_dir          # later, offline: diffusers directories"),
    "save_model": (
        "Call accelerator.save_model(model, dir) on every rank (under ZeRO-3 it gathers one shard at a "
        "time; only the main process writes), or accelerator.save_state(dir) on every rank and "
        "`accel-npu consolidate dir export_dir` afterwards."),
    "save_state": (
        "Call accelerator.save_state(dir) on every rank, not inside `if accelerator.is_main_process:`: "
        "under DeepSpeed every rank writes its own shard."),
}


def collective_timeout() -> float:
    raw = environment.get("ACCEL_NPU_COLLECTIVE_TIMEOUT")
    try:
        return float(raw)
    except ValueError:
        raise AccelNpuError(f"ACCEL_NPU_COLLECTIVE_TIMEOUT={raw!r} is not a number of seconds") from None


def _store_and_world():
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        world, rank = dist.get_world_size(), dist.get_rank()
        if world == 1:
            return None, 1, 0
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store(), world, rank
    except Exception:  # no store we can use: no guard (never worse than stock)
        return None, 1, 0


def rendezvous(op: str, timeout: float | None = None) -> None:
    """Return once every rank has called ``rendezvous(op)`` the same number of times.

    Uses the process group's key-value store (no collective, so it cannot hang): raises
    :class:`CollectiveMisuseError` naming the missing ranks after ``timeout`` seconds
    (``ACCEL_NPU_COLLECTIVE_TIMEOUT``, default 30).
    """
    store, world, rank = _store_and_world()
    if store is None:
        return
    timeout = collective_timeout() if timeout is None else timeout
    n = _counters[op] = _counters.get(op, 0) + 1
    key = f"accel_npu/rendezvous/{op}/{n}"
    store.set(f"{key}/rank{rank}", "1")
    if store.add(key, 1) >= world:
        store.set(f"{key}/done", "1")  # the last rank to arrive releases the others
        return
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout))
        return
    except Exception:  # the store's timeout error (its type differs between torch versions)
        if store.check([f"{key}/done"]):
            return
    present = [r for r in range(world) if store.check([f"{key}/rank{r}"])]
    missing = [r for r in range(world) if r not in present]
    raise CollectiveMisuseError(
        f"accelerator.{op}() under DeepSpeed ZeRO is a collective, but only rank(s) {present} "
        f"entered it; rank(s) {missing} did not within {timeout:g} s "
        f"(ACCEL_NPU_COLLECTIVE_TIMEOUT). Stock accelerate would wait here until the process "
        f"group times out, or gather the whole model into this rank's memory. "
        f"{_INSTEAD.get(op, '')}")


# --------------------------------------------------------------------------------------------
# accelerate helpers
def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def zero_stage(accelerator) -> int:
    try:
        return int(accelerator.deepspeed_config.get("zero_optimization", {}).get("stage", 0))
    except Exception:
        return 0


def partial_dir(final: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{PARTIAL_SUFFIX}")


def old_dir(final: str) -> str:
    parent, name = os.path.split(os.path.abspath(final))
    return os.path.join(parent, f".{name}{OLD_SUFFIX}")


def _is_our_temp(name: str) -> bool:
    return name.startswith(".") and (name.endswith(PARTIAL_SUFFIX) or name.endswith(OLD_SUFFIX))


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (its entries); best effort, as some filesystems refuse."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# components: what consolidate needs to write config.json
def _library_of(module) -> str | None:
    try:
        from diffusers.models.modeling_utils import ModelMixin

        if isinstance(module, ModelMixin):
            return "diffusers"
    except Exception:
        pass
    try:
        from transformers import PreTrainedModel

        if isinstance(module, PreTrainedModel):
            return "transformers"
    except Exception:
        pass
    return None


def _save_component_config(module, library: str, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    if library == "diffusers":
        module.save_config(directory)
    else:
        module.config.save_pretrained(directory)


def record_components(model, directory: str) -> dict:
    """Write the trained components' configs under ``directory/accel_npu_components``.

    A component is the model itself when it is a diffusers/transformers model, else each of its
    registered children (frozen towers kept out of the engine are not children any more).
    """
    comps: dict[str, Any] = {}
    base = os.path.join(directory, COMPONENTS_DIR)
    root_lib = _library_of(model)
    items = [("", model)] if root_lib else list(model.named_children())
    for name, module in items:
        lib = _library_of(module)
        entry = {"class": f"{type(module).__module__}.{type(module).__qualname__}", "library": lib,
                 "prefix": f"{name}." if name else ""}
        if lib:
            try:
                _save_component_config(module, lib, os.path.join(base, name or "_root"))
                entry["config"] = os.path.join(COMPONENTS_DIR, name or "_root", "config.json")
            except Exception as exc:  # a config we cannot write must not fail the save
                log.warning("accel-npu: could not record the config of %s: %s", name or "the model", exc)
        comps[name] = entry
    os.makedirs(base, exist_ok=True)
    _write_json(os.path.join(base, "components.json"), {"components": comps})
    return comps


# --------------------------------------------------------------------------------------------
# atomic save_state
def _automatic_target(accelerator) -> str:
    pc = accelerator.project_configuration
    base = os.path.join(accelerator.project_dir, "checkpoints")
    os.makedirs(base, exist_ok=True)
    if pc.total_limit is not None and accelerator.is_main_process:
        folders = sorted((f for f in os.listdir(base) if not _is_our_temp(f) and _digits(f) is not None),
                         key=_digits)
        excess = len(folders) + 1 - pc.total_limit
        for f in folders[:max(0, excess)]:
            shutil.rmtree(os.path.join(base, f))
    final = os.path.join(base, f"checkpoint_{accelerator.save_iteration}")
    if os.path.exists(final):
        raise ValueError(f"Checkpoint directory {final} ({accelerator.save_iteration}) already exists. Please "
                         "manually override `self.save_iteration` with what iteration to start with.")
    return final


def _digits(name: str):
    import re

    found = re.findall(r"([0-9]+)(?=[^/]*$)", name)
    return int(found[0]) if found else None


def atomic_save_state(wrapped, accelerator, output_dir, safe_serialization=True, **save_model_func_kwargs):
    """``Accelerator.save_state`` under DeepSpeed, atomically. Called on every rank."""
    rendezvous("save_state")
    pc = accelerator.project_configuration
    automatic = pc.automatic_checkpoint_naming
    final = _automatic_target(accelerator) if automatic else os.path.abspath(os.fspath(output_dir))
    tmp = partial_dir(final)
    if accelerator.is_main_process:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by an interrupted save: never a checkpoint
        os.makedirs(os.path.dirname(final), exist_ok=True)
    accelerator.wait_for_everyone()
    save_model_func_kwargs.setdefault("save_latest", False)  # `latest` is written last, below
    pc.automatic_checkpoint_naming = False
    try:
        wrapped(tmp, safe_serialization=safe_serialization, **save_model_func_kwargs)
    finally:
        pc.automatic_checkpoint_naming = automatic
    accelerator.wait_for_everyone()  # every rank's shards are on disk
    if accelerator.is_main_process:
        tags = [_tag(i) for i in range(len(accelerator._models))]
        if accelerator._models:
            record_components(accelerator.unwrap_model(accelerator._models[0]), tmp)
        with open(os.path.join(tmp, "latest"), "w") as f:
            f.write(tags[0] if tags else "")
        files = {}
        for dirpath, _, names in os.walk(tmp):
            for name in names:
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, tmp)] = os.path.getsize(path)
        _write_json(os.path.join(tmp, MANIFEST), {
            "format": 1, "tags": tags, "world_size": accelerator.num_processes,
            "zero_stage": zero_stage(accelerator), "files": files})
        _fsync_tree(tmp)
        _swap_into_place(tmp, final)
    accelerator.wait_for_everyone()
    return final


def _tag(i: int) -> str:
    from accelerate.utils import MODEL_NAME

    return f"{MODEL_NAME}" if i == 0 else f"{MODEL_NAME}_{i}"


def _carry_over(final: str, tmp: str) -> None:
    """Entries of an existing ``final`` that this save did not write (the user's logs, other files)
    are hard-linked into ``tmp`` so the swap keeps them, as stock save_state would (no data is
    copied; a crash before the swap leaves them where they were)."""
    for name in os.listdir(final):
        src, dst = os.path.join(final, name), os.path.join(tmp, name)
        if os.path.lexists(dst):
            continue  # written by this save: the new one wins, as in stock
        try:
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, copy_function=os.link)
            elif os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            else:
                os.link(src, dst)
        except OSError:
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
            else:
                shutil.copy2(src, dst, follow_symlinks=False)


def _swap_into_place(tmp: str, final: str) -> None:
    old = old_dir(final)
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        _carry_over(final, tmp)
    if os.path.exists(final):
        os.rename(final, old)  # from here until the next rename, resolve_load_dir() recovers `old`
    os.rename(tmp, final)
    _fsync_path(os.path.dirname(final))
    if os.path.exists(old):
        shutil.rmtree(old)


# --------------------------------------------------------------------------------------------
# loading
def missing_files(directory: str) -> list[str] | None:
    """Files the manifest lists that are absent or truncated; None when there is no manifest."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        manifest = json.load(f)
    out = []
    for rel, size in manifest["files"].items():
        p = os.path.join(directory, rel)
        if not os.path.isfile(p):
            out.append(rel)
        elif os.path.getsize(p) != size:
            out.append(f"{rel} (truncated: {os.path.getsize(p)} of {size} bytes)")
    return out


def resolve_load_dir(input_dir: str | None, accelerator) -> str | None:
    """The directory ``load_state`` should read, checked for completeness."""
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            return None
        base = os.path.join(accelerator.project_dir, "checkpoints")
        folders = sorted((f for f in os.listdir(base) if not _is_our_temp(f) and _digits(f) is not None),
                         key=_digits)
        if not folders:
            return None
        input_dir = os.path.join(base, folders[-1])
    input_dir = os.path.expanduser(os.fspath(input_dir))
    if not os.path.isdir(input_dir) and os.path.isdir(old_dir(input_dir)):
        log.warning("accel-npu: %s is missing but the previous checkpoint set aside by an interrupted save is "
                    "there; loading %s", input_dir, old_dir(input_dir))
        input_dir = old_dir(input_dir)
    if os.path.isdir(input_dir):
        missing = missing_files(input_dir)
        if missing:
            raise CheckpointError(f"checkpoint {input_dir} is incomplete; missing: {', '.join(missing)}")
    return input_dir


# --------------------------------------------------------------------------------------------
# safetensors written tensor by tensor (safetensors' save_file first serializes the whole shard
# into one bytes object: +1 shard of memory)
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class SafetensorsStream:
    """Write a .safetensors file whose header is known up front, one tensor at a time, in order."""

    def __init__(self, path: str, specs: list[tuple[str, Any, tuple]], metadata: dict | None = None):
        import struct

        import torch

        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._order = []
        for name, dtype, shape in specs:
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[str(dtype).replace("torch.", "")], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * ((8 - len(raw) % 8) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0
        self.total = offset

    def write(self, name: str, tensor) -> None:
        expected, dtype, shape, nbytes = self._order[self._next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointError(f"internal: wrote {name} {tensor.dtype} {tuple(tensor.shape)}, "
                                  f"expected {expected} {dtype} {shape}")
        t = tensor.detach().cpu().contiguous().reshape(-1)
        if nbytes:
            self._f.write(t.view(__import__("torch").uint8).numpy().data)
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            self._f.close()
            raise CheckpointError(f"internal: {len(self._order) - self._next} tensors were not written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


# --------------------------------------------------------------------------------------------
# save_model under ZeRO-3, one shard at a time
def streaming_save_model(accelerator, model, save_directory, max_shard_size="10GB", safe_serialization=True):
    """Write the model's 16-bit weights like ``save_model`` does, gathering one shard at a time.

    Every rank calls it; each rank holds at most one output shard's parameters gathered at once,
    and only the main process keeps them (on CPU) and writes.
    """
    import deepspeed
    import torch
    from accelerate.utils import convert_file_size_to_int

    from accel_npu import towers

    limit = convert_file_size_to_int(max_shard_size)
    engine = model
    module = accelerator.unwrap_model(model)
    entries = module.state_dict(keep_vars=True)
    for key, value in towers.tower_state_dict(module).items():
        entries.setdefault(key, value)
    plan = plan_shards(entries, limit, lambda value: int(torch.Size(
        value.ds_shape if hasattr(value, "ds_shape") else value.shape).numel()) * value.element_size())
    n = len(plan)
    main = accelerator.is_main_process
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if main:
        os.makedirs(save_directory, exist_ok=True)
        stem, ext = weights.rsplit(".", 1)
        for name in os.listdir(save_directory):
            if name == weights or name == weights + ".index.json" or (name.startswith(stem + "-") and name.endswith("." + ext)):
                os.remove(os.path.join(save_directory, name))
    weight_map = {}
    total = 0

    def nbytes(key):
        v = entries[key]
        return int(torch.Size(v.ds_shape if hasattr(v, "ds_shape") else v.shape).numel()) * v.element_size()

    for i, keys in enumerate(plan):
        fname = weights if n == 1 else weights.replace(".", f"-{i + 1:05d}-of-{n:05d}.", 1)
        path = os.path.join(save_directory, fname)
        stream = None
        if main and safe_serialization:
            stream = SafetensorsStream(path, [(k, entries[k].dtype, tuple(entries[k].ds_shape if hasattr(
                entries[k], "ds_shape") else entries[k].shape)) for k in keys])
        bin_shard = {}
        # gather a quarter of a shard at a time: the gather's own buffers stay small too
        sub, sub_bytes = [], 0
        groups = []
        for k in keys:
            if sub and sub_bytes + nbytes(k) > max(limit // 4, 1):
                groups.append(sub)
                sub, sub_bytes = [], 0
            sub.append(k)
            sub_bytes += nbytes(k)
        if sub:
            groups.append(sub)
        for group in groups:
            params = [entries[k] for k in group if hasattr(entries[k], "ds_id")]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if main:
                    for k in group:
                        if stream is not None:
                            stream.write(k, entries[k])
                        else:
                            bin_shard[k] = entries[k].detach().cpu().clone()
        if main:
            if stream is not None:
                stream.close()
            else:
                torch.save(bin_shard, path)
            for k in keys:
                weight_map[k] = fname
                total += nbytes(k)
        del bin_shard
    if main and n > 1:
        _write_json(os.path.join(save_directory, weights + ".index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
    accelerator.wait_for_everyone()
    del engine


# --------------------------------------------------------------------------------------------
# consolidate
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}


def _checkpoint_problems(ckpt_dir: str, tag: str | None) -> tuple[str, list[str]]:
    """(tag, list of problems) for a DeepSpeed checkpoint directory; nothing is loaded."""
    problems: list[str] = []
    if not os.path.isdir(ckpt_dir):
        return tag or "", [f"{ckpt_dir} (no such directory)"]
    missing = missing_files(ckpt_dir)
    if missing:
        problems += missing
    if tag is None:
        latest = os.path.join(ckpt_dir, "latest")
        if not os.path.isfile(latest):
            partial = partial_dir(ckpt_dir)
            hint = f" (an interrupted save left {partial})" if os.path.isdir(partial) else ""
            return "", problems + [f"{latest} (the save did not finish: `latest` is written last){hint}"]
        with open(latest) as f:
            tag = f.read().strip()
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(tag_dir):
        return tag, problems + [f"{tag_dir} (the tag named by `latest`)"]
    import glob
    import re

    optim = glob.glob(os.path.join(tag_dir, "*_optim_states.pt"))
    model_states = glob.glob(os.path.join(tag_dir, "*_model_states.pt"))
    world = None
    manifest = os.path.join(ckpt_dir, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            world = json.load(f).get("world_size")
    ranks = {int(m.group(1)) for p in optim if (m := re.search(r"zero_pp_rank_(\d+)_", os.path.basename(p)))}
    if world is None and optim:
        import torch

        sd = torch.load(sorted(optim)[0], map_location="cpu", mmap=True, weights_only=False)
        pc = sd["optimizer_state_dict"].get("partition_count")
        world = max(pc) if isinstance(pc, list) else pc
    if world is None:
        problems.append(f"{tag_dir}/*_optim_states.pt (no ZeRO optimizer shard at all)")
    else:
        for r in range(int(world)):
            if r not in ranks:
                problems.append(f"{tag}/…zero_pp_rank_{r}_mp_rank_00_optim_states.pt (rank {r} of {world})")
    stage3 = any("zero_pp_rank_" in os.path.basename(p) for p in model_states)
    if stage3 and world is not None:
        have = {int(m.group(1)) for p in model_states if (m := re.search(r"zero_pp_rank_(\d+)_", os.path.basename(p)))}
        for r in range(int(world)):
            if r not in have:
                problems.append(f"{tag}/zero_pp_rank_{r}_mp_rank_00_model_states.pt (rank {r} of {world})")
    elif not model_states:
        problems.append(f"{tag}/mp_rank_00_model_states.pt")
    return tag, problems


def _components(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, COMPONENTS_DIR, "components.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)["components"]


def _group_keys(keys: list[str], comps: dict) -> dict[str, list[str]]:
    """{component name ("" = root): [keys]} -- recorded components first, then by first segment."""
    groups: dict[str, list[str]] = {}
    prefixes = sorted(((c["prefix"], name) for name, c in comps.items()), key=lambda x: -len(x[0]))
    for key in keys:
        for prefix, name in prefixes:
            if key.startswith(prefix):
                groups.setdefault(name, []).append(key)
                break
        else:
            name = key.split(".", 1)[0] if "." in key else "_root"
            groups.setdefault(name, []).append(key)
    return groups


def consolidate(ckpt_dir: str, out_dir: str, dtype: str = "fp32", max_shard_size: str = "5GB",
                tag: str | None = None, progress: bool = True) -> dict[str, list[str]]:
    """Turn a ZeRO-2/3 checkpoint (e.g. what ``save_state`` wrote) into one directory per trained
    component: ``out_dir/<name>/config.json`` + safetensors shards (+ index), loadable with
    ``from_pretrained``. Streams one output shard at a time (ZeRO-3). Returns {component: files}.
    Nothing is written unless the checkpoint is complete; the output appears atomically.
    """
    import torch
    from accelerate.utils import convert_file_size_to_int
    from deepspeed.utils import zero_to_fp32
    from tqdm.auto import tqdm

    if dtype not in _DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of bf16, fp32, fp16")
    torch_dtype = getattr(torch, _DTYPES[dtype])
    limit = convert_file_size_to_int(max_shard_size)
    ckpt_dir = os.path.abspath(ckpt_dir)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} already exists and is not empty; choose a new output directory")
    tag, problems = _checkpoint_problems(ckpt_dir, tag)
    if problems:
        raise CheckpointError(f"cannot consolidate {ckpt_dir}: the checkpoint is incomplete. Missing:\n  - "
                              + "\n  - ".join(problems) + "\nNothing was written.")
    comps = _components(ckpt_dir)
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag, lazy_mode=True)
    groups = _group_keys(list(state.keys()), comps)
    tmp = partial_dir(out_dir)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    written: dict[str, list[str]] = {}
    try:
        total = sum(int(torch.Size(v.shape).numel()) for v in state.values())
        bar = tqdm(total=total, unit="param", unit_scale=True, desc="consolidating", disable=not progress)
        for name, keys in groups.items():
            comp = comps.get(name, {})
            lib = comp.get("library")
            sub = os.path.join(tmp, name) if name else tmp
            os.makedirs(sub, exist_ok=True)
            stem = "diffusion_pytorch_model" if lib == "diffusers" else "model"
            prefix = comp.get("prefix", f"{name}." if name != "_root" else "")
            written[name or "."] = _write_component(state, keys, prefix, sub, stem, torch_dtype, limit, bar)
            if comp.get("config"):
                shutil.copyfile(os.path.join(ckpt_dir, comp["config"]), os.path.join(sub, "config.json"))
        bar.close()
        _fsync_tree(tmp)
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def plan_shards(entries: dict, limit: int, nbytes) -> list[list[str]]:
    """Keys packed in order into shards of at most ``limit`` bytes (a larger tensor gets its own).

    A tensor seen under several keys (tied weights) is planned once, under its first key, as
    safetensors requires; from_pretrained re-ties it.
    """
    plan: list[list[str]] = [[]]
    size = 0
    seen: set[int] = set()
    for key, value in entries.items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        n = nbytes(value)
        if plan[-1] and size + n > limit:
            plan.append([])
            size = 0
        plan[-1].append(key)
        size += n
    return plan


def _write_component(state, keys, prefix, directory, stem, torch_dtype, limit, bar) -> list[str]:
    import torch

    def out_dtype(v):
        return torch_dtype if v.dtype.is_floating_point else v.dtype

    plan = plan_shards({key: state[key] for key in keys}, limit, lambda v: int(torch.Size(v.shape).numel())
                       * torch.empty((), dtype=out_dtype(v)).element_size())
    n = len(plan)
    files, weight_map, total = [], {}, 0

    def out_name(key):
        return key[len(prefix):] if prefix and key.startswith(prefix) else key

    for i, shard_keys in enumerate(plan):
        fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        stream = SafetensorsStream(os.path.join(directory, fname),
                                   [(out_name(k), out_dtype(state[k]), tuple(state[k].shape)) for k in shard_keys])
        for key in shard_keys:
            v = state[key]
            t = v.contiguous()
            t = t.to(out_dtype(t))
            stream.write(out_name(key), t)
            weight_map[out_name(key)] = fname
            del t
            bar.update(int(torch.Size(v.shape).numel()))
        stream.close()
        total += stream.total
        files.append(fname)
    if n > 1:
        _write_json(os.path.join(directory, f"{stem}.safetensors.index.json"),
                    {"metadata": {"total_size": total}, "weight_map": weight_map})
        files.append(f"{stem}.safetensors.index.json")
    return files

"""Atomic ``save_state`` under DeepSpeed, and the checks before ``load_state``.

- :func:`atomic_save_state`: ``accelerator.save_state(dir)`` writes every rank's shards into a
  hidden sibling directory, then rank 0 writes ``latest``, a manifest and the trained
  components' configs, and renames it into place. A crash or SIGKILL at any point leaves the
  previous checkpoint as it was (:func:`resolve_load_dir` also recovers the one moment where
  the old directory is set aside).
- :func:`rendezvous`: a bounded check that every rank entered a collective
  (``get_state_dict``/``save_model``/``save_state``) before anything is gathered; a rank-0-only
  call fails within ``ACCEL_NPU_COLLECTIVE_TIMEOUT`` seconds with what to call instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from typing import Any

from accel_npu import environment
from accel_npu._torch import dist
from accel_npu._torch.dist import CollectiveMisuseError
from accel_npu._torch.markers import models_prepared_together
from accel_npu.errors import CheckpointError
from accel_npu.plugins.checkpoints import adapter_reload, background, callsite
from accel_npu.plugins.checkpoints.files import (
    COMPONENTS_DIR,
    MANIFEST,
    fsync_path,
    fsync_tree,
    is_our_temp,
    old_dir,
    partial_dir,
    write_json,
)

__all__ = [
    "CheckpointError",
    "CollectiveMisuseError",
    "atomic_save_state",
    "partition_count_problem",
    "resolve_load_dir",
    "rendezvous",
]

log = logging.getLogger("accel_npu")

# --------------------------------------------------------------------------------------------
# bounded rendezvous
_INSTEAD = {
    "get_state_dict": (
        "Call it on every rank (it is a collective under ZeRO-3) and save on the main process only:\n"
        "    state_dict = accelerator.get_state_dict(model)      # all ranks\n"
        "    if accelerator.is_main_process: save(state_dict)\n"
        "or, without gathering the model into one rank's memory:\n"
        "    accelerator.save_state(output_dir)                   # all ranks; sharded, atomic\n"
        "    accel-npu consolidate output_dir export_dir          # later, offline: diffusers directories"
    ),
    "save_model": (
        "Call accelerator.save_model(model, dir) on every rank (under ZeRO-3 it gathers one shard at a "
        "time; only the main process writes), or accelerator.save_state(dir) on every rank and "
        "`accel-npu consolidate dir export_dir` afterwards."
    ),
    "save_state": (
        "Call accelerator.save_state(dir) on every rank, not inside `if accelerator.is_main_process:`: "
        "under DeepSpeed every rank writes its own shard of the model and optimizer (DeepSpeed's "
        "save_checkpoint), and rank 0 cannot write the others' while they run the next step's "
        "collectives. Nothing was written."
    ),
}


def collective_timeout() -> float:
    return environment.seconds("ACCEL_NPU_COLLECTIVE_TIMEOUT")


def rendezvous(op: str, timeout: float | None = None, fsdp: bool = False) -> None:
    """Return once every rank has called ``rendezvous(op)``; else a :class:`CollectiveMisuseError`
    after ``timeout`` (``ACCEL_NPU_COLLECTIVE_TIMEOUT``) naming the script line that called it, the
    `if` around it, and what to call instead."""

    def advice() -> str:
        call = f"accelerator.{op}()"
        where = callsite.describe(call)
        if not where:
            return _INSTEAD.get(op, "")
        return f"{where}. {callsite.fix_for(call, 'FSDP' if fsdp else 'DEEPSPEED')} {_INSTEAD.get(op, '')}"

    dist.rendezvous(
        op, collective_timeout() if timeout is None else timeout, advice, under="FSDP" if fsdp else "DeepSpeed ZeRO"
    )


# --------------------------------------------------------------------------------------------
# accelerate helpers
def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def zero_stage(accelerator) -> int:
    try:
        return int(accelerator.deepspeed_config.get("zero_optimization", {}).get("stage", 0))
    except Exception:  # noqa: BLE001 - a config accelerate cannot read: treated as no ZeRO, as stock
        return 0


# --------------------------------------------------------------------------------------------
# components: what consolidate needs to write config.json
def _library_of(module) -> str | None:
    try:
        from diffusers.models.modeling_utils import ModelMixin

        if isinstance(module, ModelMixin):
            return "diffusers"
    except Exception:  # noqa: BLE001 - a diffusers that fails to import is not the model's library
        pass
    try:
        from transformers import PreTrainedModel

        if isinstance(module, PreTrainedModel):
            return "transformers"
    except Exception:  # noqa: BLE001 - a transformers that fails to import is not the model's library
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
        entry = {
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "library": lib,
            "prefix": f"{name}." if name else "",
        }
        if lib:
            try:
                _save_component_config(module, lib, os.path.join(base, name or "_root"))
                entry["config"] = os.path.join(COMPONENTS_DIR, name or "_root", "config.json")
            except Exception as exc:  # noqa: BLE001 - a config we cannot write must not fail the save
                log.warning("accel-npu: could not record the config of %s: %s", name or "the model", exc)
        comps[name] = entry
    os.makedirs(base, exist_ok=True)
    write_json(os.path.join(base, "components.json"), {"components": comps})
    return comps


# --------------------------------------------------------------------------------------------
# atomic save_state
def _automatic_target(accelerator, prune: bool = True) -> str:
    pc = accelerator.project_configuration
    base = os.path.join(accelerator.project_dir, "checkpoints")
    os.makedirs(base, exist_ok=True)
    if prune and pc.total_limit is not None and accelerator.is_main_process:
        _prune(base, pc.total_limit - 1)  # room for the new one, as stock makes it
    final = os.path.join(base, f"checkpoint_{accelerator.save_iteration}")
    if os.path.exists(final):
        raise ValueError(
            f"Checkpoint directory {final} ({accelerator.save_iteration}) already exists. Please "
            "manually override `self.save_iteration` with what iteration to start with."
        )
    return final


def _prune(base: str, keep: int) -> None:
    """Remove the oldest checkpoints in ``base`` (by the number in their names) beyond the newest ``keep``."""
    folders = sorted((f for f in os.listdir(base) if not is_our_temp(f) and _digits(f) is not None), key=_digits)
    for f in folders[: max(0, len(folders) - keep)]:
        shutil.rmtree(os.path.join(base, f))


def _digits(name: str):
    import re

    found = re.findall(r"([0-9]+)(?=[^/]*$)", name)
    return int(found[0]) if found else None


def atomic_save_state(wrapped, accelerator, output_dir, safe_serialization=True, **save_model_func_kwargs):
    """``Accelerator.save_state`` under DeepSpeed, atomically. Called on every rank.

    Asynchronously (``background.enabled()``) the engines' files are copied to host memory and written in the
    background (``background.py``); accelerate's own small files (RNG states, schedulers, samplers, custom
    objects) and the hooks' are written here, as before. Rank 0 publishes once every rank's files are durable;
    the next checkpoint call waits for that and raises a failure on every rank."""
    background.wait_for_pending()
    rendezvous("save_state")
    asynchronous = background.enabled()
    pc = accelerator.project_configuration
    automatic = pc.automatic_checkpoint_naming
    # asynchronously, old checkpoints are pruned once the new one is published, never before
    final = (
        _automatic_target(accelerator, prune=not asynchronous) if automatic else os.path.abspath(os.fspath(output_dir))
    )
    tmp = partial_dir(final)
    if accelerator.is_main_process:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by an interrupted save: never a checkpoint
        os.makedirs(os.path.dirname(final), exist_ok=True)
    accelerator.wait_for_everyone()
    save_model_func_kwargs.setdefault("save_latest", False)  # `latest` is written last, below
    pc.automatic_checkpoint_naming = False
    hooks = accelerator._save_model_state_pre_hook
    saved_hooks = dict(hooks)
    for handle, hook in saved_hooks.items():
        hooks[handle] = _with_one_weight_per_model(hook)
    pending = background.begin(tmp, final) if asynchronous else None
    try:
        with background.engines_snapshotting(accelerator._models, pending) if pending else contextlib.nullcontext():
            wrapped(tmp, safe_serialization=safe_serialization, **save_model_func_kwargs)
    except BaseException:
        if pending is not None:
            background.discard()
        raise
    finally:
        pc.automatic_checkpoint_naming = automatic
        for handle, hook in saved_hooks.items():
            if handle in hooks:
                hooks[handle] = hook
    if pending is None:
        accelerator.wait_for_everyone()  # every rank's shards are on disk
    # (asynchronously rank 0's writer publishes once every rank has said its files are durable: no barrier here)
    publish = None
    if accelerator.is_main_process:
        tags = [_tag(i) for i in range(len(accelerator._models))]
        module = accelerator.unwrap_model(accelerator._models[0]) if accelerator._models else None
        keep = pc.total_limit if automatic and asynchronous else None
        publish = functools.partial(
            _record_and_publish,
            module,
            tmp,
            final,
            {"tags": tags, "world_size": accelerator.num_processes, "zero_stage": zero_stage(accelerator)},
            keep,
            latest=tags[0] if tags else "",
        )
    if pending is not None:
        background.submit(pending, publish)
        return final
    if publish is not None:
        publish()
    accelerator.wait_for_everyone()
    return final


def _record_and_publish(module, tmp: str, final: str, fields: dict, keep: int | None, latest: str) -> None:
    # the components' configs are written here, by the writer thread when asynchronous: write_json fsyncs
    if module is not None:
        record_components(module, tmp)
    publish_checkpoint(tmp, final, fields, keep, latest=latest)


def publish_checkpoint(tmp: str, final: str, fields: dict, keep: int | None, latest: str | None = None) -> None:
    """Rank 0, once every rank's files are in ``tmp``: ``latest`` (DeepSpeed's tag file, when given), the
    manifest (``fields`` and every file with its size), fsync, the atomic rename; then (``keep``: an
    asynchronous save with total_limit) the oldest checkpoints beyond ``keep``."""
    if latest is not None:
        with open(os.path.join(tmp, "latest"), "w") as f:
            f.write(latest)
    files = {}
    for dirpath, _, names in os.walk(tmp):
        for name in names:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, tmp)] = os.path.getsize(path)
    write_json(os.path.join(tmp, MANIFEST), {"format": 1, **fields, "files": files})
    fsync_tree(tmp)
    _swap_into_place(tmp, final)
    if keep is not None:
        _prune(os.path.dirname(final), keep)


class WeightsSavedByDeepSpeed:
    """What a save-state hook finds in ``weights`` under DeepSpeed: one per model, like elsewhere.

    accelerate passes an empty ``weights`` list to hooks under DeepSpeed (the engine's
    ``save_checkpoint`` already wrote the weights), and hooks written for the other paths
    (diffusers' examples) ``weights.pop()`` once per model: IndexError. Popping is harmless, so
    it works; reading one as a state dict cannot (there is none) and says so.
    """

    def _refuse(self, *args, **kwargs):
        raise CheckpointError(
            "under DeepSpeed accelerate passes no state dicts to save_state hooks: DeepSpeed's "
            "save_checkpoint has written the weights. In the hook, save the model with "
            "model.save_pretrained(...) or call accelerator.get_state_dict(model) on every rank."
        )

    __getitem__ = __iter__ = __len__ = keys = items = values = _refuse

    def __repr__(self):
        return "<weights saved by DeepSpeed's save_checkpoint>"


def _with_one_weight_per_model(hook):
    def hook_with_weights(models, weights, output_dir):
        prepared = models_as_prepared(models)
        if not weights and prepared:
            weights = [WeightsSavedByDeepSpeed() for _ in prepared]  # a copy: accelerate's list stays empty
        return hook(prepared, weights, output_dir)

    return hook_with_weights


def models_as_prepared(models: list) -> list:
    """The models a save/load hook sees: each DeepSpeed engine's module, as hooks get the model itself
    under DDP (accelerate keeps the model, not its DDP wrapper, in ``_models``). Hooks written for
    that path (diffusers' Sana/SDXL DreamBooth LoRA scripts) test ``isinstance(model, type(unet))``
    and raise "unexpected save model: DeepSpeedEngine" on the engine. An engine over several models
    prepared together (the deepspeed plugin's container) gives each model, in the order prepare got them.
    A new list: accelerate's ``_models`` keeps the engines."""
    from deepspeed import DeepSpeedEngine

    out = []
    for m in models:
        module = m.module if isinstance(m, DeepSpeedEngine) else m
        out.extend(models_prepared_together(module) or (module,))
    return out


def load_hooks_see_models(accelerator):
    """For the duration of ``load_state`` under DeepSpeed, load hooks get the prepared models.

    accelerate hands load hooks an empty ``models`` list under DeepSpeed (the engines loaded
    themselves); hooks written for the other paths pop the model from it and load the LoRA or
    weights the save hook wrote (diffusers' Sana/SDXL DreamBooth LoRA scripts then call
    ``set_peft_model_state_dict(None, ...)``: AttributeError, on GPUs too). They get each engine's
    module in a list of their own (accelerate's stays empty, so it loads nothing twice); what
    they load is what the engine has just restored. Under ZeRO-3 a ``load_state_dict`` they make
    into the partitioned model gathers one submodule's parameters at a time, as transformers'
    ZeRO-3 loader does (every rank runs load_state, so every rank joins each gather).

    A hook that fails given the models runs again as stock accelerate runs it under DeepSpeed, on
    accelerate's empty list, with one warning naming it and the error: the engines restored the models
    already, and what such a hook loads comes from the same checkpoint. v0.40.0's
    t2i_adapter/train_t2i_adapter_sdxl.py reads ``args.control_type`` in its load hook (line 917), an
    argument it never defines (AttributeError on GPUs under DDP too); stock DeepSpeed resumes it. A hook
    that fails on the empty list as well raises its first error.
    A LoRA they load again into an adapter the model has goes into its existing parameters
    (``adapter_reload.py``).
    """
    import contextlib

    hooks = accelerator._load_model_state_pre_hook
    saved = dict(hooks)

    def wrap(hook):
        def hook_with_models(models, input_dir):
            if models:
                return hook(models, input_dir)
            prepared = models_as_prepared(accelerator._models)
            try:
                with contextlib.ExitStack() as stack:
                    stack.enter_context(adapter_reload.resuming(prepared))
                    for model in prepared:
                        stack.enter_context(_zero3_loadable(model))
                    return hook(prepared, input_dir)
            except Exception as given_models:  # noqa: BLE001 - the hook may expect the models it was given: tried next
                try:
                    result = hook(models, input_dir)
                except Exception:  # noqa: BLE001 - the first error is the one that says what is wrong
                    raise given_models from None
                code = getattr(hook, "__code__", None)
                where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
                log.warning(
                    "accel-npu: the load_state pre-hook %s%s failed given the prepared models (%s: %s); it "
                    "ran as accelerate runs it under DeepSpeed, on an empty list: the engines restored the "
                    "models from %s.",
                    getattr(hook, "__qualname__", hook),
                    where,
                    type(given_models).__name__,
                    given_models,
                    input_dir,
                )
                return result

        return hook_with_models

    @contextlib.contextmanager
    def swapped():
        for handle, hook in saved.items():
            hooks[handle] = wrap(hook)
        try:
            yield
        finally:
            for handle, hook in saved.items():
                if handle in hooks:
                    hooks[handle] = hook

    return swapped()


def _zero3_loadable(model):
    """While active, ``_load_from_state_dict`` of each submodule of ``model`` holding ZeRO-3 partitions
    gathers the direct parameters the state dict names (modifier rank 0: every rank loads the same
    file), loads, and re-partitions on exit."""
    import contextlib

    import torch

    owners = [m for m in model.modules() if any(hasattr(p, "ds_id") for p in m._parameters.values() if p is not None)]
    if not owners:
        return contextlib.nullcontext()

    def gathering_load(module):
        def _load_from_state_dict(state_dict, prefix, *args, **kwargs):
            import deepspeed

            wanted = [
                p
                for n, p in module._parameters.items()
                if p is not None and hasattr(p, "ds_id") and prefix + n in state_dict
            ]
            if not wanted:
                return type(module)._load_from_state_dict(module, state_dict, prefix, *args, **kwargs)
            with deepspeed.zero.GatheredParameters(wanted, modifier_rank=0), torch.no_grad():
                return type(module)._load_from_state_dict(module, state_dict, prefix, *args, **kwargs)

        return _load_from_state_dict

    @contextlib.contextmanager
    def active():
        for m in owners:
            object.__setattr__(m, "_load_from_state_dict", gathering_load(m))
        try:
            yield
        finally:
            for m in owners:
                m.__dict__.pop("_load_from_state_dict", None)

    return active()


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
    fsync_path(os.path.dirname(final))
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


def resolve_load_dir(input_dir: str | None, accelerator, deepspeed: bool = True) -> str | None:
    """The directory ``load_state`` should read, checked for completeness: against its manifest, or (``deepspeed``,
    no manifest) for what a DeepSpeed checkpoint of model 0 needs."""
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            return None
        base = os.path.join(accelerator.project_dir, "checkpoints")
        folders = sorted((f for f in os.listdir(base) if not is_our_temp(f) and _digits(f) is not None), key=_digits)
        if not folders:
            return None
        input_dir = os.path.join(base, folders[-1])
    input_dir = os.path.expanduser(os.fspath(input_dir))
    if not os.path.isdir(input_dir) and os.path.isdir(old_dir(input_dir)):
        log.warning(
            "accel-npu: %s is missing but the previous checkpoint set aside by an interrupted save is "
            "there; loading %s",
            input_dir,
            old_dir(input_dir),
        )
        input_dir = old_dir(input_dir)
    if os.path.isdir(input_dir):
        missing = missing_files(input_dir)
        if missing is None:
            missing = _missing_deepspeed_files(input_dir) if deepspeed else []
        if missing:
            raise CheckpointError(
                f"checkpoint {input_dir} is incomplete; missing: {', '.join(missing)}. "
                f"{_newest_complete_beside(input_dir)}"
            )
    return input_dir


def partition_count_problem(directory: str | None, accelerator) -> str | None:
    """The fix when a ZeRO checkpoint is resumed by another number of processes; None when it loads.

    ZeRO-1/2/3 save one optimizer partition per process of the group they partition over: every process, with
    or without sequence parallelism (DeepSpeed records it as ``dp_world_size``, its sequence-data-parallel world
    size). A load by another number of processes fails deep inside DeepSpeed (engine.py ``_load_zero_checkpoint``:
    "Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
    supported"), after the model weights were loaded, without the fix; the manifest's count answers first."""
    if directory is None or not os.path.isfile(os.path.join(directory, MANIFEST)):
        return None
    with open(os.path.join(directory, MANIFEST)) as f:
        manifest = json.load(f)
    written, stage = manifest.get("world_size"), manifest.get("zero_stage")
    if not written or not stage or written == accelerator.num_processes:
        return None
    try:
        universal = bool(accelerator.deepspeed_config.get("checkpoint", {}).get("load_universal"))
    except Exception:  # noqa: BLE001 - a config accelerate cannot read: DeepSpeed decides, as stock
        universal = False
    if universal:
        return None  # DeepSpeed's universal checkpoint re-partitions
    return (
        f"checkpoint {directory} was written by {written} processes under DeepSpeed ZeRO stage {stage}, which "
        f"saves the optimizer state in one partition per process; this run has {accelerator.num_processes}, and "
        f"DeepSpeed cannot re-partition it. Resume with {written} processes (--num_processes {written}); the "
        f"sequence-parallel size may differ (any parallelism_config_sp_size dividing {written}: ZeRO partitions "
        f"over every process whatever it is)."
    )


def _missing_deepspeed_files(directory: str) -> list[str]:
    """For a checkpoint without our manifest (stock accelerate wrote it, or left it): what a
    DeepSpeed checkpoint of model 0 needs and lacks. An empty directory is what a rank-0-only
    ``save_state`` leaves behind (accelerate creates it before DeepSpeed's save hangs)."""
    tag = _tag(0)
    tag_dir = os.path.join(directory, tag)
    if not os.path.isdir(tag_dir):
        return [
            f"{tag}/ (DeepSpeed's model and optimizer shards: the save that made this directory "
            f"did not finish, e.g. save_state called on one rank only)"
        ]
    if not any(name.endswith("model_states.pt") for name in os.listdir(tag_dir)):
        return [f"{tag}/*model_states.pt"]
    return []


def _is_complete(directory: str) -> bool:
    missing = missing_files(directory)
    return not (missing if missing is not None else _missing_deepspeed_files(directory))


def _newest_complete_beside(directory: str) -> str:
    """A sentence naming the newest complete checkpoint beside ``directory`` (same name stem, by
    the number in the name), or saying there is none."""
    parent, name = os.path.split(os.path.abspath(directory))
    stem = name.rstrip("0123456789")
    found = []
    for other in os.listdir(parent):
        path = os.path.join(parent, other)
        if (
            other != name
            and other.startswith(stem)
            and not is_our_temp(other)
            and _digits(other) is not None
            and os.path.isdir(path)
            and _is_complete(path)
        ):
            found.append((_digits(other), path))
    if not found:
        return (
            f"There is no complete checkpoint beside it in {parent}: remove {directory} to start afresh "
            f"(`--resume_from_checkpoint latest` picks it by name)."
        )
    newest = max(found)[1]
    return (
        f"The newest complete checkpoint is {newest}: load that one, or remove {directory} "
        f"(`--resume_from_checkpoint latest` picks the highest number)."
    )

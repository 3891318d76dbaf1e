"""Asynchronous ``save_state`` under FSDP2 (``ACCEL_NPU_ASYNC_CHECKPOINT``, on in launched ranks by default), on
``background.py``'s writer, publication and wait.

Stock FSDP2 ``save_state`` with ``SHARDED_STATE_DICT`` (accelerate/utils/fsdp_utils.py ``save_fsdp_model`` /
``save_fsdp_optimizer``) writes each model's and optimizer's shards with torch.distributed.checkpoint (DCP) into
``pytorch_model_fsdp_<i>`` / ``optimizer_<i>`` of the output directory itself. Asynchronously:

- every rank takes the same state dicts stock takes (``get_model_state_dict`` / ``get_optimizer_state_dict``
  with accelerate's options) and makes their host copy (``background.snapshot``: each DTensor's local shard
  copied, its placement kept, as DCP's stager keeps it). The shards and optimizer states, which only the
  optimizer step changes, are copied by a thread after save_state returns and the next optimizer step waits for
  that (a torch optimizer step pre-hook), as ``dcp.async_save`` with asynchronous staging asks its caller to
  wait for ``staging_completion``; buffers, which a forward may change in place, are copied at once (DCP's own
  background staging would copy them while the next forward runs);
- the writer thread ``dcp.save``-s each copy into the hidden sibling directory over a gloo process
  group of its own: DCP's save is a collective (plans gathered by the coordinator, ``.metadata`` written after
  every rank's data), and ``dcp.async_save`` runs it in a thread for the same reason (its docstring asks for a
  CPU backend); the training's collectives stay on the default group, in the main thread. ``FileSystemWriter``
  fsyncs each file (``sync_files``);
- accelerate writes the rest (RNG states, schedulers, samplers, custom objects, the save hooks' files) as stock
  does, with the models and optimizers out of its sight for the call (the hooks still get the models);
- rank 0 publishes once every rank's writer is done (manifest, fsync, the atomic rename), as under DeepSpeed.

Other FSDP configurations (FSDP1, ``FULL_STATE_DICT``, one process) are saved synchronously, saying so once.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil

from accel_npu._torch.memory import available_memory
from accel_npu._torch.once import FirstTime
from accel_npu.plugins.checkpoints import background, direct_io
from accel_npu.plugins.checkpoints import state as checkpointing
from accel_npu.plugins.checkpoints.files import partial_dir

log = logging.getLogger("accel_npu")

_said = FirstTime()
_group = None  # the writer thread's process group (gloo), made by every rank at its first asynchronous save


def why_synchronous(accelerator) -> str | None:
    """Why this FSDP save_state cannot be written in the background; None when it can."""
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    plugin = accelerator.state.fsdp_plugin
    if accelerator.num_processes < 2:
        return "one process"
    if getattr(plugin, "fsdp_version", 1) != 2:
        return "FSDP1 (its state dicts are taken inside FSDP.state_dict_type; FSDP2 only)"
    if plugin.state_dict_type != StateDictType.SHARDED_STATE_DICT:
        return f"state_dict_type {plugin.state_dict_type.name} (SHARDED_STATE_DICT only: DCP's shards)"
    return None


def say_synchronous(why: str) -> None:
    """Once per reason: a warning where ACCEL_NPU_ASYNC_CHECKPOINT=1 asked for the background, else (the default)
    a note."""
    if _said(why):
        log.log(
            logging.WARNING if background.asked_for() else logging.INFO,
            "accel-npu: save_state under FSDP is written synchronously here, not in the background: %s.",
            why,
        )


def _writer_group():
    """A gloo group over every rank for the writer's DCP saves (every rank calls this at the same save_state)."""
    global _group
    if _group is None:
        import torch.distributed as dist

        _group = dist.new_group(backend="gloo")
    return _group


def _dcp_save(state_dict, directory: str, group) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    os.makedirs(directory, exist_ok=True)
    # the shards' files past the page cache where they are large enough
    writer = direct_io.dcp_writer(directory, background.snapshot_bytes(state_dict))
    dcp.save(state_dict=state_dict, storage_writer=writer, planner=DefaultSavePlanner(), process_group=group)


def _dcp_save_copy(copied, directory: str, group) -> None:
    _dcp_save(copied.state_dict, directory, group)
    copied.release()


def _state_dicts(accelerator, models: list, optimizers: list) -> list[tuple[str, dict]]:
    """(directory name, DCP state dict) as stock save_state writes them: the models', then the optimizers'."""
    from accelerate.utils import fsdp_utils
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    options = fsdp_utils._prepare_sd_options(accelerator.state.fsdp_plugin)
    unwrap = getattr(fsdp_utils, "_unwrap_optimizer", lambda optimizer: optimizer)
    out = []
    for i, model in enumerate(models):
        out.append((f"{FSDP_MODEL_NAME}_{i}", {"model": fsdp_utils._get_model_state_dict(model, sd_options=options)}))
    for i, optimizer in enumerate(optimizers):
        state = get_optimizer_state_dict(models[i], unwrap(optimizer), options=options)
        out.append((f"{OPTIMIZER_NAME}_{i}", {"optimizer": state}))
    return out


class _models_saved_here:
    """While active, accelerate's save_state sees no models or optimizers (their shards are written here);
    its save hooks still get the models list, the same object stock passes them."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.models, self.optimizers = accelerator._models, accelerator._optimizers
        self.hooks = accelerator._save_model_state_pre_hook
        self.saved_hooks = dict(self.hooks)

    def __enter__(self):
        models = self.models

        def given_models(hook):
            return lambda _models, weights, output_dir: hook(models, weights, output_dir)

        for handle, hook in self.saved_hooks.items():
            self.hooks[handle] = given_models(hook)
        self.accelerator._models, self.accelerator._optimizers = [], []
        return self

    def __exit__(self, *exc):
        self.accelerator._models, self.accelerator._optimizers = self.models, self.optimizers
        for handle, hook in self.saved_hooks.items():
            if handle in self.hooks:
                self.hooks[handle] = hook
        return False


def async_save_state(wrapped, accelerator, output_dir, safe_serialization=True, **kwargs):
    """``Accelerator.save_state`` under FSDP2 with its shards written in the background. Every rank, after the
    rendezvous; the previous asynchronous save has been waited for."""
    pc = accelerator.project_configuration
    automatic = pc.automatic_checkpoint_naming
    # old checkpoints are pruned once the new one is published, never before
    final = (
        checkpointing._automatic_target(accelerator, prune=False)
        if automatic
        else os.path.abspath(os.fspath(output_dir))
    )
    tmp = partial_dir(final)
    if accelerator.is_main_process:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by an interrupted save: never a checkpoint
        os.makedirs(os.path.dirname(final), exist_ok=True)
    accelerator.wait_for_everyone()
    group = _writer_group()
    pending = background.begin(tmp, final)
    pc.automatic_checkpoint_naming = False
    try:
        parts = _state_dicts(accelerator, accelerator._models, accelerator._optimizers)
        nbytes = sum(background.snapshot_bytes(sd) for _, sd in parts)
        free = available_memory()
        room = free is None or nbytes <= (free + background.pooled_bytes()) * background._HOST_HEADROOM
        if not room and _said("no room"):
            log.warning(
                "accel-npu: asynchronous save_state: the FSDP shards need a %s host copy but %s are available; "
                "they are written synchronously.",
                background._size(nbytes),
                background._size(free),
            )
        later = frozenset().union(
            *(background.changed_only_by_step(m, o) for m, o in zip(accelerator._models, accelerator._optimizers))
        )
        for name, sd in parts:
            directory = os.path.join(tmp, name)
            if room:
                # the shards and states are copied by a thread of the writer's after save_state returns; the next
                # optimizer step waits for that (background.wait_before_optimizer_steps)
                copied = background.snapshot(sd, later)
                pending.copies.append(copied)
                pending.writes.append((functools.partial(_dcp_save_copy, copied, directory, group), directory, True))
            else:
                _dcp_save(sd, directory, group)
        if room:
            pending.snapshot_bytes, pending.files = nbytes, len(parts)
            background.wait_before_optimizer_steps()
        del parts  # the staged writes hold the copies
        with _models_saved_here(accelerator):
            wrapped(tmp, safe_serialization=safe_serialization, **kwargs)
    except BaseException:
        background.discard()
        raise
    finally:
        pc.automatic_checkpoint_naming = automatic
    # rank 0's writer publishes once every rank has said its files are durable: no barrier here
    publish = None
    if accelerator.is_main_process:
        keep = pc.total_limit if automatic else None
        fields = {"fsdp_version": 2, "world_size": accelerator.num_processes}
        publish = functools.partial(checkpointing.publish_checkpoint, tmp, final, fields, keep)
    background.submit(pending, publish)
    return final

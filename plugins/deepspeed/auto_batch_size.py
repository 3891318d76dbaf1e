"""``"train_micro_batch_size_per_gpu": "auto"`` where accelerate cannot read it.

accelerate 1.15 (``Accelerator._prepare_deepspeed``) fills the "auto" from ``DataLoader.batch_size``
of the loaders passed to the same ``prepare`` call, and stops otherwise. Unchanged scripts meet that:

- a DataLoader built with ``batch_sampler=`` (bucketing samplers: diffusers'
  train_dreambooth_lora_{qwen_image,flux,sana,...}.py) has ``batch_size=None`` ("At least one of the
  dataloaders ... has `None` as batch size"). The sampler knows its batch size; it is read there, as
  accelerate itself does when it shards such a loader (``data_loader.batch_sampler.batch_size`` in
  accelerate/data_loader.py).
- no DataLoader in the call: diffusers' consistency_distillation/train_lcm_distill_*_wds.py batch inside
  a webdataset pipeline (``wds.WebLoader(..., batch_size=None)``) and prepare only ``unet, optimizer,
  lr_scheduler`` ("requires you to pass at least one of training or evaluation dataloaders"); likewise a
  loader with no batch size anywhere (an IterableDataset yielding whole batches), or a loader prepared in
  a call of its own before the model.

Under accelerate the micro batch size takes no part in the math: DeepSpeed scales the loss by the
accumulation steps and averages gradients over the data-parallel ranks (deepspeed/runtime/engine.py), and
accelerate averages nothing by batch size. DeepSpeed needs an integer at ``deepspeed.initialize`` for its
bookkeeping only — ``train_batch_size()``, the throughput timer, ``global_samples`` and the monitor, and the
``ds_config`` its checkpoints record. So prepare goes on with accelerate's own placeholder (1, as
``DeepSpeedPlugin.set_deepspeed_weakref`` uses for an "auto" micro batch), and the engine's first training
forward (grad enabled) sets the real value from the batch dimension of its first tensor input, through
DeepSpeed's own ``set_train_micro_batch_size``, in every place the value was cached. A call without a model
initializes no engine (accelerate fills the DeepSpeed config only then): the placeholder serves that call
alone and "auto" is put back.

Left as one error naming the key and the DeepSpeed file that says "auto": a config whose ``data_efficiency``
section is enabled (random-LTD reads the micro batch size inside ``deepspeed.initialize``).
"""

from __future__ import annotations

import logging

from accel_npu._torch.markers import DS_CONFIG_SOURCE
from accel_npu.errors import ConfigError

log = logging.getLogger("accel_npu")

KEY = "train_micro_batch_size_per_gpu"
TRAIN_BATCH = "train_batch_size"
#: accelerate's own placeholder for an "auto" micro batch size (accelerate/utils/dataclasses.py
#: DeepSpeedPlugin.set_deepspeed_weakref), kept until the engine's first training forward
PROVISIONAL = 1
#: DeepSpeed config sections that read the micro batch size inside deepspeed.initialize
#: (random_ltd_config in deepspeed/runtime/engine.py DeepSpeedEngine.__init__)
_READ_AT_INITIALIZE = ("data_efficiency",)


class AutoBatchSizeError(ConfigError, ValueError):
    """ "auto" micro batch size with nothing to take it from (a ValueError, as accelerate's own)."""


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _describe(obj) -> str:
    sampler = getattr(obj, "batch_sampler", None)
    dataset = getattr(obj, "dataset", None)
    parts = [f"{type(obj).__name__}(batch_size=None"]
    if dataset is not None:
        parts.append(f", dataset={type(dataset).__name__}")
    parts.append(f", batch_sampler={type(sampler).__name__ if sampler is not None else None})")
    return "".join(parts)


def micro_batch_sizes(objects) -> tuple[list[int], list[object]]:
    """Per-object batch sizes as accelerate reads them, a batch_sampler's where batch_size is None;
    and the objects whose batch size cannot be found."""
    sizes, unresolved = [], []
    for obj in objects:
        if not hasattr(obj, "batch_size"):
            continue
        size = obj.batch_size
        if size is None:
            size = getattr(getattr(obj, "batch_sampler", None), "batch_size", None)
        if _positive_int(size):
            sizes.append(size)
        else:
            unresolved.append(obj)
    return sizes, unresolved


def _error(plugin, what: str) -> AutoBatchSizeError:
    source = getattr(plugin, DS_CONFIG_SOURCE, None) or "the DeepSpeed config"
    return AutoBatchSizeError(
        f'accel-npu: "{KEY}": "auto" in {source} cannot be resolved: {what}. Set an integer '
        f'"{KEY}" (the per-process batch size) in {source}.'
    )


def _read_at_initialize(config: dict) -> str | None:
    for section in _READ_AT_INITIALIZE:
        value = config.get(section)
        if isinstance(value, dict) and value.get("enabled"):
            return section
    return None


#: what prepare does after the call: nothing; correct the placeholder at the engine's first training forward;
#: put "auto" back (no model in the call: accelerate fills the DeepSpeed config only when it initializes one)
RESOLVED, AT_FIRST_FORWARD, THIS_CALL_ONLY = "resolved", "at first forward", "this call only"


def fill_auto_micro_batch_size(accelerator, args) -> str:
    """Before accelerate reads it: resolve "auto" from batch samplers, or set accelerate's placeholder (for the
    engine's first forward to correct, or for this call only), or raise the one error."""
    import torch

    plugin = accelerator.deepspeed_plugin
    if plugin is None or not plugin.is_auto(KEY):
        return RESOLVED
    sizes, unresolved = micro_batch_sizes(args)
    if any(isinstance(obj, torch.utils.data.DataLoader) for obj in args) and not unresolved:
        if all(_positive_int(getattr(obj, "batch_size", None)) for obj in args if hasattr(obj, "batch_size")):
            return RESOLVED  # accelerate's own path: every loader has its batch_size
        if accelerator.split_batches:
            sizes = [size // accelerator.num_processes for size in sizes]
        value = min(sizes) if plugin.is_train_batch_min else max(sizes)
        plugin.deepspeed_config[KEY] = value
        log.info('accel-npu: "%s": "auto" -> %d, the DataLoader\'s batch_sampler batch size', KEY, value)
        return RESOLVED
    # nothing in this call says the batch size: no DataLoader, or one without a batch size anywhere
    if not any(isinstance(obj, torch.nn.Module) for obj in args):
        plugin.deepspeed_config[KEY] = PROVISIONAL
        return THIS_CALL_ONLY
    section = _read_at_initialize(plugin.deepspeed_config)
    if section is not None:
        what = (
            f"the DataLoader passed to accelerator.prepare(), {_describe(unresolved[0])}, has no batch size "
            "(nor does its batch_sampler)"
            if unresolved
            else "accelerator.prepare() was given no DataLoader to take the batch size from"
        )
        raise _error(plugin, f'{what}, and the config\'s "{section}" reads it inside deepspeed.initialize')
    total = plugin.deepspeed_config.get(TRAIN_BATCH)
    if _positive_int(total):  # an integer train_batch_size: DeepSpeed's own derivation (runtime/config.py)
        gas = plugin.deepspeed_config.get("gradient_accumulation_steps")
        gas = gas if _positive_int(gas) else accelerator.gradient_accumulation_steps
        value = max(1, total // (gas * accelerator.num_processes))
        plugin.deepspeed_config[KEY] = value
        log.info('accel-npu: "%s": "auto" -> %d, from "%s": %d', KEY, value, TRAIN_BATCH, total)
        return RESOLVED
    plugin.deepspeed_config[KEY] = PROVISIONAL
    return AT_FIRST_FORWARD


def _first_batch_dimension(value):
    """dim 0 of the first tensor of one or more dimensions in ``value`` (tuples, lists, dicts searched)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() >= 1 else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = _first_batch_dimension(item)
        if found is not None:
            return found
    return None


def set_engine_micro_batch_size(engine, value: int, configs) -> None:
    """The micro batch size everywhere DeepSpeed and accelerate cached it after initialize: the engine's
    config (``set_train_micro_batch_size``: micro and train batch size), its throughput timer (built from
    ``train_batch_size()``, deepspeed/runtime/engine.py), and the config dicts (the engine's ``config``,
    which its checkpoints save as ``ds_config``; accelerate's plugin and accelerator copies)."""
    engine.set_train_micro_batch_size(value)
    train_batch = engine.train_batch_size()
    timer = getattr(engine, "tput_timer", None)
    if timer is not None and hasattr(timer, "batch_size"):
        timer.batch_size = train_batch
    seen: set[int] = set()
    for config in (
        getattr(engine, "config", None),
        getattr(getattr(engine, "_config", None), "_param_dict", None),
        *configs,
    ):
        if not isinstance(config, dict) or id(config) in seen:
            continue
        seen.add(id(config))
        config[KEY] = value
        if TRAIN_BATCH in config:
            config[TRAIN_BATCH] = train_batch


def resolve_at_first_forward(engine, configs) -> None:
    """A forward pre-hook on ``engine`` that sets its micro batch size from its first training forward
    (grad enabled: an evaluation forward first does not count), then removes itself."""
    import torch

    handle = None

    def hook(module, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        handle.remove()
        value = _first_batch_dimension((args, kwargs))
        if not _positive_int(value):
            log.info(
                'accel-npu: "%s": "auto" stays %d: the first training forward of the DeepSpeed engine was '
                "given no tensor to read a batch dimension from",
                KEY,
                PROVISIONAL,
            )
            return None
        set_engine_micro_batch_size(engine, value, configs)
        log.info(
            'accel-npu: "%s": "auto" -> %d, the batch dimension of the DeepSpeed engine\'s first training '
            "forward (no DataLoader batch size in accelerator.prepare(); train_batch_size %d)",
            KEY,
            value,
            engine.train_batch_size(),
        )
        return None

    handle = engine.register_forward_pre_hook(hook, with_kwargs=True)


def prepare_with_auto_micro_batch_size(wrapped, instance, args, kwargs):
    # Accelerator.prepare, not _prepare_deepspeed (frozen_towers wraps that): the same objects,
    # just before accelerate hands them to _prepare_deepspeed.
    from accelerate.utils import DistributedType

    if instance.distributed_type != DistributedType.DEEPSPEED:
        return wrapped(*args, **kwargs)
    plugin = instance.deepspeed_plugin
    before = {k: plugin.deepspeed_config.get(k) for k in (KEY, TRAIN_BATCH)} if plugin is not None else {}
    after = fill_auto_micro_batch_size(instance, args)

    def restore():  # "auto" again, for a later prepare to resolve afresh
        for key, value in before.items():
            if value is not None:
                plugin.deepspeed_config[key] = value

    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        if after != RESOLVED:
            restore()
        raise
    if after == THIS_CALL_ONLY:
        restore()
    elif after == AT_FIRST_FORWARD:
        from deepspeed.runtime.engine import DeepSpeedEngine

        configs = [plugin.deepspeed_config, getattr(instance, "deepspeed_config", None)]
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, DeepSpeedEngine):
                resolve_at_first_forward(obj, configs)
    return result

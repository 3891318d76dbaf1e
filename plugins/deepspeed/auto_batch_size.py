"""``"train_micro_batch_size_per_gpu": "auto"`` taken from a DataLoader's ``batch_sampler``.

accelerate 1.15 (``Accelerator._prepare_deepspeed``) fills the "auto" from ``DataLoader.batch_size``
alone. A DataLoader built with ``batch_sampler=`` (bucketing samplers: diffusers'
train_dreambooth_lora_{qwen_image,flux,sana,...}.py) has ``batch_size=None``, and prepare stops
with "At least one of the dataloaders ... has `None` as batch size". The sampler knows its batch
size; this reads it there, as accelerate itself does when it shards such a loader
(``data_loader.batch_sampler.batch_size`` in accelerate/data_loader.py). Where no batch size can
be found — an IterableDataset yielding whole batches, a sampler without ``batch_size``, no
DataLoader in the call — one error names the key and the DeepSpeed file that says "auto".
"""
from __future__ import annotations

import logging

from accel_npu._torch.markers import DS_CONFIG_SOURCE
from accel_npu.errors import ConfigError

log = logging.getLogger("accel_npu")

KEY = "train_micro_batch_size_per_gpu"


class AutoBatchSizeError(ConfigError, ValueError):
    """"auto" micro batch size with nothing to take it from (a ValueError, as accelerate's own)."""


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
        f'"{KEY}" (the per-process batch size) in {source}.')


def fill_auto_micro_batch_size(accelerator, args) -> None:
    """Before accelerate reads it: resolve "auto" from batch samplers, or raise the one error."""
    import torch

    plugin = accelerator.deepspeed_plugin
    if plugin is None or not plugin.is_auto(KEY):
        return
    if not any(isinstance(obj, torch.utils.data.DataLoader) for obj in args):
        raise _error(plugin, "accelerator.prepare() was given no DataLoader to take the batch size from")
    sizes, unresolved = micro_batch_sizes(args)
    if unresolved:
        raise _error(plugin, f"the DataLoader passed to accelerator.prepare(), {_describe(unresolved[0])}, has no "
                             "batch size (nor does its batch_sampler)")
    if all(_positive_int(getattr(obj, "batch_size", None)) for obj in args if hasattr(obj, "batch_size")):
        return  # accelerate's own path: every loader has its batch_size
    if accelerator.split_batches:
        sizes = [size // accelerator.num_processes for size in sizes]
    value = min(sizes) if plugin.is_train_batch_min else max(sizes)
    plugin.deepspeed_config[KEY] = value
    log.info('accel-npu: "%s": "auto" -> %d, the DataLoader\'s batch_sampler batch size', KEY, value)


def prepare_with_auto_micro_batch_size(wrapped, instance, args, kwargs):
    # Accelerator.prepare, not _prepare_deepspeed (frozen_towers wraps that): the same objects,
    # just before accelerate hands them to _prepare_deepspeed.
    from accelerate.utils import DistributedType

    if instance.distributed_type == DistributedType.DEEPSPEED:
        fill_auto_micro_batch_size(instance, args)
    return wrapped(*args, **kwargs)

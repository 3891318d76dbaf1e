"""``save_model`` under ZeRO-3 without the whole model on rank 0: one output shard at a time."""

from __future__ import annotations

import os

from accel_npu._torch.markers import tower_state_dict
from accel_npu._torch.packing import pack_by_budget
from accel_npu._torch.safetensors_io import SafetensorsStream
from accel_npu._torch.zero import whole_shape
from accel_npu.plugins.checkpoints.files import plan_shards, write_json


def streaming_save_model(accelerator, model, save_directory, max_shard_size="10GB", safe_serialization=True):
    """Write the model's 16-bit weights like ``save_model`` does, gathering one shard at a time.

    Every rank calls it; each rank holds at most one output shard's parameters gathered at once,
    and only the main process keeps them (on CPU) and writes.
    """
    import deepspeed
    import torch
    from accelerate.utils import convert_file_size_to_int

    limit = convert_file_size_to_int(max_shard_size)
    engine = model
    module = accelerator.unwrap_model(model)
    entries = module.state_dict(keep_vars=True)
    for key, value in tower_state_dict(module).items():
        entries.setdefault(key, value)
    plan = plan_shards(entries, limit, lambda value: int(torch.Size(whole_shape(value)).numel()) * value.element_size())
    n = len(plan)
    main = accelerator.is_main_process
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    prepared = []

    def prepare():
        # only once the first gather succeeded: a rank-0-only call that fails (the others are busy)
        # must leave nothing on disk, not even the directory
        if prepared:
            return
        prepared.append(True)
        os.makedirs(save_directory, exist_ok=True)
        stem, ext = weights.rsplit(".", 1)
        for name in os.listdir(save_directory):
            if (
                name == weights
                or name == weights + ".index.json"
                or (name.startswith(stem + "-") and name.endswith("." + ext))
            ):
                os.remove(os.path.join(save_directory, name))

    weight_map = {}
    total = 0

    def nbytes(key):
        v = entries[key]
        return int(torch.Size(whole_shape(v)).numel()) * v.element_size()

    for i, keys in enumerate(plan):
        fname = weights if n == 1 else weights.replace(".", f"-{i + 1:05d}-of-{n:05d}.", 1)
        path = os.path.join(save_directory, fname)
        stream = None
        bin_shard = {}
        # gather a quarter of a shard at a time: the gather's own buffers stay small too
        groups = pack_by_budget(keys, nbytes, max(limit // 4, 1))
        for group in groups:
            params = [entries[k] for k in group if hasattr(entries[k], "ds_id")]
            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                if main:
                    prepare()
                    if stream is None and safe_serialization:
                        stream = SafetensorsStream(path, [(k, entries[k].dtype, whole_shape(entries[k])) for k in keys])
                    for k in group:
                        if stream is not None:
                            stream.write(k, entries[k])
                        else:
                            bin_shard[k] = entries[k].detach().cpu().clone()
        if main:
            prepare()
            if stream is None and safe_serialization:  # a shard with no tensors
                stream = SafetensorsStream(path, [])
            if stream is not None:
                stream.close()
            else:
                torch.save(bin_shard, path)
            for k in keys:
                weight_map[k] = fname
                total += nbytes(k)
        del bin_shard
    if main and n > 1:
        write_json(
            os.path.join(save_directory, weights + ".index.json"),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    # no barrier here (stock save_model has none): called on rank 0 alone, it would pair with the
    # other ranks' next wait_for_everyone
    del engine

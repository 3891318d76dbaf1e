"""``accel-npu consolidate CKPT_DIR OUT_DIR``: a sharded ZeRO-2/3 checkpoint (e.g. the directory
``accelerator.save_state`` wrote) -> one diffusers-style directory per trained component
(``OUT_DIR/transformer/config.json`` + safetensors shards + index), loadable with
``from_pretrained``. Built on ``deepspeed.utils.zero_to_fp32``; streams one shard at a time.

A component trained with a peft LoRA adapter (``add_adapter``: ``base_layer``, ``lora_A.default``)
becomes its adapter, as peft and diffusers write it: ``adapter_model.safetensors`` (keys
``transformer.<module>.lora_A.weight``, diffusers' ``lora_adapter_metadata``) + ``adapter_config.json``,
loadable with a pipeline's ``load_lora_weights(OUT_DIR)``. ``--merge-lora`` also writes the base
weights with the adapter merged in (W + alpha/r * B @ A) to ``OUT_DIR/merged``, loadable with
``from_pretrained``."""

from __future__ import annotations

import argparse
import json
import os
import shutil

from accel_npu._torch.safetensors_io import SafetensorsStream
from accel_npu.errors import CheckpointError
from accel_npu.plugins.checkpoints import lora
from accel_npu.plugins.checkpoints.files import (
    COMPONENTS_DIR,
    MANIFEST,
    fsync_tree,
    partial_dir,
    plan_shards,
    write_json,
)
from accel_npu.plugins.checkpoints.state import missing_files

_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


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


def consolidate(
    ckpt_dir: str,
    out_dir: str,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    tag: str | None = None,
    progress: bool = True,
    merge_lora: bool = False,
    lora_prefix: str | None = None,
) -> dict[str, list[str]]:
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
        raise CheckpointError(
            f"cannot consolidate {ckpt_dir}: the checkpoint is incomplete. Missing:\n  - "
            + "\n  - ".join(problems)
            + "\nNothing was written."
        )
    comps = _components(ckpt_dir)
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag, lazy_mode=True)
    groups = _group_keys(list(state.keys()), comps)
    loras = {}
    for name, keys in groups.items():  # checked before anything is written
        comp = comps.get(name, {})
        prefix = comp.get("prefix", f"{name}." if name != "_root" else "")
        if lora.is_lora(keys):
            loras[name] = lora.plan(ckpt_dir, keys, prefix, name, comp, lora_prefix, merge_lora)
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
            if name in loras:
                written[name or "."] = lora.write_adapter(state, loras[name], sub, torch_dtype)
                bar.update(sum(int(torch.Size(state[k].shape).numel()) for k in keys))
                if not merge_lora:
                    continue
                merged = lora.merged_view(state, loras[name])
                sub = os.path.join(sub, "merged")
                os.makedirs(sub, exist_ok=True)
                written[os.path.relpath(sub, tmp)] = _write_component(
                    merged, list(merged), prefix, sub, stem, torch_dtype, limit, None
                )
            else:
                written[name or "."] = _write_component(state, keys, prefix, sub, stem, torch_dtype, limit, bar)
            if comp.get("config"):
                shutil.copyfile(os.path.join(ckpt_dir, comp["config"]), os.path.join(sub, "config.json"))
        bar.close()
        fsync_tree(tmp)
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def _write_component(state, keys, prefix, directory, stem, torch_dtype, limit, bar) -> list[str]:
    import torch

    def out_dtype(v):
        return torch_dtype if v.dtype.is_floating_point else v.dtype

    plan = plan_shards(
        {key: state[key] for key in keys},
        limit,
        lambda v: int(torch.Size(v.shape).numel()) * torch.empty((), dtype=out_dtype(v)).element_size(),
    )
    n = len(plan)
    files, weight_map, total = [], {}, 0

    def out_name(key):
        return key[len(prefix) :] if prefix and key.startswith(prefix) else key

    for i, shard_keys in enumerate(plan):
        fname = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        stream = SafetensorsStream(
            os.path.join(directory, fname),
            [(out_name(k), out_dtype(state[k]), tuple(state[k].shape)) for k in shard_keys],
        )
        for key in shard_keys:
            v = state[key]
            t = v.contiguous()
            t = t.to(out_dtype(t))
            stream.write(out_name(key), t)
            weight_map[out_name(key)] = fname
            del t
            if bar is not None:
                bar.update(int(torch.Size(v.shape).numel()))
        stream.close()
        total += stream.total
        files.append(fname)
    if n > 1:
        write_json(
            os.path.join(directory, f"{stem}.safetensors.index.json"),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
        files.append(f"{stem}.safetensors.index.json")
    return files


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="turn a sharded DeepSpeed checkpoint into from_pretrained directories",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory (holds `latest` and the tag folder)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must not exist or be empty)")
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["bf16", "fp32", "fp16"],
        help="floating-point dtype of the written weights (default: fp32, the master weights)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in `latest`)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA checkpoint: also write the base weights with the adapter merged in, to OUT_DIR/merged",
    )
    p.add_argument(
        "--lora-prefix",
        default=None,
        help="a LoRA checkpoint: the pipeline attribute its adapter keys start with (default: "
        "transformer / unet / text_encoder, from the trained class)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    written = consolidate(
        args.ckpt_dir,
        args.out_dir,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        tag=args.tag,
        progress=not args.no_progress,
        merge_lora=args.merge_lora,
        lora_prefix=args.lora_prefix,
    )
    for name, files in written.items():
        print(f"{args.out_dir}/{'' if name == '.' else name + '/'}: {len(files)} file(s): {', '.join(files)}")
    return 0

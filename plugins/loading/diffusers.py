"""diffusers ``ModelMixin.from_pretrained`` of a local safetensors checkpoint, bounded in memory.

What happens to such a call (anything else — hub ids, ``device_map``, quantization, variants, ... —
goes to the stock implementation unchanged, before a byte is read):

1. **Plan** (:func:`plan_load`): only calls we can take over, with a local checkpoint.
2. **Build on meta** (:func:`read_config`, :func:`build_on_meta`): exactly stock diffusers'
   construction (parameters on meta, buffers and plain tensor attributes real). A depth override
   (``num_layers=2``, or ``ACCEL_NPU_TRUNCATE=Class:2``) builds the shallow model: only its tensors
   are ever read. A load read on this rank starts reading the keys it will most likely keep before
   construction (:func:`start_prefetch`, prefetch.py): the threads read and cast while it builds.
3. **Check before reading** (:func:`check_job`): every needed shard is opened (header only) and
   every key checked; a missing shard, a corrupt file or a key no shard has is one
   :class:`~accel_npu.errors.LoadError` naming the file and the key. Asking for more layers than
   the checkpoint has names the missing keys.
4. **Place** (placement/): into ZeRO-3 partitions read once by rank 0, left for FSDP to fill from
   rank 0, or read here within a load slot (staggered materialization), with diffusers' own
   ``load_model_dict_into_meta`` (same casting and ``keep_in_fp32`` rules).
5. **Finish** (:func:`finish`): nothing may be left on meta; one line for what was not read.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from accel_npu._torch.memory import cyclic_gc_paused, malloc_trim
from accel_npu._torch.safetensors_io import Checkpoint, nbytes_of, open_checkpoint, validate
from accel_npu.environment import truthy
from accel_npu.errors import LoadError
from accel_npu.patching import argument
from accel_npu.plugins.loading import prefetch, truncation
from accel_npu.plugins.loading.frozen import whole_unless_partitioning
from accel_npu.plugins.loading.job import LoadJob
from accel_npu.plugins.loading.placement import fsdp, local, zero3

log = logging.getLogger("accel_npu")

#: kwargs stock diffusers pops, with the value under which we can take the call over
_DIFFUSERS_NEUTRAL = {
    "ignore_mismatched_sizes": (False,),
    "device_map": (None,),
    "max_memory": (None,),
    "offload_folder": (None,),
    "offload_state_dict": (None, False),
    "variant": (None,),
    "use_safetensors": (None, True),
    "quantization_config": (None,),
    "parallel_config": (None,),
    "use_flashpack": (False,),
    "flashpack_kwargs": (None, {}),
    "low_cpu_mem_usage": (None, True),
    "from_flax": (False,),
}
_DIFFUSERS_PASSED = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision")


@dataclass
class _Plan:
    original: Any  # the path object exactly as passed (stock registers it in the config)
    path: str
    folder: str
    ckpt: Checkpoint
    kwargs: dict
    torch_dtype: Any
    output_loading_info: bool
    subfolder: str | None


def plan_load(cls, args, kwargs) -> _Plan | None:
    """How to take this call over, or None when it must go to stock."""
    import torch

    if len(args) > 1:
        return None  # more than from_pretrained(pretrained_model_name_or_path, **kwargs) takes: stock's error
    path = argument(args, kwargs, 0, "pretrained_model_name_or_path")
    kwargs = {k: v for k, v in kwargs.items() if k != "pretrained_model_name_or_path"}
    if not isinstance(path, (str, os.PathLike)):
        return None
    original, path = path, os.fspath(path)
    for name, neutral in _DIFFUSERS_NEUTRAL.items():
        if name in kwargs and not any(kwargs[name] is v or kwargs[name] == v for v in neutral):
            return None
    if truthy(os.environ.get("HF_ENABLE_PARALLEL_LOADING", "")) and kwargs.get("low_cpu_mem_usage") is False:
        return None
    dtype = kwargs.get("dtype", None)
    torch_dtype = dtype if dtype is not None else kwargs.get("torch_dtype", None)
    if torch_dtype is not None and (
        not isinstance(torch_dtype, torch.dtype) or torch_dtype == getattr(torch, "float8_e4m3fn", None)
    ):
        return None
    subfolder = kwargs.get("subfolder")
    folder = os.path.join(path, subfolder or "")
    if not os.path.isdir(folder):
        return None
    try:
        import accelerate  # noqa: F401  (stock needs it for low_cpu_mem_usage too)
    except ImportError:
        return None
    ckpt = open_checkpoint(folder)
    if ckpt is None:
        return None
    return _Plan(
        original, path, folder, ckpt, kwargs, torch_dtype, bool(kwargs.get("output_loading_info", False)), subfolder
    )


class _Fallback(Exception):
    """Raised before anything is read when the call should go to the stock implementation."""


@dataclass
class _Depth:
    key: str | None  # the config key of the block count
    in_checkpoint: Any  # what the checkpoint's config says
    requested: Any  # what this call asks for (None: as the checkpoint)


def read_config(cls, plan: _Plan) -> tuple[dict, dict, _Depth]:
    """(config, the kwargs it does not take, depth) exactly as stock reads them; nothing is built."""
    from diffusers.models import modeling_utils as mu

    kwargs = dict(plan.kwargs)
    for name in (*_DIFFUSERS_NEUTRAL, "output_loading_info", "torch_dtype", "dtype", "subfolder", "disable_mmap"):
        kwargs.pop(name, None)
    passed = {k: kwargs.pop(k) for k in _DIFFUSERS_PASSED if k in kwargs}

    truncate_to = truncation.truncation_for(cls)
    user_agent = {
        "diffusers": getattr(mu, "__version__", ""),
        "file_type": "model",
        "framework": "pytorch",
        "model_class": cls.__name__,
    }
    config, unused_kwargs, _commit = cls.load_config(
        plan.path,
        return_unused_kwargs=True,
        return_commit_hash=True,
        subfolder=plan.subfolder,
        user_agent=user_agent,
        **passed,
        **kwargs,
    )
    config = copy.deepcopy(config)
    if config.get("quantization_config") is not None:
        raise _Fallback()
    dkey = truncation.depth_key(config)
    if truncate_to is not None and dkey and dkey not in unused_kwargs and dkey not in kwargs:
        unused_kwargs[dkey] = truncate_to
    depth = _Depth(dkey, config.get(dkey) if dkey else None, unused_kwargs.get(dkey) if dkey else None)
    return config, unused_kwargs, depth


def build_on_meta(cls, plan: _Plan, configured: tuple[dict, dict, _Depth] | None = None):
    """(model on meta, depth) exactly as stock constructs it; nothing is read."""
    import accelerate
    import torch
    from diffusers.models import modeling_utils as mu

    config, unused_kwargs, depth = configured or read_config(cls, plan)
    torch_dtype = plan.torch_dtype
    dtype_orig = cls._set_default_torch_dtype(torch_dtype) if torch_dtype is not None else None
    try:
        with mu.ContextManagers([mu.no_init_weights(), accelerate.init_empty_weights()]):
            model = cls.from_config(config, **unused_kwargs)
    finally:
        if dtype_orig is not None:
            torch.set_default_dtype(dtype_orig)
    if plan.ckpt.index_file is None and _has_deprecated_attention_keys(model, plan.ckpt):
        raise _Fallback()
    return model, depth


def _keep_in_fp32(cls) -> list[str]:
    keep = cls._keep_in_fp32_modules
    if keep is not None and not isinstance(keep, list):
        keep = [keep]
    return keep or []


def check_job(cls, plan: _Plan, model, depth: _Depth) -> tuple[LoadJob, list[str], set[str]]:
    """Which checkpoint keys the model takes, checked in the files before any is read.

    Returns (job, keys the checkpoint lacks, names still on meta after construction).
    """
    ckpt = plan.ckpt
    model_sd = model.state_dict()
    expected = list(model_sd.keys())
    loaded = set(ckpt.weight_map)
    kept = [k for k in expected if k in loaded]
    missing = [k for k in expected if k not in loaded]
    unexpected = sorted(loaded - set(expected))
    if cls._keys_to_ignore_on_load_unexpected is not None:
        for pat in cls._keys_to_ignore_on_load_unexpected:
            unexpected = [k for k in unexpected if re.search(pat, k) is None]

    on_meta = set(tensors_on_meta(model))
    missing_meta = [k for k in missing if k in on_meta]
    if missing_meta:
        hint = ""
        if depth.requested is not None and depth.in_checkpoint is not None and depth.requested > depth.in_checkpoint:
            hint = (
                f" {cls.__name__} was asked for {depth.key}={depth.requested}, but the checkpoint has "
                f"{depth.in_checkpoint}: ask for at most {depth.in_checkpoint}."
            )
        raise LoadError(
            f"accel-npu: {plan.folder} has no tensor for {len(missing_meta)} parameter(s) of {cls.__name__}: "
            f"{truncation.short_list(missing_meta)}.{hint} (Stock diffusers would leave them on the meta device.)"
        )

    needed_files = validate(ckpt, kept)
    torch_dtype = plan.torch_dtype
    out_bytes = 0
    for k in kept:
        t = model_sd[k]
        dt = t.dtype if torch_dtype is None or not t.is_floating_point() else torch_dtype
        out_bytes += t.numel() * dt.itemsize
    job = LoadJob(
        cls=cls,
        model=model,
        model_sd=model_sd,
        ckpt=ckpt,
        kept=kept,
        needed_files=needed_files,
        nbytes=nbytes_of(ckpt, kept),
        out_bytes=out_bytes,
        torch_dtype=torch_dtype,
        keep_in_fp32=_keep_in_fp32(cls),
        unexpected=unexpected,
        path=plan.path,
        folder=plan.folder,
        load_whole=lambda: load(cls, plan),
    )  # stock's result from the files, if ever needed
    return job, missing, on_meta


def place(job: LoadJob, ds_config: dict | None, early: prefetch.Prefetch | None = None) -> float:
    """Fill the model's parameters (see placement/); returns the seconds it took."""
    if ds_config is not None:  # ZeRO-3 zero.Init: straight into partitions, read once by rank 0
        return zero3.place(job, ds_config)
    if fsdp.reads_elsewhere():  # FSDP cpu_ram_efficient_loading: rank 0 reads for this rank
        return fsdp.place(job)
    return local.place(job, early)


def start_prefetch(cls, plan: _Plan, depth: _Depth, ds_config: dict | None) -> prefetch.Prefetch | None:
    """For a load read here (not into ZeRO-3 partitions, not left to FSDP): start reading the keys it
    will most likely keep, cast as ``torch_dtype`` will have them (see prefetch.py)."""
    import torch

    if ds_config is not None or fsdp.reads_elsewhere():
        return None
    keep, torch_dtype, default = _keep_in_fp32(cls), plan.torch_dtype, torch.get_default_dtype()

    def target_dtype(key: str, stored: str):
        if stored not in ("F64", "F32", "F16", "BF16"):
            return None  # not floating: never cast
        if torch_dtype is None:
            return default  # the dtype the model is built in
        return torch.float32 if keep and any(m in key.split(".") for m in keep) else torch_dtype

    keys = prefetch.predicted_keys(plan.ckpt, depth.requested, depth.in_checkpoint)
    try:
        early = prefetch.Prefetch(plan.ckpt, keys, target_dtype, threads=0)
    except LoadError:  # a file the guess names is bad: check_job reports what the model really needs
        return None
    return early.start(f"{cls.__name__} from {plan.folder}")


def finish(job: LoadJob, depth: _Depth, seconds: float) -> None:
    """Nothing left on meta; one line for the checkpoint tensors that were not read."""
    cls = job.cls
    left = tensors_on_meta(job.model)
    if left:
        raise LoadError(
            f"accel-npu: after loading {job.folder}, {cls.__name__} still has tensors on the meta "
            f"device: {truncation.short_list(left)}. They are neither in the checkpoint nor created by "
            "the model's __init__; this model class cannot be loaded with low_cpu_mem_usage."
        )
    if not job.unexpected:
        return
    dropped_layers = truncation.layer_indices(job.unexpected)
    truncated = (
        depth.requested is not None and depth.in_checkpoint is not None and depth.requested < depth.in_checkpoint
    )
    if truncated:
        log.warning(
            "accel-npu: %s truncated to %s=%d of %d: read %d tensors (%.1f MB in %.2f s) from %d of %d "
            "shard(s); skipped %d checkpoint tensors of layers %s (not read).",
            cls.__name__,
            depth.key,
            depth.requested,
            depth.in_checkpoint,
            len(job.kept),
            job.nbytes / 2**20,
            seconds,
            len(job.needed_files),
            len(job.ckpt.files),
            len(job.unexpected),
            truncation.ranges(dropped_layers) if dropped_layers else "-",
        )
    else:
        log.warning(
            "accel-npu: %d tensor(s) of the checkpoint at %s are not used by %s (not read): %s",
            len(job.unexpected),
            job.folder,
            cls.__name__,
            truncation.short_list(job.unexpected, 5),
        )


def load(cls, plan: _Plan):
    """The whole load: build on meta, check, place, finish. Returns what stock returns."""
    ds_config = zero3.zero3_config()
    with cyclic_gc_paused():
        configured = read_config(cls, plan)
        early = start_prefetch(cls, plan, configured[2], ds_config)
        try:
            model, depth = build_on_meta(cls, plan, configured)
            if early is not None:
                early.model_built()
            job, missing, on_meta = check_job(cls, plan, model, depth)
            seconds = place(job, ds_config, early)
        finally:
            if early is not None:
                early.close()
    malloc_trim()
    finish(job, depth, seconds)
    model.register_to_config(_name_or_path=plan.original)
    model.eval()
    if plan.output_loading_info:
        return model, {
            "missing_keys": [k for k in missing if k not in on_meta],
            "unexpected_keys": job.unexpected,
            "mismatched_keys": [],
            "error_msgs": [],
        }
    return model


def tensors_on_meta(model) -> list[str]:
    """Names of parameters, buffers and plain tensor attributes still on the meta device.

    A plain attribute that a forward pre-hook computes anew before every forward is not one: torch's
    ``spectral_norm`` / ``weight_norm`` set ``module.weight`` from ``weight_orig`` (and ``u``/``v``) or
    ``weight_g``/``weight_v`` that way (torch/nn/utils/spectral_norm.py, weight_norm.py), so under a meta
    construction it stays meta until the first forward, with stock diffusers too (diffusers v0.40.0's
    vqgan/discriminator.py)."""
    import torch
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    left = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                left.append(prefix + name)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                left.append(prefix + name)
        computed = {h.name for h in module._forward_pre_hooks.values() if isinstance(h, (SpectralNorm, WeightNorm))}
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not name.startswith("_") and v.is_meta and name not in computed:
                left.append(prefix + name)
    return sorted(set(left))


def _has_deprecated_attention_keys(model, ckpt: Checkpoint) -> bool:
    paths = [name for name, m in model.named_modules() if getattr(m, "_from_deprecated_attn_block", False)]
    if not paths:
        return False
    old = ("query.", "key.", "value.", "proj_attn.")
    return any(k.startswith(f"{p}.{o}") for p in paths for o in old for k in ckpt.weight_map)


def from_pretrained(wrapped, cls, args, kwargs):
    """Wrapper of ``ModelMixin.from_pretrained``: falls back to stock before anything is read."""
    if cls is None or not isinstance(cls, type):
        return wrapped(*args, **kwargs)
    with whole_unless_partitioning():  # zero3_init_flag false, or after prepare: no ZeRO-3 placement
        plan = plan_load(cls, args, kwargs)
        if plan is None:
            return _stock(wrapped, args, kwargs)
        try:
            return load(cls, plan)
        except _Fallback:
            return _stock(wrapped, args, kwargs)


def _stock(wrapped, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    finally:
        malloc_trim()

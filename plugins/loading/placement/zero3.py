"""Loading straight into ZeRO-3 partitions: the node reads the checkpoint once.

Under ``accelerate launch`` with DeepSpeed ZeRO-3 and ``zero3_init_flag`` (the user's config asks
for ``deepspeed.zero.Init``), transformers builds its models partitioned, but stock diffusers
ignores the flag: every rank builds the whole model (fp32 without ``torch_dtype``) and DeepSpeed
partitions it only at ``accelerator.prepare`` — node peak N × model. Here a diffusers model
loaded under that flag is built on meta exactly as stock, then, in groups of a few tens of MB:

1. every rank allocates the group's parameters whole, in zero.Init's dtype (the DeepSpeed
   config's bf16/fp16/fp32, as transformers' zero.Init gives);
2. global rank 0 alone fills them from the checkpoint (``safe_open``, one tensor at a time);
3. ``deepspeed.zero.Init(module=group)`` (public API) broadcasts them from rank 0 and keeps
   each rank's 1/N partition; the whole tensors are freed.

Node peak ≈ 1 × model (in zero.Init's dtype) + N × one group, flat in N; the checkpoint is read
once. Buffers and plain tensor attributes (RoPE tables) are stock's, untouched.

A model loaded this way that is then used *without* a DeepSpeed engine (a VAE loaded outside
``zero3_init_context_manager(enable=False)`` and called directly) is rebuilt whole from its
files on its first forward — what stock diffusers would have returned — with a warning; towers
hidden at ``accelerator.prepare`` are rebuilt the same way (plugins/frozen_towers).
``ACCEL_NPU_ZERO3_INIT=0`` turns all of this off.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from accel_npu import environment
from accel_npu._torch import markers
from accel_npu._torch.callsite import caller_is_library
from accel_npu._torch.dist import collective_device
from accel_npu._torch.memory import malloc_trim
from accel_npu._torch.packing import pack_by_budget
from accel_npu._torch.zero import in_frozen_load, is_zero_partitioned, on_first_forward, outside_zero_init, param_slots
from accel_npu.errors import LoadError
from accel_npu.patching import argument
from accel_npu.plugins.loading.frozen import zero3_init_flag_off
from accel_npu.plugins.loading.lazy import LazyTensors, progress_bar

log = logging.getLogger("accel_npu")

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")

#: bytes of whole parameters a rank holds at once while partitioning (per group)
GROUP_BYTES = 64 << 20


def switched_on() -> bool:
    """``ACCEL_NPU_ZERO3_INIT`` is not 0/false/no/off."""
    return environment.switched_on("ACCEL_NPU_ZERO3_INIT")


def zero3_config() -> dict | None:
    """The DeepSpeed config when a load should go straight into ZeRO-3 partitions, else None.

    That is: transformers' HfDeepSpeedConfig weakref says ZeRO-3 and accelerate's ``zero3_init_flag``
    is not false (accelerate sets the weakref for every ZeRO-3 config), the load is not a frozen tower's
    (``zero3_init_context_manager(enable=False)``, pipeline components), ``ACCEL_NPU_ZERO3_INIT`` is not off, the
    process group is up, and parameters are partitioned over the whole world (not MiCS).
    """
    if in_frozen_load() or not switched_on() or zero3_init_flag_off():
        return None
    ds = sys.modules.get("transformers.integrations.deepspeed")
    try:
        if ds is None or not ds.is_deepspeed_zero3_enabled():
            return None
        config = ds.deepspeed_config()
    except Exception:  # noqa: BLE001 - an unknown transformers: load as stock would
        return None
    if not isinstance(config, dict):
        return None
    zero = config.get("zero_optimization") or {}
    try:
        mics = int(zero.get("mics_shard_size", -1) or -1)
    except (TypeError, ValueError):
        mics = -1
    if mics > 0:
        log.info("accel-npu: MiCS (mics_shard_size=%s) partitions per group; loading as stock diffusers does", mics)
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return config


def load_partitioned(model, lazy, ds_config: dict, progress=None) -> dict:
    """Replace ``model``'s meta parameters by ZeRO-3 partitions filled from ``lazy`` (read on rank 0).

    ``lazy`` is a :class:`~accel_npu.plugins.loading.lazy.LazyTensors` over exactly the checkpoint keys that
    name the model's parameters (buffers are the model's own). Collective: every rank calls it
    with the same model and keys. Returns {"dtype", "groups", "bytes_read"}.
    """
    import deepspeed
    import torch
    import torch.distributed as dist

    reader = dist.get_rank() == 0
    slots = param_slots(model)
    by_key: dict[str, int] = {}
    for pid, entries in slots.items():
        for _module, _attr, name in entries:
            by_key[name] = pid
    keys = [k for k in lazy.order() if k in by_key]
    seen: set[int] = set()
    order = []
    for k in keys:  # a tied parameter is filled once, from its first key
        if by_key[k] not in seen:
            seen.add(by_key[k])
            order.append(k)

    probe = torch.nn.Module()
    dtype = deepspeed.zero.Init(module=probe, config_dict_or_path=ds_config).dtype

    def target_dtype(meta):
        return dtype if meta.is_floating_point() else meta.dtype

    sizes = {}
    for k in order:
        meta = slots[by_key[k]][0][0]._parameters[slots[by_key[k]][0][1]]
        sizes[k] = meta.numel() * torch.empty((), dtype=target_dtype(meta)).element_size()
    groups = pack_by_budget(order, sizes.__getitem__, GROUP_BYTES)
    source = iter(lazy.items(only=set(order))) if reader else None
    failure: BaseException | None = None  # rank 0 keeps joining the collectives, then all ranks raise
    with torch.no_grad():
        for group in groups:
            holder = torch.nn.Module()
            for i, key in enumerate(group):
                entries = slots[by_key[key]]
                meta = entries[0][0]._parameters[entries[0][1]]
                whole = torch.empty(meta.shape, dtype=target_dtype(meta))
                if reader and failure is None:
                    try:
                        name, tensor = next(source)
                        if name != key:  # lazy.order() is the read order; never expected
                            raise RuntimeError(f"read {name!r} where {key!r} was expected")
                        whole.copy_(tensor)
                        del tensor
                    except Exception as exc:  # noqa: BLE001 - kept and raised after every rank left the collective
                        failure = exc
                param = torch.nn.Parameter(whole, requires_grad=meta.requires_grad)
                for module, attr, _name in entries:
                    module._parameters[attr] = param
                holder.register_parameter(f"p{i}", param)
            # broadcasts each tensor from rank 0 and keeps this rank's partition (public API)
            deepspeed.zero.Init(module=holder, config_dict_or_path=ds_config)
            del holder, whole, param
            # the freed whole tensors are holes between partitions in glibc's heap: without a trim
            # they stay resident (measured +1.2 GB per rank on a 4.2 GB model at N=2)
            malloc_trim()
    if source is not None and failure is None:
        for _rest in source:  # closes the last shard
            pass
    if progress is not None:
        progress.close()
    failed = torch.tensor([1 if failure is not None else 0], device=collective_device())
    dist.broadcast(failed, 0)
    if failed.item():
        if failure is not None:
            if isinstance(failure, LoadError):
                raise failure
            raise LoadError(
                f"accel-npu: reading the checkpoint into ZeRO-3 partitions failed on rank 0: {failure}"
            ) from failure
        raise LoadError(
            "accel-npu: rank 0 failed to read the checkpoint while loading it into ZeRO-3 "
            "partitions (its log names the file and key); nothing was loaded on this rank either."
        )
    return {"dtype": dtype, "groups": len(groups), "bytes_read": lazy.read}  # LazyTensors counts what it read


def place(job, ds_config: dict) -> float:
    """Fill ``job.model`` straight into ZeRO-3 partitions (collective); returns the seconds it took."""
    import torch.distributed as dist

    started = time.perf_counter()
    params = job.read_buffers_only()
    param_keys = [k for k in job.kept if k in params]
    rank0 = dist.get_rank() == 0
    bar = progress_bar(job.ckpt_bytes(param_keys), job.desc, len(job.needed_files)) if rank0 else None
    done = load_partitioned(job.model, LazyTensors(job.ckpt, param_keys, progress=bar), ds_config, progress=bar)
    seconds = time.perf_counter() - started
    if rank0:
        log.warning(
            "accel-npu: %s loaded into ZeRO-3 partitions (zero3_init_flag, %s) over %d ranks: rank 0 "
            "read %.1f MB once in %.2f s and broadcast it in %d group(s); each rank keeps 1/%d.",
            job.cls.__name__,
            str(done["dtype"]).replace("torch.", ""),
            dist.get_world_size(),
            done["bytes_read"] / 2**20,
            seconds,
            done["groups"],
            dist.get_world_size(),
        )
    attach_rebuild(job.model, job.load_whole)
    object.__setattr__(job.model, markers.SOURCE, job.folder)
    return seconds


# ------------------------------------------------------------------------------------------------
# a partitioned model used without a DeepSpeed engine
# ------------------------------------------------------------------------------------------------
#: instance attribute: the ``_apply`` functions (``.to(dtype)``, ``.half()``, ...) called on the model since it was
#: loaded
CASTS = "_accel_npu_casts"


def record_casts(model) -> None:
    """Remember every ``model._apply(fn)`` (``.to()``, ``.half()``, ``.bfloat16()``, ``.cuda()``, ...)
    so a rebuild from the files replays them: the rebuilt model is what stock gives after the same
    calls (a bound method in the instance: ``copy.deepcopy`` rebinds it to the copy)."""
    import types

    if CASTS in model.__dict__:
        return
    object.__setattr__(model, CASTS, [])
    object.__setattr__(model, "_apply", types.MethodType(_apply, model))


def _apply(self, fn, *args, **kwargs):
    """The model's ``_apply``, recording ``fn`` (module level: a pickled model pickles it by name)."""
    self.__dict__.setdefault(CASTS, []).append(fn)
    return type(self)._apply(self, fn, *args, **kwargs)


def attach_rebuild(model, load_whole: Callable[[], Any], what: str = "diffusers") -> None:
    """Let ``model`` be rebuilt whole (stock result) from its files; guard its first use outside an engine.

    ``load_whole()`` returns what the stock ``from_pretrained`` returns outside zero.Init; every
    ``.to()`` / cast the script made on ``model`` since is replayed on it. Uses that rebuild it while
    no DeepSpeed engine holds it: a forward of any submodule, a ``state_dict()`` of any submodule
    (``ControlNetModel.from_unet(unet)`` copies the UNet's blocks' state dicts), and diffusers'
    ``model.dtype`` (dreambooth/controlnet scripts refuse a trainable model that is not fp32 before
    ``prepare``: stock loads it whole in fp32; :func:`parameter_dtype`), a parameter the user's code
    reads as an attribute (:func:`guard_parameter_reads`), and the script's ``register_to_config``
    (:func:`config_changed`).
    """
    record_casts(model)
    handles = []

    def rebuild() -> None:
        for h in handles:
            h.remove()
        handles.clear()
        unguard_parameter_reads(model)
        rebuild_whole(model, load_whole)

    object.__setattr__(model, markers.REBUILD, rebuild)

    def first_call(module) -> None:
        made_whole_outside_engine(model, module, "is called", what)

    def before_state_dict(module, prefix, keep_vars) -> None:
        made_whole_outside_engine(model, module, "has its state_dict() read", what)

    on_first_forward(model, first_call)
    for sub in model.modules():
        handles.append(sub.register_state_dict_pre_hook(before_state_dict))
    guard_parameter_reads(model, what)


# -- a parameter read as an attribute -------------------------------------------------------------------
#: submodule instance-dict key: the loaded model it belongs to (whose rebuild a read triggers)
_OWNER = "_accel_npu_partitioned_owner"
#: original class -> its guarded subclass (one per class, made on first use)
_GUARDED: dict = {}


def guard_parameter_reads(model, what: str = "diffusers") -> None:
    """A parameter the user's code reads as an attribute while it is still a partition and no engine
    holds the model is made whole first: stock returns the model whole, and a read like
    ``prior.clip_mean.clone()`` before ``prepare`` (kandinsky2_2 train_text_to_image_prior.py) would
    get DeepSpeed's empty placeholder. Parameters live in ``Module._parameters``, so such reads go
    through the class's ``__getattr__``: each submodule's class is swapped for a subclass (same name,
    module and qualname) whose ``__getattr__`` checks the value; reads by libraries (DeepSpeed building
    the engine) pass through. The classes go back at the rebuild, or at the first read once the
    engine holds the model (its ZeRO-3 hooks mark every module with ``ds_id``)."""
    for sub in model.modules():
        cls = type(sub)
        if cls in _GUARDED.values():
            continue
        try:
            sub.__class__ = _guarded_class(cls)
        except TypeError:  # a class whose layout differs from a plain subclass's (__slots__): left as is
            continue
        sub.__dict__[_OWNER] = (model, what)


def unguard_parameter_reads(model) -> None:
    """Each submodule of ``model`` back to its own class."""
    for sub in model.modules():
        if sub.__dict__.pop(_OWNER, None) is not None and type(sub) in _GUARDED.values():
            sub.__class__ = type(sub).__bases__[0]


def _guarded_class(cls):
    guarded = _GUARDED.get(cls)
    if guarded is None:

        def __getattr__(self, name):
            value = cls.__getattr__(self, name)
            if hasattr(value, "ds_id") and name in self.__dict__.get("_parameters", ()):
                _partition_read(self, name)
                value = cls.__getattr__(self, name)
            return value

        guarded = type(
            cls.__name__,
            (cls,),
            {"__getattr__": __getattr__, "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        _GUARDED[cls] = guarded
    return guarded


def _partition_read(module, name: str) -> None:
    """``module.<name>``, a partition, was read: the model whole first if the user's code read it
    outside the engine; the guard removed once the engine holds the model."""
    model, what = module.__dict__.get(_OWNER, (None, ""))
    if model is None:
        return
    if hasattr(model, "ds_id") or hasattr(module, "ds_id"):
        unguard_parameter_reads(model)
        return
    if caller_is_library(depth=2):
        return
    made_whole_outside_engine(model, module, f"has its parameter `{name}` read", what)


def made_whole_outside_engine(model, module, use: str, what: str = "diffusers") -> None:
    """Rebuild ``model`` whole if it is still partitioned, has a rebuild attached and no DeepSpeed engine
    holds it (``ds_id``: set on every module by the engine's ZeRO-3 hooks)."""
    rebuild = getattr(model, "__dict__", {}).get(markers.REBUILD)
    if rebuild is None or hasattr(model, "ds_id") or hasattr(module, "ds_id") or not is_zero_partitioned(model):
        return
    (log.warning if os.environ.get("RANK", "0") == "0" else log.info)(
        "accel-npu: %s was loaded into ZeRO-3 partitions (zero3_init_flag) but %s outside the "
        "DeepSpeed engine; rebuilding it whole from its files (what stock %s returns, with the script's "
        "casts since). Load frozen models inside "
        "`accelerator.state.deepspeed_plugin.zero3_init_context_manager(enable=False)` to skip this.",
        type(model).__name__,
        use,
        what,
    )
    rebuild()


def parameter_dtype(wrapped, instance, args, kwargs):
    """diffusers' ``get_parameter_dtype(model)`` (``ModelMixin.dtype``): a model this plugin loaded into
    ZeRO-3 partitions and not yet in an engine is made whole first, so the dtype is stock's (the
    files' fp32, not zero.Init's bf16): train_dreambooth.py / train_controlnet.py raise "Unet loaded as
    datatype torch.bfloat16" otherwise."""
    model = argument(args, kwargs, 0, "parameter")
    if model is not None:  # returns at once unless this plugin attached a rebuild to it
        made_whole_outside_engine(model, model, "has its dtype read")
    return wrapped(*args, **kwargs)


def config_changed(wrapped, instance, args, kwargs):
    """diffusers' ``ConfigMixin.register_to_config`` called by the user's script (not a library) on a model
    this plugin loaded into ZeRO-3 partitions, before an engine holds it: the script is reshaping the model
    from its weights, which stock diffusers hands it whole. train_instruct_pix2pix{,_sdxl}.py set
    ``in_channels=8``, then copy ``unet.conv_in.weight`` into a wider conv_in ("The size of tensor a (3)
    must match the size of tensor b (0)" on an empty partition), so the model is made whole first."""
    if instance is not None and not caller_is_library(skip=(_HERE,)):
        made_whole_outside_engine(instance, instance, "has its config changed by the script")
    return wrapped(*args, **kwargs)


def rebuild_whole(model, load_whole: Callable[[], Any]) -> None:
    """Make ``model``'s partitioned parameters whole, in place, with the data stock would load (local, no
    collective).

    The casts and moves the script made since loading (``.to(dtype)``, ``.half()``, ``.to(device)``)
    are replayed on the fresh copy; ``requires_grad`` and train/eval mode stay the model's own.
    """
    import torch

    with outside_zero_init():
        fresh = load_whole()
    if isinstance(fresh, tuple):  # output_loading_info
        fresh = fresh[0]
    for fn in model.__dict__.get(CASTS, ()):
        try:
            type(fresh)._apply(fresh, fn)
        except Exception as exc:  # noqa: BLE001 - a custom function: the files' dtype, the partition's device
            log.warning(
                "accel-npu: replaying a cast of %s on its whole copy failed (%s); it keeps the dtype of its files",
                type(model).__name__,
                exc,
            )
    fresh_params = dict(fresh.named_parameters(remove_duplicate=False))
    for _pid, entries in param_slots(model).items():
        module, attr, name = entries[0]
        old = module._parameters[attr]
        if not hasattr(old, "ds_id"):
            continue
        # a peft adapter added since loading wraps the layer: its partitioned base weight is
        # `x.base_layer.weight` here, `x.weight` in the files (SD3's load_model_hook: from_pretrained,
        # add_adapter, then set_peft_model_state_dict reads state_dict())
        source = fresh_params.get(name)
        if source is None:
            source = fresh_params[name.replace(".base_layer.", ".")]
        # the same Parameter object, made whole: an optimizer the script built from it before this read
        # (kandinsky2_2 prior: AdamW(prior.parameters()), then prior.clip_mean) still holds the model's
        # parameters. DeepSpeed's zero.Init set its partition state as attributes on the object
        # (partition_parameters.py _convert_to_deepspeed_param): without ds_id it is a plain parameter
        # again, which prepare partitions as it does a whole model's.
        with torch.no_grad():
            old.data = source.data
        for attr in [a for a in vars(old) if a not in vars(source)]:
            delattr(old, attr)
    del fresh
    object.__setattr__(model, markers.REBUILD, None)
    model.__dict__.pop(CASTS, None)
    model.__dict__.pop("_apply", None)

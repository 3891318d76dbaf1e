"""``save_pretrained`` / ``safetensors.torch.save_file`` of ZeRO-3 partitioned models.

Stock writes what each parameter holds on this rank: shape-[0] tensors, exit 0, a model
``from_pretrained`` refuses. Here:

- diffusers ``ModelMixin.save_pretrained``: ``state_dict()`` answers, for each partitioned
  parameter, a whole-shape *meta* tensor, so diffusers plans its shards and index by the real
  sizes and writes its config as always; the ``save_file`` of each shard is then written by
  :func:`write_streaming`: gathered a group at a time (the idle ranks join, plugins/checkpoints/
  serving.py), streamed to a hidden file, renamed into place when complete;
- transformers ``PreTrainedModel.save_pretrained`` (5.x): the same meta state dict. transformers
  drops tied duplicates by the parameter objects behind meta entries, may rename keys
  (``revert_weight_conversion``) and writes each shard with ``transformers.modeling_utils.safe_save_file``,
  its own alias of save_file, bound to the patched save_file: each meta entry is known by identity,
  so a renamed one is still gathered from its parameter;
- diffusers ``save_attn_procs`` of custom-diffusion processors: the state dict it builds from them answers
  the same meta tensors (keys ``<processor>.<parameter>``), written by the patched ``save_file``;
- ``safetensors.torch.save_file`` given partitioned parameters themselves: the same;
- what cannot be completed fails before anything is written, with the reason: ``torch.save``
  (pickle) shards, a weight conversion that computes new tensors from partitioned ones, no
  process group any more (after ``end_training``).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os

from accel_npu._torch.packing import pack_by_budget
from accel_npu._torch.safetensors_io import SafetensorsStream
from accel_npu._torch.zero import whole_shape
from accel_npu.errors import CheckpointError
from accel_npu.patching import argument
from accel_npu.plugins.checkpoints import serving

GROUP_BYTES = 256 * 2**20  # gathered at once: a bound on every rank's extra memory while saving
_sources = contextvars.ContextVar("accel_npu_partitioned_sources", default=None)
#: (state dict, {key: partitioned parameter}) of the latest peft get_peft_model_state_dict answers: peft's
#: PeftModel.save_pretrained clones entries that share a storage before save_file (peft/peft_model.py, "Safetensors
#: does not allow tensor aliasing"), and every partition is an empty tensor, so the clones lose the parameter
_answered: list = []


def remember_sources(tensors: dict, sources: dict) -> None:
    """``tensors`` (a state dict handed to a caller) holds these partitioned parameters under these keys."""
    if sources:
        _answered[:] = [e for e in _answered if e[0] is not tensors][-3:] + [(tensors, sources)]


def _remembered(tensors: dict) -> dict:
    """{key: partitioned parameter} for the entries of a remembered state dict that still hold the parameter
    or an empty copy of it (a clone of its partition), never a tensor with data of its own."""
    for answered, sources in _answered:
        if answered is tensors:
            return {
                k: p
                for k, p in sources.items()
                if k in tensors and (tensors[k] is p or getattr(tensors[k], "numel", lambda: 1)() == 0)
            }
    return {}


def partitioned(module) -> list:
    return [p for p in module.parameters() if serving.is_partitioned(p)]


def _group_alive() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def refuse_if_group_gone(what: str) -> None:
    """The slices can only be gathered while the process group is up."""
    if not _group_alive():
        refuse(
            what,
            "The process group is gone (accelerator.end_training() was called), so the slices cannot be gathered.",
            "Save before accelerator.end_training().",
        )


def refuse(what: str, reason: str, fix: str):
    raise CheckpointError(
        f"{what}: the model's parameters are ZeRO-3 partitions (each rank holds a slice; "
        f"stock would write shape-[0] tensors that from_pretrained cannot load). {reason} "
        f"Nothing was written. {fix}"
    )


@contextlib.contextmanager
def meta_state_dict(module, method: str = "state_dict", by_name: dict | None = None):
    """Inside, ``module.state_dict()`` gives whole-shape meta tensors for partitioned parameters,
    and :func:`save_file` knows which parameter each such key (or meta tensor: a library may rename
    the keys) stands for. ``method``: another method of ``module`` answering a state dict, whose keys
    ``by_name`` maps to parameters (default: the module's own parameter names)."""
    import torch

    original = getattr(module, method)
    had_attr = method in module.__dict__
    by_name = dict(module.named_parameters(remove_duplicate=False)) if by_name is None else by_name
    sources: dict = {}
    metas: dict = {}
    by_meta: dict = {}  # id(meta tensor) -> parameter; the meta tensors live as long as this context

    def state_dict(*args, **kwargs):
        out = original(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        for key in list(out):
            param = by_name.get(key[len(prefix) :]) if key.startswith(prefix) else None
            if param is not None and serving.is_partitioned(param):
                if id(param) not in metas:
                    metas[id(param)] = torch.empty(whole_shape(param), dtype=param.dtype, device="meta")
                    by_meta[id(metas[id(param)])] = param
                out[key] = metas[id(param)]
                sources[key] = param
        return out

    setattr(module, method, state_dict)
    token = _sources.set((sources, by_meta))
    try:
        yield sources
    finally:
        _sources.reset(token)
        if had_attr:
            setattr(module, method, original)
        else:
            delattr(module, method)


def write_streaming(tensors: dict, sources: dict, filename, metadata=None) -> None:
    """Write ``tensors`` as safetensors, the entries in ``sources`` (key -> partitioned parameter)
    gathered a group of at most :data:`GROUP_BYTES` at a time; into a hidden file renamed into place."""
    import deepspeed
    import torch.distributed as dist

    def nbytes(key):
        value = sources.get(key, tensors[key])
        n = 1
        for d in whole_shape(value):
            n *= int(d)
        return n * value.element_size()

    keys = list(tensors)
    specs = [(k, sources.get(k, tensors[k]).dtype, whole_shape(sources.get(k, tensors[k]))) for k in keys]
    # a partitioned parameter's dtype is the one the script asked for (`unet.to(torch.float32)` before
    # saving, train_dreambooth_lora.py), but DeepSpeed gathers it in its partition's dtype (bf16)
    dtypes = {k: dtype for k, dtype, _shape in specs}
    filename = os.fspath(filename)
    rank = dist.get_rank() if _group_alive() else 0
    parent, name = os.path.split(os.path.abspath(filename))
    tmp = os.path.join(parent, f".{name}.accel-npu-partial-{rank}")
    stream = SafetensorsStream(tmp, specs, metadata)
    try:
        with serving.requesting():
            for group in pack_by_budget(keys, nbytes, GROUP_BYTES):
                params = [sources[k] for k in group if k in sources]
                with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                    for k in group:
                        stream.write(k, sources[k].to(dtypes[k]) if k in sources else tensors[k])
        stream.close()
    except BaseException:
        with contextlib.suppress(Exception):
            stream._f.close()
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, filename)


def save_file(wrapped, instance, args, kwargs):
    """``safetensors.torch.save_file``: partitioned entries are gathered and streamed."""
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    tensors = bound.arguments.get("tensors")
    if not isinstance(tensors, dict):
        return wrapped(*args, **kwargs)
    by_key, by_meta = _sources.get() or ({}, {})
    remembered = _remembered(tensors) if not by_key and not by_meta else {}
    sources = {}
    for k, t in tensors.items():
        param = by_meta.get(id(t)) if getattr(t, "is_meta", False) else None
        if param is None and (getattr(t, "is_meta", False) or t.numel() == 0):
            # diffusers' keys are the state dict's own; a tensor with data of its own is written as it is
            param = by_key.get(k)
            if param is None:
                param = remembered.get(k)  # not `or`: a partitioned Parameter has no truth value
        if param is None and serving.is_partitioned(t):
            param = t
        if param is not None:
            sources[k] = param
    if not sources:
        return wrapped(*args, **kwargs)
    unknown = [k for k, t in tensors.items() if k not in sources and getattr(t, "is_meta", False)]
    if unknown:
        refuse(
            f"safetensors save_file({bound.arguments.get('filename')!r})",
            f"Entries {unknown[:5]} are meta tensors computed from partitioned parameters (a weight conversion), "
            "not parameters that can be gathered.",
            "Save the gathered weights instead: state_dict = "
            "accelerator.get_state_dict(model) on every rank, then save it on the main process.",
        )
    refuse_if_group_gone(f"safetensors save_file({bound.arguments.get('filename')!r})")
    write_streaming(tensors, sources, bound.arguments["filename"], bound.arguments.get("metadata"))


def diffusers_save_pretrained(wrapped, instance, args, kwargs):
    """``ModelMixin.save_pretrained`` of a partitioned model: shards planned by the real sizes,
    written gathered (see the module docstring)."""
    if not partitioned(instance):
        return wrapped(*args, **kwargs)
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # stock raises its own error
    what = f"{type(instance).__name__}.save_pretrained({bound.arguments.get('save_directory')!r})"
    if not bound.arguments.get("safe_serialization", True) or bound.arguments.get("use_flashpack"):
        refuse(
            what,
            "Only safetensors shards can be written gathered slice by slice.",
            "Pass safe_serialization=True (the default).",
        )
    refuse_if_group_gone(what)
    with meta_state_dict(instance):
        return wrapped(*args, **kwargs)


def diffusers_save_attn_procs(wrapped, instance, args, kwargs):
    """``UNet2DConditionLoadersMixin.save_attn_procs`` of custom-diffusion processors that are partitioned (they
    trained in a ZeRO-3 engine: train_custom_diffusion.py's final save on the main process): the state dict
    diffusers builds from them (``_get_custom_diffusion_state_dict``, keys ``<processor name>.<parameter name>``)
    answers meta tensors, written gathered by :func:`save_file`. LoRA processors go through peft's state dict
    (peft_state_dict)."""
    import torch

    processors = getattr(instance, "attn_processors", {})
    by_name = {
        f"{name}.{param_name}": param
        for name, processor in processors.items()
        if isinstance(processor, torch.nn.Module)
        for param_name, param in processor.named_parameters(remove_duplicate=False)
    }
    if not any(serving.is_partitioned(p) for p in by_name.values()) or not hasattr(
        instance, "_get_custom_diffusion_state_dict"
    ):
        return wrapped(*args, **kwargs)
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # stock raises its own error
    what = f"{type(instance).__name__}.save_attn_procs({bound.arguments.get('save_directory')!r})"
    if bound.arguments.get("save_function") is not None or not bound.arguments.get("safe_serialization", True):
        refuse(
            what,
            "Only safetensors files written by diffusers' own save function can be written gathered slice by slice.",
            "Pass safe_serialization=True (the default) and no save_function.",
        )
    refuse_if_group_gone(what)
    with meta_state_dict(instance, "_get_custom_diffusion_state_dict", by_name):
        return wrapped(*args, **kwargs)


def transformers_save_pretrained(wrapped, instance, args, kwargs):
    """``PreTrainedModel.save_pretrained`` of a partitioned model: shards planned by the real sizes,
    written gathered by the patched ``safe_save_file`` alias (see the module docstring)."""
    if not partitioned(instance) or argument(args, kwargs, 2, "state_dict") is not None:
        return wrapped(*args, **kwargs)
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)  # stock raises its own error
    if bound.arguments.get("distributed_checkpoint"):
        return wrapped(*args, **kwargs)  # FSDP/TP's DCP writer; transformers refuses a DeepSpeed model itself
    what = f"{type(instance).__name__}.save_pretrained({bound.arguments.get('save_directory')!r})"
    # transformers 4.x wrote torch.save shards with safe_serialization=False; 5.x has no such argument
    # (it lands in **kwargs, ignored with save_function: every shard goes through safe_save_file)
    if bound.arguments.get("safe_serialization", True) is False:
        refuse(
            what,
            "Only safetensors shards can be written gathered slice by slice.",
            "Pass safe_serialization=True (the default).",
        )
    if not _alias_gathers():
        refuse(
            what,
            "transformers.modeling_utils was imported before accel-npu was active, so its alias of "
            "safetensors' save_file (safe_save_file) would write them as they are.",
            "Pass the gathered weights: state_dict = accelerator.get_state_dict(model) on every rank, then "
            "model.save_pretrained(dir, state_dict=state_dict) on the main process.",
        )
    refuse_if_group_gone(what)
    with meta_state_dict(instance):
        # an adapter-only save (transformers' add_adapter) skips the weight conversion
        if bound.arguments.get("save_original_format", True) and not getattr(instance, "_hf_peft_config_loaded", False):
            _refuse_computed_entries(what, instance)
        return wrapped(*args, **kwargs)


def _alias_gathers() -> bool:
    """transformers' ``safe_save_file``, the alias it bound of safetensors' ``save_file``, is that
    function wrapped by :func:`save_file` (safetensors.torch imports torch, which activates accel-npu,
    so the patch is in place before transformers binds it; not when accel-npu was activated later)."""
    import sys

    alias = getattr(sys.modules.get("transformers.modeling_utils"), "safe_save_file", None)
    return getattr(alias, "_self_wrapper", None) is save_file


def _refuse_computed_entries(what: str, model) -> None:
    """transformers' ``revert_weight_conversion`` (a model with a weight-conversion mapping, MoE experts)
    may compute new tensors from several parameters: from meta ones, meta tensors no gather can fill.
    Run it on the meta state dict first (meta operations, no data) and refuse before writing."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return
    state = model.state_dict()
    by_meta = (_sources.get() or ({}, {}))[1]
    converted = revert_weight_conversion(model, dict(state))
    computed = [k for k, t in converted.items() if getattr(t, "is_meta", False) and id(t) not in by_meta]
    if computed:
        refuse(
            what,
            f"transformers converts weights on saving (revert_weight_conversion): {computed[:5]} are computed "
            "from several partitioned parameters, which cannot be gathered slice by slice.",
            "Pass save_original_format=False, or the gathered weights: state_dict = accelerator.get_state_dict(model) "
            "on every rank, then model.save_pretrained(dir, state_dict=state_dict) on the main process.",
        )

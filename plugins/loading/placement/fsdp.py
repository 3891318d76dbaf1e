"""FSDP ``cpu_ram_efficient_loading``: only global rank 0 reads a diffusers checkpoint.

With ``fsdp_cpu_ram_efficient_loading: true`` accelerate's FSDP prepare fills every rank's shard
from rank 0's weights (FSDP2: ``fsdp2_load_full_state_dict`` broadcasts them; FSDP1:
``sync_module_states``). transformers reads real weights on rank 0 only and gives the other ranks
``torch.empty`` parameters. Stock diffusers ignores the setting: every rank reads the whole
checkpoint, so the node holds N models before ``prepare`` throws N - 1 of them away.

Here a diffusers model loaded on any other rank gets its parameters with the shape, dtype and
device stock would give, uninitialized (``torch.empty``: no byte read, no page touched); buffers
and plain tensor attributes are stock's. A model that is *called* before FSDP manages it (a
frozen VAE loaded while the setting is on and used directly) first reads its weights from its
files, once: what stock diffusers returns. Pipeline components and loads inside
``zero3_init_context_manager(enable=False)`` always read. ``fsdp_cpu_ram_efficient_loading:
false`` in the launch config turns all of this off, as it does for transformers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from accel_npu._torch import markers
from accel_npu._torch.dist import rank_and_world
from accel_npu._torch.memory import malloc_trim
from accel_npu._torch.zero import in_frozen_load, on_first_forward, outside_zero_init, param_slots
from accel_npu.environment import truthy

log = logging.getLogger("accel_npu")


def efficient_loading_requested() -> bool:
    """accelerate's FSDP with ``cpu_ram_efficient_loading`` (its launcher or FullyShardedDataParallelPlugin set "
    "these)."""
    return truthy(os.environ.get("ACCELERATE_USE_FSDP", "")) and truthy(
        os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "")
    )


def world_size() -> int:
    return rank_and_world()[1]


def rank0_reads_for_all() -> bool:
    """This load is of a model whose weights FSDP's prepare will broadcast from global rank 0."""
    return efficient_loading_requested() and not in_frozen_load() and rank_and_world()[1] > 1


def reads_elsewhere() -> bool:
    """True on the ranks that should not read: rank 0 reads for them."""
    return rank0_reads_for_all() and rank_and_world()[0] != 0


def place(job) -> float:
    """On a rank that does not read: parameters left uninitialized for FSDP's prepare to fill from
    rank 0 (buffers read as stock); returns the seconds it took."""
    import torch

    started = time.perf_counter()
    params = job.read_buffers_only()
    convert = job.cast()
    dtypes = {k: convert(k, torch.empty(0, dtype=job.model_sd[k].dtype)).dtype for k in job.kept if k in params}
    left_bytes = materialize_empty(job.model, dtypes)
    seconds = time.perf_counter() - started
    log.info(
        "accel-npu: %s: %.1f MB of parameters left for FSDP to fill from rank 0 "
        "(fsdp_cpu_ram_efficient_loading); this rank read no weights.",
        job.cls.__name__,
        left_bytes / 2**20,
    )
    attach_fill(job.model, job.load_whole)
    return seconds


def materialize_empty(model, dtypes: dict[str, Any]) -> int:
    """Give every parameter on meta a real, uninitialized tensor (tied ones stay tied); returns bytes."""
    import torch

    total = 0
    for entries in param_slots(model).values():
        module, attr, name = entries[0]
        old = module._parameters[attr]
        if old.device.type != "meta":
            continue
        dtype = dtypes.get(name, old.dtype)
        new = torch.nn.Parameter(torch.empty(old.shape, dtype=dtype), requires_grad=old.requires_grad)
        total += new.numel() * new.element_size()
        for mod, a, _n in entries:
            mod._parameters[a] = new
    return total


def _managed_by_fsdp(module) -> bool:
    # FSDP1 and FSDP2 both mark the modules they manage (torch.distributed.fsdp, for dynamo).
    return bool(getattr(module, "_is_fsdp_managed_module", False))


def attach_fill(model, load_whole: Callable[[], Any]) -> None:
    """Fill ``model`` from its files on its first forward unless FSDP manages it by then."""

    def fill() -> None:
        with outside_zero_init():  # a frozen load: reads on every rank
            fresh = load_whole()
        fresh_params = dict(fresh.named_parameters(remove_duplicate=False))
        for name, param in model.named_parameters(remove_duplicate=False):
            value = fresh_params[name].data
            param.data = value.to(device=param.device, dtype=param.dtype)
        del fresh
        object.__setattr__(model, markers.FILL, None)

    def first_call(module) -> None:
        if _managed_by_fsdp(model) or _managed_by_fsdp(module) or getattr(model, markers.FILL, None) is None:
            return  # FSDP's prepare broadcast rank 0's weights into it
        log.info(
            "accel-npu: %s was left for FSDP to fill from rank 0 (fsdp_cpu_ram_efficient_loading) but is "
            "called outside FSDP; reading its weights from its files now (what stock diffusers returns).",
            type(model).__name__,
        )
        fill()

    object.__setattr__(model, markers.FILL, fill)
    on_first_forward(model, first_call)


#: every rank gives freed memory back to the OS every this many bytes of parameters scattered
#: (``malloc_trim``): rank 0's full tensors were allocated by load threads, in glibc arenas that keep
#: freed blocks otherwise, and on every rank ``distribute_tensor`` allocates and frees padded chunks
#: and scatter outputs in the main heap (measured: ~40 % of a shard left in it by the end).
TRIM_BYTES = 128 << 20


def load_full_state_dict_streaming(wrapped, instance, args, kwargs):
    """Wrapper of accelerate's ``fsdp2_load_full_state_dict(accelerator, model, full_sd[, cpu_offload])``.

    Stock (accelerate 1.10-1.15) has rank 0 broadcast every full tensor to all ranks, each other rank
    receiving it into a new full-size buffer, then ``distribute_tensor`` scatters it from rank 0
    again into each rank's shard. Rank 0 keeps its whole model (``original_sd``) until the end, and
    the other ranks' freed receive buffers stay in their heaps: node peak = full model + all shards
    + about half a model per other rank. Here each parameter goes from rank 0 straight into every
    rank's shard with the same ``distribute_tensor`` (a scatter from rank 0), with stock's casting,
    contiguity and ``cpu_offload`` rules: the other ranks allocate their shards only (the full-shape
    tensor ``distribute_tensor`` needs is a view of one reused, never-written buffer), and rank 0
    frees each full tensor once scattered. Same values on every rank; no broadcast at all.
    """
    bound = _bind_load_args(args, kwargs)
    if bound is None:
        return wrapped(*args, **kwargs)
    accelerator, model, full_sd, cpu_offload = bound
    try:
        return stream_into_shards(accelerator, model, full_sd, cpu_offload)
    finally:
        malloc_trim()


def _bind_load_args(args, kwargs):
    """(accelerator, model, full_sd, cpu_offload) of a call we can take over, else None (stock)."""
    names = ("accelerator", "model", "full_sd", "cpu_offload")
    given = dict(zip(names, args))
    if len(args) > len(names) or any(k not in names or k in given for k in kwargs):
        return None
    given.update(kwargs)
    if not all(k in given for k in names[:3]) or not isinstance(given["full_sd"], dict):
        return None
    model = given["model"]
    # every entry a DTensor (what fully_shard leaves): stock would fail on anything else, let it
    if not all(hasattr(v, "device_mesh") and hasattr(v, "placements") for v in model.state_dict().values()):
        return None
    return given["accelerator"], model, given["full_sd"], bool(given.get("cpu_offload", False))


def stream_into_shards(accelerator, model, full_sd: dict, cpu_offload: bool = False):
    """Fill the FSDP2 model (on meta) from rank 0's ``full_sd``, parameter by parameter (see the wrapper)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    meta_sharded_sd = model.state_dict()
    main = accelerator.is_main_process
    if main:
        for name in meta_sharded_sd:
            if name not in full_sd:  # accelerate 1.15's check, before any collective
                raise KeyError(
                    f"Parameter '{name}' found in sharded model state dict but missing from full state dict. "
                    f"Full state dict has {len(full_sd)} keys, sharded has {len(meta_sharded_sd)} keys."
                )
    source = dict(full_sd)  # the only reference left: each entry is freed as it is scattered
    full_sd.clear()
    owners = _owning_slots(model, meta_sharded_sd)
    receive = _ReceiveBuffer()
    sharded_sd, processed = {}, 0
    for name, sharded_param in meta_sharded_sd.items():
        mesh = sharded_param.device_mesh
        only_shards = all(isinstance(p, Shard) for p in sharded_param.placements)
        if main:
            full = source.pop(name).detach().to(mesh.device_type)
            if isinstance(full, DTensor):  # after prepare_tp (accelerate >= 1.12)
                full = full.to_local()
        else:
            source.pop(name, None)
            # distribute_tensor reads only rank 0's data (it scatters from rank 0) and returns fresh
            # shards; a Replicate placement returns its input itself, so that one gets its own tensor
            full = (
                receive.view(sharded_param.size(), sharded_param.dtype, mesh.device_type)
                if only_shards
                else torch.empty(sharded_param.size(), device=mesh.device_type, dtype=sharded_param.dtype)
            )
        processed += sharded_param.numel() * sharded_param.element_size()
        sharded = distribute_tensor(full, mesh, sharded_param.placements)
        to_contiguous, casting_dtype = _infer_parameter_dtype(model, name, full)
        del full
        if casting_dtype is not None:
            sharded = sharded.to(dtype=casting_dtype)
        if to_contiguous:
            sharded = sharded.contiguous()
        if cpu_offload:  # FSDP2's lazy_init expects parameters on CPU with CPU offloading
            sharded = sharded.to("cpu")
        if owners is None:
            sharded_sd[name] = sharded
        else:
            # into the model now: FSDP2's load post-hook copies an unevenly split shard into a padded
            # one (reset_sharded_param); done for all parameters at the end, every such rank would
            # briefly hold its whole shard twice
            module, local_name = owners[name]
            module.load_state_dict({local_name: sharded}, strict=False, assign=True)
        del sharded
        if processed >= TRIM_BYTES:
            # every rank: distribute_tensor's padded chunks and scatter outputs are freed into the heap
            processed = 0
            malloc_trim()
    del receive
    if owners is None:
        # assign=True: the parameters are on meta
        model.load_state_dict(sharded_sd, assign=True)
    return model


def _owning_slots(model, names) -> dict | None:
    """{state-dict name: (module, attribute)} when every name is a parameter or buffer held directly by
    its module (loaded one by one as it is scattered); None otherwise (loaded at the end, as stock)."""
    owners = {}
    for name in names:
        base, _, local_name = name.rpartition(".")
        try:
            module = model.get_submodule(base) if base else model
        except AttributeError:
            return None
        if local_name not in module._parameters and local_name not in module._buffers:
            return None
        owners[name] = (module, local_name)
    return owners


def _infer_parameter_dtype(model, name: str, full):
    """accelerate's rule: (contiguous like the model's tensor, dtype to cast floating tensors to).

    accelerate looks the entry up with transformers' ``get_parameter_or_buffer`` and, failing that (LoRA
    entries; every diffusers ModelMixin, which lacks the method), splits the name at its last dot
    (accelerate/utils/fsdp_utils.py, fsdp2_load_full_state_dict's _infer_parameter_dtype): a parameter
    of the model itself (Z-Image's ``x_pad_token``) has no dot and stock stops with "not enough values
    to unpack". Here such an entry is the model's own attribute."""
    import torch

    try:
        old = model.get_parameter_or_buffer(name)
    except AttributeError:
        base, _, local_name = name.rpartition(".")
        old = getattr(model.get_submodule(base) if base else model, local_name)
    fp8 = getattr(torch, "float8_e4m3fn", None)
    casting_dtype = old.dtype if full.dtype.is_floating_point and full.dtype != fp8 else None
    return old is not None and old.is_contiguous(), casting_dtype


class _ReceiveBuffer:
    """One byte buffer per device, grown to the largest tensor asked for; views of it in any shape."""

    def __init__(self):
        self._bufs: dict = {}

    def view(self, shape, dtype, device):
        import torch

        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[device] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)

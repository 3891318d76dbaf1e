"""FSDP ``cpu_ram_efficient_loading``: only global rank 0 reads a diffusers checkpoint (issue 4, item 4).

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
from typing import Any, Callable

from accel_npu._torch import markers
from accel_npu._torch.dist import rank_and_world
from accel_npu._torch.memory import malloc_trim
from accel_npu._torch.zero import in_frozen_load, on_first_forward, outside_zero_init, param_slots
from accel_npu.environment import truthy

log = logging.getLogger("accel_npu")


def efficient_loading_requested() -> bool:
    """accelerate's FSDP with ``cpu_ram_efficient_loading`` (its launcher or FullyShardedDataParallelPlugin set these)."""
    return truthy(os.environ.get("ACCELERATE_USE_FSDP", "")) and truthy(os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", ""))


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
    log.info("accel-npu: %s: %.1f MB of parameters left for FSDP to fill from rank 0 "
             "(fsdp_cpu_ram_efficient_loading); this rank read no weights.", job.cls.__name__, left_bytes / 2**20)
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
        log.info("accel-npu: %s was left for FSDP to fill from rank 0 (fsdp_cpu_ram_efficient_loading) but is "
                 "called outside FSDP; reading its weights from its files now (what stock diffusers returns).",
                 type(model).__name__)
        fill()

    object.__setattr__(model, markers.FILL, fill)
    on_first_forward(model, first_call)


class _ReleasedOnRead(dict):
    """A state dict whose entries are dropped as they are read: each full tensor is freed once used.

    The memory goes back to the OS every ``TRIM_BYTES`` (``malloc_trim``): these tensors were
    allocated by load threads, in glibc arenas that keep freed blocks otherwise.
    """

    TRIM_BYTES = 256 << 20

    def __init__(self, items):
        super().__init__(items)
        self._released = 0

    def items(self):
        # accelerate 1.10-1.13 iterate ``zip(full_sd.items(), ...)`` instead of indexing: hand each
        # entry over through __getitem__ (and so release it) as the zip consumes it.
        for key in list(dict.keys(self)):
            yield key, self[key]

    def __getitem__(self, key):
        value = self.pop(key)
        self._released += value.numel() * value.element_size() if hasattr(value, "element_size") else 0
        if self._released >= self.TRIM_BYTES:
            self._released = 0
            malloc_trim()
        return value


def load_full_state_dict_releasing(wrapped, instance, args, kwargs):
    """Wrapper of accelerate's ``fsdp2_load_full_state_dict(accelerator, model, full_sd, ...)``.

    accelerate has already moved the model to meta, so ``full_sd`` (its ``original_sd``) is the
    only reference left to rank 0's whole weights, and the caller does not use it afterwards.
    Handing over a dict that forgets each tensor once it is broadcast and sharded lets rank 0 free
    its full model tensor by tensor while the shards are built, instead of holding both. The
    other ranks receive every parameter whole into a temporary buffer; the freed buffers are
    returned to the OS at the end (``malloc_trim``: 2.4 GB per rank for the benchmark model).
    """
    args = list(args)
    positional = len(args) >= 3
    full_sd = args[2] if positional else kwargs.get("full_sd")
    if isinstance(full_sd, dict):  # model.state_dict(): an OrderedDict
        released = _ReleasedOnRead(full_sd)
        full_sd.clear()
        if positional:
            args[2] = released
        else:
            kwargs["full_sd"] = released
        del full_sd
    try:
        return wrapped(*args, **kwargs)
    finally:
        malloc_trim()

"""The wrapper of ``DistributedDataParallel.__init__`` (named by path in this package's patch): CUDA
device ids of a CPU module dropped on the cpu backend, and the unused-parameter probe (``unused.py``)
armed for the first training forward, which turns on DDP's static graph when some parameters get no
gradient."""

from __future__ import annotations

import logging

from accel_npu.patching import argument, passed, with_argument

log = logging.getLogger("accel_npu")

_EXPLICIT = ("find_unused_parameters", "static_graph")


def _before_first_training_forward(ddp, args, kwargs):
    import torch

    # imported here, not at module level: this module is imported when its patch is applied (inside
    # `import torch`)
    from accel_npu._torch.dist import all_ranks_agree
    from accel_npu.plugins.ddp.unused import unused_parameters

    if not (torch.is_grad_enabled() and ddp.training):
        return None  # an eval forward first: wait for the first one that trains
    ddp._accel_npu_probe_handle.remove()
    if ddp.static_graph or ddp.find_unused_parameters:
        return None
    unused = unused_parameters(ddp.module, args, kwargs)
    # Every rank must decide alike (the reducers pair up): static graph if any rank saw unused ones.
    if all_ranks_agree(not unused):
        return None
    ddp._set_static_graph()
    shown = ", ".join(unused[:4]) + (f", ... ({len(unused)} in all)" if len(unused) > 4 else "")
    log.warning(
        "accel-npu: DDP: %s of %s get no gradient in its forward (%s): static_graph on, so DDP "
        "skips them from step 2 instead of failing with 'Expected to have finished reduction' "
        "(find_unused_parameters=True would search the graph every step)",
        f"{len(unused)} parameter(s)" if unused else "parameters on another rank",
        type(ddp.module).__name__,
        shown or "see that rank",
    )
    return None


def _without_cuda_device_ids(args, kwargs):
    """``DDP(module, device_ids=[rank])`` from a CUDA-written script on the cpu backend: the module is
    on the host, and torch raises for device_ids with a CPU module (torch/nn/parallel/distributed.py
    "device_ids and output_device arguments only work with single-device/multiple-device GPU modules
    or CPU modules"). The ids name CUDA devices this machine does not have: drop them."""
    from accel_npu._torch.device import cuda_available
    from accel_npu.backend import current_backend

    ids = argument(args, kwargs, 1, "device_ids")
    out = argument(args, kwargs, 2, "output_device")
    if (ids is None and out is None) or cuda_available() or current_backend().device_type != "cpu":
        return args, kwargs
    module = argument(args, kwargs, 0, "module")
    if any(p.device.type != "cpu" for p in module.parameters()):
        return args, kwargs
    log.info("accel-npu: DDP(device_ids=%s) of a CPU module on the cpu backend: device ids dropped (no CUDA)", ids)
    for position, name in ((1, "device_ids"), (2, "output_device")):
        if passed(args, kwargs, position, name):
            args, kwargs = with_argument(args, kwargs, position, name, None)
    return args, kwargs


def ddp_init(wrapped, instance, args, kwargs):
    args, kwargs = _without_cuda_device_ids(args, kwargs)
    wrapped(*args, **kwargs)
    if any(key in kwargs for key in _EXPLICIT):
        return  # the script chose; positional use of these (arguments 8+) is not seen in practice
    if instance.static_graph or instance.find_unused_parameters:
        return
    if not any(p.requires_grad for p in instance.module.parameters()):
        return
    instance._accel_npu_probe_handle = instance.register_forward_pre_hook(
        _before_first_training_forward, with_kwargs=True
    )

"""Wrappers of ``torch.cuda``'s classes (named by path in this package's patches): ``Event`` and
``Stream`` built for the active device (torch.npu's on npu, the host's in ``facade.py`` on cpu) for the user's code
(torch and installed libraries get torch's own classes), and the ``torch.cuda.device`` context manager."""

from __future__ import annotations

from accel_npu.plugins.cuda_compat import facade


def event_new(wrapped, instance, args, kwargs):
    import torch

    t = None if facade.caller_is_library() else facade.target()
    if t is None or not args or args[0] is not torch.cuda.streams.Event:
        return wrapped(*args, **kwargs)
    return torch.npu.Event(*args[1:], **kwargs) if t == "npu" else facade.CpuEvent(*args[1:], **kwargs)


def stream_new(wrapped, instance, args, kwargs):
    import torch

    t = None if facade.caller_is_library() else facade.target()
    if t is None or not args or args[0] is not torch.cuda.streams.Stream:
        return wrapped(*args, **kwargs)
    if t == "npu":
        return torch.npu.Stream(*(facade.remap(a) for a in args[1:]), **kwargs)
    return facade.CpuStream(*args[1:], **kwargs)


def device_enter(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None:
        return wrapped(*args, **kwargs)
    import torch

    if t == "npu":
        instance._accel_npu_ctx = torch.npu.device(instance.idx)
        return instance._accel_npu_ctx.__enter__()
    instance.prev_idx = facade.cpu_current_device()
    if instance.idx is not None and instance.idx >= 0:
        facade.cpu_set_device(instance.idx)
    return None


def device_exit(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None:
        return wrapped(*args, **kwargs)
    if t == "npu":
        return instance._accel_npu_ctx.__exit__(*args, **kwargs)
    facade.cpu_set_device(instance.prev_idx)
    return False

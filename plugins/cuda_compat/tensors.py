"""Wrappers of the consumers of "cuda" that make tensors (named by path in this package's patches):
``Tensor.to/.cuda``, ``Module.to/.cuda``, factory functions' ``device=`` and ``torch.load``'s
``map_location``, each with "cuda" (or a CUDA ordinal) remapped to the active device."""

from __future__ import annotations

from accel_npu.patching import argument, passed, with_argument
from accel_npu.plugins.cuda_compat import facade


def _cuda_like(d) -> bool:
    return facade.is_cuda_device(d)


def _names_cuda(d) -> bool:
    # Hot path (every .to() and factory call): inline type tests, no further Python calls unless
    # the argument could be a CUDA device.
    kind = type(d)
    if kind is str:
        return d[:4] == "cuda"
    return kind is int or (kind.__name__ == "device" and d.type == "cuda")


def to(wrapped, instance, args, kwargs):
    if args and _names_cuda(args[0]) and facade.target() is not None:
        args = (facade.remap(args[0], ints=True), *args[1:])
    if kwargs:
        device = kwargs.get("device")
        if device is not None and _names_cuda(device) and facade.target() is not None:
            kwargs["device"] = facade.remap(device, ints=True)
    return wrapped(*args, **kwargs)


def _cuda_destination(target: str, device):
    """Where ``.cuda(device)`` goes here: the remapped device, or on npu with no device the current NPU
    (as torch.cuda's own default is the current CUDA device)."""
    if target == "npu" and device is None:
        import torch

        return f"npu:{torch.npu.current_device()}"
    return facade.remap("cuda" if device is None else device, ints=True)


def tensor_cuda(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None or instance is None:
        return wrapped(*args, **kwargs)
    kwargs_to = {"non_blocking": argument(args, kwargs, 1, "non_blocking", False)}
    if "memory_format" in kwargs:
        kwargs_to["memory_format"] = kwargs["memory_format"]
    return instance.to(_cuda_destination(t, argument(args, kwargs, 0, "device")), **kwargs_to)


def module_cuda(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None or instance is None:
        return wrapped(*args, **kwargs)
    return instance.to(_cuda_destination(t, argument(args, kwargs, 0, "device")))


def factory(wrapped, instance, args, kwargs):
    if kwargs:
        device = kwargs.get("device")
        if device is not None and _names_cuda(device) and facade.target() is not None:
            kwargs["device"] = facade.remap(device, ints=True)
    return wrapped(*args, **kwargs)


def load(wrapped, instance, args, kwargs):
    if facade.target() is None:
        return wrapped(*args, **kwargs)
    if passed(args, kwargs, 1, "map_location"):
        location = _map_location(argument(args, kwargs, 1, "map_location"))
        args, kwargs = with_argument(args, kwargs, 1, "map_location", location)
    return wrapped(*args, **kwargs)


def _map_location(location):
    if isinstance(location, dict):
        return {k: facade.remap(v) for k, v in location.items()}
    return facade.remap(location, ints=True) if (type(location) is int or _cuda_like(location)) else location

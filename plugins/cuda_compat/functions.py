"""Wrappers of ``torch.cuda``'s functions (named by path in this package's patches): each answers for
the active device, torch.npu's function on npu, the cpu table on cpu (``facade.py``)."""

from __future__ import annotations

import logging

from accel_npu._torch.once import FirstTime
from accel_npu.plugins.cuda_compat import facade

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and target


def _announce(t: str) -> None:
    if _once(("facade", t)):
        log.warning(
            "accel-npu: torch.cuda answers for %s here (no CUDA; %s); installed libraries still see "
            "torch.cuda.is_available() False (docs/cuda-compat.md)",
            t,
            "torch.npu's functions" if t == "npu" else "CPU equivalents",
        )


def _npu_call(name, args, kwargs):
    import torch

    args = tuple(facade.remap(a) for a in args)
    if "device" in kwargs:
        kwargs["device"] = facade.remap(kwargs["device"])
    return getattr(torch.npu, name)(*args, **kwargs)


def _cpu_table():
    return {
        "device_count": facade.cpu_device_count,
        "current_device": facade.cpu_current_device,
        "set_device": facade.cpu_set_device,
        "get_device_name": facade.cpu_device_name,
        "get_device_properties": lambda device=None: facade.CpuDeviceProperties(),
        "get_device_capability": lambda device=None: (0, 0),
        "is_bf16_supported": lambda including_emulation=True: True,  # cpu autocast runs bf16
        "synchronize": lambda device=None: None,  # the host runs in program order
        "empty_cache": lambda: None,  # no caching allocator on the host
        "memory_allocated": facade.cpu_memory_allocated,
        "max_memory_allocated": facade.cpu_max_memory_allocated,
        "memory_reserved": facade.cpu_memory_allocated,
        "max_memory_reserved": facade.cpu_max_memory_allocated,
        "reset_peak_memory_stats": facade.cpu_reset_peak_memory_stats,
        "current_stream": lambda device=None: facade.CpuStream(device),
        "default_stream": lambda device=None: facade.CpuStream(device),
        # torch.cuda.manual_seed(_all) on a CPU build is already a harmless no-op (queued lazily)
        "manual_seed": None,
        "manual_seed_all": None,
        "is_available": lambda: True,
    }


_CPU: dict | None = None


def _cuda_function(name):
    def wrapper(wrapped, instance, args, kwargs):
        global _CPU
        # Answered for the user's code only. Installed libraries and torch itself get torch's own
        # answer: inductor reads get_device_properties() attributes a façade object lacks
        # (torch/_inductor/codecache.py: gcnArchName), and accel-npu's backend selection asks
        # torch.cuda before a target exists.
        if facade.caller_is_library():
            return wrapped(*args, **kwargs)
        t = facade.target()
        if t is None:
            return wrapped(*args, **kwargs)
        _announce(t)
        if t == "npu":
            return _npu_call(name, args, kwargs)
        if _CPU is None:
            _CPU = _cpu_table()
        impl = _CPU[name]
        return wrapped(*args, **kwargs) if impl is None else impl(*args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = f"cuda_{name}"
    return wrapper


# one wrapper per torch.cuda function, named cuda_<function> (the package's CUDA_FUNCTIONS)
cuda_is_available = _cuda_function("is_available")
cuda_device_count = _cuda_function("device_count")
cuda_current_device = _cuda_function("current_device")
cuda_set_device = _cuda_function("set_device")
cuda_get_device_name = _cuda_function("get_device_name")
cuda_get_device_properties = _cuda_function("get_device_properties")
cuda_get_device_capability = _cuda_function("get_device_capability")
cuda_is_bf16_supported = _cuda_function("is_bf16_supported")
cuda_synchronize = _cuda_function("synchronize")
cuda_empty_cache = _cuda_function("empty_cache")
cuda_memory_allocated = _cuda_function("memory_allocated")
cuda_max_memory_allocated = _cuda_function("max_memory_allocated")
cuda_memory_reserved = _cuda_function("memory_reserved")
cuda_max_memory_reserved = _cuda_function("max_memory_reserved")
cuda_reset_peak_memory_stats = _cuda_function("reset_peak_memory_stats")
cuda_current_stream = _cuda_function("current_stream")
cuda_default_stream = _cuda_function("default_stream")
cuda_manual_seed = _cuda_function("manual_seed")
cuda_manual_seed_all = _cuda_function("manual_seed_all")

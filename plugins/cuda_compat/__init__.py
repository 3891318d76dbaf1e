"""A ``torch.cuda`` façade for CUDA-written plain-PyTorch scripts, where CUDA is really absent.

A script written for GPUs (``assert torch.cuda.is_available()``, ``dist.init_process_group("nccl")``,
``torch.cuda.set_device(rank % torch.cuda.device_count())``, ``model.to(device)``, ``.cuda()``,
``torch.cuda.Event`` timing, ``torch.cuda.max_memory_allocated()``) runs on the active device:
torch.npu's equivalents on the npu backend (what torch_npu's own ``contrib/transfer_to_npu.py``
maps), CPU equivalents or documented no-ops on the cpu backend. Unlike ``transfer_to_npu`` every
entry is a declared, version-gated, reversible patch, ``torch.jit.script`` and ``channels_last``
are untouched, and on a machine with CUDA every wrapper passes straight through.

``torch.device("cuda")`` is a C type and cannot be remapped itself: "cuda" is remapped where it is
consumed (``Tensor.to/.cuda``, ``Module.to/.cuda``, factory functions' ``device=``,
``torch.load(map_location=)``, ``Backend("nccl")``). ``torch.cuda.is_available()`` and
``device_count()`` answer for the active device to the user's code, and the truth to installed
libraries (site-packages, torch), so xformers / bitsandbytes / flash_attn / transformers keep their
non-CUDA paths. docs/cuda-compat.md has the table and the reasons.
"""
from __future__ import annotations

import logging

from accel_npu._torch.once import FirstTime
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument
from . import facade

log = logging.getLogger("accel_npu")

_SUPPORTS = "torch>=2.5,<2.15"
_REMOVE_WHEN = "never for CUDA-written scripts on NPU/CPU (torch keeps treating 'cuda' literally)"
_once = FirstTime()  # one warning per process and cause


def _announce(t: str) -> None:
    if _once(("facade", t)):
        log.warning("accel-npu: torch.cuda answers for %s here (no CUDA; %s); installed libraries still see "
                    "torch.cuda.is_available() False (docs/cuda-compat.md)", t,
                    "torch.npu's functions" if t == "npu" else "CPU equivalents")


# -- torch.cuda functions ---------------------------------------------------------------------------
def _npu_call(name, args, kwargs):
    import torch

    args = tuple(facade.remap(a) for a in args)
    if "device" in kwargs:
        kwargs["device"] = facade.remap(kwargs["device"])
    return getattr(torch.npu, name)(*args, **kwargs)


def _cpu_table():
    import torch

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

#: answered for the user's code only; installed libraries get torch's own answer
_CALLER_SENSITIVE = frozenset({"is_available", "device_count"})


def _cuda_function(name):
    def wrapper(wrapped, instance, args, kwargs):
        global _CPU
        # the caller first: accel-npu's own backend selection asks torch.cuda before a target exists
        if name in _CALLER_SENSITIVE and facade.caller_is_library():
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

    wrapper.__name__ = f"cuda_{name}"
    return wrapper


CUDA_FUNCTIONS = ("is_available", "device_count", "current_device", "set_device", "get_device_name",
                  "get_device_properties", "get_device_capability", "is_bf16_supported", "synchronize",
                  "empty_cache", "memory_allocated", "max_memory_allocated", "memory_reserved",
                  "max_memory_reserved", "reset_peak_memory_stats", "current_stream", "default_stream",
                  "manual_seed", "manual_seed_all")

# torch.cuda re-exports torch.cuda.memory / torch.cuda.random with `from .memory import *`: the
# binding scripts call (torch.cuda.empty_cache) is torch.cuda's own attribute, so that is the target.
# torch_npu/contrib/transfer_to_npu.py maps the same functions to torch.npu, irreversibly.
TORCH_CUDA = [
    Patch(target=f"torch.cuda:{name}", supports=_SUPPORTS,
          reason=f"torch.cuda.{name}() without CUDA raises ('Torch not compiled with CUDA enabled') or "
                 f"misleads; answers for the active device.",
          remove_when=_REMOVE_WHEN, wrapper=_cuda_function(name))
    for name in CUDA_FUNCTIONS
]


def _event_new(wrapped, instance, args, kwargs):
    import torch

    t = facade.target()
    if t is None or not args or args[0] is not torch.cuda.streams.Event:
        return wrapped(*args, **kwargs)
    return torch.npu.Event(*args[1:], **kwargs) if t == "npu" else facade.CpuEvent(*args[1:], **kwargs)


def _stream_new(wrapped, instance, args, kwargs):
    import torch

    t = facade.target()
    if t is None or not args or args[0] is not torch.cuda.streams.Stream:
        return wrapped(*args, **kwargs)
    if t == "npu":
        return torch.npu.Stream(*(facade.remap(a) for a in args[1:]), **kwargs)
    return facade.CpuStream(*args[1:], **kwargs)


def _device_enter(wrapped, instance, args, kwargs):
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


def _device_exit(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None:
        return wrapped(*args, **kwargs)
    if t == "npu":
        return instance._accel_npu_ctx.__exit__(*args, **kwargs)
    facade.cpu_set_device(instance.prev_idx)
    return False


EVENT = Patch(target="torch.cuda.streams:Event.__new__", supports=_SUPPORTS,
              reason="torch.cuda.Event() without CUDA: 'Tried to instantiate dummy base class Event' "
                     "(torch/cuda/streams.py); torch.npu.Event on npu, a host timer on cpu.",
              remove_when=_REMOVE_WHEN, wrapper=_event_new)
STREAM = Patch(target="torch.cuda.streams:Stream.__new__", supports=_SUPPORTS,
               reason="torch.cuda.Stream() without CUDA: 'Tried to instantiate dummy base class Stream'; "
                      "torch.npu.Stream on npu, the host's one in-order stream on cpu.",
               remove_when=_REMOVE_WHEN, wrapper=_stream_new)
DEVICE_ENTER = Patch(target="torch.cuda:device.__enter__", supports=_SUPPORTS,
                     reason="`with torch.cuda.device(i):` raises 'PyTorch was compiled without CUDA support'; "
                            "torch.npu.device on npu, the façade's current index on cpu.",
                     remove_when=_REMOVE_WHEN, wrapper=_device_enter)
DEVICE_EXIT = Patch(target="torch.cuda:device.__exit__", supports=_SUPPORTS,
                    reason="the exit of `with torch.cuda.device(i):` (see torch.cuda:device.__enter__).",
                    remove_when=_REMOVE_WHEN, wrapper=_device_exit)


# -- consumers of "cuda" ----------------------------------------------------------------------------
def _cuda_like(d) -> bool:
    return facade.is_cuda_device(d)


def _names_cuda(d) -> bool:
    # Hot path (every .to() and factory call): inline type tests, no further Python calls unless
    # the argument could be a CUDA device.
    kind = type(d)
    if kind is str:
        return d[:4] == "cuda"
    return kind is int or (kind.__name__ == "device" and d.type == "cuda")


def _to(wrapped, instance, args, kwargs):
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


def _tensor_cuda(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None or instance is None:
        return wrapped(*args, **kwargs)
    kwargs_to = {"non_blocking": argument(args, kwargs, 1, "non_blocking", False)}
    if "memory_format" in kwargs:
        kwargs_to["memory_format"] = kwargs["memory_format"]
    return instance.to(_cuda_destination(t, argument(args, kwargs, 0, "device")), **kwargs_to)


def _module_cuda(wrapped, instance, args, kwargs):
    t = facade.target()
    if t is None or instance is None:
        return wrapped(*args, **kwargs)
    return instance.to(_cuda_destination(t, argument(args, kwargs, 0, "device")))


TENSOR_TO = Patch(target="torch._tensor:Tensor.to", supports=_SUPPORTS,
                  reason="tensor.to('cuda') or to an int CUDA ordinal without CUDA: 'Torch not compiled with CUDA "
                         "enabled'; remapped to the active device (npu:N or cpu).",
                  remove_when=_REMOVE_WHEN, wrapper=_to)
TENSOR_CUDA = Patch(target="torch._tensor:Tensor.cuda", supports=_SUPPORTS,
                    reason="tensor.cuda() without CUDA: 'Torch not compiled with CUDA enabled'; moves to the active "
                           "device instead (transfer_to_npu replaces it with Tensor.npu).",
                    remove_when=_REMOVE_WHEN, wrapper=_tensor_cuda)
MODULE_TO = Patch(target="torch.nn.modules.module:Module.to", supports=_SUPPORTS,
                  reason="model.to('cuda') / model.to(local_rank) without CUDA fails at the first parameter; the device "
                         "is remapped to the active one.",
                  remove_when=_REMOVE_WHEN, wrapper=_to)
MODULE_CUDA = Patch(target="torch.nn.modules.module:Module.cuda", supports=_SUPPORTS,
                    reason="model.cuda() without CUDA fails at the first parameter; moves to the active device.",
                    remove_when=_REMOVE_WHEN, wrapper=_module_cuda)

#: factory functions whose device= scripts set to "cuda" / a CUDA ordinal (transfer_to_npu's
#: torch_fn_white_list, the common part)
FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "linspace",
             "logspace", "eye", "tensor", "as_tensor", "zeros_like", "ones_like", "empty_like", "full_like",
             "rand_like", "randn_like", "randint_like")


def _factory(wrapped, instance, args, kwargs):
    if kwargs:
        device = kwargs.get("device")
        if device is not None and _names_cuda(device) and facade.target() is not None:
            kwargs["device"] = facade.remap(device, ints=True)
    return wrapped(*args, **kwargs)


FACTORY_FUNCTIONS = [
    Patch(target=f"torch:{name}", supports=_SUPPORTS,
          reason=f"torch.{name}(..., device='cuda') without CUDA: 'Torch not compiled with CUDA enabled'; the "
                 f"device is remapped to the active one.",
          remove_when=_REMOVE_WHEN, wrapper=_factory)
    for name in FACTORIES
]


def _load(wrapped, instance, args, kwargs):
    if facade.target() is None:
        return wrapped(*args, **kwargs)
    if len(args) > 1:
        args = (args[0], _map_location(args[1]), *args[2:])
    elif "map_location" in kwargs:
        kwargs["map_location"] = _map_location(kwargs["map_location"])
    return wrapped(*args, **kwargs)


def _map_location(location):
    if isinstance(location, dict):
        return {k: facade.remap(v) for k, v in location.items()}
    return facade.remap(location, ints=True) if (type(location) is int or _cuda_like(location)) else location


LOAD = Patch(target="torch.serialization:load", supports=_SUPPORTS,
             reason="torch.load(map_location='cuda:N') without CUDA: 'Attempting to deserialize object on a CUDA "
                    "device'; remapped to the active device.",
             remove_when=_REMOVE_WHEN, wrapper=_load)


def _backend_new(wrapped, instance, args, kwargs):
    name = args[1] if len(args) > 1 else kwargs.get("name")
    if isinstance(name, str) and "nccl" in name.lower() and facade.target() is not None:
        from accel_npu.backend import current_backend

        backend = current_backend().dist_backend
        if _once(("nccl", backend)):
            log.warning("accel-npu: process-group backend %r runs as %r (no CUDA here)", name, backend)
        # "cuda:nccl,cpu:gloo" and plain "nccl" alike: one backend for the active device
        args = (args[0], backend, *args[2:]) if len(args) > 1 else args
        kwargs = {**kwargs, "name": backend} if "name" in kwargs else kwargs
    return wrapped(*args, **kwargs)


NCCL_BACKEND = Patch(target="torch.distributed.distributed_c10d:Backend.__new__", supports=_SUPPORTS,
                     reason="init_process_group('nccl') without CUDA: 'Distributed package doesn't have NCCL built "
                            "in'; runs the active backend (hccl on npu, gloo on cpu).",
                     remove_when=_REMOVE_WHEN, wrapper=_backend_new)


@hookimpl
def accel_npu_register_patches():
    return [*TORCH_CUDA, EVENT, STREAM, DEVICE_ENTER, DEVICE_EXIT, TENSOR_TO, TENSOR_CUDA, MODULE_TO, MODULE_CUDA,
            *FACTORY_FUNCTIONS, LOAD, NCCL_BACKEND]

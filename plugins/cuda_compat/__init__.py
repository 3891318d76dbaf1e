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

This module declares the patches; the wrappers sit beside it: ``functions.py`` (torch.cuda's functions),
``classes.py`` (``Event``, ``Stream``, ``device``), ``tensors.py`` (``.to``/``.cuda``, factory functions,
``torch.load``), ``distributed.py`` (``Backend("nccl")``), all answering through ``facade.py``.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch
from accel_npu.scopes import CUDA_FACADE

_SUPPORTS = "torch>=2.5.1,<2.16"
_REMOVE_WHEN = "never for CUDA-written scripts on NPU/CPU (torch keeps treating 'cuda' literally)"


# -- torch.cuda functions (functions.py) ------------------------------------------------------------
CUDA_FUNCTIONS = (
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "get_device_name",
    "get_device_properties",
    "get_device_capability",
    "is_bf16_supported",
    "synchronize",
    "empty_cache",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "current_stream",
    "default_stream",
    "manual_seed",
    "manual_seed_all",
)

# torch.cuda re-exports torch.cuda.memory / torch.cuda.random with `from .memory import *`: the
# binding scripts call (torch.cuda.empty_cache) is torch.cuda's own attribute, so that is the target.
# torch_npu/contrib/transfer_to_npu.py maps the same functions to torch.npu, irreversibly.
TORCH_CUDA = [
    Patch(
        target=f"torch.cuda:{name}",
        supports=_SUPPORTS,
        reason=f"torch.cuda.{name}() without CUDA raises ('Torch not compiled with CUDA enabled') or "
        f"misleads; answers for the active device.",
        remove_when=_REMOVE_WHEN,
        wrapper=f".functions:cuda_{name}",
        scope=CUDA_FACADE,
    )
    for name in CUDA_FUNCTIONS
]


# -- torch.cuda classes (classes.py) ----------------------------------------------------------------
EVENT = Patch(
    target="torch.cuda.streams:Event.__new__",
    supports=_SUPPORTS,
    reason="torch.cuda.Event() without CUDA: 'Tried to instantiate dummy base class Event' "
    "(torch/cuda/streams.py); torch.npu.Event on npu, a host timer on cpu.",
    remove_when=_REMOVE_WHEN,
    wrapper=".classes:event_new",
    scope=CUDA_FACADE,
)
STREAM = Patch(
    target="torch.cuda.streams:Stream.__new__",
    supports=_SUPPORTS,
    reason="torch.cuda.Stream() without CUDA: 'Tried to instantiate dummy base class Stream'; "
    "torch.npu.Stream on npu, the host's one in-order stream on cpu.",
    remove_when=_REMOVE_WHEN,
    wrapper=".classes:stream_new",
    scope=CUDA_FACADE,
)
DEVICE_ENTER = Patch(
    target="torch.cuda:device.__enter__",
    supports=_SUPPORTS,
    reason="`with torch.cuda.device(i):` raises 'PyTorch was compiled without CUDA support'; "
    "torch.npu.device on npu, the façade's current index on cpu.",
    remove_when=_REMOVE_WHEN,
    wrapper=".classes:device_enter",
    scope=CUDA_FACADE,
)
DEVICE_EXIT = Patch(
    target="torch.cuda:device.__exit__",
    supports=_SUPPORTS,
    reason="the exit of `with torch.cuda.device(i):` (see torch.cuda:device.__enter__).",
    remove_when=_REMOVE_WHEN,
    wrapper=".classes:device_exit",
    scope=CUDA_FACADE,
)


# -- consumers of "cuda" (tensors.py, distributed.py) -----------------------------------------------
TENSOR_TO = Patch(
    target="torch._tensor:Tensor.to",
    supports=_SUPPORTS,
    reason="tensor.to('cuda') or to an int CUDA ordinal without CUDA: 'Torch not compiled with CUDA "
    "enabled'; remapped to the active device (npu:N or cpu).",
    remove_when=_REMOVE_WHEN,
    wrapper=".tensors:to",
    scope=CUDA_FACADE,
)
TENSOR_CUDA = Patch(
    target="torch._tensor:Tensor.cuda",
    supports=_SUPPORTS,
    reason="tensor.cuda() without CUDA: 'Torch not compiled with CUDA enabled'; moves to the active "
    "device instead (transfer_to_npu replaces it with Tensor.npu).",
    remove_when=_REMOVE_WHEN,
    wrapper=".tensors:tensor_cuda",
    scope=CUDA_FACADE,
)
MODULE_TO = Patch(
    target="torch.nn.modules.module:Module.to",
    supports=_SUPPORTS,
    reason="model.to('cuda') / model.to(local_rank) without CUDA fails at the first parameter; the device "
    "is remapped to the active one.",
    remove_when=_REMOVE_WHEN,
    wrapper=".tensors:to",
    scope=CUDA_FACADE,
)
MODULE_CUDA = Patch(
    target="torch.nn.modules.module:Module.cuda",
    supports=_SUPPORTS,
    reason="model.cuda() without CUDA fails at the first parameter; moves to the active device.",
    remove_when=_REMOVE_WHEN,
    wrapper=".tensors:module_cuda",
    scope=CUDA_FACADE,
)

#: factory functions whose device= scripts set to "cuda" / a CUDA ordinal (transfer_to_npu's
#: torch_fn_white_list, the common part)
FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "tensor",
    "as_tensor",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
)

FACTORY_FUNCTIONS = [
    Patch(
        target=f"torch:{name}",
        supports=_SUPPORTS,
        reason=f"torch.{name}(..., device='cuda') without CUDA: 'Torch not compiled with CUDA enabled'; the "
        f"device is remapped to the active one.",
        remove_when=_REMOVE_WHEN,
        wrapper=".tensors:factory",
        scope=CUDA_FACADE,
    )
    for name in FACTORIES
]

LOAD = Patch(
    target="torch.serialization:load",
    supports=_SUPPORTS,
    reason="torch.load(map_location='cuda:N') without CUDA: 'Attempting to deserialize object on a CUDA "
    "device'; remapped to the active device.",
    remove_when=_REMOVE_WHEN,
    wrapper=".tensors:load",
    scope=CUDA_FACADE,
)

NCCL_BACKEND = Patch(
    target="torch.distributed.distributed_c10d:Backend.__new__",
    supports=_SUPPORTS,
    reason="init_process_group('nccl') without CUDA: 'Distributed package doesn't have NCCL built "
    "in'; runs the active backend (hccl on npu, gloo on cpu).",
    remove_when=_REMOVE_WHEN,
    wrapper=".distributed:backend_new",
    scope=CUDA_FACADE,
)


@hookimpl
def accel_npu_explain_error(error):
    from accel_npu.plugins.cuda_compat import explain

    return explain.explain_error(error)


@hookimpl
def accel_npu_register_patches():
    return [
        *TORCH_CUDA,
        EVENT,
        STREAM,
        DEVICE_ENTER,
        DEVICE_EXIT,
        TENSOR_TO,
        TENSOR_CUDA,
        MODULE_TO,
        MODULE_CUDA,
        *FACTORY_FUNCTIONS,
        LOAD,
        NCCL_BACKEND,
    ]

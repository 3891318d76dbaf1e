"""STAND-IN for torch_npu, used only by tests/contract (never installed, never shipped).

It models exactly the parts of torch_npu's behaviour that accel-npu's contract
(docs/npu-contract.md) relies on, so the npu plugin can be tested on a machine without Ascend:

- ``import torch_npu`` registers ``torch.npu`` (is_available, device_count, config,
  get_amp_supported_dtype) like the real package's ``torch._register_device_module("npu", ...)``;
  ``torch.npu.config`` is write-only, as upstream's ``_npuConfig`` (see below);
- device_count honours ASCEND_RT_VISIBLE_DEVICES exactly as torch_npu/npu/__init__.py does
  (ids must be ascending, else 0 devices); the machine's count comes from
  STANDIN_NPU_DEVICE_COUNT (default 8); is_available() is device_count() > 0 (same file);
- loading fails the way the real wheel's ``libtorch_npu.so`` load fails:
  * torch/torch_npu base versions differ -> ImportError "...libtorch_npu.so: undefined symbol: ..."
  * STANDIN_REQUIRE_LD_LIBRARY_PATH=1 and torch_npu/lib not on LD_LIBRARY_PATH ->
    OSError "libc10.so: cannot open shared object file: No such file or directory"
  (the real failure comes from the dynamic loader; here the package raises the same message).
"""

import importlib.metadata
import os
import types

# Mirrors torch_npu/__init__.py (v7.2.0-pytorch2.7.1, lines 13-15 and `_autoload`): autoload is switched
# off while torch_npu imports torch (no circular autoload) and restored by `_autoload`, the function its
# `torch.backends` entry point names (setup.py: 'torch_npu = torch_npu:_autoload'); make_site(autoload=True)
# writes that entry point. A failed import leaves the switch at "0", as upstream does.
ORG_AUTOLOAD = os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402 - after TORCH_DEVICE_BACKEND_AUTOLOAD is set, as upstream

__version__ = importlib.metadata.version("torch_npu")  # upstream: torch_npu/version.py, written at build time
_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def _base(v):
    return v.split("+")[0].split(".post")[0]


# The two load failures below are the dynamic loader's (dlopen of torch_npu/lib/libtorch_npu.so), not
# torch_npu code: torch 2.7.0 beside torch_npu 2.7.1 (undefined symbol) and libc10.so not on the loader
# path, as users met them; the stand-in raises the same messages from Python.
if _base(__version__) != _base(torch.__version__):
    raise ImportError(f"{_LIB}/libtorch_npu.so: undefined symbol: _ZN3c1021throwNullDataPtrErrorEv")
if os.environ.get("STANDIN_MISSING_CANN_LIB"):
    # Mirrors torch_npu/_init/core/module_loader.py `_check_npu_import` (Ascend/pytorch master
    # 9e73e708a; torch_npu/__init__.py's `import torch_npu.npu` guard in v7.2.0-pytorch2.7.1): a CANN
    # library the loader cannot find (CANN's set_env.sh not sourced), with the hint torch_npu appends
    # for libhccl.so without ASCEND_OPP_PATH.
    _lib = os.environ["STANDIN_MISSING_CANN_LIB"]
    raise ImportError(
        f"{_lib}: cannot open shared object file: No such file or directory. Please check that the "
        "cann package is installed. Please run 'source set_env.sh' in the CANN installation path."
    )
if os.environ.get("STANDIN_REQUIRE_LD_LIBRARY_PATH") == "1":
    entries = [os.path.realpath(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if os.path.realpath(_LIB) not in entries:
        raise OSError("libc10.so: cannot open shared object file: No such file or directory")


def _parse_visible_devices():
    # Mirrors torch_npu/npu/__init__.py `_parse_visible_devices` (Ascend/pytorch master 9e73e708a):
    # unset -> 0..63; digits and commas only, reading stops at any other character.
    var = os.getenv("ASCEND_RT_VISIBLE_DEVICES")
    if var is None:
        return list(range(64))
    rc = []
    if not var:
        return rc
    for idx, c in enumerate(var):
        if not (c.isdigit() or c == ","):
            break
        if idx + 1 == len(var):
            idx += 1
    for elem in var[:idx].split(","):
        if not elem:
            return rc
        rc.append(int(elem))
    return rc


def _raw_device_count_ascend_hal():
    # Mirrors torch_npu/npu/__init__.py `_raw_device_count_ascend_hal` (same commit; also v7.1.0.2-pytorch2.6.0,
    # v7.2.0-pytorch2.7.1, v7.3.1-pytorch2.7.1): libascend_hal's drvGetDevNum, before ASCEND_RT_VISIBLE_DEVICES;
    # -1 when the driver call fails. Here STANDIN_NPU_DEVICE_COUNT (default 8).
    return int(os.environ.get("STANDIN_NPU_DEVICE_COUNT", "8"))


def _device_count():
    # Mirrors torch_npu/npu/__init__.py `_device_count_ascend_hal` (same commit): the raw count
    # (libascend_hal drvGetDevNum; here STANDIN_NPU_DEVICE_COUNT), then the visible ids in order:
    # ids not strictly ascending -> 0 devices; the first id past the raw count ends the list.
    visible = _parse_visible_devices()
    if not visible:
        return 0
    raw = _raw_device_count_ascend_hal()
    if raw <= 0:
        return raw
    for idx, val in enumerate(visible):
        if idx > 0 and val <= visible[idx - 1]:
            return 0
        if val >= raw:
            return idx
    return len(visible)


npu = types.ModuleType("torch_npu.npu")
# Mirrors torch_npu/npu/__init__.py `is_available` (v7.2.0-pytorch2.7.1, master 9e73e708a): device_count() > 0.
npu.is_available = lambda: _device_count() > 0
npu.device_count = _device_count
npu._raw_device_count_ascend_hal = _raw_device_count_ascend_hal
# Mirrors torch_npu/npu/npu_config.py `_npuConfig` (Ascend/pytorch v7.1.0.2-pytorch2.6.0 and
# master 9e73e708a): the class defines only a classmethod __setattr__ that forwards
# allow_internal_format to the C++ option ALLOW_INTERNAL_FORMAT and stores nothing, so *reading*
# torch.npu.config.allow_internal_format raises AttributeError. The option's default is already
# "disable" (csrc/core/npu/sys_ctrl/npu_sys_ctrl.cpp SetDefaultAllowInternalFromatDisable).
_C = types.SimpleNamespace(options_set=[])  # stand-in bookkeeping: what torch_npu._C._npu_setOption received
_C._npu_setOption = _C.options_set.append


class _npuConfig:
    @classmethod
    def __setattr__(cls, name, value):
        if name == "allow_internal_format":
            _C._npu_setOption({"ALLOW_INTERNAL_FORMAT": "enable" if value else "disable"})


npu.config = _npuConfig()
# Mirrors torch_npu/npu/utils.py `is_bf16_supported` -> csrc/core/npu/NpuVariables.cpp `IsBF16Supported`:
# `GetSocVersion() >= SocVersion::Ascend910B1`, in the enum order of NpuVariables.h (v7.2.0-pytorch2.7.1;
# an unknown SoC is UnsupportedSocVersion = -1): 910A/ProA/PremiumA, 910ProB/910B and 310P have no bf16.
# The SoC here: STANDIN_NPU_SOC (default Ascend910B1). torch_npu/npu/autocast_utils.py
# `get_amp_supported_dtype` lists bf16 only when supported (master 9e73e708a, mirrored below, adds float32
# to both lists; v7.2.0-pytorch2.7.1 returns [float16, bfloat16] / [float16]).
_SOC_VERSION = {
    "Ascend910PremiumA": 100,
    "Ascend910ProA": 101,
    "Ascend910A": 102,
    "Ascend910ProB": 103,
    "Ascend910B": 104,
    "Ascend310P1": 200,
    "Ascend310P2": 201,
    "Ascend310P3": 202,
    "Ascend310P4": 203,
    "Ascend310P5": 204,
    "Ascend310P7": 205,
    "Ascend910B1": 220,
    "Ascend910B2": 221,
    "Ascend910B2C": 222,
    "Ascend910B3": 223,
    "Ascend910B4": 224,
    "Ascend910B4-1": 225,
    "Ascend310B1": 240,
    "Ascend310B2": 241,
    "Ascend310B3": 242,
    "Ascend310B4": 243,
    "Ascend910_9391": 250,
    "Ascend910_9392": 251,
    "Ascend910_9381": 252,
    "Ascend910_9382": 253,
    "Ascend910_9372": 254,
    "Ascend910_9362": 255,
}
npu.is_bf16_supported = lambda including_emulation=False: (
    _SOC_VERSION.get(os.environ.get("STANDIN_NPU_SOC", "Ascend910B1"), -1) >= _SOC_VERSION["Ascend910B1"]
)
# Mirrors torch_npu/npu/__init__.py `get_device_name` (the SoC name from the runtime, e.g. Ascend910B1)
# and torch_npu/npu/utils.py `get_cann_version` (v7.1.0.2-pytorch2.6.0 and later); here STANDIN_NPU_SOC
# and STANDIN_CANN_VERSION.
npu.get_device_name = lambda device_name=None: os.environ.get("STANDIN_NPU_SOC", "Ascend910B1")
npu.utils = types.ModuleType("torch_npu.npu.utils")
npu.utils.get_cann_version = lambda module="CANN": os.environ.get("STANDIN_CANN_VERSION", "8.2.RC1")
npu.utils.is_bf16_supported = None  # set below
npu.get_amp_supported_dtype = lambda: (
    [torch.float16, torch.bfloat16, torch.float32] if npu.is_bf16_supported() else [torch.float16, torch.float32]
)
# Mirrors torch_npu/npu/__init__.py `_lazy_init` and `_after_fork` (master 9e73e708a; v7.1.0.2-pytorch2.6.0
# has the same): the first NPU call initialises the device in this process; a child that
# multiprocessing forks after that (a DataLoader worker) is marked bad (registered with
# multiprocessing.util.register_after_fork), and its first NPU call raises.
_initialized = False
_original_pid = None
_is_internal_in_bad_fork = False


def _lazy_init():
    global _initialized, _original_pid
    if _initialized:
        return
    if _is_internal_in_bad_fork:
        raise RuntimeError(
            "Cannot re-initialize NPU in forked subprocess. To use NPU with "
            "multiprocessing, you must use the 'spawn' start method"
        )
    _initialized, _original_pid = True, os.getpid()


def _after_fork(arg):
    global _initialized, _is_internal_in_bad_fork
    if _initialized and _original_pid != os.getpid():
        _initialized = False
        _is_internal_in_bad_fork = True


import multiprocessing.util as _mp_util  # noqa: E402 - kept beside the fork handling it serves, as upstream

_mp_util.register_after_fork(_after_fork, _after_fork)
npu._lazy_init = _lazy_init
# Mirrors torch_npu/npu/__init__.py `_lazy_call` and torch_npu/npu/random.py `manual_seed`/`manual_seed_all`
# (v7.3.1-pytorch2.7.1): seeding runs now in an initialised process and is queued otherwise, so a forked
# DataLoader worker's torch.manual_seed (torch/random.py seeds every device module) does not raise; its first
# real NPU call does.
_queued_calls = []


def _lazy_call(cb):
    if _initialized:
        cb()
    else:
        _queued_calls.append(cb)


npu.manual_seed = lambda seed: _lazy_call(lambda: None)
npu.manual_seed_all = lambda seed: _lazy_call(lambda: None)
# what accelerate's CLI touches at import time (accelerate.test_utils.testing.get_backend); upstream:
# torch_npu/npu/__init__.py and torch_npu/npu/memory.py (no device here: synchronize only initialises,
# as torch_npu/npu/utils.py `synchronize` calls _lazy_init first)
npu.memory_allocated = lambda device=None: 0
npu.current_device = lambda: 0
npu.set_device = lambda device: None
npu.synchronize = lambda device=None: _lazy_init()
npu.empty_cache = lambda: None
# Mirrors torch_npu/npu/__init__.py `from .streams import Stream, Event, ...` (master 9e73e708a, line 168):
# the classes are attributes of torch.npu (DeepSpeed's npu_accelerator.py reads `torch.npu.Event` when
# deepspeed.utils.timer is imported; accelerate imports deepspeed from transformers' save_pretrained).
# Constructing one needs a device (torch_npu/npu/streams.py: _NPUStreamBase / _NPUEventBase); the stand-in has none.


class _NeedsDevice:
    def __new__(cls, *args, **kwargs):
        raise RuntimeError(f"stand-in torch_npu: torch.npu.{cls.__name__} needs an NPU")


npu.Stream = type("Stream", (_NeedsDevice,), {"__module__": "torch_npu.npu.streams"})
npu.Event = type("Event", (_NeedsDevice,), {"__module__": "torch_npu.npu.streams"})
# Mirrors torch_npu/__init__.py (v7.2.0-pytorch2.7.1: `for name in dir(torch.ops.npu): globals()[name] = ...`):
# the NPU kernels are attributes of the package, and transformers imports one whenever torch_npu is
# installed (transformers/integrations/npu_flash_attention.py `from torch_npu import npu_fusion_attention`).
# The stand-in has no NPU, so calling one raises; except the fused attention and its grad, which accel-npu's
# backward for diffusers' NPU attention backend calls: modelled in plain torch math on the inputs' device
# (_fusion_attention.py, citing op-plugin for each behaviour), so its gradients can be checked.


def _kernel(name):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"stand-in torch_npu: {name} needs an NPU")

    kernel.__name__ = name
    return kernel


for _name in ("npu_rms_norm", "npu_rotary_mul"):
    globals()[_name] = _kernel(_name)
from torch_npu._fusion_attention import npu_fusion_attention, npu_fusion_attention_grad  # noqa: E402, F401 - kernels

# Mirrors torch_npu/__init__.py lines 201-203 (v7.2.0-pytorch2.7.1): rename privateuse1 to "npu" and register
# torch_npu.npu as torch.npu.
torch.utils.rename_privateuse1_backend("npu")
npu.utils.is_bf16_supported = npu.is_bf16_supported
torch._register_device_module("npu", npu)
import sys as _sys  # noqa: E402 - kept beside the registration it serves, as upstream

_sys.modules["torch_npu.npu"] = npu
_sys.modules["torch_npu.npu.utils"] = npu.utils


def _autoload():
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = ORG_AUTOLOAD

"""STAND-IN for torch_npu, used only by tests/contract (never installed, never shipped).

It models exactly the parts of torch_npu's behaviour that accel-npu's contract
(docs/npu-contract.md) relies on, so the npu plugin can be tested on a machine without Ascend:

- ``import torch_npu`` registers ``torch.npu`` (is_available, device_count, config,
  get_amp_supported_dtype) like the real package's ``torch._register_device_module("npu", ...)``;
- device_count honours ASCEND_RT_VISIBLE_DEVICES; the machine's count comes from
  STANDIN_NPU_DEVICE_COUNT (default 8);
- loading fails the way the real wheel's ``libtorch_npu.so`` load fails:
  * torch/torch_npu base versions differ -> ImportError "...libtorch_npu.so: undefined symbol: ..."
  * STANDIN_REQUIRE_LD_LIBRARY_PATH=1 and torch_npu/lib not on LD_LIBRARY_PATH ->
    OSError "libc10.so: cannot open shared object file: No such file or directory"
  (the real failure comes from the dynamic loader; here the package raises the same message).
"""
import importlib.metadata
import os
import types

import torch

__version__ = importlib.metadata.version("torch_npu")
_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")


def _base(v):
    return v.split("+")[0].split(".post")[0]


if _base(__version__) != _base(torch.__version__):
    raise ImportError(f"{_LIB}/libtorch_npu.so: undefined symbol: _ZN3c1021throwNullDataPtrErrorEv")
if os.environ.get("STANDIN_REQUIRE_LD_LIBRARY_PATH") == "1":
    entries = [os.path.realpath(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if os.path.realpath(_LIB) not in entries:
        raise OSError("libc10.so: cannot open shared object file: No such file or directory")


def _device_count():
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    machine = int(os.environ.get("STANDIN_NPU_DEVICE_COUNT", "8"))
    if visible:
        return min(machine, len([d for d in visible.split(",") if d.strip()]))
    return machine


npu = types.ModuleType("torch_npu.npu")
npu.is_available = lambda: _device_count() > 0
npu.device_count = _device_count
npu.config = types.SimpleNamespace(allow_internal_format=True)
npu.get_amp_supported_dtype = lambda: [torch.float16, torch.bfloat16]
# what accelerate's CLI touches at import time (accelerate.test_utils.testing.get_backend)
npu.memory_allocated = lambda device=None: 0
npu.current_device = lambda: 0
npu.set_device = lambda device: None
npu.synchronize = lambda device=None: None
npu.empty_cache = lambda: None
torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)

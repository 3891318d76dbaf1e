"""The wrappers of ``torch.autocast.__init__``, of layer/group norm and of cat/stack (named by path in this
package's patches): autocast("cuda") without CUDA runs on the active backend's device (npu, or cpu) with
the requested dtype, where stock torch disables it and the script silently trains in fp32; on cpu, the
calls where CPU's autocast op lists stop a half model that CUDA's and NPU's run (norms with half weights
beside other activations, cat/stack of another half dtype) run as those run them."""

from __future__ import annotations

import logging

from accel_npu._torch.device import cuda_available
from accel_npu._torch.once import FirstTime
from accel_npu.patching import argument, passed, with_argument

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and cause


def autocast_init(wrapped, instance, args, kwargs):
    # autocast.__init__(self, device_type, dtype=None, enabled=True, cache_enabled=None)
    if not passed(args, kwargs, 0, "device_type"):
        return wrapped(*args, **kwargs)
    device_type = argument(args, kwargs, 0, "device_type")
    if device_type != "cuda" or cuda_available():
        return wrapped(*args, **kwargs)
    import torch

    from accel_npu.backend import current_backend

    target = current_backend().device_type
    if target == "cuda":  # forced cuda backend without CUDA: nothing sensible to remap to
        return wrapped(*args, **kwargs)
    # keep the dtype CUDA would have used: the explicit one, else CUDA's autocast default (fp16)
    dtype = argument(args, kwargs, 1, "dtype")
    if dtype is None:
        dtype = torch.get_autocast_dtype("cuda")
    args, kwargs = with_argument(args, kwargs, 0, "device_type", target)
    args, kwargs = with_argument(args, kwargs, 1, "dtype", dtype)
    supported = _amp_dtypes(target)
    if supported is not None and dtype not in supported:
        # e.g. bf16 on a 910A: torch would disable autocast with a generic warning; say what happens
        if _once(("autocast-unsupported", target, dtype)):
            log.warning(
                "accel-npu: torch.autocast('cuda', dtype=%s): this %s has no %s autocast (supported: %s; "
                "an Ascend 910A has no bf16), so autocast is off and the forward runs in float32. "
                "dtype=torch.float16 gives mixed precision here.",
                _name(dtype),
                target,
                _name(dtype),
                ", ".join(_name(d) for d in supported),
            )
        args, kwargs = with_argument(args, kwargs, 2, "enabled", False)
        return wrapped(*args, **kwargs)
    if _once(("autocast", target, dtype)):
        log.warning(
            "accel-npu: torch.autocast('cuda', dtype=%s) runs as torch.autocast(%r, dtype=%s) "
            "(no CUDA here; stock torch would disable autocast and run fp32)",
            str(dtype).replace("torch.", ""),
            target,
            str(dtype).replace("torch.", ""),
        )
    return wrapped(*args, **kwargs)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _amp_dtypes(device_type: str):
    """The autocast dtypes of a device module that declares them (torch_npu: torch.npu, per SoC)."""
    import torch

    module = getattr(torch, device_type, None) if device_type not in ("cpu", "cuda") else None
    getter = getattr(module, "get_amp_supported_dtype", None)
    try:
        return list(getter()) if getter is not None else None
    except Exception:  # noqa: BLE001 - unknown: let torch decide
        return None


def norm_in_fp32(wrapped, instance, args, kwargs):
    """F.layer_norm / F.group_norm under CPU autocast with half weights and activations of
    another dtype: run in float32, as CUDA's autocast (AT_FORALL_FP32 in ATen/autocast_mode.h) and torch_npu's
    (torch_npu/csrc/aten/AutoCastOps.cpp) run these ops. CPU's autocast lists none of them, so
    `autocast("cuda")` remapped to cpu stops where the GPU run goes on: "mixed dtype (CPU): expect parameter
    to have scalar type of Float". Calls whose dtypes agree run as stock."""
    import torch

    x = argument(args, kwargs, 0, "input")
    weight = argument(args, kwargs, 2, "weight")
    if (
        weight is None
        or x is None
        or x.dtype == weight.dtype
        or weight.dtype not in (torch.float16, torch.bfloat16)
        or x.device.type != "cpu"
        or not torch.is_autocast_enabled("cpu")
    ):
        return wrapped(*args, **kwargs)

    def fp32(value):
        return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    with torch.autocast("cpu", enabled=False):
        return wrapped(*(fp32(a) for a in args), **{k: fp32(v) for k, v in kwargs.items()})


def concat_as_on_cuda(wrapped, instance, args, kwargs):
    """torch.cat / torch.stack under CPU autocast of tensors in a half dtype other than autocast's (a bf16
    model's outputs beside autocast("cuda")'s fp16): CPU's autocast promotes these two ops
    (``KERNEL_CPU(cat, promote)``, aten/src/ATen/autocast_mode.cpp) and refuses that mix ("Unexpected floating
    ScalarType in at::autocast::prioritize"); CUDA's and torch_npu's autocast leave them alone, so they
    concatenate with type promotion. Here too, autocast off for the call. Any other call runs as stock."""
    import torch

    tensors = argument(args, kwargs, 0, "tensors")
    if type(tensors) not in (list, tuple) or not torch.is_autocast_enabled("cpu"):
        return wrapped(*args, **kwargs)
    low = torch.get_autocast_dtype("cpu")
    if not any(
        isinstance(t, torch.Tensor) and t.dtype != low and t.dtype in (torch.float16, torch.bfloat16) for t in tensors
    ):
        return wrapped(*args, **kwargs)
    with torch.autocast("cpu", enabled=False):
        return wrapped(*args, **kwargs)

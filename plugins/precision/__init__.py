"""CUDA-written precision code on NPU / CPU: autocast("cuda"), bf16 ``.numpy()``, fused AdamW.

- ``torch.autocast("cuda")`` / ``torch.amp.autocast(device_type="cuda")`` / ``torch.cuda.amp.autocast``
  without CUDA: stock torch *disables* autocast with a warning, so the script silently runs fp32.
  We run autocast on the active backend's device (npu, or cpu) with the requested dtype and log
  the remap once. On a machine where CUDA is available nothing changes.
- ``torch.amp.GradScaler("cuda")`` / ``torch.GradScaler("cuda")`` / ``torch.cuda.amp.GradScaler()``
  without CUDA: stock torch disables the scaler (torch/amp/grad_scaler.py, "CUDA is not
  available.  Disabling."). Once autocast("cuda") really runs fp16 on npu/cpu, that would be fp16
  training without loss scaling, so a "cuda" scaler scales on the device autocast goes to.
- accelerate's ``mixed_precision: fp16`` on the cpu backend: stock accelerate runs fp32 there (no
  autocast, no scaler); the cpu backend debugs an npu fp16 config, so it runs fp16 with a scaler.
- ``tensor.numpy()`` on bfloat16: stock raises ``TypeError: Got unsupported
  ScalarType BFloat16``; we return a float32 array (one warning). Other dtypes are untouched.
- ``AdamW(fused=True)``: where the installed torch / torch_npu
  rejects the fused kernel for a device or dtype, fall back to the foreach implementation with one
  warning instead of raising. On the npu backend AdamW defaults to the fused kernel and never
  hands a GradScaler's ``grad_scale``/``found_inf`` to it (torch_npu's fused mode does not take
  them); the scaler unscales the gradients itself instead.
- float64 on the npu backend (docs/float64.md): many NPU kernels reject float64/complex128
  (diffusers #10428); diffusers downcasts its RoPE tables on "npu" devices
  (``maybe_adjust_dtype_for_device``) except where a model guards only "mps". ``float64.py`` covers
  those paths in the models the official training scripts train.
"""
from __future__ import annotations

import logging
import warnings

from accel_npu._torch.device import cuda_available
from accel_npu._torch.once import FirstTime
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and cause


# -- 1. autocast("cuda") ----------------------------------------------------------------------------
def _autocast_init(wrapped, instance, args, kwargs):
    if args:
        device_type, rest = args[0], args[1:]
    elif "device_type" in kwargs:
        device_type, rest = kwargs.pop("device_type"), ()
    else:
        return wrapped(*args, **kwargs)
    if device_type != "cuda" or cuda_available():
        return wrapped(device_type, *rest, **kwargs)
    import torch

    from accel_npu.backend import current_backend

    target = current_backend().device_type
    if target == "cuda":  # forced cuda backend without CUDA: nothing sensible to remap to
        return wrapped(device_type, *rest, **kwargs)
    # keep the dtype CUDA would have used: the explicit one, else CUDA's autocast default (fp16)
    if rest:
        dtype, rest = rest[0], rest[1:]
    else:
        dtype = kwargs.pop("dtype", None)
    if dtype is None:
        dtype = torch.get_autocast_dtype("cuda")
    supported = _amp_dtypes(target)
    if supported is not None and dtype not in supported:
        # e.g. bf16 on a 910A: torch would disable autocast with a generic warning; say what happens
        if _once(("autocast-unsupported", target, dtype)):
            log.warning("accel-npu: torch.autocast('cuda', dtype=%s): this %s has no %s autocast (supported: %s; "
                        "an Ascend 910A has no bf16), so autocast is off and the forward runs in float32. "
                        "dtype=torch.float16 gives mixed precision here.", _name(dtype), target, _name(dtype),
                        ", ".join(_name(d) for d in supported))
        kwargs["enabled"] = False
        return wrapped(target, dtype, *rest, **kwargs)
    if _once(("autocast", target, dtype)):
        log.warning("accel-npu: torch.autocast('cuda', dtype=%s) runs as torch.autocast(%r, dtype=%s) "
                    "(no CUDA here; stock torch would disable autocast and run fp32)",
                    str(dtype).replace("torch.", ""), target, str(dtype).replace("torch.", ""))
    return wrapped(target, dtype, *rest, **kwargs)


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


AUTOCAST = Patch(
    target="torch.amp.autocast_mode:autocast.__init__",
    supports="torch>=2.5,<2.15",
    reason="autocast('cuda') without CUDA: torch/amp/autocast_mode.py disables autocast with a warning "
           "and the script silently trains in fp32; it runs on the active device.",
    remove_when="never for CUDA-written scripts on NPU/CPU (torch will keep treating 'cuda' literally)",
    wrapper=_autocast_init,
)


# -- 1b. GradScaler("cuda") -------------------------------------------------------------------------
def _grad_scaler_init(wrapped, instance, args, kwargs):
    if args:
        device, rest = args[0], args[1:]
    else:
        device, rest = kwargs.pop("device", "cuda"), ()
    if device != "cuda" or cuda_available():
        return wrapped(device, *rest, **kwargs)
    from accel_npu.backend import current_backend

    target = current_backend().device_type
    if target == "cuda":  # forced cuda backend without CUDA: torch disables the scaler, as stock
        return wrapped(device, *rest, **kwargs)
    if _once(("grad-scaler", target)):
        log.warning("accel-npu: GradScaler('cuda') scales on %r, the device autocast('cuda') runs on "
                    "(no CUDA here; stock torch would disable loss scaling)", target)
    return wrapped(target, *rest, **kwargs)


GRAD_SCALER = Patch(
    target="torch.amp.grad_scaler:GradScaler.__init__",
    supports="torch>=2.5,<2.15",
    # torch_npu implements _amp_foreach_non_finite_check_and_unscale_ / _amp_update_scale_ for npu
    # (Ascend/pytorch test/custom_ops/test_amp_foreach_non_finite_check_and_unscale.py).
    reason="torch/amp/grad_scaler.py disables a 'cuda' GradScaler without CUDA, so fp16 autocast on "
           "npu/cpu trains unscaled; it scales on the autocast device.",
    remove_when="never for CUDA-written scripts on NPU/CPU (torch will keep treating 'cuda' literally)",
    wrapper=_grad_scaler_init,
)


# -- 1c. accelerate's fp16 on the cpu backend -------------------------------------------------------
def _accelerator_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    from accelerate.utils import DistributedType

    if (instance.state.mixed_precision != "fp16" or instance.native_amp or instance.device.type != "cpu"
            or instance.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
            or cuda_available()):
        return
    from accel_npu.backend import current_backend

    if current_backend().device_type != "cpu":
        return
    from accelerate.utils import get_grad_scaler
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    # accelerate's own fp16 branch (accelerator.py, "fp16 mixed precision requires a device"), the
    # device being cpu: its "cuda" scalers scale on cpu through GRAD_SCALER
    kwargs = instance.scaler_handler.to_kwargs() if instance.scaler_handler is not None else {}
    instance.native_amp = True
    instance.scaler = (get_fsdp2_grad_scaler(device="cpu", **kwargs) if instance.is_fsdp2
                       else get_grad_scaler(instance.distributed_type, **kwargs))
    if _once("accelerate-fp16-cpu"):
        log.warning("accel-npu: mixed_precision fp16 runs on the cpu backend (autocast fp16 with loss "
                    "scaling, as on npu); stock accelerate runs fp32 on cpu")


ACCELERATOR_FP16_CPU = Patch(
    target="accelerate.accelerator:Accelerator.__init__",
    supports="accelerate>=1.10,<1.16",
    reason="accelerate ignores mixed_precision fp16 on a cpu device (fp32, no scaler): the cpu backend "
           "debugs an npu fp16 config, so it runs fp16 with loss scaling.",
    remove_when="accelerate runs fp16 autocast with a GradScaler on cpu",
    wrapper=_accelerator_init,
)


# -- 6. bf16 .numpy() -------------------------------------------------------------------------------
def _numpy(wrapped, instance, args, kwargs):
    import torch

    if instance is None or instance.dtype is not torch.bfloat16:
        return wrapped(*args, **kwargs)
    if _once("numpy-bf16"):
        warnings.warn("accel-npu: .numpy() on a bfloat16 tensor returns a float32 array (numpy has no "
                      "bfloat16; stock torch raises TypeError: Got unsupported ScalarType BFloat16)",
                      UserWarning, stacklevel=2)
    return instance.float().numpy(*args, **kwargs)


BF16_NUMPY = Patch(
    target="torch._tensor:Tensor.numpy",
    supports="torch>=2.5,<2.15",
    reason="tensor.numpy() on bfloat16 raises 'TypeError: Got unsupported ScalarType BFloat16' "
           "(numpy has no bfloat16); returns a float32 array.",
    remove_when="numpy gains a bfloat16 dtype that torch converts to",
    wrapper=_numpy,
)


# -- 2. fused AdamW ---------------------------------------------------------------------------------
_probe_cache: dict = {}


def _fused_kernel_rejects(p, decoupled: bool) -> str | None:
    """Why the installed torch (or torch_npu) cannot run the fused Adam(W) kernel for ``p``, or None.

    Uses torch's own device/dtype check, then runs the kernel once on a 1-element tensor of the
    same device and dtype (cached per device/dtype), so nothing of the real parameters changes.
    """
    import torch
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    if p.device.type not in supported or not torch.is_floating_point(p):
        return f"{p.dtype} parameters on {p.device.type} (torch's fused kernels support {supported})"
    key = (p.device.type, p.device.index, p.dtype, decoupled)
    if key not in _probe_cache:
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        try:
            t = [torch.zeros(1, dtype=p.dtype, device=p.device) for _ in range(4)]
            step = torch.zeros((), dtype=torch.float32, device=p.device)
            kernel([t[0]], [t[1]], [t[2]], [t[3]], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                   weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
            _probe_cache[key] = None
        except Exception as exc:  # noqa: BLE001 - any rejection means "use foreach"
            _probe_cache[key] = f"{p.dtype} on {p.device.type}: {type(exc).__name__}: {str(exc)[:200]}"
    return _probe_cache[key]


def _fall_back_to_foreach(optimizer_name: str, why: str) -> None:
    if _once(("fused-fallback", optimizer_name, why)):
        warnings.warn(f"accel-npu: {optimizer_name}(fused=True) is not supported here ({why}); "
                      "using the foreach implementation instead.", UserWarning, stacklevel=3)


def _adamw_init(wrapped, instance, args, kwargs):
    from accel_npu.backend import current_backend

    name = type(instance).__name__ if instance is not None else "AdamW"
    on_npu = current_backend().name == "npu"
    if on_npu and kwargs.get("fused") is None and not kwargs.get("foreach") and not kwargs.get("differentiable"):
        kwargs["fused"] = True  # fewer optimizer kernels on Ascend (docs/migrating.md)
        if _once("adamw-default-fused"):
            log.info("accel-npu: AdamW uses torch_npu's fused kernel (fused=True) on npu")
    if kwargs.get("fused") and args and not isinstance(args[0], (list, tuple)):
        args = (list(args[0]), *args[1:])  # a generator would be consumed by a retry
    try:
        result = wrapped(*args, **kwargs)
    except RuntimeError as exc:
        # Older torch rejects fused=True for a device/dtype already in __init__.
        if not kwargs.get("fused") or "fused" not in str(exc):
            raise
        _fall_back_to_foreach(name, str(exc)[:200])
        kwargs["fused"], kwargs["foreach"] = False, True
        return wrapped(*args, **kwargs)
    if instance is None:
        return result
    # torch 2.13 checks device/dtype only in the first step(), deep inside a GradScaler's step:
    # decide here, while nothing has run yet.
    for group in instance.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            why = _fused_kernel_rejects(p, decoupled=True)
            if why:
                group["fused"], group["foreach"] = False, True
                _fall_back_to_foreach(name, why)
                break
    fused = any(g.get("fused") for g in instance.param_groups)
    if not fused or on_npu:
        # no fused group left, or torch_npu's fused AdamW (no grad_scale/found_inf): a GradScaler
        # must unscale the gradients itself and call the plain step.
        instance._step_supports_amp_scaling = False
    return result


ADAMW_INIT = Patch(
    target="torch.optim.adamw:AdamW.__init__",
    supports="torch>=2.5,<2.15",
    # On npu AdamW defaults to torch_npu's fused kernel, but never with an fp16 GradScaler's
    # grad_scale/found_inf, which torch_npu's fused mode does not take.
    reason="AdamW(fused=True) raises where torch/torch_npu has no fused kernel for a parameter's device "
           "or dtype (torch/optim/optimizer.py); falls back to foreach.",
    remove_when="torch_npu's fused AdamW covers every dtype and accepts grad_scale/found_inf",
    wrapper=_adamw_init,
)


# -- 7. float64 on the npu backend (float64.py, imported when diffusers' module is) ---------------------
LUMINA2_FREQS_CIS = Patch(
    target="diffusers.models.transformers.transformer_lumina2:Lumina2RotaryPosEmbed._precompute_freqs_cis",
    supports="diffusers>=0.33,<0.43",
    # transformer_lumina2.py:245 (v0.40.0) guards only mps; the tables go to the device on every forward
    reason="Lumina2's RoPE tables are complex128 except on mps and NPU kernels reject float64 (diffusers #10428): "
           "complex64 on npu, as on mps.",
    remove_when="diffusers' Lumina2RotaryPosEmbed downcasts for npu (maybe_adjust_dtype_for_device), "
                "not as of main 58eb52c080 (2026-08)",
    wrapper="accel_npu.plugins.precision.float64:lumina2_freqs_cis",
)


@hookimpl
def accel_npu_register_patches():
    return [AUTOCAST, GRAD_SCALER, ACCELERATOR_FP16_CPU, BF16_NUMPY, ADAMW_INIT, LUMINA2_FREQS_CIS]

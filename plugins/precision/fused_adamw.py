"""The wrapper of ``AdamW.__init__`` (named by path in this package's patches): ``fused=True`` falls back
to foreach where torch / torch_npu has no fused kernel for a parameter's device or dtype; on the npu
backend AdamW defaults to torch_npu's fused kernel, and a GradScaler unscales the gradients itself."""

from __future__ import annotations

import logging
import warnings

from accel_npu._torch.once import FirstTime
from accel_npu.patching import argument, with_argument

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and cause

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
            kernel(
                [t[0]],
                [t[1]],
                [t[2]],
                [t[3]],
                [],
                [step],
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.0,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
            )
            _probe_cache[key] = None
        except Exception as exc:  # noqa: BLE001 - any rejection means "use foreach"
            _probe_cache[key] = f"{p.dtype} on {p.device.type}: {type(exc).__name__}: {str(exc)[:200]}"
    return _probe_cache[key]


def _fall_back_to_foreach(optimizer_name: str, why: str) -> None:
    if _once(("fused-fallback", optimizer_name, why)):
        warnings.warn(
            f"accel-npu: {optimizer_name}(fused=True) is not supported here ({why}); "
            "using the foreach implementation instead.",
            UserWarning,
            stacklevel=3,
        )


def adamw_init(wrapped, instance, args, kwargs):
    from accel_npu.backend import current_backend

    name = type(instance).__name__ if instance is not None else "AdamW"
    on_npu = current_backend().name == "npu"
    if on_npu and kwargs.get("fused") is None and not kwargs.get("foreach") and not kwargs.get("differentiable"):
        kwargs["fused"] = True  # fewer optimizer kernels on Ascend (docs/migrating.md)
        if _once("adamw-default-fused"):
            log.info("accel-npu: AdamW uses torch_npu's fused kernel (fused=True) on npu")
    params = argument(args, kwargs, 0, "params")
    if kwargs.get("fused") and params is not None and not isinstance(params, (list, tuple)):
        args, kwargs = with_argument(args, kwargs, 0, "params", list(params))  # a retry would find a generator spent
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

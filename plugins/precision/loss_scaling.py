"""Wrappers that keep fp16 loss scaling where CUDA is absent (named by path in this package's patches):
a "cuda" ``GradScaler`` scales on the device autocast("cuda") runs on, and accelerate's
``mixed_precision: fp16`` on the cpu backend runs autocast fp16 with a scaler, as on npu."""

from __future__ import annotations

import logging

from accel_npu._torch.device import cuda_available
from accel_npu._torch.once import FirstTime
from accel_npu.patching import argument, with_argument

log = logging.getLogger("accel_npu")

_once = FirstTime()  # one warning per process and cause


def grad_scaler_init(wrapped, instance, args, kwargs):
    # GradScaler.__init__(self, device="cuda", init_scale=2.0**16, ...)
    device = argument(args, kwargs, 0, "device", "cuda")
    if device != "cuda" or cuda_available():
        return wrapped(*args, **kwargs)
    from accel_npu.backend import current_backend

    target = current_backend().device_type
    if target == "cuda":  # forced cuda backend without CUDA: torch disables the scaler, as stock
        return wrapped(*args, **kwargs)
    if _once(("grad-scaler", target)):
        log.warning(
            "accel-npu: GradScaler('cuda') scales on %r, the device autocast('cuda') runs on "
            "(no CUDA here; stock torch would disable loss scaling)",
            target,
        )
    args, kwargs = with_argument(args, kwargs, 0, "device", target)
    return wrapped(*args, **kwargs)


def accelerator_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    from accelerate.utils import DistributedType

    if (
        instance.state.mixed_precision != "fp16"
        or instance.native_amp
        or instance.device.type != "cpu"
        or instance.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
        or cuda_available()
    ):
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
    instance.scaler = (
        get_fsdp2_grad_scaler(device="cpu", **kwargs)
        if instance.is_fsdp2
        else get_grad_scaler(instance.distributed_type, **kwargs)
    )
    if _once("accelerate-fp16-cpu"):
        log.warning(
            "accel-npu: mixed_precision fp16 runs on the cpu backend (autocast fp16 with loss "
            "scaling, as on npu); stock accelerate runs fp32 on cpu"
        )

"""Which trainable parameters a forward leaves out of the autograd graph, found on the meta device.

The probe runs the module's forward once on meta copies of its parameters, buffers and inputs
(shapes and dtypes only: no compute, no memory) and asks autograd which parameters the outputs
reach — what DDP's ``find_unused_parameters=True`` searches for in every iteration, asked once.
"""

from __future__ import annotations

import logging

log = logging.getLogger("accel_npu")


def _to_meta(value):
    import torch

    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_meta(v)) for k, v in value.items())
    return value


def unused_parameters(module, args, kwargs) -> list[str] | None:
    """Names of trainable parameters no output depends on; None when the probe cannot run
    (a forward that reads tensor values: ``.item()``, data-dependent shapes, ops without meta kernels)."""
    import torch
    from torch.func import functional_call
    from torch.nn.parallel.distributed import _find_tensors

    trainable = {name: p for name, p in module.named_parameters() if p.requires_grad}
    if not trainable:
        return []
    probe = {name: torch.empty_like(p, device="meta").requires_grad_(True) for name, p in trainable.items()}
    frozen = {
        name: torch.empty_like(t, device="meta")
        for name, t in [*module.named_parameters(), *module.named_buffers()]
        if name not in probe
    }
    try:
        with torch.enable_grad():
            out = functional_call(
                module, {**frozen, **probe}, tuple(_to_meta(args)), _to_meta(kwargs), tie_weights=True, strict=False
            )
            outputs = [t for t in _find_tensors(out) if t.requires_grad]
            if not outputs:
                return None
            grads = torch.autograd.grad(
                outputs, list(probe.values()), grad_outputs=[torch.ones_like(t) for t in outputs], allow_unused=True
            )
    except Exception as exc:  # noqa: BLE001 - the probe is an optimisation of a failure path: stock then
        log.debug("accel-npu: DDP unused-parameter probe of %s could not run on meta: %r", type(module).__name__, exc)
        return None
    return [name for name, grad in zip(probe, grads) if grad is None]

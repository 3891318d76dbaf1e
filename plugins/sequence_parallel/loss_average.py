"""The loss averaged over a sequence-parallel group, and the gathered output's gradient summed over it.

Under diffusers' context parallelism the split model's output is gathered on every rank of the SP group
(``ContextParallelOutput`` → ``AllGatherFunction``, diffusers hooks/context_parallel.py), so what a script computes
from it — the loss, and any module trained on that output (an action head, a discriminator) — runs identically on
each rank. diffusers' gather backward keeps the rank's own slice of the output's gradient: right for the split
model (each rank's slice is a partial gradient, which the reduction sums over the group), but a module after the
gather gets its whole gradient on every rank of the group, and the reduction (ZeRO's, FSDP2's: summed over the
group, averaged over data-parallel groups) hands it sp_size times its gradient.

So, under DeepSpeed, as its Ulysses recipe for transformers does (the loss averaged over the SP group, its
gather's backward a reduce-scatter): ``DeepSpeedEngine.backward`` (what ``accelerator.backward`` calls)
back-propagates loss / sp_size, and the gather's backward sums the gradients of the group's ranks before taking the
rank's slice. A module after the gather gets 1 / sp_size of its gradient per rank (its whole gradient once summed);
everything before the gather gets the slice of the summed gradient it got before. Under FSDP2 (the script's
backward is a plain ``loss.backward()`` inside accelerate, and the reduction a mean over every rank) every backward
through the gather sums: fsdp2.py.
"""

from __future__ import annotations

from accel_npu.patching import argument, with_argument
from accel_npu.plugins.sequence_parallel import groups

# backward passes of DeepSpeedEngine.backward in progress, loss scaled; module-level, not thread-local: a device's
# autograd runs the gather's backward on the engine's device thread
_AVERAGED = 0


def backward_with_the_loss_averaged(wrapped, instance, args, kwargs):
    """``DeepSpeedEngine.backward(loss)``: loss / sp_size while a diffusers model is split. What it returns (the
    loss it back-propagated, after DeepSpeed's own scaling) is given back at the script's scale."""
    global _AVERAGED
    state = groups.active()
    if state is None or state.sp_size <= 1:
        return wrapped(*args, **kwargs)
    loss = argument(args, kwargs, 0, "loss")
    args, kwargs = with_argument(args, kwargs, 0, "loss", loss / state.sp_size)
    _AVERAGED += 1
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _AVERAGED -= 1
    return result * state.sp_size if hasattr(result, "mul") else result


def gathered_gradient_summed(wrapped, instance, args, kwargs):
    """``AllGatherFunction.backward(ctx, grad_output)`` (and ``AllGatherAnythingFunction``'s): the group's
    gradients summed, then diffusers' slice."""
    state = groups.active()
    ctx = argument(args, kwargs, 0, "ctx")
    summing = state is not None and (_AVERAGED or state.sum_every_gathered_gradient)
    if not summing or getattr(ctx, "world_size", None) != state.sp_size:
        return wrapped(*args, **kwargs)
    import torch
    import torch.distributed as dist

    # a copy: autograd's gradient buffer is not ours to change in place
    grad_output = torch.clone(argument(args, kwargs, 1, "grad_output"), memory_format=torch.contiguous_format)
    dist.all_reduce(grad_output, op=dist.ReduceOp.SUM, group=ctx.group)
    args, kwargs = with_argument(args, kwargs, 1, "grad_output", grad_output)
    return wrapped(*args, **kwargs)

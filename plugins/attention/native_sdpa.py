"""The backward of diffusers' native (SDPA) attention backend under Ulysses, without a second attention forward.

diffusers hands ``_native_attention_forward_op`` / ``_native_attention_backward_op`` to its Ulysses attention
(``TemplatedUlyssesAttention`` in models/attention_dispatch.py, an autograd Function whose backward calls
``ctx.backward_op``). Stock, the forward op keeps only query, key and value, and the backward op runs
``scaled_dot_product_attention`` again under autograd to differentiate it: every training step computes each
attention forward twice. At long sequences attention is most of a step (its cost grows with the tokens squared),
so a sequence-parallel rank paid one attention forward more per step than the unsplit model pays for the same
heads (docs/sequence-parallel.md, "Measured").

Here the forward op runs stock's own op under autograd on detached query, key and value, and keeps that graph on
the ctx: what torch keeps for SDPA without context parallelism (query, key, value, the output and its
log-sum-exp; the tensors stock saves are the same storage). The backward op differentiates it once
(``torch.autograd.grad``, which frees it). The same kernel on the same tensors: stock's gradients, bit for bit.
A backward the kept graph cannot serve (a second one through a retained graph, a ctx this forward op did not fill,
ring attention's per-chunk call) is stock's recomputation. The native backend is diffusers' default, and what
torch_npu's SDPA runs on NPU as well.
"""

from __future__ import annotations

import torch

from accel_npu.patching import argument, with_argument

#: where the forward op leaves the attention's autograd graph: ([query, key, value] leaves, output)
CTX_ATTRIBUTE = "accel_npu_sdpa_graph"
_QKV = ((1, "query"), (2, "key"), (3, "value"))


def forward_op(wrapped, instance, args, kwargs):
    """``_native_attention_forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    return_lse, _save_ctx, _parallel_config)``: stock's call, its graph kept for the backward op. Calls that save
    nothing (``_save_ctx=False``) or ask a log-sum-exp (which stock refuses) are stock's."""
    ctx = argument(args, kwargs, 0, "ctx")
    if ctx is None or not argument(args, kwargs, 10, "_save_ctx", True) or argument(args, kwargs, 9, "return_lse"):
        return wrapped(*args, **kwargs)
    leaves = []
    for position, name in _QKV:
        leaf = argument(args, kwargs, position, name).detach().requires_grad_(True)
        args, kwargs = with_argument(args, kwargs, position, name, leaf)
        leaves.append(leaf)
    # autograd Functions run their forward under no_grad; stock's op also saves the leaves and its arguments on
    # ctx, which its own backward (the fallback below) reads
    with torch.enable_grad():
        out = wrapped(*args, **kwargs)
    setattr(ctx, CTX_ATTRIBUTE, (leaves, out))
    return out.detach()


def backward_op(wrapped, instance, args, kwargs):
    """``_native_attention_backward_op(ctx, grad_out, *args, **kwargs)``: dq, dk, dv from the kept graph."""
    ctx = argument(args, kwargs, 0, "ctx")
    kept = getattr(ctx, CTX_ATTRIBUTE, None)
    if kept is None or any(kwargs.get(name) is not None for name in ("query", "key", "value", "out", "lse")):
        return wrapped(*args, **kwargs)
    setattr(ctx, CTX_ATTRIBUTE, None)  # freed by the grad below: a second backward recomputes, as stock
    leaves, out = kept
    return torch.autograd.grad(out, leaves, argument(args, kwargs, 1, "grad_out"))

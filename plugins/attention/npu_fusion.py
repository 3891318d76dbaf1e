"""A backward for diffusers' NPU attention backend under context parallelism (torch_npu's fused-attention grad).

diffusers registers its ``_native_npu`` backend with ``supports_context_parallel=True`` and hands
``_npu_attention_forward_op`` / ``_npu_attention_backward_op`` to its Ulysses and ring attention
(``TemplatedUlyssesAttention``, ``TemplatedRingAttention``: autograd Functions whose backward calls
``ctx.backward_op``). Stock, the backward op raises NotImplementedError("Backward pass is not implemented for
Npu Fusion Attention.") and the forward op keeps only ``npu_fusion_attention(...)[0]``, so training under
context parallelism stops at the first backward (diffusers 0.37.0 .. 0.42.1, models/attention_dispatch.py).

Here the forward op makes the same ``torch_npu.npu_fusion_attention`` call and keeps what torch_npu's own
autograd keeps for it, and the backward op hands that to ``torch_npu.npu_fusion_attention_grad`` as torch_npu's
own derivative does: op-plugin ``op_plugin/config/derivatives.yaml``, ``npu_fusion_attention``: softmax_max,
softmax_sum, softmax_in, attention_in = results 1, 2, 3, 0; seed, offset, numels = results 4, 5, 6 (op-plugin
0576042b / 691bf15a / 83120a50, the submodule of Ascend/pytorch v7.1.0.2-pytorch2.6.0 / v7.2.0-pytorch2.7.1 /
v7.3.1-pytorch2.7.1; the same signatures on master 517f2e7d). Nothing changes where diffusers found no usable
torch_npu (its ``npu_fusion_attention`` is None): the stock ops run, and fail as they do stock.
"""

from __future__ import annotations

import math
import sys

import torch

from accel_npu.patching import argument

#: how diffusers' forward op calls the kernel (attention_dispatch.py ``_npu_attention_forward_op``): q/k/v in its
#: model layout (B, S, heads, head_dim) and a +-65536-token band, which only applies with an atten_mask
#: (op-plugin docs/context/torch_npu-npu_fusion_attention.md, 7.2.0: "atten_mask None: sparse_mode, pre_tockens,
#: next_tockens do not apply"); the grad gets the same so it differentiates what the forward computed
LAYOUT = "BSND"
TOKENS = 65536
#: softmax_max / softmax_sum are [B, N, Sq, 8] float32, the row's value repeated 8 times
#: (FlashAttentionKernelNpuOpApi.cpp ``SOFTMAXMAX_LAST_DIMSHAPE``, op-plugin 7.1.0 .. master)
SOFTMAX_WIDTH = 8
#: where the forward op leaves its kernel arguments on the autograd ctx (its tensors go to save_for_backward)
CTX_ATTRIBUTE = "accel_npu_fusion_attention"


class FusionAttentionCall:
    """The non-tensor arguments and results of one forward ``npu_fusion_attention`` call the grad needs."""

    __slots__ = ("head_num", "atten_mask", "scale", "keep_prob", "seed", "offset", "numels")

    def __init__(self, head_num, atten_mask, scale, keep_prob, seed, offset, numels):
        self.head_num, self.atten_mask, self.scale, self.keep_prob = head_num, atten_mask, scale, keep_prob
        self.seed, self.offset, self.numels = seed, offset, numels


def _kernel(wrapped):
    """diffusers' own ``npu_fusion_attention`` (``from torch_npu import npu_fusion_attention`` in
    attention_dispatch.py; None where torch_npu is missing or failed to import)."""
    return getattr(sys.modules.get(wrapped.__module__), "npu_fusion_attention", None)


def forward_op(wrapped, instance, args, kwargs):
    """``_npu_attention_forward_op(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
    return_lse, _save_ctx, _parallel_config)``: stock's call, with what the backward needs saved and, for ring
    attention (which asks ``return_lse=True``), the log-sum-exp in diffusers' (B, S, heads) layout. Like stock,
    ``is_causal`` is not applied: diffusers' context parallelism refuses it before any op runs
    (``_templated_context_parallel_attention``)."""
    kernel = _kernel(wrapped)
    if kernel is None:
        return wrapped(*args, **kwargs)
    ctx, query, key, value = (argument(args, kwargs, i, n) for i, n in enumerate(("ctx", "query", "key", "value")))
    attn_mask = argument(args, kwargs, 4, "attn_mask")
    dropout_p = argument(args, kwargs, 5, "dropout_p", 0.0) or 0.0
    scale = argument(args, kwargs, 7, "scale")
    return_lse = argument(args, kwargs, 9, "return_lse", False)
    save_ctx = argument(args, kwargs, 10, "_save_ctx", True)

    atten_mask = sys.modules[wrapped.__module__]._maybe_modify_attn_mask_npu(query, key, attn_mask)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    keep_prob = 1.0 - dropout_p
    out, softmax_max, softmax_sum, softmax_in, seed, offset, numels = kernel(
        query,
        key,
        value,
        query.size(2),
        atten_mask=atten_mask,
        input_layout=LAYOUT,
        pse=None,
        scale=scale,
        pre_tockens=TOKENS,
        next_tockens=TOKENS,
        keep_prob=keep_prob,
        sync=False,
        inner_precise=0,
    )
    if save_ctx:
        # query, key, value first: diffusers' ring backward reads ``query, key, value, *_ = ctx.saved_tensors``
        ctx.save_for_backward(query, key, value, out, softmax_max, softmax_sum, softmax_in)
        setattr(
            ctx, CTX_ATTRIBUTE, FusionAttentionCall(query.size(2), atten_mask, scale, keep_prob, seed, offset, numels)
        )
    if not return_lse:
        return out
    # softmax = exp(s - max) / sum, so log-sum-exp = max + log(sum); [B, N, Sq] -> diffusers' (B, Sq, N)
    lse = softmax_max[..., 0] + torch.log(softmax_sum[..., 0])
    return out, lse.transpose(1, 2).contiguous()


def _softmax_stats_from_lse(lse: torch.Tensor):
    """(softmax_max, softmax_sum) that normalise by ``lse`` (B, S, N): max = lse and sum = 1 give
    exp(s - lse), the probabilities of the whole sequence for any chunk of keys (the global normaliser ring
    attention's backward hands over, diffusers ``TemplatedRingAttention.backward``)."""
    stats = lse.float().transpose(1, 2).unsqueeze(-1)
    shape = (*stats.shape[:-1], SOFTMAX_WIDTH)
    return stats.expand(shape).contiguous(), torch.ones(shape, dtype=torch.float32, device=lse.device)


def backward_op(wrapped, instance, args, kwargs):
    """``_npu_attention_backward_op(ctx, grad_out, *, query=None, key=None, value=None, out=None, lse=None)``:
    dq, dk, dv from ``npu_fusion_attention_grad``. Ring attention (diffusers >= 0.40) passes each step's key and
    value chunk with the reduced ``out`` and ``lse``; Ulysses passes nothing and the forward's tensors are used.
    A ctx this module's forward op did not fill (no torch_npu: stock's forward ran) goes to stock's backward."""
    ctx = argument(args, kwargs, 0, "ctx")
    call = getattr(ctx, CTX_ATTRIBUTE, None)
    if call is None:
        return wrapped(*args, **kwargs)
    grad_out = argument(args, kwargs, 1, "grad_out")
    saved = dict(zip(("query", "key", "value", "out", "softmax_max", "softmax_sum", "softmax_in"), ctx.saved_tensors))
    given = {name: kwargs.get(name) for name in ("query", "key", "value", "out", "lse")}
    query, key, value, out = (saved[n] if given[n] is None else given[n] for n in ("query", "key", "value", "out"))
    softmax_max, softmax_sum = saved["softmax_max"], saved["softmax_sum"]
    if given["lse"] is not None:
        softmax_max, softmax_sum = _softmax_stats_from_lse(given["lse"])
    if call.keep_prob < 1.0 and given["key"] is not None:
        # the dropout mask is regenerated from the forward's seed and offset, which belong to one ring step only
        raise NotImplementedError(
            "accel-npu: ring attention with dropout_p > 0 on the NPU attention backend has no backward "
            "(npu_fusion_attention_grad regenerates one forward call's dropout mask); use dropout_p=0 or Ulysses"
        )
    import torch_npu  # imported already: diffusers' attention_dispatch took npu_fusion_attention from it

    grads = torch_npu.npu_fusion_attention_grad(
        query,
        key,
        value,
        grad_out.contiguous(),
        call.head_num,
        LAYOUT,
        pse=None,
        padding_mask=None,
        atten_mask=call.atten_mask,
        softmax_max=softmax_max,
        softmax_sum=softmax_sum,
        softmax_in=saved["softmax_in"],
        attention_in=out.to(query.dtype),
        scale_value=call.scale,
        keep_prob=call.keep_prob,
        pre_tockens=TOKENS,
        next_tockens=TOKENS,
        inner_precise=0,
        seed=call.seed,
        offset=call.offset,
        numels=call.numels,
    )
    # (dq, dk, dv, dpse) up to v7.2.0, (dq, dk, dv, dpse, dsink) from v7.3.1 (op_plugin_functions.yaml)
    return grads[0], grads[1], grads[2]

"""diffusers' native (SDPA) attention backend under Ulysses (plugins/attention/native_sdpa.py): its backward
differentiates the forward's attention instead of running the attention forward again.

The ops are called as diffusers' ``TemplatedUlyssesAttention`` calls them (``forward_op(ctx, query, key, value, ...,
_save_ctx=True, ...)`` inside an autograd Function's forward, ``ctx.backward_op(ctx, grad_out)`` in its backward;
checked against its source below), on one process: the exchange around them does not touch what they compute.
Witnesses independent of accel-npu: torch's attention kernels counted at the dispatcher (one forward kernel per
attention and step; stock: two), and the gradients of SDPA differentiated by autograd on the same tensors.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.inprocess import stock


class KernelCount(TorchDispatchMode):
    """How many times torch ran an SDPA forward kernel and an SDPA backward kernel."""

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "scaled_dot_product" in name:
            if "backward" in name:
                self.backward += 1
            else:
                self.forward += 1
        return func(*args, **(kwargs or {}))


class UlyssesOps(torch.autograd.Function):
    """diffusers' ``TemplatedUlyssesAttention`` around its ops, without the all_to_all (one rank)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask):
        from diffusers.models import attention_dispatch as dispatch

        ctx.backward_op = dispatch._native_attention_backward_op
        return dispatch._native_attention_forward_op(
            ctx, query, key, value, attn_mask, 0.0, False, None, False, False, _save_ctx=True, _parallel_config=None
        )

    @staticmethod
    def backward(ctx, grad_out):
        grad_query, grad_key, grad_value, *_ = ctx.backward_op(ctx, grad_out)
        return grad_query, grad_key, grad_value, None


def _tensors(mask: bool):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 24, 2, 8) for _ in range(3))  # (batch, tokens, heads, head_dim): diffusers' layout
    attn_mask = torch.rand(2, 1, 1, 24) > 0.3 if mask else None
    return q, k, v, attn_mask, torch.randn(2, 24, 2, 8)


def _ulysses(q, k, v, attn_mask, grad, backwards=1):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    count = KernelCount()
    with count:
        out = UlyssesOps.apply(*leaves, attn_mask)
        for i in range(backwards):
            out.backward(grad, retain_graph=i + 1 < backwards)
    return out.detach(), [x.grad for x in leaves], count


def _reference(q, k, v, attn_mask, grad):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), attn_mask=attn_mask).transpose(1, 2)
    out.backward(grad)
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "key-mask"])
def test_the_backward_runs_no_second_attention_forward_and_gives_sdpas_gradients(mask):
    tensors = _tensors(mask)
    out, grads, count = _ulysses(*tensors)
    want_out, want_grads = _reference(*tensors)
    assert (count.forward, count.backward) == (1, 1)
    assert torch.equal(out, want_out)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    with stock():
        stock_out, stock_grads, stock_count = _ulysses(*tensors)
    # the negative: stock runs the forward kernel again in its backward, for the same values
    assert (stock_count.forward, stock_count.backward) == (2, 1)
    assert torch.equal(stock_out, out) and all(torch.equal(g, s) for g, s in zip(grads, stock_grads))


def test_a_second_backward_through_a_retained_graph_recomputes_as_stock():
    tensors = _tensors(False)
    _, grads, count = _ulysses(*tensors, backwards=2)
    _, once, _ = _ulysses(*tensors)
    assert (count.forward, count.backward) == (2, 2)  # the kept graph serves the first, stock's the second
    assert all(torch.allclose(g, 2 * w, atol=1e-6) for g, w in zip(grads, once))


def test_without_grad_the_forward_is_stocks():
    q, k, v, attn_mask, _ = _tensors(True)
    with torch.no_grad():
        out = UlyssesOps.apply(q, k, v, attn_mask)
    assert out.grad_fn is None
    assert torch.equal(out, _reference(q, k, v, attn_mask, torch.zeros_like(q))[0])


def test_diffusers_ulysses_calls_the_ops_so():
    """What the Function above mirrors: ``_native_attention`` names both ops as module globals at each call, and
    ``TemplatedUlyssesAttention`` calls the forward op with its ctx and ``_save_ctx=True``, the backward op with
    its ctx and the exchanged output gradient (attention_dispatch.py)."""
    from diffusers.models import attention_dispatch as dispatch

    body = inspect.getsource(dispatch._native_attention).replace(" ", "")
    assert "forward_op=_native_attention_forward_op," in body and "backward_op=_native_attention_backward_op," in body
    ulysses = inspect.getsource(dispatch.TemplatedUlyssesAttention).replace(" ", "").replace("\n", "")
    assert "out=forward_op(ctx,query,key,value," in ulysses and "_save_ctx=True," in ulysses
    assert "ctx.backward_op(ctx,grad_out)" in ulysses

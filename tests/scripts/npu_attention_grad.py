"""diffusers' NPU attention backend, forward and backward, against autograd through torch's SDPA (fp32).

Run with the torch_npu stand-in on PYTHONPATH (tests/contract/test_attention_npu.py). Prints one RESULT: the
largest absolute difference per case between the NPU backend's (forward_op, backward_op) pair, called the way
diffusers' context parallelism calls it, and ``torch.nn.functional.scaled_dot_product_attention`` differentiated by
autograd on the same inputs; stock's backward error, where stock runs (ACCEL_NPU_DISABLE=1).

Cases: the stand-in kernels alone per input layout (BNSD, BSND, BSH, SBH: the contract the backward relies on);
diffusers' ops inside ``TemplatedUlyssesAttention`` and ``TemplatedRingAttention`` (1-rank gloo group; diffusers'
layout BSND) without a mask, with a [B, Skv] and a [B, 1, 1, Skv] key mask; the ops alone with grouped key/value
heads; ring
attention's merge over two key/value chunks done by hand as TemplatedRingAttention does it across ranks; dropout
(the mask regenerated from the forward's seed); and the same checks with a wrong grad kernel, which must fail.
Usage: npu_attention_grad.py WORKDIR
"""

import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch_npu
from diffusers.models import attention_dispatch as dispatch

work = Path(sys.argv[1])
torch.manual_seed(0)
B, S, N, D = 2, 12, 4, 8


def qkv(heads_kv=N, seq_kv=S):
    q = torch.randn(B, S, N, D)
    k, v = torch.randn(B, seq_kv, heads_kv, D), torch.randn(B, seq_kv, heads_kv, D)
    return q, k, v


def sdpa_bsnd(q, k, v, mask=None):
    """The reference: SDPA on diffusers' (B, S, N, D) tensors; mask True = attend (SDPA's and diffusers' sense)."""
    if mask is not None and mask.ndim == 2:
        mask = mask[:, None, None, :]
    gqa = k.shape[2] != q.shape[2]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2)


def reference(q, k, v, dy, mask=None):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = sdpa_bsnd(*leaves, mask)
    out.backward(dy)
    return out.detach(), [x.grad for x in leaves]


def max_diff(got, want):
    return max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))


def grads_of(function, q, k, v, dy):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = function(*leaves)
    out.backward(dy)
    return out.detach(), [x.grad for x in leaves]


# -- diffusers' context-parallel attention on a 1-rank gloo group ---------------------------------------------
dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
group = types.SimpleNamespace(get_group=lambda: dist.group.WORLD)
config = types.SimpleNamespace(
    context_parallel_config=types.SimpleNamespace(
        _ulysses_mesh=group, ulysses_degree=1, _ring_mesh=group, _ring_local_rank=0, ring_degree=1, convert_to_fp32=True
    )
)


def templated(kind, mask=None, dropout_p=0.0):
    function = dispatch.TemplatedUlyssesAttention if kind == "ulysses" else dispatch.TemplatedRingAttention

    def run(q, k, v):
        # _native_npu_attention's call: (..., attn_mask, dropout_p, None, scale, None, return_lse, ops, config)
        return function.apply(
            q,
            k,
            v,
            mask,
            dropout_p,
            None,
            None,
            None,
            False,
            dispatch._npu_attention_forward_op,
            dispatch._npu_attention_backward_op,
            config,
        )

    return run


class Ctx:
    """What an autograd Function's ctx offers the ops."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def ring_by_hand(q, k, v, dy, chunks=2):
    """TemplatedRingAttention's two ranks in one process: each key/value chunk's forward with return_lse, merged
    as diffusers merges them (attention_dispatch.py, TemplatedRingAttention.forward), then each chunk's backward
    with the merged out/lse (TemplatedRingAttention.backward, diffusers >= 0.40)."""
    ctx, prev_out, prev_lse = Ctx(), None, None
    k_chunks, v_chunks = k.chunk(chunks, dim=1), v.chunk(chunks, dim=1)
    for i, (kc, vc) in enumerate(zip(k_chunks, v_chunks)):
        out, lse = dispatch._npu_attention_forward_op(
            ctx, q, kc, vc, None, 0.0, None, None, None, True, _save_ctx=i == 0
        )
        out, lse = out.float(), lse.float().unsqueeze(-1)
        if prev_out is not None:
            out = prev_out - torch.sigmoid(lse - prev_lse) * (prev_out - out)
            lse = prev_lse - F.logsigmoid(prev_lse - lse)
        prev_out, prev_lse = out, lse
    out, lse = out.to(q.dtype), lse.squeeze(-1)
    dq, dks, dvs = torch.zeros_like(q), [], []
    for kc, vc in zip(k_chunks, v_chunks):
        gq, gk, gv = dispatch._npu_attention_backward_op(ctx, dy, query=q, key=kc, value=vc, out=out, lse=lse)
        dq, dks, dvs = dq + gq, dks + [gk], dvs + [gv]
    return out, [dq, torch.cat(dks, dim=1), torch.cat(dvs, dim=1)]


def kernel_alone(layout, mask=None, heads_kv=N):
    """The stand-in kernels on their own: forward output and grad (from the forward's softmax statistics) against
    SDPA, in ``layout``."""
    q, k, v = qkv(heads_kv)
    dy = torch.randn_like(q)
    want_out, want = reference(q, k, v, dy, mask)

    def to(x):  # BSND -> layout
        return {"BSND": x, "BNSD": x.transpose(1, 2), "BSH": x.flatten(2), "SBH": x.flatten(2).transpose(0, 1)}[
            layout
        ].contiguous()

    def back(x, heads):
        if layout == "BNSD":
            return x.transpose(1, 2)
        if layout in ("BSH", "SBH"):
            x = x.transpose(0, 1) if layout == "SBH" else x
            return x.unflatten(2, (heads, D))
        return x

    atten_mask = None if mask is None else ~mask[:, None, None, :].expand(B, 1, S, S)
    scale = D**-0.5
    out, smax, ssum, sin, seed, offset, numels = torch_npu.npu_fusion_attention(
        to(q), to(k), to(v), N, layout, atten_mask=atten_mask, scale=scale
    )
    grads = torch_npu.npu_fusion_attention_grad(
        to(q),
        to(k),
        to(v),
        to(dy),
        N,
        layout,
        atten_mask=atten_mask,
        softmax_max=smax,
        softmax_sum=ssum,
        softmax_in=sin,
        attention_in=out,
        scale_value=scale,
        seed=seed,
        offset=offset,
        numels=numels,
    )
    got = [back(grads[0], N), back(grads[1], heads_kv), back(grads[2], heads_kv)]
    shapes_ok = list(smax.shape) == [B, N, S, 8] and smax.dtype == torch.float32 and numels == B * N * S * S
    return max(max_diff([back(out, N)], [want_out]), max_diff(got, want)), shapes_ok


def checks():
    found = {}
    for layout in ("BNSD", "BSND", "BSH", "SBH"):
        found[f"kernel {layout}"], shapes_ok = kernel_alone(layout)
        result["kernel_stats_shapes_ok"] = result.get("kernel_stats_shapes_ok", True) and shapes_ok
    keep = torch.rand(B, S) > 0.3
    keep[:, 0] = True  # no query row without keys
    found["kernel BSND key mask"], _ = kernel_alone("BSND", keep)
    found["kernel BSH grouped kv heads"], _ = kernel_alone("BSH", heads_kv=2)

    masks = {"no mask": None, "[B,Skv] mask": keep, "[B,1,1,Skv] mask": keep[:, None, None, :]}
    for kind in ("ulysses", "ring"):
        for name, mask in masks.items():
            if kind == "ring" and mask is not None:
                continue  # diffusers' ring attention applies one mask to every key chunk; not an NPU question
            q, k, v = qkv()
            dy = torch.randn_like(q)
            want_out, want = reference(q, k, v, dy, mask)
            out, got = grads_of(templated(kind, mask), q, k, v, dy)
            found[f"{kind} {name}"] = max(max_diff([out], [want_out]), max_diff(got, want))
    # grouped key/value heads: diffusers' Ulysses splits key/value by the query's head count, so the ops alone
    q, k, v = qkv(heads_kv=2)
    dy = torch.randn_like(q)
    want_out, want = reference(q, k, v, dy)
    ctx = Ctx()
    out = dispatch._npu_attention_forward_op(ctx, q, k, v, None, 0.0, None, None, None, False)
    got = dispatch._npu_attention_backward_op(ctx, dy)
    found["ops grouped kv heads"] = max(max_diff([out], [want_out]), max_diff(got, want))

    q, k, v = qkv()
    dy = torch.randn_like(q)
    want_out, want = reference(q, k, v, dy)
    out, got = ring_by_hand(q, k, v, dy)
    found["ring merged over 2 key chunks"] = max(max_diff([out], [want_out]), max_diff(got, want))

    # dropout: the backward must regenerate the forward's mask (its seed and offset); the witness differentiates
    # softmax * keep / keep_prob with the same mask, drawn from the seed the stand-in's forward drew
    q, k, v = qkv()
    dy = torch.randn_like(q)
    torch.manual_seed(7)
    out, got = grads_of(templated("ulysses", dropout_p=0.25), q, k, v, dy)
    torch.manual_seed(7)
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    keep_mask = torch_npu._fusion_attention._dropout_keep((B, N, S, S), 0.75, seed, 0, q.device)

    def dropped(q, k, v):
        p = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) * D**-0.5, dim=-1)
        return ((p * keep_mask / 0.75) @ v.transpose(1, 2)).transpose(1, 2)

    want_out, want = grads_of(dropped, q, k, v, dy)
    found["ulysses dropout 0.25"] = max(max_diff([out], [want_out]), max_diff(got, want))
    return found


result = {}
try:
    result["max_abs_diff"] = checks()
except Exception as exc:  # noqa: BLE001 - stock's backward raises; the record says what
    result["error"] = f"{type(exc).__name__}: {exc}"

# the checker against wrong grad kernels: every one must be caught
right_grad = torch_npu.npu_fusion_attention_grad
wrong = {
    "dq 1% off": lambda *a, **kw: (right_grad(*a, **kw)[0] * 1.01, *right_grad(*a, **kw)[1:]),
    "dk and dv swapped": lambda *a, **kw: (lambda g: (g[0], g[2], g[1], g[3]))(right_grad(*a, **kw)),
    "softmax_max ignored": lambda *a, **kw: right_grad(
        *a, **{**kw, "softmax_max": torch.zeros_like(kw["softmax_max"])}
    ),
    "attention_in ignored": lambda *a, **kw: right_grad(
        *a, **{**kw, "attention_in": torch.zeros_like(kw["attention_in"])}
    ),
}
result["wrong_grad"] = {}
for name, fake in wrong.items():
    torch_npu.npu_fusion_attention_grad = fake
    try:
        result["wrong_grad"][name] = checks()
    except Exception as exc:  # noqa: BLE001 - recorded
        result["wrong_grad"][name] = f"{type(exc).__name__}: {exc}"
torch_npu.npu_fusion_attention_grad = right_grad
dist.destroy_process_group()
print("RESULT " + json.dumps(result))

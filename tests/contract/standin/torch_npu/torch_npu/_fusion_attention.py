"""STAND-IN for torch_npu's fused attention kernels, in plain torch math (tests/contract only).

Mirrors the Python-visible contract of ``torch_npu.npu_fusion_attention`` and ``torch_npu.npu_fusion_attention_grad``
as Ascend/op-plugin defines them (the submodule ``third_party/op-plugin`` of Ascend/pytorch
v7.2.0-pytorch2.7.1 is op-plugin 691bf15a; v7.1.0.2-pytorch2.6.0's 0576042b and v7.3.1-pytorch2.7.1's 83120a50
have the same signatures, 7.3.x adding ``sink`` and a fifth grad output ``dsink``):

- signatures: ``op_plugin/config/op_plugin_functions.yaml`` (forward: every argument may be positional;
  grad: keyword-only after ``input_layout``), ``op_plugin/python/meta/_meta_registrations.py``;
- outputs: attention_out in the input layout and dtype; softmax_max and softmax_sum float32 [B, N, Sq, 8] (the
  row's value repeated, ``SOFTMAXMAX_LAST_DIMSHAPE``); softmax_out empty; seed, offset and numels of the dropout
  mask (numels = B*N*Sq*Skv) — ``ops/opapi/FlashAttentionKernelNpuOpApi.cpp`` ``npu_fusion_attention``,
  ``dropout_gen_mask``; the grad returns (dq, dk, dv, dpse), dpse empty without pse (same file,
  ``npu_fusion_attention_backward``);
- softmax_max is the row max of ``scale * q @ k^T``, softmax_sum the row sum of ``exp(x - max)``; the grad takes
  its probabilities from them, not from a recomputed softmax (op-plugin test/test_custom_ops/
  test_npu_flash_attention_grad.py builds them so: ``tsoftmax``, ``x_max.expand(..., 8)``), and D = rowsum(dy *
  attention_in), FlashAttention's backward;
- atten_mask: True/1 = the position does not take part; BNSS, B1SS, 11SS or SS; without atten_mask, sparse_mode,
  pre_tockens and next_tockens do not apply; sparse_mode 0 with a mask also drops keys more than next_tockens
  after / pre_tockens before the query (docs/context/torch_npu-npu_fusion_attention.md, 7.2.0);
- keep_prob < 1: dropout from a mask the grad regenerates from (seed, offset, numels); here a CPU generator
  seeded with ``seed`` stands for the NPU's Philox generator.

Layouts BSH, SBH, BSND and BNSD; N of key/value may divide N of query (GQA). Not modelled: TND (varlen), pse,
padding_mask, prefix, sparse_mode other than 0, NPU tensors (inputs stay on their device, here the CPU).
"""

import torch


def _head_dim(query, head_num, layout):
    return query.shape[-1] // head_num if layout in ("BSH", "SBH") else query.shape[-1]


def _to_bnsd(x, layout, head_dim):
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "SBH":
        x = x.transpose(0, 1)
    if layout in ("BSH", "SBH"):
        return x.reshape(x.shape[0], x.shape[1], x.shape[2] // head_dim, head_dim).transpose(1, 2)
    raise NotImplementedError(f"stand-in torch_npu: input_layout {layout!r} is not modelled")


def _from_bnsd(x, layout):
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.transpose(1, 2).contiguous()
    x = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], x.shape[1] * x.shape[3])
    return (x.transpose(0, 1) if layout == "SBH" else x).contiguous()


def _check(layout, pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, keep_prob):
    layout = layout.upper()  # FlashAttentionKernelNpuOpApi.cpp: case-insensitive
    if layout not in ("BSH", "SBH", "BNSD", "BSND", "TND"):
        raise RuntimeError(f"The input_layout should be BSH/SBH/BNSD/BSND/TND(case-insensitive), but got {layout}")
    if not 0 < keep_prob <= 1:
        raise RuntimeError(f"The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    unmodelled = {"pse": pse, "padding_mask": padding_mask, "prefix": prefix}
    unmodelled.update(actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    named = [name for name, value in unmodelled.items() if value is not None]
    if named or sparse_mode != 0:
        raise NotImplementedError(f"stand-in torch_npu: {named or f'sparse_mode={sparse_mode}'} not modelled")
    return layout


def _scores(q, k, scale, atten_mask, pre_tockens, next_tockens):
    """scale * q @ k^T in float32 with the masked positions at -inf ([B, N, Sq, Skv])."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if atten_mask is None:
        return s
    sq, skv = s.shape[-2:]
    i = torch.arange(sq, device=s.device).unsqueeze(1)
    j = torch.arange(skv, device=s.device).unsqueeze(0)
    masked = atten_mask.to(torch.bool) | (j - i > next_tockens) | (i - j > pre_tockens)
    return s.masked_fill(masked, float("-inf"))


def _dropout_keep(shape, keep_prob, seed, offset, device):
    generator = torch.Generator().manual_seed(seed + offset)
    return (torch.rand(shape, generator=generator) < keep_prob).to(device)


def _gqa(q, k, v):
    """k, v repeated to q's heads (N_q / N_kv must be an integer)."""
    group = q.shape[1] // k.shape[1]
    if group * k.shape[1] != q.shape[1]:
        raise RuntimeError(f"Nq/Nkv must be an integer, got {q.shape[1]}/{k.shape[1]}")
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), group


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
):
    layout = _check(input_layout, pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, keep_prob)
    d = _head_dim(query, head_num, layout)
    q, k, v = (_to_bnsd(x, layout, d).float() for x in (query, key, value))
    k, v, _ = _gqa(q, k, v)
    s = _scores(q, k, scale, atten_mask, pre_tockens, next_tockens)
    row_max = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - row_max)
    row_sum = e.sum(dim=-1, keepdim=True)
    p = e / row_sum
    numels = p.numel()  # dropout_gen_mask: [B, N, Sq, Skv]
    seed, offset = 0, 0
    if keep_prob < 1.0:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # upstream: the NPU generator's philox_engine_inputs
        p = p * _dropout_keep(p.shape, keep_prob, seed, offset, p.device) / keep_prob
    out = _from_bnsd(torch.matmul(p, v), layout).to(query.dtype)
    stats_shape = (*row_max.shape[:-1], 8)
    softmax_max = row_max.expand(stats_shape).contiguous()
    softmax_sum = row_sum.expand(stats_shape).contiguous()
    softmax_out = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, softmax_max, softmax_sum, softmax_out, seed, offset, numels


def npu_fusion_attention_grad(
    query,
    key,
    value,
    dy,
    head_num,
    input_layout,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    softmax_max=None,
    softmax_sum=None,
    softmax_in=None,
    attention_in=None,
    scale_value=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    seed=0,
    offset=0,
    numels=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
):
    layout = _check(input_layout, pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, keep_prob)
    d = _head_dim(query, head_num, layout)
    q, k, v, o, g = (_to_bnsd(x, layout, d).float() for x in (query, key, value, attention_in, dy))
    k_full, v_full, group = _gqa(q, k, v)
    s = _scores(q, k_full, scale_value, atten_mask, pre_tockens, next_tockens)
    p = torch.exp(s - softmax_max[..., :1]) / softmax_sum[..., :1]
    dp = torch.matmul(g, v_full.transpose(-1, -2))
    p_drop = p
    if keep_prob < 1.0:
        keep = _dropout_keep(p.shape, keep_prob, seed, offset, p.device) / keep_prob
        p_drop, dp = p * keep, dp * keep
    ds = p * (dp - (g * o).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k_full) * scale_value
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale_value
    dv = torch.matmul(p_drop.transpose(-1, -2), g)
    if group > 1:  # each key/value head served `group` query heads
        dk, dv = (x.unflatten(1, (k.shape[1], group)).sum(dim=2) for x in (dk, dv))
    dpse = torch.empty(0, dtype=query.dtype, device=query.device)
    return tuple(_from_bnsd(x, layout).to(query.dtype) for x in (dq, dk, dv)) + (dpse,)

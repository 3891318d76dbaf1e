"""float64 on the npu backend (docs/float64.md), against the torch_npu stand-in.

Many NPU kernels reject float64/complex128 (diffusers #10428). diffusers v0.40.0 downcasts for npu
in ``maybe_adjust_dtype_for_device`` (``src/diffusers/utils/torch_utils.py:107,178``), which the
UNets', Flux's, Flux2's, HiDream's, Krea2's and the sin-cos tables' float64 paths go through, but
Lumina2 guards only mps: ``transformer_lumina2.py:245``
``freqs_dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64`` builds
complex128 tables (``embeddings.py:1120`` ``get_1d_rotary_pos_embed``, ``:1183`` ``torch.polar`` of
float64 on the CPU), and ``_get_freqs_cis`` (``transformer_lumina2.py:251``) moves them to the device
each forward, where ``apply_rotary_emb`` (``embeddings.py:1239``, ``x_rotated * freqs_cis``; called at
``transformer_lumina2.py:114-115``) multiplies the queries and keys by them. All lines: diffusers v0.40.0.

Witness: the real Lumina2Transformer2DModel (tiny, random weights) runs a forward on the CPU in a
process whose backend is npu (the stand-in torch_npu), under a TorchDispatchMode that records the
dtype of every tensor every op produces. The stand-in has no NPU tensors, so what the forward
would put on the device is what it computes here. Stock is ``ACCEL_NPU_DISABLE=1``.
"""

from __future__ import annotations

import pytest
import torch

from ..launch_utils import results
from .test_npu_contract import env_with, make_site, py

pytestmark = pytest.mark.contract

LUMINA2_PROBE = """
import json, sys, torch, torch_npu
from torch.utils._python_dispatch import TorchDispatchMode
from diffusers import Lumina2Transformer2DModel
from diffusers.models import normalization
from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device

# RMSNorm calls torch_npu.npu_rms_norm whenever torch_npu is installed (normalization.py RMSNorm.forward);
# the stand-in has no kernels (it raises, as torch_npu without an NPU does), so the norms take diffusers'
# own torch path (float32 as well). Both halves run the same way; the dtypes in question are the RoPE's.
normalization.is_torch_npu_available = lambda: False

class Dtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = {}
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.seen.setdefault(str(t.dtype), set()).add(str(func.overloadpacket))
        return out

torch.manual_seed(0)
model = Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
    num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None,
    norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32).eval()
g = torch.Generator().manual_seed(1)
inputs = dict(hidden_states=torch.randn(2, 4, 16, 16, generator=g),
              encoder_hidden_states=torch.randn(2, 16, 32, generator=g), timestep=torch.rand(2, generator=g),
              encoder_attention_mask=torch.ones(2, 16, dtype=torch.bool))
mode = Dtypes()
with torch.no_grad(), mode:
    out = model(**inputs, return_dict=False)[0]
torch.save(out, sys.argv[1])
print("RESULT " + json.dumps({
    "backend_npu": torch.npu.device_count() > 0,
    "tables": [str(f.dtype) for f in model.rope_embedder.freqs_cis],
    "forward_dtypes": {k: sorted(v) for k, v in mode.seen.items()},
    "upstream_npu_guard": str(maybe_adjust_dtype_for_device(torch.float64, torch.device("npu"))),
}))
"""

WIDE = {"torch.float64", "torch.complex128"}


@pytest.mark.slow
def test_lumina2_rope_puts_no_float64_on_the_npu(tmp_path):
    site = make_site(tmp_path)
    runs = {}
    for name, extra in (("ours", {}), ("stock", {"ACCEL_NPU_DISABLE": "1"})):
        path = tmp_path / f"{name}.pt"
        proc = py(LUMINA2_PROBE.replace("sys.argv[1]", repr(str(path))), env_with(site, **extra))
        (r,) = results(proc) or [None]
        assert r is not None, proc.stderr[-3000:]
        runs[name] = (r, torch.load(path))
    (ours, ours_out), (stock, stock_out) = runs["ours"], runs["stock"]
    # diffusers' own npu guard (torch_utils.py:107-110,178-180) is real: the category the doc calls guarded
    assert ours["upstream_npu_guard"] == stock["upstream_npu_guard"] == "torch.float32"
    assert ours["backend_npu"] and stock["backend_npu"]
    # stock: complex128 tables (transformer_lumina2.py:245) and complex128 products in the forward
    assert stock["tables"] == ["torch.complex128"] * 3, stock
    assert "torch.complex128" in stock["forward_dtypes"], stock["forward_dtypes"]
    assert "aten.mul" in stock["forward_dtypes"]["torch.complex128"]  # apply_rotary_emb: x_rotated * freqs_cis
    # ours: complex64 tables and not one float64/complex128 tensor in the whole forward
    assert ours["tables"] == ["torch.complex64"] * 3, ours
    assert not WIDE & set(ours["forward_dtypes"]), ours["forward_dtypes"]
    assert "aten.mul" in ours["forward_dtypes"]["torch.complex64"]
    # same numbers as the float64 reference (the table is still computed in float64, on the host)
    assert ours_out.dtype == stock_out.dtype == torch.float32
    torch.testing.assert_close(ours_out, stock_out, rtol=1e-5, atol=1e-5)
    assert ours_out.abs().max() > 0.1  # a real output, not zeros

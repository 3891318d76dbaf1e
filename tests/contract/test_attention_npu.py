"""CUDA attention flags on the npu backend, against the torch_npu stand-in (tests/contract/standin).

tests/scripts/attention_flags.py (the official scripts' xformers sequence on a tiny
UNet2DConditionModel and FluxTransformer2DModel; a tiny Llama loaded with
``attn_implementation="flash_attention_2"``) with torch_npu installed:
- diffusers: the UNet's attention layers get diffusers' own ``AttnProcessorNPU``
  (diffusers/models/attention_processor.py: torch_npu.npu_fusion_attention for fp16/bf16, SDPA for
  fp32); stock raises;
- transformers: ``flash_attention_2`` is left to transformers, which accepts it when torch_npu is
  there (``custom_supported_devices`` in transformers/modeling_flash_attention_utils.py): the same
  as stock.
The stand-in has no NPU kernels (with torch_npu installed diffusers' GEGLU calls torch_npu.npu_geglu),
so no forward runs here; tests/test_attention_flags.py compares outputs on the cpu backend.

diffusers' NPU attention backend under context parallelism (tests/scripts/npu_attention_grad.py): its
forward/backward ops, called by diffusers' own TemplatedUlyssesAttention and TemplatedRingAttention (1-rank gloo
group) and by hand as ring attention merges two key chunks, give the output and dq/dk/dv of autograd through
torch's SDPA on the same fp32 inputs, within ATOL; stock's backward raises NotImplementedError. The stand-in's
npu_fusion_attention / npu_fusion_attention_grad (plain torch math, op-plugin's contract) are checked against
SDPA in every layout they model, and grad kernels returning wrong values are caught by the same comparison.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..launch_utils import SCRIPTS, explain, results, run_concurrently
from .test_npu_contract import env_with, make_site

#: fp32 against SDPA: measured up to 7.2e-7 (largest over the cases, torch 2.13 CPU); a wrong grad misses by >= 1e-2
ATOL = 1e-5

pytestmark = pytest.mark.contract


def _probe(work, site, **env):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "attention_flags.py"), str(work), "--no-forward"],
        env=env_with(site, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", **env),
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )


@pytest.mark.slow
def test_npu_flags_run_torch_npu_attention_and_stock_raises(tmp_path):
    site = make_site(tmp_path)
    (tmp_path / "ours").mkdir(), (tmp_path / "stock").mkdir()
    ours, stock = run_concurrently(
        lambda: _probe(tmp_path / "ours", site), lambda: _probe(tmp_path / "stock", site, ACCEL_NPU_DISABLE="1")
    )
    (r,), (s,) = results(ours) or [None], results(stock) or [None]
    assert r is not None, explain(ours)
    assert s is not None, explain(stock)

    assert s["script_sees_xformers"] is False and s["unet_enable_error"].startswith("ModuleNotFoundError"), s
    assert r["script_sees_xformers"] is True and r["library_sees_xformers"] is False, r
    assert r["unet_processors_before"] == ["AttnProcessor2_0"] and r["unet_processors"] == ["AttnProcessorNPU"], r
    assert r["flux_enabled"] is True and r["flux_backends"] == ["None"], r  # native SDPA, which torch_npu runs
    assert sum("AttnProcessorNPU" in line for line in ours.stderr.splitlines()) == 1, ours.stderr[-3000:]

    # transformers' own Ascend path, in both halves
    assert r["llama_attn_implementation"] == s["llama_attn_implementation"] == "flash_attention_2", (r, s)
    assert sum("transformers' Ascend path" in line for line in ours.stderr.splitlines()) == 1, ours.stderr[-3000:]


def _grad_probe(work, site, **env):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "npu_attention_grad.py"), str(work)],
        env=env_with(site, **env),
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )


@pytest.mark.slow
def test_npu_attention_backward_under_context_parallelism_matches_sdpa_autograd(tmp_path):
    site = make_site(tmp_path)
    (tmp_path / "ours").mkdir(), (tmp_path / "stock").mkdir()
    ours, stock = run_concurrently(
        lambda: _grad_probe(tmp_path / "ours", site),
        lambda: _grad_probe(tmp_path / "stock", site, ACCEL_NPU_DISABLE="1"),
    )
    (r,), (s,) = results(ours) or [None], results(stock) or [None]
    assert r is not None, explain(ours)
    assert s is not None, explain(stock)

    # stock: diffusers' backward op raises (attention_dispatch.py _npu_attention_backward_op)
    assert s["error"] == "NotImplementedError: Backward pass is not implemented for Npu Fusion Attention.", s
    # ours: every case within ATOL of SDPA's autograd
    assert "error" not in r, r
    diffs = r["max_abs_diff"]
    assert {"ulysses no mask", "ulysses [B,Skv] mask", "ring no mask", "ring merged over 2 key chunks"} <= set(diffs)
    assert {f"kernel {layout}" for layout in ("BNSD", "BSND", "BSH", "SBH")} <= set(diffs)
    assert all(d <= ATOL for d in diffs.values()), diffs
    assert r["kernel_stats_shapes_ok"] is True, r  # softmax_max/softmax_sum float32 [B, N, S, 8], numels B*N*S*S
    # the checker: each wrong grad kernel misses in every case
    assert set(r["wrong_grad"]) == {"dq 1% off", "dk and dv swapped", "softmax_max ignored", "attention_in ignored"}
    for name, wrong in r["wrong_grad"].items():
        assert isinstance(wrong, dict) and set(wrong) == set(diffs), (name, wrong)
        assert all(d > 100 * ATOL for d in wrong.values()), (name, wrong)

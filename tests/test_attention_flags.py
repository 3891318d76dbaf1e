"""CUDA attention flags on the cpu backend (plugins/attention), stock and accel-npu side by side.

tests/scripts/attention_flags.py runs, in one process each, diffusers' xformers switch the way the
official scripts write it (``is_xformers_available()`` -> ``import xformers`` -> ``version.parse(
xformers.__version__)`` -> ``unet.enable_xformers_memory_efficient_attention()``) on a tiny
UNet2DConditionModel and FluxTransformer2DModel, and transformers'
``from_pretrained(attn_implementation="flash_attention_2")`` of a tiny Llama saved locally.
Stock (ACCEL_NPU_DISABLE=1) raises at each; accel-npu runs SDPA and the outputs equal SDPA's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .launch_utils import SCRIPTS, base_env, explain, results, run_concurrently


def _probe(work, **env):
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "attention_flags.py"), str(work)],
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """(ours, its results, stock's, a plain process's): ours is the script as a torchrun rank runs it (LOCAL_RANK
    set); a plain `python` process with nothing opted in is left as stock leaves it (docs/cuda-compat.md)."""
    ours_dir, stock_dir, plain_dir = (tmp_path_factory.mktemp(n) for n in ("ours", "stock", "plain"))
    ours, stock, plain = run_concurrently(
        lambda: _probe(ours_dir, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"),
        lambda: _probe(stock_dir, ACCEL_NPU_DISABLE="1"),
        lambda: _probe(plain_dir),
    )
    (r_ours,), (r_stock,), (r_plain,) = results(ours) or [None], results(stock) or [None], results(plain) or [None]
    assert r_ours is not None, explain(ours)
    assert r_stock is not None, explain(stock)
    assert r_plain is not None, explain(plain)
    return ours, r_ours, r_stock, r_plain


@pytest.mark.slow
def test_a_plain_process_meets_each_flag_as_stock_does(probes):
    *_, stock, plain = probes
    assert plain == stock


@pytest.mark.slow
def test_stock_raises_at_each_flag(probes):
    _, _, stock, _ = probes
    assert stock["script_sees_xformers"] is False  # the official scripts raise "xformers is not available" here
    assert stock["unet_enable_error"].startswith("ModuleNotFoundError"), stock
    assert stock["flux_enable_error"].startswith("ModuleNotFoundError"), stock
    assert stock["llama_fa2_error"].startswith("ImportError: FlashAttention2"), stock


@pytest.mark.slow
def test_xformers_switch_runs_sdpa_on_cpu(probes):
    proc, ours, *_ = probes
    # the script is told xformers is there, diffusers (a library) is told the truth
    assert ours["script_sees_xformers"] is True and ours["library_sees_xformers"] is False, ours
    assert ours["xformers_version"] == "0.0.0+accel.npu", ours
    assert "xformers_ops_error" in ours and ours["xformers_ops_error"].startswith("ModuleNotFoundError"), ours
    assert ours["unet_enabled"] is True and ours["flux_enabled"] is True, ours
    assert ours["unet_processors"] == ["AttnProcessor2_0"], ours  # diffusers' SDPA processor, as before
    assert ours["flux_backends"] == ["None"], ours  # the native (SDPA) dispatch backend
    assert ours["unet_max_abs_diff_vs_sdpa"] == 0.0, ours
    lines = [line for line in proc.stderr.splitlines() if "enable_xformers_memory_efficient_attention()" in line]
    assert len(lines) == 2, proc.stderr[-3000:]  # one per attention kind, not one per layer


@pytest.mark.slow
def test_flash_attention_2_runs_sdpa_on_cpu(probes):
    proc, ours, *_ = probes
    assert ours["llama_attn_implementation"] == "sdpa", ours
    assert ours["llama_max_abs_diff_vs_sdpa"] == 0.0, ours
    assert sum("flash_attention_2" in line for line in proc.stderr.splitlines()) == 1, proc.stderr[-3000:]


def test_passes_through_where_cuda_is_available(monkeypatch):
    from accel_npu.plugins.attention import diffusers, target, transformers

    monkeypatch.setattr(target, "cuda_available", lambda: True)
    stock = lambda *args, **kwargs: ("stock", args, kwargs)  # noqa: E731 - a stand-in for the wrapped function, one expression
    assert diffusers.is_xformers_available(lambda: False, None, (), {}) is False
    assert diffusers.attention_set_xformers(stock, object(), (True,), {}) == ("stock", (True,), {})
    assert diffusers.attention_module_set_xformers(stock, object(), (True,), {}) == ("stock", (True,), {})

    class Model:
        _supports_flash_attn = _supports_sdpa = True

    assert transformers.check_and_adjust_attn_implementation(stock, Model(), ("flash_attention_2",), {}) == (
        "stock",
        ("flash_attention_2",),
        {},
    )

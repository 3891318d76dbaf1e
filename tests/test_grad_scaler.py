"""A "cuda" GradScaler scales where autocast("cuda") runs (npu; cpu on the debug backend).

tests/scripts/fp16_scaler_underflow.py trains under ``torch.autocast("cuda", torch.float16)`` with
a loss whose gradients lie below float16's smallest subnormal, with each "cuda" GradScaler
spelling, beside an fp32 reference. Three processes, each a launched rank (LOCAL_RANK=0, as
``accelerate launch``/torchrun give it):
- accel-npu: the scaler is enabled on cpu, its scale moves, gradients match fp32;
- accel-npu without the GradScaler patch (the regression it fixes): autocast runs fp16 but the
  scaler is disabled, every gradient is exactly zero and the parameters never move;
- stock (ACCEL_NPU_DISABLE=1): autocast *and* the scaler are disabled: correct, but fp32.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import accel_npu
from accel_npu.plugins import precision
from accel_npu.plugins.precision import loss_scaling
from tests.inprocess import stock

from .launch_utils import SCRIPTS, base_env, explain, results, run_concurrently

SCRIPT = SCRIPTS / "fp16_scaler_underflow.py"


def _run(**env):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=base_env(LOCAL_RANK="0", **env), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, explain(proc)
    (rec,) = results(proc)
    return rec["runs"], proc


@pytest.fixture(scope="module")
def runs():
    from accel_npu._torch.device import cuda_available

    assert not cuda_available()  # no real CUDA on this machine
    return run_concurrently(
        lambda: _run(),
        lambda: _run(ACCEL_NPU_DISABLED_PATCHES=precision.GRAD_SCALER.target),
        lambda: _run(ACCEL_NPU_DISABLE="1"),
    )


@pytest.mark.slow
def test_cuda_grad_scaler_scales_on_the_autocast_device(runs):
    (ours, proc), _, _ = runs
    assert len(ours) == 6  # three spellings x (SGD, fused AdamW)
    for name, r in ours.items():
        assert r["enabled"] is True, name
        assert r["autocast_output_dtype"] == "torch.float16", name  # fp16 really ran
        assert r["scales"] == [2.0**17, 2.0**18, 2.0**19], name  # growth_interval=1: it moves
        assert r["zero_grad_fraction"] == 0.0, name
        assert r["grad_rel_err"] < 5e-3, name  # fp16 forward vs fp32
        assert r["param_rel_err"] < 0.05 * r["params_moved"], name
    assert (proc.stdout + proc.stderr).count("GradScaler('cuda') scales on 'cpu'") == 1


@pytest.mark.slow
def test_without_the_patch_fp16_gradients_underflow(runs):
    _, (unpatched, _), _ = runs
    for name, r in unpatched.items():
        assert r["enabled"] is False and r["scales"] == [1.0] * 3, name
        assert r["autocast_output_dtype"] == "torch.float16", name
        assert r["zero_grad_fraction"] == 1.0, name  # every gradient lost
        assert r["params_moved"] < 0.01 * r["param_rel_err"], name


@pytest.mark.slow
def test_stock_disables_both_and_runs_fp32(runs):
    _, _, (theirs, _) = runs
    for name, r in theirs.items():
        assert r["enabled"] is False and r["autocast_output_dtype"] == "torch.float32", name
        assert r["grad_rel_err"] == 0.0, name


@pytest.fixture
def active():
    accel_npu.patch()
    loss_scaling._once.clear()
    yield
    accel_npu.patch()


def test_other_scalers_untouched_and_cuda_passes_through(active, monkeypatch):
    assert torch.amp.GradScaler("cpu")._device == "cpu"
    assert torch.amp.GradScaler("cuda", enabled=False).is_enabled() is False  # enabled=False is kept
    assert torch.amp.GradScaler(device="cuda")._device == "cpu"
    with stock(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.amp.GradScaler("cuda").is_enabled() is False
    monkeypatch.setattr(loss_scaling, "cuda_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cuda")
    assert scaler._device == "cuda"  # on a CUDA machine torch gets "cuda" untouched

"""Precision, end to end: an unchanged CUDA-style script trains end to end on 2 CPU ranks.

tests/scripts/cuda_style_train.py: torch.autocast("cuda", dtype=torch.bfloat16) in the forward,
AdamW(fused=True), an eval pass under @torch.inference_mode() after step 2 whose bf16 predictions
go through .cpu().numpy() for a metric; launched with `accelerate launch` under DeepSpeed ZeRO-3
bf16 with mixed_precision: bf16 *also* set in the accelerate config.
"""

from __future__ import annotations

import math

import pytest

from .launch_utils import SCRIPTS, accelerate_launch, base_env, explain, results, write_deepspeed_config, zero_config


@pytest.fixture(scope="module")
def launch_config(tmp_path_factory):
    return write_deepspeed_config(
        tmp_path_factory.mktemp("e2e"), zero_config(3, bf16=True), accelerate_extra={"mixed_precision": "bf16"}
    )


@pytest.mark.slow
def test_cuda_style_script_trains_with_accel_npu(launch_config):
    proc = accelerate_launch(
        ["--config_file", str(launch_config), str(SCRIPTS / "cuda_style_train.py"), "--steps", "4", "--eval-after", "2"]
    )
    assert proc.returncode == 0, explain(proc)
    recs = results(proc)
    assert [r["rank"] for r in recs] == [0, 1], explain(proc)
    out = proc.stdout + proc.stderr
    for r in recs:
        assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.DEEPSPEED"
        assert len(r["losses"]) == 4  # trained to the end, past the eval
        assert r["activation_dtypes"] == ["bfloat16"] * 4  # autocast really ran bf16
        # fp32 activations into the bf16 engine come back fp32, as accelerate's convert_outputs_to_fp32 hands them
        # back under DDP (plugins/deepspeed/input_dtype.py); bf16's .numpy() is tested in tests/test_precision.py
        assert r["eval_pred_dtype"] == "torch.float32" and r["eval_numpy_dtype"] == "float32"
        # a finite MSE of the right size (targets are sums of 8 N(0, 1): variance 8)
        assert math.isfinite(r["eval_metric"]) and 0 < r["eval_metric"] < 50, r["eval_metric"]
        assert r["ds_bf16"] == {"enabled": True} and r["param_dtype"] == "torch.bfloat16"
    # one line per launch states the effective precision; the remap is logged once per rank
    assert out.count("accel-npu: mixed precision = bf16") == 1, explain(proc)
    assert out.count("runs as torch.autocast('cpu', dtype=bfloat16)") == 2


@pytest.mark.slow
def test_same_run_stock_fails(launch_config):
    proc = accelerate_launch(
        [
            "--config_file",
            str(launch_config),
            str(SCRIPTS / "cuda_style_train.py"),
            "--steps",
            "4",
            "--eval-after",
            "2",
        ],
        env=base_env(ACCEL_NPU_DISABLE="1"),
    )
    # Stock accelerate 1.15 refuses mixed_precision beside deepspeed_config_file in every worker,
    # before any training step: it fails (it does not silently run fp32).
    assert proc.returncode != 0, explain(proc)
    assert "the following accelerate config variables will be ignored" in proc.stdout + proc.stderr, explain(proc)
    assert not results(proc)

"""mixed_precision vs DeepSpeed JSON, launch-side DeepSpeed file wins over a
hard-coded DeepSpeedPlugin(hf_ds_config=...), ZeRO-3 + @torch.inference_mode() eval.

In-process tests build real accelerate DeepSpeedPlugin objects (no distributed state needed) and
show stock beside ours with accel_npu.unpatch(). Launch tests run real `accelerate launch` /
torchrun processes on 2 CPU ranks (stock = ACCEL_NPU_DISABLE=1).
"""

from __future__ import annotations

import json
import logging

import pytest

import accel_npu
from accel_npu.errors import ConfigError
from accel_npu.plugins.deepspeed.precision_config import file_precision, resolve_precision
from tests.inprocess import stock

from .launch_utils import (
    SCRIPTS,
    accelerate_launch,
    base_env,
    explain,
    results,
    run_concurrently,
    torchrun_launch,
    write_deepspeed_config,
    zero_config,
)


@pytest.fixture(autouse=True)
def active():
    accel_npu.patch()
    yield
    accel_npu.patch()


def _ds_file(tmp_path, name, bf16=None, fp16=None, stage=2):
    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    if bf16 is not None:
        cfg["bf16"] = {"enabled": bf16}
    if fp16 is not None:
        cfg["fp16"] = {"enabled": fp16}
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


# -- mixed_precision vs the DeepSpeed file: the resolution rule -----------------------------------------
@pytest.mark.parametrize(
    "acc,ds,effective",
    [
        ("bf16", {"bf16": {"enabled": True}}, "bf16"),
        ("no", {"bf16": {"enabled": True}}, "bf16"),  # the hand edit users made, now unnecessary
        ("bf16", {"bf16": {"enabled": "auto"}}, "bf16"),  # file defers to accelerate
        ("fp16", {}, "fp16"),
        ("bf16", {"bf16": {"enabled": False}}, "no"),  # the file decides
        ("fp8", {"bf16": {"enabled": True}}, "fp8"),
    ],
)
def test_deepspeed_file_decides_precision(acc, ds, effective):
    assert resolve_precision(acc, "accelerate config a.yaml", ds, "ds.json")[0] == effective


def test_real_contradiction_is_one_error_naming_both():
    with pytest.raises(ConfigError) as err:
        resolve_precision(
            "fp16", "mixed_precision in accelerate config /x/acc.yaml", {"bf16": {"enabled": True}}, "/x/ds.json"
        )
    msg = str(err.value)
    assert "/x/acc.yaml" in msg and "'fp16'" in msg and "/x/ds.json" in msg and "'bf16'" in msg
    assert file_precision({"fp16": {"enabled": "true"}}) == "fp16"


# -- the same rule in a worker: accelerate's own checks, stock beside ours ------------------------------
def test_mixed_precision_beside_deepspeed_config_file(tmp_path, monkeypatch, caplog):
    from accelerate.utils import DeepSpeedPlugin

    ds = _ds_file(tmp_path, "ds.json", bf16=True)
    # what `accelerate launch` exports for an accelerate config with mixed_precision: bf16
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero3_init_flag,mixed_precision")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", ds)
    with stock(), pytest.raises(ValueError, match="the following accelerate config variables will be ignored"):
        DeepSpeedPlugin()
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"]["enabled"] is True


def test_set_mixed_precision_contradiction(tmp_path, caplog):
    from accelerate.utils import DeepSpeedPlugin

    ds = _ds_file(tmp_path, "ds.json", bf16=True)
    with stock(), pytest.raises(ValueError, match="cannot be set to `fp16` when `bf16` is set"):
        DeepSpeedPlugin(hf_ds_config=ds).set_mixed_precision("fp16")
    with pytest.raises(ConfigError, match=r"says 'fp16' but the DeepSpeed config .*ds\.json enables 'bf16'"):
        DeepSpeedPlugin(hf_ds_config=ds).set_mixed_precision("fp16")


def test_set_mixed_precision_file_off_wins_and_says_so(tmp_path, caplog):
    from accelerate.utils import DeepSpeedPlugin

    ds = _ds_file(tmp_path, "ds.json", bf16=False)
    with stock():
        plugin = DeepSpeedPlugin(hf_ds_config=ds)
        plugin.set_mixed_precision("bf16")  # stock: silently keeps fp32
    assert plugin.deepspeed_config["bf16"]["enabled"] is False
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        plugin = DeepSpeedPlugin(hf_ds_config=ds)
        plugin.set_mixed_precision("bf16")
    assert plugin.deepspeed_config["bf16"]["enabled"] is False
    assert any("mixed precision = no" in r.getMessage() and "ds.json" in r.getMessage() for r in caplog.records)


# -- a script's hard-coded hf_ds_config vs the launch config's file -------------------------------------
def test_launch_deepspeed_file_wins_over_hard_coded_path(tmp_path, monkeypatch, caplog):
    from accelerate.utils import DeepSpeedPlugin

    script_file = _ds_file(tmp_path, "hf_default_zero2.json", stage=2)
    launch_file = _ds_file(tmp_path, "npu_zero3.json", stage=3)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", launch_file)
    with stock():
        assert DeepSpeedPlugin(hf_ds_config=script_file).zero_stage == 2  # launch file silently ignored
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        plugin = DeepSpeedPlugin(hf_ds_config=script_file)
    assert plugin.zero_stage == 3
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    assert any("hf_default_zero2.json" in r.getMessage() and "npu_zero3.json" in r.getMessage() for r in caplog.records)


def test_without_launch_file_the_script_choice_stands(tmp_path, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    script_file = _ds_file(tmp_path, "script.json", stage=2)
    assert DeepSpeedPlugin(hf_ds_config=script_file).zero_stage == 2


# -- launches ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_contradiction_refused_in_launcher_before_workers(tmp_path):
    yaml_path = write_deepspeed_config(
        tmp_path, zero_config(2, bf16=True), accelerate_extra={"mixed_precision": "fp16"}
    )
    proc = accelerate_launch(["--config_file", str(yaml_path), str(SCRIPTS / "cuda_style_train.py")])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, explain(proc)
    assert "accel_npu.errors.ConfigError" in out and "contradicts itself" in out, explain(proc)
    assert str(yaml_path) in out and str(tmp_path / "ds_config.json") in out
    assert "[rank0]" not in out and not results(proc)  # no worker started


@pytest.mark.slow
def test_zero3_inference_mode_eval_between_steps(tmp_path):
    """An @torch.inference_mode() eval between ZeRO-3 steps, plain DeepSpeed under torchrun, 2 CPU ranks."""

    def run(**extra):
        return torchrun_launch([str(SCRIPTS / "zero3_inference_eval.py")], env=base_env(DS_ACCELERATOR="cpu", **extra))

    # the stock and the patched launch are independent: they run side by side
    theirs, ours = run_concurrently(lambda: run(ACCEL_NPU_DISABLE="1"), run)
    assert theirs.returncode != 0
    assert "Inference tensors cannot be saved for backward" in theirs.stdout + theirs.stderr, explain(theirs)
    assert ours.returncode == 0, explain(ours)
    recs = results(ours)
    assert len(recs) == 2 and len(recs[0]["losses"]) == 4
    assert recs[0]["losses"][-1] < recs[0]["losses"][0]


def test_configure_deepspeed_hook_sees_every_config_with_its_source(tmp_path, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    from accel_npu import hookimpl
    from accel_npu.manager import get_plugin_manager

    seen = []

    class TunesBuckets:
        @hookimpl
        def accel_npu_configure_deepspeed(self, ds_config, source):
            seen.append(source)
            ds_config["zero_optimization"]["reduce_bucket_size"] = 12345

    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    pm = get_plugin_manager()
    plugin = TunesBuckets()
    pm.register(plugin, name="tunes-buckets")
    try:
        ds = _ds_file(tmp_path, "ds.json", stage=2)
        from_file = DeepSpeedPlugin(hf_ds_config=ds)
        from_dict = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}})
    finally:
        pm.unregister(plugin)
    assert seen == [ds, "<script>"]
    assert from_file.deepspeed_config["zero_optimization"]["reduce_bucket_size"] == 12345
    assert from_dict.deepspeed_config["zero_optimization"]["reduce_bucket_size"] == 12345

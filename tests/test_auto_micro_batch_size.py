""" "train_micro_batch_size_per_gpu": "auto" with a DataLoader built on a batch_sampler.

Stock accelerate reads the "auto" from ``DataLoader.batch_size`` only, which is None for a loader
built with ``batch_sampler=`` (diffusers' train_dreambooth_lora_qwen_image.py and its bucketing
siblings): prepare fails. With accel-npu the sampler's batch size is used. A loader with no batch size
anywhere, prepared in a call of its own, is prepared and leaves "auto" for the model's call (that case,
trained, and prepare without a DataLoader: tests/test_deepspeed_auto_micro_batch.py).
"""

import pytest

from tests.launch_utils import accelerate_launch, base_env, explain, results, write_deepspeed_config, zero_config

SCRIPT = "tests/scripts/batch_sampler_auto.py"


@pytest.mark.slow
def test_auto_micro_batch_size_from_a_batch_sampler(tmp_path):
    config = write_deepspeed_config(tmp_path, zero_config(2), num_processes=2)

    # Stock accelerate's prepare, everything else of accel-npu on: fully stock accelerate cannot form
    # the DeepSpeed group of CPU ranks at all (every rank is rank 0 of 1; plugins/devices/cpu.py).
    stock = accelerate_launch(
        ["--config_file", str(config), SCRIPT],
        timeout=180,
        env=base_env(ACCEL_NPU_DISABLED_PATCHES="accelerate.accelerator:Accelerator.prepare"),
    )
    assert stock.returncode != 0 and not results(stock), explain(stock)
    assert "has `None` as batch size" in stock.stderr, explain(stock)

    ours = accelerate_launch(["--config_file", str(config), SCRIPT])
    assert ours.returncode == 0, explain(ours)
    ranks = results(ours)
    assert [r["rank"] for r in ranks] == [0, 1], explain(ours)
    for r in ranks:
        # 12 samples in batches of 3, the batches dealt out to 2 ranks: 2 steps of 3 each
        assert r["shapes"] == [[3, 4], [3, 4]], r
        assert r["engine_micro_batch"] == 3 and r["engine_train_batch"] == 6, r
        assert r["whole_batches"] == "prepared" and r["after_whole_batches"] == "auto", r

"""Loading, end to end: real `accelerate launch` processes on CPU (tiny real models, no hub)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.launch_utils import SCRIPTS, accelerate_launch, base_env, explain, results, run_concurrently, zero_config

sys.path.insert(0, str(SCRIPTS))


@pytest.fixture(scope="module")
def deep_qwen(tmp_path_factory):
    """A Qwen-Image-shaped DiT checkpoint (reduced width), 6 blocks, bf16, sharded with an index."""
    import tiny_models as tm
    import torch

    path = tmp_path_factory.mktemp("accept") / "qwen6"
    tm.randomize(tm.qwen(num_layers=6)).to(torch.bfloat16).save_pretrained(str(path), max_shard_size="60KB")
    return path


@pytest.mark.slow
def test_two_ranks_train_with_the_loss_of_one_rank(deep_qwen):
    """2 ranks train with the loss of 1 rank, quick variant (benchmarks/loss_equality.py runs 100 steps):
    the unchanged script loads the whole model without torch_dtype and slices 2 blocks itself;
    ACCEL_NPU_TRUNCATE makes the load read only those 2 blocks and the slicing a no-op."""

    def launch(n):
        return accelerate_launch(
            [
                "--num_processes",
                str(n),
                "--num_machines",
                "1",
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                str(SCRIPTS / "train_qwen_truncated.py"),
                str(deep_qwen),
                "--steps",
                "8",
            ],
            env=base_env(ACCEL_NPU_TRUNCATE="QwenImageTransformer2DModel:2"),
            timeout=600,
        )

    runs = {}
    for n, proc in zip((1, 2), run_concurrently(lambda: launch(1), lambda: launch(2))):
        assert proc.returncode == 0, explain(proc)
        res = results(proc)
        assert len(res) == n and all(r["world"] == n for r in res), explain(proc)
        assert all(r["before"] == 2 and r["blocks"] == 2 for r in res)  # built with 2: slicing was a no-op
        assert "truncated to num_layers=2 of 6" in proc.stderr
        runs[n] = res[0]["losses"]
    one, two = runs[1], runs[2]
    assert len(one) == len(two) == 8
    diff = sum(abs(a - b) for a, b in zip(one, two)) / len(one)
    print("step  loss(1 rank)  loss(2 ranks)")
    for i, (a, b) in enumerate(zip(one, two)):
        print(f"{i + 1:4d}  {a:.6f}  {b:.6f}")
    assert diff < 1e-5, (diff, one, two)  # measured about 1e-7: the same model, the same data


DIFFUSERS_FROM_PRETRAINED = "diffusers.models.modeling_utils:ModelMixin.from_pretrained"


def _zero3_launch_config(directory: Path) -> Path:
    ds = directory / "ds_zero3_bf16.json"
    ds.write_text(json.dumps(zero_config(3, bf16=True)))
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": str(ds), "zero3_init_flag": True},
        "num_machines": 1,
        "num_processes": 1,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": False,
    }
    path = directory / "zero3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_frozen_tower_loads_outside_zero_init(tmp_path):
    """zero3_init_context_manager(enable=False) is accelerate's documented way to keep a frozen
    tower out of zero.Init; in accelerate 1.15 it does not work (accelerate #3170)."""
    import tiny_models as tm

    tm.randomize(tm.llama()).save_pretrained(str(tmp_path / "llama"))  # fp32 checkpoint
    config = _zero3_launch_config(tmp_path)
    got = {}
    for label, disable in (("stock", "1"), ("ours", "0")):
        proc = accelerate_launch(
            ["--config_file", str(config), str(SCRIPTS / "load_frozen_towers.py"), str(tmp_path / "llama")],
            env=base_env(ACCEL_NPU_DISABLE=disable),
            timeout=600,
        )
        assert proc.returncode == 0, explain(proc)
        got[label] = results(proc)[0]
    # stock: the "frozen" tower is partitioned by zero.Init and cast to the DS config's bf16
    assert got["stock"]["frozen"] == {"partitioned": True, "dtype": "torch.bfloat16", "numel": 0}
    # ours: whole, fp32 as in the checkpoint; the trained model still goes through zero.Init
    assert got["ours"]["frozen"]["partitioned"] is False and got["ours"]["frozen"]["dtype"] == "torch.float32"
    assert got["ours"]["frozen"]["numel"] > 0
    assert got["ours"]["trained"]["partitioned"] is True


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    """A small fp32 AutoencoderKL checkpoint (a pipeline's frozen VAE)."""
    import tiny_models as tm
    import torch
    from diffusers import AutoencoderKL

    path = tmp_path_factory.mktemp("vae") / "vae"
    torch.manual_seed(0)
    tm.randomize(
        AutoencoderKL(
            block_out_channels=(8, 16),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4,
            norm_num_groups=4,
            layers_per_block=1,
        )
    ).save_pretrained(str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("vae_child", [False, True], ids=["vae-standalone", "vae-held-by-model"])
def test_zero3_loads_straight_into_partitions_read_once(tmp_path, deep_qwen, tiny_vae, vae_child):
    """Under ZeRO-3 with zero3_init_flag, the unchanged script (whole
    model, no torch_dtype) loads each rank's 1/N partition only — rank 0 reads the checkpoint
    once — and trains with exactly the losses of stock diffusers' load (its from_pretrained
    unpatched: ACCEL_NPU_DISABLED_PATCHES), which every rank reads whole. A frozen VAE loaded the
    same way and used outside the engine (or held by the model and kept out of the engine at
    prepare) is rebuilt whole, fp32, as stock. What each rank read is counted by the script itself
    (the tensors it takes out of the shards), not by accel-npu."""
    config = _zero3_launch_config(tmp_path)
    args = [
        "--config_file",
        str(config),
        "--num_processes",
        "2",
        str(SCRIPTS / "train_qwen_truncated.py"),
        str(deep_qwen),
        "--steps",
        "4",
        "--vae",
        str(tiny_vae),
    ] + (["--vae-child"] if vae_child else [])
    labels = ("partitioned", {}), ("stock", {"ACCEL_NPU_DISABLED_PATCHES": DIFFUSERS_FROM_PRETRAINED})
    procs = run_concurrently(
        *(lambda env=env: accelerate_launch(args, env=base_env(**env), timeout=600) for _, env in labels)
    )
    runs = {}
    for (label, _), proc in zip(labels, procs):
        assert proc.returncode == 0, explain(proc)
        res = results(proc)
        assert [r["rank"] for r in res] == [0, 1], explain(proc)
        runs[label] = (proc, res)
    proc, ours = runs["partitioned"]
    _, stock = runs["stock"]
    checkpoint_bytes = sum(f.stat().st_size for f in Path(deep_qwen).glob("*.safetensors"))
    # read once: rank 0 took every tensor out of the shards, rank 1 opened none
    assert ours[0]["shards_opened"] > 0 and ours[1]["shards_opened"] == 0, ours
    assert 0.9 * checkpoint_bytes < ours[0]["bytes_read"] <= checkpoint_bytes and ours[1]["bytes_read"] == 0, ours
    # stock: every rank reads it all
    assert all(r["shards_opened"] > 0 and r["bytes_read"] > 0.9 * checkpoint_bytes for r in stock), stock
    for r in ours:  # each rank held half of every parameter right after from_pretrained
        assert r["partitioned"] and r["whole"] <= 2 * r["held"] <= r["whole"] + 2 * r["params"], r
    assert all(not r["partitioned"] and r["held"] == r["whole"] for r in stock)
    log = proc.stdout + proc.stderr
    assert log.count("QwenImageTransformer2DModel loaded into ZeRO-3 partitions") == 1  # rank 0 says so once
    assert ours[0]["losses"] == stock[0]["losses"], (ours[0]["losses"], stock[0]["losses"])  # bit-identical
    assert ours[0]["losses"] == ours[1]["losses"]
    for a, b in zip(ours, stock):  # the VAE: whole, fp32, the same output as stock's
        assert a["decoded"] == b["decoded"] and a["decoded"]["dtype"] == "torch.float32", (a, b)
    if not vae_child:
        assert "called outside the DeepSpeed engine; rebuilding it whole" in log


@pytest.mark.slow
def test_zero3_read_failure_on_rank0_fails_every_rank_clearly(tmp_path, deep_qwen):
    """Rank 0 reads for everyone: if a shard breaks under it, the other ranks, waiting in the
    broadcast, get a LoadError too instead of hanging until the process-group timeout."""
    import shutil

    from tests.launch_utils import torchrun_launch

    ckpt = shutil.copytree(deep_qwen, tmp_path / "qwen6")
    proc = torchrun_launch(
        [str(SCRIPTS / "zero3_read_failure.py"), str(ckpt)], env=base_env(ACCELERATE_USE_DEEPSPEED="true")
    )
    res = results(proc)
    assert [r["rank"] for r in res] == [0, 1], explain(proc)
    assert not res[0]["ok"] and "cannot open" in res[0]["error"] and str(ckpt) in res[0]["error"], res[0]
    assert not res[1]["ok"] and "rank 0 failed to read the checkpoint" in res[1]["error"], res[1]


def _fsdp2_launch_config(directory: Path, efficient: bool) -> Path:
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": efficient,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_reshard_after_forward": True,
        },
        "num_machines": 1,
        "num_processes": 2,
        "machine_rank": 0,
        "mixed_precision": "no",
        "use_cpu": False,
    }
    path = directory / f"fsdp2_{'efficient' if efficient else 'every_rank'}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_fsdp2_cpu_ram_efficient_loading_reads_on_rank0_only(tmp_path, deep_qwen, tiny_vae):
    """Partitioned loading under FSDP: with fsdp_cpu_ram_efficient_loading (accelerate's own setting, which
    transformers honours and stock diffusers ignores), the unchanged script's DiT is read by rank 0
    alone (stock: both ranks read) and rank 1 gets rank 0's weights at prepare: losses
    bit-identical to every rank reading.
    The frozen VAE used without prepare reads its files on rank 1 at its first call: same output."""
    configs = {efficient: _fsdp2_launch_config(tmp_path, efficient) for efficient in (True, False)}

    def launch(efficient):
        args = [
            "--config_file",
            str(configs[efficient]),
            str(SCRIPTS / "train_qwen_truncated.py"),
            str(deep_qwen),
            "--steps",
            "4",
            "--vae",
            str(tiny_vae),
        ]
        return accelerate_launch(args, timeout=600)

    # stock diffusers ignores the setting: rank 1 reads the checkpoint too
    stock_launch = lambda: accelerate_launch(  # noqa: E731 - the launch both halves share, called once each
        ["--config_file", str(configs[True]), str(SCRIPTS / "train_qwen_truncated.py"), str(deep_qwen), "--steps", "1"],
        env=base_env(ACCEL_NPU_DISABLED_PATCHES=DIFFUSERS_FROM_PRETRAINED),
        timeout=600,
    )
    efficient_run, every_run, stock = run_concurrently(lambda: launch(True), lambda: launch(False), stock_launch)
    runs = {}
    for efficient, proc in ((True, efficient_run), (False, every_run)):
        assert proc.returncode == 0, explain(proc)
        res = results(proc)
        assert [r["rank"] for r in res] == [0, 1] and all(r["world"] == 2 for r in res), explain(proc)
        runs[efficient] = (proc, res)
    proc, ours = runs[True]
    _, every = runs[False]
    assert stock.returncode == 0, explain(stock)
    assert [r["shards_opened"] > 0 for r in results(stock)] == [True, True], explain(stock)
    log = proc.stdout + proc.stderr
    assert ours[0]["shards_opened"] > 0 and ours[1]["shards_opened"] == 0, ours  # rank 1 read nothing
    assert every[0]["shards_opened"] == every[1]["shards_opened"] > 0, every
    assert log.count("QwenImageTransformer2DModel read on rank 0 only (fsdp_cpu_ram_efficient_loading)") == 1
    assert "read on rank 0 only" not in runs[False][0].stderr
    assert ours[0]["losses"] == ours[1]["losses"] == every[0]["losses"], (ours, every)  # bit-identical
    for a, b in zip(ours, every):  # the VAE, used without prepare: stock's weights on every rank
        assert a["decoded"] == b["decoded"] and a["decoded"]["dtype"] == "torch.float32", (a, b)

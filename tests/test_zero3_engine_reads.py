"""A ZeRO-3 engine's parameters() / named_parameters() iterated by the script: gathered while held.

diffusers v0.40.0's train_lcm_distill_sd_wds.py / train_lcm_distill_sdxl_wds.py update their EMA target
from the engine after every step (``update_ema(target_unet.parameters(), unet.parameters(), rate)``); stock
ZeRO-3 hands out shape-[0] partitions there ("The size of tensor a (8) must match the size of tensor b (0)").

In-process, one rank (``one_rank_deepspeed_group``; stage3_param_persistence_threshold 0 partitions every
parameter), stock beside ours (``tests.inprocess.stock``). Witnesses: DeepSpeed's own read of the same
weights (``deepspeed.zero.GatheredParameters``), its parameter status (``ds_status``, the shape-[0]
placeholder) after the read, the EMA computed from DeepSpeed's read. The 2-rank half (every rank reads,
a rank-0-only checkpoint right after, a read by rank 0 alone) is one launch of
tests/scripts/zero3_engine_reads.py.
"""

from __future__ import annotations

import json
import logging

import pytest

from tests.inprocess import stock

RATE = 0.9


def update_ema(target_params, source_params, rate=0.99):
    """diffusers v0.40.0 consistency_distillation/train_lcm_distill_sd_wds.py's helper, as written there."""
    import torch

    with torch.no_grad():
        for targ, src in zip(target_params, source_params):
            targ.detach().mul_(rate).add_(src, alpha=1 - rate)


@pytest.fixture(scope="module")
def trained():
    """(accelerator, engine, target): a ZeRO-3 bf16 engine after one optimizer step, every parameter
    partitioned, and an fp32 copy of the model made before prepare (the scripts' target_unet). One engine
    for the module's tests (none changes its weights)."""
    import copy

    import torch

    from tests.launch_utils import accelerator_deepspeed_session

    with pytest.MonkeyPatch.context() as monkeypatch, accelerator_deepspeed_session(monkeypatch):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        # a prefetch bucket of one element: each parameter is gathered on its own (released as the reader moves on)
        config = {
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 1,
            },
            "bf16": {"enabled": True},
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
        }
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
        accelerator = Accelerator(deepspeed_plugin=plugin)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        target = copy.deepcopy(model).requires_grad_(False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, optimizer = accelerator.prepare(model, optimizer)
        loss = engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        yield accelerator, engine, target


def deepspeed_read(engine):
    """The engine's weights as DeepSpeed's documented gather reads them: {name: clone}."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().clone() for n, p in params.items()}


def all_partitioned(engine) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in engine.module.parameters())


def test_script_reads_the_engine_weights_gathered(trained):
    import torch

    accelerator, engine, target = trained
    expected = deepspeed_read(engine)
    names = list(expected)
    assert all(v.numel() > 0 for v in expected.values()) and all_partitioned(engine)

    # the EMA target as the scripts update it, from DeepSpeed's read (the same ops, so bitwise)
    reference = [t.detach().clone() for t in target.parameters()]
    for ref, name in zip(reference, names):
        ref.mul_(RATE).add_(expected[name], alpha=1 - RATE)

    before = [t.detach().clone() for t in target.parameters()]
    with stock():
        assert [tuple(p.shape) for p in engine.parameters()] == [(0,)] * len(names)
        with pytest.raises(RuntimeError, match=r"must match the size of tensor b \(0\)"):
            update_ema(target.parameters(), engine.parameters(), RATE)
    with torch.no_grad():  # stock scaled the first target tensor before failing
        for t, b in zip(target.parameters(), before):
            t.copy_(b)

    update_ema(target.parameters(), engine.parameters(), RATE)
    assert not any(torch.equal(t, b) for t, b in zip(target.parameters(), before))
    assert all(torch.equal(t, r) for t, r in zip(target.parameters(), reference))
    assert all(t.dtype == torch.float32 for t in target.parameters())  # the target stays the script's fp32
    assert all_partitioned(engine)  # every gathered parameter partitioned again

    read = {n: p.detach().clone() for n, p in engine.named_parameters()}
    assert list(read) == [f"module.{n}" for n in names]  # the engine's own names (it holds the model as .module)
    assert all(torch.equal(read[f"module.{n}"], expected[n]) for n in names)
    assert all_partitioned(engine)


def test_each_parameter_is_whole_while_held_and_released_when_the_reader_moves_on(trained):
    import torch

    accelerator, engine, _ = trained
    expected = deepspeed_read(engine)
    it = engine.named_parameters()
    name0, first = next(it)
    assert name0 == "module.0.weight" and torch.equal(first, expected["0.weight"])
    name1, second = next(it)
    assert first.numel() == 0 and torch.equal(second, expected["0.bias"])  # the first partitioned again
    it.close()
    assert all_partitioned(engine)

    # a consumer that drops the iterator half-way (zip stops at its shorter input): released at collection
    import gc

    pairs = list(zip(range(1), engine.parameters()))
    del pairs
    gc.collect()
    assert all_partitioned(engine)


def test_libraries_iterating_the_engine_see_stock_partitions(trained):
    import torch

    accelerator, engine, _ = trained
    # torch consumes the iterator the script made: stock's partitions (nothing gathered)
    assert torch.nn.utils.parameters_to_vector(engine.parameters()).numel() == 0
    # accelerate's clip_grad_norm_ under DeepSpeed never iterates what it is given
    accelerator.clip_grad_norm_(engine.parameters(), 1.0)
    assert all_partitioned(engine)


def test_a_read_under_is_main_process_stays_stock_with_a_warning(trained, caplog):
    accelerator, engine, _ = trained
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        if accelerator.is_main_process:
            shapes = [tuple(p.shape) for p in engine.parameters()]
    assert shapes == [(0,)] * 4  # the other ranks could not join a gather: as stock reads it
    assert all_partitioned(engine)
    assert any("inside `if accelerator.is_main_process:`" in r.getMessage() for r in caplog.records)


def test_a_write_to_a_gathered_parameter_is_one_clear_error(trained):
    import torch

    from accel_npu.plugins.deepspeed.gathered_reads import ParameterWriteError

    accelerator, engine, _ = trained
    expected = deepspeed_read(engine)
    with stock():  # stock: the write lands in a shape-[0] placeholder and is lost without a word
        for p in engine.parameters():
            p.data.mul_(2)
    assert all(torch.equal(v, expected[n]) for n, v in deepspeed_read(engine).items())

    with pytest.raises(
        ParameterWriteError,
        match=r"test_zero3_engine_reads\.py:\d+ changed 1 ZeRO-3 parameter\(s\) "
        r"of the DeepSpeed engine \(0\.weight\)",
    ):
        for p in engine.parameters():
            p.data.mul_(2)  # .data: a version counter of its own; seen by the partition's bytes
    with pytest.raises(ParameterWriteError, match=r"\(2\.bias\)"):
        with torch.no_grad():
            for name, p in engine.named_parameters():
                if name == "module.2.bias":
                    p.add_(1)
    assert all_partitioned(engine)
    assert all(torch.equal(v, expected[n]) for n, v in deepspeed_read(engine).items())  # DeepSpeed's state intact


@pytest.mark.slow
def test_every_rank_reads_then_rank0_checkpoints_and_a_rank0_only_read_fails_clearly(tmp_path):
    """2 ranks, ZeRO-3 t0 bf16: the script's EMA read on every rank after each step equals the one made from
    DeepSpeed's partition on that rank (its slice); rank 0's `if accelerator.is_main_process: save_state` right
    after it is served at the other rank's next forward (both ranks' DeepSpeed shards written); a read by rank 0 alone
    (`process_index == 0`, no
    is_main_process guard to see) is a CollectiveMisuseError within ACCEL_NPU_COLLECTIVE_TIMEOUT."""
    from tests.launch_utils import (
        REPO,
        accelerate_launch,
        base_env,
        explain,
        results,
        write_deepspeed_config,
        zero_config,
    )

    yaml_path = write_deepspeed_config(tmp_path / "cfg", zero_config(3, bf16=True))
    proc = accelerate_launch(
        ["--config_file", str(yaml_path), str(REPO / "tests/scripts/zero3_engine_reads.py"), str(tmp_path / "out")],
        env=base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT="5"),
        timeout=240,
    )
    assert proc.returncode == 0, explain(proc)
    rec = results(proc)
    assert [r["rank"] for r in rec] == [0, 1], explain(proc)
    for r in rec:
        assert r["steps"] == 3 and r["ema_equal"] and r["ema_moved"], explain(proc)
    assert rec[0]["asymmetric"] == "CollectiveMisuseError", explain(proc)
    assert rec[0]["asymmetric_seconds"] < 5 + 10, explain(proc)
    assert "zero3_engine_reads.py" in rec[0]["asymmetric_message"], explain(proc)
    shards = sorted(p.name for p in (tmp_path / "out" / "checkpoint-2").rglob("*model_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"], (
        explain(proc)
    )
    assert json.loads((tmp_path / "out" / "steps.json").read_text()) == {"saved_at": 2}

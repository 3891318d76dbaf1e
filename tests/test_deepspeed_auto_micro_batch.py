""" "train_micro_batch_size_per_gpu": "auto" when accelerator.prepare() is given no DataLoader.

diffusers v0.40.0's consistency_distillation/train_lcm_distill_*_wds.py batch inside a webdataset
pipeline (``wds.WebLoader(..., batch_size=None)``) and call ``accelerator.prepare(unet, optimizer,
lr_scheduler)``: stock accelerate 1.15 stops in ``Accelerator._prepare_deepspeed`` ("requires you to pass
at least one of training or evaluation dataloaders"). accel-npu initializes with accelerate's placeholder
and sets the value from the engine's first training forward (plugins/deepspeed/auto_batch_size.py).

In-process, one rank (``one_rank_deepspeed_group``), stock beside ours (``tests.inprocess.stock``).
Witnesses: DeepSpeed's own ``train_micro_batch_size_per_gpu()`` / ``train_batch_size()``, its throughput
timer and ``global_samples`` counter, and the ``ds_config`` DeepSpeed writes into the checkpoint
``save_state`` makes (the model-states file, opened here).
"""

from __future__ import annotations

import pytest

from tests.inprocess import stock

KEY = "train_micro_batch_size_per_gpu"


@pytest.fixture()
def accelerator_factory(monkeypatch):
    from tests.launch_utils import accelerator_deepspeed_session

    made = []

    def make(stage: int, **extra):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        config = {
            "zero_optimization": {"stage": stage},
            "train_batch_size": "auto",
            KEY: "auto",
            "gradient_accumulation_steps": "auto",
            **extra,
        }
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
        made.append(plugin)
        return Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=2)

    with accelerator_deepspeed_session(monkeypatch):
        yield make


def _model_and_optimizer():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


@pytest.mark.parametrize("stage", [2, 3])
def test_auto_micro_batch_size_from_the_first_training_forward(accelerator_factory, tmp_path, stage):
    import torch

    accelerator = accelerator_factory(stage)
    model, optimizer = _model_and_optimizer()
    with stock():
        with pytest.raises(ValueError, match="requires you to pass at least one of training or evaluation"):
            accelerator.prepare(model, optimizer)
    assert accelerator.deepspeed_plugin.deepspeed_config[KEY] == "auto"

    engine, optimizer = accelerator.prepare(model, optimizer)
    with torch.no_grad():  # an evaluation forward first: not the training micro batch
        engine(torch.randn(7, 4))
    for _ in range(4):  # batches made outside prepare, as the LCM scripts' webdataset pipeline makes them
        with accelerator.accumulate(engine):
            loss = engine(torch.randn(3, 4)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    # DeepSpeed's own bookkeeping: micro batch 3, accumulation 2, one rank; two optimizer steps
    assert engine.train_micro_batch_size_per_gpu() == 3
    assert engine.gradient_accumulation_steps() == 2
    assert engine.train_batch_size() == 6
    assert engine.tput_timer.batch_size == 6
    assert engine.global_steps == 2 and engine.global_samples == 12

    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.wait_for_everyone()  # written in the background (a launched rank's default): on disk from here
    (states,) = (tmp_path / "ckpt").rglob("*mp_rank_00_model_states.pt")  # ZeRO-3: zero_pp_rank_0_...
    saved = torch.load(states, map_location="cpu", weights_only=False)["ds_config"]
    assert saved[KEY] == 3 and saved["train_batch_size"] == 6, saved


def test_a_config_that_reads_the_micro_batch_at_initialize_is_one_error(accelerator_factory):
    from accel_npu.plugins.deepspeed.auto_batch_size import AutoBatchSizeError

    accelerator = accelerator_factory(2, data_efficiency={"enabled": True})
    model, optimizer = _model_and_optimizer()
    with pytest.raises(AutoBatchSizeError, match=f'"{KEY}": "auto" .* "data_efficiency"'):
        accelerator.prepare(model, optimizer)
    assert accelerator.deepspeed_plugin.deepspeed_config[KEY] == "auto"


def test_a_loader_without_a_batch_size_prepared_alone_before_the_model(accelerator_factory):
    """A loader whose dataset yields whole batches (batch_size=None, no batch_sampler), prepared in a call of its
    own, then the model: stock stops at both calls; the engine takes 5 from its first training batch."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class WholeBatches(IterableDataset):
        def __iter__(self):
            for _ in range(4):
                yield torch.randn(5, 4)

    accelerator = accelerator_factory(2)
    model, optimizer = _model_and_optimizer()
    with stock():
        with pytest.raises(ValueError, match="has `None` as batch size"):
            accelerator.prepare(DataLoader(WholeBatches(), batch_size=None))
    loader = accelerator.prepare(DataLoader(WholeBatches(), batch_size=None))
    assert accelerator.deepspeed_plugin.deepspeed_config[KEY] == "auto"  # no engine yet: still to be resolved
    with stock():
        with pytest.raises(ValueError, match="requires you to pass at least one of training or evaluation"):
            accelerator.prepare(model, optimizer)
    engine, optimizer = accelerator.prepare(model, optimizer)
    shapes = []
    for x in loader:
        with accelerator.accumulate(engine):
            accelerator.backward(engine(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        shapes.append(tuple(x.shape))
    assert shapes == [(5, 4)] * 4
    assert engine.train_micro_batch_size_per_gpu() == 5 and engine.train_batch_size() == 10
    assert engine.global_steps == 2 and engine.global_samples == 20


def test_auto_micro_batch_size_from_an_integer_train_batch_size(accelerator_factory):
    """An integer "train_batch_size" beside the "auto" micro batch: DeepSpeed's own derivation
    (runtime/config.py: train_batch_size // (gradient_accumulation_steps * world)), at prepare."""
    import torch

    accelerator = accelerator_factory(2, train_batch_size=12)
    model, optimizer = _model_and_optimizer()
    engine, optimizer = accelerator.prepare(model, optimizer)
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (6, 12)
    loss = engine(torch.randn(3, 4)).pow(2).mean()  # a batch of another size changes nothing: it was given
    accelerator.backward(loss)
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (6, 12)

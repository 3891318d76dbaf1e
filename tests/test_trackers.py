"""init_trackers(config=vars(args)) with list / dict values under TensorBoard (plugins/trackers).

diffusers v0.40.0's cosmos/train_cosmos_predict25_lora.py hands vars(args) to accelerator.init_trackers (line
589) under its default --report_to tensorboard; its --conditional_frames_probs is a dict (line 206), which
torch's add_hparams refuses (torch/utils/tensorboard/summary.py hparams). The call init_trackers makes,
accelerate's TensorBoardTracker.store_init_configuration, runs stock (tests.inprocess.stock) and with
accel-npu. Witnesses: stock's ValueError; the hparams TensorBoard itself reads back from our event file
(tensorboard's EventAccumulator and the hparams plugin's protobuf), and accelerate's hparams.yml.
"""

from __future__ import annotations

import logging

import pytest
import yaml

import accel_npu
from tests.inprocess import stock


def _config():
    return {
        "conditional_frames_probs": {1: 0.5, 2: 0.5},
        "resolution": [64, 96],
        "learning_rate": 1e-4,
        "output_dir": "out",
        "use_dora": False,
        "max_train_steps": 3,
        "validation_prompt": None,
    }


def _tracker(directory):
    from accelerate.tracking import TensorBoardTracker

    tracker = TensorBoardTracker("diffusers-lora", directory)
    tracker.start()
    return tracker


def _hparams_read_back(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    (events,) = [p for p in run_dir.rglob("events.out.tfevents.*") if p.parent != run_dir]  # add_hparams' own run
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    contents = accumulator.PluginTagToContent("hparams")
    (start,) = [
        plugin_data_pb2.HParamsPluginData.FromString(c)
        for c in contents.values()
        if plugin_data_pb2.HParamsPluginData.FromString(c).HasField("session_start_info")
    ]
    return {
        k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
        for k, v in start.session_start_info.hparams.items()
    }


def test_list_and_dict_values_are_recorded_as_their_str(tmp_path, caplog):
    accel_npu.patch()
    import accelerate.tracking  # noqa: F401  (imported before stock(): an import inside would activate again)

    config = _config()
    with stock():
        tracker = _tracker(tmp_path / "stock")
        with pytest.raises(ValueError, match="value should be one of int, float, str, bool, or torch.Tensor"):
            tracker.store_init_configuration(config)
        tracker.finish()

    tracker = _tracker(tmp_path / "ours")
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        tracker.store_init_configuration(config)
    tracker.finish()
    assert config == _config()  # the script's dict is not changed
    assert "add_hparams" not in vars(tracker.writer)  # the writer is the SummaryWriter it was

    run_dir = tmp_path / "ours" / "diffusers-lora"
    recorded = _hparams_read_back(run_dir)
    assert recorded == {
        "conditional_frames_probs": "{1: 0.5, 2: 0.5}",
        "resolution": "[64, 96]",
        "learning_rate": pytest.approx(1e-4),
        "output_dir": "out",
        "use_dora": False,
        "max_train_steps": 3.0,
    }  # None is left out, as torch leaves it out
    (yml,) = run_dir.rglob("hparams.yml")
    assert yaml.safe_load(yml.read_text()) == _config()  # accelerate's file keeps the values themselves
    warnings = [r.getMessage() for r in caplog.records if "TensorBoard's hparams" in r.getMessage()]
    assert (
        len(warnings) == 1 and "conditional_frames_probs (dict)" in warnings[0] and "resolution (list)" in warnings[0]
    )


def test_scalar_values_pass_untouched(tmp_path):
    accel_npu.patch()
    config = {k: v for k, v in _config().items() if not isinstance(v, (list, dict))}
    tracker = _tracker(tmp_path)
    writer_method = tracker.writer.add_hparams
    tracker.store_init_configuration(config)
    tracker.finish()
    assert tracker.writer.add_hparams == writer_method and "add_hparams" not in vars(tracker.writer)
    assert _hparams_read_back(tmp_path / "diffusers-lora")["output_dir"] == "out"

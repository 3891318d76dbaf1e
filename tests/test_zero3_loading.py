"""When a diffusers load goes straight into ZeRO-3 partitions (plugins/loading/placement/zero3.py).

The end-to-end behaviour (2 ranks, bit-identical losses, rank 0 reading once, frozen VAEs rebuilt
whole) is tests/test_loading_acceptance.py::test_zero3_loads_straight_into_partitions_read_once.
"""
from __future__ import annotations

import pytest

from accel_npu._torch.packing import pack_by_budget
from accel_npu._torch.zero import outside_zero_init
from accel_npu.plugins.loading.placement import zero3 as zero3_loading
from tests.launch_utils import free_port


def test_groups_keep_read_order_and_stay_under_the_budget():
    sizes = {"a": 40, "b": 30, "c": 100, "d": 10, "e": 10}
    groups = pack_by_budget(list("abcde"), sizes.__getitem__, 64)
    assert groups == [["a"], ["b"], ["c"], ["d", "e"]]  # order kept; an oversized tensor alone
    assert [k for g in groups for k in g] == list("abcde")


@pytest.fixture()
def hf_zero3(monkeypatch):
    """transformers' HfDeepSpeedConfig weakref as accelerate sets it, and a 1-rank gloo group."""
    import torch.distributed as dist
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    keep = []

    def configure(stage=3, **zero):
        unset_hf_deepspeed_config()
        keep[:] = [HfDeepSpeedConfig({"zero_optimization": {"stage": stage, **zero}, "bf16": {"enabled": True},
                                      "train_micro_batch_size_per_gpu": 1})]

    try:
        yield configure
    finally:
        unset_hf_deepspeed_config()
        dist.destroy_process_group()


def test_partitioned_load_only_under_zero3_with_the_flag_and_not_for_frozen_towers(hf_zero3, monkeypatch):
    import torch.distributed as dist

    hf_zero3()
    cfg = zero3_loading.zero3_config()
    assert cfg is not None and cfg["zero_optimization"]["stage"] == 3
    with outside_zero_init():  # zero3_init_context_manager(enable=False), pipeline components
        assert zero3_loading.zero3_config() is None
    monkeypatch.setenv("ACCEL_NPU_ZERO3_INIT", "0")
    assert zero3_loading.zero3_config() is None
    monkeypatch.delenv("ACCEL_NPU_ZERO3_INIT")
    hf_zero3(mics_shard_size=2)  # MiCS broadcasts per shard group: loaded as stock
    assert zero3_loading.zero3_config() is None
    hf_zero3()
    assert zero3_loading.zero3_config() is not None
    dist.destroy_process_group()
    try:
        assert zero3_loading.zero3_config() is None  # no process group yet
    finally:
        dist.init_process_group("gloo", rank=0, world_size=1)


def test_no_partitioned_load_without_zero3(hf_zero3):
    from transformers.integrations import unset_hf_deepspeed_config

    hf_zero3(stage=2)  # ZeRO-2 partitions nothing at load
    assert zero3_loading.zero3_config() is None
    unset_hf_deepspeed_config()  # no DeepSpeed plugin (or zero3_init_flag: false)
    assert zero3_loading.zero3_config() is None
    hf_zero3(stage=3)
    assert zero3_loading.zero3_config() is not None

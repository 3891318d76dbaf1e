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
        keep[:] = [
            HfDeepSpeedConfig(
                {
                    "zero_optimization": {"stage": stage, **zero},
                    "bf16": {"enabled": True},
                    "train_micro_batch_size_per_gpu": 1,
                }
            )
        ]

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


def test_a_config_change_by_the_script_makes_a_partitioned_model_whole(hf_zero3, tmp_path, monkeypatch):
    """train_instruct_pix2pix{,_sdxl}.py: ``unet.register_to_config(in_channels=8)``, then
    ``new_conv_in.weight[:, :4].copy_(unet.conv_in.weight)`` before prepare. Loaded into partitions, the
    weight is empty; the script's config change makes the model whole (the files' fp32, as stock) first.
    diffusers' own register_to_config calls (from_pretrained's _name_or_path) leave the partitions alone."""
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    from accel_npu._torch.zero import is_zero_partitioned

    torch.manual_seed(0)
    UNet2DConditionModel(
        block_out_channels=(8,),
        layers_per_block=1,
        sample_size=4,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",),
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=4,
    ).save_pretrained(tmp_path)
    files = load_file(str(tmp_path / "diffusion_pytorch_model.safetensors"))
    for name, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)  # as accelerate launch sets them (zero.Init reads LOCAL_RANK)
    hf_zero3()
    unet = UNet2DConditionModel.from_pretrained(tmp_path)
    # the load itself: partitions (read through _parameters: an attribute read by this file, user code, would
    # make the model whole, as the script's own reads do)
    assert is_zero_partitioned(unet) and unet.conv_in._parameters["weight"].numel() == 0
    unet.register_to_config(in_channels=8)
    assert not is_zero_partitioned(unet) and unet.config.in_channels == 8
    state = unet.state_dict()
    assert all(torch.equal(state[k], v) for k, v in files.items())  # whole, the files' fp32 (stock's)
    new = torch.zeros(8, 8, 3, 3)
    new[:, :4].copy_(unet.conv_in.weight)  # the script's next line
    assert torch.equal(new[:, :4], files["conv_in.weight"])

"""diffusers v0.40.0's ``train_dreambooth_lora_sd3.py`` and ``train_dreambooth_lora_flux.py``, run
UNCHANGED from ``$DIFFUSERS_EXAMPLES_DIR`` (never copied into this repo) on 2 CPU ranks (issue 16).

Tiny pipelines from the real classes (tests/scripts/tiny_sd3_flux.py), 4 DreamBooth PNGs, the shipped
cpu_zero2 config and cpu_zero3 with ``stage3_param_persistence_threshold: 0`` (zero3_init_flag true, as
shipped), built as tests/test_upstream_text_to_image.py builds them.

The in-process test runs always (fast); the launched ones are skipped unless DIFFUSERS_EXAMPLES_DIR
is set. Witnesses: DeepSpeed's own zero_to_fp32 reading of the checkpoints, safetensors files opened
here, diffusers' ``load_lora_weights`` -- never accel-npu's log lines.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.launch_utils import SCRIPTS, free_port

sys.path.insert(0, str(SCRIPTS))

EXAMPLES = os.environ.get("DIFFUSERS_EXAMPLES_DIR", "")
needs_examples = pytest.mark.skipif(
    not EXAMPLES or not os.path.isdir(os.path.join(EXAMPLES, "dreambooth")),
    reason="DIFFUSERS_EXAMPLES_DIR is not set to a diffusers v0.40.0 examples/ directory (the official "
           "scripts are run from there, unchanged; they are not part of this repository)")


# ------------------------------------------------------------------------------------------------
# in-process: a CLIP text encoder built in ZeRO-3 partitions and called outside the engine
# ------------------------------------------------------------------------------------------------
@pytest.fixture()
def one_rank_zero3(monkeypatch):
    """A 1-rank gloo group and accelerate's ZeRO-3 plugin (zero3_init_flag true) selected, as
    ``accelerate launch`` + ``Accelerator()`` leave them before the script loads its text encoders."""
    import torch.distributed as dist
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations import unset_hf_deepspeed_config

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    deepspeed.comm.init_distributed(dist_backend="gloo")
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=True)
    plugin.set_deepspeed_weakref()
    try:
        yield
    finally:
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ds_init
        import torch

        torch.nn.functional.linear = getattr(ds_init, "linear_bk", torch.nn.functional.linear)
        unset_hf_deepspeed_config()
        dist.destroy_process_group()
        del plugin


def test_partitioned_clip_text_encoder_is_made_whole_before_its_embeddings_read_a_shape(tmp_path, one_rank_zero3):
    """SD3/Flux scripts load CLIP with ``from_pretrained`` under ZeRO-3 (no disabled-init context), cast it
    and call it outside the engine. CLIPTextEmbeddings.forward reads ``position_embedding.weight.shape[0]``
    before any module holding parameters runs: stock fails with ``max_position_embeddings: 0``; accel-npu
    makes the encoder whole first (its hooks sit on every submodule) and keeps the script's bf16 cast."""
    import torch
    from transformers import CLIPTextModelWithProjection

    import tiny_sd3_flux
    from tests.inprocess import stock
    from transformers.integrations import is_deepspeed_zero3_enabled

    ids = torch.tensor([[0, 5, 6, 7] + [1] * 73])  # the scripts' max_length=77
    import transformers.integrations.deepspeed as tds

    # the reference: the same files, loaded whole (transformers' ZeRO-3 switch off for the duration)
    saved_ref = tds._hf_deepspeed_config_weak_ref
    tds._hf_deepspeed_config_weak_ref = None
    try:
        tiny_sd3_flux._encoders(str(tmp_path), [CLIPTextModelWithProjection])["text_encoder"].save_pretrained(
            str(tmp_path / "text_encoder"))
        ref = CLIPTextModelWithProjection.from_pretrained(str(tmp_path / "text_encoder")).to(dtype=torch.bfloat16)
        with torch.no_grad():
            want = ref(ids, output_hidden_states=True).hidden_states[-2]
    finally:
        tds._hf_deepspeed_config_weak_ref = saved_ref
    assert is_deepspeed_zero3_enabled()

    def load_like_the_script():
        te = CLIPTextModelWithProjection.from_pretrained(str(tmp_path), subfolder="text_encoder",
                                                         revision=None, variant=None)
        built_partitioned = any(hasattr(p, "ds_id") for p in te.parameters())
        te.requires_grad_(False)
        te.to("cpu", dtype=torch.bfloat16)  # train_dreambooth_lora_sd3.py l.1239
        return te, built_partitioned

    with stock():
        te, partitioned = load_like_the_script()
        assert partitioned
        with pytest.raises(ValueError, match="max_position_embeddings: 0"), torch.no_grad():
            te(ids, output_hidden_states=True)

    te, partitioned = load_like_the_script()
    assert partitioned
    with torch.no_grad():
        got = te(ids, output_hidden_states=True).hidden_states[-2]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not any(hasattr(p, "ds_id") or p.requires_grad for p in te.parameters())

"""A UNet LoRA saved the way diffusers v0.40.0's consistency_distillation/train_lcm_distill_lora_sdxl.py saves it
(``save_lora_weights(unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet)))``,
lines 893-894 and 1445-1446) loads whole with the pipeline's unchanged ``load_lora_weights(dir)``.

``convert_state_dict_to_diffusers`` renames only the attention projections (``to_k.lora.down``); resnets,
samplers, transformer MLPs and time_emb_proj stay ``lora_A``. Stock ``load_lora_adapter`` converts only
when the first key is old-style (diffusers #14548), and the file's first key is a downsampler's ``lora_A``:
the attention layers are never injected. In-process, stock = ``tests.inprocess.stock()`` (every patch
removed). Witness: the LoRA tensors the loaded UNet holds, against the trained model's peft state dict.
"""

from __future__ import annotations

import pytest

import accel_npu
from tests.inprocess import stock

# train_lcm_distill_lora_sdxl.py's default --lora_target_modules (lines 855-870)
TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "proj_in",
    "proj_out",
    "ff.net.0.proj",
    "ff.net.2",
    "conv1",
    "conv2",
    "conv_shortcut",
    "downsamplers.0.conv",
    "upsamplers.0.conv",
    "time_emb_proj",
]


def _unet():
    """tests/scripts/tiny_sana_sdxl.py's SDXL UNet (text_time added embedding, two cross-attention blocks)."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=8,
    )


def _loaded(directory) -> dict:
    """{peft key without the adapter name: tensor} of the LoRA a fresh pipeline's load_lora_weights(dir) holds."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(
        vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None, unet=_unet(), scheduler=None
    )
    pipe.load_lora_weights(str(directory))
    return {
        k.replace(".default_0.weight", ".weight"): v.clone() for k, v in pipe.unet.state_dict().items() if ".lora_" in k
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, the trained peft state dict): the LoRA file written as the script writes it."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict
    from safetensors import safe_open

    accel_npu.patch()
    unet = _unet()
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if ".lora_" in name:  # trained: lora_B is no longer zero
                p.copy_(torch.randn(p.shape, generator=generator))
    trained = {k: v.detach().clone() for k, v in get_peft_model_state_dict(unet).items()}
    directory = tmp_path_factory.mktemp("lcm_lora")
    StableDiffusionXLPipeline.save_lora_weights(
        str(directory), unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    )
    with safe_open(str(directory / "pytorch_lora_weights.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    old = [k for k in keys if ".lora.down." in k or ".lora.up." in k]
    # the mix the script writes, and a first key that keeps stock from converting
    assert old and len(old) < len(keys) and "lora_A" in keys[0], keys[:3]
    assert all(k.split(".")[-4] in ("to_q", "to_k", "to_v") or ".to_out.0." in k for k in old)
    return directory, trained


def test_stock_load_lora_weights_drops_the_attention_layers_of_the_scripts_lora(saved):
    import torch

    directory, trained = saved
    with stock():
        got = _loaded(directory)
    missing = sorted(set(trained) - set(got))
    attention = [k for k in trained if any(f".{t}.lora_" in k for t in ("to_q", "to_k", "to_v", "to_out.0"))]
    assert missing == sorted(attention) and 0 < len(missing) < len(trained)
    assert all(torch.equal(got[k], v) for k, v in trained.items() if k in got)


def test_load_lora_weights_loads_every_tensor_of_the_scripts_lora_bit_equal(saved):
    import torch

    directory, trained = saved
    accel_npu.patch()
    got = _loaded(directory)
    assert set(got) == set(trained)
    assert all(torch.equal(got[k], v) for k, v in trained.items())


def test_a_state_dict_stock_reads_whole_is_passed_as_it_is():
    import torch

    from accel_npu.plugins.checkpoints.lora import adapter_keys

    t = torch.zeros(1)
    peft_only = {"unet.a.to_k.lora_A.weight": t, "unet.a.conv1.lora_A.weight": t}
    old_first = {"unet.a.to_k.lora.down.weight": t, "unet.a.conv1.lora_A.weight": t}
    assert adapter_keys(peft_only, "unet") is None
    assert adapter_keys(old_first, "unet") is None  # stock converts every key itself
    # another component's keys: not the model's to convert, kept as they are
    mixed = {"unet.a.conv1.lora_A.weight": t, "unet.a.to_k.lora.down.weight": t, "text_encoder.q.lora.down.weight": t}
    assert adapter_keys(mixed, "unet") == {
        "unet.a.conv1.lora_A.weight": t,
        "unet.a.to_k.lora_A.weight": t,
        "text_encoder.q.lora.down.weight": t,
    }
    assert adapter_keys(mixed, "transformer") is None

"""Tiny models built from the real diffusers / transformers classes (random weights, no hub).

Used by tests/test_loading*.py and by the launched loading scripts. Never imports accel_npu.
"""

from __future__ import annotations

import torch

QWEN = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=4,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=3,
    rope_max_seq_len=32,
)
COSMOS = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=3,
    mlp_ratio=2.0,
    text_embed_dim=32,
    adaln_lora_dim=8,
    max_size=(4, 16, 16),
    patch_size=(1, 2, 2),
    rope_scale=(1.0, 1.0, 1.0),
    concat_padding_mask=False,
    extra_pos_embed_type="learnable",
)
LLAMA = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)


def qwen(**over):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(**{**QWEN, **over})


def wan(**over):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**{**WAN, **over})


def cosmos(**over):
    from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

    torch.manual_seed(0)
    return CosmosTransformer3DModel(**{**COSMOS, **over})


def llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **over}))


def randomize(model):
    """Non-trivial values everywhere (zero-initialized output layers would hide mistakes)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.2)
    return model


def qwen_inputs(batch=2, seed=0, height=4, width=4, text=5):
    g = torch.Generator().manual_seed(seed)
    seq = height * width
    return dict(
        hidden_states=torch.randn(batch, seq, QWEN["in_channels"], generator=g),
        encoder_hidden_states=torch.randn(batch, text, QWEN["joint_attention_dim"], generator=g),
        encoder_hidden_states_mask=torch.ones(batch, text, dtype=torch.long),
        timestep=torch.full((batch,), 0.5),
        img_shapes=[[(1, height // 1, width // 1)]] * batch,
        return_dict=False,
    )


# ------------------------------------------------------------------------------------------------
# a whole tiny Qwen-Image pipeline (the real classes), for the upstream DreamBooth LoRA script
QWEN_IMAGE_VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False],
    latents_mean=[0.1, -0.2, 0.3, 0.0],
    latents_std=[1.5, 0.8, 1.2, 1.0],
)
QWEN_VL_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)


def _qwen_vl_text() -> dict:
    """QWEN_VL_TEXT as the installed transformers reads it: 4.x takes the multimodal RoPE as rope_scaling
    (configuration_qwen2_5_vl.py of 4.57) and ignores rope_parameters, which 5.x reads."""
    if transformers_major() >= 5:
        return dict(QWEN_VL_TEXT)
    rope = QWEN_VL_TEXT["rope_parameters"]
    return {
        **{k: v for k, v in QWEN_VL_TEXT.items() if k != "rope_parameters"},
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
    }


QWEN_VL_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    fullatt_block_indexes=[0],
    patch_size=4,
    window_size=8,
)
_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def transformers_major() -> int:
    """The installed transformers' major release: 4.x and 5.x build tokenizers and configs differently."""
    import transformers

    return int(transformers.__version__.split(".")[0])


def qwen_tokenizer(folder):
    """A byte-level BPE Qwen2Tokenizer over the 256 byte symbols (no merges) plus Qwen's specials."""
    import json
    import os

    from transformers import Qwen2Tokenizer

    # GPT-2's byte -> symbol table (every byte a printable character), as byte-level BPE uses it
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    extra = [b for b in range(256) if b not in printable]
    symbols = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]
    vocab = {ch: i for i, ch in enumerate(symbols)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    if transformers_major() < 5:  # 4.x's slow tokenizer reads the two files
        tok = Qwen2Tokenizer(
            vocab_file=os.path.join(folder, "vocab.json"),
            merges_file=os.path.join(folder, "merges.txt"),
            errors="replace",
        )
    else:
        tok = Qwen2Tokenizer(vocab=vocab, merges=[], errors="replace")
    tok.add_special_tokens({"additional_special_tokens": _SPECIAL[1:]})
    tok.save_pretrained(folder)
    return tok


def qwen_image_pipeline(folder) -> dict:
    """Save a tiny Qwen-Image pipeline (transformer, VAE, Qwen2.5-VL text encoder, tokenizer,
    scheduler) under ``folder`` with ``save_pretrained``; returns {component: model}."""
    import os

    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer(os.path.join(folder, "tokenizer"))
    n = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL}
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                **_qwen_vl_text(),
                "vocab_size": n,
                "pad_token_id": ids["<|endoftext|>"],
                "bos_token_id": ids["<|endoftext|>"],
                "eos_token_id": ids["<|im_end|>"],
            },
            vision_config=QWEN_VL_VISION,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
    )
    randomize(text_encoder)
    torch.manual_seed(0)
    vae = randomize(AutoencoderKLQwenImage(**QWEN_IMAGE_VAE))
    with torch.no_grad():  # keep the tiny VAE's latents in a sane range
        for p in vae.parameters():
            p.mul_(0.5)
    transformer = randomize(qwen(joint_attention_dim=QWEN_VL_TEXT["hidden_size"], num_layers=2))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(folder)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder}


def dreambooth_images(folder, count: int = 4, size: int = 32) -> None:
    """A DreamBooth instance folder: ``count`` small RGB PNGs with different content."""
    import os

    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(os.path.join(folder, f"img{i}.png"))

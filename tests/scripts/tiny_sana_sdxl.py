"""Tiny Sana and SDXL pipeline folders from the real classes (random weights, no hub), for diffusers'
official ``train_dreambooth_lora_sana.py`` / ``train_dreambooth_lora_sdxl.py`` (tests/test_official_sana_sdxl.py).

usage: python tiny_sana_sdxl.py {sana,sdxl} MODEL_DIR

Each folder is written with the pipeline's own ``save_pretrained``, so it holds what the script loads
with ``--pretrained_model_name_or_path`` and what ``DiffusionPipeline.from_pretrained`` /
``load_lora_weights`` read back. Sizes follow diffusers' own pipeline tests (tests/pipelines/sana,
tests/pipelines/stable_diffusion_xl), made consistent with ``--resolution 16``. Never imports accel_npu.
"""

from __future__ import annotations

import os
import sys

import torch
from tiny_models import randomize
from tiny_sd import write_tokenizer as write_clip_tokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def gemma_tokenizer(folder: str):
    """A GemmaTokenizer (BPE with byte fallback, as transformers builds it) over Gemma's specials, the
    word marker and the lower-case letters; no merges: every letter is one token."""
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "▁": 5}
    for ch in LETTERS:
        vocab[ch] = len(vocab)
        vocab["▁" + ch] = len(vocab)
    tok = GemmaTokenizer(vocab=vocab, merges=[])
    tok.save_pretrained(folder)
    return tok


def sana_pipeline(folder: str) -> None:
    """SanaTransformer2DModel + AutoencoderDC (spatial factor 2) + a 1-layer Gemma2Model + GemmaTokenizer
    + FlowMatchEulerDiscreteScheduler, saved by SanaPipeline.save_pretrained."""
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = gemma_tokenizer(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    transformer = randomize(
        SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            num_attention_heads=2,
            attention_head_dim=8,
            num_cross_attention_heads=2,
            cross_attention_head_dim=8,
            cross_attention_dim=16,
            caption_channels=16,
            sample_size=8,
        )
    )
    torch.manual_seed(0)
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=[1, 1],
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    SanaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    ).save_pretrained(folder)


def sdxl_pipeline(
    folder: str, vae_blocks: int = 2, text_hidden: tuple = (32, 32), projection_dim: int = 32, **unet_over
) -> None:
    """UNet2DConditionModel (addition_embed_type text_time) + CLIPTextModel + CLIPTextModelWithProjection
    + AutoencoderKL + two CLIP tokenizers + DDPMScheduler, saved by StableDiffusionXLPipeline.save_pretrained.
    cross_attention_dim = the two encoders' hidden sizes side by side; the added embedding takes 6 time ids
    of addition_time_embed_dim each plus the second encoder's projection. ``vae_blocks``: the VAE downsamples
    by 2 ** (vae_blocks - 1); ``text_hidden``: the two encoders' hidden sizes, ``projection_dim`` the second's
    pooled size (the UNet's cross_attention_dim and added embedding follow them); ``unet_over`` replaces UNet
    arguments."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tokenizer, vocab_size = write_clip_tokenizer(os.path.join(folder, "tokenizer"))
    tokenizer_2, _ = write_clip_tokenizer(os.path.join(folder, "tokenizer_2"))

    def clip_config(hidden_size):
        return CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=tokenizer.model_max_length,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            projection_dim=projection_dim,
        )

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        **{
            **dict(
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
                projection_class_embeddings_input_dim=6 * 8 + projection_dim,
                cross_attention_dim=sum(text_hidden),
                norm_num_groups=8,
            ),
            **unet_over,
        }
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8,) * vae_blocks,
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        norm_num_groups=4,
        sample_size=8 * 2 ** (vae_blocks - 1),
    )
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(clip_config(text_hidden[0]))
    torch.manual_seed(1)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(text_hidden[1]))
    scheduler = DDPMScheduler(num_train_timesteps=100, beta_schedule="scaled_linear", clip_sample=False)
    StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
    ).save_pretrained(folder)


if __name__ == "__main__":
    {"sana": sana_pipeline, "sdxl": sdxl_pipeline}[sys.argv[1]](sys.argv[2])

"""Tiny SD3 and Flux pipeline folders from the real classes (random weights, no hub), for diffusers'
official ``train_dreambooth_lora_sd3.py`` / ``train_dreambooth_lora_flux.py``.

usage: python tiny_sd3_flux.py {sd3,flux} MODEL_DIR [IMAGE_DIR]

Sizes follow diffusers' own pipeline tests (tests/pipelines/stable_diffusion_3, tests/pipelines/flux):
CLIP hidden 32, T5 d_model 32, one-block VAE (no downsampling). The T5 tokenizer is a Unigram
``T5TokenizerFast`` built from a vocabulary list (transformers' tokenizers backend: no sentencepiece
model, no hub); the CLIP tokenizers are tiny_sd's byte-level BPE, with model_max_length 77 because both
scripts tokenize CLIP prompts with ``max_length=77``. Never imports accel_npu.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from tiny_models import (
    dreambooth_images,  # re-exported for the tests
    transformers_major,
)
from tiny_sd import WORDS, write_tokenizer

CLIP_LENGTH = 77  # the scripts' hard-coded CLIP max_length
TEXT = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=CLIP_LENGTH,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
    hidden_act="gelu",
    projection_dim=32,
)
T5 = dict(
    d_model=32,
    d_kv=8,
    d_ff=37,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
VAE = dict(
    sample_size=32,
    in_channels=3,
    out_channels=3,
    block_out_channels=(4,),
    layers_per_block=1,
    norm_num_groups=1,
    use_quant_conv=False,
    use_post_quant_conv=False,
    shift_factor=0.0609,
    scaling_factor=1.5035,
    down_block_types=("DownEncoderBlock2D",),
    up_block_types=("UpDecoderBlock2D",),
)


def _unigram(pieces):
    """The Unigram tokenizer transformers 5's T5TokenizerFast(vocab=...) builds (tokenization_t5.py): Metaspace
    pre-tokenizer and decoder, "</s>" appended to every sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tk = Tokenizer(models.Unigram(pieces, unk_id=2))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return tk


def t5_tokenizer(directory: str):
    """A Unigram T5TokenizerFast over a few words (pieces with SentencePiece's word marker)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in WORDS + ["sks", "photo"] if ("\u2581" + w, -1.0) not in pieces]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    if transformers_major() < 5:  # 4.x builds a fast tokenizer from files or a tokenizers object only
        tok = T5TokenizerFast(
            tokenizer_object=_unigram(pieces), extra_ids=0, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
        )
    else:
        tok = T5TokenizerFast(vocab=pieces, extra_ids=0)
    tok.save_pretrained(directory)
    return T5TokenizerFast.from_pretrained(directory)


def _encoders(folder: str, clip_classes: list):
    """CLIP tokenizers + text encoders (one per class given) and a T5 tokenizer + encoder."""
    from transformers import CLIPTextConfig, T5Config, T5EncoderModel

    out = {}
    for i, cls in enumerate(clip_classes):
        suffix = "" if i == 0 else f"_{i + 1}"
        tok, vocab = write_tokenizer(os.path.join(folder, "tokenizer" + suffix), max_length=CLIP_LENGTH)
        torch.manual_seed(i)
        out["tokenizer" + suffix] = tok
        out["text_encoder" + suffix] = cls(CLIPTextConfig(vocab_size=vocab, **TEXT))
    suffix = f"_{len(clip_classes) + 1}"
    t5_tok = t5_tokenizer(os.path.join(folder, "tokenizer" + suffix))
    torch.manual_seed(9)
    out["tokenizer" + suffix] = t5_tok
    out["text_encoder" + suffix] = T5EncoderModel(T5Config(vocab_size=len(t5_tok), **T5))
    return out


def sd3_pipeline(folder: str, num_layers: int = 1):
    """StableDiffusion3Pipeline.save_pretrained of a tiny SD3 (transformer, VAE, 2 CLIP + T5).

    ``num_layers=13`` for train_controlnet_sd3.py: its ``SD3ControlNetModel.from_transformer`` builds 12
    blocks and loads the transformer's first 12 into them, which must all be full joint blocks (the
    transformer's last block is ``context_pre_only``, with other shapes), as in SD3's 24.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    parts = _encoders(folder, [CLIPTextModelWithProjection, CLIPTextModelWithProjection])
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=num_layers,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    vae = AutoencoderKL(latent_channels=4, **VAE)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(), **parts
    )
    pipe.save_pretrained(folder)
    return pipe


def flux_transformer():
    """The tiny FluxTransformer2DModel (1 double + 1 single block, 2 heads of 16, 4 latent channels), drawn from
    torch's global generator as it stands."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )


def flux_pipeline(folder: str):
    """FluxPipeline.save_pretrained of a tiny Flux (transformer, VAE, CLIP + T5)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextModel

    parts = _encoders(folder, [CLIPTextModel])
    torch.manual_seed(0)
    transformer = flux_transformer()
    vae = AutoencoderKL(latent_channels=1, **VAE)
    pipe = FluxPipeline(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(), **parts)
    pipe.save_pretrained(folder)
    return pipe


if __name__ == "__main__":
    {"sd3": sd3_pipeline, "flux": flux_pipeline}[sys.argv[1]](sys.argv[2])
    if len(sys.argv) > 3:
        dreambooth_images(sys.argv[3])

"""A tiny Stable Diffusion pipeline folder and an imagefolder dataset, from the real classes, no hub.

usage: python tiny_sd.py MODEL_DIR DATA_DIR

MODEL_DIR gets what diffusers' train_text_to_image.py loads with --pretrained_model_name_or_path
(scheduler/, tokenizer/, text_encoder/, vae/, unet/, model_index.json via
StableDiffusionPipeline.save_pretrained); DATA_DIR gets a few 32x32 PNGs and metadata.jsonl with a
"text" column (datasets' imagefolder: --train_data_dir, --caption_column text); --resolution 16.
Never imports accel_npu.
"""

from __future__ import annotations

import json
import os
import sys

# byte-level characters CLIP's tokenizer maps ASCII letters to are the letters themselves
WORDS = ["a", "red", "blue", "green", "square", "circle", "photo", "of", "the", "dog", "cat"]


def write_tokenizer(directory: str, max_length: int = 16):
    from transformers import CLIPTokenizer

    os.makedirs(directory, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges = []
    for word in WORDS:  # merge each word left to right into one token
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            a, b = parts[0], parts[1]
            merges.append(f"{a} {b}")
            parts = [a + b] + parts[2:]
            vocab.setdefault(parts[0], len(vocab))
    merges = list(dict.fromkeys(merges))
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = CLIPTokenizer(
        os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt"), model_max_length=max_length
    )
    tok.save_pretrained(directory)
    return tok, len(vocab)


def build(model_dir: str, seed: int = 0):
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    tok_dir = os.path.join(model_dir, "tokenizer")
    tokenizer, vocab_size = write_tokenizer(tok_dir)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(16,),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
        time_embedding_dim=32,
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 8),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        norm_num_groups=4,
        sample_size=16,
    )
    return save_pipeline(model_dir, tokenizer, vocab_size, unet, vae)


def save_pipeline(model_dir: str, tokenizer, vocab_size: int, unet, vae):
    """The rest of a tiny StableDiffusionPipeline around ``unet`` and ``vae`` (a 2-layer CLIP text encoder,
    DDPM scheduler), saved to ``model_dir``; weights drawn from torch's current random state."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=tokenizer.model_max_length,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            projection_dim=32,
        )
    )
    scheduler = DDPMScheduler(num_train_timesteps=100, beta_schedule="linear", clip_sample=False)
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(model_dir)
    return pipe


def write_dataset(data_dir: str, n: int = 8, size: int = 16):
    import numpy as np
    from PIL import Image

    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    captions = ["a red square", "a blue circle", "a photo of the dog", "a green cat"]
    with open(os.path.join(data_dir, "metadata.jsonl"), "w") as f:
        for i in range(n):
            name = f"{i:03d}.png"
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(os.path.join(data_dir, name))
            f.write(json.dumps({"file_name": name, "text": captions[i % len(captions)]}) + "\n")


if __name__ == "__main__":
    build(sys.argv[1])
    write_dataset(sys.argv[2])

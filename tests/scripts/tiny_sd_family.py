"""Tiny inputs for diffusers' Stable Diffusion family of official examples (dreambooth, dreambooth
LoRA, controlnet), from the real classes, no hub.

usage: python tiny_sd_family.py MODEL_DIR INSTANCE_DIR CONTROLNET_DATA_DIR

MODEL_DIR: tiny_sd.py's pipeline, but with a 4-block VAE (3 downsamplings, the x8 of a real SD VAE):
  train_controlnet.py builds its ControlNet with ``ControlNetModel.from_unet(unet)``, whose
  conditioning embedding always downsamples the conditioning image x8, so the latents must be
  resolution/8 too (--resolution 32 -> 4x4 latents).
INSTANCE_DIR: a DreamBooth instance folder (a few 32x32 PNGs; --instance_data_dir).
CONTROLNET_DATA_DIR: a parquet file with image / text / conditioning_image columns (datasets Image
  features), which train_controlnet.py's ``load_dataset(--train_data_dir)`` reads with the columns
  in its default order.
Never imports accel_npu.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_sd import save_pipeline, write_tokenizer

CAPTIONS = ["a red square", "a blue circle", "a photo of the dog", "a green cat"]


def build(model_dir: str, seed: int = 0, max_length: int = 16):
    """``max_length``: the tokenizer's model_max_length and the text encoder's positions."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    tokenizer, vocab_size = write_tokenizer(os.path.join(model_dir, "tokenizer"), max_length)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(16,),
        layers_per_block=1,
        sample_size=4,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )  # default time embedding: from_unet copies it
    vae = AutoencoderKL(
        block_out_channels=(8, 8, 8, 8),
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=4,
        sample_size=32,
    )
    return save_pipeline(model_dir, tokenizer, vocab_size, unet, vae)


def _images(n: int, size: int, seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def write_instance_images(folder: str, n: int = 4, size: int = 32) -> None:
    os.makedirs(folder, exist_ok=True)
    for i, image in enumerate(_images(n, size, seed=1)):
        image.save(os.path.join(folder, f"img{i}.png"))


def image_pair_dataset(
    folder: str, columns: tuple[str, str, str], n: int = 4, size: int = 32, seeds: tuple[int, int] = (2, 3)
) -> None:
    """``folder/train.parquet``: an image column, a caption column and a second image column (a ControlNet's
    conditioning image, InstructPix2Pix's edited image), read by the scripts' ``load_dataset(<folder>)``."""
    import datasets

    first, text, second = columns
    os.makedirs(folder, exist_ok=True)
    features = datasets.Features({first: datasets.Image(), text: datasets.Value("string"), second: datasets.Image()})
    data = datasets.Dataset.from_dict(
        {
            first: _images(n, size, seed=seeds[0]),
            text: [CAPTIONS[i % len(CAPTIONS)] for i in range(n)],
            second: _images(n, size, seed=seeds[1]),
        },
        features=features,
    )
    data.to_parquet(os.path.join(folder, "train.parquet"))


def write_controlnet_dataset(folder: str, n: int = 4, size: int = 32) -> None:
    image_pair_dataset(folder, ("image", "text", "conditioning_image"), n, size)


if __name__ == "__main__":
    build(sys.argv[1])
    write_instance_images(sys.argv[2])
    write_controlnet_dataset(sys.argv[3])

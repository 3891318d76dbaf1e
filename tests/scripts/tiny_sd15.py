"""Tiny data for the SD 1.x UNet official examples beyond dreambooth / controlnet, from the real classes,
no hub: instruct_pix2pix's edit triples, the LCM distillation scripts' webdataset shards, and
train_unconditional.py's UNet2DModel config with its image folder. The SD pipeline itself is
tiny_sd_family.build (its x8 VAE: --resolution 32 gives 4x4 latents).

usage: python tiny_sd15.py WORK_DIR   (writes all of them under WORK_DIR)
Never imports accel_npu.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_sd_family import CAPTIONS, _images, image_pair_dataset

# diffusers v0.40.0 tests/pipelines/ddpm/test_ddpm.py dummy_uncond_unet
UNCOND_UNET = dict(
    block_out_channels=(4, 8),
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=16,
    in_channels=3,
    out_channels=3,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
)


def write_pix2pix_dataset(folder: str, n: int = 4, size: int = 32) -> None:
    """A parquet file with train_instruct_pix2pix.py's default columns (input_image, edit_prompt,
    edited_image), read by its ``load_dataset(--dataset_name <this folder>)``."""
    image_pair_dataset(folder, ("input_image", "edit_prompt", "edited_image"), n, size, seeds=(4, 5))


def write_shards(folder: str, shards: int = 2, per_shard: int = 4, size: int = 32) -> list[str]:
    """webdataset tar shards of ``<key>.png`` + ``<key>.txt`` samples (the keys the LCM scripts'
    ``wds.rename(image="jpg;png;jpeg;webp", text="text;txt;caption")`` reads); returns their paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for s in range(shards):
        path = os.path.join(folder, f"shard-{s:06d}.tar")
        with tarfile.open(path, "w") as tar:
            for i, image in enumerate(_images(per_shard, size, seed=10 + s)):
                key = f"{s:03d}{i:05d}"
                png = io.BytesIO()
                image.save(png, format="PNG")
                text = CAPTIONS[i % len(CAPTIONS)].encode()
                for name, payload in ((f"{key}.png", png.getvalue()), (f"{key}.txt", text)):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
        paths.append(path)
    return paths


def write_unconditional(folder: str, n: int = 4, size: int = 16) -> None:
    """``folder/unet/config.json`` (--model_config_name_or_path) and ``folder/images`` (--train_data_dir,
    datasets' imagefolder) for train_unconditional.py, which builds its UNet2DModel from a config."""
    from diffusers import UNet2DModel

    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    UNet2DModel(**UNCOND_UNET).save_config(os.path.join(folder, "unet"))
    for i, image in enumerate(_images(n, size, seed=6)):
        image.save(os.path.join(folder, "images", f"img{i}.png"))


if __name__ == "__main__":
    import tiny_sd_family

    tiny_sd_family.build(os.path.join(sys.argv[1], "model"))
    write_pix2pix_dataset(os.path.join(sys.argv[1], "pix2pix_data"))
    write_shards(os.path.join(sys.argv[1], "shards"))
    write_unconditional(os.path.join(sys.argv[1], "unconditional"))

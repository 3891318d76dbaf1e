"""Tiny inputs for diffusers' official SDXL UNet examples (text_to_image full and LoRA, ControlNet,
T2I-Adapter, InstructPix2Pix, advanced DreamBooth LoRA, LCM distillation), from the real classes, no hub.

usage: python tiny_sdxl_family.py MODEL_DIR DATA_DIR

MODEL_DIR (build): tiny_sana_sdxl.py's SDXL pipeline with a 4-block VAE (3 downsamplings, the x8 of a real
  SDXL VAE): train_controlnet_sdxl.py builds its ControlNet with ``ControlNetModel.from_unet(unet)``, whose
  conditioning embedding downsamples the conditioning image x8, so latents must be resolution/8
  (--resolution 32 -> 4x4 latents). The other scripts take the same folder.
build_adapter: the same, but a UNet with SDXL's block widths (320, 640, 1280): train_t2i_adapter_sdxl.py
  builds ``T2IAdapter(channels=(320, 640, 1280, 1280), adapter_type="full_adapter_xl")`` with fixed sizes,
  and the UNet adds the adapter's features to its down blocks' outputs channel for channel.
DATA_DIR gets, side by side:
  text/            imagefolder: 32x32 PNGs + metadata.jsonl (image, text), for --train_data_dir
  controlnet/      parquet: image / text / conditioning_image (train_controlnet_sdxl, train_t2i_adapter_sdxl)
  pix2pix/         imagefolder: input_image / edited_image (``*_file_name`` metadata keys) / edit_prompt
  instance/        DreamBooth instance images (--instance_data_dir)
  shards/          webdataset tars: <key>.png + <key>.txt + <key>.json ({"width", "height"} >= the LCM wds
                   scripts' MIN_SIZE 700, else their WebdatasetFilter drops every sample)
Never imports accel_npu.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_sana_sdxl import sdxl_pipeline
from tiny_sd_family import CAPTIONS, _images, write_controlnet_dataset, write_instance_images

SIZE = 32  # --resolution 32


def build(model_dir: str) -> None:
    sdxl_pipeline(model_dir, vae_blocks=4)


def build_lcm(model_dir: str) -> None:
    """The same, with SDXL's text sizes: the LCM wds scripts build their unconditional embeddings as
    ``torch.zeros(bs, 77, 2048)`` and ``torch.zeros(bs, 1280)`` (train_lcm_distill_sdxl_wds.py:1228-1229), so
    the encoders' hidden sizes add up to 2048 and the second projects to 1280 (2 layers, 64-wide MLPs)."""
    sdxl_pipeline(model_dir, vae_blocks=4, text_hidden=(1024, 1024), projection_dim=1280)


def build_adapter(model_dir: str) -> None:
    """SDXL's block widths and layout (DownBlock2D, two CrossAttnDownBlock2D) with one layer per block,
    small attention and a 64-wide text context."""
    sdxl_pipeline(
        model_dir,
        vae_blocks=4,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4, 8),
        transformer_layers_per_block=(1, 1, 1),
        norm_num_groups=32,
    )


def write_text_images(folder: str, n: int = 8) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
        for i, image in enumerate(_images(n, SIZE, seed=4)):
            name = f"{i:03d}.png"
            image.save(os.path.join(folder, name))
            f.write(json.dumps({"file_name": name, "text": CAPTIONS[i % len(CAPTIONS)]}) + "\n")


def write_pix2pix_dataset(folder: str, n: int = 4) -> None:
    os.makedirs(folder, exist_ok=True)
    inputs, edited = _images(n, SIZE, seed=5), _images(n, SIZE, seed=6)
    with open(os.path.join(folder, "metadata.jsonl"), "w") as f:
        for i in range(n):
            inputs[i].save(os.path.join(folder, f"in{i}.png"))
            edited[i].save(os.path.join(folder, f"out{i}.png"))
            f.write(
                json.dumps(
                    {
                        "input_image_file_name": f"in{i}.png",
                        "edited_image_file_name": f"out{i}.png",
                        "edit_prompt": CAPTIONS[i % len(CAPTIONS)],
                    }
                )
                + "\n"
            )


def write_shards(folder: str, shards: int = 2, per_shard: int = 4) -> None:
    os.makedirs(folder, exist_ok=True)
    images = _images(shards * per_shard, SIZE, seed=7)
    for s in range(shards):
        with tarfile.open(os.path.join(folder, f"{s:05d}.tar"), "w") as tar:
            for j in range(per_shard):
                i = s * per_shard + j
                buf = io.BytesIO()
                images[i].save(buf, format="PNG")
                meta = json.dumps({"width": 1024, "height": 1024, "pwatermark": 0.0}).encode()
                for ext, data in (
                    ("png", buf.getvalue()),
                    ("txt", CAPTIONS[i % len(CAPTIONS)].encode()),
                    ("json", meta),
                ):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def write_data(data_dir: str) -> None:
    write_text_images(os.path.join(data_dir, "text"))
    write_controlnet_dataset(os.path.join(data_dir, "controlnet"))
    write_pix2pix_dataset(os.path.join(data_dir, "pix2pix"))
    write_instance_images(os.path.join(data_dir, "instance"))
    write_shards(os.path.join(data_dir, "shards"))


if __name__ == "__main__":
    build(sys.argv[1])
    write_data(sys.argv[2])

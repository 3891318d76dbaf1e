"""Tiny CogVideoX pipeline folders from the real classes (random weights, no hub) and a folder of tiny
videos, for diffusers' official ``cogvideo/train_cogvideox_lora.py`` and
``train_cogvideox_image_to_video_lora.py``.

usage: python tiny_cogvideox.py {t2v,i2v,t2v_rope} MODEL_DIR [VIDEO_DIR]

Sizes follow diffusers v0.40.0's own pipeline tests (tests/pipelines/cogvideo/test_cogvideox.py and
test_cogvideox_image2video.py ``get_dummy_components``): transformer of inner dim 32, one layer, latent
2×2, 9 frames; VAE of four 8-channel CogVideoX blocks (16 px → 2, temporal compression 4). The tests'
hub tokenizer ``hf-internal-testing/tiny-random-t5`` is replaced by tiny_sd3_flux's local Unigram T5
tokenizer and a T5 encoder of d_model 32 (the transformer's text_embed_dim). Videos are uncompressed
AVIs (tiny_video.py) that decord reads. Never imports accel_npu.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
from tiny_sd3_flux import T5, t5_tokenizer
from tiny_video import write_raw_avi

SIZE = 16  # pixels the t2v script resizes to (--height/--width): latent 2 after three spatial downsamplings
# written 32×32: decord 0.6.0 returns garbled frames (shape (16, 16, 6)) for a 16-pixel-wide AVI; the
# i2v script has decord resize to --height/--width itself, so its transformer's learned positional
# embeddings are sized for 32 pixels (latent 4)
VIDEO_SIZE = 32
FRAMES = 9  # 4k + 1 frames: latent 3 after temporal compression 4
MAX_TEXT = 16  # the transformer's max_text_seq_length (the scripts pad prompts to it)
TRANSFORMER = dict(
    time_embed_dim=2,
    text_embed_dim=32,
    num_layers=1,
    sample_width=2,
    sample_height=2,
    sample_frames=FRAMES,
    patch_size=2,
    temporal_compression_ratio=4,
    max_text_seq_length=MAX_TEXT,
)
KINDS = {  # test_cogvideox.py / test_cogvideox_image2video.py
    "t2v": dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4),
    "i2v": dict(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=8,
        out_channels=4,
        use_rotary_positional_embeddings=True,
        use_learned_positional_embeddings=True,
        sample_width=VIDEO_SIZE // 8,
        sample_height=VIDEO_SIZE // 8,
    ),
    # t2v with RoPE, run at 32 px (latent 4x4: 12 video tokens, 16 text tokens; 2 heads): both token counts and
    # the heads divide by 2, for sequence parallelism (tests/test_sequence_parallel.py)
    "t2v_rope": dict(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        use_rotary_positional_embeddings=True,
        sample_width=VIDEO_SIZE // 8,
        sample_height=VIDEO_SIZE // 8,
    ),
}
PROMPTS = ["a red square", "a blue circle", "a green square", "the red dog"]


def pipeline(kind: str, folder: str):
    """CogVideoXPipeline (t2v) / CogVideoXImageToVideoPipeline (i2v) ``save_pretrained`` to ``folder``."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDPMScheduler,
        CogVideoXImageToVideoPipeline,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    transformer = CogVideoXTransformer3DModel(**{**TRANSFORMER, **KINDS[kind]})
    torch.manual_seed(0)
    blocks = 4
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * blocks,
        up_block_types=("CogVideoXUpBlock3D",) * blocks,
        block_out_channels=(8,) * blocks,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), **T5))
    cls = CogVideoXImageToVideoPipeline if kind == "i2v" else CogVideoXPipeline
    pipe = cls(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=CogVideoXDPMScheduler(),
    )
    pipe.save_pretrained(folder)
    return pipe


def videos(folder: str, count: int = len(PROMPTS)) -> None:
    """``count`` AVIs of FRAMES frames, VIDEO_SIZE×VIDEO_SIZE, with the scripts' line-per-entry index files:
    ``--instance_data_root folder --video_column videos.txt --caption_column prompts.txt``."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    names = []
    for i in range(count):
        base = rng.integers(0, 256, size=(VIDEO_SIZE, VIDEO_SIZE, 3))
        frames = [((base + 16 * t) % 256).astype(np.uint8) for t in range(FRAMES)]
        names.append(f"video_{i}.avi")
        write_raw_avi(Path(folder, names[-1]), frames)
    with open(os.path.join(folder, "videos.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    with open(os.path.join(folder, "prompts.txt"), "w") as f:
        f.write("\n".join(PROMPTS[:count]) + "\n")


if __name__ == "__main__":
    pipeline(sys.argv[1], sys.argv[2])
    if len(sys.argv) > 3:
        videos(sys.argv[3])

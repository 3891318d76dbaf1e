"""Tiny Kandinsky 2.2 prior and decoder pipelines, and a tiny MoVQ for VQGAN, from the real classes, no hub.

usage: python tiny_kandinsky.py MODEL_DIR DATA_DIR

MODEL_DIR/prior gets what diffusers' kandinsky2_2/text_to_image scripts load with
--pretrained_prior_model_name_or_path (a KandinskyV22PriorPipeline: prior/, image_encoder/, text_encoder/,
tokenizer/, scheduler/, image_processor/); MODEL_DIR/decoder what they load with
--pretrained_decoder_model_name_or_path (a KandinskyV22Pipeline: unet/, scheduler/, movq/) plus the
README.md whose ``prior:`` entry diffusers follows to load the connected prior pipeline: the scripts end
with ``AutoPipelineForText2Image.from_pretrained(decoder)``, a KandinskyV22CombinedPipeline that loads its
prior from the decoder's model card (diffusers pipelines/pipeline_loading_utils.py
_update_init_kwargs_with_connected_pipeline; the hub's kandinsky-2-2-decoder card names
kandinsky-2-2-prior the same way). Component configs: diffusers v0.40.0
tests/pipelines/kandinsky2_2/test_kandinsky_prior.py and test_kandinsky.py get_dummy_components, with
a 32x32 CLIP image encoder and a 16-token tokenizer for speed.
DATA_DIR: tiny_sd.py's imagefolder dataset ("image" and "text" columns; --train_data_dir).
Never imports accel_npu.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny_sd import write_dataset, write_tokenizer  # noqa: E402

EMBED = 32  # text_embedder_hidden_size of diffusers' tests: CLIP projection = prior embedding = UNet image_embeds
MAX_LENGTH = 16  # tokens; PriorTransformer.num_embeddings must equal it


def prior_pipeline(folder: str, seed: int = 0):
    import torch
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import (CLIPImageProcessor, CLIPTextConfig, CLIPTextModelWithProjection, CLIPVisionConfig,
                              CLIPVisionModelWithProjection)

    tokenizer, vocab_size = write_tokenizer(os.path.join(folder, "tokenizer"), max_length=MAX_LENGTH)
    torch.manual_seed(seed)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=EMBED, num_layers=1,
                             num_embeddings=MAX_LENGTH)
    prior.clip_std = torch.nn.Parameter(torch.ones(prior.clip_std.shape))
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=EMBED, image_size=32, projection_dim=EMBED, intermediate_size=37, num_attention_heads=4,
        num_channels=3, num_hidden_layers=2, patch_size=8))
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=EMBED, projection_dim=EMBED,
        intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=vocab_size, max_position_embeddings=MAX_LENGTH))
    image_processor = CLIPImageProcessor(
        crop_size=32, do_center_crop=True, do_normalize=True, do_resize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
        resample=3, size=32)
    scheduler = UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample", num_train_timesteps=1000,
                                clip_sample=True, clip_sample_range=10.0)
    pipe = KandinskyV22PriorPipeline(prior=prior, image_encoder=image_encoder, text_encoder=text_encoder,
                                     tokenizer=tokenizer, scheduler=scheduler, image_processor=image_processor)
    pipe.save_pretrained(folder)
    return pipe


MOVQ = dict(block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
            in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial",
            num_vq_embeddings=12, out_channels=3, up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
            vq_embed_dim=4)


def decoder_pipeline(folder: str, prior_folder: str, seed: int = 0):
    import torch
    from diffusers import DDIMScheduler, KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", block_out_channels=(32, 64), layers_per_block=1,
        encoder_hid_dim=EMBED, encoder_hid_dim_type="image_proj", cross_attention_dim=32, attention_head_dim=4,
        resnet_time_scale_shift="scale_shift", class_embed_type=None)
    movq = VQModel(**MOVQ)
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.00085, beta_end=0.012,
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon",
                              thresholding=False)
    pipe = KandinskyV22Pipeline(unet=unet, scheduler=scheduler, movq=movq)
    pipe.save_pretrained(folder)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(f"---\nprior:\n- {os.path.abspath(prior_folder)}\n---\n")
    return pipe


def build(model_dir: str, seed: int = 0) -> None:
    """``model_dir``/prior and ``model_dir``/decoder (see the module docstring)."""
    prior_pipeline(os.path.join(model_dir, "prior"), seed)
    decoder_pipeline(os.path.join(model_dir, "decoder"), os.path.join(model_dir, "prior"), seed)


def movq(folder: str, seed: int = 0):
    """A VQModel saved at ``folder`` itself (train_vqgan.py: ``VQModel.from_pretrained(path)``, no subfolder)."""
    import torch
    from diffusers import VQModel

    torch.manual_seed(seed)
    model = VQModel(**MOVQ)
    model.save_pretrained(folder)
    return model


if __name__ == "__main__":
    build(sys.argv[1])
    write_dataset(sys.argv[2])

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

from tiny_sd import write_dataset, write_tokenizer

EMBED = 32  # text_embedder_hidden_size of diffusers' tests: CLIP projection = prior embedding = UNet image_embeds
MAX_LENGTH = 16  # tokens; PriorTransformer.num_embeddings must equal it


def prior_pipeline(folder: str, seed: int = 0):
    import torch
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import (
        CLIPImageProcessor,
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
    )

    tokenizer, vocab_size = write_tokenizer(os.path.join(folder, "tokenizer"), max_length=MAX_LENGTH)
    torch.manual_seed(seed)
    prior = PriorTransformer(
        num_attention_heads=2, attention_head_dim=12, embedding_dim=EMBED, num_layers=1, num_embeddings=MAX_LENGTH
    )
    prior.clip_std = torch.nn.Parameter(torch.ones(prior.clip_std.shape))
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=EMBED,
            image_size=32,
            projection_dim=EMBED,
            intermediate_size=37,
            num_attention_heads=4,
            num_channels=3,
            num_hidden_layers=2,
            patch_size=8,
        )
    )
    text_encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
            hidden_size=EMBED,
            projection_dim=EMBED,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=vocab_size,
            max_position_embeddings=MAX_LENGTH,
        )
    )
    image_processor = CLIPImageProcessor(
        crop_size=32,
        do_center_crop=True,
        do_normalize=True,
        do_resize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
        resample=3,
        size=32,
    )
    scheduler = UnCLIPScheduler(
        variance_type="fixed_small_log",
        prediction_type="sample",
        num_train_timesteps=1000,
        clip_sample=True,
        clip_sample_range=10.0,
    )
    pipe = KandinskyV22PriorPipeline(
        prior=prior,
        image_encoder=image_encoder,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=scheduler,
        image_processor=image_processor,
    )
    pipe.save_pretrained(folder)
    return pipe


MOVQ = dict(
    block_out_channels=[32, 64],
    down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
    in_channels=3,
    latent_channels=4,
    layers_per_block=1,
    norm_num_groups=8,
    norm_type="spatial",
    num_vq_embeddings=12,
    out_channels=3,
    up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
    vq_embed_dim=4,
)


def decoder_pipeline(folder: str, prior_folder: str, seed: int = 0):
    import torch
    from diffusers import DDIMScheduler, KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        in_channels=4,
        out_channels=8,
        addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        block_out_channels=(32, 64),
        layers_per_block=1,
        encoder_hid_dim=EMBED,
        encoder_hid_dim_type="image_proj",
        cross_attention_dim=32,
        attention_head_dim=4,
        resnet_time_scale_shift="scale_shift",
        class_embed_type=None,
    )
    movq = VQModel(**MOVQ)
    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_schedule="linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
        thresholding=False,
    )
    pipe = KandinskyV22Pipeline(unet=unet, scheduler=scheduler, movq=movq)
    pipe.save_pretrained(folder)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write(f"---\nprior:\n- {os.path.abspath(prior_folder)}\n---\n")
    return pipe


def build(model_dir: str, seed: int = 0) -> None:
    """``model_dir``/prior and ``model_dir``/decoder (see the module docstring)."""
    prior_pipeline(os.path.join(model_dir, "prior"), seed)
    decoder_pipeline(os.path.join(model_dir, "decoder"), os.path.join(model_dir, "prior"), seed)


# train_vqgan.py's perceptual loss: a timm backbone it creates with pretrained=True. timm's smallest,
# test_resnet (0.5 M parameters; its pretrained_cfg has the CenterCrop and Normalize the script requires),
# with --timm_model_layers layer1 --timm_model_offset 3 (named child 4 -> feature index 1)
TIMM_BACKBONE = "test_resnet"
TIMM_HUB_ID = "timm/test_resnet.r160_in1k"  # its pretrained_cfg's hf_hub_id
TIMM_REQUIREMENT = "timm==1.0.31"  # vqgan/requirements.txt names timm unpinned: the registry's newest


def vqgan(folder: str, seed: int = 0) -> None:
    """What train_vqgan.py reads, under ``folder``:

    - model/: a MoVQ-shaped VQModel saved at the folder itself (``VQModel.from_pretrained(path)``);
    - discriminator.json: a small config for the script's Paella discriminator
      (--discriminator_config_name_or_path; its default has 512 hidden channels);
    - hub/: a Hugging Face hub cache (the row's HF_HUB_CACHE, HF_HUB_OFFLINE=1) holding random weights
      for TIMM_HUB_ID as huggingface_hub lays out a download (models--org--name/refs/main names the
      snapshot), so timm's ``pretrained=True`` loads them without the hub;
    - data/: tiny_sd.py's imagefolder dataset.
    timm comes from tests/torchvision_site.package_site (its requirements would pull a CUDA torchvision).
    """
    import json

    import torch
    from diffusers import VQModel
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from tests.torchvision_site import package_site, torchvision_site

    sys.path[:0] = [torchvision_site(), package_site(TIMM_REQUIREMENT)]
    import timm

    torch.manual_seed(seed)
    VQModel(**MOVQ).save_pretrained(os.path.join(folder, "model"))
    with open(os.path.join(folder, "discriminator.json"), "w") as f:
        json.dump(
            {"_class_name": "Discriminator", "in_channels": 3, "cond_channels": 0, "hidden_channels": 64, "depth": 4}, f
        )
    backbone = timm.create_model(TIMM_BACKBONE, pretrained=False)
    repo = os.path.join(folder, "hub", "models--" + TIMM_HUB_ID.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", "0" * 40)
    os.makedirs(snapshot, exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    save_file(
        {k: v.contiguous() for k, v in backbone.state_dict().items()}, os.path.join(snapshot, "model.safetensors")
    )
    write_dataset(os.path.join(folder, "data"))


if __name__ == "__main__":
    build(sys.argv[1])
    write_dataset(sys.argv[2])

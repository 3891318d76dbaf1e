"""Tiny Flux2, Flux2 Klein, Z-Image and Ideogram4 pipeline folders from the real classes (random weights,
no hub), for diffusers' official ``train_dreambooth_lora_{flux2,flux2_img2img,flux2_klein,
flux2_klein_img2img,z_image,ideogram4}.py``.

usage: python tiny_flux2.py {flux2,klein,z_image,ideogram4} MODEL_DIR [IMAGE_DIR]

Component sizes follow diffusers' own tests (tests/pipelines/flux2/test_pipeline_flux2.py and
test_pipeline_flux2_klein.py, tests/pipelines/z_image/test_z_image.py,
tests/models/transformers/test_models_transformer_ideogram4.py); vocabularies are the tokenizer's own
size instead of 32000 / 151936. Tokenizers are tiny_models' byte-level Qwen2Tokenizer (no merges,
no hub) with a chat template, since every one of these pipelines formats prompts with
``apply_chat_template``; Flux2's is wrapped in a PixtralProcessor (its [IMG] tokens added).
Never imports accel_npu.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from tiny_models import dreambooth_images, qwen_tokenizer

# text content as a string (Klein, Z-Image) or as a list of {"type": "text"} parts (Flux2, Ideogram4)
CHAT_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{%- if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif -%}"
    "<|im_end|>\n{% endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# diffusers' Flux2 tests: a one-block AutoencoderKLFlux2 (no downsampling)
FLUX2_VAE = dict(
    sample_size=32,
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",),
    up_block_types=("UpDecoderBlock2D",),
    block_out_channels=(4,),
    layers_per_block=1,
    norm_num_groups=1,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
HIDDEN = 16  # every text encoder's hidden size
# the Flux2 pipelines stack the text encoder's hidden states of layers (10, 20, 30) (Klein: 9, 18, 27);
# the img2img scripts have no --text_encoder_out_layers, so the tiny encoders are that deep
FLUX2_TEXT_LAYERS = 30
FLUX2_JOINT_DIM = 3 * HIDDEN


def chat_tokenizer(folder: str, extra_specials=()):
    tok = qwen_tokenizer(folder)
    if extra_specials:
        tok.add_tokens(list(extra_specials), special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return tok


def _flux2_transformer(**over):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        **{
            **dict(
                patch_size=1,
                in_channels=4,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=FLUX2_JOINT_DIM,
                timestep_guidance_channels=256,
                axes_dims_rope=[4, 4, 4, 4],
            ),
            **over,
        }
    )


def _flux2_vae(latent_channels=1):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    return AutoencoderKLFlux2(latent_channels=latent_channels, **FLUX2_VAE)


def _torchvision_importable() -> None:
    """transformers' PixtralProcessor requires torchvision: the tests' paired copy (tests/torchvision_site.py),
    as the launched scripts get it on PYTHONPATH."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from torchvision_site import torchvision_site

        sys.path.insert(0, torchvision_site())


def flux2_pipeline(folder: str):
    """Flux2Pipeline: Flux2 transformer, AutoencoderKLFlux2, Mistral3 (+ Pixtral vision) text encoder,
    PixtralProcessor."""
    _torchvision_importable()
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    tok_dir = os.path.join(folder, "tokenizer")
    tok = chat_tokenizer(tok_dir, PIXTRAL_TOKENS)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *PIXTRAL_TOKENS]}
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=6), tokenizer=tok, patch_size=6, chat_template=CHAT_TEMPLATE
    )
    special = dict(bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tok),
            "hidden_size": HIDDEN,
            "intermediate_size": 37,
            "max_position_embeddings": 512,
            "num_attention_heads": 4,
            "num_hidden_layers": FLUX2_TEXT_LAYERS,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            **special,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "image_size": 30,
            "patch_size": 6,
            "num_channels": 3,
        },
        image_seq_length=4,
        vision_feature_layer=-1,
        image_token_index=ids["[IMG]"],
        **special,
    )
    torch.manual_seed(0)
    text_encoder = Mistral3ForConditionalGeneration(config)
    pipe = Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_flux2_vae(),
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=_flux2_transformer(),
    )
    pipe.save_pretrained(folder)
    return pipe


def _qwen3_config(tok, **over):
    from transformers import Qwen3Config

    return Qwen3Config(
        **{
            **dict(
                hidden_size=HIDDEN,
                intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=8,
                vocab_size=len(tok),
                max_position_embeddings=512,
                pad_token_id=tok.pad_token_id,
            ),
            **over,
        }
    )


def klein_pipeline(folder: str):
    """Flux2KleinPipeline: Flux2 transformer (no guidance embedding), AutoencoderKLFlux2, Qwen3ForCausalLM."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    tok = chat_tokenizer(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(_qwen3_config(tok, num_hidden_layers=FLUX2_TEXT_LAYERS))
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_flux2_vae(),
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=_flux2_transformer(guidance_embeds=False),
    )
    pipe.save_pretrained(folder)
    return pipe


def z_image_pipeline(folder: str):
    """ZImagePipeline: Z-Image transformer, AutoencoderKL (2 blocks), Qwen3Model."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    tok = chat_tokenizer(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        norm_eps=1e-5,
        qk_norm=True,
        cap_feat_dim=HIDDEN,
        rope_theta=256.0,
        t_scale=1000.0,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # torch.empty in the constructor (diffusers' test fixes them the same way)
        transformer.x_pad_token.copy_(torch.ones_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.ones_like(transformer.cap_pad_token))
    torch.manual_seed(0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        block_out_channels=[32, 64],
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=32,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    torch.manual_seed(0)
    text_encoder = Qwen3Model(_qwen3_config(tok))
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )
    pipe.save_pretrained(folder)
    return pipe


def ideogram4_pipeline(folder: str):
    """Ideogram4Pipeline: two Ideogram4 transformers (conditional, unconditional), AutoencoderKLFlux2 with 4
    latent channels (16 packed), a Qwen3-VL text encoder with the 36 decoder layers the pipeline taps
    (QWEN3_VL_ACTIVATION_LAYERS: 13 of them, so llm_features_dim = 13 x hidden)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS
    from transformers import Qwen3VLConfig, Qwen3VLModel

    tok = chat_tokenizer(os.path.join(folder, "tokenizer"))
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=HIDDEN,
            intermediate_size=16,
            num_hidden_layers=max(QWEN3_VL_ACTIVATION_LAYERS) + 1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=512,
            pad_token_id=tok.pad_token_id,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=HIDDEN,
            patch_size=4,
            deepstack_visual_indexes=[],
        ),
    )
    torch.manual_seed(0)
    text_encoder = Qwen3VLModel(config)
    transformers_ = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        transformers_.append(
            Ideogram4Transformer2DModel(
                in_channels=16,
                num_layers=2,
                attention_head_dim=8,
                num_attention_heads=4,
                intermediate_size=32,
                adaln_dim=16,
                llm_features_dim=len(QWEN3_VL_ACTIVATION_LAYERS) * HIDDEN,
                rope_theta=10_000,
                mrope_section=(2, 1, 1),
                norm_eps=1e-5,
            )
        )
    pipe = Ideogram4Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_flux2_vae(latent_channels=4),
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformers_[0],
        unconditional_transformer=transformers_[1],
    )
    pipe.save_pretrained(folder)
    return pipe


def img2img_dataset(folder: str, n: int = 4, size: int = 32) -> None:
    """A local parquet dataset (``--dataset_name FOLDER``) with ``image``, ``cond_image`` and ``prompt``."""
    import datasets
    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(3)
    images = [
        [Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)) for _ in range(n)]
        for _ in range(2)
    ]
    features = datasets.Features(
        {"image": datasets.Image(), "cond_image": datasets.Image(), "prompt": datasets.Value("string")}
    )
    data = datasets.Dataset.from_dict(
        {"image": images[0], "cond_image": images[1], "prompt": ["a photo of sks dog"] * n}, features=features
    )
    data.to_parquet(os.path.join(folder, "train.parquet"))


if __name__ == "__main__":
    {"flux2": flux2_pipeline, "klein": klein_pipeline, "z_image": z_image_pipeline, "ideogram4": ideogram4_pipeline}[
        sys.argv[1]
    ](sys.argv[2])
    if len(sys.argv) > 3:
        dreambooth_images(sys.argv[3])

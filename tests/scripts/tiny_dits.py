"""Tiny pipelines (real classes, random weights, no hub) and their data for diffusers v0.40.0's official
scripts of the "other image DiTs, video, discrete" family in tools/compatibility.py, plus the
DiT4DiT-shaped user script (tests/scripts/train_dit4dit.py).

Component sizes follow diffusers v0.40.0's own pipeline tests (``get_dummy_components`` of the file named
at each builder); hub tokenizers are replaced by local ones (tiny_models.py, tiny_sd3_flux.py). Never
imports accel_npu.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch
from tiny_models import _SPECIAL, qwen_tokenizer

# the text-only part of Qwen2-VL's chat template (tokenizer_config.json of Qwen/Qwen2.5-VL-7B-Instruct):
# the Cosmos 2.5 pipeline's _get_prompt_embeds calls apply_chat_template with text-only messages
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_model_index(folder: str, pipeline: str, components: dict) -> None:
    """model_index.json as DiffusionPipeline.save_pretrained writes it, for pipelines whose __init__ cannot
    run here (Cosmos 2.5 builds a CosmosSafetyChecker that needs the absent cosmos_guardrail package)."""
    import diffusers

    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__}
    for name, obj in components.items():
        if obj is None:
            index[name] = [None, None]
        else:
            index[name] = [type(obj).__module__.split(".")[0], type(obj).__name__]
            obj.save_pretrained(os.path.join(folder, name))
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)


# -- Cosmos Predict 2.5 (cosmos/train_cosmos_predict25_lora.py) ------------------------------------------
# tests/pipelines/cosmos/test_cosmos2_5_predict.py get_dummy_components, the hub Qwen2 tokenizer replaced
# by tiny_models.qwen_tokenizer (so the text encoder's vocabulary is the local tokenizer's)
COSMOS25_TRANSFORMER = dict(
    in_channels=16 + 1,
    out_channels=16,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    mlp_ratio=2,
    text_embed_dim=32,
    adaln_lora_dim=4,
    max_size=(4, 32, 32),
    patch_size=(1, 2, 2),
    rope_scale=(2.0, 1.0, 1.0),
    concat_padding_mask=True,
    extra_pos_embed_type="learnable",
)
COSMOS25_VAE = dict(
    base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
)
# two layers of 16: _get_prompt_embeds concatenates every layer's hidden state, 2 x 16 = text_embed_dim
COSMOS25_TEXT = dict(
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
)
COSMOS25_VISION = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)
COSMOS25_FRAMES = 9  # written per video; the script takes --num_frames 5 (2 latent frames: 1 or 2 conditional)
COSMOS25_SIZE = 32


def cosmos25_pipeline(folder: str) -> None:
    """A Cosmos2_5_PredictBasePipeline folder (transformer, Wan VAE, Qwen2.5-VL text encoder, tokenizer with a
    chat template, UniPC scheduler; no safety checker: the script passes its own MockSafetyChecker)."""
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel, UniPCMultistepScheduler
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    os.makedirs(folder, exist_ok=True)
    tokenizer = qwen_tokenizer(os.path.join(folder, "tokenizer"))
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL}
    torch.manual_seed(0)
    transformer = CosmosTransformer3DModel(**COSMOS25_TRANSFORMER)
    torch.manual_seed(0)
    vae = AutoencoderKLWan(**COSMOS25_VAE)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                **COSMOS25_TEXT,
                "vocab_size": len(tokenizer),
                "pad_token_id": ids["<|endoftext|>"],
                "bos_token_id": ids["<|endoftext|>"],
                "eos_token_id": ids["<|im_end|>"],
            },
            vision_config=COSMOS25_VISION,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    )
    _write_model_index(
        folder,
        "Cosmos2_5_PredictBasePipeline",
        {
            "text_encoder": text_encoder,
            "tokenizer": tokenizer,
            "transformer": transformer,
            "vae": vae,
            "scheduler": UniPCMultistepScheduler(),
            "safety_checker": None,
        },
    )


def cosmos25_videos(folder: str, count: int = 2) -> None:
    """The script's --train_data_dir layout: ``videos/*.mp4`` (H.264 through imageio-ffmpeg, the script's
    own requirement) and ``metas/<name>.txt`` captions."""
    import imageio.v2 as imageio

    os.makedirs(os.path.join(folder, "videos"), exist_ok=True)
    os.makedirs(os.path.join(folder, "metas"), exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        base = rng.integers(0, 256, size=(COSMOS25_SIZE, COSMOS25_SIZE, 3))
        frames = [((base + 16 * t) % 256).astype(np.uint8) for t in range(COSMOS25_FRAMES)]
        imageio.mimwrite(
            os.path.join(folder, "videos", f"clip_{i}.mp4"), frames, fps=8, codec="libx264", macro_block_size=16
        )
        with open(os.path.join(folder, "metas", f"clip_{i}.txt"), "w") as f:
            f.write(f"a robot arm moves block {i}\n")


# -- DiT4DiT, a user script's shape (tests/scripts/train_dit4dit.py) --------------------------------------
def dit4dit(folder: str) -> None:
    """train_dit4dit.py's --pretrained folder: transformer/ (Cosmos), vae/ (Wan), text_encoder/ (T5), the
    folder tests/test_checkpoints_dit4dit.py trains too."""
    from diffusers import AutoencoderKLWan, CosmosTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    CosmosTransformer3DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        mlp_ratio=2.0,
        text_embed_dim=16,
        adaln_lora_dim=4,
        max_size=(4, 16, 16),
        patch_size=(1, 2, 2),
        concat_padding_mask=False,
        extra_pos_embed_type="learnable",
    ).save_pretrained(os.path.join(folder, "transformer"))
    AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).save_pretrained(os.path.join(folder, "vae"))
    T5EncoderModel(
        T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    ).save_pretrained(os.path.join(folder, "text_encoder"))


# -- Lumina2 (dreambooth/train_dreambooth_lora_lumina2.py) ------------------------------------------------
# tests/pipelines/lumina2/test_pipeline_lumina2.py get_dummy_components; the hub dummy-gemma tokenizer
# replaced by tiny_sana_sdxl.gemma_tokenizer
def lumina2_pipeline(folder: str) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
    from tiny_sana_sdxl import gemma_tokenizer
    from transformers import Gemma2Config, Gemma2Model

    tokenizer = gemma_tokenizer(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    transformer = Lumina2Transformer2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=1,
        num_kv_heads=1,
        multiple_of=16,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        scaling_factor=1.0,
        axes_dim_rope=[4, 2, 2],
        cap_feat_dim=8,
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    torch.manual_seed(0)
    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            head_dim=4,
            hidden_size=8,
            intermediate_size=8,
            num_attention_heads=2,
            num_hidden_layers=2,
            num_key_value_heads=2,
            sliding_window=2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
    )
    Lumina2Pipeline(
        transformer=transformer,
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    ).save_pretrained(folder)


# -- Krea 2 (dreambooth/train_dreambooth_lora_krea2.py) ---------------------------------------------------
# tests/pipelines/krea2/test_krea2.py get_dummy_components; the hub Qwen2 tokenizer replaced by
# tiny_models.qwen_tokenizer
def krea2_pipeline(folder: str) -> None:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Pipeline,
        Krea2Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLModel

    tokenizer = qwen_tokenizer(os.path.join(folder, "tokenizer"))
    torch.manual_seed(0)
    transformer = Krea2Transformer2DModel(
        in_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        timestep_embed_dim=8,
        text_hidden_dim=16,
        num_text_layers=3,
        text_num_attention_heads=2,
        text_num_key_value_heads=1,
        text_intermediate_size=16,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(4, 2, 2),
        rope_theta=1000.0,
    )
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(
        base_dim=4 * 6,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400
    )
    torch.manual_seed(0)
    text_encoder = Qwen3VLModel(
        Qwen3VLConfig(
            text_config={
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 8,
            },
            vision_config={
                "depth": 2,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 16,
            },
            vocab_size=152064,
        )
    ).eval()
    Krea2Pipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        text_encoder_select_layers=(0, 1, 2),
    ).save_pretrained(folder)


# -- HiDream-I1 (dreambooth/train_dreambooth_lora_hidream.py) --------------------------------------------
# tests/pipelines/hidream_image/test_pipeline_hidream.py get_dummy_components; the hub CLIP / T5 / Llama
# tokenizers and encoders replaced by tiny_sd3_flux's local CLIP + T5 pair and a tiny_models.llama of hidden
# 16 (caption_channels [T5 32, Llama 16]) with tiny_models.qwen_tokenizer (the script loads it with
# AutoTokenizer from --pretrained_tokenizer_4_name_or_path)
def hidream_pipeline(folder: str) -> None:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        HiDreamImagePipeline,
        HiDreamImageTransformer2DModel,
    )
    from tiny_models import llama
    from tiny_sd3_flux import VAE, _encoders
    from transformers import CLIPTextModelWithProjection

    parts = _encoders(folder, [CLIPTextModelWithProjection, CLIPTextModelWithProjection])
    tokenizer_4 = qwen_tokenizer(os.path.join(folder, "tokenizer_4"))
    text_encoder_4 = llama(
        vocab_size=len(tokenizer_4),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        tie_word_embeddings=False,
        pad_token_id=tokenizer_4.pad_token_id,
        eos_token_id=tokenizer_4.eos_token_id,
        bos_token_id=tokenizer_4.eos_token_id,
    )
    torch.manual_seed(0)
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_channels=[32, 16],
        text_emb_dim=64,
        num_routed_experts=4,
        num_activated_experts=2,
        axes_dims_rope=(4, 2, 2),
        max_resolution=(32, 32),
        llama_layers=(0, 1),
    )
    vae = AutoencoderKL(latent_channels=4, **{**VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159})
    HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        transformer=transformer,
        tokenizer_4=tokenizer_4,
        text_encoder_4=text_encoder_4,
        **parts,
    ).save_pretrained(folder)


# -- CogView4 Control (cogview4-control/train_control_cogview4.py) ----------------------------------------
# tests/pipelines/cogview4/test_cogview4.py get_dummy_components; the hub GLM-4 tokenizer replaced by
# glm_tokenizer, the GLM vocabulary sized to it
def glm_tokenizer(folder: str):
    """tiny_models.qwen_tokenizer's byte-level BPE with GLM-4's prefix: every text starts with ``[gMASK]<sop>``
    (THUDM/glm-4-9b-chat's tokenizer adds them), so the empty negative prompt the script encodes has tokens;
    left padding, as GLM-4's."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    tok = qwen_tokenizer(folder + ".bpe")
    tok.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<sop>"]})
    backend = tok.backend_tokenizer
    backend.post_processor = TemplateProcessing(
        single="[gMASK] <sop> $A", special_tokens=[(t, tok.convert_tokens_to_ids(t)) for t in ("[gMASK]", "<sop>")]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|endoftext|>", padding_side="left"
    )
    fast.save_pretrained(folder)
    return fast


def cogview4_control_pipeline(folder: str) -> None:
    import shutil

    from diffusers import (
        AutoencoderKL,
        CogView4ControlPipeline,
        CogView4Transformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import GlmConfig, GlmModel

    tokenizer = glm_tokenizer(os.path.join(folder, "tokenizer"))
    shutil.rmtree(os.path.join(folder, "tokenizer.bpe"))
    torch.manual_seed(0)
    transformer = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=4,
        num_attention_heads=4,
        out_channels=4,
        text_embed_dim=32,
        time_embed_dim=8,
        condition_dim=4,
    )
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        sample_size=128,
        # the script normalizes latents with both (THUDM/CogView4-6B's vae/config.json: 0.0, 1.0)
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    torch.manual_seed(0)
    text_encoder = GlmModel(
        GlmConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            head_dim=8,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    CogView4ControlPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    ).save_pretrained(folder)


def control_jsonl(folder: str, count: int = 4, size: int = 32) -> None:
    """``folder/train.jsonl`` for --jsonl_for_train: image / text / conditioning_image (paths to PNGs)."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(os.path.join(folder, "train.jsonl"), "w") as f:
        for i in range(count):
            image = os.path.join(folder, f"image_{i}.png")
            cond = os.path.join(folder, f"cond_{i}.png")
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(image)
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(cond)
            f.write(json.dumps({"image": image, "text": f"a photo of block {i}", "conditioning_image": cond}) + "\n")


# -- LLaDA2-style block refinement (discrete_diffusion/train_llada2.py) -----------------------------------
# the script fine-tunes any AutoModelForCausalLM (default Qwen/Qwen2.5-0.5B): a 2-layer Qwen2ForCausalLM of
# hidden 32 with tiny_models.qwen_tokenizer (the script adds its [MASK] token and resizes the embeddings)
def llada2_model(folder: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = qwen_tokenizer(folder)
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).save_pretrained(folder)


# -- aMUSEd (amused/train_amused.py) ----------------------------------------------------------------------
# tests/pipelines/amused/test_amused.py get_dummy_components (removed with the deprecated pipelines in
# diffusers #11879; as of commit 62cce3045d); the hub CLIP tokenizer replaced by tiny_sd.write_tokenizer at
# the script's hard-coded max_length 77
def amused_pipeline(folder: str) -> None:
    from diffusers import AmusedPipeline, AmusedScheduler, UVit2DModel, VQModel
    from tiny_sd import write_tokenizer
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    tokenizer, vocab = write_tokenizer(os.path.join(folder, "tokenizer"), max_length=77)
    torch.manual_seed(0)
    transformer = UVit2DModel(
        hidden_size=8,
        use_bias=False,
        hidden_dropout=0.0,
        cond_embed_dim=8,
        micro_cond_encode_dim=2,
        micro_cond_embed_dim=10,
        encoder_hidden_size=8,
        vocab_size=32,
        codebook_size=8,
        in_channels=8,
        block_out_channels=8,
        num_res_blocks=1,
        downsample=True,
        upsample=True,
        block_num_heads=1,
        num_hidden_layers=1,
        num_attention_heads=1,
        attention_dropout=0.0,
        intermediate_size=8,
        layer_norm_eps=1e-06,
        ln_elementwise_affine=True,
    )
    torch.manual_seed(0)
    vqvae = VQModel(
        act_fn="silu",
        block_out_channels=[8],
        down_block_types=["DownEncoderBlock2D"],
        in_channels=3,
        latent_channels=8,
        layers_per_block=1,
        norm_num_groups=8,
        num_vq_embeddings=8,
        out_channels=3,
        sample_size=8,
        up_block_types=["UpDecoderBlock2D"],
        mid_block_add_attention=False,
        lookup_from_codebook=True,
    )
    torch.manual_seed(0)
    text_encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=1,
            hidden_size=8,
            intermediate_size=8,
            layer_norm_eps=1e-05,
            num_attention_heads=1,
            num_hidden_layers=1,
            pad_token_id=1,
            vocab_size=vocab,
            projection_dim=8,
            max_position_embeddings=77,
        )
    )
    AmusedPipeline(
        vqvae=vqvae,
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        scheduler=AmusedScheduler(mask_token_id=31),
    ).save_pretrained(folder)

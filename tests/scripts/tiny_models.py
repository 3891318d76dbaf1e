"""Tiny models built from the real diffusers / transformers classes (random weights, no hub).

Used by tests/test_loading*.py and by the launched loading scripts. Never imports accel_npu.
"""
from __future__ import annotations

import torch

QWEN = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
           text_dim=32, freq_dim=32, ffn_dim=64, num_layers=3, rope_max_seq_len=32)
COSMOS = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3,
              mlp_ratio=2.0, text_embed_dim=32, adaln_lora_dim=8, max_size=(4, 16, 16), patch_size=(1, 2, 2),
              rope_scale=(1.0, 1.0, 1.0), concat_padding_mask=False, extra_pos_embed_type="learnable")
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)


def qwen(**over):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(**{**QWEN, **over})


def wan(**over):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(**{**WAN, **over})


def cosmos(**over):
    from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

    torch.manual_seed(0)
    return CosmosTransformer3DModel(**{**COSMOS, **over})


def llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**LLAMA, **over}))


def randomize(model):
    """Non-trivial values everywhere (zero-initialized output layers would hide mistakes)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.2)
    return model


def qwen_inputs(batch=2, seed=0, height=4, width=4, text=5):
    g = torch.Generator().manual_seed(seed)
    seq = height * width
    return dict(hidden_states=torch.randn(batch, seq, QWEN["in_channels"], generator=g),
                encoder_hidden_states=torch.randn(batch, text, QWEN["joint_attention_dim"], generator=g),
                encoder_hidden_states_mask=torch.ones(batch, text, dtype=torch.long),
                timestep=torch.full((batch,), 0.5), img_shapes=[[(1, height // 1, width // 1)]] * batch,
                return_dict=False)

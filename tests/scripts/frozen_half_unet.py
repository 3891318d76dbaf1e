"""A frozen bf16 UNet given fp32 prompt embeddings, as diffusers v0.40.0's controlnet/train_controlnet_sdxl.py
calls it (lines 974, 1062, 1264-1274: requires_grad_(False), .to(device, dtype=weight_dtype), then prompt
embeddings its collate_fn rebuilt as fp32 with torch.tensor). An unchanged user script: no accel_npu import.

usage: frozen_half_unet.py OUT.pt   -- writes {"error": str | None, "output": tensor | None, "by_hand_autocast",
"by_hand_cast"}: the script's call, then two references computed by hand (torch.autocast around the call; the
inputs cast to bf16 by hand).
"""

import sys

import torch
from diffusers import UNet2DConditionModel


def main(out: str) -> None:
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=8,
    )
    unet.requires_grad_(False)
    unet.to("cpu", dtype=torch.bfloat16)

    torch.manual_seed(1)
    noisy_latents = torch.randn(2, 4, 8, 8).to(torch.bfloat16)
    timesteps = torch.tensor([3, 7])
    prompt_embeds = torch.stack([torch.tensor(torch.randn(5, 64).tolist()) for _ in range(2)])  # fp32, as collate_fn
    added = {"text_embeds": torch.randn(2, 32), "time_ids": torch.tensor([[8.0, 8, 0, 0, 8, 8]] * 2)}

    def call(embeds):
        return unet(noisy_latents, timesteps, encoder_hidden_states=embeds, added_cond_kwargs=added, return_dict=False)[
            0
        ]

    result = {"error": None, "output": None}
    try:
        result["output"] = call(prompt_embeds)
    except RuntimeError as e:
        result["error"] = str(e)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result["by_hand_autocast"] = call(prompt_embeds)
    result["by_hand_cast"] = call(prompt_embeds.to(torch.bfloat16))
    torch.save(result, out)


if __name__ == "__main__":
    main(sys.argv[1])

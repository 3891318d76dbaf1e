"""Frozen bf16 models given fp32 activations outside any engine (plugins/precision/frozen_half.py).

diffusers v0.40.0's controlnet/train_controlnet_sdxl.py and t2i_adapter/train_t2i_adapter_sdxl.py freeze the UNet,
cast it to bf16 and hand it the prompt embeddings their collate_fn rebuilt as fp32: stock stops at the first
matmul. The same call runs in a fresh process twice, stock (ACCEL_NPU_DISABLE=1) and with accel-npu; the
witnesses are the tensors each process saved: stock's error, and our output beside references computed by
hand in the stock process (the call under torch.autocast, the inputs cast to bf16).
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accel_npu
from accel_npu.plugins.precision import frozen_half
from tests.launch_utils import base_env, run_concurrently

SCRIPT = Path(__file__).parent / "scripts" / "frozen_half_unet.py"


def _run(tmp_path: Path, name: str, **env: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=base_env(**env), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out), proc.stderr


def test_a_frozen_bf16_unet_given_fp32_prompt_embeddings_runs_under_autocast(tmp_path):
    (stock, _), (ours, log) = run_concurrently(lambda: _run(tmp_path, "stock", ACCEL_NPU_DISABLE="1"),
                                               lambda: _run(tmp_path, "ours"))
    assert stock["output"] is None and "expected m1 and m2 to have the same dtype" in stock["error"], stock["error"]
    assert ours["error"] is None
    got = ours["output"]
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4, 8, 8)
    assert torch.equal(got, stock["by_hand_autocast"])  # what torch.autocast around the call gives, bit for bit
    by_hand = stock["by_hand_cast"].float()
    assert not torch.equal(got.float(), torch.zeros_like(by_hand))
    assert torch.allclose(got.float(), by_hand, atol=5e-2, rtol=5e-2), (got.float() - by_hand).abs().max()
    # one warning, naming the script's line and the arguments
    warnings = [line for line in log.splitlines() if "frozen bfloat16 UNet2DConditionModel" in line]
    assert len(warnings) == 1 and f"{SCRIPT}:" in warnings[0] and "encoder_hidden_states" in warnings[0], log[-3000:]


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=2,
                                cross_attention_dim=16, norm_num_groups=4)


def _inputs():
    torch.manual_seed(1)
    return torch.randn(1, 4, 8, 8).to(torch.bfloat16), torch.tensor([3]), torch.randn(1, 5, 16)


def test_trained_fp32_and_unfrozen_models_are_left_as_they_are(caplog):
    accel_npu.patch()
    latents, t, embeds = _inputs()

    # trained (a parameter requires grad) when cast: no hook, stock's error
    trained = _tiny_unet().to(dtype=torch.bfloat16)
    assert trained not in frozen_half._hooked
    with pytest.raises(RuntimeError, match="same dtype"):
        trained(latents, t, encoder_hidden_states=embeds)

    # frozen when cast, trained afterwards (a layer unfrozen): the hook stands aside, stock's error
    unfrozen = _tiny_unet().requires_grad_(False).to(torch.bfloat16)
    assert unfrozen in frozen_half._hooked
    unfrozen.conv_out.requires_grad_(True)
    with pytest.raises(RuntimeError, match="same dtype"):
        unfrozen(latents, t, encoder_hidden_states=embeds)
    assert unfrozen not in frozen_half._hooked and not unfrozen._forward_pre_hooks and not unfrozen._forward_hooks

    # frozen when cast, a LoRA adapter added afterwards (diffusers' LoRA scripts: requires_grad_(False),
    # .to(weight_dtype), add_adapter): trained, so stock's error
    from peft import LoraConfig

    lora = _tiny_unet().requires_grad_(False).to(torch.bfloat16)
    lora.add_adapter(LoraConfig(r=2, target_modules=["to_q", "to_k"]))
    with pytest.raises(RuntimeError, match="same dtype"):
        lora(latents, t, encoder_hidden_states=embeds)

    # a frozen fp32 model: no hook, runs in fp32 as stock
    fp32 = _tiny_unet().requires_grad_(False).to(torch.float32)
    assert fp32 not in frozen_half._hooked
    assert fp32(latents.float(), t, encoder_hidden_states=embeds).sample.dtype == torch.float32

    # a frozen bf16 model given bf16 inputs: hooked, but nothing changes (no autocast entered)
    frozen = _tiny_unet().requires_grad_(False).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        plain = frozen(latents, t, encoder_hidden_states=embeds.to(torch.bfloat16)).sample
        ours = frozen(latents, t, encoder_hidden_states=embeds).sample
        assert not torch.is_autocast_enabled("cpu")  # the context left with the forward
        with pytest.raises(TypeError):  # a failing forward leaves it too
            frozen(latents, t, encoder_hidden_states=embeds, no_such_argument=1)
        assert not torch.is_autocast_enabled("cpu") and not getattr(frozen_half._entered, "stack", [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours, frozen(latents, t, encoder_hidden_states=embeds).sample)
    assert plain.dtype == ours.dtype == torch.bfloat16
    assert sum("frozen bfloat16 UNet2DConditionModel" in r.getMessage() for r in caplog.records) <= 1

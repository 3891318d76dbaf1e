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
from tests.inprocess import stock
from tests.launch_utils import base_env, run_concurrently

SCRIPT = Path(__file__).parent / "scripts" / "frozen_half_unet.py"


def _run(tmp_path: Path, name: str, **env: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.pt"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=base_env(**env), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out), proc.stderr


@pytest.mark.slow
def test_a_frozen_bf16_unet_given_fp32_prompt_embeddings_runs_under_autocast(tmp_path):
    (stock, _), (ours, log) = run_concurrently(
        lambda: _run(tmp_path, "stock", ACCEL_NPU_DISABLE="1"), lambda: _run(tmp_path, "ours")
    )
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
    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=2,
        cross_attention_dim=16,
        norm_num_groups=4,
    )


def _inputs():
    torch.manual_seed(1)
    return torch.randn(1, 4, 8, 8).to(torch.bfloat16), torch.tensor([3]), torch.randn(1, 5, 16)


@pytest.fixture()
def nothing_prepared():
    """No prepared optimizer or DeepSpeed engine left alive by an earlier test in this worker; the Accelerator
    a test makes is reset on leaving."""
    from accelerate.state import AcceleratorState, GradientState

    from accel_npu._torch import zero

    accel_npu.patch()
    AcceleratorState._reset_state(True)  # an earlier test's DeepSpeed state would make Accelerator() use it
    GradientState._reset_state()
    frozen_half._prepared.clear()
    frozen_half._first.clear()
    zero._engines.clear()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    frozen_half._prepared.clear()
    zero._engines.clear()


def test_trained_fp32_and_unfrozen_models_are_left_as_they_are(caplog, nothing_prepared):
    latents, t, embeds = _inputs()

    # a parameter requires grad and nothing is prepared yet: stock's error
    trained = _tiny_unet().to(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):
        trained(latents, t, encoder_hidden_states=embeds)

    # frozen when cast, trained afterwards (a layer unfrozen), nothing prepared: stock's error
    unfrozen = _tiny_unet().requires_grad_(False).to(torch.bfloat16)
    assert unfrozen in frozen_half._hooked
    unfrozen.conv_out.requires_grad_(True)
    with pytest.raises(RuntimeError, match="same dtype"):
        unfrozen(latents, t, encoder_hidden_states=embeds)

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


def test_a_bf16_unet_no_prepared_optimizer_holds_runs_under_autocast(nothing_prepared, caplog):
    """t2i_adapter/train_t2i_adapter_sdxl.py (v0.40.0): the UNet is never frozen (lines 926-930), cast to bf16
    (line 1011), left out of the optimizer and of prepare (only the adapter is trained: lines 1000, 1099), and
    given the fp32 prompt embeddings its collate_fn rebuilds (line 770). Stock stops at the first matmul;
    ours runs the call under torch.autocast, bit for bit the call written by hand under torch.autocast, the
    backward too. A UNet the prepared optimizer holds still fails as stock does, and loses the hooks."""
    from accelerate import Accelerator

    latents, t, embeds = _inputs()
    ours = _tiny_unet().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="same dtype"):  # before any prepare: as stock
        ours(latents, t, encoder_hidden_states=embeds)

    accelerator = Accelerator()
    adapter = torch.nn.Linear(4, 4)
    held = _tiny_unet().to(torch.bfloat16)
    adapter, optimizer = accelerator.prepare(adapter, torch.optim.AdamW(adapter.parameters()))
    held, held_optimizer = accelerator.prepare(held, torch.optim.AdamW(held.parameters()))

    with stock():  # cast without accel-npu: no hooks
        plain = _tiny_unet().to(torch.bfloat16)
    assert all(p.requires_grad for p in plain.parameters())
    with pytest.raises(RuntimeError, match="expected m1 and m2 to have the same dtype"):
        plain(latents, t, encoder_hidden_states=embeds)

    got_embeds, ref_embeds = embeds.clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="accel_npu"):
        got = ours(latents, t, encoder_hidden_states=got_embeds).sample
    assert not torch.is_autocast_enabled("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = plain(latents, t, encoder_hidden_states=ref_embeds).sample
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    got.float().square().mean().backward()
    ref.float().square().mean().backward()
    assert got_embeds.grad is not None and torch.equal(got_embeds.grad, ref_embeds.grad)
    assert torch.equal(ours.conv_in.weight.grad, plain.conv_in.weight.grad)
    assert [r.getMessage() for r in caplog.records if "no prepared optimizer holds" in r.getMessage()]

    # the UNet the second prepared optimizer holds: stock's error, hooks gone
    assert held in frozen_half._hooked
    with pytest.raises(RuntimeError, match="same dtype"):
        held(latents, t, encoder_hidden_states=embeds)
    assert held not in frozen_half._hooked and not held._forward_pre_hooks and not held._forward_hooks


@pytest.mark.parametrize("stage", [2, 3])
def test_a_unet_a_deepspeed_engine_trains_still_fails_as_stock(nothing_prepared, monkeypatch, stage):
    """DeepSpeed's ZeRO optimizers hold flat fp32 partitions in their param_groups, not the module's
    parameters: the engine says which it trains. A bf16 UNet given to prepare, then called outside the
    engine with fp32 activations, fails as stock does; another bf16 UNet, left out, runs under autocast."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from tests.launch_utils import one_rank_deepspeed_group

    latents, t, embeds = _inputs()
    with one_rank_deepspeed_group(monkeypatch):
        config = {
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
        }
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
        accelerator = Accelerator(deepspeed_plugin=plugin)
        trained = _tiny_unet().to(torch.bfloat16)
        left_out = _tiny_unet().to(torch.bfloat16)
        engine, optimizer = accelerator.prepare(trained, torch.optim.AdamW(trained.parameters()))
        inner = optimizer.optimizer
        assert not any(p is q for g in inner.param_groups for p in g["params"] for q in trained.parameters())
        with pytest.raises(RuntimeError, match="same dtype"):
            engine.module(latents, t, encoder_hidden_states=embeds)
        assert trained not in frozen_half._hooked
        got = left_out(latents, t, encoder_hidden_states=embeds).sample
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(got, left_out(latents, t, encoder_hidden_states=embeds).sample)
        del engine, optimizer, inner

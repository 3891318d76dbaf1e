"""Resuming a LoRA run under DeepSpeed whose load hook loads the checkpoint's LoRA again.

accelerate's ``load_state`` restores each DeepSpeed engine (its module and the optimizer's fp32 master) and
then runs the script's load hooks, which load the LoRA file the save hook wrote from that same state:

- diffusers v0.40.0's consistency_distillation/train_lcm_distill_lora_sd_wds.py (lines 1045-1061; the SDXL
  one the same): ``unet_.load_adapter(input_dir, "default", is_trainable=True)`` on its peft ``PeftModel``.
  peft's ``cast_adapter_dtype`` then swaps the engine's bf16 LoRA parameters for new fp32 ones;
- advanced_diffusion_training/train_dreambooth_lora_sd15_advanced.py (lines 1331-1411):
  ``set_peft_model_state_dict`` and then ``load_lora_into_unet`` with no adapter name, which injects a second
  adapter.

The optimizer holds neither: the next step fails (ZeRO-2 IndexError in reduce_ipg_grads; ZeRO-3 a parameter
it never partitioned). With accel-npu the hook's load goes into the existing adapter in place.

In-process, one rank (``one_rank_deepspeed_group``), a tiny real UNet2DConditionModel, the hooks' code as the
scripts write it. Stock half: the one patch off (``tests.inprocess.without``), as the matrix's
ACCEL_NPU_DISABLED_PATCHES would (the rest of accel-npu hands the sd15 hook its model). Witnesses: DeepSpeed's
own fp32 master (``deepspeed.utils.safe_get_full_fp32_param``), the parameter objects, the optimizer's
parameter groups, and a training step after the resume.
"""

from __future__ import annotations

import os

import pytest

from tests.inprocess import without

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1"]


@pytest.fixture()
def accelerator_factory(monkeypatch):
    from tests.launch_utils import accelerator_deepspeed_session

    made = []

    def make(stage: int):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        config = {
            "zero_optimization": zero,
            "bf16": {"enabled": True},
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
        }
        plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False)
        if made:  # a new launch: accelerate's process-wide state starts afresh
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(True)
            GradientState._reset_state()
        made.append(plugin)
        return Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")

    with accelerator_deepspeed_session(monkeypatch):
        yield make


def _unet():
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(  # tests/scripts/tiny_sd_family.py's
        block_out_channels=(16,),
        layers_per_block=1,
        sample_size=4,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def _lcm_hooks(accelerator, unet):
    """train_lcm_distill_lora_sd_wds.py lines 1045-1061."""
    from diffusers import StableDiffusionPipeline
    from peft import get_peft_model_state_dict

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            unet_ = accelerator.unwrap_model(unet)
            lora_state_dict = get_peft_model_state_dict(unet_, adapter_name="default")
            StableDiffusionPipeline.save_lora_weights(os.path.join(output_dir, "unet_lora"), lora_state_dict)
            unet_.save_pretrained(output_dir)
            for _, _model in enumerate(models):
                weights.pop()

    def load_model_hook(models, input_dir):
        unet_ = accelerator.unwrap_model(unet)
        unet_.load_adapter(input_dir, "default", is_trainable=True)
        for _ in range(len(models)):
            models.pop()

    return save_model_hook, load_model_hook


def _sd15_hooks(accelerator, unet):
    """train_dreambooth_lora_sd15_advanced.py lines 1331-1411 (no text encoder trained)."""
    from diffusers import StableDiffusionPipeline
    from diffusers.loaders import StableDiffusionLoraLoaderMixin
    from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            unet_lora_layers_to_save = None
            for model in models:
                if isinstance(model, type(accelerator.unwrap_model(unet))):
                    unet_lora_layers_to_save = convert_state_dict_to_diffusers(get_peft_model_state_dict(model))
                else:
                    raise ValueError(f"unexpected save model: {model.__class__}")
                weights.pop()
            StableDiffusionPipeline.save_lora_weights(
                output_dir, unet_lora_layers=unet_lora_layers_to_save, text_encoder_lora_layers=None
            )

    def load_model_hook(models, input_dir):
        unet_ = None
        text_encoder_one_ = None
        while len(models) > 0:
            model = models.pop()
            if isinstance(model, type(accelerator.unwrap_model(unet))):
                unet_ = model
            else:
                raise ValueError(f"unexpected save model: {model.__class__}")
        lora_state_dict, network_alphas = StableDiffusionPipeline.lora_state_dict(input_dir)
        unet_state_dict = {f"{k.replace('unet.', '')}": v for k, v in lora_state_dict.items() if k.startswith("unet.")}
        unet_state_dict = convert_unet_state_dict_to_peft(unet_state_dict)
        set_peft_model_state_dict(unet_, unet_state_dict, adapter_name="default")
        lora_state_dict, network_alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(input_dir)
        StableDiffusionLoraLoaderMixin.load_lora_into_unet(lora_state_dict, network_alphas=network_alphas, unet=unet_)
        text_encoder_state_dict = {k: v for k, v in lora_state_dict.items() if "text_encoder." in k}
        StableDiffusionLoraLoaderMixin.load_lora_into_text_encoder(
            text_encoder_state_dict, network_alphas=network_alphas, text_encoder=text_encoder_one_
        )

    return save_model_hook, load_model_hook


def _lora(module):
    return {n: p for n, p in module.named_parameters() if "lora_" in n}


def _values(params):
    """{name: (module value as fp32, DeepSpeed's fp32 master)} of partitioned or whole parameters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    with deepspeed.zero.GatheredParameters(list(params.values())):  # a no-op for whole (ZeRO-2) parameters
        for name, p in params.items():
            out[name] = (p.detach().float().clone(), safe_get_full_fp32_param(p).detach().clone())
    return out


def _step(accelerator, engine, optimizer, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(1, 4, 4, 4, generator=g, dtype=torch.float32).to(torch.bfloat16)
    ehs = torch.randn(1, 3, 32, generator=g).to(torch.bfloat16)
    loss = engine(sample, torch.tensor([10]), ehs).sample.float().pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def _prepared(make, stage, script):
    """A fresh Accelerator, the tiny UNet with its LoRA as the script adds it, prepared; the script's hooks."""
    import torch
    from peft import LoraConfig, get_peft_model

    accelerator = make(stage)
    unet = _unet()
    unet.requires_grad_(False)
    if script == "lcm":
        unet = get_peft_model(unet, LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS))
    else:
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=TARGETS))
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-2)
    engine, optimizer = accelerator.prepare(unet, optimizer)
    save_hook, load_hook = (_lcm_hooks if script == "lcm" else _sd15_hooks)(accelerator, engine)
    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    module = accelerator.unwrap_model(engine)
    return accelerator, engine, optimizer, module, _lora(module)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("script", ["lcm", "sd15_advanced"])
def test_a_load_hook_that_loads_the_lora_again_resumes_into_the_engines_parameters(
    accelerator_factory, tmp_path, stage, script
):
    """Each launch of the script as a fresh Accelerator and engine: the first trains 2 steps and saves, the
    resumed one loads (ours), the stock one loads with the patch off."""
    import torch

    from accel_npu.plugins.checkpoints import DIFFUSERS_LOAD_LORA_ADAPTER, PEFT_LOAD_ADAPTER

    patch = PEFT_LOAD_ADAPTER if script == "lcm" else DIFFUSERS_LOAD_LORA_ADAPTER
    accelerator, engine, optimizer, module, lora = _prepared(accelerator_factory, stage, script)
    assert lora and all(p.dtype == torch.bfloat16 for p in lora.values())
    initial = _values(lora)
    for seed in (1, 2):
        _step(accelerator, engine, optimizer, seed)
    ckpt = tmp_path / "checkpoint-2"
    accelerator.save_state(str(ckpt))
    saved = _values(lora)
    assert all(not torch.equal(saved[n][1], initial[n][1]) for n in lora)  # trained: a fresh model differs

    # the resumed launch
    accelerator, engine, optimizer, module, lora = _prepared(accelerator_factory, stage, script)
    accelerator.load_state(str(ckpt))
    assert _lora(module).keys() == lora.keys() and all(_lora(module)[n] is p for n, p in lora.items())
    assert list(module.peft_config) == ["default"]
    restored = _values(lora)
    for name, (value, master) in restored.items():
        assert torch.equal(master, saved[name][1]), name  # DeepSpeed restored the checkpoint's master
        assert torch.equal(value, master.to(torch.bfloat16).float()), name  # the module holds it, in bf16
        assert lora[name].dtype == torch.bfloat16, name
    if stage == 2:  # the ZeRO-2 optimizer's own parameter groups hold these very parameters
        held = {id(p) for group in engine.optimizer.bit16_groups for p in group}
        assert all(id(p) in held for p in lora.values())
    _step(accelerator, engine, optimizer, 3)
    after = _values(lora)
    assert all(not torch.equal(after[n][1], restored[n][1]) for n in lora)  # the step trained every LoRA tensor
    assert all(not torch.equal(after[n][0], restored[n][0]) for n in lora if "lora_B" in n)

    # stock: the hook's load replaces the parameters (peft's fp32 cast) or adds an adapter; the next step fails
    accelerator, engine, optimizer, module, lora = _prepared(accelerator_factory, stage, script)
    with without(patch):
        accelerator.load_state(str(ckpt))
    if script == "lcm":
        assert all(p.dtype == torch.float32 and p is not lora[n] for n, p in _lora(module).items())
    else:
        assert len(module.peft_config) == 2 and len(_lora(module)) == 2 * len(lora)
    # ZeRO-2: no gradient hook on the new parameters, an empty bucket; ZeRO-3: parameters it never partitioned
    # (the launches' "no attribute 'ds_status'" / "'ds_active_sub_modules'"; here the backward of a shape-[0] one)
    expected = (
        (IndexError, "list index out of range")
        if stage == 2
        else (
            (AttributeError, RuntimeError),
            "'Parameter' object has no attribute 'ds_|invalid gradient .* expected shape compatible with \\[0\\]",
        )
    )
    with pytest.raises(expected[0], match=expected[1]):
        _step(accelerator, engine, optimizer, 4)

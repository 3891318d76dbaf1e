"""Several models with one optimizer over them in one ``accelerator.prepare`` under DeepSpeed.

diffusers v0.40.0's custom_diffusion/train_custom_diffusion.py with ``--modifier_token`` calls
``accelerator.prepare(custom_diffusion_layers, text_encoder, optimizer, train_dataloader, lr_scheduler)``, the
optimizer over both models' parameters; stock accelerate 1.15 asserts "You can't use same `Accelerator()` instance
with multiple models when using DeepSpeed". accel-npu puts both under one engine
(plugins/deepspeed/models_together.py). The same two classes here, tiny: diffusers' AttnProcsLayers (whose
state-dict hooks rename its keys) over two processors called directly, as the UNet calls them, and a
CLIPTextModel whose token embedding alone trains, as the script freezes it.

The engine steps at the script's ``optimizer.step()``; in between, under ZeRO-2 and ZeRO-3 (the embedding a shape-[0]
partition there), the script zeroes the embedding gradient of all but its new token, as train_custom_diffusion.py does
(lines 1192-1205): the whole gradient is shown when read (a read under ``if accelerator.is_main_process:`` gets None,
as stock) and written back before the step.

In-process, one rank, stock beside ours. Witnesses: the models' parameters after two steps against the same
steps (and gradient edits) taken without DeepSpeed, read from DeepSpeed's own fp32 master weights
(``safe_get_full_fp32_param``); DeepSpeed's ``global_steps``; the checkpoint ``save_state`` writes (its model-states
file opened); the parameters after ``load_state``; what save/load hooks receive.
"""

from __future__ import annotations

import copy
import itertools

import pytest

from tests.inprocess import stock

NEW_TOKEN = 3  # the script's --modifier_token, whose embedding row alone trains
STOCK = "You can't use same `Accelerator\\(\\)` instance with multiple models when using DeepSpeed"


@pytest.fixture()
def accelerator_factory(monkeypatch):
    from tests.launch_utils import accelerator_deepspeed_session

    def make(stage: int):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        config = {
            "zero_optimization": {
                "stage": stage,
                "stage3_param_persistence_threshold": 0,
                "reduce_bucket_size": "auto",
            },
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 1,
        }
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False))

    with accelerator_deepspeed_session(monkeypatch):
        yield make


def _models():
    """custom_diffusion_layers and text_encoder as the script builds them, tiny."""
    import torch
    from diffusers.loaders.utils import AttnProcsLayers
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=40,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=6,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    # the script trains the token embeddings alone (train_custom_diffusion.py lines 877-883)
    text_module = text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
    text_module.encoder.requires_grad_(False)
    text_module.final_layer_norm.requires_grad_(False)
    text_module.embeddings.position_embedding.requires_grad_(False)
    layers = AttnProcsLayers(
        {"down.attn2.processor": torch.nn.Linear(8, 8), "up.attn2.processor": torch.nn.Linear(8, 8)}
    )
    return layers, text_encoder


def _text_module(text_encoder):
    return text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder


def _optimizer(layers, text_encoder):
    import torch

    return torch.optim.SGD(
        itertools.chain(text_encoder.get_input_embeddings().parameters(), layers.parameters()), lr=0.5
    )


def _loss(layers, text_encoder, ids):
    import torch

    hidden = text_encoder(ids)[0]
    for processor in layers.layers:  # called directly, as the UNet's attention modules call them
        hidden = torch.tanh(processor(hidden))
    return hidden.pow(2).mean()


def _batches():
    import torch

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (2, 5), generator=g) for _ in range(4)]
    for ids in batches:
        ids[:, 1] = NEW_TOKEN  # "a photo of <new1> dog": every prompt holds the new token
    return batches


def _master(models: dict) -> dict:
    """DeepSpeed's own fp32 master copy of every trainable parameter."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        f"{m}.{n}": safe_get_full_fp32_param(p).clone()
        for m, model in models.items()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_one_optimizer_over_two_models_trains_both_in_one_engine(accelerator_factory, tmp_path, stage):
    import torch
    from deepspeed import DeepSpeedEngine
    from torch.utils.data import DataLoader

    accelerator = accelerator_factory(stage)
    layers, text_encoder = _models()
    reference = copy.deepcopy((layers, text_encoder))
    optimizer = _optimizer(layers, text_encoder)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.cat(_batches())), batch_size=2)

    with stock():
        with pytest.raises(AssertionError, match=STOCK):
            accelerator.prepare(layers, text_encoder, optimizer, loader, scheduler)

    saved_by_hooks, loaded_by_hooks = [], []
    accelerator.register_save_state_pre_hook(lambda models, weights, out: saved_by_hooks.append(list(models)))
    accelerator.register_load_state_pre_hook(lambda models, in_dir: loaded_by_hooks.append(list(models)))
    p_layers, p_text, p_opt, p_loader, p_sched = accelerator.prepare(layers, text_encoder, optimizer, loader, scheduler)
    # what the script reaches through each position: the model (unwrap_model, .module), a DeepSpeedEngine as stock
    # gives each model; one engine in accelerate's _models
    assert accelerator.unwrap_model(p_text) is text_encoder and p_text.module is text_encoder
    assert accelerator.unwrap_model(p_layers) is layers
    assert isinstance(p_text, DeepSpeedEngine) and len(accelerator._models) == 1
    assert {id(p) for p in p_text.parameters()} == {id(p) for p in text_encoder.parameters()}
    p_text.eval()
    assert not text_encoder.training and layers.training
    p_text.train()
    assert text_encoder.training
    engine = accelerator._models[0]
    # "auto" bucket sizes come from model.config.hidden_size (accelerate's _prepare_deepspeed): the text encoder's
    assert engine.zero_reduce_bucket_size() == 8 * 8

    initial = {k: v.clone() for k, v in _master({"layers": layers, "text_encoder": text_encoder}).items()}
    ref_layers, ref_text = reference
    ref_opt = _optimizer(ref_layers, ref_text)
    batches = [b for (b,) in p_loader]
    others = torch.arange(40) != NEW_TOKEN
    for step, ids in enumerate(batches[:2]):
        with accelerator.accumulate(p_layers), accelerator.accumulate(p_text):
            loss = _loss(p_layers.module, p_text, ids)  # the script calls text_encoder(...) as prepare returned it
            accelerator.backward(loss)
            if step == 0 and accelerator.is_main_process:
                # a read on the main process alone would be a collective the other ranks do not join: None, as stock
                guarded = p_text.module.get_input_embeddings().weight.grad
                assert guarded is None
            # the script zeroes the embedding gradient of all but its new token before the step (lines 1192-1205)
            grad = p_text.module.get_input_embeddings().weight.grad
            assert grad.shape == (40, 8) and p_text.module.get_input_embeddings().weight.grad is grad
            grad.data[others, :] = grad.data[others, :].fill_(0)
            assert engine.global_steps == step  # the step is the optimizer's, as the script takes it
            p_opt.step()
            p_sched.step()
            p_opt.zero_grad()
        ref_loss = _loss(ref_layers, ref_text, ids)
        ref_loss.backward()
        ref_grad = ref_text.get_input_embeddings().weight.grad
        ref_grad.data[others, :] = ref_grad.data[others, :].fill_(0)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), ref_loss.detach())
    assert engine.global_steps == 2

    after = _master({"layers": layers, "text_encoder": text_encoder})
    expected = {
        f"{m}.{n}": p.detach()
        for m, model in {"layers": ref_layers, "text_encoder": ref_text}.items()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    assert set(after) == set(expected) and any(k.startswith("text_encoder.") for k in after)
    for key, value in after.items():
        torch.testing.assert_close(value, expected[key], msg=key)
        assert not torch.equal(value, initial[key]), f"{key} did not train"
    embedding = next(k for k in after if "token_embedding" in k)
    # the zeroed rows reached DeepSpeed's step: only the new token's embedding moved
    assert torch.equal(after[embedding][others], initial[embedding][others])
    assert not torch.equal(after[embedding][NEW_TOKEN], initial[embedding][NEW_TOKEN])

    # one DeepSpeed checkpoint holding both models (each under its index, keys as the model names them)
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.wait_for_everyone()  # written in the background (a launched rank's default): on disk from here
    assert saved_by_hooks[0] == [layers, text_encoder]  # save hooks get the models, as under DDP
    (states,) = (tmp_path / "ckpt").rglob("*mp_rank_00_model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert any(k.startswith("0.down.attn2.processor.") for k in module), sorted(module)[:4]
    assert any(k.startswith("1.") and "token_embedding" in k for k in module), sorted(module)

    for ids in batches[2:]:  # more training, then back to the checkpoint
        accelerator.backward(_loss(p_layers.module, p_text, ids))
        p_opt.step()
    moved = _master({"layers": layers, "text_encoder": text_encoder})
    assert any(not torch.equal(moved[k], after[k]) for k in after)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert loaded_by_hooks[0] == [layers, text_encoder]
    restored = _master({"layers": layers, "text_encoder": text_encoder})
    for key, value in after.items():
        assert torch.equal(restored[key], value), key
    assert engine.global_steps == 2


def test_an_optimizer_missing_a_models_parameters_keeps_accelerates_assertion_with_the_reason(accelerator_factory):
    """Two models and one optimizer over one of them: neither one engine (the optimizer misses model 1's trainable
    parameters) nor one engine per model (one optimizer for two models); accelerate's assertion stands, saying why.
    (A generator and a discriminator, each with its optimizer, get one engine each: test_deepspeed_engine_per_model.)"""
    import torch

    accelerator = accelerator_factory(2)
    layers, text_encoder = _models()
    only_layers = torch.optim.SGD(layers.parameters(), lr=0.1)
    with pytest.raises(
        AssertionError,
        match=STOCK + r".*the trainable parameters of model 1 \(CLIPTextModel\) are not.*2 models with 1",
    ):
        accelerator.prepare(layers, text_encoder, only_layers)
    assert accelerator._models == []


@pytest.mark.parametrize("stage", [2, 3])
def test_a_trainable_parameter_left_out_of_the_optimizer_keeps_its_value_as_under_ddp(accelerator_factory, stage):
    """diffusers v0.40.0's textual_inversion_sdxl.py leaves CLIPTextModelWithProjection's ``text_projection``
    requiring a gradient outside its optimizer (token embeddings only). Under DDP no step changes it; here the
    final layer norm plays that part. Witnesses: the left-out weight equal to its initial value after two steps,
    the optimized ones equal to the same steps taken without DeepSpeed, where the left-out weight does get a
    gradient (so it did take part) and is not stepped."""
    import torch
    from torch.utils.data import DataLoader

    accelerator = accelerator_factory(stage)
    layers, text_encoder = _models()
    left_out = _text_module(text_encoder).final_layer_norm.weight
    left_out.requires_grad_(True)
    initial_left_out = left_out.detach().clone()
    reference = copy.deepcopy((layers, text_encoder))
    optimizer = _optimizer(layers, text_encoder)
    loader = DataLoader(torch.utils.data.TensorDataset(torch.cat(_batches())), batch_size=2)
    p_layers, p_text, p_opt, p_loader = accelerator.prepare(layers, text_encoder, optimizer, loader)

    ref_layers, ref_text = reference
    ref_opt = _optimizer(ref_layers, ref_text)
    for (ids,) in list(p_loader)[:2]:
        accelerator.backward(_loss(p_layers.module, p_text, ids))
        p_opt.step()
        p_opt.zero_grad()
        _loss(ref_layers, ref_text, ids).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_left_out = _text_module(ref_text).final_layer_norm.weight
    assert ref_left_out.grad is not None and ref_left_out.grad.abs().sum() > 0  # it takes part in the loss
    assert torch.equal(ref_left_out.detach(), initial_left_out)  # and no step changes it under plain torch
    from deepspeed import zero

    with zero.GatheredParameters([left_out], enabled=stage == 3):
        assert torch.equal(left_out.detach().float(), initial_left_out)
    after = _master({"layers": layers, "text_encoder": text_encoder})
    expected = {
        f"{m}.{n}": p.detach()
        for m, model in {"layers": ref_layers, "text_encoder": ref_text}.items()
        for n, p in model.named_parameters()
        if p.requires_grad and "final_layer_norm" not in n
    }
    assert set(after) == set(expected)
    for key, value in after.items():
        torch.testing.assert_close(value, expected[key], msg=key)

"""Several models, each with an optimizer of its own, in one ``accelerator.prepare`` under DeepSpeed: one engine each.

diffusers v0.40.0's vqgan/train_vqgan.py prepares ``model, discriminator, optimizer, discr_optimizer, lr_scheduler,
discr_lr_scheduler`` together; stock accelerate asserts "You can't use same `Accelerator()` instance with multiple
models when using DeepSpeed". accel-npu gives each (model, optimizer) an engine (plugins/deepspeed/engine_per_model.py).
The loop here is the script's, tiny: a generator step whose loss runs through the discriminator, with the adaptive
weight's ``torch.autograd.grad`` on the generator's last layer, and a discriminator step with a gradient penalty
(``autograd.grad(create_graph=True)``), the discriminator spectral-normed as the script's.

In-process, one rank, stock beside ours. Witnesses: DeepSpeed's own fp32 master weights after the steps against the
same steps taken without DeepSpeed (torch's AdamW, ``zero_grad`` where the script calls it); the two checkpoints
``save_state`` writes (their model-states files opened); the weights after ``load_state``.
"""

from __future__ import annotations

import copy

import pytest

STOCK = "You can't use same `Accelerator\\(\\)` instance with multiple models when using DeepSpeed"


@pytest.fixture()
def accelerator_factory(monkeypatch):
    from tests.launch_utils import accelerator_deepspeed_session

    def make(stage: int, bf16: bool = False):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        config = {
            "bf16": {"enabled": bf16},
            # ZeRO-3 releases each parameter after its use (no reuse distance, no prefetch), as in a real-size model
            "zero_optimization": {
                "stage": stage,
                "stage3_param_persistence_threshold": 0,
                "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 0,
            },
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,  # accelerate's default is 1.0; the reference clips nothing
        }
        return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False))

    with accelerator_deepspeed_session(monkeypatch):
        yield make


def _models():
    import torch

    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    discriminator = torch.nn.Sequential(
        torch.nn.utils.spectral_norm(torch.nn.Linear(6, 8)), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1)
    )
    return generator, discriminator


def _optimizers(generator, discriminator):
    import torch

    return (
        torch.optim.AdamW(list(generator.parameters()), lr=1e-2),
        torch.optim.AdamW(list(discriminator.parameters()), lr=1e-2),
    )


def _batches():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g) for _ in range(6)]


def _train(generator, discriminator, opt, d_opt, batches, backward, unwrap, start=0):
    """train_vqgan.py's loop (lines 899-973), tiny: even iterations train the generator, odd ones the discriminator."""
    import torch

    losses = []
    for i, x in enumerate(batches, start):
        generator_step = i % 2 == 0
        (opt if generator_step else d_opt).zero_grad(set_to_none=True)
        fmap = generator(x)
        if generator_step:
            recon = torch.nn.functional.mse_loss(fmap, x)
            gen_loss = -discriminator(fmap).mean()
            last = unwrap(generator)[2].weight  # the script's decoder.conv_out.weight
            g_recon = torch.autograd.grad(recon, last, retain_graph=True)[0].detach().norm(p=2)
            g_gen = torch.autograd.grad(gen_loss, last, retain_graph=True)[0].detach().norm(p=2)
            loss = recon + (g_recon / g_gen.clamp(min=1e-8)).clamp(max=1e4) * gen_loss
            backward(loss)
            opt.step()
        else:
            fmap = fmap.detach()
            pixels = x.clone().requires_grad_()
            real, fake = discriminator(pixels), discriminator(fmap)
            loss = (torch.nn.functional.relu(1 + fake) + torch.nn.functional.relu(1 - real)).mean()
            grads = torch.autograd.grad(real, pixels, torch.ones_like(real), create_graph=True, retain_graph=True)[0]
            loss = loss + 10 * ((grads.norm(2, dim=1) - 1) ** 2).mean()
            backward(loss)
            d_opt.step()
        losses.append(loss.detach())
    return losses


def _master(model) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("stage", [2, 3])
def test_each_model_with_its_optimizer_trains_in_an_engine_of_its_own(accelerator_factory, tmp_path, stage):
    import torch
    from deepspeed import DeepSpeedEngine

    from tests.inprocess import stock

    accelerator = accelerator_factory(stage)
    generator, discriminator = _models()
    reference = copy.deepcopy((generator, discriminator))
    opt, d_opt = _optimizers(generator, discriminator)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    d_sched = torch.optim.lr_scheduler.LambdaLR(d_opt, lambda step: 1.0)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4

    with stock():
        with pytest.raises(AssertionError, match=STOCK):
            accelerator.prepare(generator, discriminator, opt, d_opt, sched, d_sched)

    p_gen, p_disc, p_opt, p_d_opt, _, _ = accelerator.prepare(generator, discriminator, opt, d_opt, sched, d_sched)
    assert isinstance(p_gen, DeepSpeedEngine) and isinstance(p_disc, DeepSpeedEngine) and p_gen is not p_disc
    assert accelerator._models == [p_gen, p_disc]  # one checkpoint each, in the script's order
    initial = {"g": _master(generator), "d": _master(discriminator)}

    batches = _batches()
    losses = _train(p_gen, p_disc, p_opt, p_d_opt, batches, accelerator.backward, accelerator.unwrap_model)
    assert p_gen.global_steps == 3 and p_disc.global_steps == 3  # each stepped at its own optimizer.step()

    ref_gen, ref_disc = reference
    ref_opt, ref_d_opt = _optimizers(ref_gen, ref_disc)
    ref_losses = _train(ref_gen, ref_disc, ref_opt, ref_d_opt, batches, lambda loss: loss.backward(), lambda m: m)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    after = {"g": _master(generator), "d": _master(discriminator)}
    for key, model in (("g", ref_gen), ("d", ref_disc)):
        for name, param in model.named_parameters():
            torch.testing.assert_close(after[key][name], param.detach(), msg=f"{key}.{name}")
            assert not torch.equal(after[key][name], initial[key][name]), f"{key}.{name} did not train"

    # one DeepSpeed checkpoint per engine; load_state puts both back
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.wait_for_everyone()  # written in the background (a launched rank's default): on disk from here
    states = sorted(p.parent.name for p in (tmp_path / "ckpt").rglob("*mp_rank_00_model_states.pt"))
    assert states == ["pytorch_model", "pytorch_model_1"], states
    _train(p_gen, p_disc, p_opt, p_d_opt, batches[:2], accelerator.backward, accelerator.unwrap_model)
    assert not torch.equal(_master(generator)[next(iter(after["g"]))], next(iter(after["g"].values())))
    accelerator.load_state(str(tmp_path / "ckpt"))
    for key, model in (("g", generator), ("d", discriminator)):
        for name, value in _master(model).items():
            assert torch.equal(value, after[key][name]), f"{key}.{name}"


def test_models_whose_optimizers_mix_them_keep_accelerates_assertion(accelerator_factory):
    """An optimizer over parts of two models is neither one engine's (two optimizers) nor one engine per model."""
    import torch

    accelerator = accelerator_factory(2)
    generator, discriminator = _models()
    mixed = torch.optim.SGD(list(generator.parameters()) + list(discriminator[0].parameters()), lr=0.1)
    rest = torch.optim.SGD(list(discriminator[2].parameters()), lr=0.1)
    with pytest.raises(
        AssertionError, match=STOCK + r".*no optimizer holds exactly the trainable parameters of model 0"
    ):
        accelerator.prepare(generator, discriminator, mixed, rest)
    assert accelerator._models == []


def test_autograd_grad_through_an_engine_is_not_its_backward(accelerator_factory):
    """The generator step's two ``torch.autograd.grad`` (train_vqgan.py's adaptive weight) run through both engines'
    outputs before the backward. Without the output-hook patch DeepSpeed takes them for backwards: the step stops."""
    import torch

    from accel_npu.plugins.deepspeed import ENGINE_OUTPUT_BACKWARD_HOOK
    from tests.inprocess import without

    accelerator = accelerator_factory(2)
    generator, discriminator = _models()
    opt, d_opt = _optimizers(generator, discriminator)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    p_gen, p_disc, p_opt, p_d_opt = accelerator.prepare(generator, discriminator, opt, d_opt)
    before = _master(generator)
    batches = _batches()
    with without(ENGINE_OUTPUT_BACKWARD_HOOK):
        with pytest.raises((IndexError, KeyError)):
            _train(p_gen, p_disc, p_opt, p_d_opt, batches[:1], accelerator.backward, accelerator.unwrap_model)
    assert all(torch.equal(v, before[k]) for k, v in _master(generator).items())  # no step was taken


def test_a_bf16_engine_runs_a_spectral_normed_model_on_fp32_inputs_as_ddp_does(accelerator_factory):
    """train_vqgan.py's discriminator is spectral-normed and gets fp32 images. DeepSpeed 0.19.2 casts the weights to
    bf16 and keeps spectral norm's u/v fp32: its first forward stops ("addmv input tensors must have the same dtype").
    With accel-npu u/v take the weights' dtype, the forward runs under autocast and returns fp32, as accelerate's
    mixed precision returns it under DDP (the script hands the VQModel's output to an fp32 timm model)."""
    import torch

    from accel_npu.plugins.deepspeed import ZERO3_PARAM_DTYPE
    from tests.inprocess import without

    accelerator = accelerator_factory(2, bf16=True)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    _generator, discriminator = _models()
    stock_model = copy.deepcopy(discriminator)
    optimizer = torch.optim.AdamW(discriminator.parameters(), lr=1e-3)
    engine, _ = accelerator.prepare(discriminator, optimizer)
    norm = engine.module[0]
    assert norm.weight_orig.dtype == norm.weight_u.dtype == norm.weight_v.dtype == torch.bfloat16
    out = engine(torch.randn(4, 6))
    assert out.dtype == torch.float32
    accelerator.backward(out.mean())  # the engine steps (accelerate's own engine wrapper: one model)
    assert engine.global_steps == 1

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    stock_accelerator = accelerator_factory(2, bf16=True)
    stock_accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    with without(ZERO3_PARAM_DTYPE):
        stock_engine, _ = stock_accelerator.prepare(stock_model, torch.optim.AdamW(stock_model.parameters(), lr=1e-3))
    assert stock_engine.module[0].weight_u.dtype == torch.float32
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        stock_engine(torch.randn(4, 6))


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_grad_after_a_backward_discards_what_it_accumulated(accelerator_factory, stage):
    """``optimizer.zero_grad()`` between a backward and the step, as under DDP: the gradients DeepSpeed accumulated for
    that engine are dropped (the step then has nothing to apply, as torch.optim skips a parameter whose .grad is
    None), and the next backward's gradient alone is stepped: the weights equal those of a run that never took the
    dropped backward."""
    import torch

    accelerator = accelerator_factory(stage)
    generator, discriminator = _models()
    reference = copy.deepcopy(generator)
    opt, d_opt = _optimizers(generator, discriminator)
    accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    p_gen, p_disc, p_opt, p_d_opt = accelerator.prepare(generator, discriminator, opt, d_opt)
    x, y = _batches()[:2]
    before = _master(generator)
    p_opt.zero_grad()
    accelerator.backward(p_gen(x).pow(2).mean())
    p_opt.zero_grad()  # drops it
    p_opt.step()
    assert all(torch.equal(v, before[k]) for k, v in _master(generator).items())
    assert p_gen.global_steps == 0
    accelerator.backward(p_gen(y).pow(2).mean())
    p_opt.step()
    ref_opt = torch.optim.AdamW(list(reference.parameters()), lr=1e-2)
    reference(y).pow(2).mean().backward()
    ref_opt.step()
    after = _master(generator)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(after[name], param.detach(), msg=name)
        assert not torch.equal(after[name], before[name]), name

"""Two official diffusers scripts (v0.40.0, vendored in third_party/) that accelerate refuses under DeepSpeed,
unchanged, on 2 CPU ranks, as tools/compatibility.py runs them (its tiny models, flags and configs), a few steps.

- custom_diffusion/train_custom_diffusion.py ``--modifier_token`` prepares the custom-diffusion layers and the text
  encoder with one optimizer (one engine, plugins/deepspeed/models_together.py) and zeroes the embedding gradient of
  every token but its new one between ``accelerator.backward`` and ``optimizer.step()`` (lines 1192-1205). Under ZeRO-3
  that parameter is a shape-[0] partition: its whole gradient is shown as ``param.grad`` there and written back
  (plugins/deepspeed/shown_gradients.py), and its final rank-0 save of the processors and the new token's row is
  gathered (plugins/checkpoints). Launched under ZeRO-2 and ZeRO-3 (``zero3_t0``: every parameter partitioned) side
  by side, same seed.
- vqgan/train_vqgan.py prepares a VQModel and its discriminator with two optimizers: one engine each
  (plugins/deepspeed/engine_per_model.py), the generator's loss through the discriminator, ``torch.autograd.grad`` on
  the decoder's last weight; launched under ZeRO-3 (ZeRO-2 and the step-by-step comparison with a run without
  DeepSpeed: tests/test_deepspeed_engine_per_model.py, in-process).

Witnesses: DeepSpeed's own fp32 master weights (``zero_to_fp32``) of the checkpoint each run writes, against the
initial weights in the tiny model folder and against each other; the saved artifacts opened with safetensors /
``from_pretrained``. Stock refuses both ``prepare`` calls with accelerate's "multiple models" assertion: the in-process
tests show it (``tests.inprocess.stock``); a launch with ``ACCEL_NPU_DISABLE=1`` stops earlier here, at the CUDA build
of torchvision this machine's registry ships ("operator torchvision::nms does not exist").
"""

from __future__ import annotations

import sys

import pytest

from tests.launch_utils import REPO, base_env, run_concurrently, shipped_zero_configs

sys.path.insert(0, str(REPO))

pytestmark = pytest.mark.slow

LR = 1e-3  # tools/compatibility.py's SD flags
WEIGHT_DECAY = 1e-2  # train_custom_diffusion.py's --adam_weight_decay default


def _launch(name: str, config: str, root, steps: int, every: int):
    """One launch of the runner's plan for ``name`` under ``config`` to ``steps`` steps, a checkpoint every ``every``:
    (exit code, output, output folder, the tiny model's folder)."""
    from tests.torchvision_site import with_torchvision
    from tools import compatibility as compat

    spec = next(s for s in compat.SPECS if s.name == name)
    work = root / spec.builder
    compat._build(spec.builder, work)
    (root / config).mkdir()
    cfg = shipped_zero_configs(root / config)[config]
    env = with_torchvision(
        base_env(
            HF_DATASETS_CACHE=str(root / "datasets-cache"), **{k: v.format(work=work) for k, v in spec.env.items()}
        ),
        *spec.site,
    )
    out = root / f"{spec.name}-{config}"
    out.mkdir(parents=True)
    values = dict(work=work, model=work / "model", out=out, steps=steps, every=every, resume_to=steps)
    cli = {**compat.OFFICIAL_CLI, **spec.cli}
    args = [a.format(**values) for a in cli["model"] + spec.data + spec.extra + cli["common"] + cli["first"]]
    run = compat.launch(["--config_file", str(cfg), str(spec.script), *args], env, root, 900)
    return run["code"], run["output"], out, work / "model"


def _master(checkpoint, tag: str | None = None) -> dict:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)


def _equal_or_bf16(saved, master) -> bool:
    import torch

    saved = saved.float()
    return torch.equal(saved, master) or torch.equal(saved, master.to(torch.bfloat16).float())


@pytest.fixture(scope="module")
def custom_diffusion(tmp_path_factory):
    root = tmp_path_factory.mktemp("custom_diffusion")
    # two steps: the tiny dataset's second batch has an empty mask (the script's loss is 0/0, DeepSpeed skips that
    # step on both configs), the first trains
    runs = run_concurrently(
        *(lambda c=c: _launch("train_custom_diffusion.py", c, root, 2, 2) for c in ("zero2", "zero3_t0"))
    )
    return dict(zip(("zero2", "zero3_t0"), runs))


def test_custom_diffusion_under_zero3_trains_the_new_token_alone_as_under_zero2(custom_diffusion):
    import torch
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file
    from transformers import CLIPTokenizer

    masters = {}
    for config, (code, output, out, model) in custom_diffusion.items():
        assert code == 0, f"{config}:\n{output[-6000:]}"
        masters[config] = master = _master(out / "checkpoint-2")
        tokenizer = CLIPTokenizer.from_pretrained(str(model / "tokenizer"))
        text_encoder = load_file(str(model / "text_encoder" / "model.safetensors"))
        (initial,) = [v for k, v in text_encoder.items() if k.endswith("token_embedding.weight")]
        (table,) = [v for k, v in master.items() if k.endswith("token_embedding.weight")]
        vocab, dog = initial.shape[0], tokenizer.convert_tokens_to_ids("dog</w>")
        assert table.shape[0] == vocab + 1  # <new1> appended, initialised from "dog"
        # the script zeroed every other row's gradient before each step: those rows moved by AdamW's weight decay
        # alone (each step scales them by 1 - lr * weight_decay: relative 1e-5), from the model folder's weights as
        # DeepSpeed's bf16 engine holds them; the new token's row moved away from the initializer token's by its
        # gradient (Adam's step: about lr = 1e-3 per element)
        start = initial.to(torch.bfloat16).float()
        decay = (table[:vocab] - start).abs() <= start.abs() * LR * WEIGHT_DECAY * 2 + 1e-9
        assert decay.all(), f"{config}: {int((~decay).sum())} elements of untrained rows moved beyond weight decay"
        assert (table[vocab] - start[dog]).abs().max() > LR / 10, config

        # the final artifacts, saved on rank 0 alone, are whole and hold the master weights
        (embedding,) = load_file(str(out / "<new1>.safetensors")).values()
        assert _equal_or_bf16(embedding, table[vocab]), config
        saved = load_file(str(out / "pytorch_custom_diffusion_weights.safetensors"))
        unet = load_file(str(model / "unet" / "diffusion_pytorch_model.safetensors"))
        # the engine's AttnProcsLayers names the i-th of the UNet's attention processors "layers.<i>" (model 0)
        names = list(UNet2DConditionModel.from_pretrained(str(model / "unet")).attn_processors)
        assert len(saved) == sum("custom_diffusion" in k for k in master) > 0, config
        for key, value in saved.items():
            processor, _, param = key.partition(".processor.")
            assert _equal_or_bf16(value, master[f"0.layers.{names.index(processor + '.processor')}.{param}"]), key
            start = unet[f"{processor}.{param.replace('_custom_diffusion', '')}"]  # the script copies to_k / to_v
            assert value.shape == start.shape and not torch.equal(value.float(), start.float()), key  # trained

    # ZeRO-3 against ZeRO-2, same seed: Adam moves an element by at most about the learning rate per step, and the
    # bf16 sums of the two reduce in other orders, which may turn a near-zero gradient element's sign
    tolerance = 2 * LR * 2
    assert set(masters["zero2"]) == set(masters["zero3_t0"])
    for key, value in masters["zero2"].items():
        worst = (value - masters["zero3_t0"][key]).abs().max().item()
        assert worst <= tolerance, f"{key}: max |Δ| {worst} > {tolerance}"


def test_vqgan_under_zero3_trains_generator_and_discriminator_in_two_engines(tmp_path):
    """Four steps (generator, discriminator, generator, discriminator), a checkpoint after each discriminator step."""
    import torch
    from diffusers import VQModel
    from safetensors.torch import load_file

    code, output, out, model = _launch("train_vqgan.py", "zero3_t0", tmp_path, 4, 2)
    assert code == 0, output[-6000:]
    # one DeepSpeed checkpoint per engine, in the order the script prepared them
    for step in (2, 4):
        assert {p.name for p in (out / f"checkpoint-{step}").glob("pytorch_model*")} == {
            "pytorch_model",
            "pytorch_model_1",
        }
    generator = _master(out / "checkpoint-4", tag="pytorch_model")
    initial = load_file(str(model / "diffusion_pytorch_model.safetensors"))
    assert set(generator) == set(initial)
    kept = [k for k in initial if torch.equal(generator[k], initial[k].float())]
    assert not kept, kept[:5]  # the generator steps reached every tensor, through the adaptive-weighted loss
    before = _master(out / "checkpoint-2", tag="pytorch_model_1")
    discriminator = _master(out / "checkpoint-4", tag="pytorch_model_1")
    kept = [k for k in before if torch.equal(before[k], discriminator[k])]
    assert not kept, kept[:5]  # its second step (the fourth iteration) moved every tensor

    # the final save (rank 0 alone, after wait_for_everyone) as diffusers loads it: the master weights
    sys.path.insert(0, str(REPO / "third_party" / "diffusers-v0.40.0" / "examples" / "vqgan"))
    from discriminator import Discriminator

    loaded = VQModel.from_pretrained(str(out / "vqmodel"))
    for name, param in loaded.named_parameters():
        assert _equal_or_bf16(param.detach(), generator[name]), name
    saved = Discriminator.from_pretrained(str(out / "discriminator"))
    for name, param in saved.named_parameters():
        assert _equal_or_bf16(param.detach(), discriminator[name]), name

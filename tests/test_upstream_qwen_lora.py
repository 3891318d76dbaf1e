"""diffusers' official ``train_dreambooth_lora_qwen_image.py`` (v0.40.0, or v0.35.2 under an older diffusers:
``RELEASE_EXAMPLES``; byte for byte, vendored in ``third_party/``), unchanged, on 2 CPU ranks: train,
checkpoint, resume, final save; text encoders under zero3_init_flag false; ``accel-npu consolidate`` of
the LoRA checkpoint.

A tiny Qwen-Image pipeline from the real classes (QwenImageTransformer2DModel, AutoencoderKLQwenImage,
Qwen2.5-VL text encoder, a byte-level Qwen2Tokenizer written locally, FlowMatchEulerDiscreteScheduler)
and a DreamBooth folder of 4 PNGs. The launch configs are the shipped cpu_zero2 / cpu_zero3 ones with
real ZeRO-3 partitioning (``stage3_param_persistence_threshold: 0``) and ``zero3_init_flag: false``.

Witnesses are DeepSpeed's own reader of the checkpoints (``zero_to_fp32``: the optimizer's fp32
master weights), safetensors files opened here, and diffusers' ``load_lora_weights`` /
``from_pretrained`` -- never accel-npu's log lines.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from tests.launch_utils import (
    RELEASE_EXAMPLES,
    REPO,
    SCRIPTS,
    accelerate_launch,
    base_env,
    explain,
    one_rank_deepspeed_group,
    partitioned,
    release_examples_env,
    restore_torch_linear,
)
from tests.official_scripts import loaded_lora, master_lora
from tests.torchvision_site import with_torchvision

sys.path.insert(0, str(SCRIPTS))

SCRIPT = RELEASE_EXAMPLES / "dreambooth" / "train_dreambooth_lora_qwen_image.py"
PROMPT = "a photo of sks dog"
DOC = REPO / "docs" / "compatibility.md"


def _doc_row(config: str) -> str:
    """docs/compatibility.md's row for this script under ``config`` (its second cell)."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `train_dreambooth_lora_qwen_image.py`")]
    found = [row for row in rows if row.strip("|").split("|")[1].strip() == config]
    assert len(found) == 1, rows
    return found[0]


@pytest.fixture(scope="module")
def qwen_pipe(tmp_path_factory):
    """(pipeline folder, DreamBooth image folder)."""
    import tiny_models as tm

    root = tmp_path_factory.mktemp("qwen_lora")
    tm.qwen_image_pipeline(str(root / "pipe"))
    tm.dreambooth_images(str(root / "images"))
    return root / "pipe", root / "images"


# ------------------------------------------------------------------------------------------------
# zero3_init_flag false, in-process: it builds whole; partitioned towers keep the script's casts
# ------------------------------------------------------------------------------------------------
@pytest.fixture()
def one_rank_group(monkeypatch):
    """A 1-rank gloo group as `accelerate launch` gives one (deepspeed.zero.Init needs LOCAL_RANK)."""
    with one_rank_deepspeed_group(monkeypatch):
        yield


def _zero3_plugin(flag: bool):
    """accelerate's DeepSpeedPlugin for a ZeRO-3 config, selected as AcceleratorState selects it."""
    from accelerate.utils import DeepSpeedPlugin

    config = {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=flag)
    plugin.set_deepspeed_weakref()  # what DeepSpeedPlugin.select() does
    return plugin


def _load_like_the_script(pipe):
    """The script's loads and casts: text encoder in weight_dtype, VAE as saved, then
    requires_grad_(False) and .to(dtype=bf16) on both (train_dreambooth_lora_qwen_image.py l.1214-1259)."""
    import torch
    from diffusers import AutoencoderKLQwenImage
    from transformers import Qwen2_5_VLForConditionalGeneration

    vae = AutoencoderKLQwenImage.from_pretrained(str(pipe), subfolder="vae")
    te = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(pipe), subfolder="text_encoder", torch_dtype=torch.bfloat16
    )
    built_partitioned = {"vae": partitioned(vae), "text_encoder": partitioned(te)}
    restore_torch_linear()
    for m in (vae, te):
        m.requires_grad_(False)
        m.to(dtype=torch.bfloat16)
    return vae, te, built_partitioned


def _run(vae, te):
    import torch

    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(1, 3, 1, 16, 16, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[5, 70, 80, 90, 100, 3]])
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
        hidden = te(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-1]
    return latents, hidden


def test_zero3_init_flag_false_builds_whole_and_partitioned_towers_keep_the_scripts_casts(qwen_pipe, one_rank_group):
    import torch

    from tests.inprocess import stock

    pipe, _images = qwen_pipe
    ref = _run(*_load_like_the_script(pipe)[:2])  # reference: the same loads and casts without DeepSpeed
    assert ref[0].dtype == ref[1].dtype == torch.bfloat16

    # stock, zero3_init_flag false: accelerate still hands transformers its ZeRO-3 config, so the text
    # encoder is built partitioned and its first call outside the engine fails (docs/compatibility.md's table)
    with stock():
        keep = _zero3_plugin(False)
        vae, te, built = _load_like_the_script(pipe)
        assert built == {"vae": False, "text_encoder": True}
        with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
            _run(vae, te)
        del keep

    # accel-npu, flag false: every model built whole, as the config asks
    keep = _zero3_plugin(False)
    vae, te, built = _load_like_the_script(pipe)
    assert built == {"vae": False, "text_encoder": False}
    for got, want in zip(_run(vae, te), ref):
        assert got.dtype == want.dtype and torch.equal(got, want)
    del keep

    # accel-npu, flag true: built in partitions (zero.Init, as asked); called outside the engine they are
    # made whole with the script's .to(bfloat16) and requires_grad_(False) kept (stock diffusers never
    # partitions the VAE: `Input type (BFloat16) and bias type (float)` was ours alone)
    keep = _zero3_plugin(True)
    vae, te, built = _load_like_the_script(pipe)
    assert built == {"vae": True, "text_encoder": True}
    vae.eval()
    for got, want in zip(_run(vae, te), ref):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for m in (vae, te):
        assert not partitioned(m)
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
        assert not any(p.requires_grad for p in m.parameters())
    assert not vae.training
    del keep


# ------------------------------------------------------------------------------------------------
# launched: train, checkpoint, resume latest, final save (under ZeRO-3 with zero3_init_flag false)
# ------------------------------------------------------------------------------------------------
def _config(tmp, stage: int) -> str:
    """The shipped cpu_zero{stage} config, with real ZeRO-3 partitioning and zero3_init_flag: false."""
    ds = json.loads((REPO / "launch_configs" / f"cpu_zero{stage}.deepspeed.json").read_text())
    if stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg = yaml.safe_load((REPO / "launch_configs" / f"cpu_zero{stage}.yaml").read_text())
    (tmp / "ds.json").write_text(json.dumps(ds))
    cfg["deepspeed_config"] = {"deepspeed_config_file": str(tmp / "ds.json"), "zero3_init_flag": False}
    (tmp / "accelerate.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp / "accelerate.yaml")


def _train(config, pipe, images, out, steps: int, *extra: str):
    args = [
        "--config_file",
        config,
        str(SCRIPT),
        "--pretrained_model_name_or_path",
        str(pipe),
        "--instance_data_dir",
        str(images),
        "--instance_prompt",
        PROMPT,
        "--output_dir",
        str(out),
        "--resolution",
        "16",
        "--train_batch_size",
        "1",
        "--max_train_steps",
        str(steps),
        "--checkpointing_steps",
        "2",
        "--rank",
        "4",
        "--lora_alpha",
        "8",
        "--max_sequence_length",
        "16",
        "--seed",
        "0",
        "--learning_rate",
        "1e-2",
        "--skip_final_inference",
        *extra,
    ]
    # the script imports torchvision.transforms: the paired wheel, on PYTHONPATH only (tests/torchvision_site.py)
    return accelerate_launch(args, env=with_torchvision(release_examples_env(base_env())), timeout=400, cwd=out.parent)


def _loaded_lora(pipe, lora_dir) -> dict:
    from diffusers import QwenImagePipeline

    return loaded_lora(QwenImagePipeline, pipe, lora_dir)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_qwen_lora_trains_checkpoints_resumes_and_saves_a_lora_that_loads(qwen_pipe, tmp_path, stage, capfd):
    import torch
    from safetensors import safe_open

    pipe, images = qwen_pipe
    config = _config(tmp_path, stage)
    out = tmp_path / "out"
    out.mkdir()
    first = _train(config, pipe, images, out, 4)
    assert first.returncode == 0, explain(first)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-4"]
    at4 = master_lora(out / "checkpoint-4")
    second = _train(config, pipe, images, out, 6, "--resume_from_checkpoint", "latest")
    assert second.returncode == 0, explain(second)
    assert "Resuming from checkpoint checkpoint-4" in second.stdout + second.stderr  # the script's own print
    # resumed at step 4: only checkpoint-6 is new (a fresh start would have rewritten checkpoint-2)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    assert master_lora(out / "checkpoint-4").keys() == at4.keys()
    final = master_lora(out / "checkpoint-6")
    assert len(final) == 16 and any(not torch.equal(final[k], at4[k]) for k in final)  # steps 5-6 trained

    # the final LoRA file: every tensor whole, equal to the trained master weights (saved in bf16)
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), framework="pt") as f:
        saved = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    assert saved.keys() == final.keys()
    for k, v in saved.items():
        assert v.shape == final[k].shape and torch.equal(v, final[k].to(v.dtype)), k
    # and diffusers' load_lora_weights gives exactly those tensors
    loaded = _loaded_lora(pipe, out)
    assert loaded.keys() == saved.keys()
    for k, v in loaded.items():
        assert torch.equal(v, saved[k].to(v.dtype)), k
    row = _doc_row({2: "cpu_zero2 / npu_zero2", 3: "ZeRO-3, threshold 0, `zero3_init_flag: false`"}[stage])
    assert "trains, checkpoints, resumes from `latest`; the final LoRA loads" in row
    if stage == 3:  # consolidate the same checkpoint (every parameter partitioned: the hardest case)
        _check_consolidate(pipe, out / "checkpoint-6", final, tmp_path, capfd)


# ------------------------------------------------------------------------------------------------
# accel-npu consolidate of the LoRA checkpoint
# ------------------------------------------------------------------------------------------------
def _check_consolidate(pipe, ckpt, master, tmp_path, capfd):
    """``accel-npu consolidate`` with a user's arguments (its entry point, in this process): the adapter loads
    with load_lora_weights and equals DeepSpeed's master weights; ``--merge-lora``'s model loads with
    from_pretrained and equals base + alpha/r * B @ A computed here."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from safetensors import safe_open
    from safetensors.torch import load_file

    from accel_npu.cli import main

    # the command's own entry point, in this process (as tests/test_checkpoints_dit4dit.py runs it): deepspeed and
    # diffusers are imported once here, not once per call
    for args in ([str(ckpt), str(tmp_path / "adapter")], [str(ckpt), str(tmp_path / "merged"), "--merge-lora"]):
        capfd.readouterr()
        rc = main(["consolidate", *args, "--no-progress"])
        out, err = capfd.readouterr()
        assert rc == 0, out + err

    adapter = tmp_path / "adapter"
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.") and ".base_layer." not in k and ".default." not in k for k in keys)
    loaded = _loaded_lora(pipe, adapter)
    assert loaded.keys() == master.keys()
    for k, v in loaded.items():
        assert torch.equal(v, master[k]), k

    merged = QwenImageTransformer2DModel.from_pretrained(str(tmp_path / "merged" / "merged"))
    base = load_file(str(pipe / "transformer" / "diffusion_pytorch_model.safetensors"))
    got = merged.state_dict()
    assert got.keys() == base.keys()
    scale = 8 / 4  # lora_alpha / r
    merged_count = 0
    for k, w in base.items():
        want = w.to(torch.bfloat16).float()  # the script trains with the base cast to weight_dtype (bf16)
        module = k.removesuffix(".weight")
        if f"{module}.lora_A.weight" in master:
            want = want + scale * (master[f"{module}.lora_B.weight"] @ master[f"{module}.lora_A.weight"])
            merged_count += 1
        assert torch.allclose(got[k], want, rtol=0, atol=1e-6), k
    assert merged_count == 8

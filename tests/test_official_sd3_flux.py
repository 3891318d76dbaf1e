"""diffusers v0.40.0's ``train_dreambooth_lora_sd3.py`` and ``train_dreambooth_lora_flux.py``, run
UNCHANGED from the vendored copies (third_party/; ``$DIFFUSERS_EXAMPLES_DIR`` overrides) on 2 CPU ranks.

Tiny pipelines from the real classes (tests/scripts/tiny_sd3_flux.py), 4 DreamBooth PNGs, the shipped
cpu_zero2 config and cpu_zero3 with ``stage3_param_persistence_threshold: 0`` (zero3_init_flag true, as
shipped), built as tests/test_upstream_text_to_image.py builds them.

The two in-process tests run always (~40 s together, most of it importing DeepSpeed); the launched ones
run with ``RUN_OFFICIAL_MATRIX=1`` only (CI runs one official script per shape; these are the matrix's): SD3 5 launches
(both configs train + resume, the stock
ZeRO-3 launch), Flux 7 (unchanged: misuse, final save, stock; with the one-line fix: both configs train +
resume, the stock hook failure), up to 3 at a time. The whole file took 24.6 min on the 2-core machine
under a load average of ~11 (other helpers' launches): SD3 7.0 min + 6.3 min building the tiny pipelines
and torchvision's site, Flux 8.8 min. Witnesses: DeepSpeed's own zero_to_fp32 reading of the checkpoints, safetensors
files opened
here, diffusers' ``load_lora_weights`` -- never accel-npu's log lines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.launch_utils import (
    OFFICIAL_EXAMPLES,
    OFFICIAL_MATRIX,
    OFFICIAL_MATRIX_REASON,
    SCRIPTS,
    free_port,
    shipped_zero_configs,
)
from tests.official_scripts import StreamedLaunch, fixed_copy, line_of, loaded_lora, lora_file, master_lora

sys.path.insert(0, str(SCRIPTS))

EXAMPLES = str(OFFICIAL_EXAMPLES)


def needs_examples(test):
    """The launched tests: part of the official matrix, not of CI's subset (24.6 min here, see above)."""
    return pytest.mark.official_matrix(pytest.mark.skipif(not OFFICIAL_MATRIX, reason=OFFICIAL_MATRIX_REASON)(test))


# ------------------------------------------------------------------------------------------------
# in-process: a CLIP text encoder built in ZeRO-3 partitions and called outside the engine
# ------------------------------------------------------------------------------------------------
# one_rank_zero3: tests/conftest.py
def test_partitioned_clip_text_encoder_is_made_whole_before_its_embeddings_read_a_shape(tmp_path, one_rank_zero3):
    """SD3/Flux scripts load CLIP with ``from_pretrained`` under ZeRO-3 (no disabled-init context), cast it
    and call it outside the engine. CLIPTextEmbeddings.forward reads ``position_embedding.weight.shape[0]``
    before any module holding parameters runs: stock fails with ``max_position_embeddings: 0``; accel-npu
    makes the encoder whole first (its hooks sit on every submodule) and keeps the script's bf16 cast."""
    import tiny_sd3_flux
    import torch
    from transformers import CLIPTextModelWithProjection
    from transformers.integrations import is_deepspeed_zero3_enabled

    from tests.inprocess import stock

    ids = torch.tensor([[0, 5, 6, 7] + [1] * 73])  # the scripts' max_length=77
    import transformers.integrations.deepspeed as tds

    # the reference: the same files, loaded whole (transformers' ZeRO-3 switch off for the duration)
    saved_ref = tds._hf_deepspeed_config_weak_ref
    tds._hf_deepspeed_config_weak_ref = None
    try:
        tiny_sd3_flux._encoders(str(tmp_path), [CLIPTextModelWithProjection])["text_encoder"].save_pretrained(
            str(tmp_path / "text_encoder")
        )
        ref = CLIPTextModelWithProjection.from_pretrained(str(tmp_path / "text_encoder")).to(dtype=torch.bfloat16)
        with torch.no_grad():
            want = ref(ids, output_hidden_states=True).hidden_states[-2]
    finally:
        tds._hf_deepspeed_config_weak_ref = saved_ref
    assert is_deepspeed_zero3_enabled()

    def load_like_the_script():
        te = CLIPTextModelWithProjection.from_pretrained(
            str(tmp_path), subfolder="text_encoder", revision=None, variant=None
        )
        built_partitioned = any(hasattr(p, "ds_id") for p in te.parameters())
        te.requires_grad_(False)
        te.to("cpu", dtype=torch.bfloat16)  # train_dreambooth_lora_sd3.py l.1239
        return te, built_partitioned

    with stock():
        te, partitioned = load_like_the_script()
        assert partitioned
        with pytest.raises(ValueError, match="max_position_embeddings: 0"), torch.no_grad():
            te(ids, output_hidden_states=True)

    te, partitioned = load_like_the_script()
    assert partitioned
    with torch.no_grad():
        got = te(ids, output_hidden_states=True).hidden_states[-2]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not any(hasattr(p, "ds_id") or p.requires_grad for p in te.parameters())


def test_partitioned_model_with_a_lora_adapter_added_since_loading_is_rebuilt_whole(tmp_path, one_rank_zero3):
    """SD3's load_model_hook under DeepSpeed: ``SD3Transformer2DModel.from_pretrained`` (accel-npu loads it
    into ZeRO-3 partitions), ``add_adapter``, then peft reads its state_dict outside any engine. The rebuild
    from the files must find ``x.base_layer.weight`` under ``x.weight`` (was: KeyError)."""
    import torch
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig
    from safetensors.torch import load_file

    from accel_npu._torch import markers

    torch.manual_seed(0)
    SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_projection_dim=16,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        out_channels=4,
    ).save_pretrained(str(tmp_path / "transformer"))
    model = SD3Transformer2DModel.from_pretrained(str(tmp_path), subfolder="transformer")
    assert any(hasattr(p, "ds_id") for p in model.parameters())  # loaded into partitions
    model.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            init_lora_weights="gaussian",
            target_modules=["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0"],
        )
    )
    getattr(model, markers.REBUILD)()  # what its first use outside an engine does
    files = load_file(str(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"))
    state = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}
    assert state.keys() == files.keys()
    for k, v in files.items():
        assert torch.equal(state[k], v), k
    assert not any(hasattr(p, "ds_id") for p in model.parameters())
    assert sum(".lora_" in k for k, _ in model.named_parameters()) == 8  # the adapter kept (4 layers, A and B)


# ------------------------------------------------------------------------------------------------
# launched: the scripts unchanged, vendored: train, checkpoint, resume, save; RUN_OFFICIAL_MATRIX=1 only
# ------------------------------------------------------------------------------------------------
PROMPT = "a photo of sks dog"
STOCK_LOADS = ",".join(
    [
        "transformers.modeling_utils:PreTrainedModel.from_pretrained",
        "diffusers.models.modeling_utils:ModelMixin.from_pretrained",
    ]
)
STOCK_HOOKS = "accelerate.accelerator:Accelerator.save_state,accelerate.accelerator:Accelerator.load_state"
MISUSE_TIMEOUT_S = 15


def _script(family: str) -> Path:
    return Path(EXAMPLES) / "dreambooth" / f"train_dreambooth_lora_{family}.py"


class Launch(StreamedLaunch):
    """One ``accelerate launch`` of a DreamBooth LoRA script, started now; ``wait()`` collects it."""

    def __init__(self, cfg, script, pipe, images, out, steps, env, *extra):
        from tests.launch_utils import BIN

        args = [
            str(BIN / "accelerate"),
            "launch",
            "--main_process_port",
            str(free_port()),
            "--config_file",
            str(cfg),
            str(script),
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
            "--rank",
            "4",
            "--max_sequence_length",
            "16",
            "--seed",
            "0",
            "--learning_rate",
            "1e-2",
            "--dataloader_num_workers",
            "0",
            *extra,
        ]
        super().__init__(args, env, Path(out).parent, steps, Path(out))


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) if out.exists() else []


def _loaded_lora(family: str, pipe: Path, lora_dir: Path) -> dict:
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    return loaded_lora({"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[family], pipe, lora_dir)


def _assert_final_lora_is(family, pipe, out, master):
    """The final LoRA file holds every trained tensor whole, equal to ``master`` (in the file's bf16),
    and diffusers' load_lora_weights gives exactly those tensors."""
    import torch

    saved = lora_file(out)
    assert saved.keys() == master.keys() and len(saved) > 0
    for k, v in saved.items():
        assert v.shape == master[k].shape and torch.equal(v, master[k].to(v.dtype)), k
    loaded = _loaded_lora(family, pipe, out)
    assert loaded.keys() == saved.keys()
    for k, v in loaded.items():
        assert torch.equal(v, saved[k].to(v.dtype)), k
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in saved.items())  # trained (B starts at 0)
    return saved


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    import subprocess

    from tests.launch_utils import base_env
    from tests.torchvision_site import with_torchvision

    root = tmp_path_factory.mktemp("sd3_flux")
    for family in ("sd3", "flux"):
        subprocess.run(
            [sys.executable, str(SCRIPTS / "tiny_sd3_flux.py"), family, str(root / family), str(root / "images")],
            check=True,
            capture_output=True,
            timeout=300,
            env=base_env(),
        )
    # the scripts import torchvision.transforms: the paired wheel, on PYTHONPATH only (tests/torchvision_site.py)
    return root, shipped_zero_configs(root), with_torchvision(base_env())


@needs_examples
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sd3_dreambooth_lora_unchanged_trains_checkpoints_resumes_and_saves_a_lora_that_loads(work):
    """Both configs: train 4 steps (checkpoints 2, 4), resume ``latest`` to 6, final LoRA == DeepSpeed's
    master weights of checkpoint-6 and loads with load_lora_weights. Stock under ZeRO-3: the frozen CLIP
    text encoders are built partitioned and the first call fails (docs/compatibility.md's table)."""
    import torch

    root, cfg, env = work
    script = _script("sd3")
    pipe, images = root / "sd3", root / "images"
    outs = {c: root / f"sd3_{c}" for c in cfg}
    for o in outs.values():
        o.mkdir()
    stock_out = root / "sd3_stock_zero3_t0"
    stock_out.mkdir()
    first = {c: Launch(cfg[c], script, pipe, images, outs[c], 4, env, "--checkpointing_steps", "2") for c in cfg}
    stock = Launch(
        cfg["zero3_t0"],
        script,
        pipe,
        images,
        stock_out,
        4,
        dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_LOADS),
        "--checkpointing_steps",
        "2",
    )
    for run in (*first.values(), stock):
        run.wait()
    assert stock.returncode != 0 and "max_position_embeddings: 0" in stock.output, stock.explain()
    assert _checkpoints(stock_out) == []
    at4 = {}
    for c, run in first.items():
        assert run.returncode == 0, run.explain()
        assert _checkpoints(outs[c]) == ["checkpoint-2", "checkpoint-4"], c
        at4[c] = master_lora(outs[c] / "checkpoint-4")
        _assert_final_lora_is("sd3", pipe, outs[c], at4[c])
    second = {
        c: Launch(
            cfg[c],
            script,
            pipe,
            images,
            outs[c],
            6,
            env,
            "--checkpointing_steps",
            "2",
            "--resume_from_checkpoint",
            "latest",
        )
        for c in cfg
    }
    for c, run in second.items():
        run.wait()
        assert run.returncode == 0, run.explain()
        assert "Resuming from checkpoint checkpoint-4" in run.output  # the script's own print
        assert _checkpoints(outs[c]) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], c
        final = master_lora(outs[c] / "checkpoint-6")
        assert final.keys() == at4[c].keys() and any(not torch.equal(final[k], at4[c][k]) for k in final)
        _assert_final_lora_is("sd3", pipe, outs[c], final)
    _check_doc_rows("train_dreambooth_lora_sd3.py")


@needs_examples
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_flux_dreambooth_lora_unchanged_and_with_the_one_line_fix(work):
    """Unchanged: ``accelerator.save_state`` inside ``if accelerator.is_main_process:`` (line 1866/1889)
    fails on every rank with the line and the fix, nothing written (ZeRO-2); stock under ZeRO-3 fails at
    the frozen CLIP text encoder (built partitioned); with checkpointing off the
    ZeRO-3 (threshold 0) final LoRA is whole, loads, and equals the one-line-fixed run's checkpoint-4
    master weights (same seed, same steps). With the fix, both configs: checkpoints, resume from
    ``latest``, final LoRA == checkpoint-6's master weights, loads with load_lora_weights."""
    import torch

    root, cfg, env = work
    script = _script("flux")
    pipe, images = root / "flux", root / "images"
    fixed = fixed_copy(_script("flux"), root, "train_dreambooth_lora_flux_fixed.py")
    misuse_out, plain_out = root / "flux_misuse_zero2", root / "flux_plain_zero3_t0"
    outs = {c: root / f"flux_fixed_{c}" for c in cfg}
    for o in (misuse_out, plain_out, *outs.values()):
        o.mkdir()
    quick = dict(env, ACCEL_NPU_COLLECTIVE_TIMEOUT=str(MISUSE_TIMEOUT_S))
    stock_out = root / "flux_stock_zero3_t0"
    stock_out.mkdir()
    misuse = Launch(cfg["zero2"], script, pipe, images, misuse_out, 4, quick, "--checkpointing_steps", "2")
    plain = Launch(cfg["zero3_t0"], script, pipe, images, plain_out, 4, env, "--checkpointing_steps", "100")
    stock = Launch(
        cfg["zero3_t0"],
        script,
        pipe,
        images,
        stock_out,
        4,
        dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_LOADS),
        "--checkpointing_steps",
        "100",
    )
    for run in (misuse, plain, stock):
        run.wait()
    # stock: the frozen CLIP text encoder is built in partitions and fails at its first call
    assert stock.returncode != 0 and "max_position_embeddings: 0" in stock.output, stock.explain()
    assert not (stock_out / "pytorch_lora_weights.safetensors").exists()
    save_line = line_of(script, "accelerator.save_state(save_path)")
    guard_line = line_of(script, "if global_step % args.checkpointing_steps == 0:") - 1
    assert misuse.returncode != 0, misuse.explain()
    assert "CollectiveMisuseError" in misuse.output and f"train_dreambooth_lora_flux.py:{save_line}" in misuse.output
    assert f"(line {guard_line})" in misuse.output
    assert (
        "if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:" in misuse.output
    )
    assert _checkpoints(misuse_out) == [] and not any(misuse_out.iterdir()), list(misuse_out.iterdir())
    assert plain.returncode == 0, plain.explain()

    fixed_stock_out = root / "flux_fixed_stock_zero2"
    fixed_stock_out.mkdir()
    first = {c: Launch(cfg[c], fixed, pipe, images, outs[c], 4, env, "--checkpointing_steps", "2") for c in cfg}
    # stock, with the fix: accelerate hands the save hook DeepSpeed's engine, which is no
    # FluxTransformer2DModel, so it falls through to `text_encoder_one` (deleted once the prompts were encoded)
    fixed_stock = Launch(
        cfg["zero2"],
        fixed,
        pipe,
        images,
        fixed_stock_out,
        4,
        dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_HOOKS),
        "--checkpointing_steps",
        "2",
    )
    fixed_stock.wait()
    assert fixed_stock.returncode != 0 and "in save_model_hook" in fixed_stock.output, fixed_stock.explain()
    assert "NameError: cannot access free variable 'text_encoder_one'" in fixed_stock.output
    assert not (fixed_stock_out / "checkpoint-2" / "pytorch_lora_weights.safetensors").exists()
    for c, run in first.items():
        run.wait()
        assert run.returncode == 0, run.explain()
        assert _checkpoints(outs[c]) == ["checkpoint-2", "checkpoint-4"], c
    at4 = {c: master_lora(outs[c] / "checkpoint-4") for c in cfg}
    _assert_final_lora_is("flux", pipe, plain_out, at4["zero3_t0"])  # the unchanged script's final save
    second = {
        c: Launch(
            cfg[c],
            fixed,
            pipe,
            images,
            outs[c],
            6,
            env,
            "--checkpointing_steps",
            "2",
            "--resume_from_checkpoint",
            "latest",
        )
        for c in cfg
    }
    for c, run in second.items():
        run.wait()
        assert run.returncode == 0, run.explain()
        assert "Resuming from checkpoint checkpoint-4" in run.output
        assert _checkpoints(outs[c]) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"], c
        final = master_lora(outs[c] / "checkpoint-6")
        assert any(not torch.equal(final[k], at4[c][k]) for k in final)
        _assert_final_lora_is("flux", pipe, outs[c], final)
    _check_doc_rows("train_dreambooth_lora_flux.py")


def _check_doc_rows(script_name: str) -> None:
    """docs/compatibility.md has this script's rows in the further-official-scripts table, naming this test."""
    from tests.launch_utils import REPO

    text = (REPO / "docs" / "compatibility.md").read_text()
    section = text.split("## Further official scripts", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith(f"| `{script_name}`")]
    assert len(rows) >= 2 and all("test_official_sd3_flux.py" in r for r in rows), rows

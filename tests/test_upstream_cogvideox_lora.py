"""diffusers' official CogVideoX LoRA scripts (v0.40.0, or v0.35.2 under an older diffusers:
``RELEASE_EXAMPLES``; byte for byte, vendored in ``third_party/``), unchanged, on 2 CPU ranks under the
shipped bf16 ``cpu_zero2`` config (CI's "video DiT LoRA" row).

Both scripts pick ``weight_dtype = torch.float16`` when the DeepSpeed config enables bf16
(train_cogvideox_lora.py l.1090-1100) and run their frozen T5 and VAE in it, while DeepSpeed casts the
transformer to bf16: the fp16 latents and prompt embeddings stop the first forward. accel-npu casts
inputs of the other half dtype at the engine's boundary (plugins/deepspeed/input_dtype.py).

Tiny pipelines from the real classes (tests/scripts/tiny_cogvideox.py; configs of diffusers' own
pipeline tests), four 9-frame AVIs decord reads. One module fixture launches, side by side: the two stock
runs (this patch disabled, ``ACCEL_NPU_DISABLED_PATCHES``: with ACCEL_NPU_DISABLE=1 on CPU
no 2-rank group forms), accel-npu's text-to-video and image-to-video runs to step 4 (checkpoints 2, 4);
then both resume from ``latest`` to step 6. Witnesses: DeepSpeed's own zero_to_fp32 reading of the
checkpoints, safetensors files opened here, diffusers' ``load_lora_weights``.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.launch_utils import (
    RELEASE_EXAMPLES,
    REPO,
    SCRIPTS,
    accelerate_launch,
    base_env,
    ended_by_launcher,
    explain,
    release_examples_env,
    run_concurrently,
)
from tests.official_scripts import loaded_lora, lora_file, master_lora
from tests.torchvision_site import with_torchvision

sys.path.insert(0, str(SCRIPTS))

CONFIG = REPO / "launch_configs" / "cpu_zero2.yaml"
SCRIPTS_BY_KIND = {
    "t2v": RELEASE_EXAMPLES / "cogvideo" / "train_cogvideox_lora.py",
    "i2v": RELEASE_EXAMPLES / "cogvideo" / "train_cogvideox_image_to_video_lora.py",
}
PATCH = "deepspeed.runtime.engine:DeepSpeedEngine.forward"
DOC = REPO / "docs" / "compatibility.md"


# ------------------------------------------------------------------------------------------------
# in-process: the cast at the engine's boundary
# ------------------------------------------------------------------------------------------------
@pytest.fixture()
def one_rank_group(monkeypatch):
    import importlib

    import deepspeed.utils.groups

    from tests.launch_utils import one_rank_deepspeed_group

    with one_rank_deepspeed_group(monkeypatch):
        # DeepSpeed caches its groups per process: those of an earlier test's (destroyed) group are stale
        importlib.reload(deepspeed.utils.groups)
        yield


def _engine(bf16: bool):
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def test_a_half_precision_engine_casts_inputs_of_the_other_half_dtype_only(one_rank_group, caplog):
    import torch

    from tests.inprocess import stock

    x = torch.randn(2, 4)
    engine = _engine(bf16=True)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    want = engine.module(x.to(torch.bfloat16))
    with stock():  # DeepSpeed as it is: fp16 input to bf16 weights
        with pytest.raises(RuntimeError, match="same dtype"):
            engine(x.half())
    with caplog.at_level("WARNING", logger="accel_npu"):
        got, again = [engine(x.half()) for _ in range(2)]  # two calls from one line: one warning
    assert got.dtype == torch.bfloat16 and torch.equal(got, engine.module(x.half().to(torch.bfloat16)))
    assert torch.equal(again, got)
    assert torch.allclose(got.float(), want.float(), atol=2e-2)
    warnings = [r.getMessage() for r in caplog.records if "engine's boundary" in r.getMessage()]
    assert len(warnings) == 1 and "float16 argument 0" in warnings[0] and f"{__file__}:" in warnings[0], warnings
    # a 1-D fp32 input (timesteps, sigmas: models cast them themselves) passes through as DeepSpeed passes it
    with pytest.raises(RuntimeError, match="same dtype"):
        engine(x[0])
    # fp32 activations (2-D or more): stock stops at the first matmul; accel-npu runs the forward under
    # torch.autocast of the engine's dtype and hands back fp32, as accelerate runs it under DDP with mixed precision
    # (autocast, then convert_outputs_to_fp32)
    with stock():
        with pytest.raises(RuntimeError, match="same dtype"):
            engine(x)
    with caplog.at_level("WARNING", logger="accel_npu"):
        got = engine(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = engine.module(x)
    assert got.dtype == torch.float32 and expected.dtype == torch.bfloat16 and torch.equal(got, expected.float())
    assert any(
        "torch.autocast(bfloat16)" in r.getMessage() and f"{__file__}:" in r.getMessage() for r in caplog.records
    )
    # an fp32 engine (no bf16/fp16 in its config) is left alone: stock's error, nothing cast
    engine = _engine(bf16=False)
    with pytest.raises(RuntimeError, match="same dtype"):
        engine(x.half())


def test_a_zero3_model_cast_after_partitioned_loading_trains_in_the_configured_dtype(one_rank_group):
    """ZeRO-3, a model built in partitions (zero.Init, as accel-npu loads under zero3_init_flag), cast
    .to(float16) and given an adapter layer afterwards, as the CogVideoX scripts treat their transformer
    (.to(weight_dtype), add_adapter). DeepSpeed from 0.19.2 skips its cast for zero.Init models
    (engine._cast_module_mixed_precision), so stock trains the adapter in fp16 under the bf16 config and
    the first forward stops; before 0.19.2 its module.bfloat16() cast everything, and the patch is "not
    needed" there. Either way accel-npu ends with every parameter, and its partition, in bf16. The version
    matrix runs this at 0.16.9, 0.19.1, 0.19.2 and 0.19.8 (noxfile.py GATED_TESTS)."""
    import deepspeed
    import torch

    from accel_npu.patching import get_ledger
    from accel_npu.patching.versions import parse_supports, version_satisfies
    from tests.inprocess import stock

    def zero3_engine():
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        }
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = torch.nn.Sequential(torch.nn.Linear(4, 3))
        model.requires_grad_(False)
        model.to(torch.float16)
        model.append(torch.nn.Linear(3, 3).to(torch.float16))
        trainable = [p for p in model.parameters() if p.requires_grad]
        return deepspeed.initialize(model=model, model_parameters=trainable, config=config)[0]

    patch = get_ledger().find("deepspeed.runtime.engine:DeepSpeedEngine._cast_module_mixed_precision")
    stock_correct = version_satisfies(deepspeed.__version__, parse_supports(patch.stock_correct)[1])
    x = torch.randn(2, 4)
    with stock():
        dtypes = {p.dtype for p in zero3_engine().module[1].parameters()}
    # the declaration is the witness's: stock_correct holds exactly where stock casts the adapter itself
    assert dtypes == ({torch.bfloat16} if stock_correct else {torch.float16}), (deepspeed.__version__, dtypes)
    assert patch.status.startswith("not needed" if stock_correct else "applied"), patch.status
    engine = zero3_engine()
    assert {(p.dtype, p.ds_tensor.dtype) for p in engine.module.parameters()} == {(torch.bfloat16, torch.bfloat16)}
    assert engine(x.half()).dtype == torch.bfloat16  # gathered in bf16; the fp16 input cast at the boundary


# ------------------------------------------------------------------------------------------------
# launched: stock fails before step 1; accel-npu trains, checkpoints, resumes, saves a LoRA that loads
# ------------------------------------------------------------------------------------------------
def _args(kind: str, pipe, videos, out, steps: int, *extra: str) -> list[str]:
    size = "16" if kind == "t2v" else "32"  # tiny_cogvideox: t2v resizes 32 -> 16, i2v's transformer is sized for 32
    return [
        "--config_file",
        str(CONFIG),
        str(SCRIPTS_BY_KIND[kind]),
        "--pretrained_model_name_or_path",
        str(pipe),
        "--instance_data_root",
        str(videos),
        "--caption_column",
        "prompts.txt",
        "--video_column",
        "videos.txt",
        "--height",
        size,
        "--width",
        size,
        "--max_num_frames",
        "9",
        "--output_dir",
        str(out),
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
        "--seed",
        "0",
        "--learning_rate",
        "1e-2",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (CompletedProcess, output dir)} plus the pipeline folders and the LoRA after step 4."""
    import tiny_cogvideox

    root = tmp_path_factory.mktemp("cogvideox")
    pipes = {kind: root / f"pipe_{kind}" for kind in SCRIPTS_BY_KIND}
    for kind, folder in pipes.items():
        tiny_cogvideox.pipeline(kind, str(folder))
    videos = root / "videos"
    tiny_cogvideox.videos(str(videos))

    def launch(name, kind, steps, *extra, **env):
        out = root / name
        out.mkdir(exist_ok=True)
        proc = accelerate_launch(
            _args(kind, pipes[kind], videos, out, steps, *extra),
            env=with_torchvision(release_examples_env(base_env(**env))),
            timeout=600,
            cwd=root,
        )
        return proc, out

    done = {}
    names = ["stock_t2v", "stock_i2v", "t2v", "i2v"]
    first = run_concurrently(
        lambda: launch("stock_t2v", "t2v", 4, ACCEL_NPU_DISABLED_PATCHES=PATCH),
        lambda: launch("stock_i2v", "i2v", 4, ACCEL_NPU_DISABLED_PATCHES=PATCH),
        lambda: launch("t2v", "t2v", 4),
        lambda: launch("i2v", "i2v", 4),
    )
    done.update(zip(names, first))
    at4 = {
        kind: master_lora(done[kind][1] / "checkpoint-4") if done[kind][0].returncode == 0 else None
        for kind in SCRIPTS_BY_KIND
    }
    second = run_concurrently(
        *[
            lambda kind=kind: launch(kind, kind, 6, "--resume_from_checkpoint", "latest")
            for kind in SCRIPTS_BY_KIND
            if done[kind][0].returncode == 0
        ]
    )
    done.update(
        {f"{kind}_resumed": proc for kind, proc in zip([k for k in SCRIPTS_BY_KIND if at4[k] is not None], second)}
    )
    return done, pipes, at4


def _loaded_lora(kind: str, pipe, lora_dir) -> dict:
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline

    return loaded_lora(CogVideoXPipeline if kind == "t2v" else CogVideoXImageToVideoPipeline, pipe, lora_dir)


def _doc_row(script: str, config: str) -> str:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith(f"| `{script}`")]
    found = [row for row in rows if row.strip("|").split("|")[1].strip() == config]
    assert len(found) == 1, rows
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SCRIPTS_BY_KIND))
def test_stock_stops_before_step_1_on_every_rank(runs, kind):
    done, _pipes, _at4 = runs
    proc, out = done[f"stock_{kind}"]
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, explain(proc)
    # each rank meets the error in its first forward; the one that meets it later may be ended by the
    # launcher before it prints it
    error = "RuntimeError: mat1 and mat2 must have the same dtype, but got Half and BFloat16"
    printed = [rank for rank in (0, 1) if f"[rank{rank}]: {error}" in text]
    assert printed and all(rank in printed or ended_by_launcher(text, rank) for rank in (0, 1)), explain(proc)
    assert "diffusers/models/embeddings.py" in text  # where: the transformer's first matmul
    assert not list(out.glob("checkpoint-*")) and not (out / "pytorch_lora_weights.safetensors").exists()
    row = _doc_row(SCRIPTS_BY_KIND[kind].name, "cpu_zero2 / npu_zero2")
    assert (
        "fp16 for frozen towers under a bf16 config: `mat1 and mat2 must have the same dtype"
        if kind == "t2v"
        else "the same error, on every rank before step 1"
    ) in row


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SCRIPTS_BY_KIND))
def test_accel_npu_trains_checkpoints_resumes_and_saves_a_lora_that_loads(runs, kind):
    import torch

    done, pipes, at4 = runs
    proc, out = done[kind]
    assert proc.returncode == 0, explain(proc)
    text = proc.stdout + proc.stderr
    # the warning names the script's line, which is the transformer call (read here from the script)
    lines = SCRIPTS_BY_KIND[kind].read_text().splitlines()
    sites = set(re.findall(rf"{re.escape(SCRIPTS_BY_KIND[kind].name)}:(\d+) passes float16 ", text))
    assert len(sites) == 1 and "= transformer(" in lines[int(sites.pop()) - 1], text[-3000:]
    assert text.count("at the engine's boundary") == 2  # once per rank

    resumed, _ = done[f"{kind}_resumed"]
    assert resumed.returncode == 0, explain(resumed)
    assert "Resuming from checkpoint checkpoint-4" in resumed.stdout + resumed.stderr  # the script's own print
    # resumed at step 4: only checkpoint-6 is new (a fresh start would have rewritten checkpoint-2)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert master_lora(out / "checkpoint-4").keys() == at4[kind].keys()
    final = master_lora(out / "checkpoint-6")
    assert len(final) == 8 and any(not torch.equal(final[k], at4[kind][k]) for k in final)  # steps 5-6 trained
    # the save hook's LoRA in checkpoint-4: the master weights as the bf16 engine holds them
    in_ckpt = lora_file(out / "checkpoint-4")
    assert in_ckpt.keys() == at4[kind].keys()
    for k, v in in_ckpt.items():
        assert torch.equal(v.float(), at4[kind][k].to(torch.bfloat16).float()), k
    # the final LoRA (the script casts the transformer to fp32 first, --mixed_precision unset): bf16 values
    saved = lora_file(out)
    assert saved.keys() == final.keys()
    for k, v in saved.items():
        assert v.dtype == torch.float32 and torch.equal(v, final[k].to(torch.bfloat16).float()), k
    loaded = _loaded_lora(kind, pipes[kind], out)
    assert loaded.keys() == saved.keys()
    for k, v in loaded.items():
        assert torch.equal(v, saved[k]), k
    script = SCRIPTS_BY_KIND[kind].name
    assert "trains, checkpoints, resumes from `latest`; the final LoRA loads" in _doc_row(
        script, "cpu_zero2 / npu_zero2"
    )

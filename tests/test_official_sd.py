"""diffusers v0.40.0's official Stable Diffusion family of examples, run UNCHANGED from the vendored
copies (third_party/; ``$DIFFUSERS_EXAMPLES_DIR`` overrides) on 2 CPU ranks:

- ``dreambooth/train_dreambooth_lora.py`` (SD UNet LoRA),
- ``dreambooth/train_dreambooth.py`` (full UNet fine-tune),
- ``controlnet/train_controlnet.py`` (ControlNet built with ``ControlNetModel.from_unet``),

under the shipped ``launch_configs/cpu_zero2.yaml`` and cpu_zero3 with real partitioning
(``stage3_param_persistence_threshold: 0``, ``zero3_init_flag: true`` as shipped), tiny local models
(tests/scripts/tiny_sd_family.py), 4 steps. Twelve launches, three at a time (~12 min on the 2-core
machine). All twelve are the official matrix's and run with ``RUN_OFFICIAL_MATRIX=1`` (CI runs the two fast
in-process tests at the end):

- per script and config, checkpointing off and ``--resume_from_checkpoint latest`` (none yet: a new
  run), then the final save: it loads (``from_pretrained`` / ``load_lora_weights``) and equals what
  was saved; the ZeRO-3 run's weights equal the ZeRO-2 run's (same seed: an independent witness,
  no partitioning there) up to bf16 rounding, far closer than either is to the initial weights;
- per script under ZeRO-3, ``--checkpointing_steps 2``: every script calls ``accelerator.save_state``
  inside ``if accelerator.is_main_process:`` (a hang in stock, on GPUs too: see
  tests/test_upstream_text_to_image.py): one error naming that line, its guard and the one-line fix;
  no ``checkpoint-*`` directory for ``latest`` to pick;
- per script under ZeRO-3, stock (the loading and saving patches off, ACCEL_NPU_DISABLED_PATCHES):
  the frozen CLIP text encoder, built partitioned by transformers under zero.Init, fails at its first
  call outside the engine (``max_position_embeddings: 0``), as on GPUs.

The two fast in-process tests at the end (no launch, not skipped) pin the fixes these launches needed:
a UNet loaded into ZeRO-3 partitions by accel-npu is whole fp32 (stock's) when the script reads its
``dtype`` or ``state_dict()`` before ``prepare`` (train_dreambooth.py's fp32 check,
``ControlNetModel.from_unet``), and a partitioned LoRA cast ``.to(torch.float32)`` on rank 0 is saved in
fp32 (train_dreambooth_lora.py's final save).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch_utils import (
    BIN,
    OFFICIAL_EXAMPLES,
    OFFICIAL_MATRIX,
    OFFICIAL_MATRIX_REASON,
    REPO,
    SCRIPTS,
    base_env,
    free_port,
    partitioned,
    shipped_zero_configs,
)
from tests.official_scripts import line_of

EXAMPLES = str(OFFICIAL_EXAMPLES)
DOC = REPO / "docs" / "compatibility.md"
STEPS = 4
MISUSE_TIMEOUT_S = 15
SCRIPT = {
    "lora": "dreambooth/train_dreambooth_lora.py",
    "full": "dreambooth/train_dreambooth.py",
    "controlnet": "controlnet/train_controlnet.py",
}
# "stock" under ZeRO-3: diffusers/transformers loads and the saves as the libraries do them
STOCK = ",".join(
    [
        "diffusers.models.modeling_utils:ModelMixin.from_pretrained",
        "diffusers.models.modeling_utils:get_parameter_dtype",
        "transformers.modeling_utils:PreTrainedModel.from_pretrained",
        "diffusers.pipelines.pipeline_utils:DiffusionPipeline.from_pretrained",
        "diffusers.models.modeling_utils:ModelMixin.save_pretrained",
        "safetensors.torch:save_file",
        "accelerate.state:PartialState.wait_for_everyone",
        "accelerate.accelerator:Accelerator.end_training",
        "deepspeed.runtime.zero.partition_parameters:GatheredParameters.__enter__",
        "peft.utils.save_and_load:get_peft_model_state_dict",
    ]
)


# CI's subset: none. Every launch here is the official matrix's (RUN_OFFICIAL_MATRIX=1): CI's 30-minute budget
# holds one official script per shape (tests/test_upstream_*.py), and what ControlNet's launches needed is pinned
# by the in-process tests at the end (a partitioned UNet read whole before prepare, as ControlNetModel.from_unet
# reads it)
CI_KINDS: tuple = ()
KINDS = tuple(SCRIPT) if OFFICIAL_MATRIX else CI_KINDS


def launched(test):
    """Marks of the tests that read the launches: slow."""
    for mark in (pytest.mark.slow, pytest.mark.timeout(2400)):
        test = mark(test)
    return test


def matrix_only(test):
    """A launched test beyond CI's subset: runs with RUN_OFFICIAL_MATRIX=1."""
    return pytest.mark.official_matrix(pytest.mark.skipif(not OFFICIAL_MATRIX, reason=OFFICIAL_MATRIX_REASON)(test))


def kinds(ci: tuple = CI_KINDS):
    """The script kinds as parameters, those outside ``ci`` marked matrix-only."""
    return [
        pytest.param(k)
        if k in ci
        else pytest.param(
            k,
            marks=[pytest.mark.official_matrix, pytest.mark.skipif(not OFFICIAL_MATRIX, reason=OFFICIAL_MATRIX_REASON)],
        )
        for k in SCRIPT
    ]


def _script(kind: str) -> Path:
    return Path(EXAMPLES) / SCRIPT[kind]


def _launch(work: Path, kind: str, cfg: Path, out: Path, extra: list[str], env: dict) -> dict:
    data = (
        ["--train_data_dir", str(work / "controlnet_data")]
        if kind == "controlnet"
        else ["--instance_data_dir", str(work / "instance"), "--instance_prompt", "a photo of sks dog"]
    )
    args = [
        str(BIN / "accelerate"),
        "launch",
        "--main_process_port",
        str(free_port()),
        "--config_file",
        str(cfg),
        str(_script(kind)),
        "--pretrained_model_name_or_path",
        str(work / "model"),
        *data,
        "--resolution",
        "32",
        "--train_batch_size",
        "2",
        "--max_train_steps",
        str(STEPS),
        "--learning_rate",
        "1e-3",
        "--seed",
        "0",
        "--dataloader_num_workers",
        "0",
        "--output_dir",
        str(out),
        *extra,
    ]
    started = time.monotonic()
    try:
        proc = subprocess.run(args, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
        code, text = proc.returncode, proc.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        code, text = "timeout", (exc.stdout or b"").decode(errors="replace")
    return {"code": code, "output": text, "out": out, "seconds": time.monotonic() - started}


def _explain(run: dict) -> str:
    return f"exit {run['code']} after {run['seconds']:.0f} s\n{run['output'][-8000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.torchvision_site import with_torchvision

    work = tmp_path_factory.mktemp("official_sd")
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "tiny_sd_family.py"),
            str(work / "model"),
            str(work / "instance"),
            str(work / "controlnet_data"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        env=base_env(),
    )
    cfg = shipped_zero_configs(work)
    env = with_torchvision(base_env(HF_DATASETS_CACHE=str(work / "datasets-cache")))
    plan = {}
    for kind in KINDS:
        if OFFICIAL_MATRIX:
            plan[(kind, "misuse")] = (
                cfg["zero3_t0"],
                ["--checkpointing_steps", "2"],
                dict(env, ACCEL_NPU_COLLECTIVE_TIMEOUT=str(MISUSE_TIMEOUT_S)),
            )
        plan[(kind, "stock_zero3_t0")] = (cfg["zero3_t0"], [], dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK))
        for label in ("zero2", "zero3_t0"):
            plan[(kind, label)] = (cfg[label], ["--resume_from_checkpoint", "latest"], env)
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        futures = {
            key: pool.submit(_launch, work, key[0], c, work / f"{key[0]}_{key[1]}", extra, e)
            for key, (c, extra, e) in plan.items()
        }
        results = {key: f.result() for key, f in futures.items()}
    results["seconds"] = time.monotonic() - t0
    results["work"] = work
    print(f"official SD-family launches: {results['seconds']:.0f} s")
    return results


def _closeness(got: dict, witness: dict, initial: dict) -> tuple:
    """(share of training-moved elements, share of elements identical to the witness, mean distance to
    the witness, mean distance the witness moved from the initial weights), all keys together."""
    import torch

    keys = sorted(got)

    def diff(a, b):
        return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in keys])

    moved, apart = diff(witness, initial), diff(got, witness)
    return (
        (moved > 0).float().mean().item(),
        (apart == 0).float().mean().item(),
        apart.mean().item(),
        moved.mean().item(),
    )


def _assert_close_to_witness(got, witness, initial, min_identical=0.5, fraction=10):
    moved, identical, apart, distance = _closeness(got, witness, initial)
    assert moved > 0.9, "training changed nearly every weight"
    # ZeRO-3's saved weights are ZeRO-2's up to bf16 rounding of differently reduced gradients: many
    # elements identical (fewer where the values are small: LoRA up, ControlNet's zero convolutions),
    # the mean distance a small fraction of what training moved them (measured: 1/14 for ControlNet's
    # copied blocks, 1/40 for the LoRA)
    assert identical > min_identical and apart < distance / fraction, (identical, apart, distance)


def _files(directory: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / name))


@pytest.mark.slow
@launched
@matrix_only
@pytest.mark.parametrize("kind", list(SCRIPT))
def test_rank0_only_save_state_fails_naming_the_line_and_the_fix(runs, kind):
    run = runs[(kind, "misuse")]
    assert run["code"] not in (0, "timeout"), _explain(run)
    guard_of = line_of(_script(kind), "if global_step % args.checkpointing_steps == 0:") - 1
    assert _script(kind).read_text().splitlines()[guard_of - 1].strip() == "if accelerator.is_main_process:"
    line = line_of(_script(kind), "accelerator.save_state(save_path)", after=guard_of)
    text = run["output"]
    assert (
        f"{_script(kind)}:{line} calls accelerator.save_state() inside `if accelerator.is_main_process:` "
        f"(line {guard_of})" in text
    ), _explain(run)
    assert "`if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:`" in text
    assert f"did not within {MISUSE_TIMEOUT_S} s (ACCEL_NPU_COLLECTIVE_TIMEOUT)" in text
    assert text.count("CollectiveMisuseError: ") == 1, _explain(run)
    out = run["out"]
    assert not [d for d in os.listdir(out) if d.startswith("checkpoint")] if out.exists() else True


@pytest.mark.slow
@launched
@pytest.mark.parametrize("kind", kinds())
def test_stock_zero3_fails_at_the_partitioned_text_encoder(runs, kind):
    run = runs[(kind, "stock_zero3_t0")]
    assert run["code"] not in (0, "timeout"), _explain(run)
    assert "max_position_embeddings: 0" in run["output"], _explain(run)
    assert (
        not (run["out"] / "unet").exists() and not list(run["out"].glob("*.safetensors"))
        if run["out"].exists()
        else True
    )


@pytest.mark.slow
@launched
@matrix_only
def test_dreambooth_lora_final_save_loads_and_equals(runs):
    import torch
    from diffusers import StableDiffusionPipeline

    z2, z3 = runs[("lora", "zero2")], runs[("lora", "zero3_t0")]
    for run in (z2, z3):
        assert run["code"] == 0, _explain(run)
        assert "Checkpoint 'latest' does not exist. Starting a new training run." in run["output"]
    got, witness = (_files(r["out"], "pytorch_lora_weights.safetensors") for r in (z3, z2))
    assert set(got) == set(witness) and got and all(k.startswith("unet.") for k in got)
    assert {t.dtype for t in got.values()} == {torch.float32}  # the script's unet.to(torch.float32)
    # LoRA up (B) starts at zero: the initial adapter is down as trained, up all zeros
    initial = {k: (v if ".lora.down." in k else torch.zeros_like(v)) for k, v in witness.items()}
    ups = [k for k in got if ".lora.up." in k]
    _assert_close_to_witness(
        {k: got[k] for k in ups}, {k: witness[k] for k in ups}, {k: initial[k] for k in ups}, min_identical=0.1
    )
    pipe = StableDiffusionPipeline.from_pretrained(str(runs["work"] / "model"))
    pipe.load_lora_weights(str(z3["out"]), weight_name="pytorch_lora_weights.safetensors")
    adapter = pipe.get_active_adapters()[0]
    params = dict(pipe.unet.named_parameters())
    for key, value in got.items():
        name = (
            key[len("unet.") :]
            .replace(".lora.down.weight", f".lora_A.{adapter}.weight")
            .replace(".lora.up.weight", f".lora_B.{adapter}.weight")
        )
        assert torch.equal(params[name].detach(), value), key


@pytest.mark.slow
@launched
@matrix_only
def test_dreambooth_full_final_save_loads_and_equals(runs):
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    z2, z3 = runs[("full", "zero2")], runs[("full", "zero3_t0")]
    for run in (z2, z3):
        assert run["code"] == 0, _explain(run)
        assert "Checkpoint 'latest' does not exist. Starting a new training run." in run["output"]
    name = "unet/diffusion_pytorch_model.safetensors"
    got, witness = _files(z3["out"], name), _files(z2["out"], name)
    initial = UNet2DConditionModel.from_pretrained(str(runs["work"] / "model"), subfolder="unet").state_dict()
    assert set(got) == set(witness) == set(initial)
    _assert_close_to_witness(got, witness, initial)
    StableDiffusionPipeline.from_pretrained(str(z2["out"]))
    pipe = StableDiffusionPipeline.from_pretrained(str(z3["out"]))
    loaded = pipe.unet.state_dict()  # diffusers loads the saved bf16 in fp32 (no torch_dtype): exact
    assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in got.items())


@pytest.mark.slow
@launched
@matrix_only
def test_controlnet_final_save_loads_and_equals(runs):
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    z2, z3 = runs[("controlnet", "zero2")], runs[("controlnet", "zero3_t0")]
    for run in (z2, z3):
        assert run["code"] == 0, _explain(run)
        assert "Checkpoint 'latest' does not exist. Starting a new training run." in run["output"]
    name = "diffusion_pytorch_model.safetensors"
    got, witness = _files(z3["out"], name), _files(z2["out"], name)
    unet = UNet2DConditionModel.from_pretrained(str(runs["work"] / "model"), subfolder="unet")
    initial = ControlNetModel.from_unet(unet).state_dict()
    assert set(got) == set(witness) == set(initial)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in witness.items()}
    # the blocks from_unet copies from the UNet (the conditioning embedding starts at random)
    copied = [k for k in got if k.startswith(("conv_in.", "time_embedding.", "down_blocks.", "mid_block."))]
    _assert_close_to_witness(
        {k: got[k] for k in copied},
        {k: witness[k] for k in copied},
        {k: initial[k] for k in copied},
        min_identical=0.3,
        fraction=5,
    )
    ControlNetModel.from_pretrained(str(z2["out"]))
    loaded = ControlNetModel.from_pretrained(str(z3["out"])).state_dict()  # bf16 saved, fp32 loaded
    assert all(torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in got.items())


@pytest.mark.slow
@launched
@matrix_only
def test_compatibility_doc_rows_are_true(runs):
    """docs/compatibility.md's rows for these scripts state what the launches above show."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for kind, path in SCRIPT.items():
            # this test's own table (its rows name it), not the matrix table's rows for the same scripts
            if line.startswith(f"| `{Path(path).name}` |") and cells[-1] == "tests/test_official_sd.py":
                rows[(kind, cells[1])] = cells
    assert set(rows) == {(k, c) for k in SCRIPT for c in ("cpu_zero2", "ZeRO-3, threshold 0")}, rows
    for kind in KINDS:
        z3, z2 = rows[(kind, "ZeRO-3, threshold 0")], rows[(kind, "cpu_zero2")]
        assert runs[(kind, "stock_zero3_t0")]["code"] not in (0, "timeout")
        assert "max_position_embeddings: 0" in z3[2] and "before step 1" in z3[2]
        assert "Starting a new training run" in runs[(kind, "zero3_t0")]["output"]
        if OFFICIAL_MATRIX:
            guard = line_of(_script(kind), "if global_step % args.checkpointing_steps == 0:") - 1
            line = line_of(_script(kind), "accelerator.save_state(save_path)", after=guard)
            assert runs[(kind, "misuse")]["code"] not in (0, "timeout")
            assert f"naming line {line}" in z3[3] and f"line {guard}" in z3[3], z3
        assert runs[(kind, "zero3_t0")]["code"] == 0 and "loads" in z3[3] and "ZeRO-2" in z3[3]
        assert runs[(kind, "zero2")]["code"] == 0 and "loads" in z2[3]
        assert z3[4] == z2[4] == "tests/test_official_sd.py"


# ------------------------------------------------------------------------------------------------
# fast, in-process (no launch, no examples checkout): the fixes the launches above needed
# ------------------------------------------------------------------------------------------------
# one_rank_zero3: tests/conftest.py
@pytest.fixture(scope="module")
def tiny_sd_model(tmp_path_factory):
    sys.path.insert(0, str(SCRIPTS))
    import tiny_sd_family

    root = tmp_path_factory.mktemp("tiny_sd_family")
    tiny_sd_family.build(str(root / "model"))
    return root / "model"


def test_partitioned_unet_read_before_prepare_is_whole_fp32_as_stock(tiny_sd_model, one_rank_zero3):
    """train_dreambooth.py's ``unwrap_model(unet).dtype != torch.float32`` check and train_controlnet.py's
    ``ControlNetModel.from_unet(unet)`` see what stock diffusers loads (whole, fp32), not accel-npu's
    ZeRO-3 partitions (bf16, shape [0]); the reference is stock's own load."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from tests.inprocess import stock

    with stock():
        ref = UNet2DConditionModel.from_pretrained(str(tiny_sd_model), subfolder="unet")
        torch.manual_seed(0)  # from_unet initialises the conditioning embedding at random
        ref_controlnet = ControlNetModel.from_unet(ref).state_dict()
    assert not partitioned(ref) and ref.dtype == torch.float32

    unet = UNet2DConditionModel.from_pretrained(str(tiny_sd_model), subfolder="unet")
    assert partitioned(unet)  # loaded straight into partitions (zero3_init_flag)
    assert unet.dtype == torch.float32 and not partitioned(unet)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in unet.state_dict().items())

    unet = UNet2DConditionModel.from_pretrained(str(tiny_sd_model), subfolder="unet")
    assert partitioned(unet)
    torch.manual_seed(0)
    controlnet = ControlNetModel.from_unet(unet).state_dict()
    assert not partitioned(unet)
    assert set(controlnet) == set(ref_controlnet)
    assert all(torch.equal(v, ref_controlnet[k]) for k, v in controlnet.items())


def test_partitioned_parameters_cast_to_fp32_are_saved_in_fp32(tmp_path, one_rank_zero3):
    """train_dreambooth_lora.py's final save: ``unet.to(torch.float32)`` on rank 0, then the LoRA's
    partitioned parameters go to ``save_file``; DeepSpeed gathers them in the partition's bf16, and the
    file says (and holds) fp32, the values equal to the gathered ones."""
    import deepspeed
    import safetensors.torch
    import torch

    config, _plugin = one_rank_zero3
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        layer = torch.nn.Linear(8, 4)
    assert partitioned(layer) and layer.weight.dtype == torch.bfloat16
    with deepspeed.zero.GatheredParameters(list(layer.parameters())):
        want = {k: v.detach().clone() for k, v in layer.named_parameters()}
    layer.to(torch.float32)
    safetensors.torch.save_file(dict(layer.named_parameters()), str(tmp_path / "lora.safetensors"))
    got = safetensors.torch.load_file(str(tmp_path / "lora.safetensors"))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and got[k].shape == v.shape and torch.equal(got[k], v.float()), k

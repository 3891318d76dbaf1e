"""diffusers' train_text_to_image.py (v0.40.0, or v0.35.2 under an older diffusers: ``RELEASE_EXAMPLES``;
byte for byte, vendored in third_party/ and run unchanged) on 2 CPU ranks, under the shipped cpu_zero2
config and a cpu_zero3 variant with real partitioning (stage3_param_persistence_threshold 0, as any
real-size UNet is): the unchanged script's rank-0-only checkpoints; docs/compatibility.md's rows for this script are
asserted here.

The script checkpoints with ``accelerator.save_state`` inside ``if accelerator.is_main_process:``
right after the optimizer step. Ten launches in two waves, sharing the CPUs:
- unchanged (ZeRO-2, ZeRO-3 threshold 0): STEPS steps, ``--checkpointing_steps CKPT``, then
  ``--resume_from_checkpoint latest`` to RESUMED_STEPS;
- the same with the one-line fix applied to a temporary copy (every rank calls save_state), same
  seed: the reference. Each checkpoint of the unchanged run equals the fixed copy's, file for file,
  tensor for tensor, state for state (DeepSpeed's model and optimizer shards, scheduler, sampler,
  both ranks' RNG states, the UNet the script's save hook writes); the resumed runs' losses and
  final UNets are equal too;
- stock (ZeRO-2, the step-boundary and save_state patches disabled): hangs at the first checkpoint,
  leaving an empty ``checkpoint-CKPT`` that ``--resume_from_checkpoint latest`` would pick;
- rank-0-only validation under ZeRO-3 threshold 0 (``--validation_prompts``, given to the unchanged ZeRO-3
  resume: after its last epoch): served by the other rank (no collective error, no hang; the pipeline saved
  afterwards loads whole, and its UNet still equals the fixed copy's resume, which validates nothing; no stock
  half: stock waits for the process-group timeout);
- stock final save (ZeRO-3 threshold 0, this plugin's save/gather patches disabled): exit 0 and a
  UNet that ``from_pretrained`` refuses (shape [0]); the unchanged runs' final saves load, and the
  ZeRO-3 one equals the ZeRO-2 one far closer than either is to the initial weights.

Stock halves use ACCEL_NPU_DISABLED_PATCHES: with ACCEL_NPU_DISABLE=1 on CPU every rank is rank 0
of 1 (stock accelerate starts no gloo group without an accelerator), so neither failure can happen.
A rank-0-only save_state made mid-step is tested in tests/test_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch_utils import BIN, RELEASE_EXAMPLES, REPO, SCRIPTS, base_env, free_port, shipped_zero_configs
from tests.official_scripts import StreamedLaunch, fixed_copy
from tests.torchvision_site import with_torchvision

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

UPSTREAM = RELEASE_EXAMPLES / "text_to_image" / "train_text_to_image.py"
DOC = REPO / "docs" / "compatibility.md"
STEPS, CKPT, RESUMED_STEPS = 10, 5, 12
# the script's rank-0-only validation after each epoch, and its final inference: run by the unchanged ZeRO-3 resume
VALIDATION = ["--validation_prompts", "a red square", "--validation_epochs", "1"]
# the patches whose absence is "stock" for each half
STOCK_SAVE_STATE = "accelerate.accelerator:Accelerator.save_state,accelerate.accelerator:Accelerator.backward"
STOCK_FINAL_SAVE = ",".join(
    [
        "diffusers.models.modeling_utils:ModelMixin.save_pretrained",
        "safetensors.torch:save_file",
        "accelerate.state:PartialState.wait_for_everyone",
        "accelerate.accelerator:Accelerator.end_training",
        "deepspeed.runtime.zero.partition_parameters:GatheredParameters.__enter__",
    ]
)


class Run(StreamedLaunch):
    """One `accelerate launch` of the upstream script (or the fixed copy) with this file's arguments."""

    def __init__(
        self,
        cfg: Path,
        out: Path,
        extra: list[str],
        env: dict,
        workdir: Path,
        script: Path = UPSTREAM,
        steps: int = STEPS,
    ):
        args = [
            str(BIN / "accelerate"),
            "launch",
            "--main_process_port",
            str(free_port()),
            "--config_file",
            str(cfg),
            str(script),
            "--pretrained_model_name_or_path",
            str(workdir / "model"),
            "--train_data_dir",
            str(workdir / "data"),
            "--caption_column",
            "text",
            "--resolution",
            "16",
            "--train_batch_size",
            "2",
            "--max_train_steps",
            str(steps),
            "--learning_rate",
            "1e-3",
            "--seed",
            "0",
            "--output_dir",
            str(out),
            "--dataloader_num_workers",
            "0",
            *extra,
        ]
        super().__init__(args, env, workdir, steps, out)


def _unet_state(directory: Path) -> dict:
    from safetensors.torch import load_file

    # copied into memory: load_file's tensors map the file, and safetensors 0.4.3's save_file rewrites an
    # existing file in place, so a later run saving to the same path would change a state kept from an earlier one
    return {k: v.clone() for k, v in load_file(str(directory / "unet" / "diffusion_pytorch_model.safetensors")).items()}


def _load(path: Path):
    import torch
    from safetensors.torch import load_file

    if path.suffix == ".safetensors":
        return {k: v.clone() for k, v in load_file(str(path)).items()}  # in memory, as _unet_state
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix in (".pt", ".bin", ".pkl"):
        return torch.load(path, map_location="cpu", weights_only=False)
    return path.read_bytes()


def _differences(a, b, where: str, out: list) -> list:
    """Where ``a`` and ``b`` differ: tensors by dtype, shape and value, containers entry by entry,
    other objects by their attributes."""
    import numpy as np
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (
            torch.is_tensor(a)
            and torch.is_tensor(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        ):
            out.append(where)
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)):
            out.append(where)
    elif isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            out.append(f"{where} (keys)")
        else:
            for k in a:
                _differences(a[k], b[k], f"{where}[{k!r}]", out)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            out.append(f"{where} (length)")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                _differences(x, y, f"{where}[{i}]", out)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        if type(a) is not type(b):
            out.append(f"{where} (type)")
        else:
            _differences(vars(a), vars(b), f"{where}.__dict__", out)
    elif a != b:
        out.append(where)
    return out


def checkpoint_differences(one: Path, other: Path) -> list[str]:
    """Every file of two checkpoint directories compared (an empty list: the same checkpoint)."""
    files = sorted(str(p.relative_to(one)) for p in one.rglob("*") if p.is_file())
    theirs = sorted(str(p.relative_to(other)) for p in other.rglob("*") if p.is_file())
    if files != theirs:
        return [f"files: {sorted(set(files) ^ set(theirs))}"]
    out: list[str] = []
    for rel in files:
        _differences(_load(one / rel), _load(other / rel), rel, out)
    return out


def step_losses(run) -> dict[int, str]:
    """The step_loss the progress bar shows at each step (tqdm: n/total ... step_loss=...)."""
    found = {}
    for n, loss in re.findall(rf"\| (\d+)/{run.steps} \[[^\]\n\r]*step_loss=([-0-9.e+]+)", run.output):
        found[int(n)] = loss
    return found


def xformers(label: str) -> list[str]:
    """The unchanged ZeRO-2 runs also pass --enable_xformers_memory_efficient_attention (a flag written for
    CUDA; stock raises 'xformers is not available', tests/test_attention_flags.py): on CPU it must change
    nothing, so their checkpoints still equal the fixed copy's, which runs without it."""
    return ["--enable_xformers_memory_efficient_attention"] if label == "unchanged_zero2" else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("t2i")
    subprocess.run(
        [sys.executable, str(SCRIPTS / "tiny_sd.py"), str(work / "model"), str(work / "data")],
        check=True,
        capture_output=True,
        timeout=300,
        env=base_env(),
    )
    cfg = shipped_zero_configs(work)
    env = with_torchvision(base_env(HF_DATASETS_CACHE=str(work / "datasets-cache")))
    stock = {
        "save_state": dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_SAVE_STATE),
        "final": dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_FINAL_SAVE),
    }
    fixed = fixed_copy(UPSTREAM, work, "train_text_to_image_fixed.py")
    ckpt = ["--checkpointing_steps", str(CKPT), "--resume_from_checkpoint", "latest"]
    results = {}
    t0 = time.monotonic()
    # wave 1: unchanged and fixed, ZeRO-2 and ZeRO-3, and the stock hang
    first = {}
    for label in ("zero2", "zero3_t0"):
        first[f"unchanged_{label}"] = Run(
            cfg[label], work / f"unchanged_{label}", ckpt + xformers(f"unchanged_{label}"), env, work
        )
        first[f"fixed_{label}"] = Run(cfg[label], work / f"fixed_{label}", ckpt, env, work, script=fixed)
    hang = Run(cfg["zero2"], work / "stock_hang", ckpt, stock["save_state"], work)
    deadline = time.monotonic() + 900
    leftover = work / "stock_hang" / f"checkpoint-{CKPT}"
    while not leftover.exists() and hang.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    hang_alive = False
    if leftover.exists():
        time.sleep(20)  # a hang, not a slow save: still there 20 s after the checkpoint began
        hang_alive = hang.proc.poll() is None
    hang.kill() if hang.proc.poll() is None else None
    hang.wait(30)
    results["hang"] = dict(run=hang, alive_20s_after_checkpoint=hang_alive, leftover=leftover)
    # wave 2: as each first run ends, its resume from `latest` (the unchanged ZeRO-3 one with rank-0-only
    # validation, a pipeline forward with the partitioned UNet, right after its last step); beside them, the
    # stock final save
    later = {
        "stock_final_zero3_t0": Run(
            cfg["zero3_t0"], work / "stock_final_z3", ["--checkpointing_steps", "100"], stock["final"], work
        ),
    }
    for label, run in first.items():
        run.wait(900)
        results[label] = dict(
            run=run,
            checkpoints=sorted(
                (d for d in os.listdir(run.out) if d.startswith("checkpoint")), key=lambda d: int(d.split("-")[1])
            ),
            unet=_unet_state(run.out) if (run.out / "unet").is_dir() else None,
        )
        later[f"resumed_{label}"] = Run(
            cfg[label.split("_", 1)[1]],
            run.out,
            ckpt + xformers(label) + (VALIDATION if label == "unchanged_zero3_t0" else []),
            env,
            work,
            script=fixed if label.startswith("fixed") else UPSTREAM,
            steps=RESUMED_STEPS,
        )
    for label, run in later.items():
        run.wait(900)
        results[label] = dict(run=run)
    results["seconds"] = time.monotonic() - t0
    results["work"] = work
    print(f"upstream text_to_image launches: {results['seconds']:.0f} s")
    return results


@pytest.mark.parametrize("stage", ["zero2", "zero3_t0"])
def test_unchanged_script_checkpoints_what_the_fixed_copy_checkpoints(runs, stage):
    """The unchanged script's rank-0-only save_state completes at the step
    boundary, and each checkpoint equals the fixed copy's, file for file, tensor for tensor."""
    unchanged, fixed = runs[f"unchanged_{stage}"], runs[f"fixed_{stage}"]
    for r in (unchanged, fixed):
        assert r["run"].proc.returncode == 0, r["run"].explain()
    want = [f"checkpoint-{s}" for s in range(CKPT, STEPS + 1, CKPT)]
    assert unchanged["checkpoints"] == fixed["checkpoints"] == want, (unchanged["checkpoints"], fixed["checkpoints"])
    for name in want:
        ours, reference = unchanged["run"].out / name, fixed["run"].out / name
        # what every rank writes for itself: its shards and its RNG states
        assert (ours / "random_states_1.pkl").is_file() and list(ours.rglob("*rank_1*")), sorted(os.listdir(ours))
        assert checkpoint_differences(ours, reference) == [], name
    # the comparison sees a difference where there is one: two checkpoints of the same run differ
    one, two = (unchanged["run"].out / name for name in want[:2])
    found = checkpoint_differences(one, two)
    assert any("optim_states" in d for d in found) and any("random_states_1.pkl" in d for d in found), found
    assert not [d for d in os.listdir(unchanged["run"].out) if d.startswith(".")]


@pytest.mark.parametrize("stage", ["zero2", "zero3_t0"])
def test_unchanged_script_resumes_as_the_fixed_copy_does(runs, stage):
    """--resume_from_checkpoint latest from the unchanged run's checkpoint trains on exactly as the
    fixed copy's resume: the same step losses, the same final UNet, bit for bit (under ZeRO-3 the unchanged
    resume also ran the script's rank-0-only validation before its final save; the fixed copy's did not)."""
    import torch

    ours, reference = runs[f"resumed_unchanged_{stage}"]["run"], runs[f"resumed_fixed_{stage}"]["run"]
    for run in (ours, reference):
        assert run.proc.returncode == 0, run.explain()
        assert f"Resuming from checkpoint checkpoint-{STEPS}" in run.output, run.explain()
    losses, witness = step_losses(ours), step_losses(reference)
    assert RESUMED_STEPS in losses and RESUMED_STEPS in witness, (losses, witness)
    assert all(losses[n] == witness[n] for n in set(losses) & set(witness)), (losses, witness)
    final, expected = _unet_state(ours.out), _unet_state(reference.out)
    assert set(final) == set(expected) and all(torch.equal(final[k], expected[k]) for k in final)
    before = runs[f"unchanged_{stage}"]["unet"]
    assert any(not torch.equal(final[k], before[k]) for k in final)  # steps 11-12 trained on


def test_stock_rank0_only_save_state_hangs_and_leaves_what_latest_picks(runs):
    from accel_npu.plugins.checkpoints import state as checkpointing

    hang = runs["hang"]
    assert hang["alive_20s_after_checkpoint"], hang["run"].explain()
    out = hang["run"].out
    # the script's own choice for --resume_from_checkpoint latest
    dirs = sorted((d for d in os.listdir(out) if d.startswith("checkpoint")), key=lambda x: int(x.split("-")[1]))
    assert dirs == [f"checkpoint-{CKPT}"] and not list((out / dirs[0]).rglob("*model_states.pt"))

    class Acc:
        class project_configuration:
            automatic_checkpoint_naming = False

    with pytest.raises(checkpointing.CheckpointError) as info:
        checkpointing.resolve_load_dir(str(out / dirs[0]), Acc())
    message = str(info.value)
    assert f"checkpoint {out / dirs[0]} is incomplete; missing: pytorch_model/" in message
    assert f"There is no complete checkpoint beside it in {out}" in message


def test_final_save_of_a_partitioned_unet_loads_and_equals_the_trained_weights(runs):
    import torch
    from diffusers import UNet2DConditionModel

    z3, z2 = runs["unchanged_zero3_t0"], runs["unchanged_zero2"]
    assert (
        "does not exist. Starting a new training run" in z3["run"].output
    )  # --resume_from_checkpoint latest, none yet
    got, witness = z3["unet"], z2["unet"]
    initial = UNet2DConditionModel.from_pretrained(runs["work"] / "model", subfolder="unet").state_dict()
    assert set(got) == set(witness) == set(initial)

    def diff(a, b):
        return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in got])

    moved, apart = diff(witness, initial), diff(got, witness)
    assert (moved > 0).float().mean() > 0.9, "training changed nearly every weight"
    # ZeRO-3's saved UNet is ZeRO-2's up to bf16 rounding of differently reduced gradients: most
    # elements identical, the mean difference a small fraction of what training moved them
    assert (apart == 0).float().mean() > 0.5 and apart.mean() < moved.mean() / 10, (apart.mean(), moved.mean())
    # the resumed run's final save_pretrained loads with from_pretrained
    unet = UNet2DConditionModel.from_pretrained(runs["resumed_unchanged_zero3_t0"]["run"].out, subfolder="unet")
    assert unet.conv_in.weight.shape == initial["conv_in.weight"].shape


def test_fixed_copy_checkpoints_hold_what_deepspeed_holds(runs):
    """Witness for the reference itself: DeepSpeed's own zero_to_fp32 of each ZeRO-3 checkpoint
    (the optimizer's fp32 master weights) cast to the model's bf16 equals the UNet the script's
    save hook wrote into it (rank 0 alone, its ZeRO-3 gathers joined by rank 1)."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = runs["fixed_zero3_t0"]["run"].out
    for step in range(CKPT, STEPS + 1, CKPT):
        ckpt = out / f"checkpoint-{step}"
        master = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
        hooked = _unet_state(ckpt)
        assert set(hooked) == set(master), step
        assert all(torch.equal(hooked[k], v.to(hooked[k].dtype)) for k, v in master.items()), step


def test_stock_final_save_of_a_partitioned_unet_exits_0_and_cannot_be_loaded(runs):
    from diffusers import UNet2DConditionModel

    run = runs["stock_final_zero3_t0"]["run"]
    assert run.proc.returncode == 0, run.explain()
    assert _unet_state(run.out)["conv_in.weight"].shape == (0,)
    with pytest.raises(Exception, match=r"conv_in.weight.*\[0\]|size mismatch|shape"):
        UNet2DConditionModel.from_pretrained(run.out, subfolder="unet")


def test_rank0_only_validation_under_zero3_is_served_and_the_pipeline_saved(runs):
    """The script's `if accelerator.is_main_process: ... log_validation(...)` runs a pipeline on the
    partitioned UNet (every layer a gather) on rank 0 alone after each epoch (here the unchanged ZeRO-3
    resume's last one, steps 11-12): the other rank, paused at its next clean point, serves each gather.
    Witnesses: no collective error, no hang, and the pipeline the script saves afterwards on rank 0 (after the
    last epoch's validation) loads with a whole UNet, and the script's final inference under
    `torch.autocast("cuda")` with the bf16 pipeline it reloads runs to the end (its fp16 matmuls meet bf16
    norms, run in fp32 as CUDA's autocast runs them: the run exits 0)."""
    from diffusers import UNet2DConditionModel

    run = runs["resumed_unchanged_zero3_t0"]["run"]
    text = run.output
    assert RESUMED_STEPS in run.step_seen, run.explain()
    # validation was asked: after the last epoch, and the final inference
    assert "Running validation..." in text and "Running inference for collecting generated images" in text
    assert "CollectiveMisuseError" not in text and "Connection closed by peer" not in text, run.explain()
    assert run.exited - run.step_seen[RESUMED_STEPS] < 120, run.explain()
    unet = UNet2DConditionModel.from_pretrained(run.out, subfolder="unet")
    assert all(p.numel() > 0 for p in unet.parameters())
    assert run.proc.returncode == 0 and "mixed dtype" not in text, run.explain()


def test_compatibility_doc_rows_for_this_script_are_true(runs):
    """docs/compatibility.md states, for this script, what the runs above show."""
    section = DOC.read_text().split("## `train_text_to_image.py`", 1)[1].split("\n## ", 1)[0]  # not the matrix's rows
    rows = [line for line in section.splitlines() if line.startswith("| `train_text_to_image.py`")]
    table = {tuple(c.strip() for c in row.strip("|").split("|")[1:3]): row for row in rows}
    assert set(table) == {
        ("cpu_zero2 / npu_zero2", "`--checkpointing_steps` < steps"),
        ("ZeRO-3, threshold 0", "`--checkpointing_steps` < steps"),
        ("cpu_zero2 / npu_zero2", "checkpointing off"),
        ("ZeRO-3, threshold 0", "checkpointing off"),
    }, table
    for stage, row in (("zero2", "cpu_zero2 / npu_zero2"), ("zero3_t0", "ZeRO-3, threshold 0")):
        assert runs[f"unchanged_{stage}"]["run"].proc.returncode == 0
        assert runs[f"resumed_unchanged_{stage}"]["run"].proc.returncode == 0
        assert "checkpoints and resumes unchanged" in table[(row, "`--checkpointing_steps` < steps")]
        assert "loads" in table[(row, "checkpointing off")]
    assert runs["hang"]["alive_20s_after_checkpoint"]
    assert "stock hangs" in table[("cpu_zero2 / npu_zero2", "`--checkpointing_steps` < steps")]
    assert runs["stock_final_zero3_t0"]["run"].proc.returncode == 0
    assert "shape-[0]" in table[("ZeRO-3, threshold 0", "checkpointing off")]

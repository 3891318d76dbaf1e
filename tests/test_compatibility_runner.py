"""tools/compatibility.py's bookkeeping, without launching anything: which script each error is
blamed on, how a partial run merges into the results file, that every vendored official script has a
plan or a row saying why not, and that each check of a row can fail (an untrained artifact, a tampered
one, a resumed run unlike the straight one). One slow test launches a copy of an official script that
never steps its optimizer and tampers with its artifact."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launch_utils import REPO, UPSTREAM_EXAMPLES

sys.path.insert(0, str(REPO))

from tools import compatibility as compat

SCRIPT = UPSTREAM_EXAMPLES / "cogvideo" / "train_cogvideox_lora.py"


def test_first_error_names_the_frame_outside_torch_and_known_causes():
    site = "/venv/lib/python3.11/site-packages"
    out = "\n".join(
        [
            "Steps: 0%",
            "[rank1]: Traceback (most recent call last):",
            f'[rank1]:   File "{SCRIPT}", line 1449, in main',
            f'[rank1]:   File "{site}/diffusers/models/attention.py", line 10, in forward',
            f'[rank1]:   File "{site}/torch/nn/modules/linear.py", line 134, in forward',
            "[rank1]: ValueError: something the library refused",
            "[rank0]: RuntimeError: later, on the other rank",
        ]
    )
    assert compat.first_error(out, SCRIPT) == ("ValueError: something the library refused", "diffusers's")
    mine = out.replace(f"{site}/diffusers/models/attention.py", str(SCRIPT))
    assert compat.first_error(mine, SCRIPT)[1] == "the script's"
    dtype = out.replace(
        "ValueError: something the library refused",
        "RuntimeError: mat1 and mat2 must have the same dtype, but got Half and BFloat16",
    )
    assert compat.first_error(dtype, SCRIPT)[1].startswith("the script's: fp16 frozen towers")
    ours = out.replace(f"{site}/diffusers/models/attention.py", f"{site}/accel_npu/plugins/loading/x.py")
    assert compat.first_error(ours, SCRIPT)[1] == "ours (accel-npu)"
    chained = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            f'[rank0]:   File "{site}/diffusers/models/modeling_utils.py"',
            "[rank0]: AttributeError: 'M' object has no attribute 'get_parameter_or_buffer'",
            "[rank0]: ",
            "[rank0]: During handling of the above exception, another exception occurred:",
            "[rank0]: ",
            "[rank0]: Traceback (most recent call last):",
            f'[rank0]:   File "{SCRIPT}", line 1620, in main',
            f'[rank0]:   File "{site}/accel_npu/plugins/loading/placement/fsdp.py", line 246',
            "[rank0]: ValueError: not enough values to unpack (expected 2, got 1)",
        ]
    )
    assert compat.first_error(chained, SCRIPT) == (
        "ValueError: not enough values to unpack (expected 2, got 1)",
        "ours (accel-npu)",
    )
    lcm = UPSTREAM_EXAMPLES / "consistency_distillation" / "train_lcm_distill_lora_sdxl.py"
    dropped = "64 of 158 master tensors not in the loaded artifact"
    assert compat._whose("", dropped, lcm).startswith("diffusers': ")  # a cause scoped to one script
    assert compat._whose("", dropped, SCRIPT) == "unknown"
    # a script's own cause comes before the generic one of the same error
    misuse = "accel_npu._torch.dist.CollectiveMisuseError: x.py:692 enters all_gather_into_tensor, a collective"
    unconditional = UPSTREAM_EXAMPLES / "unconditional_image_generation" / "train_unconditional.py"
    assert "DDPMPipeline" in compat._whose("", misuse, unconditional)
    assert "save_state inside" in compat._whose("", misuse, SCRIPT)
    warned = "UserWarning: not an error\nKeyError: 'x'"
    assert compat.first_error(warned, SCRIPT)[0] == "KeyError: 'x'"


def test_a_partial_run_replaces_its_rows_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "RESULT_FILE", tmp_path / "compatibility.md")

    def row(script, config, result, commit):
        return [f"`{script}`", "F", config, result, "master", "x", "", "1 s", "0.10 GiB", commit, "2026-01-01 00:00"]

    compat.write_rows(
        {("`a.py`", "zero2"): row("a.py", "zero2", "✘", "old"), ("`b.py`", "zero2"): row("b.py", "zero2", "✔", "old")},
        ["compatibility.py"],
    )
    compat.write_rows({("`a.py`", "zero2"): row("a.py", "zero2", "✔", "new")}, ["compatibility.py", "--only", "a"])
    rows = compat.read_rows(tmp_path / "compatibility.md")
    assert set(rows) == {("`a.py`", "zero2"), ("`b.py`", "zero2")}
    assert rows[("`a.py`", "zero2")][3::6] == ["✔", "new"] and rows[("`b.py`", "zero2")][3::6] == ["✔", "old"]


def test_resume_keeps_this_commits_rows_and_runs_the_others(tmp_path, monkeypatch):
    results = tmp_path / "compatibility.md"
    spec = compat.SPECS[0]
    kept = [f"`{spec.name}`", spec.family, "zero2", "✔", "master", "x", "", "1 s", "0.10 GiB", "abc1234", "d"]
    older = [*kept[:2], "zero3_t0", *kept[3:9], "0ld0000", "d"]
    compat.write_rows({(kept[0], "zero2"): kept, (older[0], "zero3_t0"): older}, ["compatibility.py"], results)
    ran = []

    def run_row(spec, config, *args):
        ran.append(config)
        return {"ok": True, "what": "ran", "whose": "", "seconds": 2.0, "peak_rss": 2**30}

    monkeypatch.setattr(compat, "run_row", run_row)
    monkeypatch.setattr(compat, "_commit", lambda: "abc1234")
    monkeypatch.setattr(compat, "not_run_rows", lambda stamp: {})
    argv = ["--only", spec.name, "--configs", "zero2,zero3_t0", "--results", str(results), "--work", str(tmp_path)]
    compat.main([*argv, "--resume"])
    assert ran == ["zero3_t0"]  # the row of another commit ran again; this commit's was kept, as it was
    rows = compat.read_rows(results)
    assert rows[(kept[0], "zero2")] == kept and rows[(kept[0], "zero3_t0")][-2] == "abc1234"
    compat.main(argv)  # the negative: without --resume every row runs
    assert ran == ["zero3_t0", "zero2", "zero3_t0"]


def test_a_not_run_row_goes_once_its_script_has_a_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "RESULT_FILE", tmp_path / "compatibility.md")
    planned, unplanned = f"`{compat.SPECS[0].name}`", "`no_such_script.py`"
    not_run = lambda script: [script, "F", "all", "–", "not run: no tiny builder", "", "", "", "c", "d"]  # noqa: E731 - a row builder, one expression
    (tmp_path / "compatibility.md").write_text(
        "\n".join("| " + " | ".join(not_run(s)) + " |" for s in (planned, unplanned)) + "\n"
    )
    assert set(compat.read_rows(tmp_path / "compatibility.md")) == {(planned, "all"), (unplanned, "all")}
    compat.write_rows({}, ["compatibility.py"])
    assert set(compat.read_rows(tmp_path / "compatibility.md")) == {(unplanned, "all")}


def test_every_vendored_torch_script_has_a_plan_or_a_row_saying_why_not():
    assert all(s.script.is_file() for s in compat.SPECS)
    # users' own scripts (tests/scripts/) are rows of the table too, beside the official ones
    planned = {s.name for s in compat.SPECS if s.official}
    assert {s.name for s in compat.SPECS if not s.official} == {"train_dit4dit.py"}
    not_run = {key[0].strip("`") for key in compat.not_run_rows(["c", "d"])}
    # the official training scripts: train_*.py and the two textual inversion scripts, named otherwise
    every = {p.name for p in UPSTREAM_EXAMPLES.rglob("train_*.py")} | {
        p.name for p in UPSTREAM_EXAMPLES.rglob("textual_inversion*.py")
    }
    assert {"textual_inversion.py", "textual_inversion_sdxl.py"} <= planned
    assert planned | not_run == every and not planned & not_run


def test_an_fsdp_checkpoint_is_compared_with_its_consolidated_model_folder(tmp_path):
    """Under fsdp2 the master weights are accelerate's SHARDED_STATE_DICT model folder (dcp.save of
    {"model": state_dict}), read back by torch's dcp_to_torch_save: written here by dcp itself."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"blocks.0.to_q.lora_A.default.weight": torch.randn(4, 8), "blocks.0.to_q.weight": torch.randn(8, 8)}
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(str(tmp_path / compat.FSDP_MODEL_DIR)))
    master = compat._master(tmp_path)
    assert master.keys() == state.keys() and all(torch.equal(master[k], v) for k, v in state.items())


def _spec(name):
    return next(s for s in compat.SPECS if s.name == name)


def test_each_script_is_launched_with_its_own_flags(tmp_path, monkeypatch):
    """Official scripts keep the runner's common flags; a Spec's ``cli`` replaces them (Cosmos: epochs, one
    launch; DiT4DiT: its own flags, the resume witnessed by DeepSpeed's global_steps, which can fail)."""
    import torch

    calls = []

    def fake_launch(args, env, cwd, timeout):
        calls.append(args)
        if "--final-save" in args:  # DiT4DiT's resumed launch: a checkpoint whose step count says "no resume"
            ckpt = Path(args[args.index("--final-save") + 1]) / "pytorch_model"
            ckpt.mkdir(parents=True)
            torch.save({"global_steps": 2}, ckpt / "mp_rank_00_model_states.pt")
        return {"code": 0, "output": "", "seconds": 1.0, "peak_rss": 0}

    monkeypatch.setattr(compat, "launch", fake_launch)
    monkeypatch.setattr(compat, "_build", lambda kind, work: None)
    monkeypatch.setattr(compat, "shipped_zero_configs", lambda root: {"zero2": root / "z2.yaml"})

    spec = _spec("train_dreambooth_lora_sd3.py")
    row = compat.run_row(spec, "zero2", tmp_path, 4, 2, 6, 10)
    out, model = tmp_path / f"{spec.name}-zero2", tmp_path / spec.builder / "model"
    data = [a.format(work=tmp_path / spec.builder) for a in spec.data]
    base = [
        "--config_file",
        str(tmp_path / "z2.yaml"),
        str(spec.script),
        "--pretrained_model_name_or_path",
        str(model),
        *data,
        *spec.extra,
        "--seed",
        "0",
        "--output_dir",
        str(out),
        "--checkpointing_steps",
        "2",
    ]
    assert calls == [
        base + ["--max_train_steps", "4"],
        base + ["--max_train_steps", "6", "--resume_from_checkpoint", "latest"],
    ]
    assert not row["ok"] and "did not resume from checkpoint-4" in row["what"]

    calls.clear()
    row = compat.run_row(_spec("train_cosmos_predict25_lora.py"), "zero2", tmp_path, 4, 2, 6, 10)
    assert len(calls) == 1 and "--max_train_steps" not in calls[0]
    assert calls[0][-4:] == ["--num_train_epochs", "4", "--checkpointing_epochs", "2"]
    assert not row["ok"] and "did not write checkpoint-(none)" in row["what"]

    calls.clear()
    spec = _spec("train_dit4dit.py")
    row = compat.run_row(spec, "zero2", tmp_path, 4, 2, 6, 10)
    out = tmp_path / f"{spec.name}-zero2"
    assert spec.script == REPO / "tests" / "scripts" / "train_dit4dit.py"
    assert calls[1][calls[1].index("--resume") + 1] == str(out / "checkpoint-4")
    assert not row["ok"] and "global_steps in checkpoint-6: 2" in row["what"]


def test_a_script_given_a_spec_loses_its_not_run_row(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "RESULT_FILE", tmp_path / "compatibility.md")
    name = f"`{compat.SPECS[0].name}`"
    compat.write_rows(
        {(name, "all"): [name, "F", "all", "–", "", "not run: no tiny builder", "", "", "", "c", "d"]},
        ["compatibility.py"],
    )
    compat.write_rows(
        {(name, "zero2"): [name, "F", "zero2", "✔", "master", "x", "", "1 s", "0.10 GiB", "c", "d"]},
        ["compatibility.py"],
    )
    assert set(compat.read_rows(tmp_path / "compatibility.md")) == {(name, "zero2")}


# -- each check of a row can fail ---------------------------------------------------------------------
def test_the_trained_check_fails_where_a_trained_tensor_kept_its_initial_value():
    lora = _spec("train_dreambooth_lora_sdxl.py")
    b, a = "down.0.to_q.lora_B.weight", "down.0.to_q.lora_A.weight"
    ok, what = compat.trained_check(lora, {a: torch.randn(4, 8), b: torch.zeros(8, 4)}, {}, {}, "checkpoint-2")
    assert not ok and what.startswith("not trained: 1 of 1 LoRA B = 0")
    ok, what = compat.trained_check(lora, {a: torch.randn(4, 8), b: torch.randn(8, 4)}, {}, {}, "checkpoint-2")
    assert ok and what == "trained: 1 LoRA B ≠ 0, their initialisation"
    # a LoRA B the script never trains (SD3's last block's text query projection), named by its Spec
    sd3 = _spec("train_dreambooth_lora_sd3.py")
    dropped = "transformer_blocks.0.attn.add_q_proj.lora_B.weight"
    ok, what = compat.trained_check(sd3, {b: torch.randn(8, 4), dropped: torch.zeros(8, 4)}, {}, {}, "checkpoint-2")
    assert ok and what.startswith("trained: 1 LoRA B ≠ 0") and "add_q_proj" in what and "left out" in what

    full = _spec("train_text_to_image.py")
    initial = {"conv_in.weight": torch.randn(8, 4), "conv_out.weight": torch.randn(4, 8)}
    earlier = {"conv_in.weight": torch.randn(8, 8), "conv_out.weight": torch.randn(4, 8)}
    trained = {k: v + 1e-2 for k, v in initial.items()}
    ok, what = compat.trained_check(full, trained, initial, earlier, "checkpoint-2")
    assert ok and what == "trained: 2 tensors ≠ their initial value (2 from the model folder)"
    # a bf16 artifact equal to its initial value's bf16 rounding was not trained either
    kept = {"conv_in.weight": trained["conv_in.weight"], "conv_out.weight": initial["conv_out.weight"].bfloat16()}
    ok, what = compat.trained_check(full, kept, initial, earlier, "checkpoint-2")
    assert not ok and what.startswith("not trained: 1 of 2 tensors") and "conv_out.weight" in what
    # a tensor of another shape than the model folder's (a widened conv_in) is held against the first checkpoint
    widened = {"conv_in.weight": earlier["conv_in.weight"], "conv_out.weight": trained["conv_out.weight"]}
    ok, what = compat.trained_check(full, widened, initial, earlier, "checkpoint-2")
    assert not ok and "1 from the model folder, 1 from checkpoint-2" in what and "conv_in.weight" in what
    frozen = dataclasses.replace(full, untrained=r"^conv_in\.")
    ok, what = compat.trained_check(frozen, widened, initial, earlier, "checkpoint-2")
    assert ok and "/^conv_in\\./ left out" in what

    ti = _spec("textual_inversion.py")
    row = {"text_encoder.token_embedding.99": torch.randn(32)}
    ok, what = compat.trained_check(ti, row, dict(row), {}, "checkpoint-2")
    assert not ok and what.startswith("not trained: 1 of 1 new token rows")


def test_a_tampered_artifact_is_not_the_master_weights():
    master = {"w": torch.randn(4, 4), "b": torch.randn(4)}
    assert compat.equal_to_master(master, {k: v.bfloat16() for k, v in master.items()}) == (True, "2 tensors = master")
    tampered = dict(master, w=master["w"].clone())
    tampered["w"][0, 0] += 0.5
    ok, what = compat.equal_to_master(master, tampered)
    assert not ok and what == "loaded artifact differs from the master weights: max |Δ| 0.5"
    ok, what = compat.equal_to_master(master, {"w": master["w"]})
    assert not ok and what == "1 of 2 master tensors not in the loaded artifact"


def test_a_resumed_run_unlike_the_straight_one_is_a_cross():
    straight = {"w": torch.randn(4, 4)}
    assert compat.resume_check(dict(straight), straight, None) == (True, "resumed = straight bit for bit")
    resumed = {"w": straight["w"] + 1e-4}
    ok, what = compat.resume_check(resumed, straight, None)
    assert not ok and what.startswith("resumed ≠ straight: 1 of 1 tensors differ") and "bit for bit expected" in what
    ok, what = compat.resume_check(resumed, straight, 1e-3)
    assert ok and "≤ 0.001 (stated tolerance)" in what
    assert not compat.resume_check(resumed, straight, 1e-5)[0]


def test_a_row_launches_a_straight_run_and_fails_when_it_differs(tmp_path, monkeypatch):
    """After the first and the resumed launch, a third launch runs straight to --resume-to with the same seed in
    its own folder; the artifacts are loaded in a fresh process (faked here) and the row is ✘ when they differ."""
    calls, requests = [], []

    def fake_launch(args, env, cwd, timeout):
        calls.append(args)
        out = Path(args[args.index("--output_dir") + 1])
        steps = int(args[args.index("--max_train_steps") + 1])
        for step in range(2, steps + 1, 2):
            (out / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
        resumed = "--resume_from_checkpoint" in args
        return {
            "code": 0,
            "output": "Resuming from checkpoint checkpoint-4" if resumed else "",
            "seconds": 1.0,
            "peak_rss": 0,
        }

    trained = {"t.lora_A.weight": torch.ones(2, 2), "t.lora_B.weight": torch.ones(2, 2)}

    def fake_load(spec, model, dirs=(), pretrained=None):
        requests.append(list(dirs))
        straight = dict(trained, **{"t.lora_B.weight": torch.full((2, 2), 2.0)})
        return {"loaded": [trained, straight], "initial": {}}

    monkeypatch.setattr(compat, "launch", fake_launch)
    monkeypatch.setattr(compat, "load_without_accel_npu", fake_load)
    monkeypatch.setattr(compat, "_master", lambda ckpt: trained)
    monkeypatch.setattr(compat, "_build", lambda kind, work: None)
    monkeypatch.setattr(compat, "shipped_zero_configs", lambda root: {"zero2": root / "z2.yaml"})
    spec = _spec("train_dreambooth_lora_sd3.py")
    row = compat.run_row(spec, "zero2", tmp_path, 4, 2, 6, 10)
    out, straight = tmp_path / f"{spec.name}-zero2", tmp_path / f"{spec.name}-zero2-straight"
    assert len(calls) == 3 and calls[2][-2:] == ["--max_train_steps", "6"]
    assert calls[2][calls[2].index("--output_dir") + 1] == str(straight) and "--resume_from_checkpoint" not in calls[2]
    assert calls[2][calls[2].index("--seed") + 1] == "0" and calls[2][:-2] == [
        str(straight) if a == str(out) else a for a in calls[0][:-2]
    ]
    assert requests == [[out, straight]]
    assert not row["ok"] and row["what"].startswith("resumed ≠ straight: 1 of 2 tensors differ")
    assert "2 tensors = master" in row["what"] and "trained: 1 LoRA B ≠ 0" in row["what"]
    assert row["whose"] == "unknown"  # the failed check's, not "loaded without accel-npu"'s


def test_the_commit_stamp_ignores_results_files_and_the_file_records_versions(tmp_path, monkeypatch):
    """A row is "+dirty" only when files other than results files differ from HEAD (the runner rewrites its own
    results file after every row: benchmarks/_results.py's git_state leaves them out); the header lists the
    library versions, peft among them; the headline counts official scripts only."""
    asked = []

    def git_state(root):
        asked.append(root)
        return "0123456789abcdef", changed

    monkeypatch.setattr(compat, "git_state", git_state)
    changed = []
    assert compat._commit() == "0123456" and asked == [compat.REPO]
    changed = ["tools/compatibility.py"]
    assert compat._commit() == "0123456+dirty"

    monkeypatch.setattr(compat, "RESULT_FILE", tmp_path / "compatibility.md")
    rows = {}
    for script, config, result in (
        ("train_text_to_image.py", "zero2", "✔"),
        ("train_text_to_image.py", "zero3_t0", "✘"),
        ("train_dit4dit.py", "zero2", "✔"),
    ):
        checks = compat.row_checks(_spec(script))
        rows[(f"`{script}`", config)] = [f"`{script}`", "F", config, result, checks, "x", "", "1 s", "1 GiB", "c", "d"]
    compat.write_rows(rows, ["compatibility.py"])
    text = (tmp_path / "compatibility.md").read_text()
    assert "- Libraries (the run that last wrote this file): torch " in text and ", peft " in text
    assert "Official scripts: 1 of 2 rows run are ✔ (1 scripts; ✔ per config: zero2 1 of 1, zero3_t0 0 of 1)" in text
    assert "2 of these rows ran the trained / straight-run / stock-load checks" in text
    assert "Users' own scripts, not counted: 1 of 1 rows ✔ (`train_dit4dit.py`)" in text


def test_a_row_written_before_the_checks_column_reads_as_checking_master_only(tmp_path):
    old = "| `a.py` | F | zero2 | ✔ | 64 tensors = master |  | 1 s | 1.00 GiB | abc1234+dirty | 2026-12-03 09:35 |"
    (tmp_path / "compatibility.md").write_text(old + "\n")
    row = compat.read_rows(tmp_path / "compatibility.md")[("`a.py`", "zero2")]
    assert row[3:6] == ["✔", compat.OLD_CHECKS, "64 tensors = master"] and len(row) == len(compat.HEADER)


@pytest.mark.slow
def test_git_state_leaves_the_results_files_out(tmp_path):
    """The stamp's source: in a checkout whose only change is a results file, git_state lists nothing."""
    from benchmarks._results import git_state

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "compatibility.md").write_text("a\n")
    (tmp_path / "code.py").write_text("a\n")
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run(git + cmd, check=True, capture_output=True)
    (tmp_path / "benchmarks" / "results" / "compatibility.md").write_text("b\n")
    assert git_state(tmp_path)[1] == []
    (tmp_path / "code.py").write_text("b\n")
    assert git_state(tmp_path)[1] == ["code.py"]


@pytest.mark.slow
def test_a_script_that_never_steps_and_a_tampered_artifact_are_crosses(tmp_path):
    """One short launch of a copy of train_dreambooth_lora_sd3.py without its backward (under DeepSpeed,
    accelerator.backward is where the engine steps; a script whose ranks all call save_state, which needs no
    step boundary): it checkpoints and saves its LoRA, which equals the master weights, loads without accel-npu,
    and is ✘ as not trained (LoRA B still zero). Then one value of the saved LoRA changed: ✘ against the master
    weights."""
    from safetensors.torch import load_file, save_file

    official = _spec("train_dreambooth_lora_sd3.py")
    text = official.script.read_text()
    assert text.count("accelerator.backward(loss)") == 1
    copy = tmp_path / "never_steps" / official.name
    copy.parent.mkdir()
    copy.write_text(text.replace("accelerator.backward(loss)", "pass  # never steps"))
    spec = dataclasses.replace(official, path=str(copy), cli={"resume": None})
    row = compat.run_row(spec, "zero2", tmp_path, 2, 2, 2, 600)
    assert not row["ok"] and row["what"].startswith("one launch (the script has no resume option); checkpoint-2: "), row
    assert "not trained: " in row["what"] and "LoRA B = 0" in row["what"], row
    assert "tensors = master" in row["what"] and "loaded without accel-npu" in row["what"], row

    out, model = tmp_path / f"{spec.name}-zero2", tmp_path / spec.builder / "model"
    (lora,) = out.glob("*.safetensors")
    tensors = load_file(str(lora))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1.0
    save_file(tensors, str(lora))
    ok, what = compat.compare_artifact(spec, model, out, out / "checkpoint-2")
    assert not ok and what.startswith("loaded artifact differs from the master weights: max |Δ| 1"), what


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


# a parent that waits on a child that waits on nothing: the shape of a launcher over ranks stuck in a collective
_IDLE_TREE = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
# a process that computes for 6 s, longer than the idle window, then exits 0
_BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 6: sum(range(10000))\nprint('done')"


@pytest.mark.slow
def test_a_launch_whose_whole_tree_sits_idle_is_killed_as_a_hang_and_a_busy_one_is_not(monkeypatch):
    started = time.monotonic()
    idle = compat.watch(_start(_IDLE_TREE), timeout=50, idle_s=3)
    assert idle["code"] == "idle" and idle["seconds"] < 20, idle
    assert time.monotonic() - started < 25  # killed with its child: communicate() did not wait 60 s
    # the negative: 6 s of work in a 3 s idle window, and the window off for the same idle tree
    busy = compat.watch(_start(_BUSY), timeout=50, idle_s=3)
    assert busy["code"] == 0 and "done" in busy["output"], busy
    off = compat.watch(_start("import time; time.sleep(4)"), timeout=50, idle_s=0)
    assert off["code"] == 0 and off["seconds"] >= 4, off
    monkeypatch.setattr(compat, "IDLE_TIMEOUT_S", 3.0)
    assert compat._killed("first launch", "idle", 900) == "first launch: every process idle for 3 s, a hang (killed)"
    assert compat._killed("first launch", 0, 900) is None

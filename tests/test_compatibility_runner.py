"""tools/compatibility.py's bookkeeping, without launching anything: which script each error is
blamed on, how a partial run merges into the results file, and that every vendored train_*.py has a
plan or a row saying why not."""

from __future__ import annotations

import sys
from pathlib import Path

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
        return [f"`{script}`", "F", config, result, "x", "", "1 s", "0.10 GiB", commit, "2026-01-01 00:00"]

    compat.write_rows(
        {("`a.py`", "zero2"): row("a.py", "zero2", "✘", "old"), ("`b.py`", "zero2"): row("b.py", "zero2", "✔", "old")},
        ["compatibility.py"],
    )
    compat.write_rows({("`a.py`", "zero2"): row("a.py", "zero2", "✔", "new")}, ["compatibility.py", "--only", "a"])
    rows = compat.read_rows(tmp_path / "compatibility.md")
    assert set(rows) == {("`a.py`", "zero2"), ("`b.py`", "zero2")}
    assert rows[("`a.py`", "zero2")][3::5] == ["✔", "new"] and rows[("`b.py`", "zero2")][3::5] == ["✔", "old"]


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
    planned = {s.name for s in compat.SPECS if s.script.is_relative_to(UPSTREAM_EXAMPLES)}
    not_run = {key[0].strip("`") for key in compat.not_run_rows(["c", "d"])}
    every = {p.name for p in UPSTREAM_EXAMPLES.rglob("train_*.py")}
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
        {(name, "all"): [name, "F", "all", "–", "not run: no tiny builder", "", "", "", "c", "d"]}, ["compatibility.py"]
    )
    compat.write_rows(
        {(name, "zero2"): [name, "F", "zero2", "✔", "x", "", "1 s", "0.10 GiB", "c", "d"]}, ["compatibility.py"]
    )
    assert set(compat.read_rows(tmp_path / "compatibility.md")) == {(name, "zero2")}

"""benchmarks/compatibility.py's bookkeeping, without launching anything: which script each error is
blamed on, how a partial run merges into the results file, and that every vendored train_*.py has a
plan or a row saying why not."""
from __future__ import annotations

import sys

from tests.launch_utils import REPO, UPSTREAM_EXAMPLES

sys.path.insert(0, str(REPO))

from benchmarks import compatibility as compat  # noqa: E402

SCRIPT = UPSTREAM_EXAMPLES / "cogvideo" / "train_cogvideox_lora.py"


def test_first_error_names_the_frame_outside_torch_and_known_causes():
    site = "/venv/lib/python3.11/site-packages"
    out = "\n".join([
        "Steps: 0%", "[rank1]: Traceback (most recent call last):",
        f'[rank1]:   File "{SCRIPT}", line 1449, in main',
        f'[rank1]:   File "{site}/diffusers/models/attention.py", line 10, in forward',
        f'[rank1]:   File "{site}/torch/nn/modules/linear.py", line 134, in forward',
        "[rank1]: ValueError: something the library refused",
        "[rank0]: RuntimeError: later, on the other rank"])
    assert compat.first_error(out, SCRIPT) == ("ValueError: something the library refused", "diffusers's")
    mine = out.replace(f"{site}/diffusers/models/attention.py", str(SCRIPT))
    assert compat.first_error(mine, SCRIPT)[1] == "the script's"
    dtype = out.replace("ValueError: something the library refused",
                        "RuntimeError: mat1 and mat2 must have the same dtype, but got Half and BFloat16")
    assert compat.first_error(dtype, SCRIPT)[1].startswith("the script's: fp16 frozen towers")
    ours = out.replace(f"{site}/diffusers/models/attention.py", f"{site}/accel_npu/plugins/loading/x.py")
    assert compat.first_error(ours, SCRIPT)[1] == "ours (accel-npu)"
    chained = "\n".join([
        "[rank0]: Traceback (most recent call last):", f'[rank0]:   File "{site}/diffusers/models/modeling_utils.py"',
        "[rank0]: AttributeError: 'M' object has no attribute 'get_parameter_or_buffer'", "[rank0]: ",
        "[rank0]: During handling of the above exception, another exception occurred:", "[rank0]: ",
        "[rank0]: Traceback (most recent call last):", f'[rank0]:   File "{SCRIPT}", line 1620, in main',
        f'[rank0]:   File "{site}/accel_npu/plugins/loading/placement/fsdp.py", line 246',
        "[rank0]: ValueError: not enough values to unpack (expected 2, got 1)"])
    assert compat.first_error(chained, SCRIPT) == ("ValueError: not enough values to unpack (expected 2, got 1)",
                                                   "ours (accel-npu)")
    warned = "UserWarning: not an error\nKeyError: 'x'"
    assert compat.first_error(warned, SCRIPT)[0] == "KeyError: 'x'"


def test_a_partial_run_replaces_its_rows_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "RESULT_FILE", tmp_path / "compatibility.md")
    row = lambda script, config, result, commit: [f"`{script}`", "F", config, result, "x", "", "1 s", "0.10 GiB",  # noqa: E731
                                                  commit, "2026-01-01 00:00"]
    compat.write_rows({("`a.py`", "zero2"): row("a.py", "zero2", "✘", "old"),
                       ("`b.py`", "zero2"): row("b.py", "zero2", "✔", "old")}, ["compatibility.py"])
    compat.write_rows({("`a.py`", "zero2"): row("a.py", "zero2", "✔", "new")}, ["compatibility.py", "--only", "a"])
    rows = compat.read_rows(tmp_path / "compatibility.md")
    assert set(rows) == {("`a.py`", "zero2"), ("`b.py`", "zero2")}
    assert rows[("`a.py`", "zero2")][3::5] == ["✔", "new"] and rows[("`b.py`", "zero2")][3::5] == ["✔", "old"]


def test_every_vendored_torch_script_has_a_plan_or_a_row_saying_why_not():
    planned = {s.name for s in compat.SPECS}
    assert all((UPSTREAM_EXAMPLES / s.path).is_file() for s in compat.SPECS)
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

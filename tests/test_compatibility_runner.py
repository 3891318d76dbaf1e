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
    lcm = UPSTREAM_EXAMPLES / "consistency_distillation" / "train_lcm_distill_lora_sdxl.py"
    dropped = "64 of 158 master tensors not in the loaded artifact"
    assert compat._whose("", dropped, lcm).startswith("diffusers': ")  # a cause scoped to one script
    assert compat._whose("", dropped, SCRIPT) == "unknown"
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

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


def test_launch_args_follow_each_scripts_own_flags(tmp_path):
    by_name = {s.name: s for s in compat.SPECS}
    args = lambda name, **kw: compat.launch_args(by_name[name], tmp_path / "c.yaml", tmp_path, tmp_path / "o",  # noqa: E731
                                                 2, 6, **kw)
    plain = args("train_text_to_image_lora.py")
    assert plain[plain.index("--pretrained_model_name_or_path") + 1] == str(tmp_path / "model")
    assert plain[-2:] == ["--max_train_steps", "6"] and "--seed" in plain
    # train_unconditional.py builds its model from a config, has no --seed and counts epochs (2 steps each)
    uncond = args("train_unconditional.py", resume=True)
    assert not {"--pretrained_model_name_or_path", "--seed", "--max_train_steps"} & set(uncond)
    assert uncond[-4:] == ["--num_epochs", "3", "--resume_from_checkpoint", "latest"]
    lcm = args("train_lcm_distill_sd_wds.py")
    assert lcm[lcm.index("--pretrained_teacher_model") + 1] == str(tmp_path / "model")
    assert lcm[lcm.index("--train_shards_path_or_url") + 1] == f"{tmp_path}/shards/shard-{{000000..000001}}.tar"


def test_a_specs_own_causes_name_whose_error_it_is():
    out = "\n".join(["[rank0]: Traceback (most recent call last):",
                     '[rank0]:   File "/v/lib/python3.11/site-packages/deepspeed/runtime/zero/stage_1_and_2.py", line 2229',
                     "[rank0]: IndexError: list index out of range"])
    advanced = next(s for s in compat.SPECS if s.name == "train_dreambooth_lora_sd15_advanced.py")
    assert compat.first_error(out, SCRIPT) == ("IndexError: list index out of range", "deepspeed's")
    assert compat.first_error(out, SCRIPT, advanced.causes)[1].startswith("the script's: its load_model_hook")


def test_peft_wrapped_lora_keys_match_the_pipelines():
    assert compat._norm("base_model.model.up_blocks.0.attn.to_q.lora_A.default.weight") == \
        compat._norm("up_blocks.0.attn.to_q.lora_A.default_0.weight") == "up_blocks.0.attn.to_q.lora_A.weight"


def test_a_script_given_a_spec_loses_its_not_run_row(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "RESULT_FILE", tmp_path / "compatibility.md")
    name = f"`{compat.SPECS[0].name}`"
    stale = [name, "F", "all", "–", "not run: no tiny builder", "", "", "", "old", "2026-01-01 00:00"]
    compat.write_rows({(name, "all"): stale}, ["compatibility.py"])
    ran = [name, "F", "zero2", "✔", "x", "", "1 s", "0.10 GiB", "new", "2026-01-02 00:00"]
    compat.write_rows({(name, "zero2"): ran}, ["compatibility.py", "--only", "x"])
    assert set(compat.read_rows(tmp_path / "compatibility.md")) == {(name, "zero2")}

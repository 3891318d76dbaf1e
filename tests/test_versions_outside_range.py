"""A library outside accel-npu's declared ranges (accelerate 1.9.0, pip-installed into a folder first on
PYTHONPATH: one release below the range, as a new release is one above it): the patches it switches off are
listed by `accel-npu env` with what each fixes, and a launch warns once, naming them, before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.launch_utils import BIN, base_env, explain, torchrun_launch

OUTSIDE = "1.9.0"


def _accelerate_outside_the_range(tmp_path):
    site = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--no-deps",
            "--target",
            str(site),
            f"accelerate=={OUTSIDE}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def _accelerate_patches():
    """The accelerate patches OUTSIDE switches off: not those declaring it stock correct (sequence parallelism's,
    for an accelerate without a parallelism config)."""
    from packaging.requirements import Requirement

    from tests.inprocess import declared_patches

    def stock_correct_at_outside(patch) -> bool:
        return bool(patch.stock_correct) and Requirement(patch.stock_correct).specifier.contains(OUTSIDE)

    return {
        p.target for p in declared_patches() if p.supports.startswith("accelerate") and not stock_correct_at_outside(p)
    }


@pytest.mark.slow
def test_a_library_outside_its_range_is_named_by_env_and_by_one_launch_warning(tmp_path):
    env = _accelerate_outside_the_range(tmp_path)
    expected = _accelerate_patches()
    assert len(expected) > 10
    proc = subprocess.run(
        [str(BIN / "accel-npu"), "env", "--json"], env=env, capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["versions"]["accelerate"] == OUTSIDE
    off = {
        p["target"]: p
        for p in report["patches"]
        if f"accelerate {OUTSIDE} is outside the supported range" in p["status"]
    }
    assert set(off) == expected, sorted(set(off) ^ expected)
    assert all(p["reason"] and p["status"].startswith("skipped: ") for p in off.values())

    script = tmp_path / "noop.py"
    script.write_text("print('RESULT {\"ran\": true}')\n")
    launch = torchrun_launch([str(script)], env=env, nproc=1)
    assert launch.returncode == 0, explain(launch)
    warnings = [
        line
        for line in (launch.stdout + launch.stderr).splitlines()
        if f"patch(es) are off for accelerate {OUTSIDE}" in line
    ]
    assert len(warnings) == 1, explain(launch)
    assert all(target in warnings[0] for target in expected)
    assert "accelerate.state:PartialState._prepare_backend" in warnings[0]

    # inside the ranges: no such warning
    inside = torchrun_launch([str(script)], nproc=1)
    assert inside.returncode == 0 and "are off for" not in inside.stdout + inside.stderr, explain(inside)

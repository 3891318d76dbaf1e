"""The version matrix: one nox session per version set.

    pip install nox
    nox -l                                   # the sessions
    nox -s lower                             # one set: fresh venv, every check, a results row
    nox -s lower -- quick                    # every check but the official scripts
    nox -r -s newest                         # reuse its venv (-r; never -R, which skips the installs)

Each session snapshots the working tree (tracked + untracked, not ignored files) into the session's
tmp dir, so a checkout edited while it runs does not mix two versions; installs torch first (2.13.0 is
the CPU build from local disk, any other version the registry's build), then the snapshot
NON-editable with its test extra and the set's pins in one resolve; then runs, from the snapshot's root:

- lifecycle: ``pytest tests/test_patch_lifecycle.py tests/test_import_order.py``
- env: ``accel-npu env --json`` checked by ``benchmarks/versions.py check-env`` (no patch skipped for a
  version inside its declared range; every skipped one named)
- gated: GATED_TESTS, the tests of patches whose need depends on the version (stock_correct)
- main_job: README's ``accelerate launch --config_file launch_configs/cpu_zero3.yaml docs/examples/train_dit.py``
- examples: ``pytest tests/test_example_plugin.py`` (docs/examples/accel-npu-dit4dit, a plugin a repository ships:
  pip-installed, listed by ``accel-npu env``, its patch applied, blockable by name)
- official: tests/test_upstream_text_to_image.py (ZeRO-3 threshold 0), tests/test_upstream_qwen_lora.py
  (Qwen-Image DreamBooth LoRA), tests/test_upstream_cogvideox_lora.py (CogVideoX LoRA), each with
  checkpoint + resume; the scripts of the installed diffusers' release (tests.launch_utils.RELEASE_EXAMPLES)

and appends its row (exact versions, commit, dirty flag, date, pass/fail and first error per check,
seconds) to benchmarks/results/versions.json, re-rendering benchmarks/results/versions.md. A failed
check fails the session after the row is written.

A set with ``lift`` tests versions above a declared cap before the cap is raised: the snapshot's
setup.cfg and every ``supports=`` string get that library's upper bound replaced (only in the
snapshot), and the machine's pip constraint file (which caps torch) is replaced by an empty one for
that session's installs (PIP_CONSTRAINT=/dev/null), never deleted; so is it for a set marked
``past_machine_cap`` (a torch release newer than the machine's cap, inside the declared range).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nox

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "benchmarks"))
import versions as results  # noqa: E402  (benchmarks/versions.py: standard library only at import)

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lower"]

SETS = results.SETS  # benchmarks/versions.py: the version sets, readable without nox (tests check them)
# tests of the patches whose need depends on the version (a stock_correct range or a variant per
# range): each asserts stock's behaviour at the installed version against what the patch declares
GATED_TESTS = [
    "tests/test_upstream_cogvideox_lora.py::"
    "test_a_zero3_model_cast_after_partitioned_loading_trains_in_the_configured_dtype",
    # hang watch's single-tensor collectives exist from torch 2.13 (stock_correct below it)
    "tests/test_hang_diagnosis.py::test_stalled_rank_named_with_stacks_and_the_job_fails_where_stock_waits_on",
    "tests/test_stock_paths.py::test_torchscript_compiles_every_wrapped_torch_callable_as_stock",
]
OFFICIAL_TESTS = [
    "tests/test_upstream_text_to_image.py",
    "tests/test_upstream_qwen_lora.py",
    "tests/test_upstream_cogvideox_lora.py",
]
# every check's tests, the slow ones (they start processes) included
PYTEST = ["-m", "pytest", "-q", "--runslow", "-p", "no:cacheprovider"]
ERROR_LINE = re.compile(r"\b\w*(Error|Exception|error)\b:? ")


def first_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines()]
    for prefix in ("E   ", "FAILED ", "ERROR "):
        for line in output.splitlines():
            if line.startswith(prefix):
                return line.strip()[:300]
    for line in lines:
        if ERROR_LINE.search(line) and "Warning" not in line:
            return line[:300]
    return (lines[-1] if lines else "")[:300]


def run_check(session, name, cmd, cwd, env, logs, ok=lambda out: True, timeout=3600):
    session.log(f"[{name}] {' '.join(cmd)}")
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}{exc.stderr or ''}\nTimeoutExpired: {timeout} s", -1
    seconds = time.time() - start
    (logs / f"{name}.log").write_text(out)
    passed = rc == 0 and ok(out)
    result = {
        "result": "pass" if passed else "fail",
        "seconds": round(seconds, 1),
        "rc": rc,
        "log": str(logs / f"{name}.log"),
    }
    if not passed:
        result["first_error"] = first_error(out) if rc != 0 else "exit 0 but the expected output is missing"
    session.log(
        f"[{name}] {result['result']} in {seconds:.0f} s" + (f": {result.get('first_error')}" if not passed else "")
    )
    return result


def _check_installed_is_the_snapshot(session, src: Path) -> None:
    """The accel-npu the venv holds is the snapshot's, file for file: ``nox -R`` (``--no-install``) skips
    every install, and a row would then record a reused venv's older accel-npu under this commit."""
    probe = (
        "import pathlib, sys, accel_npu, accel_npu.plugins as p\n"
        "root = pathlib.Path(sys.argv[1])\n"
        "for pkg, src in ((accel_npu, root / 'accel_npu'), (p, root / 'plugins')):\n"
        "    for f in src.rglob('*.py'):\n"
        "        if (pathlib.Path(pkg.__path__[0]) / f.relative_to(src)).read_bytes() != f.read_bytes():\n"
        "            sys.exit(f'differs from the snapshot: {f.relative_to(root)}')\n"
    )
    proc = subprocess.run(
        [str(Path(session.bin) / "python"), "-c", probe, str(src)], cwd="/", capture_output=True, text=True
    )
    if proc.returncode != 0:
        session.error(
            f"the installed accel-npu is not this snapshot ({proc.stderr.strip()[-300:]}); "
            "nox -R skips installs: use -r (--reuse-existing-virtualenvs) to reuse a venv"
        )


def matrix_session(session, name: str, spec: dict) -> None:
    started = time.time()
    wanted = set(results.CHECKS)
    for arg in session.posargs:
        if arg == "quick":  # CI's subset
            wanted.discard("official")
        elif arg.startswith("only="):  # e.g. only=official: the other checks keep their last row's result
            wanted = set(arg[len("only=") :].split(","))
    lift = spec.get("lift", {})
    tmp = Path(session.create_tmp()).resolve()
    src = tmp / "src"
    commit, dirty, changed = results.git_state(REPO)
    results.snapshot(REPO, src, lift)
    pip_env = {"PIP_CONSTRAINT": "/dev/null"} if lift.get("torch") or spec.get("past_machine_cap") else {}
    # --no-compile: modules are byte-compiled when first imported, not all of them at install (minutes of CPU)
    session.install("--no-compile", "setuptools", "wheel", "packaging", env=pip_env)
    session.install("--no-compile", spec["torch"], env=pip_env)
    # deepspeed's sdist imports torch in its setup.py: built against the session's torch, not an isolated one
    # torch again in this resolve: otherwise pip upgrades it for a library's newest release (accelerate 1.16
    # needs a newer torch than 2.5.1) instead of resolving that library's release for the set's torch
    session.install(
        "--no-compile", "--no-build-isolation", spec["torch"], f"{src}[test]", "matplotlib", *spec["pins"], env=pip_env
    )

    bin_dir = Path(session.bin)
    _check_installed_is_the_snapshot(session, src)
    env = {
        **os.environ,
        **pip_env,
        **spec.get("env", {}),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(bin_dir.parent),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)
    py = str(bin_dir / "python")
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    versions = subprocess.run(
        [
            py,
            "-c",
            "import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            f"for d in {results.DISTS!r} + ('accel-npu',):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: out[d] = None\n"
            "out['python'] = sys.version.split()[0]\n"
            "print(json.dumps(out))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    versions = json.loads(versions)
    session.log(f"versions: {versions}")

    checks = {}
    if "lifecycle" in wanted:
        checks["lifecycle"] = run_check(
            session,
            "lifecycle",
            [py, *PYTEST, "tests/test_patch_lifecycle.py", "tests/test_import_order.py"],
            src,
            env,
            logs,
        )
    if "env" in wanted:
        env_json = logs / "env.json"
        with open(env_json, "w") as f:
            subprocess.run([str(bin_dir / "accel-npu"), "env", "--json"], cwd=tmp, env=env, stdout=f, check=False)
        # the installed metadata is the snapshot's: a lifted cap is already the declared range there
        checks["env"] = run_check(
            session,
            "env",
            [py, str(src / "benchmarks" / "versions.py"), "check-env", "--env-json", str(env_json)],
            src,
            env,
            logs,
        )
    if "gated" in wanted:
        checks["gated"] = run_check(session, "gated", [py, *PYTEST, *GATED_TESTS], src, env, logs)
    out_dir = tmp / "main_job"
    shutil.rmtree(out_dir, ignore_errors=True)
    if "main_job" in wanted:
        checks["main_job"] = run_check(
            session,
            "main_job",
            [
                str(bin_dir / "accelerate"),
                "launch",
                "--config_file",
                "launch_configs/cpu_zero3.yaml",
                "docs/examples/train_dit.py",
                "--output_dir",
                str(out_dir / "out"),
                "--cache_dir",
                str(out_dir / "cache"),
            ],
            src,
            env,
            logs,
            ok=lambda out: "Loss table" in out and (out_dir / "out" / "transformer").is_dir(),
        )
    if "examples" in wanted:
        checks["examples"] = run_check(
            session, "examples", [py, *PYTEST, "tests/test_example_plugin.py"], src, env, logs
        )
    if "official" in wanted:
        checks["official"] = run_check(session, "official", [py, *PYTEST, *OFFICIAL_TESTS], src, env, logs)

    row = {
        "session": name,
        "versions": versions,
        "requested": [spec["torch"], *spec["pins"]],
        "lifted": [f"{d}<{cap}" for d, cap in lift.items()],
        "env": spec.get("env", {}),
        "commit": commit,
        "dirty": dirty,
        "changed_files": changed,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "wall_s": round(time.time() - started, 1),
        "checks": checks,
    }
    results.append_row(row)
    failed = [c for c, r in checks.items() if r["result"] != "pass"]
    if failed:
        session.error(f"{name}: failed: {', '.join(failed)} (benchmarks/results/versions.md)")


def _define(name: str, spec: dict) -> None:
    def session_fn(session):
        matrix_session(session, name, spec)

    session_fn.__doc__ = (
        (f"Python {spec['python']}: " if spec.get("python") else "")
        + f"{spec['torch']} {' '.join(spec['pins'])}".strip()
        + (f" (caps lifted: {spec['lift']})" if spec.get("lift") else "")
    )
    nox.session(name=name, python=spec.get("python"))(session_fn)


for _name, _spec in SETS.items():
    _define(_name, _spec)

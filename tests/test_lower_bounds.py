"""The version matrix's lower set, quick subset, in CI: every install_requires lower bound together
(benchmarks/versions.py SETS["lower"]: accelerate 1.10.1, deepspeed 0.16.9, diffusers 0.35.2,
transformers 4.57.6, ...) installed non-editable into a fresh venv, then the patch lifecycle and
import-order tests and README's main job run in it.

torch is CI's own (2.13.0, the CPU build this machine has on disk): the lower set's torch 2.5.1 exists on
the registry only as a CUDA build (about 6 GB installed), which ``nox -s lower`` installs; its row in
benchmarks/results/versions.md is the torch floor's evidence. Everything else is the set's pins.
"""

from __future__ import annotations

import subprocess
import sys
import venv

import pytest

from tests.launch_utils import REPO, base_env, explain, source_tree

sys.path.insert(0, str(REPO / "benchmarks"))
import versions as matrix  # benchmarks/versions.py: the version sets, standard library only

pytestmark = pytest.mark.slow


def _torch_here() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch").split("+")[0]


def _venv_env(**extra: str) -> dict[str, str]:
    """base_env for the processes that run in the lower venv, with bytecode caching on: the venv is installed
    --no-compile, so where PYTHONDONTWRITEBYTECODE=1 is set every one of them (the inner pytest, its import-order
    subprocesses, the launcher and both ranks) would compile each module of torch, transformers, diffusers and
    deepspeed it imports again; without it the first import writes the bytecode the others read."""
    env = base_env(**extra)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


@pytest.fixture(scope="module")
def lower_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("lower")
    source_tree(root / "src")  # the tree's files, as a matrix session installs them
    venv.create(root / "venv", with_pip=True)
    py = root / "venv" / "bin" / "python"
    pins = matrix.SETS["lower"]["pins"]
    # --no-compile: modules are byte-compiled when first imported; pip would compile every module it installs
    # (transformers and diffusers alone: about 20 s of CPU), most of which no test imports
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile"]
    steps = [
        [*pip, "setuptools", "wheel", f"torch=={_torch_here()}"],
        # non-editable, the set's pins in one resolve (deepspeed's sdist imports torch in its setup.py)
        [
            *pip,
            "--no-build-isolation",
            f"torch=={_torch_here()}",
            str(root / "src"),
            "matplotlib",
            "pytest",
            "pytest-timeout",
            "decord==0.6.0",
            *pins,
        ],
    ]  # README installs matplotlib too
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    found = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.metadata as m, sys\nfor d in sys.argv[1:]: print(d, m.version(d))",
            *(p.split("==")[0] for p in pins),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert sorted(found.split("\n")[:-1]) == sorted(p.replace("==", " ") for p in pins), found
    return root


def test_lifecycle_and_import_order_at_the_lower_bounds(lower_venv):
    py = lower_venv / "venv" / "bin" / "python"
    proc = subprocess.run(
        [
            str(py),
            "-m",
            "pytest",
            "-q",
            "--runslow",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "tests/test_patch_lifecycle.py",
            "tests/test_import_order.py",
        ],
        cwd=lower_venv / "src",
        env=_venv_env(),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]


def test_readme_main_job_at_the_lower_bounds(lower_venv):
    bin_dir = lower_venv / "venv" / "bin"
    out = lower_venv / "main_job"
    env = _venv_env(PATH=f"{bin_dir}:{base_env().get('PATH', '')}", VIRTUAL_ENV=str(bin_dir.parent))
    proc = subprocess.run(
        [
            str(bin_dir / "accelerate"),
            "launch",
            "--config_file",
            "launch_configs/cpu_zero3.yaml",
            "docs/examples/train_dit.py",
            "--output_dir",
            str(out / "out"),
            "--cache_dir",
            str(out / "cache"),
        ],
        cwd=lower_venv / "src",
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, explain(proc)
    # witnesses: the saved transformer loads with the lower set's diffusers, its weights moved from the initial ones
    check = subprocess.run(
        [
            str(bin_dir / "python"),
            "-c",
            "import sys, diffusers, torch\n"
            "from diffusers import QwenImageTransformer2DModel as T\n"
            "trained, initial = T.from_pretrained(sys.argv[1]), T.from_pretrained(sys.argv[2])\n"
            "moved = sum(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(),\n"
            "                                                  initial.state_dict().values()))\n"
            "print(diffusers.__version__, moved)",
            str(out / "out" / "transformer"),
            str(out / "cache" / "qwen-image" / "transformer"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    version, moved = check.stdout.split()[-2:]
    assert version == "0.35.2" and int(moved) > 0, check.stdout

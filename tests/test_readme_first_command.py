"""README.md's first command, verbatim, in a fresh clone and a fresh venv: the way a new user meets
accel-npu (a non-editable `pip install .`, then `accelerate launch` from the repository root).

"Fresh clone": the files git tracks (plus untracked, not ignored ones, so a working tree is
tested as it would be committed), copied into an empty directory. The environment is stripped of
this test run's venv, so the command builds its own `.venv` exactly as written.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO, explain, source_tree

README = REPO / "README.md"


def first_command() -> str:
    block = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1).splitlines()
    assert block[0].startswith("# install and run the main job")
    return block[1]


def user_environment() -> dict[str, str]:
    """A shell as a new user has it: no venv active, no PYTHONPATH, the system python3 on PATH."""
    venv_bin = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_NPU_", "ACCELERATE_", "VIRTUAL_ENV", "PYTHON"))
    }
    env.update(PATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def test_readme_first_command_is_the_documented_shape():
    command = first_command()
    assert "pip install torch==2.13.0" in command and "pip install . " in command
    assert "-e ." not in command, "the README installs as users do: not editable"
    assert command.endswith("accelerate launch --config_file launch_configs/cpu_zero3.yaml docs/examples/train_dit.py")


@pytest.mark.slow
def test_readme_first_command_verbatim_in_a_fresh_clone(tmp_path):
    clone = source_tree(tmp_path / "accel-npu")
    proc = subprocess.run(
        ["bash", "-c", first_command()], cwd=clone, env=user_environment(), capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout + proc.stderr
    # Every worker activated: no plugin failed to load anywhere.
    assert "failed to load" not in out and "no built-in plugin loads" not in out, explain(proc)
    # Installed non-editably: the venv holds a copy, not a link to the clone.
    site = next((clone / ".venv" / "lib").glob("python*/site-packages"))
    assert (site / "accel_npu" / "plugins" / "__init__.py").is_file()
    assert not list(site.glob("__editable__*accel_npu*"))

    result = clone / "outputs" / "train_dit"
    png = (result / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    history = json.loads((result / "loss_history.json").read_text())
    assert history, "a loss history"
    # The consolidated transformer: a diffusers directory whose tensors all have data.
    from safetensors import safe_open

    transformer = result / "transformer"
    config = json.loads((transformer / "config.json").read_text())
    assert config["_class_name"] == "QwenImageTransformer2DModel"
    shards = sorted(transformer.glob("*.safetensors"))
    assert shards
    shapes = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    assert shapes and all(all(d > 0 for d in shape) for shape in shapes.values()), shapes

"""docs/examples/accel-npu-dit4dit: a plugin shipped by a repo, really pip-installed.

Installed with pip into a private target directory that the processes below get on PYTHONPATH
(so other people's tests running in the same venv never see it); uninstalling is deleting it.
Each check runs in a fresh process, as a user would: `accel-npu env`, then the repo's own code.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import BIN, REPO, base_env

DIST = REPO / "docs" / "examples" / "accel-npu-dit4dit"
TARGET = "dit4dit_mini.evaluation:eval_action_model"
STOCK_ERROR = "The size of tensor a (16) must match the size of tensor b (8) at non-singleton dimension 1"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(DIST),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (target / "accel_npu_dit4dit-0.1.0.dist-info" / "entry_points.txt").is_file()
    return target


def run(site: Path, args: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, env=base_env(PYTHONPATH=str(site), **env), capture_output=True, text=True, timeout=180, cwd="/"
    )


def env_report(site: Path, **env) -> dict:
    proc = run(site, [str(BIN / "accel-npu"), "env", "--json"], **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed's logger writes to stdout when it gets imported; the JSON document starts at "{".
    return json.loads(proc.stdout[proc.stdout.index("{\n") :])


@pytest.mark.slow
def test_listed_by_accel_npu_env_with_its_patch_applied(site):
    text = run(site, [str(BIN / "accel-npu"), "env"])
    assert text.returncode == 0, text.stderr[-3000:]
    out = text.stdout
    assert "  dit4dit        loaded     entry point (accel-npu-dit4dit) accel_npu_dit4dit.plugin 0.1.0\n" in out
    assert f"  [applied] {TARGET}  (plugin dit4dit; supports accel-npu-dit4dit>=0.1,<0.2)\n" in out
    assert "      why: DiT4DiT pitfall 7.6: eval feeds obs_horizon (16)" in out
    assert "## DiT4DiT (accel-npu-dit4dit)\n  version            0.1.0\n  eval_action_model  applied\n" in out


@pytest.mark.slow
def test_fix_applies_to_the_repos_unchanged_eval_code(site):
    fixed = run(site, [sys.executable, "-m", "dit4dit_mini"])
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert fixed.stdout.strip() == "eval action mse: 0.0123"
    assert "truncating to action_horizon=8 as the training path does (pitfall 7.6)" in fixed.stderr
    # Stock: the same command without accel-npu fails with the eval path's shape mismatch.
    stock = run(site, [sys.executable, "-m", "dit4dit_mini"], ACCEL_NPU_DISABLE="1")
    assert stock.returncode != 0 and STOCK_ERROR in stock.stderr


@pytest.mark.slow
def test_blocked_by_name(site):
    report = env_report(site, ACCEL_NPU_DISABLED_PLUGINS="dit4dit")
    assert {p["name"]: p for p in report["plugins"]}["dit4dit"]["status"] == "blocked"
    assert not any(p["target"] == TARGET for p in report["patches"])
    assert "DiT4DiT (accel-npu-dit4dit)" not in report["sections"]
    # The built-ins are still there: only the named plugin is blocked.
    assert {p["name"]: p for p in report["plugins"]}["devices.cpu"]["status"] == "loaded"
    unfixed = run(site, [sys.executable, "-m", "dit4dit_mini"], ACCEL_NPU_DISABLED_PLUGINS="dit4dit")
    assert unfixed.returncode != 0 and STOCK_ERROR in unfixed.stderr


LAUNCH_ENV_PROBE = """
from accel_npu._torch.nodes import SINGLE
from accel_npu.backend import Backend
from accel_npu.manager import get_plugin_manager
pm = get_plugin_manager()
for name in ("npu", "cpu"):
    backend = Backend(name=name, device_type=name, dist_backend="hccl" if name == "npu" else "gloo")
    merged = {}
    for defaults in pm.hook.accel_npu_launch_env(backend=backend, env={}, nodes=SINGLE, launching=True):
        merged.update(defaults or {})
    print(name, merged.get("WANDB_MODE"), merged.get("TASK_QUEUE_ENABLE"))
"""


@pytest.mark.slow
def test_launch_default_for_ascend_workers(site):
    """The plugin's accel_npu_launch_env default, called through the plugin manager as the launcher does."""
    proc = run(site, [sys.executable, "-c", LAUNCH_ENV_PROBE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["npu offline 2", "cpu None None"]

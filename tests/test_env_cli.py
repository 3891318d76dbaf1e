"""`accel-npu env` prints exactly the plugins and patches the code declares, and which applied."""

import json
import subprocess

import pytest

from accel_npu.scopes import CUDA_FACADE
from tests.inprocess import declared_patches as _declared_patches
from tests.launch_utils import BIN, base_env


def _declared():
    from accel_npu.manager import DEFAULT_PLUGINS

    return {name for name, _ in DEFAULT_PLUGINS}, {p.target for p in _declared_patches()}


def _run(*args, **env):
    proc = subprocess.run(
        [str(BIN / "accel-npu"), "env", *args],
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_env_json_lists_exactly_declared_plugins_and_patches():
    plugins, targets = _declared()
    report = json.loads(_run("--json"))
    builtin = {p["name"] for p in report["plugins"] if p["source"].startswith("builtin")}
    assert builtin == plugins
    assert {p["target"] for p in report["patches"]} == targets
    # `accel-npu env` imports every target: with every targeted library installed (CI), all apply, but the
    # CUDA façade family, which a process no launcher started leaves stock (and says why)
    facade = {p.target for p in _declared_patches() if p.scope is CUDA_FACADE}
    assert facade and [p for p in report["patches"] if p["status"] != "applied" and p["target"] not in facade] == []
    assert {p["status"] for p in report["patches"] if p["target"] in facade} == {
        "inactive here: not a launched rank (accelerate launch / torchrun); ACCEL_NPU_CUDA_FACADE=1 turns it on here"
    }
    for environ in ({"ACCEL_NPU_CUDA_FACADE": "1"}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}):
        opted_in = json.loads(_run("--json", **environ))
        assert [p for p in opted_in["patches"] if p["status"] != "applied"] == [], environ
    assert report["backend"]["name"] == "cpu"
    assert report["activation"]["active in this process"] is True
    assert set(report["environment"]) >= {"ACCEL_NPU_DISABLE", "ACCEL_NPU_DISABLED_PLUGINS", "ACCEL_NPU_TRACE"}
    assert report["versions"]["torch"].startswith("2.")


@pytest.mark.slow
def test_env_text_is_pasteable_and_shows_why():
    _, targets = _declared()
    text = _run()
    for target in targets:
        assert target in text
    assert "why: " in text and "remove when: " in text and "## Plugins" in text


@pytest.mark.slow
def test_env_when_disabled_says_so():
    report = json.loads(_run("--json", ACCEL_NPU_DISABLE="1"))
    assert report["activation"]["disabled (ACCEL_NPU_DISABLE)"] is True
    assert report["activation"]["active in this process"] is False
    assert all(p["status"] != "applied" for p in report["patches"])


@pytest.mark.slow
def test_env_reports_a_target_that_fails_to_import_as_failed(tmp_path):
    """A target module that raises on import is a failure to show, not a "skip"."""
    (tmp_path / "decord").mkdir()
    (tmp_path / "decord" / "__init__.py").write_text("raise ImportError('decord is broken here')\n")
    report = json.loads(_run("--json", PYTHONPATH=str(tmp_path)))
    statuses = {p["target"]: p["status"] for p in report["patches"]}
    broken = {t: s for t, s in statuses.items() if t.startswith("decord.")}
    assert broken and all(
        s.startswith("failed: cannot import decord.") and "decord is broken here" in s for s in broken.values()
    ), broken

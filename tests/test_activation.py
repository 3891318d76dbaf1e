"""Activation inside `import torch`, the opt-outs, broken and third-party plugins — in fresh processes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, run_concurrently

PLUGIN_DIST = Path(__file__).parent / "plugin_dist"

PROBE = r"""
import json, sys, inspect
import torch
import accel_npu, wrapt
import accelerate.state as st
from accel_npu.patching import get_ledger
wrapped = isinstance(inspect.getattr_static(st.PartialState, "_prepare_backend"), wrapt.FunctionWrapper)
print("RESULT " + json.dumps({"active": accel_npu.is_active(), "prepare_backend_wrapped": wrapped,
      "applied": sorted(p.target for p in get_ledger().patches if p.applied),
      "applied_by": sorted({p.plugin for p in get_ledger().patches if p.applied})}))
"""


def probe(**env):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=base_env(**env), capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[7:]), proc


@pytest.mark.slow
def test_importing_the_patched_stack_activates():
    result, _ = probe()
    assert result["active"] and result["prepare_backend_wrapped"]
    assert "accelerate.state:PartialState._prepare_backend" in result["applied"]


DEFERRED = r"""
import inspect, json, sys
import torch
# a torch patch outside the CUDA façade family (which applies in launched ranks only)
wrapped = lambda: type(inspect.getattr_static(torch.Tensor, "numpy")).__name__ == "FunctionWrapper"
deferred = {"pluggy": "pluggy" in sys.modules, "wrapt": "wrapt" in sys.modules,
            "plugins": sorted(m for m in sys.modules if m.startswith("accel_npu.plugins")),
            "torch_patch_wrapped": wrapped()}
import accelerate
deferred["after_accelerate"] = wrapped()
print("RESULT " + json.dumps(deferred))
"""


@pytest.mark.parametrize(
    "environ, at_import_torch", [({}, False), ({"LOCAL_RANK": "0"}, True)], ids=["plain-process", "launched-rank"]
)
@pytest.mark.slow
def test_import_torch_alone_waits_for_the_patched_stack_except_in_a_launched_rank(environ, at_import_torch):
    """`import torch` in a process that uses nothing accel-npu patches (a compile worker, a quick
    `python -c`) loads no plugin, not even pluggy or wrapt; the first trigger import (here accelerate)
    activates, before its body runs, and the torch patches come with it. A launched rank (LOCAL_RANK)
    activates inside `import torch`, as on an Ascend machine."""
    proc = subprocess.run(
        [sys.executable, "-c", DEFERRED], env=base_env(**environ), capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert result["after_accelerate"], result
    if at_import_torch:
        assert result["pluggy"] and result["wrapt"] and result["plugins"] and result["torch_patch_wrapped"], result
    else:
        assert result == {
            "pluggy": False,
            "wrapt": False,
            "plugins": [],
            "torch_patch_wrapped": False,
            "after_accelerate": True,
        }, result


EXPLICIT_WHILE_WAITING = r"""
import inspect, json
import torch                 # a plain process: activation waits for a trigger import
import accel_npu
accel_npu.patch()            # explicit activation meanwhile (the npu plugin looks up torch_npu, a trigger)
active = accel_npu.is_active()
accel_npu.unpatch()
import accelerate.state as st  # the first trigger import after unpatch() must not re-arm
wrapped = type(inspect.getattr_static(st.PartialState, "_prepare_backend")).__name__ == "FunctionWrapper"
print("RESULT " + json.dumps({"active": active, "after_unpatch": accel_npu.is_active(), "wrapped": wrapped}))
"""


@pytest.mark.slow
def test_explicit_activation_while_waiting_neither_deadlocks_nor_rearms_later():
    proc = subprocess.run(
        [sys.executable, "-c", EXPLICIT_WHILE_WAITING],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert result == {"active": True, "after_unpatch": False, "wrapped": False}, result


def test_when_import_torch_activates_at_once():
    from accel_npu.activation.triggers import activate_now

    no, yes = (lambda: False), (lambda: True)
    plain = dict(modules={"torch": object()}, environ={}, npu_installed=no, third_party_plugins=no)
    assert not activate_now(**plain)
    assert activate_now(**dict(plain, modules={"torch": object(), "accelerate": object()}))  # accelerate first
    assert activate_now(**dict(plain, environ={"LOCAL_RANK": "1"}))  # a launched rank
    assert not activate_now(**dict(plain, environ={"LOCAL_RANK": ""}))
    assert activate_now(**dict(plain, npu_installed=yes))  # an Ascend machine
    assert activate_now(**dict(plain, third_party_plugins=yes))  # a plugin may patch anything


def test_third_party_plugins_declared_reads_what_importlib_metadata_parses(tmp_path, monkeypatch):
    """The quick check (a substring of each entry_points.txt) agrees with importlib.metadata's own
    parse of the group, for a distribution on sys.path that declares it and for one that does not."""
    from importlib.metadata import entry_points

    from accel_npu.activation.triggers import PLUGIN_ENTRY_POINT_GROUP, third_party_plugins_declared

    assert third_party_plugins_declared() is bool(entry_points(group=PLUGIN_ENTRY_POINT_GROUP)) is False
    site = tmp_path / "site"
    other = site / "other_pkg-1.0.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: other-pkg\nVersion: 1.0\n")
    (other / "entry_points.txt").write_text("[console_scripts]\nother = other_pkg:main\n")
    monkeypatch.syspath_prepend(str(site))
    assert third_party_plugins_declared() is bool(entry_points(group=PLUGIN_ENTRY_POINT_GROUP)) is False
    plugin = site / "my_plugin-0.1.dist-info"
    plugin.mkdir()
    (plugin / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (plugin / "entry_points.txt").write_text(f"[{PLUGIN_ENTRY_POINT_GROUP}]\nmine = my_plugin.hooks\n")
    assert third_party_plugins_declared() is bool(entry_points(group=PLUGIN_ENTRY_POINT_GROUP)) is True


def test_every_declared_patch_is_reached_by_a_trigger():
    """A patch applies only once activation has run: its module must be a trigger module (or inside
    one), or torch's own (applied with the first trigger, or inside `import torch` in a launched
    rank). No patch may target a trigger module itself: activation runs while that module is found."""
    import accel_npu
    from accel_npu.activation.triggers import TRIGGER_MODULES
    from accel_npu.patching import get_ledger

    accel_npu.patch()
    modules = {p.module for p in get_ledger().patches}
    assert len(modules) > 20
    for module in modules:
        inside = [t for t in TRIGGER_MODULES if module.startswith(t + ".")]
        # sys is built in, so imported before activation runs: its patch applies with activation
        assert inside or module.split(".")[0] == "torch" or module in sys.builtin_module_names, (
            f"{module}: no trigger module imports it"
        )
        assert module not in TRIGGER_MODULES, module


@pytest.mark.slow
def test_disable_activates_nothing():
    result, _ = probe(ACCEL_NPU_DISABLE="1")
    assert result == {"active": False, "prepare_backend_wrapped": False, "applied": [], "applied_by": []}


@pytest.mark.slow
def test_disabled_plugins_block_by_name_and_star():
    result, _ = probe(ACCEL_NPU_DISABLED_PLUGINS="devices.cpu")
    assert "accelerate.state:PartialState._prepare_backend" not in result["applied"]
    result, _ = probe(ACCEL_NPU_DISABLED_PLUGINS="cpu")  # the plugin's old name, an alias
    assert "accelerate.state:PartialState._prepare_backend" not in result["applied"]
    result, _ = probe(ACCEL_NPU_DISABLED_PLUGINS="*")
    # every plugin but the essential ones, which call the hooks other plugins rely on
    assert result["applied_by"] == ["deepspeed"], result
    assert "accelerate.state:PartialState._prepare_backend" not in result["applied"]


def test_an_old_plugin_name_blocks_the_plugin_it_names_and_a_plugin_of_that_name(monkeypatch):
    from accel_npu import environment

    monkeypatch.setenv("ACCEL_NPU_DISABLED_PLUGINS", " npu, launch_settings ,my_plugin")
    assert environment.disabled_plugins() == {"npu", "devices.npu", "launch_settings", "launch.settings", "my_plugin"}
    monkeypatch.setenv("ACCEL_NPU_DISABLED_PLUGINS", "devices.npu")
    assert environment.disabled_plugins() == {"devices.npu"}


@pytest.mark.slow
def test_essential_plugins_cannot_be_blocked():
    from accel_npu.manager import ESSENTIAL_PLUGINS

    assert set(ESSENTIAL_PLUGINS) == {"launch.launcher", "deepspeed"}
    result, proc = probe(ACCEL_NPU_DISABLED_PLUGINS="deepspeed,precision")
    assert "deepspeed" in result["applied_by"] and "precision" not in result["applied_by"]
    assert "plugin 'deepspeed' is essential and cannot be blocked" in proc.stderr


@pytest.mark.slow
def test_trace_logs_patch_applications():
    _, proc = probe(ACCEL_NPU_TRACE="1")
    assert (
        "[accel-npu trace] patch accelerate.state:PartialState._prepare_backend (devices.cpu): applied" in proc.stderr
    )


@pytest.mark.slow
def test_activation_never_breaks_import_torch(tmp_path):
    # A broken accel-npu core (here: pluggy made unimportable) must leave `import torch` working, and
    # the import that activates (accelerate's).
    (tmp_path / "pluggy.py").write_text("raise ImportError('pluggy is broken')\n")
    env = base_env(PYTHONPATH=str(tmp_path))
    code = "import torch; print('torch ok', torch.ones(1).item()); import accelerate; print('accelerate ok')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0 and "torch ok 1.0\naccelerate ok" in proc.stdout, proc.stderr
    assert "accel-npu: disabled in this process" in proc.stderr


@pytest.mark.slow
def test_top_level_plugins_import_fails_loudly():
    proc = subprocess.run(
        [sys.executable, "-c", "import plugins"], cwd=REPO, capture_output=True, text=True, timeout=60, env=base_env()
    )
    assert proc.returncode != 0
    assert "import them as 'accel_npu.plugins'" in proc.stderr


@pytest.fixture(scope="module")
def installed_test_plugin(tmp_path_factory):
    """accel-npu-testplugin, really pip-installed (into a target dir put on PYTHONPATH)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
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
            str(PLUGIN_DIST),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return target


def env_json(target, **env):
    proc = subprocess.run(
        [sys.executable, "-m", "accel_npu", "env", "--json"],
        env=base_env(PYTHONPATH=str(target), **env),
        capture_output=True,
        text=True,
        timeout=180,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc


@pytest.mark.slow
def test_third_party_plugin_listed_applied_and_blockable(installed_test_plugin):
    run = [
        sys.executable,
        "-c",
        "import torch\nfrom accel_npu_testplugin.greeting import horizon\nprint(horizon(16, 8))",
    ]
    # four independent processes (one core each): side by side
    (report, proc), fixed, (blocked, _), unfixed = run_concurrently(
        lambda: env_json(installed_test_plugin),
        lambda: subprocess.run(
            run,
            env=base_env(PYTHONPATH=str(installed_test_plugin)),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        ),
        lambda: env_json(installed_test_plugin, ACCEL_NPU_DISABLED_PLUGINS="testplugin"),
        lambda: subprocess.run(
            run,
            env=base_env(PYTHONPATH=str(installed_test_plugin), ACCEL_NPU_DISABLED_PLUGINS="testplugin"),
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        ),
    )
    plugins = {p["name"]: p for p in report["plugins"]}
    assert plugins["testplugin"]["status"] == "loaded"
    assert plugins["testplugin"]["source"] == "entry point (accel-npu-testplugin)"
    assert plugins["testplugin"]["version"] == "0.3.1"
    patch = next(p for p in report["patches"] if p["target"] == "accel_npu_testplugin.greeting:horizon")
    assert patch["status"] == "applied" and patch["plugin"] == "testplugin"
    assert report["sections"]["Test plugin"] == {"hello": "from accel-npu-testplugin"}
    # The broken plugin is reported by name and skipped; everything else still works.
    assert plugins["brokenplugin"]["status"].startswith("failed: RuntimeError: this plugin is broken")
    assert "plugin 'brokenplugin'" in proc.stderr

    assert fixed.stdout.strip() == "8", fixed.stderr

    plugins = {p["name"]: p for p in blocked["plugins"]}
    assert plugins["testplugin"]["status"] == "blocked"
    assert not any(p["target"].startswith("accel_npu_testplugin") for p in blocked["patches"])
    assert unfixed.stdout.strip() == "16", unfixed.stderr


@pytest.mark.slow
def test_disabled_patches_leave_one_function_stock():
    result, proc = probe(ACCEL_NPU_DISABLED_PATCHES="accelerate.state:PartialState._prepare_backend, nope:x")
    assert result["active"] and not result["prepare_backend_wrapped"]
    assert "accelerate.state:PartialState._prepare_backend" not in result["applied"]
    assert "accelerate.utils.dataclasses:DeepSpeedPlugin.__post_init__" in result["applied"]  # the rest stays on
    assert "ACCEL_NPU_DISABLED_PATCHES names nope:x, which no plugin declares" in proc.stderr


LAZY_PROBE = r"""
import json, sys
import torch
import accel_npu
print("RESULT " + json.dumps({"active": accel_npu.is_active(),
      "modules": sorted(m for m in sys.modules if m.startswith("accel_npu.plugins."))}))
"""


@pytest.mark.slow
def test_import_torch_alone_imports_no_loading_or_checkpoint_machinery():
    """Where `import torch` activates (here a launched rank), only the plugins'
    declarations load; the machinery named by path in `wrapper=` waits until its target library is
    imported."""
    proc = subprocess.run(
        [sys.executable, "-c", LAZY_PROBE],
        env=base_env(LOCAL_RANK="0"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert result["active"]
    assert "accel_npu.plugins.loading" in result["modules"] and "accel_npu.plugins.checkpoints" in result["modules"]
    eager = [
        m for m in result["modules"] if m.startswith(("accel_npu.plugins.loading.", "accel_npu.plugins.checkpoints."))
    ]
    assert eager == []


def test_wrappers_named_by_path_resolve_inside_their_own_plugin():
    from accel_npu.manager import declared_patches, get_plugin_manager

    pm = get_plugin_manager()
    checked = 0
    for impl in pm.hook.accel_npu_register_patches.get_hookimpls():
        plugin = impl.plugin.__name__
        for patch in declared_patches(impl):
            path = patch.wrapper_path
            if not path:
                continue
            # A plugin package's own modules, or the plugin module itself (devices/cpu.py, launch/*.py)
            module = path.partition(":")[0]
            assert module == plugin or module.startswith(plugin + "."), (patch.target, path, plugin)
            # Resolving caches the function; the declared path must stay (earlier tests in the same
            # process may already have applied these patches — CI ran this after them).
            assert callable(patch.wrapper) and patch.wrapper is patch.wrapper, patch.target
            assert patch.wrapper_path == path
            checked += 1
    assert checked >= 10

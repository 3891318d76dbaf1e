"""The plugin manager and each hook, in-process, with a plugin registered by the test."""

import pytest

from accel_npu import hookimpl
from accel_npu.backend import Backend, current_backend
from accel_npu.errors import LaunchError


class ProbePlugin:
    """A plugin a test registers to observe and steer accel-npu's hooks."""

    def __init__(self):
        self.activated_with = "never"

    @hookimpl(tryfirst=True)
    def accel_npu_select_backend(self, env):
        if env.get("PROBE_BACKEND") == "1":
            return Backend(name="probe", device_type="cpu", dist_backend="gloo", device_count=2, plugin="probe")
        return None

    @hookimpl
    def accel_npu_launch_env(self, backend, env):
        return {"PROBE_DEFAULT": "from-plugin", "PROBE_USER_SET": "from-plugin"}

    @hookimpl
    def accel_npu_check_launch(self, backend, num_processes, env):
        if backend.name == "probe" and num_processes > backend.device_count:
            raise LaunchError(f"{num_processes} processes but {backend.device_count} probe devices")

    @hookimpl
    def accel_npu_env_report(self, backend):
        return ("Probe", {"backend": backend.name})

    @hookimpl
    def accel_npu_add_commands(self, subparsers):
        p = subparsers.add_parser("probe-hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 0)

    @hookimpl
    def accel_npu_activate(self, backend_name):
        self.activated_with = backend_name


@pytest.fixture
def probe(fresh_pm):
    from accel_npu.manager import get_plugin_manager

    plugin = ProbePlugin()
    get_plugin_manager().register(plugin, name="probe")
    return plugin


def test_builtin_plugins_are_loaded_by_name(fresh_pm):
    from accel_npu.manager import DEFAULT_PLUGINS, get_plugin_manager

    pm = get_plugin_manager()
    for name, module in DEFAULT_PLUGINS:
        assert pm.get_plugin(name) is not None, name
        assert pm.get_plugin(name).__name__ == module


def test_only_accel_npu_names_are_inspected_for_hook_implementations(fresh_pm, monkeypatch):
    """Like pytest with "pytest_": the manager looks only at attributes named accel_npu_*, so a
    plugin module's other names (everything it imports) are never inspected. Witness: pluggy's own
    ``PluginManager.parse_hookimpl_opts``, recording the names it is asked about."""
    import types

    import pluggy

    from accel_npu.manager import HOOK_PREFIX, get_plugin_manager

    pm = get_plugin_manager()
    asked = []
    base = pluggy.PluginManager.parse_hookimpl_opts

    def recording(self, plugin, name):
        asked.append(name)
        return base(self, plugin, name)

    monkeypatch.setattr(pluggy.PluginManager, "parse_hookimpl_opts", recording)
    module = types.ModuleType("a_plugin")
    module.os, module.helper, module.CONSTANT = __import__("os"), (lambda: None), 3

    @hookimpl
    def accel_npu_env_report(backend):
        return ("Prefixed", {})

    module.accel_npu_env_report = accel_npu_env_report
    pm.register(module, name="prefixed")
    assert "prefixed" in [impl.plugin_name for impl in pm.hook.accel_npu_env_report.get_hookimpls()]
    assert asked == ["accel_npu_env_report"], asked
    assert HOOK_PREFIX == "accel_npu_"


def test_blocked_and_broken_builtin_plugins(fresh_pm, monkeypatch):
    from accel_npu import manager

    monkeypatch.setenv("ACCEL_NPU_DISABLED_PLUGINS", "devices.cuda")
    monkeypatch.setattr(manager, "DEFAULT_PLUGINS", manager.DEFAULT_PLUGINS + (("ghost", "accel_npu.plugins.no_such"),))
    pm = manager.get_plugin_manager()
    status = {r.name: r.status for r in pm.records}
    assert status["devices.cuda"] == "blocked" and pm.get_plugin("devices.cuda") is None
    assert status["ghost"].startswith("failed: ModuleNotFoundError")
    assert status["devices.cpu"] == "loaded"


def test_old_builtin_names_block_as_aliases(fresh_pm, monkeypatch, caplog):
    from accel_npu import manager

    monkeypatch.setenv("ACCEL_NPU_DISABLED_PLUGINS", "cuda, launch_settings,launcher")
    pm = manager.get_plugin_manager()
    status = {r.name: r.status for r in pm.records}
    assert status["devices.cuda"] == "blocked" and status["launch.settings"] == "blocked"
    assert status["launch.launcher"] == "loaded" and status["devices.cpu"] == "loaded"  # essential; not named
    assert "plugin 'launch.launcher' is essential and cannot be blocked" in caplog.text


def test_select_backend_first_result_wins(probe, monkeypatch):
    assert current_backend().name == "cpu"  # built-in cpu backend on this machine
    from accel_npu.backend import reset_backend_cache

    reset_backend_cache()
    monkeypatch.setenv("PROBE_BACKEND", "1")
    assert current_backend().name == "probe"


def test_forced_backend(fresh_pm, monkeypatch):
    monkeypatch.setenv("ACCEL_NPU_BACKEND", "cpu")
    assert current_backend().plugin == "devices.cpu"


def test_launch_env_user_values_win_and_bootstrap_is_added(probe):
    from accel_npu.plugins.launch.launcher import bootstrap_dir, prepare_worker_environment

    environ = {"PROBE_USER_SET": "mine", "PYTHONPATH": "/somewhere"}
    added = prepare_worker_environment(2, environ)
    assert environ["PROBE_DEFAULT"] == "from-plugin" and added["PROBE_DEFAULT"] == "from-plugin"
    assert environ["PROBE_USER_SET"] == "mine"
    assert environ["PYTHONPATH"].split(":") == [bootstrap_dir(), "/somewhere"]
    assert environ["DS_ACCELERATOR"] == "cpu"  # the cpu backend's own default


def test_check_launch_refuses_before_workers(probe, monkeypatch):
    from accel_npu.backend import reset_backend_cache
    from accel_npu.plugins.launch.launcher import prepare_worker_environment

    reset_backend_cache()
    monkeypatch.setenv("PROBE_BACKEND", "1")
    environ = {}
    with pytest.raises(LaunchError, match="3 processes but 2 probe devices"):
        prepare_worker_environment(3, environ)
    assert environ == {}  # nothing applied for a refused launch


def test_env_report_section_and_cli_command(probe, capsys):
    from accel_npu.cli import main
    from accel_npu.cli.env import collect

    report = collect(import_targets=False)
    assert report["sections"]["Probe"] == {"backend": "cpu"}
    assert main(["probe-hello", "--name", "npu"]) == 0
    assert capsys.readouterr().out.strip() == "hello npu"


def test_activate_hook_runs_once_per_activation(probe, monkeypatch):
    from accel_npu import activation

    monkeypatch.setattr(activation, "_activated", False)
    monkeypatch.setenv("ACCEL_NPU_BACKEND", "cpu")
    assert activation.activate(strict=True)
    assert probe.activated_with == "cpu"

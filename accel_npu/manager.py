"""The plugin manager: built-in plugins by name, third-party ones by entry point.

Built-in plugins are plain modules or packages listed in :data:`DEFAULT_PLUGINS`; third-party
plugins come from the entry-point group ``accel_npu``. ``ACCEL_NPU_DISABLED_PLUGINS=a,b`` (or
``*``) blocks plugins by name, like pytest's ``-p no:name`` — except the :data:`ESSENTIAL_PLUGINS`,
which call the hooks other plugins rely on (``accel_npu_check_launch``, ``accel_npu_launch_env``,
``accel_npu_configure_deepspeed``) and so cannot be blocked, as pytest's essential plugins cannot.
A plugin that raises while loading is recorded with its error and skipped: training goes on.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from dataclasses import dataclass

import pluggy

from accel_npu import environment, hookspecs
from accel_npu.activation.triggers import PLUGIN_ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from accel_npu.activation.triggers import third_party_plugins_declared
from accel_npu.hookspecs import PROJECT_NAME

#: the name every hook (and so every hook implementation) starts with
HOOK_PREFIX = f"{PROJECT_NAME}_"

log = logging.getLogger("accel_npu")

BUILTIN_PACKAGE = "accel_npu.plugins"

#: Built-in plugins: (name, module). A built-in plugin's name is its module path inside
#: ``accel_npu.plugins`` (tests/test_architecture.py holds this); the names they had before are
#: ``environment.PLUGIN_ALIASES``. Order does not decide backend priority (tryfirst/trylast do).
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("devices.npu", "accel_npu.plugins.devices.npu"),
    ("devices.cuda", "accel_npu.plugins.devices.cuda"),
    ("devices.cpu", "accel_npu.plugins.devices.cpu"),
    ("launch.launcher", "accel_npu.plugins.launch.launcher"),
    ("precision", "accel_npu.plugins.precision"),
    ("cuda_compat", "accel_npu.plugins.cuda_compat"),
    ("attention", "accel_npu.plugins.attention"),
    ("deepspeed", "accel_npu.plugins.deepspeed"),
    ("video", "accel_npu.plugins.video"),
    ("torchvision_compat", "accel_npu.plugins.torchvision_compat"),
    ("ddp", "accel_npu.plugins.ddp"),
    ("loading", "accel_npu.plugins.loading"),
    ("frozen_towers", "accel_npu.plugins.frozen_towers"),
    ("checkpoints", "accel_npu.plugins.checkpoints"),
    ("explain_errors", "accel_npu.plugins.explain_errors"),
    ("launch.settings", "accel_npu.plugins.launch.settings"),
    ("hang_watch", "accel_npu.plugins.hang_watch"),
    ("trackers", "accel_npu.plugins.trackers"),
    ("sequence_parallel", "accel_npu.plugins.sequence_parallel"),
)

#: Built-in plugins that ACCEL_NPU_DISABLED_PLUGINS cannot block, and why.
ESSENTIAL_PLUGINS: dict[str, str] = {
    "launch.launcher": "reaches launched workers; calls every plugin's accel_npu_check_launch, accel_npu_launch_env "
    "and accel_npu_launch_args",
    "deepspeed": "calls every plugin's accel_npu_configure_deepspeed and accel_npu_prepare_deepspeed",
}


@dataclass
class PluginRecord:
    name: str
    source: str  # "builtin" or "entry point <dist>"
    module: str
    version: str
    status: str  # "loaded", "blocked", "failed: <error>"
    origin: str = ""  # the file the plugin module was imported from


class AccelNpuPluginManager(pluggy.PluginManager):
    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.records: list[PluginRecord] = []
        self._loaded = False

    def parse_hookimpl_opts(self, plugin, name: str):
        # Every hook is named accel_npu_*. pluggy inspects every attribute of a plugin module (each
        # name it imports, too: ~470 in the built-ins, a third of the plugin manager's start-up);
        # like pytest with "pytest_", other names are not hook implementations.
        if not name.startswith(HOOK_PREFIX):
            return None
        return super().parse_hookimpl_opts(plugin, name)

    # -- loading -----------------------------------------------------------------------------
    def _blocked(self, name: str) -> bool:
        blocked = environment.disabled_plugins()
        asked = "*" in blocked or name in blocked
        if asked and name in ESSENTIAL_PLUGINS:
            if name in blocked:
                log.warning(
                    "accel-npu: plugin %r is essential and cannot be blocked (ACCEL_NPU_DISABLED_PLUGINS): "
                    "it %s. ACCEL_NPU_DISABLE=1 turns accel-npu off as a whole.",
                    name,
                    ESSENTIAL_PLUGINS[name],
                )
            return False
        return asked

    def _register_module(self, name: str, module_name: str, source: str, version: str, loader) -> None:
        if self._blocked(name):
            self.set_blocked(name)
            self.records.append(PluginRecord(name, source, module_name, version, "blocked"))
            return
        try:
            plugin = loader()
            self.register(plugin, name=name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must never break training
            log.warning(
                "accel-npu: plugin %r (%s) failed to load and is skipped: %s: %s",
                name,
                module_name,
                type(exc).__name__,
                exc,
            )
            self.records.append(
                PluginRecord(name, source, module_name, version, f"failed: {type(exc).__name__}: {exc}")
            )
            return
        self.records.append(
            PluginRecord(name, source, module_name, version, "loaded", origin=getattr(plugin, "__file__", "") or "")
        )

    def load_plugins(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        from accel_npu._version import __version__

        problem = _builtin_package_problem()
        if problem is not None:
            # One line for the one cause, not one per built-in plugin.
            log.warning("accel-npu: no built-in plugin loads in this process (pid %d): %s", os.getpid(), problem)
        for name, module_name in DEFAULT_PLUGINS:
            if problem is not None:
                status = "blocked" if self._blocked(name) else f"failed: {problem}"
                source = "builtin, essential" if name in ESSENTIAL_PLUGINS else "builtin"
                self.records.append(PluginRecord(name, source, module_name, __version__, status))
                continue
            source = "builtin, essential" if name in ESSENTIAL_PLUGINS else "builtin"
            self._register_module(
                name, module_name, source, __version__, lambda m=module_name: importlib.import_module(m)
            )
        self._load_entry_points()

    def _load_entry_points(self) -> None:
        if not third_party_plugins_declared():  # the usual case: skip parsing every distribution's entry points
            return
        from importlib.metadata import entry_points

        try:
            eps = entry_points(group=ENTRY_POINT_GROUP)
        except Exception as exc:  # noqa: BLE001 - broken metadata of some unrelated dist
            log.warning("accel-npu: could not read entry points: %s", exc)
            return
        for ep in eps:
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "?"
            version = dist.version if dist is not None else "?"
            self._register_module(ep.name, ep.value, f"entry point ({dist_name})", version, ep.load)

    def enable_trace(self) -> None:
        self.trace.root.setwriter(lambda msg: sys.stderr.write(f"[accel-npu trace] {msg}"))
        self.enable_tracing()


def plugin_package(plugin) -> str:
    """The package a plugin's relative wrapper paths (".module:function") are resolved in: a package
    plugin's own, a module plugin's parent; "" for a plugin that is no module."""
    return getattr(plugin, "__package__", None) or ""


def declared_patches(impl) -> list:
    """The patches one ``accel_npu_register_patches`` implementation declares, their wrapper paths
    resolved in its plugin's package, as the ledger holds them."""
    patches = list(impl.function() or ())
    for patch in patches:
        patch.anchor(plugin_package(impl.plugin))
    return patches


def _builtin_package_problem() -> str | None:
    """Why ``accel_npu.plugins`` cannot be imported here (naming a shadowing copy), or None."""
    try:
        importlib.import_module(BUILTIN_PACKAGE)
        return None
    except Exception as exc:  # noqa: BLE001 - reported, never raised
        from accel_npu import install

        note = install.shadowing_note()
        return f"cannot import {BUILTIN_PACKAGE} ({type(exc).__name__}: {exc})" + (f"; {note}" if note else "")


_pm: AccelNpuPluginManager | None = None
_pm_lock = threading.Lock()


def get_plugin_manager() -> AccelNpuPluginManager:
    """The process-wide plugin manager, with plugins loaded (created on first use)."""
    global _pm
    with _pm_lock:
        if _pm is None:
            pm = AccelNpuPluginManager()
            if environment.flag("ACCEL_NPU_TRACE"):
                pm.enable_trace()
            pm.load_plugins()
            _pm = pm
        return _pm


def reset_plugin_manager() -> None:
    """Forget the plugin manager (tests use this after changing the environment)."""
    global _pm
    with _pm_lock:
        _pm = None

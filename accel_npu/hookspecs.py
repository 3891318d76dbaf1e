"""Every hook accel-npu calls, and the two markers: ``hookspec`` here, ``hookimpl`` for plugins.

Plugins implement hooks with ``@hookimpl`` (``from accel_npu.hookspecs import hookimpl``, or
``from accel_npu import hookimpl``: the same object).

All hooks are prefixed ``accel_npu_``. docs/plugin_hooks.md lists each one with its exact
signature (tests/test_hookspecs_documented.py keeps the two in step).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # for annotations only: never imported at run time (backend.py calls these hooks)
    from accel_npu._torch.nodes import Nodes
    from accel_npu.backend import Backend
    from accel_npu.config_files import WorkerTuning
    from accel_npu.patching import Patch

#: pluggy project name: the markers below and the plugin manager use it
PROJECT_NAME = "accel_npu"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec(firstresult=True)
def accel_npu_select_backend(env: Mapping[str, str]) -> Backend | None:
    """Return the device backend for this machine, or None to let the next plugin decide.

    Called once per process, lazily, the first time a patch or command needs to know.
    The first non-None result wins: built-in ``npu`` runs first (tryfirst), ``cpu`` last
    (trylast). ``env`` is a snapshot of ``os.environ``. Must be cheap and must not raise.
    """


@hookspec
def accel_npu_register_patches() -> list[Patch]:
    """Return the :class:`accel_npu.patching.Patch` objects this plugin declares.

    Called once at activation. Declaring a patch changes nothing: the ledger applies it when
    its target module is imported, if the installed version is supported.
    """


@hookspec
def accel_npu_launch_env(
    backend: Backend, env: Mapping[str, str], nodes: Nodes, launching: bool
) -> Mapping[str, str] | None:
    """Return environment defaults for processes a launcher is about to start.

    Called in the launcher (``accelerate launch`` / ``torchrun``) before workers start. Values
    are applied only where ``env`` (the launcher's environment) does not already set them: the
    user's values always win. ``nodes`` is the launch's shape (machines, this machine's rank,
    world size, rendezvous endpoint; ``accel_npu._torch.nodes.Nodes``). ``launching`` is False
    where a command only shows or writes the defaults (``accel-npu config``, ``accel-npu env``):
    then return only what does not depend on this node's state at this moment (a free port) and
    log nothing.
    """


@hookspec(firstresult=True)
def accel_npu_worker_tuning(backend_name: str) -> WorkerTuning | None:
    """Return what ``accel-npu config`` offers to tune in the workers' environment on backend
    ``backend_name``, or None when it is not yours.

    ``backend_name`` is the backend being configured, not necessarily this machine's. The
    :class:`accel_npu.config_files.WorkerTuning` names the variables the wizard asks about (their
    proposed values are the backend's ``accel_npu_launch_env`` defaults), checks the answers, and
    names the host-interface variable written for a job across machines. The first non-None
    result wins.
    """


@hookspec
def accel_npu_check_launch(backend: Backend, num_processes: int, env: Mapping[str, str], nodes: Nodes) -> None:
    """Validate a launch before any worker starts; raise ``accel_npu.errors.LaunchError`` to refuse.

    ``num_processes`` is the number of processes this machine will start; ``nodes`` the launch's
    shape, for what this machine can check of a launch across machines.
    """


@hookspec
def accel_npu_launch_args(backend: Backend, launch_args: argparse.Namespace, resolved: bool) -> None:
    """Adjust ``accelerate launch``'s arguments around accelerate's own validation of them.

    Called twice per launch by the launch.launcher plugin (accelerate/commands/launch.py
    ``_validate_launch_command``): with ``resolved`` False on the arguments as parsed, before accelerate checks
    them (hide what it would refuse before reading the config file), and with ``resolved`` True on the
    arguments as resolved with the config file (adjust them, or raise SystemExit with one message to refuse).
    """


@hookspec
def accel_npu_prepare_deepspeed(accelerator: Any, objects: tuple) -> None:
    """Called by ``Accelerator.prepare`` under DeepSpeed (the deepspeed plugin) with the objects it was given,
    before accelerate prepares the DataLoaders among them or builds the engine. Raise
    ``accel_npu.errors.ConfigError`` to refuse.
    """


@hookspec
def accel_npu_activate(backend_name: str | None) -> None:
    """Called once per process right after the ledger is armed (inside ``import torch``).

    Keep it cheap; never import heavy libraries here. ``backend_name`` is the forced backend
    from ``ACCEL_NPU_BACKEND`` or None (the backend itself is selected lazily).
    """


@hookspec
def accel_npu_env_report(backend: Backend) -> tuple[str, dict[str, Any]] | None:
    """Return one section for ``accel-npu env``: ``(title, {key: value})``, or None."""


@hookspec
def accel_npu_add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``accel-npu`` CLI.

    Each added parser must ``set_defaults(func=callable)``; ``func(args)`` returns an exit code.
    """


@hookspec
def accel_npu_selftest_checks(backend: Backend) -> list[tuple[str, str]] | None:
    """Return this plugin's checks for ``accel-npu env --selftest``: ``(title, "module:function")`` pairs.

    Return None unless ``backend`` is yours. Each function runs in a fresh subprocess with the
    workers' environment and is called with no arguments: it returns a one-line detail (ok),
    raises ``accel_npu.cli.selftest.CheckSkipped(reason)`` (skipped), or raises anything else
    (failed, with the exception as the reason). They run before the device checks every backend
    gets (matmul, autocast, AdamW, GradScaler, bf16 ``.numpy()``).
    """


@hookspec
def accel_npu_configure_deepspeed(ds_config: MutableMapping[str, Any], source: str) -> None:
    """Adjust a DeepSpeed config dict in place before DeepSpeed sees it.

    ``source`` names where it came from (a file path, or "<script>" for a dict built in code).
    """


@hookspec
def accel_npu_explain_error(error: BaseException) -> str | None:
    """Return one line saying what an uncaught ``error`` means on this machine and what to do, or None.

    Called after Python printed the traceback (the explain_errors plugin's excepthook), never for
    KeyboardInterrupt or SystemExit. Match on the text of ``error`` and its causes: errors from
    another process arrive re-raised with that process's traceback in the message (a DataLoader
    worker's, for one). Keep it cheap and never raise.
    """

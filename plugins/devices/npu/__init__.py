"""The npu device backend (Ascend, torch_npu): backend selection, launch defaults and checks,
activation (import diagnostics, mx_driving), the NPU section of ``accel-npu env``.

A thin layer: every call into torch_npu goes through :class:`contract.TorchNpu`, and that list is
the contract written down in docs/npu-contract.md. The work sits beside this module:
``selection.py`` (is torch_npu usable here, and why not), ``worker_env.py`` (the workers' Ascend
defaults, HCCL's ports), ``launch_checks.py`` (launches refused before workers start),
``explain.py`` (errors the machine caused), ``activation.py`` and ``mx_patcher.py`` (what activation
sets up), ``diagnostics.py`` (why torch_npu cannot load), ``env_report.py`` and ``selftest.py``
(``accel-npu env`` and its ``--selftest``).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.plugins.devices.npu import (
    activation,
    env_report,
    explain,
    launch_checks,
    selection,
    selftest,
    worker_env,
)
from accel_npu.plugins.devices.npu.worker_tuning import accel_npu_worker_tuning as accel_npu_worker_tuning


@hookimpl(tryfirst=True)
def accel_npu_select_backend(env):
    return selection.select_backend(env)


@hookimpl
def accel_npu_launch_env(backend, env, nodes, launching):
    return worker_env.launch_env(backend, env, nodes, launching)


@hookimpl
def accel_npu_check_launch(backend, num_processes, env, nodes):
    launch_checks.check_launch(backend, num_processes, env, nodes)


@hookimpl
def accel_npu_explain_error(error):
    return explain.explain_error(error)


@hookimpl
def accel_npu_activate(backend_name):
    activation.activate(backend_name)


@hookimpl
def accel_npu_env_report(backend):
    return env_report.env_report()


@hookimpl
def accel_npu_selftest_checks(backend):
    return selftest.CHECKS if backend.name == "npu" else None

"""ACCEL_NPU_HANG_TIMEOUT before a launch and in ``accel-npu env``: refused when unreadable, and the
timeout a run gets when it is unset (just under the process-group timeout)."""

from __future__ import annotations

import os

from accel_npu import environment
from accel_npu._torch.dist import first_timeout, hccl_exec_timeout
from accel_npu._torch.nodes import SINGLE
from accel_npu.errors import ConfigError, LaunchError

from .watch import default_timeout


def check_launch(env) -> None:
    """An unreadable value: one error naming it, before any worker starts."""
    try:
        environment.hang_timeout(env)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


def env_report(backend) -> tuple[str, dict]:
    """The "Hang diagnosis" section of ``accel-npu env``."""
    from accel_npu.manager import get_plugin_manager

    info = {}
    try:
        configured = environment.hang_timeout()
    except ConfigError as exc:
        return ("Hang diagnosis", {"ACCEL_NPU_HANG_TIMEOUT": f"PROBLEM: {exc}"})
    if configured == 0:
        info["ACCEL_NPU_HANG_TIMEOUT"] = "0: off"
    elif configured is not None:
        info["ACCEL_NPU_HANG_TIMEOUT"] = f"{configured:g} s"
    else:
        # A DeepSpeed launch: its group timeout is DEEPSPEED_TIMEOUT minutes (deepspeed/constants.py,
        # default 10) as the workers get it, the backend's launch defaults included.
        workers = dict(os.environ)
        for defaults in get_plugin_manager().hook.accel_npu_launch_env(
            backend=backend, env=dict(os.environ), nodes=SINGLE, launching=False
        ):
            for key, value in (defaults or {}).items():
                workers.setdefault(key, str(value))
        try:  # deepspeed/constants.py: int(os.getenv("DEEPSPEED_TIMEOUT", 10)) minutes
            group = int(workers.get("DEEPSPEED_TIMEOUT", "10")) * 60
        except ValueError:
            info["DEEPSPEED_TIMEOUT"] = (
                f"PROBLEM: {workers['DEEPSPEED_TIMEOUT']!r} is not a whole number of "
                "minutes: `import deepspeed` fails on it (deepspeed/constants.py int())"
            )
            return ("Hang diagnosis", info)
        source = f"DeepSpeed's process-group timeout, DEEPSPEED_TIMEOUT={group / 60:g} min"
        if backend.dist_backend == "hccl":
            exec_timeout = hccl_exec_timeout(workers)
            if first_timeout([group, exec_timeout]) != group:
                group, source = exec_timeout, f"HCCL_EXEC_TIMEOUT={exec_timeout:g} s, below the group timeout"
        info["ACCEL_NPU_HANG_TIMEOUT"] = (
            "<unset>: just under each run's process-group timeout (min(60 s, a quarter) below it)"
        )
        info["hang report after (DeepSpeed launch)"] = (
            f"{default_timeout(group):g} s ({group:g} s - {group - default_timeout(group):g} s; {source})"
        )
    return ("Hang diagnosis", info)

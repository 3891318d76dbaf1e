"""Hang diagnosis: a stuck collective becomes a report and a failed job.

Stock, a rank that never reaches a collective leaves the others waiting in it silently until the
process-group timeout (DeepSpeed: 10 minutes; HCCL: ``HCCL_EXEC_TIMEOUT``), and then the error
names neither the missing rank nor where anyone was. Here the collectives of ``torch.distributed``
are counted per process group; when a rank has waited ``ACCEL_NPU_HANG_TIMEOUT`` seconds (default:
just under the process-group timeout) every rank prints its Python stacks and the collective it is
in, one line names the ranks that did not arrive, and the job fails (see watch.py for how).
"""

from __future__ import annotations

from accel_npu import environment
from accel_npu._torch.dist import first_timeout, hccl_exec_timeout
from accel_npu._torch.nodes import SINGLE
from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

from .watch import collective_wrapper, default_timeout, init_wrapper

#: The collectives of torch.distributed (p2p send/recv and monitored_barrier, which has its own
#: timeout and report, are left alone).
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
#: torch 2.13's names for the single-tensor collectives (pytorch PR 186130; absent before): the deprecated
#: all_gather_into_tensor / reduce_scatter_tensor forward to them, and callers migrate to them (FSDP, PR 186124).
SINGLE_TENSOR_COLLECTIVES = ("all_gather_single", "reduce_scatter_single")

_SUPPORTS = "torch>=2.5.1,<2.16"
# The target is torch.distributed's own binding, not distributed_c10d where the functions are
# defined: `from .distributed_c10d import *` binds these names when torch imports torch.distributed,
# before accel-npu activates at the end of `import torch`, and the callers (deepspeed.comm,
# accelerate, torch's FSDP) call `torch.distributed.<name>`. Patching both bindings would wrap
# twice whenever accel-npu is armed before torch.distributed is imported.
_REASON = (
    "A rank that never reaches a collective leaves the others waiting silently until the timeout; "
    "counted per group, a hang names the missing ranks."
)
_REMOVE_WHEN = (
    "torch's own watchdog names the missing ranks and dumps Python stacks on every backend "
    "(gloo included) before the process-group timeout"
)

COLLECTIVE_PATCHES = tuple(
    Patch(
        target=f"torch.distributed:{name}",
        supports=_SUPPORTS,
        reason=_REASON,
        remove_when=_REMOVE_WHEN,
        wrapper=collective_wrapper(name),
    )
    for name in COLLECTIVES
) + tuple(
    Patch(
        target=f"torch.distributed:{name}",
        supports="torch>=2.13,<2.16",
        stock_correct="torch<2.13",
        reason=_REASON,
        remove_when=_REMOVE_WHEN,
        wrapper=collective_wrapper(name),
    )
    for name in SINGLE_TENSOR_COLLECTIVES
)

INIT_PROCESS_GROUP = Patch(
    target="torch.distributed:init_process_group",
    supports=_SUPPORTS,
    reason="Starts the hang watch as soon as the process group is up, so a rank stuck before its first "
    "collective still prints its stacks.",
    remove_when=_REMOVE_WHEN,
    wrapper=init_wrapper,
)


@hookimpl
def accel_npu_register_patches():
    return [*COLLECTIVE_PATCHES, INIT_PROCESS_GROUP]


@hookimpl
def accel_npu_check_launch(backend, num_processes, env):
    # An unreadable value: one error naming it, before any worker starts.
    from accel_npu.errors import ConfigError, LaunchError

    try:
        environment.hang_timeout(env)
    except ConfigError as exc:
        raise LaunchError(str(exc)) from None


@hookimpl
def accel_npu_env_report(backend):
    import os

    from accel_npu.errors import ConfigError
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

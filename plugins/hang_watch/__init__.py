"""Hang diagnosis: a stuck collective becomes a report and a failed job.

Stock, a rank that never reaches a collective leaves the others waiting in it silently until the
process-group timeout (DeepSpeed: 10 minutes; HCCL: ``HCCL_EXEC_TIMEOUT``), and then the error
names neither the missing rank nor where anyone was. Here the collectives of ``torch.distributed``
are counted per process group; when a rank has waited ``ACCEL_NPU_HANG_TIMEOUT`` seconds (default:
just under the process-group timeout) every rank prints its Python stacks and the collective it is
in, one line names the ranks that did not arrive, and the job fails (see watch.py for how).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

from .collectives import COLLECTIVES, SINGLE_TENSOR_COLLECTIVES

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
        wrapper=f".watch:COLLECTIVE_WRAPPERS.{name}",
    )
    for name in COLLECTIVES
) + tuple(
    Patch(
        target=f"torch.distributed:{name}",
        supports="torch>=2.13,<2.16",
        stock_correct="torch<2.13",
        reason=_REASON,
        remove_when=_REMOVE_WHEN,
        wrapper=f".watch:COLLECTIVE_WRAPPERS.{name}",
    )
    for name in SINGLE_TENSOR_COLLECTIVES
)

INIT_PROCESS_GROUP = Patch(
    target="torch.distributed:init_process_group",
    supports=_SUPPORTS,
    reason="Starts the hang watch as soon as the process group is up, so a rank stuck before its first "
    "collective still prints its stacks.",
    remove_when=_REMOVE_WHEN,
    wrapper=".watch:init_wrapper",
)


@hookimpl
def accel_npu_register_patches():
    return [*COLLECTIVE_PATCHES, INIT_PROCESS_GROUP]


@hookimpl
def accel_npu_check_launch(backend, num_processes, env):
    from . import timeout_setting

    timeout_setting.check_launch(env)


@hookimpl
def accel_npu_env_report(backend):
    from . import timeout_setting

    return timeout_setting.env_report(backend)

"""One line after an uncaught error's traceback: what it means on this machine and what to do.

Plugins recognise errors whose cause is the environment rather than the script (the
``accel_npu_explain_error`` hook: the npu plugin knows HCCL's port clash, a forked DataLoader worker
touching the NPU, graph capture under ``TASK_QUEUE_ENABLE=2``); this plugin prints their lines after
Python's own traceback, so the last thing a user reads is the fix.
"""
from __future__ import annotations

import sys

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch, argument


def explanations(error: BaseException) -> list[str]:
    """The plugins' lines for ``error``, each once; none for an interrupt or an exit."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return []
    from accel_npu.manager import get_plugin_manager

    lines = get_plugin_manager().hook.accel_npu_explain_error(error=error)
    return list(dict.fromkeys(line for line in lines if line))


def _excepthook(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    error = argument(args, kwargs, 1, "value")
    try:
        lines = explanations(error) if isinstance(error, BaseException) else []
    except Exception:  # noqa: BLE001 - an explanation must never hide the error itself
        return
    for line in lines:
        sys.stderr.write(f"accel-npu: {line}\n")
    sys.stderr.flush()


EXCEPTHOOK = Patch(
    target="sys:excepthook",
    supports="python>=3.10,<3.15",
    reason="Errors caused by the machine (HCCL ports taken, an NPU touched in a forked worker) end in a "
           "traceback that names no fix: one line after it says what to change.",
    remove_when="torch_npu's and CANN's errors name their fix themselves",
    wrapper=_excepthook,
)


@hookimpl
def accel_npu_register_patches():
    return [EXCEPTHOOK]

"""One line after an uncaught error's traceback: what it means on this machine and what to do.

Plugins recognise errors whose cause is the environment rather than the script (the
``accel_npu_explain_error`` hook: the npu plugin knows HCCL's port clash, a forked DataLoader worker
touching the NPU, graph capture under ``TASK_QUEUE_ENABLE=2``); this plugin prints their lines after
Python's own traceback, so the last thing a user reads is the fix.

This module declares the patch and names a library release that needs a newer torch than it declares
(accel_npu.compat); ``excepthook.py`` holds the wrapper and ``explanations``.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

EXCEPTHOOK = Patch(
    target="sys:excepthook",
    supports="python>=3.10,<3.15",
    reason="Errors caused by the machine (HCCL ports taken, an NPU touched in a forked worker) end in a "
    "traceback that names no fix: one line after it says what to change.",
    remove_when="torch_npu's and CANN's errors name their fix themselves",
    wrapper=".excepthook:excepthook",
)


@hookimpl
def accel_npu_register_patches():
    return [EXCEPTHOOK]


@hookimpl
def accel_npu_explain_error(error):
    # whatever the error, a library release that needs a newer torch than installed is its likely cause, and
    # the error itself (an AttributeError on torch.accelerator, a TypeError in object.__init__) does not say so
    from accel_npu.compat import undeclared_torch_mismatches

    return " ".join(undeclared_torch_mismatches()) or None

"""An uncaught error in an environment where a library release needs a newer torch than installed
(accel_npu.compat): whatever the error, that mismatch is named after the traceback, since the error itself
(an AttributeError on ``torch.accelerator``, a TypeError in ``object.__init__``) does not point at it."""
from __future__ import annotations


def explain(error: BaseException) -> list[str]:
    from accel_npu.compat import undeclared_torch_mismatches

    return undeclared_torch_mismatches()

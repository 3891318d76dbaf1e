"""Where in the user's script a misused collective was called, and the `if` that guards it.

A collective entered by rank 0 alone is nearly always ``if accelerator.is_main_process:`` around
it (diffusers' train_text_to_image.py around ``accelerator.save_state``, diffusers #2606). The
error names that line and the `if` so the one-line fix can be given verbatim.
"""

from __future__ import annotations

from accel_npu._torch.callsite import LIBRARIES, main_process_guard, user_frame  # noqa: F401  (re-exported: the misuse messages use it)

FIX = "if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:"


def describe(call: str) -> str:
    """``"train.py:1089 calls accelerator.save_state() inside `if accelerator.is_main_process:` (line 1067)"``,
    or "" when the caller is not a file."""
    site = user_frame()
    if site is None:
        return ""
    filename, line = site
    guard = main_process_guard(filename, line)
    where = f"{filename}:{line} calls {call}"
    if guard is not None:
        where += f" inside `{guard[1]}` (line {guard[0]})"
    return where


def fix_for(call: str, kind: str = "DEEPSPEED") -> str:
    """The one-line fix (``kind``: the accelerate DistributedType that makes ``call`` collective), with the
    script's line when it can be found."""
    site = user_frame()
    guard = main_process_guard(*site) if site is not None else None
    at = f"{site[0]}:{guard[0]}: " if guard is not None else ""
    fix = FIX.replace("DistributedType.DEEPSPEED", f"DistributedType.{kind}")
    return f"Fix (one line): {at}`{fix}` (from accelerate.utils import DistributedType), so every rank calls {call}."

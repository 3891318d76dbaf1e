"""Where in the user's script a misused collective was called, and the `if` that guards it.

A collective entered by rank 0 alone is nearly always ``if accelerator.is_main_process:`` around
it (diffusers' train_text_to_image.py around ``accelerator.save_state``, diffusers #2606). The
error names that line and the `if` so the one-line fix can be given verbatim.
"""
from __future__ import annotations

import ast

from accel_npu._torch.callsite import LIBRARIES, user_frame  # noqa: F401  (re-exported: the misuse messages use it)

FIX = "if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:"


_guards: dict = {}


def main_process_guard(filename: str, line: int):
    """(line, source) of the innermost ``if ...is_main_process...:`` whose body holds ``line``, or None."""
    key = (filename, line)
    if key not in _guards:  # asked once per optimizer step at most (boundary.py): parse each file once per line
        _guards[key] = _main_process_guard(filename, line)
    return _guards[key]


def _main_process_guard(filename: str, line: int):
    try:
        with open(filename, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, filename)
    except (OSError, SyntaxError, ValueError):
        return None
    best = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not node.body:
            continue
        test = ast.get_source_segment(source, node.test) or ""
        if "is_main_process" not in test and "is_local_main_process" not in test:
            continue
        first, last = node.body[0].lineno, max(getattr(n, "end_lineno", n.lineno) for n in node.body)
        if first <= line <= last and (best is None or node.lineno > best[0]):
            best = (node.lineno, f"if {test}:")
    return best


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
    return (f"Fix (one line): {at}`{fix}` (from accelerate.utils import DistributedType), so every rank calls "
            f"{call}.")

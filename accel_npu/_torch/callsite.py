"""Who called into the libraries: the line of the user's script (for messages naming it), and whether
the caller of a patched function is an installed library or the user's own code."""

from __future__ import annotations

import ast
import os
import sys

# frames of these packages are library code, never the line a user should change
LIBRARIES = (
    "accel_npu",
    "accelerate",
    "wrapt",
    "deepspeed",
    "torch",
    "diffusers",
    "transformers",
    "safetensors",
    "peft",
    "huggingface_hub",
    "contextlib",
    "functools",
    "importlib",
)


def user_frame():
    """(filename, line) of the innermost frame outside the libraries, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "") or ""
        if name.split(".")[0] not in LIBRARIES and os.path.isfile(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


# -- who is asking: installed libraries or the user's code ------------------------------------------
# A frame's file decides, not its module name: a script run as __main__ or a repository's own package
# has no library name to go by. Answers are cached per file (hot paths ask per call).
_LIBRARY_DIRS: tuple[str, ...] | None = None
_library_file: dict[str, bool] = {}


def _library_dirs() -> tuple[str, ...]:
    """site-packages, torch, and accel-npu itself (accel_npu/ and wherever its plugins live)."""
    import sysconfig

    import accel_npu

    paths = sysconfig.get_paths()
    dirs = {paths.get("purelib"), paths.get("platlib"), os.path.dirname(os.path.abspath(accel_npu.__file__))}
    import torch

    dirs.add(os.path.dirname(torch.__file__))
    plugins = sys.modules.get("accel_npu.plugins")  # imported by now: a plugin is asking
    dirs.update(os.path.abspath(p) for p in getattr(plugins, "__path__", ()))
    return tuple(os.path.join(d, "") for d in dirs if d)


def caller_is_library(depth: int = 1, skip: tuple[str, ...] = ()) -> bool:
    """The code that called the function asking (``depth`` frames above it) lives in an installed
    package (site-packages, torch) or in accel-npu, not in the user's script or repository.

    ``skip``: path prefixes of the asking plugin's own frames (its wrappers), passed over together
    with wrapt's pure-Python fallback, so the first frame beyond them decides."""
    global _LIBRARY_DIRS
    frame = sys._getframe(depth + 1)
    skip = (*skip, "<wrapt")
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return False
    filename = frame.f_code.co_filename
    known = _library_file.get(filename)
    if known is None:
        if _LIBRARY_DIRS is None:
            _LIBRARY_DIRS = _library_dirs()
        known = _library_file[filename] = filename.startswith(_LIBRARY_DIRS)
    return known


# -- rank-0-only code: the `if accelerator.is_main_process:` around a line ----------------------------
# A collective entered by rank 0 alone is nearly always inside such an `if` (diffusers'
# train_text_to_image.py around ``accelerator.save_state``, diffusers #2606).
_guards: dict = {}


def main_process_guard(filename: str, line: int):
    """(line, source) of the innermost ``if ...is_main_process...:`` whose body holds ``line``, or None."""
    key = (filename, line)
    if key not in _guards:  # asked once per optimizer step at most: parse each file once per line
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


def guarded_caller(frame):
    """((file, line), guard) of the innermost script frame from ``frame`` outward that runs under
    ``if ...is_main_process...:`` (a helper the script calls there counts too), else (None, None)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "") or ""
        if name.split(".")[0] not in LIBRARIES:
            guard = main_process_guard(frame.f_code.co_filename, frame.f_lineno)
            if guard is not None:
                return (frame.f_code.co_filename, frame.f_lineno), guard
        frame = frame.f_back
    return None, None

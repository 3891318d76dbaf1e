"""Who called into the libraries: the line of the user's script (for messages naming it), and whether
the caller of a patched function is an installed library or the user's own code."""
from __future__ import annotations

import os
import sys

# frames of these packages are library code, never the line a user should change
LIBRARIES = ("accel_npu", "accelerate", "wrapt", "deepspeed", "torch", "diffusers", "transformers",
             "safetensors", "peft", "huggingface_hub", "contextlib", "functools", "importlib")


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

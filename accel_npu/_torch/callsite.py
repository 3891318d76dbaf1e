"""The line of the user's script that called into the libraries (for messages naming it)."""
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

"""train_tiny.py, but importing a torch_npu-like module (autoload off) before torch."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_autoload_off_first  # noqa: F401 - imported for its effect: torch imported with autoload off first

sys.argv[0] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_tiny.py")
runpy.run_path(sys.argv[0], run_name="__main__")

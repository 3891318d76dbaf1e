"""Run a script as ``__main__`` with torchvision importable beside this machine's CPU torch: the same for both halves
of a benchmark whose stock half must import torchvision.

The registry's torchvision wheels are CUDA builds; beside a CPU torch their C++ operators cannot load and ``import
torchvision`` dies in ``torchvision/_meta_registrations.py`` ("operator torchvision::nms does not exist",
pytorch/vision#9085). A user's torchvision matches their torch and has no such failure. This runner applies the guard
pytorch/vision#9086 proposed (skip ``register_fake`` for a torchvision operator that does not exist) before the script
runs, in every half alike, so the stock half can run at all; the script itself runs unchanged (``runpy``).

Usage: python benchmarks/_torchvision_guard.py SCRIPT [ARGS...]
"""

import runpy
import sys

import torch
import torch.library

_register_fake = torch.library.register_fake


def _guarded_register_fake(op, func=None, /, *args, **kwargs):
    if isinstance(op, str) and op.startswith("torchvision::"):
        if not hasattr(torch.ops.torchvision, op.split("::", 1)[1].split(".", 1)[0]):
            return func if func is not None else (lambda f: f)
    if func is None:
        return _register_fake(op, *args, **kwargs)
    return _register_fake(op, func, *args, **kwargs)


torch.library.register_fake = _guarded_register_fake

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(__import__("pathlib").Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")

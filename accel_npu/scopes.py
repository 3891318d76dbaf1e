"""The scopes patches declare (``Patch(scope=...)``, accel_npu/patching/scope.py).

``CUDA_FACADE``: where "cuda" stands for the active device (the torch.cuda façade, autocast("cuda"),
a "cuda" GradScaler, the CUDA-only attention flags). It is the product's promise for a CUDA-written
training script in a launched rank; a pytest run, a notebook or a tool that merely imports diffusers
sees stock torch (``torch.cuda.is_available()`` False), as it does without accel-npu.
ACCEL_NPU_CUDA_FACADE=1 opts a plain ``python script.py`` in (debugging a CUDA script without a
launcher), =0 opts every process out. docs/cuda-compat.md ("Where the façade answers").
"""

from __future__ import annotations

import os

from accel_npu import environment
from accel_npu.patching.scope import Scope


def launched_rank(environ=None) -> bool:
    """A process a launcher started: torchrun, accelerate's multi-process path and the DeepSpeed
    launcher set LOCAL_RANK for every worker; accelerate launch's single-process path runs the script
    with ACCELERATE_USE_CPU set (accelerate/utils/launch.py ``prepare_simple_launcher_cmd_env``)."""
    environ = os.environ if environ is None else environ
    return environ.get("LOCAL_RANK", "") != "" or "ACCELERATE_USE_CPU" in environ


def cuda_facade_off(environ=None) -> str | None:
    """None where the CUDA façade family applies in this process, else why it does not."""
    mode = environment.cuda_facade(environ)
    if mode == "on":
        return None
    if mode == "off":
        return "ACCEL_NPU_CUDA_FACADE=0"
    if launched_rank(environ):
        return None
    return "not a launched rank (accelerate launch / torchrun); ACCEL_NPU_CUDA_FACADE=1 turns it on here"


CUDA_FACADE = Scope("CUDA façade", cuda_facade_off)

"""A torchvision for tests to put on PYTHONPATH, never into the test environment itself.

The registry's torchvision wheels link CUDA. Installed beside this CPU torch, stock
``import torchvision`` fails — and transformers' model code imports torchvision whenever it is
installed, so every stock half (``ACCEL_NPU_DISABLE=1``) that builds a transformers model would
fail at import instead of where it means to. Tests that need torchvision (its mismatch test,
the upstream diffusers scripts, which import ``torchvision.transforms``) therefore get the
paired wheel installed with ``--no-deps`` into a directory of its own, once per machine, and
put that directory on the launched processes' PYTHONPATH.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import filelock


def paired_version() -> str:
    """torchvision's release for the installed torch: 0.(minor+15).patch (torch 2.13.0 -> 0.28.0)."""
    import importlib.metadata

    torch_version = importlib.metadata.version("torch")
    major, minor, patch = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version).groups()
    assert major == "2", torch_version
    return f"0.{int(minor) + 15}.{patch}"


def torchvision_site() -> str:
    """A directory holding torchvision (paired with this torch, installed --no-deps); made once."""
    version = paired_version()
    root = Path(tempfile.gettempdir()) / "accel-npu-tests"
    root.mkdir(exist_ok=True)
    site = root / f"torchvision-{version}-py{sys.version_info.major}{sys.version_info.minor}"
    with filelock.FileLock(str(site) + ".lock", timeout=600):
        if not (site / "torchvision" / "__init__.py").is_file():
            partial = Path(tempfile.mkdtemp(dir=root, prefix="partial-"))
            # --no-deps: its Requires-Dist pins torch; pip must not touch the torch under test.
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                                   "--disable-pip-version-check", "--target", str(partial),
                                   f"torchvision=={version}"], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                shutil.rmtree(partial, ignore_errors=True)
                raise RuntimeError(f"pip could not install torchvision=={version}:\n{proc.stderr[-2000:]}")
            shutil.rmtree(site, ignore_errors=True)
            os.replace(partial, site)
    return str(site)


def with_torchvision(env: dict) -> dict:
    """``env`` with torchvision's directory first on PYTHONPATH."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (torchvision_site(), env.get("PYTHONPATH", "")) if p)
    return env

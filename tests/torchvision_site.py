"""A torchvision for tests to put on PYTHONPATH, never into the test environment itself.

The registry's torchvision wheels link CUDA. Installed beside this CPU torch, stock
``import torchvision`` fails — and transformers' model code imports torchvision whenever it is
installed, so every stock half (``ACCEL_NPU_DISABLE=1``) that builds a transformers model would
fail at import instead of where it means to. Tests that need torchvision (its mismatch test,
the upstream diffusers scripts, which import ``torchvision.transforms``) therefore get the
paired wheel installed with ``--no-deps`` into a directory of its own, once per machine, and
put that directory on the launched processes' PYTHONPATH. Packages that require torchvision
(timm, for diffusers' vqgan/train_vqgan.py) get a directory of their own the same way
(``package_site``, ``with_torchvision(env, "timm==...")``).
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
    """torchvision's release for the installed torch: 0.(minor+15).patch (torch 2.13.0 -> 0.28.0), or
    TORCHVISION_VERSION where that pair is not released yet (noxfile.py's torch 2.15.0 sets)."""
    import importlib.metadata

    if os.environ.get("TORCHVISION_VERSION"):
        return os.environ["TORCHVISION_VERSION"]

    torch_version = importlib.metadata.version("torch")
    major, minor, patch = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version).groups()
    assert major == "2", torch_version
    return f"0.{int(minor) + 15}.{patch}"


def torchvision_site() -> str:
    """A directory holding torchvision (paired with this torch, installed --no-deps); made once."""
    return package_site(f"torchvision=={paired_version()}")


def package_site(requirement: str) -> str:
    """A directory holding ``requirement`` ("name==version", the import name = the project name),
    installed --no-deps from the registry; made once per machine. For packages whose own requirements
    would pull a CUDA torchvision into the environment under test (timm requires torchvision)."""
    name, version = requirement.split("==")
    root = Path(tempfile.gettempdir()) / "accel-npu-tests"
    root.mkdir(exist_ok=True)
    site = root / f"{name}-{version}-py{sys.version_info.major}{sys.version_info.minor}"
    with filelock.FileLock(str(site) + ".lock", timeout=600):
        if not (site / name / "__init__.py").is_file():
            partial = Path(tempfile.mkdtemp(dir=root, prefix="partial-"))
            # --no-deps: its Requires-Dist pins torch; pip must not touch the torch under test.
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-compile",
                    "--no-deps",
                    "--disable-pip-version-check",
                    "--target",
                    str(partial),
                    requirement,
                ],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if proc.returncode != 0:
                shutil.rmtree(partial, ignore_errors=True)
                raise RuntimeError(f"pip could not install {requirement}:\n{proc.stderr[-2000:]}")
            shutil.rmtree(site, ignore_errors=True)
            os.replace(partial, site)
    return str(site)


def with_torchvision(env: dict, *requirements: str) -> dict:
    """``env`` with torchvision's directory, and one per further ``requirements`` ("name==version",
    package_site), first on PYTHONPATH."""
    env = dict(env)
    sites = [torchvision_site(), *(package_site(r) for r in requirements)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*sites, env.get("PYTHONPATH", "")) if p)
    return env

"""Where accel-npu is installed, and where this process (or a launched worker) imports it from.

A copy of ``accel_npu/`` earlier on ``sys.path`` than the installed distribution shadows it: the
repository root (``python -c`` from there, or accelerate's DeepSpeed launcher, which appends the
working directory to the workers' PYTHONPATH), or a stale checkout on PYTHONPATH. A source
checkout of this version serves ``accel_npu.plugins`` itself (``accel_npu/__init__.py``); an
older one does not, and then no built-in plugin loads. This module names such a copy.
Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from urllib.parse import unquote, urlparse

DISTRIBUTION = "accel-npu"


def imported_package_dir() -> str:
    """The ``accel_npu/`` directory this process imported (this module lives in it)."""
    return os.path.dirname(os.path.abspath(__file__))


def installed_package_dir() -> str | None:
    """The ``accel_npu/`` directory the installed distribution provides (editable: its source
    tree), or None when accel-npu is not installed (a bare source checkout on sys.path)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    except ValueError:
        direct_url = {}
    if direct_url.get("dir_info", {}).get("editable") and direct_url.get("url", "").startswith("file:"):
        return os.path.join(unquote(urlparse(direct_url["url"]).path), "accel_npu")
    return os.path.abspath(str(dist.locate_file("accel_npu")))


def builtin_plugins_dir(package_dir: str) -> str | None:
    """Where ``accel_npu.plugins`` comes from for the ``accel_npu/`` at ``package_dir``:
    inside it (an install) or ``plugins/`` beside it (a source checkout), else None."""
    inside = os.path.join(package_dir, "plugins")
    if os.path.isfile(os.path.join(inside, "__init__.py")):
        return inside
    root = os.path.dirname(package_dir)
    beside = os.path.join(root, "plugins")
    if os.path.isfile(os.path.join(beside, "__init__.py")) and os.path.isfile(os.path.join(root, "setup.cfg")):
        # Only a checkout whose accel_npu/__init__.py maps plugins/ (older ones did not).
        try:
            with open(os.path.join(package_dir, "__init__.py"), encoding="utf-8") as f:
                if "class _SourceCheckoutFinder" in f.read():
                    return beside
        except OSError:
            return None
    return None


def shadowing_note() -> str | None:
    """'accel_npu imported from X, not the installed accel-npu at Y', or None when they agree."""
    here = imported_package_dir()
    installed = installed_package_dir()
    if installed is None:
        return f"accel_npu is imported from {here}, and no accel-npu distribution is installed"
    if os.path.realpath(installed) != os.path.realpath(here):
        return f"accel_npu is imported from {here}, not the installed accel-npu at {installed}"
    return None


def first_package_dir_on(paths: list[str]) -> str | None:
    """The first ``<entry>/accel_npu`` package among ``paths`` (a would-be sys.path)."""
    for entry in paths:
        candidate = os.path.join(os.path.abspath(entry or "."), "accel_npu")
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    return None


def worker_import_problem(pythonpath: str, script_dir: str | None = None) -> str | None:
    """Why a worker started with this PYTHONPATH (running a script in ``script_dir``) would import
    an ``accel_npu`` that cannot load the built-in plugins, or None when it would not."""
    shadow = first_package_dir_on([script_dir]) if script_dir else None
    via = "the script's directory"
    if shadow is None:
        shadow = first_package_dir_on([p for p in pythonpath.split(os.pathsep) if p])
        via = "PYTHONPATH"
    if shadow is None or os.path.realpath(shadow) == os.path.realpath(imported_package_dir()):
        return None
    if builtin_plugins_dir(shadow) is not None:
        return None
    return (
        f"workers would import accel_npu from {shadow} (first on their sys.path through {via}), "
        f"a copy that cannot load accel-npu's built-in plugins, instead of {imported_package_dir()}. "
        f"Remove it from PYTHONPATH or launch from another directory, or update that checkout"
    )


#: The startup hook: setup.py installs STARTUP_PTH into site-packages; its line imports STARTUP_MODULE.
STARTUP_PTH = "accel_npu_startup.pth"
STARTUP_MODULE = "_accel_npu_startup"


def startup_hook_state() -> str:
    """Whether the startup hook (which explains a failed ``import torch_npu`` before accel-npu is
    active) runs in this process, and from where."""
    import sys

    module = sys.modules.get(STARTUP_MODULE)
    if module is None and sys.flags.no_site:
        return "not loaded: python -S runs no .pth file"
    if module is None:
        import site

        dirs = [*(site.getsitepackages() if hasattr(site, "getsitepackages") else []), site.getusersitepackages()]
        found = next((os.path.join(d, STARTUP_PTH) for d in dirs if os.path.isfile(os.path.join(d, STARTUP_PTH))), None)
        if found:
            return f"not loaded in this process, though {found} is installed"
        return (
            f"not installed: no {STARTUP_PTH} in this interpreter's site-packages (accel-npu installed with "
            "--target or found through PYTHONPATH; reinstall it with pip). A failed `import torch_npu` "
            "is then explained only once accel-npu is active"
        )
    hooks = [f for f in sys.meta_path if type(f).__name__ == "ExplainTorchNpuImport"]
    where = getattr(module, "__file__", STARTUP_MODULE)
    if not hooks:
        return f"{where}: off (ACCEL_NPU_DISABLE=1 at interpreter start)"
    return f"{where}: {'waiting for' if hooks[0].waiting else 'done with'} the first import of torch_npu"

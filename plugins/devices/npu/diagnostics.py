"""Why torch_npu cannot load here, and the exact fix: pairing, loader path, import errors."""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import os
import re
import sys
import threading

from accel_npu.errors import AccelNpuError
from accel_npu.plugins.devices.npu.contract import TorchNpu


class NpuEnvironmentError(AccelNpuError, ImportError):
    """torch_npu cannot load in this environment; the message says why and the exact fix."""


def _base(version: str) -> tuple:
    from packaging.version import Version

    return Version(version).release[:3]


def pairing_problem() -> str | None:
    """torch and torch_npu must share the base version (2.7.1 with 2.7.1.postN); None when they do."""
    npu = TorchNpu.dist_version()
    try:
        torch_v = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    if npu is None:
        return None
    try:
        npu_base, torch_base = _base(npu), _base(torch_v)
    except Exception:  # noqa: BLE001 - unparsable local versions: nothing to say
        return None
    if npu_base == torch_base:
        return None
    want = ".".join(map(str, npu_base))
    have = ".".join(map(str, torch_base))
    return (
        f"torch {torch_v} and torch_npu {npu} are not a pair: torch_npu {npu} is built for torch {want} "
        f"(a mismatch ends in 'libtorch_npu.so: undefined symbol'). Fix: pip install 'torch=={want}' "
        f"(or install the torch_npu {have}.postN release that matches torch {torch_v})."
    )


def library_dirs() -> dict[str, str | None]:
    """Where libc10.so (torch) and libtorch_npu.so (torch_npu) live, without importing torch_npu."""
    torch_spec = importlib.util.find_spec("torch")
    torch_dir = (
        list(torch_spec.submodule_search_locations)[0] if torch_spec and torch_spec.submodule_search_locations else None
    )
    npu_dir = TorchNpu.package_dir()
    return {
        "libc10.so": os.path.join(torch_dir, "lib") if torch_dir else None,
        "libtorch_npu.so": os.path.join(npu_dir, "lib") if npu_dir else None,
    }


def _on_loader_path(directory: str, env) -> bool:
    entries = [e for e in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if e]
    real = os.path.realpath(directory)
    return any(os.path.realpath(e) == real for e in entries)


def library_status(env) -> dict[str, str]:
    """One line per library: where it is and whether LD_LIBRARY_PATH names its directory."""
    out = {}
    for name, directory in library_dirs().items():
        if directory is None:
            out[name] = "package not found"
        elif not os.path.exists(os.path.join(directory, name)):
            out[name] = f"MISSING from {directory}"
        else:
            out[name] = f"{directory} ({'on' if _on_loader_path(directory, env) else 'not on'} LD_LIBRARY_PATH)"
    return out


def library_fix(env) -> str:
    dirs = [d for d in library_dirs().values() if d]
    return f"export LD_LIBRARY_PATH={':'.join(dirs)}:$LD_LIBRARY_PATH"


def diagnose_import_error(exc: BaseException, env=os.environ) -> str:
    """One message for a failed ``import torch_npu``: the cause and the exact fix."""
    text = f"{type(exc).__name__}: {exc}"
    parts = [f"accel-npu: torch_npu cannot be loaded ({text})."]
    pairing = pairing_problem()
    if "undefined symbol" in text or pairing:
        parts.append(
            pairing
            or "torch_npu was built for another torch: reinstall the torch_npu release "
            "matching your torch (same base version, e.g. 2.7.1 with 2.7.1.postN)."
        )
    missing_lib = _missing_library(text)
    if missing_lib is not None and not _is_torch_library(missing_lib):
        # a CANN library (libhccl, libascendcl, ...): the toolkit's environment script is the fix, not
        # LD_LIBRARY_PATH by hand (torch_npu _init/core/module_loader.py `_check_npu_import` says the same)
        parts.append(
            f"{missing_lib} is part of CANN, whose environment is not set up in this shell. Fix: "
            f"source {cann_set_env(env)} (in the shell that launches training; with a container, in its "
            "entrypoint)"
            + (
                ". libascend_hal.so comes with the NPU driver: check /usr/local/Ascend/driver"
                if missing_lib.startswith("libascend_hal")
                else ""
            )
            + "."
        )
    elif "cannot open shared object file" in text or ("libc10.so" in text and "undefined symbol" not in text):
        status = library_status(env)
        missing = [f"{n}: {v}" for n, v in status.items() if "not on" in v or "MISSING" in v]
        parts.append(
            "The dynamic loader cannot find torch's/torch_npu's libraries"
            + (f" ({'; '.join(missing)})" if missing else "")
            + f". Fix: {library_fix(env)}."
        )
    if len(parts) == 1:
        parts.append("Check the CANN toolkit (ASCEND_HOME_PATH, source set_env.sh) and `accel-npu env`.")
    return " ".join(parts)


#: shared libraries that come with the torch and torch_npu wheels (everything else a failed load names
#: is CANN's or the driver's)
_TORCH_LIBRARIES = ("libc10", "libtorch", "libshm", "libgomp")


def _missing_library(text: str) -> str | None:
    """``libhccl.so`` from "libhccl.so: cannot open shared object file: ...", else None."""
    match = re.search(r"([\w.+-]+\.so[\w.]*): cannot open shared object file", text)
    return match.group(1) if match else None


def _is_torch_library(name: str) -> bool:
    return name.startswith(_TORCH_LIBRARIES)


def cann_set_env(env) -> str:
    """The CANN toolkit's set_env.sh: beside the toolkit ASCEND_TOOLKIT_HOME / ASCEND_HOME_PATH name
    (they point at ``<install>/ascend-toolkit/latest``; the script is ``<install>/ascend-toolkit/
    set_env.sh``), else at the default install location."""
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        home = (env.get(var) or "").rstrip("/")
        if home:
            toolkit = os.path.dirname(home) if os.path.basename(home) == "latest" else home
            return os.path.join(toolkit, "set_env.sh")
    return "/usr/local/Ascend/ascend-toolkit/set_env.sh"


class _ClearTorchNpuImportErrors(importlib.abc.MetaPathFinder):
    """Turns `undefined symbol` / `cannot open shared object file` from ``import torch_npu`` into one
    NpuEnvironmentError (an ImportError) that names the cause and the fix."""

    _busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_npu" or getattr(self._busy, "on", False):
            return None
        self._busy.on = True  # other finders (wrapt's) ask the whole meta path again
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _ClearErrorsLoader(spec.loader)
                    return spec
            return None
        finally:
            self._busy.on = False


class _ClearErrorsLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        except (ImportError, OSError) as exc:
            if isinstance(exc, NpuEnvironmentError):
                raise
            raise NpuEnvironmentError(diagnose_import_error(exc)) from exc

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        return getattr(self._loader, name)


_finder = _ClearTorchNpuImportErrors()


def install_import_diagnostics() -> _ClearTorchNpuImportErrors:
    """Put the finder first on ``sys.meta_path`` (once); returns it. Called by the npu plugin's
    activation and by the startup hook (_accel_npu_startup.py) at the first lookup of torch_npu."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return _finder

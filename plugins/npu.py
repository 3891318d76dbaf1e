"""The npu device backend (Ascend, torch_npu).

A thin layer: every call into torch_npu goes through :class:`TorchNpu`, and that list is the
contract written down in docs/npu-contract.md. Tests exercise it against a stand-in torch_npu
that only the tests install (tests/contract/).
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import logging
import os
import sys
import threading

from accel_npu import hookimpl
from accel_npu.backend import Backend
from accel_npu import environment
from accel_npu.errors import AccelNpuError, LaunchError

log = logging.getLogger("accel_npu")


class TorchNpu:
    """The complete list of torch_npu calls accel-npu makes (docs/npu-contract.md)."""

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("torch_npu") is not None

    @staticmethod
    def module():
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

        return torch_npu

    @staticmethod
    def version() -> str:
        return getattr(TorchNpu.module(), "__version__", "unknown")

    @staticmethod
    def is_available() -> bool:
        import torch

        TorchNpu.module()
        return bool(torch.npu.is_available())

    @staticmethod
    def device_count() -> int:
        import torch

        TorchNpu.module()
        return int(torch.npu.device_count())

    @staticmethod
    def disallow_internal_format() -> None:
        import torch

        torch.npu.config.allow_internal_format = False

    @staticmethod
    def dist_version() -> str | None:
        """The installed torch_npu distribution's version, from its metadata (no import)."""
        try:
            return importlib.metadata.version("torch_npu")
        except importlib.metadata.PackageNotFoundError:
            return None

    @staticmethod
    def package_dir() -> str | None:
        """torch_npu's package directory, found without importing it."""
        spec = importlib.util.find_spec("torch_npu")
        if spec is None or not spec.submodule_search_locations:
            return None
        return list(spec.submodule_search_locations)[0]


class MxDriving:
    """The complete list of mx_driving calls accel-npu makes (docs/npu-contract.md)."""

    #: module holding ``default_patcher_builder`` (>= 1.0.20260421; DrivingSDK layout), in order
    BUILDER_MODULES = ("mx_driving.tools.patch.patcher", "mx_driving.patcher")

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("mx_driving") is not None

    @staticmethod
    def apply_patcher():
        """Enter mx_driving's default patcher; returns (api description, patcher object).

        New API: ``default_patcher_builder.build().__enter__()``; pre-1.0 fallback:
        ``Patcher().add(TransformersNPU).apply()`` from ``mx_driving.tools.patch``.
        """
        errors = []
        for module_name in MxDriving.BUILDER_MODULES:
            try:
                module = importlib.import_module(module_name)
                builder = module.default_patcher_builder
            except (ImportError, AttributeError) as exc:
                errors.append(f"{module_name}.default_patcher_builder: {type(exc).__name__}: {exc}")
                continue
            patcher = builder.build()
            patcher.__enter__()
            return f"{module_name}.default_patcher_builder.build().__enter__()", patcher
        try:
            legacy = importlib.import_module("mx_driving.tools.patch")
            patcher = legacy.Patcher().add(legacy.TransformersNPU)
            patcher.apply()
            return "mx_driving.tools.patch.Patcher().add(TransformersNPU).apply()", patcher
        except (ImportError, AttributeError) as exc:
            errors.append(f"mx_driving.tools.patch.Patcher/TransformersNPU: {type(exc).__name__}: {exc}")
        raise ImportError("no known mx_driving patcher API: " + "; ".join(errors))


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
    return (f"torch {torch_v} and torch_npu {npu} are not a pair: torch_npu {npu} is built for torch {want} "
            f"(a mismatch ends in 'libtorch_npu.so: undefined symbol'). Fix: pip install 'torch=={want}' "
            f"(or install the torch_npu {have}.postN release that matches torch {torch_v}).")


def library_dirs() -> dict[str, str | None]:
    """Where libc10.so (torch) and libtorch_npu.so (torch_npu) live, without importing torch_npu."""
    torch_spec = importlib.util.find_spec("torch")
    torch_dir = list(torch_spec.submodule_search_locations)[0] if torch_spec and torch_spec.submodule_search_locations else None
    npu_dir = TorchNpu.package_dir()
    return {"libc10.so": os.path.join(torch_dir, "lib") if torch_dir else None,
            "libtorch_npu.so": os.path.join(npu_dir, "lib") if npu_dir else None}


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
        parts.append(pairing or "torch_npu was built for another torch: reinstall the torch_npu release "
                                "matching your torch (same base version, e.g. 2.7.1 with 2.7.1.postN).")
    if "cannot open shared object file" in text or ("libc10.so" in text and "undefined symbol" not in text):
        status = library_status(env)
        missing = [f"{n}: {v}" for n, v in status.items() if "not on" in v or "MISSING" in v]
        parts.append("The dynamic loader cannot find torch's/torch_npu's libraries"
                     + (f" ({'; '.join(missing)})" if missing else "")
                     + f". Fix: {library_fix(env)} (field report 001, section 2.9).")
    if len(parts) == 1:
        parts.append("Check the CANN toolkit (ASCEND_HOME_PATH, source set_env.sh) and `accel-npu env`.")
    return " ".join(parts)


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
#: why torch_npu is installed but unusable in this process (set by backend selection)
_broken: str | None = None


def install_import_diagnostics() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def visible_device_count(env) -> int:
    """Devices this process may use, honouring ASCEND_RT_VISIBLE_DEVICES."""
    count = TorchNpu.device_count()
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible:
        count = min(count, len([d for d in visible.split(",") if d.strip()])) if count else \
            len([d for d in visible.split(",") if d.strip()])
    return count


@hookimpl(tryfirst=True)
def accel_npu_select_backend(env):
    global _broken
    forced = env.get("ACCEL_NPU_BACKEND", "").strip().lower()
    if forced and forced != "npu":
        return None
    if not TorchNpu.installed():
        return None
    try:
        if not TorchNpu.is_available():
            return None
        count = visible_device_count(env)
    except (ImportError, OSError) as exc:
        _broken = str(exc) if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc, env)
        log.error("%s", _broken)
        return None
    except Exception as exc:  # a broken torch_npu install is reported by `accel-npu env`
        log.warning("accel-npu: torch_npu is installed but unusable: %s", exc)
        return None
    return Backend(name="npu", device_type="npu", dist_backend="hccl", device_count=count,
                   ds_accelerator="npu", plugin="npu")


#: Ascend defaults for launched workers (field report 001, section 5.1); user values win.
NPU_LAUNCH_DEFAULTS = {
    "TASK_QUEUE_ENABLE": "2",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "CPU_AFFINITY_CONF": "1",
    "HCCL_CONNECT_TIMEOUT": "1200",
    "HCCL_EXEC_TIMEOUT": "1800",
}


@hookimpl
def accel_npu_launch_env(backend, env):
    if backend.name != "npu":
        return None
    return dict(NPU_LAUNCH_DEFAULTS, DS_ACCELERATOR="npu")


@hookimpl
def accel_npu_check_launch(backend, num_processes, env):
    # torch_npu installed but not loadable: one clear error before any worker starts
    if _broken and env.get("ACCEL_NPU_BACKEND", "").strip().lower() in ("", "npu"):
        raise LaunchError(_broken)
    # Pitfall 7.1: accelerate wraps extra ranks onto the same device; HCCL then fails much later.
    if backend.name == "npu" and backend.device_count and num_processes > backend.device_count:
        raise LaunchError(
            f"accel-npu: {num_processes} processes requested but only {backend.device_count} NPU(s) are "
            f"visible (ASCEND_RT_VISIBLE_DEVICES={env.get('ASCEND_RT_VISIBLE_DEVICES', '<unset>')}). "
            f"Use --num_processes {backend.device_count} (one process per NPU)."
        )


# -- mx_driving ----------------------------------------------------------------------------------
_mx_lock = threading.Lock()
_mx_state: dict = {"status": "not requested"}
#: libraries whose import (after torch is fully imported) may apply a deferred mx_driving patcher
_MX_DEFERRED_TRIGGERS = ("accelerate", "transformers", "diffusers", "deepspeed", "mmcv")


def _torch_initializing() -> bool:
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is None or bool(getattr(spec, "_initializing", False))


def apply_mx_driving(_module=None) -> None:
    """Enter mx_driving's patcher once per process (ACCEL_NPU_MX_DRIVING=1). Never raises."""
    with _mx_lock:
        if _mx_state.get("patcher") is not None or _mx_state["status"].startswith("failed"):
            return
        if _torch_initializing():
            # torch_npu is imported inside `import torch` (its autoload): mx_driving imports torch,
            # so wait for the first library the script imports after torch.
            _mx_state["status"] = "deferred until torch is imported"
            return
        try:
            api, patcher = MxDriving.apply_patcher()
        except Exception as exc:  # noqa: BLE001 - a patcher failure must not stop training
            _mx_state["status"] = f"failed: {type(exc).__name__}: {exc}"
            log.warning("accel-npu: mx_driving patcher not applied: %s", exc)
            return
        _mx_state.update(status=f"applied: {api}", patcher=patcher)
        log.info("accel-npu: mx_driving patcher applied (%s)", api)


@hookimpl
def accel_npu_activate(backend_name):
    if backend_name not in (None, "npu") or not TorchNpu.installed():
        return
    import wrapt

    install_import_diagnostics()
    # A mismatched pair is known from metadata alone: say so at startup, even when nothing imports
    # torch_npu directly (accelerate's is_npu_available() swallows the import error and trains on CPU).
    problem = pairing_problem()
    if problem:
        log.error("accel-npu: %s", problem)

    def _on_torch_npu(_module):
        # Field report 000: "Cannot create tensor with internal format" warnings; base format always.
        try:
            TorchNpu.disallow_internal_format()
        except Exception as exc:  # noqa: BLE001
            log.debug("accel-npu: allow_internal_format not set: %s", exc)

    wrapt.register_post_import_hook(_on_torch_npu, "torch_npu")
    if environment.flag("ACCEL_NPU_MX_DRIVING") and MxDriving.installed():
        _mx_state["status"] = "waiting for torch_npu"
        wrapt.register_post_import_hook(apply_mx_driving, "torch_npu")

        def _deferred(_module):
            if _mx_state["status"].startswith("deferred") and "torch_npu" in sys.modules:
                apply_mx_driving()

        for name in _MX_DEFERRED_TRIGGERS:
            wrapt.register_post_import_hook(_deferred, name)


@hookimpl
def accel_npu_env_report(backend):
    if not TorchNpu.installed():
        return ("NPU", {"torch_npu": "not installed"})
    info = {"torch_npu (installed)": TorchNpu.dist_version() or "unknown"}
    pairing = pairing_problem()
    info["torch/torch_npu pairing"] = f"PROBLEM: {pairing}" if pairing else "ok (same base version)"
    info.update(library_status(os.environ))
    try:
        info["torch_npu"] = TorchNpu.version()
        info["devices"] = TorchNpu.device_count()
    except Exception as exc:  # noqa: BLE001
        info["import torch_npu"] = f"PROBLEM: {exc if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc)}"
    info["ASCEND_HOME_PATH"] = os.environ.get("ASCEND_HOME_PATH", "<unset>")
    info["ASCEND_RT_VISIBLE_DEVICES"] = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
    info["mx_driving"] = ("not installed" if not MxDriving.installed() else
                          _mx_state["status"] if environment.flag("ACCEL_NPU_MX_DRIVING") else
                          "installed; patcher off (ACCEL_NPU_MX_DRIVING=1 enables it)")
    return ("NPU", info)

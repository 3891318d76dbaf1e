"""The npu device backend (Ascend, torch_npu): backend selection, launch defaults and checks,
activation (import diagnostics, mx_driving), the NPU section of ``accel-npu env``.

A thin layer: every call into torch_npu goes through :class:`contract.TorchNpu`, and that list is
the contract written down in docs/npu-contract.md; :mod:`diagnostics` explains failed imports.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading

from accel_npu import environment
from accel_npu._torch import nodes as node_net
from accel_npu._torch.nodes import SINGLE, Nodes
from accel_npu.backend import Backend, record_unusable
from accel_npu.errors import LaunchError
from accel_npu.hookspecs import hookimpl
from accel_npu.plugins.devices.npu import multinode
from accel_npu.plugins.devices.npu.contract import MxDriving, TorchNpu
from accel_npu.plugins.devices.npu.diagnostics import (
    NpuEnvironmentError,
    cann_set_env,
    diagnose_import_error,
    install_import_diagnostics,
    library_status,
    pairing_problem,
)
from accel_npu.plugins.devices.npu.multinode import connect_timeout_for
from accel_npu.plugins.devices.npu.visibility import suggested_value, visible_devices
from accel_npu.plugins.devices.npu.worker_tuning import accel_npu_worker_tuning as accel_npu_worker_tuning

log = logging.getLogger("accel_npu")

#: why torch_npu is installed but unusable in this process (set by backend selection)
_broken: str | None = None
#: why torch_npu loads but reports no usable NPU here (set by backend selection)
_no_device: str | None = None


def no_device_reason(env) -> str:
    """Why torch_npu reports no usable NPU, naming the cause where this process can see it."""
    value = env.get("ASCEND_RT_VISIBLE_DEVICES")
    seen = visible_devices(value, -1)
    if value is not None and seen.count == 0:
        fix = suggested_value(value, -1)
        return f"ASCEND_RT_VISIBLE_DEVICES={value}: {seen.why} (torch_npu/npu/__init__.py _parse_visible_devices). " + (
            f"List the ids ascending: ASCEND_RT_VISIBLE_DEVICES={fix}" if fix else "Unset it or list device ids"
        )
    if not glob.glob("/dev/davinci[0-9]*"):
        return (
            "there are no /dev/davinci* device nodes: this container was started without the NPUs "
            "(docker run --device=/dev/davinci0 ... --device=/dev/davinci_manager --device=/dev/devmm_svm "
            "--device=/dev/hisi_hdc, or your cluster's NPU device plugin)"
        )
    if not os.path.isdir("/usr/local/Ascend/driver"):
        return "the Ascend driver is not installed (/usr/local/Ascend/driver is missing): install the NPU driver"
    return "torch.npu.is_available() is False (check `npu-smi info` and the driver/firmware versions)"


def _machine_device_count(backend) -> int:
    """The driver's NPU count (what ASCEND_RT_VISIBLE_DEVICES chooses from); -1 when unknown."""
    try:
        raw = TorchNpu.raw_device_count()
    except Exception:  # noqa: BLE001 - a private torch_npu function: fall back to what we know
        raw = -1
    if raw <= 0 and "ASCEND_RT_VISIBLE_DEVICES" not in os.environ:
        raw = backend.device_count  # this process sees every device
    return raw


@hookimpl(tryfirst=True)
def accel_npu_select_backend(env):
    global _broken, _no_device
    forced = environment.forced_backend(env)
    if forced and forced != "npu":
        return None
    if not TorchNpu.installed():
        return None
    try:
        if not TorchNpu.is_available():
            _no_device = no_device_reason(env)
            log.error("accel-npu: torch_npu is installed but no NPU is usable: %s", _no_device)
            record_unusable("npu", f"torch_npu is installed but no NPU is usable: {_no_device}")
            return None
        count = TorchNpu.device_count()
    except (ImportError, OSError) as exc:
        _broken = str(exc) if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc, env)
        log.error("%s", _broken)
        record_unusable("npu", _broken)
        return None
    except Exception as exc:  # a broken torch_npu install is reported by `accel-npu env`
        log.warning("accel-npu: torch_npu is installed but unusable: %s", exc)
        return None
    return Backend(
        name="npu",
        device_type="npu",
        dist_backend="hccl",
        device_count=count,
        ds_accelerator="npu",
        plugin="npu",
        device_name=TorchNpu.soc_name,
    )


#: Ascend defaults for launched workers; user values win.
#: HCCL_EXEC_TIMEOUT=1800 is below CANN's own default of 1836 s
#: (torch_npu csrc/distributed/ProcessGroupHCCL.cpp `defaultExecTimeout`).
#: DEEPSPEED_TIMEOUT (minutes; deepspeed/constants.py `default_pg_timeout`: 30 up to 0.19.5, 10 from
#: 0.19.6): DeepSpeed 0.19.8 gives its process group 10 minutes, and torch_npu's ProcessGroupHCCL keeps any timeout
#: other than torch's 30-minute default as its watchdog timeout (warning when it is not above
#: HCCL_EXEC_TIMEOUT): a slow first compile or rank-0 load is killed at 600 s. At exactly 30
#: minutes ProcessGroupHCCL raises the watchdog to HCCL_EXEC_TIMEOUT + 1800 s itself — the
#: timeout then exceeds HCCL_EXEC_TIMEOUT whatever its value (same file, v7.1.0.2-pytorch2.6.0).
NPU_LAUNCH_DEFAULTS = {
    "TASK_QUEUE_ENABLE": "2",
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "CPU_AFFINITY_CONF": "1",
    "HCCL_CONNECT_TIMEOUT": "1200",
    "HCCL_EXEC_TIMEOUT": "1800",
    "DEEPSPEED_TIMEOUT": "30",
    # Hang diagnosis: torch_npu's own watchdog switches are left at torch_npu's defaults
    # (csrc/core/npu/register/OptionsManager.cpp, v7.1.0.2 .. master): HCCL_ASYNC_ERROR_HANDLING is
    # already 1 (tear the job down on a failed or timed-out collective), and HCCL_DESYNC_DEBUG stays 0:
    # on, the watchdog writes to the TCPStore twice and records an extra event per collective
    # (ProcessGroupHCCL.cpp master :1966-1990, :2192-2198, :4072-4077), while the hang watch already
    # names the ranks that did not join. Users who want HCCL's own desync report set it.
    # csrc/distributed/ProcessGroupHCCL.hpp/.cpp (c10d::getCvarBool/getCvarInt, all off by default):
    # the heartbeat monitor aborts a rank whose watchdog made no progress for
    # TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC (600 s), and the flight recorder keeps the last
    # TORCH_HCCL_TRACE_BUFFER_SIZE collective events, dumped on a timeout to
    # TORCH_HCCL_DEBUG_INFO_TEMP_FILE (/tmp/hccl_trace_rank_<rank>) — DUMP_ON_TIMEOUT needs both of
    # the others (the .hpp's comment). 2000 entries is torch's own NCCL default.
    "TORCH_HCCL_ENABLE_MONITORING": "1",
    "TORCH_HCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_HCCL_DUMP_ON_TIMEOUT": "1",
}


def worker_defaults(env, nodes: Nodes = SINGLE) -> dict[str, str]:
    """The npu workers' defaults (the launcher then keeps every value ``env`` already sets);
    HCCL_CONNECT_TIMEOUT grows with the job past ~8K processes (multinode.connect_timeout_for)."""
    return dict(
        NPU_LAUNCH_DEFAULTS, DS_ACCELERATOR="npu", HCCL_CONNECT_TIMEOUT=str(connect_timeout_for(nodes.world_size))
    )


#: HCCL listens on HCCL_IF_BASE_PORT .. +15 of the host NIC (CANN's HCCL environment variables:
#: default 60000, one port per device of a 16-device node); a second job on the node fails with
#: EJ0003/EI0019 "Failed to bind the IP port" (vllm-ascend #405, dlrover #1171).
HCCL_DEFAULT_BASE_PORT = 60000
HCCL_PORTS_PER_NODE = 16


def _ports_free(base: int) -> bool:
    import socket

    for port in range(base, base + HCCL_PORTS_PER_NODE):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                return False
    return True


def free_hccl_base_port(env) -> str | None:
    """A base port for this job when HCCL_IF_BASE_PORT is unset and HCCL's default range is taken
    on this node (another job listens there); None when the default is free or the user chose."""
    if "HCCL_IF_BASE_PORT" in env or _ports_free(HCCL_DEFAULT_BASE_PORT):
        return None
    for base in range(HCCL_DEFAULT_BASE_PORT + HCCL_PORTS_PER_NODE, 65536 - HCCL_PORTS_PER_NODE, HCCL_PORTS_PER_NODE):
        if _ports_free(base):
            log.warning(
                "accel-npu: HCCL's default ports %d-%d are in use on this node (another job?); this job "
                "uses HCCL_IF_BASE_PORT=%d",
                HCCL_DEFAULT_BASE_PORT,
                HCCL_DEFAULT_BASE_PORT + HCCL_PORTS_PER_NODE - 1,
                base,
            )
            return str(base)
    return None


@hookimpl
def accel_npu_launch_env(backend, env, nodes, launching):
    if backend.name != "npu":
        return None
    defaults = worker_defaults(env, nodes)
    port = free_hccl_base_port(env) if launching else None
    if port:
        defaults["HCCL_IF_BASE_PORT"] = port
    return defaults


def _error_text(error: BaseException) -> str:
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


@hookimpl
def accel_npu_explain_error(error):
    text = _error_text(error)
    if "Cannot re-initialize NPU in forked subprocess" in text:
        # torch_npu/npu/__init__.py _lazy_init: a process forked after the parent touched the NPU
        return (
            "a process started with fork (a DataLoader worker, most likely) used the NPU the parent had "
            "already initialised, which fork cannot carry over. Create the DataLoader with "
            'multiprocessing_context="spawn" (or call torch.multiprocessing.set_start_method("spawn") '
            "first), and keep NPU work out of Dataset.__getitem__."
        )
    if "TASK_QUEUE_ENABLE = 2 during NPU graph capture" in text:
        # NPUGraph.cpp capture_begin TORCH_CHECK (v7.1.0.2 .. master)
        return (
            'TASK_QUEUE_ENABLE=2 cannot capture NPU graphs (torch.compile mode="reduce-overhead", torchair, '
            "NPUGraph); accel-npu launches workers with 2, faster for eager training, unless you set it. Launch "
            "with TASK_QUEUE_ENABLE=1 in the environment: accel-npu keeps any value you set."
        )
    if any(code in text for code in ("EJ0003", "EI0019")) or "Failed to bind the IP port" in text:
        port = os.environ.get("HCCL_IF_BASE_PORT", str(HCCL_DEFAULT_BASE_PORT))
        return (
            f"HCCL could not listen on its ports (HCCL_IF_BASE_PORT={port} .. +{HCCL_PORTS_PER_NODE - 1}): "
            "another job on this node holds them. Give this job its own range, e.g. HCCL_IF_BASE_PORT="
            f"{int(port) + 2 * HCCL_PORTS_PER_NODE if port.isdigit() else 60100}; launched with accel-npu "
            "and HCCL_IF_BASE_PORT unset, a free range is chosen when the default one is busy."
        )
    return None


def multinode_problems(env, nodes: Nodes) -> list[str]:
    """What this machine can tell is wrong with its part of an HCCL launch across machines."""
    if not nodes.multi:
        return []
    found = []
    if env.get("HCCL_IF_IP", "").strip():
        problem = multinode.if_ip_problem(env["HCCL_IF_IP"], node_net.interface_addresses(), node_net.is_local_address)
        if problem:
            found.append(problem)
    elif env.get("HCCL_SOCKET_IFNAME") is not None:  # HCCL_IF_IP wins over it (CANN's HCCL_SOCKET_IFNAME)
        problem = multinode.socket_ifname_problem(env["HCCL_SOCKET_IFNAME"], node_net.interface_addresses())
        if problem:
            found.append(problem)
    return found


@hookimpl
def accel_npu_check_launch(backend, num_processes, env, nodes):
    # torch_npu installed but not loadable, or loadable without a usable NPU: one clear error before
    # any worker starts, instead of training on the CPU without a word
    if _broken and environment.forced_backend(env) in (None, "npu"):
        raise LaunchError(_broken)
    if _no_device and environment.forced_backend(env) in (None, "npu"):
        raise LaunchError(
            f"accel-npu: torch_npu is installed but no NPU is usable: {_no_device}. To train on "
            "the CPU on purpose, set ACCEL_NPU_BACKEND=cpu."
        )
    if backend.name != "npu":
        return
    problems = multinode_problems(env, nodes)
    if problems:
        # HCCL would fail only at its first communicator, after every machine loaded the model
        raise LaunchError(
            f"accel-npu: machine rank {nodes.rank if nodes.rank is not None else '?'} of "
            f"{nodes.count} refuses to start its workers: " + "; ".join(problems) + "."
        )
    # accelerate wraps extra ranks onto the same device, and HCCL then fails much later. `env` is the
    # workers' environment (accelerate has applied --gpu_ids to ASCEND_RT_VISIBLE_DEVICES by now),
    # read as torch_npu in each worker will read it.
    value = env.get("ASCEND_RT_VISIBLE_DEVICES")
    machine = _machine_device_count(backend)
    seen = visible_devices(value, machine)
    fix = suggested_value(value, machine)
    if seen.count == 0 and value is not None:
        raise LaunchError(
            f"accel-npu: the workers would see no NPU: ASCEND_RT_VISIBLE_DEVICES={value}: {seen.why} "
            f"(torch_npu/npu/__init__.py _parse_visible_devices). "
            + (
                f"Use ASCEND_RT_VISIBLE_DEVICES={fix} (accelerate launch: --gpu_ids {fix})."
                if fix
                else "Unset it, or list device ids separated by commas."
            )
        )
    if seen.count and num_processes > seen.count:
        raise LaunchError(
            f"accel-npu: {num_processes} processes requested but only {seen.count} NPU(s) are "
            f"visible (ASCEND_RT_VISIBLE_DEVICES={value if value is not None else '<unset>'})"
            + (f": {seen.why}" if seen.why else "")
            + f". Use --num_processes {seen.count} (one process per NPU)"
            + (
                f", or ASCEND_RT_VISIBLE_DEVICES={fix} (--gpu_ids {fix}) if you meant those devices."
                if seen.why and fix
                else "."
            )
        )


# -- mx_driving ----------------------------------------------------------------------------------
_mx_lock = threading.RLock()
_mx_state: dict = {"status": "not requested"}
_MX_PENDING = "pending: applied when torch_npu is imported, or before the first of {} is"
#: libraries mx_driving's patcher must come before (DrivingSDK docs/zh/features/patcher.md: apply()
#: before any other import; TransformersNPU patches transformers' Qwen3 modules)
_MX_BEFORE = ("transformers", "accelerate", "diffusers", "deepspeed", "peft", "mmcv", "mmdet", "mmdet3d", "mmengine")


def _torch_initializing() -> bool:
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is None or bool(getattr(spec, "_initializing", False))


def apply_mx_driving(_module=None) -> None:
    """Apply mx_driving's patcher once per process (ACCEL_NPU_MX_DRIVING=1). Never raises."""
    with _mx_lock:  # re-entrant: the patcher imports torch_npu, whose post-import hook calls this again
        if not _mx_state["status"].startswith("pending"):
            return
        if _torch_initializing():
            # torch_npu is imported inside `import torch` (its autoload): mx_driving imports torch,
            # so wait for the first library the script imports after torch (_ApplyMxDrivingFirst).
            return
        _mx_state["status"] = "applying"
        try:
            api, patcher = MxDriving.apply_patcher()
        except Exception as exc:  # noqa: BLE001 - a patcher failure must not stop training
            _mx_state["status"] = f"failed: {type(exc).__name__}: {exc}"
            log.warning("accel-npu: mx_driving patcher not applied: %s", exc)
            return
        _mx_state.update(status=f"applied: {api}", patcher=patcher)
        log.info("accel-npu: mx_driving patcher applied (%s)", api)


class _AlreadyImported(importlib.abc.Loader):
    """Loader for a module the patcher imported while the script's own import of it was being
    looked up: hands back that module instead of running it a second time."""

    def __init__(self, module, spec):
        self._module, self._spec = module, spec

    def create_module(self, spec):
        return self._module

    def exec_module(self, module):
        module.__spec__ = self._spec  # the import system set ours; give the module its own back


class _ApplyMxDrivingFirst(importlib.abc.MetaPathFinder):
    """Applies the pending patcher just *before* the first of ``_MX_BEFORE`` is imported."""

    _busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if (
            path is not None
            or fullname not in _MX_BEFORE
            or getattr(self._busy, "on", False)
            or not _mx_state["status"].startswith("pending")
            or _torch_initializing()
        ):
            return None
        self._busy.on = True
        try:
            apply_mx_driving()
        finally:
            self._busy.on = False
        module = sys.modules.get(fullname)
        if module is None:
            return None
        # The patcher imported it (TransformersNPU imports transformers' Qwen3 modules). The import
        # system would now run it again from its own spec (importlib._bootstrap._find_spec returns
        # sys.modules[name].__spec__): give it a spec whose loader returns the loaded module.
        own = module.__spec__
        module.__spec__ = importlib.util.spec_from_loader(fullname, _AlreadyImported(module, own))
        return module.__spec__


_mx_finder = _ApplyMxDrivingFirst()


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

    # allow_internal_format is left alone: "disable" is torch_npu's own default, and that setting is
    # what prints torch_npu's one-time "Cannot create tensor with internal format" notice
    # (csrc/aten/common/TensorFactories.cpp TORCH_WARN_ONCE): setting it again cannot silence it.
    if environment.flag("ACCEL_NPU_MX_DRIVING") and MxDriving.installed():
        _mx_state["status"] = _MX_PENDING.format(", ".join(_MX_BEFORE))
        wrapt.register_post_import_hook(apply_mx_driving, "torch_npu")
        if _mx_finder not in sys.meta_path:
            sys.meta_path.insert(0, _mx_finder)


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
        info["import torch_npu"] = (
            f"PROBLEM: {exc if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc)}"
        )
    exec_timeout = os.environ.get("HCCL_EXEC_TIMEOUT", NPU_LAUNCH_DEFAULTS["HCCL_EXEC_TIMEOUT"])
    ds_minutes = os.environ.get("DEEPSPEED_TIMEOUT", NPU_LAUNCH_DEFAULTS["DEEPSPEED_TIMEOUT"])
    info["HCCL_EXEC_TIMEOUT (workers)"] = f"{exec_timeout} s (CANN's own default: 1836 s)"
    info["process-group timeout (DeepSpeed, DEEPSPEED_TIMEOUT)"] = f"{ds_minutes} min" + (
        ": torch_npu raises the watchdog to HCCL_EXEC_TIMEOUT + 1800 s" if ds_minutes.strip() == "30" else ""
    )
    workers = {**worker_defaults(os.environ), **os.environ}
    torch_npu_default = {"HCCL_ASYNC_ERROR_HANDLING": "1", "HCCL_DESYNC_DEBUG": "0"}
    info["hang diagnosis (workers)"] = ", ".join(
        f"{name}={workers[name]}"
        if name in workers
        else f"{name}=<unset> (torch_npu: {torch_npu_default.get(name, 'off')})"
        for name in (
            "HCCL_ASYNC_ERROR_HANDLING",
            "HCCL_DESYNC_DEBUG",
            "TORCH_HCCL_ENABLE_MONITORING",
            "TORCH_HCCL_TRACE_BUFFER_SIZE",
            "TORCH_HCCL_DUMP_ON_TIMEOUT",
        )
    )
    info["ASCEND_HOME_PATH"] = os.environ.get("ASCEND_HOME_PATH", "<unset>")
    info["ASCEND_RT_VISIBLE_DEVICES"] = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "<unset>")
    info["mx_driving"] = (
        "not installed"
        if not MxDriving.installed()
        else _mx_state["status"]
        if environment.flag("ACCEL_NPU_MX_DRIVING")
        else "installed; patcher off (ACCEL_NPU_MX_DRIVING=1 enables it)"
    )
    return ("NPU", info)


# -- accel-npu env --selftest ---------------------------------------------------------------------
#: CANN libraries libtorch_npu.so links (torch_npu setup.py `cann_dependencies`, v7.2.0-pytorch2.7.1: the
#: runtime, collectives, op compiler, graph engine), and the driver's, which torch_npu opens to count devices
#: (torch_npu/npu/__init__.py `_raw_device_count_ascend_hal`)
CANN_LIBRARIES = ("libascendcl.so", "libhccl.so", "libacl_op_compiler.so", "libge_runner.so", "libascend_hal.so")


def _skipped(reason: str):
    from accel_npu.cli.selftest import CheckSkipped

    return CheckSkipped(reason)


def check_cann_libraries() -> str:
    import ctypes

    missing, first_error = [], None
    for name in CANN_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError as exc:
            missing.append(name)
            first_error = first_error or str(exc)
    if missing:
        driver = (
            " (libascend_hal.so is the NPU driver's: /usr/local/Ascend/driver/lib64/driver belongs on LD_LIBRARY_PATH)"
            if "libascend_hal.so" in missing
            else ""
        )
        raise OSError(
            f"cannot load {', '.join(missing)} ({first_error}). Fix: source {cann_set_env(os.environ)}{driver}"
        )
    return ", ".join(CANN_LIBRARIES) + " load"


def check_import_torch_npu() -> str:
    try:
        return f"torch_npu {TorchNpu.version()}"
    except (ImportError, OSError) as exc:
        raise ImportError(str(exc) if isinstance(exc, NpuEnvironmentError) else diagnose_import_error(exc)) from exc


def check_soc() -> str:
    return f"CANN {TorchNpu.cann_version() or 'version unknown'}, SoC {TorchNpu.soc_name()}, bf16 " + (
        "supported"
        if TorchNpu.is_bf16_supported()
        else "NOT supported (autocast bf16 runs float32, AdamW uses foreach)"
    )


def check_visible_devices() -> str:
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    count = TorchNpu.device_count()
    if count == 0:
        raise RuntimeError(f"torch_npu sees no NPU: {no_device_reason(os.environ)}")
    listed = len([d for d in (visible or "").split(",") if d.strip()])
    if visible is not None and count != listed:
        seen = visible_devices(visible, TorchNpu.raw_device_count())
        raise RuntimeError(
            f"torch.npu.device_count() is {count} but ASCEND_RT_VISIBLE_DEVICES={visible} lists "
            f"{listed}: {seen.why or 'ids past the machine count are dropped'} "
            "(torch_npu/npu/__init__.py _device_count_ascend_hal)"
        )
    return f"torch.npu.device_count() = {count}" + (
        f" (ASCEND_RT_VISIBLE_DEVICES={visible})" if visible else " (ASCEND_RT_VISIBLE_DEVICES unset)"
    )


def check_mx_driving() -> str:
    if not environment.flag("ACCEL_NPU_MX_DRIVING"):
        raise _skipped("ACCEL_NPU_MX_DRIVING is not 1")
    if not MxDriving.installed():
        raise RuntimeError("ACCEL_NPU_MX_DRIVING=1 but mx_driving is not installed")
    apply_mx_driving()
    status = _mx_state["status"]
    if not status.startswith("applied"):
        raise RuntimeError(status)
    return status


@hookimpl
def accel_npu_selftest_checks(backend):
    if backend.name != "npu":
        return None
    here = __name__
    return [
        ("CANN libraries", f"{here}:check_cann_libraries"),
        ("import torch_npu", f"{here}:check_import_torch_npu"),
        ("CANN / SoC / bf16", f"{here}:check_soc"),
        ("visible devices", f"{here}:check_visible_devices"),
        ("mx_driving", f"{here}:check_mx_driving"),
    ]

"""What ``torch.cuda.*`` answers where CUDA is absent: torch.npu's functions on the npu backend,
CPU equivalents (or documented no-ops) on the cpu backend. docs/cuda-compat.md lists every entry.
"""

from __future__ import annotations

import os
import platform
import time

from accel_npu._torch import callsite
from accel_npu._torch.device import cuda_available

_UNSET = object()
_target = _UNSET


def target() -> str | None:
    """The device type ``"cuda"`` stands for in this process ("npu" or "cpu"), or None: CUDA is
    really present (nothing changes) or the backend is forced to cuda without it."""
    global _target
    if _target is _UNSET:
        if cuda_available():
            _target = None
        else:
            from accel_npu.backend import current_backend

            device_type = current_backend().device_type
            _target = device_type if device_type in ("npu", "cpu") else None
    return _target


def reset() -> None:
    """Forget the cached answer (tests switch backends)."""
    global _target
    _target = _UNSET


# -- devices --------------------------------------------------------------------------------------
def is_cuda_device(device) -> bool:
    """``device`` names a CUDA device: "cuda", "cuda:N", torch.device("cuda", N)."""
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return getattr(device, "type", None) == "cuda" and type(device).__name__ == "device"


def remap(device, ints: bool = False):
    """``device`` with "cuda" replaced by the target device type; ints (CUDA ordinals in
    ``.to(0)``, ``device=0``) too when ``ints``. Anything else is returned unchanged."""
    t = target()
    if t is None:
        return device
    if isinstance(device, str):
        if device == "cuda":
            return t
        if device.startswith("cuda:"):
            return t if t == "cpu" else t + device[4:]
        return device
    if ints and type(device) is int:
        return t if t == "cpu" else f"{t}:{device}"
    if getattr(device, "type", None) == "cuda" and type(device).__name__ == "device":
        import torch

        return torch.device(t) if t == "cpu" or device.index is None else torch.device(t, device.index)
    return device


def device_index(device) -> int:
    """The ordinal of a CUDA device given as int, "cuda:N" or torch.device (None/"cuda": current)."""
    if device is None:
        return _current_index
    if type(device) is int:
        return device
    if isinstance(device, str):
        return int(device.split(":", 1)[1]) if ":" in device else _current_index
    index = getattr(device, "index", None)
    return _current_index if index is None else index


# -- who is asking ----------------------------------------------------------------------------------
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


def caller_is_library(depth: int = 2) -> bool:
    """The code that called the façade function lives in an installed package (site-packages or
    torch) or in accel-npu, not in the user's script or repository. Libraries get the truth about
    CUDA, so xformers, bitsandbytes, flash_attn, transformers, diffusers, accelerate, torch and
    accel-npu's own backend selection choose their non-CUDA paths; the user's script gets the façade."""
    return callsite.caller_is_library(depth, skip=(_HERE,))


# -- the cpu backend's answers ----------------------------------------------------------------------
_current_index = int(os.environ.get("LOCAL_RANK", "0") or 0)


def cpu_device_count() -> int:
    """One "device" per local rank: ``rank % torch.cuda.device_count()`` gives each rank its own index."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def cpu_set_device(device) -> None:
    global _current_index
    _current_index = device_index(device)


def cpu_current_device() -> int:
    return _current_index


def cpu_device_name(device=None) -> str:
    return f"cpu ({platform.processor() or platform.machine()})"


def _proc_status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _mem_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def cpu_memory_allocated(device=None) -> int:
    """This process's resident memory (bytes): the host is the device."""
    return _proc_status_kib("VmRSS") * 1024


def cpu_max_memory_allocated(device=None) -> int:
    """Peak resident memory (VmHWM, bytes) since the start or the last reset_peak_memory_stats()."""
    return _proc_status_kib("VmHWM") * 1024


def cpu_reset_peak_memory_stats(device=None) -> None:
    try:  # Linux >= 4.0: "5" resets the peak RSS (VmHWM) to the current RSS (proc(5) clear_refs)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class CpuDeviceProperties:
    """What scripts read from ``torch.cuda.get_device_properties``: capability (0, 0), so code that
    gates flash attention / bf16 / TF32 on ``major >= 8`` takes its portable path."""

    def __init__(self):
        self.name = cpu_device_name()
        self.total_memory = _mem_total()
        self.major, self.minor = 0, 0
        self.multi_processor_count = os.cpu_count() or 1
        self.is_integrated, self.is_multi_gpu_board = True, False

    def __repr__(self):
        return (
            f"_CudaDeviceProperties(name='{self.name}', major=0, minor=0, "
            f"total_memory={self.total_memory // 2**20}MB, multi_processor_count={self.multi_processor_count})"
        )


class CpuEvent:
    """``torch.cuda.Event`` on the host: ``record`` takes the time (the host runs in program order,
    so recording is synchronizing), ``elapsed_time`` is in milliseconds, as CUDA's."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def synchronize(self):
        return None

    def elapsed_time(self, end_event):
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._t - self._t) * 1000.0


class CpuStream:
    """``torch.cuda.Stream`` on the host: one in-order stream; work "on" it is ordinary host work."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device, self.priority = device, priority

    def wait_event(self, event):
        return None

    def wait_stream(self, stream):
        return None

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record(self)
        return event

    def query(self):
        return True

    def synchronize(self):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

"""The device backend a process trains on, chosen by the ``accel_npu_select_backend`` hook."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backend:
    """What a device plugin tells the rest of accel-npu about the machine.

    name:            "npu", "cuda" or "cpu".
    device_type:     torch device type for tensors ("npu", "cuda", "cpu").
    dist_backend:    torch.distributed backend ("hccl", "nccl", "gloo").
    device_count:    visible devices (0 for cpu: no per-process device limit).
    ds_accelerator:  DeepSpeed accelerator name (DS_ACCELERATOR), None to leave DeepSpeed alone.
    plugin:          name of the plugin that selected it.
    device_name:     a function returning the device's model (the SoC on npu, e.g. Ascend910B1), or None;
                     asked only where a device is in use anyway (it may initialise one).
    """

    name: str
    device_type: str
    dist_backend: str
    device_count: int = 0
    ds_accelerator: str | None = None
    plugin: str = ""
    device_name: Callable[[], str] | None = field(default=None, compare=False, repr=False)
    details: dict = field(default_factory=dict, compare=False)

    @property
    def is_accelerator(self) -> bool:
        return self.name != "cpu"

    def model(self) -> str | None:
        """The device's model (``device_name()``), or None when the backend cannot say."""
        try:
            return str(self.device_name()) if self.device_name else None
        except Exception:  # noqa: BLE001 - a runtime that cannot answer: the model stays unknown
            return None

    def device_for(self, local_rank: int) -> str:
        if not self.is_accelerator:
            return "cpu"
        return f"{self.device_type}:{local_rank}"


_cached: Backend | None = None
#: accelerators installed in this process but unusable, {backend name: why, naming the cause and the
#: fix}: recorded by device plugins while selecting, so that a launched rank refuses the CPU fallback
_unusable: dict[str, str] = {}


def record_unusable(name: str, why: str) -> None:
    """A device plugin's note that its accelerator is installed here but cannot be used, and why."""
    _unusable[name] = why


def cpu_fallback_refusal(env=os.environ) -> str | None:
    """Why this launched rank must not train on the CPU: its accelerator is installed but unusable here
    (recorded by the device plugin), and ``ACCEL_NPU_BACKEND=cpu`` does not say the CPU is meant.
    None when the rank may go on (an accelerator in use, the CPU chosen, or not a launched rank)."""
    from accel_npu import environment

    if current_backend().is_accelerator or not is_distributed_launch(env) or not _unusable:
        return None
    if environment.forced_backend(env) == "cpu":
        return None
    name, why = next(iter(_unusable.items()))
    return (
        f"accel-npu: rank {env.get('RANK', '?')} of {env.get('WORLD_SIZE', '?')} has no usable "
        f"{name.upper()}, and a rank of a launched job does not fall back to the CPU: {why}. To train on "
        "the CPU on purpose, set ACCEL_NPU_BACKEND=cpu."
    )


def current_backend() -> Backend:
    """The backend of this process (selected once, on first use, then cached)."""
    global _cached
    if _cached is None:
        from accel_npu.manager import get_plugin_manager

        chosen = get_plugin_manager().hook.accel_npu_select_backend(env=dict(os.environ))
        _cached = chosen or Backend(name="cpu", device_type="cpu", dist_backend="gloo", plugin="fallback")
    return _cached


def reset_backend_cache() -> None:
    global _cached
    _cached = None
    _unusable.clear()


def is_distributed_launch(env=os.environ) -> bool:
    """A launcher (torchrun / accelerate launch) started this process as one of several ranks."""
    try:
        return int(env.get("LOCAL_RANK", "-1")) != -1 and int(env.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False

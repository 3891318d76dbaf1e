"""The files `accel-npu config` writes beside an accelerate config (read by the launch plugin too).

``<stem>.yaml`` (accelerate) + ``<stem>.deepspeed.json`` + ``<stem>.accel-npu.yaml`` (the
sidecar: ``env:`` variables for the training processes).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only
    from accel_npu.backend import Backend

DEEPSPEED_SUFFIX = ".deepspeed.json"
SIDECAR_SUFFIX = ".accel-npu.yaml"


def sidecar_for(config_file: str) -> str:
    """``launch_configs/cpu_zero3.yaml`` -> ``launch_configs/cpu_zero3.accel-npu.yaml``."""
    base, _ext = os.path.splitext(os.fspath(config_file))
    return base + SIDECAR_SUFFIX


def _no_interface(main_process_ip: str | None) -> str:
    return ""


def _no_problem(value: str) -> str | None:
    return None


@dataclass(frozen=True)
class WorkerTuning:
    """A backend's tunable worker environment, as ``accel-npu config`` offers it in the sidecar: a
    device plugin's ``accel_npu_worker_tuning`` hook returns one, so the wizard names no backend's
    variables itself.

    title:              what the variables are, as the wizard names them ("Ascend runtime settings").
    backend:            the backend whose ``accel_npu_launch_env`` defaults the wizard proposes
                        (asked with ``launching=False``, for the job's shape).
    variables:          ``(name, what it does)`` of each variable offered, in the order asked.
    problem:            ``problem(name, value)``: why ``value`` cannot be given to ``name``, or None.
    interface:          ``(name, what it does)`` of the variable naming the host interface(s) the
                        backend's collectives reach the other machines by, written for jobs across
                        machines only; None when the backend has none.
    interface_unset:    what happens where ``interface`` is left unset ("HCCL picks").
    suggest_interface:  ``suggest_interface(main_process_ip)``: the value to offer ("" for none).
    interface_problem:  ``interface_problem(value)``: why ``value`` cannot work from this machine, or None.
    """

    title: str
    backend: Backend
    variables: tuple[tuple[str, str], ...]
    problem: Callable[[str, str], str | None]
    interface: tuple[str, str] | None = None
    interface_unset: str = ""
    suggest_interface: Callable[[str | None], str] = _no_interface
    interface_problem: Callable[[str], str | None] = _no_problem

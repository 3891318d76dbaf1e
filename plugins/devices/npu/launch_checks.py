"""Launches refused before any worker starts: torch_npu unusable, more ranks than visible NPUs,
a multi-machine HCCL setup this machine can tell is wrong."""

from __future__ import annotations

import os

from accel_npu import environment
from accel_npu._torch import nodes as node_net
from accel_npu._torch.nodes import Nodes
from accel_npu.errors import LaunchError
from accel_npu.plugins.devices.npu import multinode, selection
from accel_npu.plugins.devices.npu.contract import TorchNpu
from accel_npu.plugins.devices.npu.visibility import suggested_value, visible_devices


def _machine_device_count(backend) -> int:
    """The driver's NPU count (what ASCEND_RT_VISIBLE_DEVICES chooses from); -1 when unknown."""
    try:
        raw = TorchNpu.raw_device_count()
    except Exception:  # noqa: BLE001 - a private torch_npu function: fall back to what we know
        raw = -1
    if raw <= 0 and "ASCEND_RT_VISIBLE_DEVICES" not in os.environ:
        raw = backend.device_count  # this process sees every device
    return raw


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


def check_launch(backend, num_processes, env, nodes) -> None:
    """LaunchError when this launch cannot work on this machine's NPUs, before any worker starts."""
    # torch_npu installed but not loadable, or loadable without a usable NPU: one clear error before
    # any worker starts, instead of training on the CPU without a word
    if selection.broken and environment.forced_backend(env) in (None, "npu"):
        raise LaunchError(selection.broken)
    if selection.no_device and environment.forced_backend(env) in (None, "npu"):
        raise LaunchError(
            f"accel-npu: torch_npu is installed but no NPU is usable: {selection.no_device}. To train on "
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

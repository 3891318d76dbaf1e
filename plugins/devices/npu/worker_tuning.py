"""The Ascend runtime settings ``accel-npu config`` offers for the training processes: what each
variable does, the values torch_npu and CANN accept, and HCCL_SOCKET_IFNAME for a job across machines.

The values the wizard proposes are this backend's launch defaults (``accel_npu_launch_env``, asked
with ``launching=False``); this module says what the wizard asks and how it checks the answers.
"""

from __future__ import annotations

import re

from accel_npu._torch.nodes import interface_names, parse_socket_ifname, route_interface, usable_interfaces
from accel_npu.backend import Backend
from accel_npu.config_files import WorkerTuning
from accel_npu.hookspecs import hookimpl

#: the Ascend runtime variables the wizard offers, in the order it asks
VARIABLES = (
    ("TASK_QUEUE_ENABLE", "task queue: 0 off, 1 on, 2 also moves workspace tasks (may raise peak memory)"),
    ("PYTORCH_NPU_ALLOC_CONF", "NPU caching allocator; expandable_segments:True reduces fragmentation OOMs"),
    ("CPU_AFFINITY_CONF", "bind each rank to CPU cores: 0 off, 1 coarse (per NUMA node), 2 fine"),
    ("HCCL_CONNECT_TIMEOUT", "seconds HCCL waits for all ranks to connect"),
    ("HCCL_EXEC_TIMEOUT", "seconds one HCCL collective may take before the job fails"),
)

#: what the wizard writes for HCCL across machines (more than one machine)
SOCKET_IFNAME = (
    "HCCL_SOCKET_IFNAME",
    "host interface(s) HCCL reaches the other machines by: name prefixes (eth,enp), "
    "=exact names, ^excluded (CANN's syntax)",
)

#: variables taking one of a few levels: (accepted values, how to say them)
_LEVELS = {
    "TASK_QUEUE_ENABLE": ({"0", "1", "2"}, "0, 1 or 2"),
    "CPU_AFFINITY_CONF": ({"0", "1", "2"}, "0, 1 or 2"),
}


def value_problem(name: str, value: str) -> str | None:
    """Why ``value`` cannot be given to ``name``; None when it can."""
    value = str(value).strip()
    if name in _LEVELS:
        allowed, text = _LEVELS[name]
        if value not in allowed:
            return f"{name} must be {text} (got {value!r})"
    elif name.startswith("HCCL_") and not (value.isdigit() and int(value) > 0):
        return f"{name} must be a number of seconds > 0 (got {value!r})"
    elif name == "PYTORCH_NPU_ALLOC_CONF" and value and ":" not in value:
        return f"PYTORCH_NPU_ALLOC_CONF must look like key:value[,key:value] (got {value!r})"
    return None


def suggested_socket_ifname(main_process_ip: str | None) -> str:
    """The HCCL_SOCKET_IFNAME to offer: the letters the name of this machine's interface towards the
    main machine starts with ("enp" for enp189s0f0), a prefix that also matches the other machines'
    differently numbered interfaces; "" when there is no route to tell."""
    name = route_interface(main_process_ip) if main_process_ip else None
    stem = re.match(r"[A-Za-z]+", name or "")
    return stem.group(0) if stem else ""


def socket_ifname_answer_problem(value: str) -> str | None:
    """Why HCCL_SOCKET_IFNAME=``value`` cannot work from this machine (the config is run here too)."""
    value = str(value).strip()
    if not value:
        return None
    if not parse_socket_ifname(value)[2]:
        return (
            f"--hccl-socket-ifname {value!r} names no interface: give name prefixes separated by commas "
            f"(eth,enp), '=' before exact names (=eth0), '^' to exclude"
        )
    names = interface_names()
    if not usable_interfaces(value, names):
        return (
            f"--hccl-socket-ifname {value} matches no interface of this machine (it has: {', '.join(names)}); "
            f"give a prefix every machine's interface starts with"
        )
    return None


TUNING = WorkerTuning(
    title="Ascend runtime settings",
    # the npu backend as the launcher would select it; the wizard may run on a machine without NPUs
    backend=Backend(name="npu", device_type="npu", dist_backend="hccl", ds_accelerator="npu"),
    variables=VARIABLES,
    problem=value_problem,
    interface=SOCKET_IFNAME,
    interface_unset="HCCL picks",
    suggest_interface=suggested_socket_ifname,
    interface_problem=socket_ifname_answer_problem,
)


@hookimpl
def accel_npu_worker_tuning(backend_name):
    return TUNING if backend_name == "npu" else None

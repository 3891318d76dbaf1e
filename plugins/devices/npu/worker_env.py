"""The npu workers' environment: Ascend defaults (the user's values win) and HCCL's ports."""

from __future__ import annotations

import logging

from accel_npu._torch.nodes import SINGLE, Nodes
from accel_npu.plugins.devices.npu.multinode import connect_timeout_for

log = logging.getLogger("accel_npu")


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


def launch_env(backend, env, nodes, launching) -> dict[str, str] | None:
    """The npu workers' environment defaults; a free HCCL port range when a launch would collide."""
    if backend.name != "npu":
        return None
    defaults = worker_defaults(env, nodes)
    port = free_hccl_base_port(env) if launching else None
    if port:
        defaults["HCCL_IF_BASE_PORT"] = port
    return defaults

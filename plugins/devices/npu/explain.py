"""What to change when an error is the NPU machine's doing, not the script's."""

from __future__ import annotations

import os

from accel_npu.plugins.devices.npu.worker_env import HCCL_DEFAULT_BASE_PORT, HCCL_PORTS_PER_NODE


def _error_text(error: BaseException) -> str:
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


def explain_error(error) -> str | None:
    """The fix for an error the NPU machine caused (a fork after NPU use, graph capture under
    TASK_QUEUE_ENABLE=2, HCCL's ports taken), or None."""
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

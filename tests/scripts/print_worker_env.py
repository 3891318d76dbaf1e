"""A launched worker that reports what it was started with (no accelerate, no accel_npu import).

Prints ``RESULT {json}``: rank, the Ascend environment variables, and whether torch_npu imported
(torch.npu present), and how many NPUs torch_npu counts.
"""

import json
import os

KEYS = (
    "TASK_QUEUE_ENABLE",
    "HCCL_IF_BASE_PORT",
    "PYTORCH_NPU_ALLOC_CONF",
    "CPU_AFFINITY_CONF",
    "HCCL_CONNECT_TIMEOUT",
    "HCCL_EXEC_TIMEOUT",
    "DEEPSPEED_TIMEOUT",
    "DS_ACCELERATOR",
    "ASCEND_RT_VISIBLE_DEVICES",
    "HCCL_ASYNC_ERROR_HANDLING",
    "TORCH_HCCL_ASYNC_ERROR_HANDLING",
    "HCCL_DESYNC_DEBUG",
    "TORCH_HCCL_DESYNC_DEBUG",
    "TORCH_HCCL_ENABLE_MONITORING",
    "TORCH_HCCL_TRACE_BUFFER_SIZE",
    "TORCH_HCCL_DUMP_ON_TIMEOUT",
    "HCCL_SOCKET_IFNAME",
    "HCCL_IF_IP",
)

rec = {
    "rank": int(os.environ.get("RANK", "0")),
    "local_rank": os.environ.get("LOCAL_RANK"),
    "world_size": os.environ.get("WORLD_SIZE"),
    "env": {k: os.environ.get(k) for k in KEYS},
}
import torch  # noqa: E402 - after the environment is read, before torch could change it
import torch_npu  # noqa: E402 - after the environment is read, before torch could change it

rec["torch_npu"] = hasattr(torch, "npu") and torch_npu.__name__ == "torch_npu"
rec["npu_count"] = torch.npu.device_count()  # as torch_npu counts ASCEND_RT_VISIBLE_DEVICES
print("RESULT " + json.dumps(rec), flush=True)

"""The loading section of ``accel-npu env``: truncation, load slots and threads, where ZeRO-3 and FSDP
loads go, the memory calls this machine offers."""

from __future__ import annotations

from accel_npu._torch.dist import local_world_size
from accel_npu._torch.memory import available_memory, malloc_trim, prefault_available
from accel_npu.environment import get as env_get
from accel_npu.errors import ConfigError


def loading_report() -> dict:
    """The loading section of ``accel-npu env`` (never raises)."""
    from accel_npu.plugins.loading import truncation
    from accel_npu.plugins.loading.placement import fsdp, zero3
    from accel_npu.plugins.loading.slots import load_threads

    info: dict = {}
    try:
        wanted = truncation.truncation_map()
        info["truncate (ACCEL_NPU_TRUNCATE)"] = ", ".join(f"{k} -> {v} layers" for k, v in wanted.items()) or "off"
    except ConfigError as exc:
        info["truncate (ACCEL_NPU_TRUNCATE)"] = f"INVALID: {exc}"
    raw = env_get("ACCEL_NPU_LOAD_SLOTS").strip()
    info["load slots (ACCEL_NPU_LOAD_SLOTS)"] = raw or "from free memory (multi-rank nodes only)"
    info["slot timeout s (ACCEL_NPU_LOAD_TIMEOUT)"] = env_get("ACCEL_NPU_LOAD_TIMEOUT")
    try:
        info["load threads (ACCEL_NPU_LOAD_THREADS)"] = str(load_threads(local_world_size()))
    except ConfigError as exc:
        info["load threads (ACCEL_NPU_LOAD_THREADS)"] = f"INVALID: {exc}"
    info["ZeRO-3 loads (ACCEL_NPU_ZERO3_INIT)"] = (
        "straight into partitions, read once by rank 0"
        if zero3.switched_on()
        else "off: whole model on every rank, as stock"
    )
    info["FSDP loads (fsdp_cpu_ram_efficient_loading)"] = (
        "rank 0 reads, the other ranks get its weights at prepare"
        if fsdp.efficient_loading_requested()
        else "off in this environment: every rank reads, as stock"
    )
    avail = available_memory()
    info["MemAvailable"] = f"{avail / 2**30:.1f} GiB" if avail else "unknown"
    info["malloc_trim"] = "available" if malloc_trim() else "not available (not glibc?)"
    info["casts' pages faulted in ahead (MADV_POPULATE_WRITE)"] = (
        "available"
        if prefault_available()
        else "not available (Linux before 5.14, or not glibc): casts fault them as they copy"
    )
    return info

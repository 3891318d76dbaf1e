"""Read on this rank: within a load slot (at most K ranks of a node at once), cast in threads."""

from __future__ import annotations

import logging
import time

from accel_npu._torch.dist import local_world_size
from accel_npu.plugins.loading.lazy import LazyTensors, progress_bar
from accel_npu.plugins.loading.placement import fsdp
from accel_npu.plugins.loading.slots import load_slot, load_threads, slot_count

log = logging.getLogger("accel_npu")


def place(job, early=None) -> float:
    """Fill ``job.model`` from its files on this rank (taking what ``early``, a prefetch.Prefetch, has
    read); returns the seconds the read took."""
    started = time.perf_counter()
    budget = max(job.nbytes, job.out_bytes)
    slots = slot_count(budget)
    threads = load_threads(min(local_world_size(), slots or local_world_size()))
    with load_slot(budget, what=f"{job.cls.__name__} from {job.folder}", slots=slots):
        bar = progress_bar(job.nbytes, job.desc, len(job.needed_files))
        try:
            job.load_into_meta(
                LazyTensors(job.ckpt, job.kept, progress=bar, convert=job.cast(), threads=threads, prefetch=early)
            )
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - started
    if fsdp.rank0_reads_for_all():
        log.warning(
            "accel-npu: %s read on rank 0 only (fsdp_cpu_ram_efficient_loading): the other %d rank(s) "
            "read nothing; accelerator.prepare gives them rank 0's weights (a model used without "
            "prepare reads its files on its first call).",
            job.cls.__name__,
            fsdp.world_size() - 1,
        )
    return seconds

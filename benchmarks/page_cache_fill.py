"""How a shard gets into the page cache decides what reading it through its mapping costs afterwards.

A load reads tensors through the mmap safetensors makes of each shard; with a cold cache it asks the
kernel for the bytes ahead of the reader (plugins/loading/lazy.py's ``Readahead``). This measures,
for one shard of ``benchmarks/host_memory.py``'s checkpoint, dropped from the cache before each run
(``POSIX_FADV_DONTNEED``), the CPU and faults of filling the cache one way, then of touching one byte
of every 4 KiB page through a fresh read-only mapping (what a cast or a copy does), in a fresh process:

  willneed   ``posix_fadvise(POSIX_FADV_WILLNEED)`` in pieces of the device's readahead size (what
             ``Readahead`` does today)
  populate   ``madvise(MADV_POPULATE_READ)`` (Linux 5.14) on a read-only mapping, in the same pieces:
             the pages come in through the page-fault path and its readahead
  sendfile   ``os.sendfile`` of the same pieces to /dev/null: the buffered-read path and its readahead,
             nothing copied to user space
  fault      no fill: the touch's own page faults read the file (the raw reader's way)

Linux's ``force_page_cache_ra`` (mm/readahead.c), which serves WILLNEED, allocates the page cache in
folios of the mapping's minimum order (one 4 KiB page here), while the fault path's and the buffered
read path's readahead (``page_cache_ra_order``) allocate large folios; a fault on a mapping maps at
most one fault-around window or one folio, so small folios mean more faults for the same bytes. Minor
faults and CPU are ``getrusage`` of the process; the fill of "fault" is inside its touch.

Usage: python benchmarks/page_cache_fill.py [--repeat 3] [--cache DIR]
Writes benchmarks/results/page_cache_fill.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_memory  # the checkpoint and its cache
from _results import Report, median_spread

from accel_npu.plugins.loading.lazy import _readahead_bytes  # the piece size Readahead uses

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("plugins/loading/lazy.py", "benchmarks/host_memory.py")

MODES = ("willneed", "populate", "sendfile", "fault")
MADV_POPULATE_READ = 22  # include/uapi/asm-generic/mman-common.h (Python 3.11's mmap module lacks the name)


def _usage() -> tuple[float, int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt, time.perf_counter()


def measure(mode: str, path: str) -> dict:
    """One run in this process: drop the file from the cache, fill it by ``mode``, touch every page."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        piece = _readahead_bytes(fd)
        before = _usage()
        if mode == "willneed":
            for off in range(0, size, piece):
                os.posix_fadvise(fd, off, min(piece, size - off), os.POSIX_FADV_WILLNEED)
        elif mode == "populate":
            with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
                for off in range(0, size, piece):
                    m.madvise(MADV_POPULATE_READ, off, min(piece, size - off))
        elif mode == "sendfile":
            sink = os.open(os.devnull, os.O_WRONLY)
            try:
                for off in range(0, size, piece):
                    length, done = min(piece, size - off), 0
                    while done < length:
                        sent = os.sendfile(sink, fd, off + done, length - done)
                        if not sent:
                            break
                        done += sent
            finally:
                os.close(sink)
        filled = _usage()
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            view = memoryview(m)
            total = 0
            for off in range(0, size, mmap.PAGESIZE):
                total += view[off]
            view.release()
        touched = _usage()
    finally:
        os.close(fd)
    return {
        "fill_cpu": filled[0] - before[0],
        "fill_wall": filled[2] - before[2],
        "touch_cpu": touched[0] - filled[0],
        "touch_faults": touched[1] - filled[1],
        "touch_wall": touched[2] - filled[2],
        "cpu": touched[0] - before[0],
        "wall": touched[2] - before[2],
        "bytes": size,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", default=str(host_memory.default_cache()))
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "FILE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print("RESULT " + json.dumps(measure(*a.worker)), flush=True)
        return 0
    ckpt = host_memory.build_checkpoint(Path(a.cache))
    shard = sorted(ckpt.glob("*.safetensors"))[len(list(ckpt.glob("*.safetensors"))) // 2]
    report = Report(
        "page_cache_fill", "Filling the page cache: what reading a shard through its mapping costs after", MEASURES
    )
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(a.repeat):  # interleaved rounds, a fresh process per run
        for mode in MODES:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", mode, str(shard)], capture_output=True, text=True, timeout=600
            )
            if proc.returncode != 0 or "RESULT " not in proc.stdout:
                raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
            got[mode].append(json.loads(proc.stdout.split("RESULT ", 1)[1]))
            x = got[mode][-1]
            print(
                f"  {mode} #{i + 1}: fill cpu {x['fill_cpu'] * 1e3:.0f} ms, touch cpu {x['touch_cpu'] * 1e3:.0f} ms, "
                f"{x['touch_faults']} faults",
                flush=True,
            )
    size = got[MODES[0]][0]["bytes"]
    report.text(
        f"One shard, {shard.name} of {ckpt.name} ({size / 2**20:,.0f} MB), dropped from the cache before each run; "
        f"{a.repeat} interleaved rounds, a fresh process per run. Median (min-max). Fill: the calls that ask for "
        "the bytes (none for fault). Touch: one byte of every 4 KiB page through a fresh read-only mapping; its "
        "minor faults. CPU: the process's user + system time (getrusage); total = fill + touch."
    )

    def ms(values):
        return median_spread([v * 1e3 for v in values], "{:.0f}", " ms")

    rows = [
        [
            mode,
            ms([x["fill_cpu"] for x in got[mode]]),
            ms([x["fill_wall"] for x in got[mode]]),
            median_spread([x["touch_faults"] for x in got[mode]], "{:,.0f}"),
            ms([x["touch_cpu"] for x in got[mode]]),
            ms([x["cpu"] for x in got[mode]]),
            ms([x["wall"] for x in got[mode]]),
        ]
        for mode in MODES
    ]
    report.table(["fill", "fill CPU", "fill wall", "touch faults", "touch CPU", "total CPU", "total wall"], rows)
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

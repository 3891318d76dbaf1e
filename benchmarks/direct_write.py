"""The background checkpoint writer's cost for one rank's state: a torch.save archive written through the page
cache (the writer before, and any filesystem refusing O_DIRECT) against one written past it
(plugins/checkpoints/direct_io.py), the same state dict, alternating, each file dropped from the cache and
removed after its run.

The state is a ZeRO-2 rank's: a few large flat fp32 storages (its parameter partition and the two Adam moments,
page-aligned as the writer's host copies are) and small objects. Measured per write: wall time to durable
(torch.save, then fsync); the writer thread's CPU (``time.thread_time``: serialization, CRC-32, copies into the
page cache); every core's busy time over the same interval (``/proc/stat``, all but idle and iowait: adds the
kernel's writeback and reclaim, which run on threads of their own); and the file's pages left in the page cache
(mincore(2)), memory the kernel must reclaim later. A third kind, direct without the archive's CRC-32 (which the
writer keeps), shows what of the writer's CPU is the checksum.

Usage: python benchmarks/direct_write.py [--gb 2] [--runs 5]
Writes benchmarks/results/direct_write.md. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Report, median_spread

from tests.page_cache import drop_from_cache, resident_fraction

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("plugins/checkpoints/direct_io.py", "plugins/checkpoints/background.py")


KINDS = ("buffered", "direct", "direct_nocrc")


def busy_seconds() -> float:
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def drop(path: str) -> None:
    drop_from_cache(path)
    os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0, help="the state's size in GiB")
    ap.add_argument("--runs", type=int, default=5, help="writes of each kind, alternating")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    a = ap.parse_args()
    report = Report("direct_write", "A rank's checkpoint file written through the page cache and past it", MEASURES)

    import torch

    from accel_npu.plugins.checkpoints import background, direct_io

    if not direct_io.supported():
        sys.exit("this platform or torch cannot write O_DIRECT archives (torch 2.6+ on Linux)")
    # a ZeRO-2 rank's optimizer file: its fp32 partition and the two Adam moments, as the writer's host copies
    numel = int(a.gb * 2**30) // 4 // 3
    flat = [torch.empty(0).set_(direct_io.host_storage(4 * numel), 0, (numel,), (1,)) for _ in range(3)]
    for t in flat:
        t.normal_()
    state = {
        "optimizer_state_dict": {"state": {0: {"exp_avg": flat[1], "exp_avg_sq": flat[2], "step": 10}}},
        "fp32_flat_groups": [flat[0]],
        "param_shapes": [{f"blocks.{i}.weight": torch.Size([1024, 1024]) for i in range(200)}],
        "ds_version": "0.19.8",
    }
    nbytes = 3 * 4 * numel
    runs: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="accel_npu_direct_write_", dir=a.dir) as folder:
        for i in range(a.runs):
            for kind in KINDS:
                path = os.path.join(folder, f"{kind}_{i}.pt")
                os.sync()
                time.sleep(1)  # the previous run's writeback settled
                busy, cpu, wall = busy_seconds(), time.thread_time(), time.perf_counter()
                if kind != "buffered":
                    torch.serialization.set_crc32_options(kind == "direct")
                    try:
                        assert direct_io.save(state, path), f"{folder} refuses O_DIRECT"
                    finally:
                        torch.serialization.set_crc32_options(True)
                else:
                    torch.save(state, path)
                    background._fsync_file(path)
                wall, cpu, busy = time.perf_counter() - wall, time.thread_time() - cpu, busy_seconds() - busy
                cached = resident_fraction(path)
                drop(path)
                got = runs.setdefault(kind, {"wall": [], "cpu": [], "busy": [], "cached": []})
                for key, value in (("wall", wall), ("cpu", cpu), ("busy", busy), ("cached", cached)):
                    got[key].append(value)
                print(f"{kind:9s} run {i}: wall {wall:.2f} s, writer CPU {cpu:.2f} s, cores busy {busy:.2f} s")
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in runs.items()}
    rows = []
    for kind in KINDS:
        r = runs[kind]
        rows.append(
            [
                kind,
                median_spread(r["wall"], unit=" s"),
                f"{nbytes / 2**30 / med[kind]['wall']:.2f} GiB/s",
                median_spread(r["cpu"], unit=" s"),
                median_spread(r["busy"], unit=" s"),
                f"{100 * med[kind]['cached']:.0f} %",
            ]
        )
    ratios = [
        [
            f"{kind} / buffered",
            f"{med[kind]['wall'] / med['buffered']['wall']:.2f}×",
            "",
            f"{med[kind]['cpu'] / med['buffered']['cpu']:.2f}×",
            f"{med[kind]['busy'] / med['buffered']['busy']:.2f}×",
            "",
        ]
        for kind in KINDS[1:]
    ]
    report.text(
        f"State: a ZeRO-2 rank's optimizer file, three flat fp32 storages of {numel / 1e6:.0f} M elements "
        f"({nbytes / 2**30:.2f} GiB in all, page-aligned host copies) and small objects; {a.runs} writes of each "
        "kind, alternating, into a temporary folder on the machine's disk; medians (min-max). Buffered: "
        "`torch.save(state, path)` then fsync. Direct: `direct_io.save` (O_DIRECT, records page-aligned, CRC-32 "
        "kept, tail buffered, fsync), what the writer does. direct_nocrc: the same with torch's CRC-32 switched off "
        "(`torch.serialization.set_crc32_options(False)`), which the writer does not do: it shows the checksum's "
        "share of the rest."
    )
    report.table(
        ["write", "wall to durable", "throughput", "writer thread CPU", "all cores busy", "file left in page cache"],
        rows + ratios,
    )
    path = report.write()
    print(path.read_text())


if __name__ == "__main__":
    main()

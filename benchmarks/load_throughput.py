"""Load throughput, end to end: the wall time of the whole ``from_pretrained`` call vs a raw
``safe_open`` read of the same bytes with the same number of threads.

The checkpoint is ``benchmarks/host_memory.py``'s (60-block QwenImage, 9 shards; built once into
the cache). The loaded model keeps the first ``--keep`` blocks (2: a truncated load, 60: the whole
checkpoint). Every measurement is a fresh process; the clock runs from just before the call to just
after every tensor it produced has each 4 KiB page touched (imports excluded; model construction,
key planning, validation and reading included). Every reader keeps everything it read. Readers, all
with ``--threads`` T:

  raw     safe_open + get_tensor + clone (no cast) / + .to(float32) (cast) of exactly the tensors the
          truncated model holds, kept in a list, T reader threads over the tensors (torch: 1 thread each),
          then the shard files closed (their munmap is part of a read; from_pretrained pays it inside
          the call). ``get_tensor`` alone returns a view of the file's mmap (safetensors >= 0.8): clone
          is the copy into fresh memory a read means.
  view    (no cast only) raw without the copy: the ``get_tensor`` views kept, the shard files closed
          (each view holds its own mapping), then the same touch of every page: what accel-npu's load
          does when it casts nothing, without its readahead. The no-cast cells' like-for-like baseline.
  accel   accel-npu, the unchanged script's call: ``from_pretrained(path)`` with
          ``ACCEL_NPU_TRUNCATE=QwenImageTransformer2DModel:<keep>``, ``ACCEL_NPU_LOAD_THREADS=T``
  stock   ``ACCEL_NPU_DISABLE=1``, ``from_pretrained(path, num_layers=<keep>)`` (stock's way to the same
          model; it has no reader threads of its own, so torch gets T threads)

A load may return tensors that are still views of the file's mmap (bf16 as stored): touching them
inside the clock reads (cold) and maps their pages, so every reader ends with every byte resident.
The table's anon / file columns say where those bytes live: the process's own memory, or page-cache
pages it maps (shared by every rank that maps the same file). A no-cast load returns views, so its
cells are compared with both raw readers: "vs raw" (raw copies every tensor, the load does not) and "vs
view" (neither copies); the summary lines count the cast cells against raw and the no-cast cells against
view only.

"no cast" loads with ``torch_dtype=torch.bfloat16`` (as stored); "cast" loads without torch_dtype
(fp32, twice the bytes written: the unchanged script's call). Page cache: "warm" (the files read once
before); "cold": ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every shard file before every run (this job's
files only, unmapped then: the whole machine's cache is left alone for the jobs sharing it). Every run
follows the same untimed predecessor (``PREDECESSOR``: the cell's fp32 bytes written into fresh memory,
then freed), whichever reader it is, and its clock starts ``--start-after`` seconds after the
predecessor exited, imports done (0: as soon as its imports are done, a load seconds after raw): the time
since memory was freed decides what touching fresh memory costs on a VM that reports free pages to its
host, and the sweep (0, 2, 8 s by default) shows whether a ratio depends on it. Runs are
interleaved, ``--repeat`` times (raw first in odd rounds, last in even ones; ``--repeat-keep 2:15`` gives a
keep its own count: a small load's cells take a second a run, and their ratios need more rounds to
settle than the whole model's); the table gives median
(min-max) seconds, the median throughput = kept checkpoint bytes / seconds, and vs raw: median (min-max)
of raw's seconds / the reader's in the same round, which a machine drifting between rounds moves less
than a ratio of medians.

Usage: python benchmarks/load_throughput.py [--repeat 5] [--repeat-keep 2:15] [--keep 2,60] [--threads 1,2]
       [--start-after 0,2,8] [--cache DIR] [--quick]
Writes benchmarks/results/load_throughput.md.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_memory  # the checkpoint and its cache
from _results import Report, median_spread

from tests.page_cache import drop_from_cache

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("plugins/loading/", "accel_npu/_torch/safetensors_io.py", "benchmarks/host_memory.py")
MB = 1024**2

WORKER = r"""
import json, os, sys, time
import torch
reader, cast, path, keep, threads = sys.argv[1], sys.argv[2] == "cast", sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads if reader == "stock" else 1)
dtype = None if cast else torch.bfloat16
start_at = float(sys.argv[7])  # the driver's CLOCK_MONOTONIC time (one clock for every process on Linux)

def wait_for_start():
    # every reader starts its clock the same time after the predecessor freed its memory, however long
    # its imports took: on a VM that reports free pages to its host, that time decides what a first
    # touch of fresh memory costs. Returns how late this process got there (its imports took longer).
    time.sleep(max(0.0, start_at - time.monotonic()))
    return max(0.0, time.monotonic() - start_at)

def touch(tensors):
    # one byte of every 4 KiB page of every storage: a page still backed by the file (an mmap view)
    # is read (cold) and mapped here, inside the clock; fresh memory a reader wrote is already resident
    seen = set()
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        torch.empty(0, dtype=torch.uint8).set_(s)[::4096].sum()

def memory():
    # this process's resident memory: anonymous (its own copies) and file-backed (page-cache pages it maps,
    # shared with every other process mapping the same file)
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out

build = None
if reader in ("accel", "stock"):
    import functools
    from diffusers import QwenImageTransformer2DModel
    kwargs = {} if reader == "accel" else {"num_layers": keep}
    build, init = 0.0, QwenImageTransformer2DModel.__init__
    @functools.wraps(init)  # diffusers reads __init__'s signature (through __wrapped__)
    def timed_init(self, *args, **kw):  # the model's construction, inside the call: raw builds nothing
        global build
        started = time.perf_counter()
        try:
            return init(self, *args, **kw)
        finally:
            build += time.perf_counter() - started
    QwenImageTransformer2DModel.__init__ = timed_init
    late = wait_for_start()
    base = memory()
    t, cpu, times = time.perf_counter(), time.process_time(), os.times()
    model = QwenImageTransformer2DModel.from_pretrained(path, torch_dtype=dtype, **kwargs)
    sd = model.state_dict()
    touch(sd.values())
    secs, cpu, system = time.perf_counter() - t, time.process_time() - cpu, os.times().system - times.system
    assert len(model.transformer_blocks) == keep, len(model.transformer_blocks)
    nbytes = sum(p.numel() * p.element_size() for p in sd.values())
else:
    from concurrent.futures import ThreadPoolExecutor
    from safetensors import safe_open
    wm = json.load(open(os.path.join(path, "diffusion_pytorch_model.safetensors.index.json")))["weight_map"]
    keys = json.load(open(sys.argv[6]))  # the truncated model's checkpoint keys (the driver's kept_keys)
    late = wait_for_start()
    base = memory()
    t, cpu, times = time.perf_counter(), time.process_time(), os.times()
    handles = {name: safe_open(os.path.join(path, name), framework="pt") for name in sorted(set(wm[k] for k in keys))}
    def read(k):  # raw: a copy in fresh memory (get_tensor alone is a view of the file's mmap, safetensors >= 0.8)
        x = handles[wm[k]].get_tensor(k)
        if reader == "view":  # no copy: the view, as a load that casts nothing returns it
            return x
        return x.to(torch.float32) if cast else x.clone()
    with ThreadPoolExecutor(threads) as pool:
        got = list(pool.map(read, keys))  # every tensor kept, as a model keeps its parameters
    for handle in handles.values():  # closing (munmap) is part of reading, as in from_pretrained
        handle.__exit__(None, None, None)
    touch(got)
    secs, cpu, system = time.perf_counter() - t, time.process_time() - cpu, os.times().system - times.system
    nbytes = sum(x.numel() * x.element_size() for x in got)
after = memory()
print("RESULT " + json.dumps({"seconds": secs, "cpu": cpu, "system": system, "build": build, "model_bytes": nbytes,
                              "anon": after["RssAnon"] - base["RssAnon"], "file": after["RssFile"] - base["RssFile"],
                              "late": late}),
      flush=True)
"""


#: The same untimed predecessor before every timed run: a process that writes ``argv[1]`` bytes of fresh
#: memory (one byte a page) and exits. On a VM that reports free pages to its host, what a first touch of
#: fresh memory costs depends on what the guest freed, and how long ago: the host takes back freed pages
#: some seconds after they are freed (mm/page_reporting.c reports a share every 2 s), and a reported page
#: costs the host a fault when touched again. Without it each reader follows whichever reader ran before
#: it in the round; with it and ``START_AFTER_S``, every reader meets the same memory.
PREDECESSOR = "import sys; b = bytearray(int(sys.argv[1])); b[::4096] = bytes(len(range(0, len(b), 4096)))"
#: how long after the predecessor exited every reader's clock starts, swept: 8 s is longer than a worker's
#: imports (raw imports torch and safetensors, a load diffusers too); 0: each starts as soon as its imports
#: are done, a load seconds after raw
START_AFTER_S = (0.0, 2.0, 8.0)


def run_predecessor(nbytes: int, start_after: float) -> float:
    """Run the predecessor; the CLOCK_MONOTONIC time the timed run's clock starts."""
    subprocess.run([sys.executable, "-c", PREDECESSOR, str(nbytes)], check=True, timeout=300)
    return time.monotonic() + start_after


@functools.cache  # the report is rewritten after every run; the device does not change
def free_page_reporting() -> bool | None:
    """Whether this machine is a VM whose virtio balloon reports free pages to its host
    (VIRTIO_BALLOON_F_REPORTING, feature bit 5 in include/uapi/linux/virtio_balloon.h); None where no
    balloon device can be read."""
    found = None
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if int((dev / "device").read_text(), 16) != 5:  # VIRTIO_ID_BALLOON
                continue
            bits = (dev / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        found = bool(found) or (len(bits) > 5 and bits[5] == "1")
    return found


def machine_note() -> str:
    if not free_page_reporting():
        return ""
    return (
        "This machine is a VM whose balloon reports free pages to its host (VIRTIO_BALLOON_F_REPORTING): "
        "memory the guest frees can be taken back by the host, so what a first touch of fresh memory costs "
        "(the system column) depends on what ran before and varies between runs of the same code."
    )


def kept_tensors(ckpt: Path, keep: int) -> tuple[list[str], int, list[Path]]:
    """The checkpoint keys a ``keep``-block model holds, their bytes, and the shards holding them
    (from the shard headers; blocks are ``transformer_blocks.<i>.``)."""
    import struct

    index = json.loads((ckpt / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    keys, total, shards = [], 0, set()
    for name in sorted(set(index.values())):
        with open(ckpt / name, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            if key.startswith("transformer_blocks.") and int(key.split(".")[1]) >= keep:
                continue
            keys.append(key)
            start, end = meta["data_offsets"]
            total += end - start
            shards.add(ckpt / name)
    return keys, total, sorted(shards)


def fill_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 * MB):
                pass


def run(
    worker: Path, reader: str, cast: bool, ckpt: Path, keep: int, threads: int, keys_file: Path, start_at: float
) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update(
        OMP_NUM_THREADS=str(threads if reader == "stock" else 1),
        HF_HUB_OFFLINE="1",
        ACCEL_NPU_DISABLE="0" if reader == "accel" else "1",
    )
    if reader == "accel":
        env.update(ACCEL_NPU_TRUNCATE=f"QwenImageTransformer2DModel:{keep}", ACCEL_NPU_LOAD_THREADS=str(threads))
    proc = subprocess.run(
        [
            sys.executable,
            str(worker),
            reader,
            "cast" if cast else "nocast",
            str(ckpt),
            str(keep),
            str(threads),
            str(keys_file),
            repr(start_at),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise SystemExit(f"{reader} ({'cast' if cast else 'no cast'}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


LABELS = {
    "raw": "raw safe_open read",
    "view": "raw safe_open views (no copy)",
    "accel": "accel-npu `from_pretrained` (whole call)",
    "stock": "stock `from_pretrained` (whole call)",
}


def late_note(got, delays) -> str:
    """Per start delay, how many runs began their clock late (their imports took longer than the delay)."""
    notes = []
    for d in [d for d in delays if d > 0]:
        late = [x["late"] for key, runs in got.items() if key[4] == d for x in runs]
        over = [x for x in late if x > 0.05]
        notes.append(
            f"after {d:g} s, {len(over)} of {len(late)} runs started over 0.05 s late"
            + (f" (at most {max(over):.2f} s)" if over else "")
        )
    return "; ".join(notes) or "no delay"


def pair_ratios(base: list[dict], runs: list[dict]) -> list[float]:
    """base's seconds / the reader's, run by run of the same round."""
    return [x["seconds"] / y["seconds"] for x, y in zip(base, runs)]


def summary(got, keeps, threads, states, casts, delays) -> list[str]:
    """One line per start delay: the cast cells against the copying raw reader (both copy), the no-cast
    cells against the view reader (neither copies); the no-cast cells never against the copying one."""
    lines = []
    for d in delays:
        parts = []
        for c, base, what in ((True, "raw", "cast cells vs raw"), (False, "view", "no-cast cells vs view")):
            medians = [
                statistics.median(pair_ratios(got[(k, t, s, c, d, base)], got[(k, t, s, c, d, "accel")]))
                for k in keeps
                for t in threads
                for s in states
                if c in casts and got.get((k, t, s, c, d, base)) and got.get((k, t, s, c, d, "accel"))
            ]
            if medians:
                at_least = sum(m >= 0.9 for m in medians)
                parts.append(
                    f"{what}: {at_least} of {len(medians)} at or above 0.9×, lowest {min(medians):.2f}×, "
                    f"highest {max(medians):.2f}×"
                )
        if parts:
            lines.append(
                f"- Start after {d:g} s, accel-npu's whole call (medians of same-round ratios): " + "; ".join(parts)
            )
    return lines


def write_report(report, ckpt, ckpt_bytes, kept, keeps, threads, states, casts, delays, readers, got, rounds) -> None:
    report.parts.clear()  # rewritten after every run: the date and first load average stay the start's
    report.text(
        f"Checkpoint: {ckpt.name} ({ckpt_bytes / MB:,.0f} MB bf16, 9 shards, 60 blocks); the model keeps the first "
        + ", ".join(f"{k} ({kept[k] / MB:,.1f} MB of checkpoint bytes)" for k in keeps)
        + " blocks. The same thread count for every reader. Every reader ends holding every tensor it "
        "loaded, each 4 KiB page touched inside the clock: raw keeps a copy of each tensor in fresh memory "
        "(clone, or the cast); view (no cast only) keeps get_tensor's views of the files' mmap, as a load that "
        "casts nothing does; a load keeps what from_pretrained returns. "
        f"Seconds: median (min-max) of the fresh processes per cell (runs; rounds started: {rounds}), "
        "interleaved; CPU: median CPU seconds of the process over the same span (all its threads: "
        "the work done, whatever share of the cores the other jobs left it); MB/s = kept checkpoint bytes / "
        "median seconds; build: median seconds of the call spent in the model's __init__ (construction, "
        "on the main thread; raw builds no model); system: median seconds of that CPU in the kernel (page "
        "faults, zeroing fresh memory, reads); vs raw = median (min-max) over the rounds of raw's seconds / "
        "this reader's in the same round (same blocks, cache state, cast, threads; raw runs first in odd "
        "rounds and last in even ones), so a machine whose speed drifts between rounds moves both sides of "
        "each ratio; vs view: the same against the view reader (no-cast cells: neither side copies). "
        "Anon / file MB: the process's RssAnon / RssFile growth over the call (median): its own "
        "memory, and page-cache pages it maps (shared with any other process mapping the same files). Warm: "
        "the files the call reads (config, index, the shards holding the kept tensors) read just before; "
        "cold: posix_fadvise(POSIX_FADV_DONTNEED) on every shard just before (this job's files only; nothing "
        "maps them then). Then, before every run, the same untimed predecessor for every reader: a process "
        "that writes twice the kept checkpoint bytes (the cast's fp32 size) into fresh memory and exits; "
        "every reader's clock starts the cell's start delay after it exited ("
        + ", ".join(f"{d:g} s" for d in delays)
        + "), its imports done (0 s: as soon as they are done, a load seconds after raw; late: "
        + late_note(got, delays)
        + "). "
        + machine_note()
    )
    lines = summary(got, keeps, threads, states, casts, delays)
    if lines:
        report.text("\n".join(lines))
    rows = []
    for k in keeps:
        for t in threads:
            for s in states:
                for c in casts:
                    for d in delays:
                        if not got[(k, t, s, c, d, "raw")]:
                            continue
                        raw_runs, view_runs = got[(k, t, s, c, d, "raw")], got.get((k, t, s, c, d, "view"), [])
                        for r in readers:
                            runs = got.get((k, t, s, c, d, r), [])
                            if not runs:
                                continue
                            secs = [x["seconds"] for x in runs]
                            med = statistics.median(secs)
                            ratios = pair_ratios(raw_runs, runs)  # same round
                            rows.append(
                                [
                                    str(k),
                                    str(t),
                                    s,
                                    "fp32 (cast)" if c else "bf16 (no cast)",
                                    f"{d:g} s",
                                    LABELS[r],
                                    str(len(runs)),
                                    median_spread(secs, "{:.3f}", " s"),
                                    f"{statistics.median(x['cpu'] for x in runs):.3f} s",
                                    f"{statistics.median(x['system'] for x in runs):.3f} s",
                                    "—"
                                    if r in ("raw", "view")
                                    else f"{statistics.median(x['build'] for x in runs):.3f} s",
                                    f"{kept[k] / MB / med:,.0f} MB/s",
                                    "—" if r == "raw" else median_spread(ratios, "{:.2f}", "×"),
                                    "—"
                                    if r in ("raw", "view") or not view_runs
                                    else median_spread(pair_ratios(view_runs, runs), "{:.2f}", "×"),
                                    f"{statistics.median(x['anon'] for x in runs) / MB:,.0f} MB",
                                    f"{statistics.median(x['file'] for x in runs) / MB:,.0f} MB",
                                ]
                            )
    report.table(
        [
            "blocks",
            "threads",
            "cache",
            "load",
            "start after",
            "reader",
            "runs",
            "seconds",
            "CPU",
            "system",
            "build",
            "throughput",
            "vs raw",
            "vs view",
            "anon",
            "file",
        ],
        rows,
    )
    report.write()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="rounds (each cell once a round)")
    ap.add_argument("--repeat-keep", default="", help="KEEP:N,...: rounds for those keeps instead of --repeat")
    ap.add_argument("--cache", default=str(host_memory.default_cache()))
    ap.add_argument(
        "--keep",
        default="2,60",
        help="blocks kept (host_memory.py's case (c) keeps 2; 60: the whole checkpoint); a list measures each",
    )
    ap.add_argument(
        "--threads",
        default="1,2",
        help="reader threads, the same for raw, accel-npu and stock; a list (1,2) measures each",
    )
    ap.add_argument("--states", default="warm,cold")
    ap.add_argument("--readers", default="raw,view,accel,stock", help="raw first; view runs in the no-cast cells only")
    ap.add_argument("--casts", default="nocast,cast")
    ap.add_argument(
        "--start-after",
        default=",".join(f"{d:g}" for d in START_AFTER_S),
        help="seconds from the predecessor's exit to every reader's clock start; a list measures each",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 blocks, 1 thread, 1 round, delays 0 and 2 s: proves the script runs (its figures are not a result)",
    )
    a = ap.parse_args(argv)
    if a.quick:
        a.repeat, a.repeat_keep, a.keep, a.threads, a.start_after = 1, "", "2", "1", "0,2"
    report = Report(  # before measuring, and before the checkpoint is built where it is absent
        "load_throughput", "Load throughput: whole from_pretrained vs raw safe_open, same bytes, same threads", MEASURES
    )
    cache = Path(a.cache)
    ckpt = host_memory.build_checkpoint(cache)
    # a worker file per content: another run of an older version of this script may be using its own
    worker = cache / f"load_throughput_worker_{hashlib.sha1(WORKER.encode()).hexdigest()[:10]}.py"
    if not worker.exists():
        worker.write_text(WORKER)
    states = a.states.split(",")
    threads = [int(t) for t in str(a.threads).split(",")]
    keeps = [int(k) for k in str(a.keep).split(",")]
    repeats = {k: a.repeat for k in keeps}
    for item in filter(None, a.repeat_keep.split(",")):
        k, _, n = item.partition(":")
        if not (k.isdigit() and n.isdigit() and int(k) in repeats):
            raise SystemExit(f"--repeat-keep {item!r}: KEEP:N with KEEP one of --keep ({a.keep})")
        repeats[int(k)] = int(n)
    readers = tuple(a.readers.split(","))
    if readers[0] != "raw":
        raise SystemExit("--readers: raw first (the other readers are compared with it)")
    casts = tuple(c == "cast" for c in a.casts.split(","))
    delays = [float(d) for d in str(a.start_after).split(",")]
    kept, shards, keys_files = {}, {}, {}
    for k in keeps:
        keys, kept[k], shards[k] = kept_tensors(ckpt, k)
        keys_files[k] = cache / f"load_throughput_keys_{k}.json"
        keys_files[k].write_text(json.dumps(keys))
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    got: dict = {
        (k, t, s, c, d, r): []
        for k in keeps
        for t in threads
        for s in states
        for c in casts
        for d in delays
        for r in readers
        if not (c and r == "view")  # a cast copies whatever reads it: raw is its like-for-like baseline
    }
    for i in range(max(repeats.values())):  # rounds: the results file is rewritten after each run
        for k in [k for k in keeps if i < repeats[k]]:
            for t in threads:
                for s in states:
                    for c, d in [(c, d) for c in casts for d in delays]:
                        # raw first in odd rounds, last in even ones: a machine drifting within a round
                        # favours neither side of a pair
                        for r in readers if i % 2 == 0 else readers[::-1]:
                            if (k, t, s, c, d, r) not in got:
                                continue
                            if s == "warm":  # everything the call reads: config, index, the kept tensors' shards
                                fill_cache(
                                    [
                                        ckpt / "config.json",
                                        ckpt / "diffusion_pytorch_model.safetensors.index.json",
                                        *shards[k],
                                    ]
                                )
                            else:
                                for shard in shards[k]:
                                    drop_from_cache(shard)
                            start_at = run_predecessor(2 * kept[k], d)  # the cell's fp32 bytes, every reader alike
                            got[(k, t, s, c, d, r)].append(run(worker, r, c, ckpt, k, t, keys_files[k], start_at))
                            x = got[(k, t, s, c, d, r)][-1]
                            print(
                                f"  {k} block(s) {t} thread(s) {s} {'cast' if c else 'no cast'} after {d:g} s "
                                f"{r} #{i + 1}: "
                                f"{x['seconds']:.3f} s (cpu {x['cpu']:.3f} s, anon {x['anon'] / MB:,.0f} MB, file "
                                f"{x['file'] / MB:,.0f} MB)",
                                flush=True,
                            )
                            # after every run: a cut-short run still reports the cells it measured
                            started = ", ".join(f"{k} blocks {min(i + 1, repeats[k])} of {repeats[k]}" for k in keeps)
                            write_report(
                                report,
                                ckpt,
                                ckpt_bytes,
                                kept,
                                keeps,
                                threads,
                                states,
                                casts,
                                delays,
                                readers,
                                got,
                                started,
                            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load throughput, end to end: the wall time of the whole ``from_pretrained`` call vs a raw
``safe_open`` read of the same bytes with the same number of threads (issue 4, issue 14 item 6).

The checkpoint is ``benchmarks/host_memory.py``'s (60-block QwenImage, 9 shards; built once into
the cache). The loaded model keeps the first ``--keep`` blocks. Every measurement is a fresh
process; the clock runs from just before the call to just after it (imports excluded, model
construction, key planning, validation and reading included). Readers, all with ``--threads`` T:

  raw     safe_open + get_tensor + clone (no cast) / + .to(float32) (cast) of exactly the tensors the
          truncated model holds, T reader threads over the tensors (torch: 1 thread each), then the
          shard files closed (their munmap is part of a read; from_pretrained pays it inside the call)
  accel   accel-npu, the field report's call: ``from_pretrained(path)`` with
          ``ACCEL_NPU_TRUNCATE=QwenImageTransformer2DModel:<keep>``, ``ACCEL_NPU_LOAD_THREADS=T``
  stock   ``ACCEL_NPU_DISABLE=1``, ``from_pretrained(path, num_layers=<keep>)`` (stock's way to the same
          model; it has no reader threads of its own, so torch gets T threads)

"no cast" loads with ``torch_dtype=torch.bfloat16`` (as stored); "cast" loads without torch_dtype
(fp32, twice the bytes written: the field report's call). Page cache: "warm" (the files read once
before); "cold": before every run ``/proc/sys/vm/drop_caches`` when writable (root), otherwise
``posix_fadvise(POSIX_FADV_DONTNEED)`` on every shard file (drops clean, unmapped pages only: a
page another process maps stays cached). Runs are interleaved, ``--repeat`` times; the table gives
median (min-max) seconds and the median throughput = kept checkpoint bytes / seconds.

``--threads 1,2`` measures each thread count (a table row group per count).

Usage: python benchmarks/load_throughput.py [--repeat 5] [--keep 2] [--threads 1,2] [--cache DIR]
Writes benchmarks/results/load_throughput.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_memory  # noqa: E402  (the checkpoint and its cache)
from _results import Report, median_spread  # noqa: E402

MB = 1024 ** 2

WORKER = r'''
import json, os, sys, time
import torch
reader, cast, path, keep, threads = sys.argv[1], sys.argv[2] == "cast", sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads if reader == "stock" else 1)
dtype = None if cast else torch.bfloat16
if reader in ("accel", "stock"):
    from diffusers import QwenImageTransformer2DModel
    kwargs = {} if reader == "accel" else {"num_layers": keep}
    t = time.perf_counter()
    model = QwenImageTransformer2DModel.from_pretrained(path, torch_dtype=dtype, **kwargs)
    secs = time.perf_counter() - t
    assert len(model.transformer_blocks) == keep, len(model.transformer_blocks)
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print("RESULT " + json.dumps({"seconds": secs, "model_bytes": nbytes}), flush=True)
    sys.exit(0)
from concurrent.futures import ThreadPoolExecutor
from safetensors import safe_open
wm = json.load(open(os.path.join(path, "diffusion_pytorch_model.safetensors.index.json")))["weight_map"]
keys = json.load(open(sys.argv[6]))  # the truncated model's checkpoint keys (the driver's kept_keys)
t = time.perf_counter()
handles = {name: safe_open(os.path.join(path, name), framework="pt") for name in sorted(set(wm[k] for k in keys))}
def read(k):
    x = handles[wm[k]].get_tensor(k)
    return x.to(torch.float32) if cast else x.clone()
with ThreadPoolExecutor(threads) as pool:
    got = list(pool.map(read, keys))
for handle in handles.values():  # closing (munmap) is part of reading, as in from_pretrained
    handle.__exit__(None, None, None)
secs = time.perf_counter() - t
print("RESULT " + json.dumps({"seconds": secs, "model_bytes": sum(x.numel() * x.element_size() for x in got)}), flush=True)
'''


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def fadvise_dontneed(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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


def run(worker: Path, reader: str, cast: bool, ckpt: Path, keep: int, threads: int, keys_file: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update(OMP_NUM_THREADS=str(threads if reader == "stock" else 1), HF_HUB_OFFLINE="1",
               ACCEL_NPU_DISABLE="0" if reader == "accel" else "1")
    if reader == "accel":
        env.update(ACCEL_NPU_TRUNCATE=f"QwenImageTransformer2DModel:{keep}", ACCEL_NPU_LOAD_THREADS=str(threads))
    proc = subprocess.run([sys.executable, str(worker), reader, "cast" if cast else "nocast", str(ckpt), str(keep),
                           str(threads), str(keys_file)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise SystemExit(f"{reader} ({'cast' if cast else 'no cast'}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def write_report(a, ckpt, ckpt_bytes, kept, threads, states, casts, readers, got, cold_how, rounds) -> None:
    report = Report("load_throughput", "Load throughput: whole from_pretrained vs raw safe_open, same bytes, same threads")
    report.text(f"Checkpoint: {ckpt.name} ({ckpt_bytes / MB:,.0f} MB bf16, 9 shards); the model keeps {a.keep} of 60 "
                f"blocks: {kept / MB:,.1f} MB of checkpoint bytes (bf16). The same thread count for every reader. "
                f"Seconds: median (min-max) of {rounds} fresh process(es) per cell ({rounds} of {a.repeat} rounds "
                f"done), interleaved; MB/s = kept bytes / median seconds; vs raw = raw's median seconds / this "
                f"reader's (same cache state, same cast). Warm: the files the call reads (config, index, the shards holding the kept tensors) read just before; "
                f"cold: {cold_how} just before.")
    rows = []
    for t in threads:
        for s in states:
            for c in casts:
                raw_med = statistics.median(x["seconds"] for x in got[(t, s, c, "raw")])
                for r in readers:
                    secs = [x["seconds"] for x in got[(t, s, c, r)]]
                    med = statistics.median(secs)
                    label = {"raw": "raw safe_open read", "accel": "accel-npu `from_pretrained` (whole call)",
                             "stock": "stock `from_pretrained` (whole call)"}[r]
                    rows.append([str(t), s, "fp32 (cast)" if c else "bf16 (no cast)", label,
                                 median_spread(secs, "{:.3f}", " s"), f"{kept / MB / med:,.0f} MB/s",
                                 f"{raw_med / med:.2f}×"])
    report.table(["threads", "cache", "load", "reader", "seconds", "throughput", "vs raw"], rows)
    print(report.render())
    report.write()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache", default=str(host_memory.default_cache()))
    ap.add_argument("--keep", type=int, default=2, help="blocks kept (host_memory.py's case (c) keeps 2)")
    ap.add_argument("--threads", default="2", help="reader threads, the same for raw, accel-npu and stock; "
                                                   "a list (1,2) measures each")
    ap.add_argument("--states", default="warm,cold")
    a = ap.parse_args(argv)
    cache = Path(a.cache)
    ckpt = host_memory.build_checkpoint(cache)
    # a worker file per content: another run of an older version of this script may be using its own
    worker = cache / f"load_throughput_worker_{hashlib.sha1(WORKER.encode()).hexdigest()[:10]}.py"
    if not worker.exists():
        worker.write_text(WORKER)
    states = a.states.split(",")
    threads = [int(t) for t in str(a.threads).split(",")]
    keys, kept, shards = kept_tensors(ckpt, a.keep)
    keys_file = cache / f"load_throughput_keys_{a.keep}.json"
    keys_file.write_text(json.dumps(keys))
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    cold_how = "drop_caches" if drop_caches() else "posix_fadvise(POSIX_FADV_DONTNEED) on each shard (not root)"
    readers = ("raw", "accel", "stock")
    casts = (False, True)
    got: dict = {(t, s, c, r): [] for t in threads for s in states for c in casts for r in readers}
    for i in range(a.repeat):  # rounds: the results file is rewritten after each, so a cut-short run still reports
        for t in threads:
            for s in states:
                for c in casts:
                    for r in readers:
                        if s == "warm":  # everything the call reads: config, index, the kept tensors' shards
                            fill_cache([ckpt / "config.json", ckpt / "diffusion_pytorch_model.safetensors.index.json",
                                        *shards])
                        elif not drop_caches():
                            fadvise_dontneed(shards)
                        got[(t, s, c, r)].append(run(worker, r, c, ckpt, a.keep, t, keys_file))
                        print(f"  {t} thread(s) {s} {'cast' if c else 'no cast'} {r} #{i + 1}: "
                              f"{got[(t, s, c, r)][-1]['seconds']:.3f} s", flush=True)
        write_report(a, ckpt, ckpt_bytes, kept, threads, states, casts, readers, got, cold_how, i + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

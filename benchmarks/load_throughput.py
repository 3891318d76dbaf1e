"""Load throughput of a truncated load vs a raw ``safe_open`` read of the same bytes (issue 4). Prints a table.

The checkpoint is ``benchmarks/host_memory.py``'s (60-block QwenImage, 4.24 GB bf16, 9 shards;
built once into the cache). Every measurement is a fresh process (one thread, like one rank of
many), interleaved, ``--repeat`` times; the table gives medians. Three readers of the same kept
tensors (the first ``--keep`` blocks + the rest, what ``ACCEL_NPU_TRUNCATE=...:2`` keeps):

  raw       safe_open + get_tensor + clone (bf16 in, bf16 out: the yardstick)
  raw_fp32  safe_open + get_tensor + .to(float32) (what loading without torch_dtype must produce)
  accel     the field report's call, ``from_pretrained(path)`` with ACCEL_NPU_TRUNCATE: the time
            accel-npu reports for reading + materializing (its log line), and the whole call;
            it reads and casts in this node's cores / loading ranks threads (2 here, at N = 1)
  accel_1t  the same with ACCEL_NPU_LOAD_THREADS=1

Both page-cache states are measured: "warm" (the files are in the page cache) and "cold"
(``/proc/sys/vm/drop_caches`` before every run; needs root, else skipped), the state a job's first
load meets. Throughput = kept checkpoint bytes / seconds.

Usage: python benchmarks/load_throughput.py [--repeat 5] [--keep 2] [--cache DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_memory  # noqa: E402  (the checkpoint and its cache)

MB = 1024 ** 2

WORKER = r'''
import json, os, sys, time
import torch
torch.set_num_threads(1)
mode, path, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
from diffusers import QwenImageTransformer2DModel
if mode.startswith("accel"):
    t = time.perf_counter()
    model = QwenImageTransformer2DModel.from_pretrained(path)
    print("RESULT " + json.dumps({"call": time.perf_counter() - t}), flush=True)
    sys.exit(0)
import accelerate
from safetensors import safe_open
cfg = {k: v for k, v in json.load(open(os.path.join(path, "config.json"))).items() if not k.startswith("_")}
cfg["num_layers"] = keep
with accelerate.init_empty_weights():
    keys = list(QwenImageTransformer2DModel(**cfg).state_dict())
wm = json.load(open(os.path.join(path, "diffusion_pytorch_model.safetensors.index.json")))["weight_map"]
t = time.perf_counter()
got, nbytes = [], 0
for name in sorted(set(wm[k] for k in keys)):
    with safe_open(os.path.join(path, name), framework="pt") as f:
        for k in keys:
            if wm[k] == name:
                x = f.get_tensor(k)
                nbytes += x.numel() * x.element_size()
                got.append(x.clone() if mode == "raw" else x.to(torch.float32))
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t, "bytes": nbytes}), flush=True)
'''


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def run(worker: Path, mode: str, ckpt: Path, keep: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    accel = mode.startswith("accel")
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", ACCEL_NPU_DISABLE="0" if accel else "1")
    if accel:
        env["ACCEL_NPU_TRUNCATE"] = f"QwenImageTransformer2DModel:{keep}"
    if mode == "accel_1t":
        env["ACCEL_NPU_LOAD_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(worker), mode, str(ckpt), str(keep)], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.split("RESULT ", 1)[1])
    if accel:
        m = re.search(r"read \d+ tensors \(([\d.]+) MB in ([\d.]+) s\)", proc.stderr)
        if not m:
            raise SystemExit(f"no accel-npu summary line:\n{proc.stderr[-3000:]}")
        res.update(seconds=float(m.group(2)), bytes=float(m.group(1)) * MB)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache", default=str(host_memory.default_cache()))
    ap.add_argument("--keep", type=int, default=2, help="blocks kept (the issue's case (c) keeps 2)")
    a = ap.parse_args(argv)
    cache = Path(a.cache)
    ckpt = host_memory.build_checkpoint(cache)
    worker = cache / "load_throughput_worker.py"
    worker.write_text(WORKER)
    states = ["warm"] + (["cold"] if drop_caches() else [])
    modes = ("raw", "raw_fp32", "accel_1t", "accel")
    got: dict = {(s, m): [] for s in states for m in modes}
    for s in states:
        if s == "warm":
            run(worker, "raw", ckpt, a.keep)  # fill the page cache
        for _ in range(a.repeat):
            for m in modes:
                if s == "cold":
                    drop_caches()
                got[(s, m)].append(run(worker, m, ckpt, a.keep))
    print(f"\nkept bytes: {got[(states[0], 'raw')][0]['bytes'] / MB:,.1f} MB (bf16) of {ckpt}; "
          f"medians of {a.repeat} fresh processes, 1 thread each")
    print(f"{'cache':<6}{'reader':<10}{'seconds':>9}{'MB/s':>9}{'vs raw':>8}  note")
    for s in states:
        raw_s = statistics.median(r["seconds"] for r in got[(s, "raw")])
        for m in modes:
            rs = got[(s, m)]
            sec = statistics.median(r["seconds"] for r in rs)
            mbps = rs[0]["bytes"] / MB / sec
            note = ""
            if m.startswith("accel"):
                note = f"whole from_pretrained call {statistics.median(r['call'] for r in rs):.2f} s"
            print(f"{s:<6}{m:<10}{sec:>9.3f}{mbps:>9,.0f}{raw_s / sec:>8.2f}  {note}")
    if "cold" not in states:
        print("cold cache: not measured (cannot write /proc/sys/vm/drop_caches here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

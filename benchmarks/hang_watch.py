"""What the hang watch (plugins/hang_watch) adds to each collective, side by side in one run.

Two gloo ranks started with torchrun. Rank 0 reports the median per-call time of
1. a no-op function called bare, through a pass-through wrapt wrapper (what any patch costs) and
   through the hang watch's wrapper (the bookkeeping on top);
2. a 1-element gloo all_reduce through the stock function and through the patched one, interleaved;
3. one round trip to the process group's store (what publishing every collective eagerly would
   cost: the watch uses the store only when a rank suspects a hang);
and the no-op through the wrapper in a one-rank group (the watch is off there).

Each figure is the fastest of --rounds short rounds: the one least disturbed by other load on the
machine (a round fits in one scheduler time slice).

Usage: python benchmarks/hang_watch.py [--calls 2000] [--rounds 100]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def worker(calls: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    import wrapt

    from accel_npu.patching import original_of
    from accel_npu.plugins.hang_watch.watch import collective_wrapper

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def noop(tensor, op=None, group=None, async_op=False):
        return None

    watched = wrapt.FunctionWrapper(noop, collective_wrapper("benchmark_noop"))
    passthrough = wrapt.FunctionWrapper(noop, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    stock = original_of("torch.distributed:all_reduce")
    assert stock is not None, "accel-npu is not active: the all_reduce patch is not applied"
    t = torch.zeros(1)
    rows: dict[str, list[float]] = {
        "noop bare": [],
        "noop passthrough": [],
        "noop watched": [],
        "all_reduce stock": [],
        "all_reduce watched": [],
        "store add": [],
    }
    store = dist.distributed_c10d._get_default_store()
    for _ in range(rounds):
        rows["noop bare"].append(_per_call(lambda: noop(t), calls))
        rows["noop passthrough"].append(_per_call(lambda: passthrough(t), calls))
        rows["noop watched"].append(_per_call(lambda: watched(t), calls))
        n = max(20, calls // 50)
        dist.barrier()
        rows["all_reduce stock"].append(_per_call(lambda: stock(t), n))
        dist.barrier()
        rows["all_reduce watched"].append(_per_call(lambda: dist.all_reduce(t), n))
        rows["store add"].append(_per_call(lambda: store.add(f"bench/{rank}", 1), 20))
    dist.barrier()
    if rank == 0:
        print("BENCH " + json.dumps({k: min(v) * 1e6 for k, v in rows.items()}), flush=True)
    dist.destroy_process_group()


def single(calls: int, rounds: int) -> dict:
    code = f"""
import json, os, time, torch, torch.distributed as dist, wrapt
from accel_npu.plugins.hang_watch.watch import collective_wrapper
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_free_port()}")
dist.init_process_group("gloo", rank=0, world_size=1)
def noop(tensor, op=None, group=None, async_op=False):
    return None
w = wrapt.FunctionWrapper(noop, collective_wrapper("benchmark_noop"))
t = torch.zeros(1)
res = []
for _ in range({rounds}):
    t0 = time.perf_counter()
    for _ in range({calls}):
        w(t)
    res.append((time.perf_counter() - t0) / {calls})
print("BENCH " + json.dumps(min(res) * 1e6))
"""
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True).stdout
    return json.loads(out.split("BENCH ", 1)[1].splitlines()[0])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ACCEL_NPU_DISABLE", None)
    env.pop("ACCEL_NPU_HANG_TIMEOUT", None)
    return env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.calls, a.rounds)
        return
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run(
        [
            str(torchrun),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(_free_port()),
            __file__,
            "--worker",
            "--calls",
            str(a.calls),
            "--rounds",
            str(a.rounds),
        ],
        env=_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or "BENCH " not in proc.stdout:
        sys.exit(f"benchmark ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.split("BENCH ", 1)[1].splitlines()[0])
    one = single(a.calls, a.rounds)
    added = r["noop watched"] - r["noop bare"]
    from _results import Report

    report = Report("hang_watch", "What the hang watch adds to each collective")
    report.table(
        ["call", "µs per call"],
        [
            ["no-op, bare", f"{r['noop bare']:.2f}"],
            ["no-op, through a pass-through wrapt wrapper", f"{r['noop passthrough']:.2f}"],
            ["no-op, through the hang-watch wrapper (2 ranks: watching)", f"{r['noop watched']:.2f}"],
            ["no-op, through the wrapper (1 rank: off)", f"{one:.2f}"],
            ["**added per collective**", f"**{added:.2f}**"],
            ["gloo all_reduce of 1 float, stock function", f"{r['all_reduce stock']:.1f}"],
            ["gloo all_reduce of 1 float, patched", f"{r['all_reduce watched']:.1f}"],
            ["one store round trip (`add`), per collective if published eagerly", f"{r['store add']:.1f}"],
        ],
        caption=f"Fastest of {a.rounds} rounds of {a.calls} calls per figure (2 gloo ranks, OMP_NUM_THREADS=1).",
    )
    report.text(
        f"added / smallest gloo all_reduce: {added / r['all_reduce stock']:.2%}; the bookkeeping beyond "
        f"any patch's wrapper: {r['noop watched'] - r['noop passthrough']:.2f} µs"
    )
    print(report.render())
    report.write()


if __name__ == "__main__":
    main()

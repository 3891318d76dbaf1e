"""What the hang watch (plugins/hang_watch) adds to each collective: a gloo all_reduce with the watch
against the same all_reduce without it, alternated.

Two gloo ranks started with torchrun, ``--launches`` times with accel-npu active and as many times stock
(``ACCEL_NPU_DISABLE=1``), launches alternating and which side goes first alternating from pair to pair.
In every launch rank 0 reports, per round of ``--ar-calls`` calls of a 1-element all_reduce each:

- the all_reduce through ``torch.distributed.all_reduce`` as the launch has it (accel-npu: the watch's
  wrapper; stock: torch's function), and through torch's own function (accel-npu: the original the patch
  wraps, ``accel_npu.patching.original_of``; stock: the same function again). The two alternate within
  the launch, which goes first alternating from round to round, so drift in machine load hits both alike.

The headline is the accel-npu launches' per-round ratio watched / torch's own function (median and
min-max over rounds), and the per-round difference in µs; the stock launches' ratio of the same function
against itself is the measurement's own spread. Beside it, launch against launch: each launch's median
all_reduce through ``torch.distributed.all_reduce``, accel-npu / stock per pair (this one also carries what
accel-npu's other threads cost the process, e.g. the watch's own). Secondary figures, from the accel-npu
launches: a no-op function called bare, through a pass-through wrapt wrapper and through the watch's
wrapper (the bookkeeping alone, fastest of the rounds), the no-op through the wrapper in a one-rank group
(the watch is off there), and one round trip to the process group's store (what publishing every
collective eagerly would cost: the watch uses the store only when a rank suspects a hang).

Usage: python benchmarks/hang_watch.py [--launches 3] [--rounds 100] [--ar-calls 50] [--calls 2000] [--quick]
Writes benchmarks/results/hang_watch.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Report, median_spread

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("plugins/hang_watch/", "accel_npu/patching/", "accel_npu/_torch/dist.py")


def _per_call(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def worker(calls: int, rounds: int, ar_calls: int) -> None:
    import torch
    import torch.distributed as dist

    active = os.environ.get("ACCEL_NPU_DISABLE") != "1"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    installed = dist.all_reduce
    wrapped = type(installed).__name__ == "FunctionWrapper"
    assert wrapped == active, f"all_reduce is {type(installed).__name__} with accel-npu {'on' if active else 'off'}"
    stock = installed
    if active:
        from accel_npu.patching import original_of

        stock = original_of("torch.distributed:all_reduce")
        assert stock is not None and stock is not installed, "the all_reduce patch is not applied"
    t = torch.zeros(1)
    out: dict[str, list[float]] = {"installed": [], "torch": []}
    for fn in (stock, installed):  # untimed: the first calls connect and fill caches
        dist.barrier()
        _per_call(lambda fn=fn: fn(t), ar_calls)
    for i in range(rounds):
        # both ranks run the same order; which side goes first alternates from round to round
        for side in ("torch", "installed") if i % 2 == 0 else ("installed", "torch"):
            fn = stock if side == "torch" else installed
            dist.barrier()
            out[side].append(_per_call(lambda fn=fn: fn(t), ar_calls))
    if active:
        import wrapt

        from accel_npu.plugins.hang_watch.watch import collective_wrapper

        def noop(tensor, op=None, group=None, async_op=False):
            return None

        watched = wrapt.FunctionWrapper(noop, collective_wrapper("benchmark_noop"))
        passthrough = wrapt.FunctionWrapper(noop, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
        store = dist.distributed_c10d._get_default_store()
        for key in ("noop bare", "noop passthrough", "noop watched", "store add"):
            out[key] = []
        for _ in range(rounds):
            out["noop bare"].append(_per_call(lambda: noop(t), calls))
            out["noop passthrough"].append(_per_call(lambda: passthrough(t), calls))
            out["noop watched"].append(_per_call(lambda: watched(t), calls))
            out["store add"].append(_per_call(lambda: store.add(f"bench/{rank}", 1), 20))
    dist.barrier()
    if rank == 0:
        print("BENCH " + json.dumps({k: [x * 1e6 for x in v] for k, v in out.items()}), flush=True)
    dist.destroy_process_group()


def single(calls: int, rounds: int) -> float:
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
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(True), capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.split("BENCH ", 1)[1].splitlines()[0])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(active: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in (
        "ACCEL_NPU_DISABLE",
        "ACCEL_NPU_HANG_TIMEOUT",
        "ACCEL_NPU_DISABLED_PATCHES",
        "ACCEL_NPU_DISABLED_PLUGINS",
    ):
        env.pop(key, None)
    if not active:
        env["ACCEL_NPU_DISABLE"] = "1"
    return env


def launch(active: bool, a) -> dict[str, list[float]]:
    torchrun = Path(sys.executable).parent / "torchrun"
    args = ["--worker", "--calls", str(a.calls), "--rounds", str(a.rounds), "--ar-calls", str(a.ar_calls)]
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(_free_port()), __file__, *args]
    proc = subprocess.run(cmd, env=_env(active), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or "BENCH " not in proc.stdout:
        side = "accel-npu" if active else "stock"
        sys.exit(f"benchmark ranks ({side}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("BENCH ", 1)[1].splitlines()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=3, help="launches per side (accel-npu, stock), alternating")
    ap.add_argument("--rounds", type=int, default=100, help="rounds per launch")
    ap.add_argument("--ar-calls", type=int, default=50, help="all_reduce calls per round and side")
    ap.add_argument("--calls", type=int, default=2000, help="no-op calls per round (the secondary figures)")
    ap.add_argument("--quick", action="store_true", help="1 launch per side, 10 rounds: proves the script runs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.calls, a.rounds, a.ar_calls)
        return
    if a.quick:
        a.launches, a.rounds, a.calls = 1, 10, 200
    report = Report("hang_watch", "What the hang watch adds to each collective", MEASURES)  # before measuring
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(a.launches):
        for active in (True, False) if i % 2 == 0 else (False, True):
            runs[active].append(launch(active, a))
        now = {side: statistics.median(runs[side][-1]["installed"]) for side in (True, False)}
        print(f"  pair {i + 1}: all_reduce µs, median of rounds: accel-npu {now[True]:.1f}, stock {now[False]:.1f}")
    one = single(a.calls, a.rounds)

    def rounds_of(active: bool, key: str) -> list[float]:
        return [x for run in runs[active] for x in run[key]]

    w_on, s_on = rounds_of(True, "installed"), rounds_of(True, "torch")
    w_off, s_off = rounds_of(False, "installed"), rounds_of(False, "torch")
    ratio_on = [w / s for w, s in zip(w_on, s_on)]
    ratio_off = [w / s for w, s in zip(w_off, s_off)]
    diff_on = [w - s for w, s in zip(w_on, s_on)]
    per_launch = {side: [statistics.median(run["installed"]) for run in runs[side]] for side in (True, False)}
    launch_ratio = [x / y for x, y in zip(per_launch[True], per_launch[False])]

    def fmt(values: list[float], digits: str = "{:.1f}") -> str:
        return median_spread(values, digits)

    n_rounds = len(w_on)
    report.text(
        f"2 gloo ranks (torchrun, OMP_NUM_THREADS=1), a 1-element all_reduce; {a.launches} launches with accel-npu "
        f"and {a.launches} stock (`ACCEL_NPU_DISABLE=1`), alternating; {a.rounds} rounds per launch of {a.ar_calls} "
        "calls per side, the side that goes first alternating from round to round. µs per call: median (min-max) "
        f"over the {n_rounds} rounds of a side's launches. Ratio: per round, the first column's µs / the second's "
        "(same round, same process), median (min-max); difference: per round, in µs."
    )
    report.table(
        ["launches", "all_reduce as installed (µs)", "torch's own function (µs)", "ratio", "difference (µs)"],
        [
            [
                "**accel-npu: the watch's wrapper vs the function it wraps**",
                fmt(w_on),
                fmt(s_on),
                f"**{median_spread(ratio_on, '{:.3f}', '×')}**",
                f"**{median_spread(diff_on, '{:+.1f}')}**",
            ],
            [
                "stock: torch's function against itself (the measurement's spread)",
                fmt(w_off),
                fmt(s_off),
                median_spread(ratio_off, "{:.3f}", "×"),
                median_spread([w - s for w, s in zip(w_off, s_off)], "{:+.1f}"),
            ],
        ],
        caption="All_reduce with the watch vs without, alternated within each launch:",
    )
    report.table(
        ["side", "median all_reduce per launch (µs)", "ratio accel-npu / stock, per pair"],
        [
            ["accel-npu (`torch.distributed.all_reduce`: the watch's wrapper)", fmt(per_launch[True]), "—"],
            ["stock (`ACCEL_NPU_DISABLE=1`)", fmt(per_launch[False]), median_spread(launch_ratio, "{:.3f}", "×")],
        ],
        caption="Launch against launch (each launch's median over its rounds; also carries accel-npu's other threads):",
    )
    best = {key: min(rounds_of(True, key)) for key in ("noop bare", "noop passthrough", "noop watched", "store add")}
    report.table(
        ["call", "µs per call"],
        [
            ["no-op, bare", f"{best['noop bare']:.2f}"],
            ["no-op, through a pass-through wrapt wrapper", f"{best['noop passthrough']:.2f}"],
            ["no-op, through the hang-watch wrapper (2 ranks: watching)", f"{best['noop watched']:.2f}"],
            ["no-op, through the wrapper (1 rank: off)", f"{one:.2f}"],
            ["one store round trip (`add`), per collective if published eagerly", f"{best['store add']:.1f}"],
        ],
        caption=f"Secondary: the wrapper's own bookkeeping on a no-op, fastest of the accel-npu launches' rounds "
        f"({a.calls} calls a round); it leaves out what the watch does to the collective itself.",
    )
    report.text(
        f"The wrapper on a no-op: {best['noop watched'] - best['noop bare']:.2f} µs above the bare call, "
        f"{best['noop watched'] - best['noop passthrough']:.2f} µs above any patch's pass-through wrapper."
    )
    print(report.render())
    report.write()


if __name__ == "__main__":
    main()

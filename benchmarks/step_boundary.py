"""Per-step cost of the step-boundary cooperation (goal: <= 1 % of a step, no extra
collective), with the feature on and switched off, interleaved in one run.

The feature: after each optimizer step rank 0 appends ``release`` to the process group's store
(two store operations) when it draws its next batch; every other rank waits there for it. A tiny
loop shaped like diffusers' train_*.py (prepared DataLoader, ``accelerator.backward``,
``optimizer.step()``, ``lr_scheduler.step()``, ``optimizer.zero_grad()``, ``if
accelerator.sync_gradients: global_step += 1``, a ``if global_step % checkpointing_steps == 0:
if accelerator.is_main_process:`` block that never fires), launched with the shipped
``launch_configs/cpu_zero2.yaml`` (2 CPU ranks, gloo, ZeRO-2 bf16). "Off" is the same launch with
``ACCEL_NPU_DISABLED_PATCHES`` naming the feature's patches (Accelerator.backward, the prepared
DataLoaders' ``__iter__``, AcceleratedOptimizer.step); every other accel-npu patch is on in both.
Launches alternate on / off.
Each rank times each step (from drawing the batch to the end of ``zero_grad``; the wait at the next
batch falls inside the next step) and reports the median of steps after a warm-up; the table gives,
per side, the median over launches of the slower rank's median.

Where the time goes is measured in both launches, not inferred: each rank also times, per step, drawing
its batch (with the feature: rank 1's wait for rank 0's release), ``accelerator.backward`` (under
DeepSpeed it runs the engine's backward and step: the gradient collectives, where a rank waits for the
other without the feature) and the rest of the step; the second table sets each phase with the feature
against the same phase without it. Inside the feature-on launches the loop also times the feature's own
functions.

Usage: python benchmarks/step_boundary.py [--runs 4] [--steps 150] [--width 1024] [--quick]
Writes benchmarks/results/step_boundary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Report, median_spread

REPO = Path(__file__).resolve().parents[1]
#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = (
    "plugins/checkpoints/",
    "accel_npu/_torch/",
    "launch_configs/cpu_zero2.yaml",
    "launch_configs/cpu_zero2.deepspeed.json",
)
WARMUP = 20
FEATURE = ",".join(
    [
        "accelerate.accelerator:Accelerator.backward",
        "accelerate.data_loader:DataLoaderShard.__iter__",
        "accelerate.data_loader:DataLoaderDispatcher.__iter__",
        "accelerate.data_loader:SkipDataLoader.__iter__",
        "accelerate.optimizer:AcceleratedOptimizer.step",
    ]
)

LOOP = r"""
import json, os, sys, time
import torch
from accelerate import Accelerator
steps, width = int(sys.argv[1]), int(sys.argv[2])
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = torch.utils.data.TensorDataset(torch.randn(16 * steps, width))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
inside = [0.0]  # seconds spent in the feature's own functions (feature on), an independent per-step witness
if type(accelerator.backward).__name__ == "BoundFunctionWrapper":
    from accel_npu.plugins.checkpoints import boundary

    def timed(function):
        def timer(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start
        return timer

    for name in ("before_backward", "after_backward", "after_optimizer_step", "clean_point"):
        setattr(boundary, name, timed(getattr(boundary, name)))  # the wrappers call them through the module
times, feature, global_step, t0 = [], [], 0, time.perf_counter()
phases = {"draw": [], "backward": [], "rest": []}
for (x,) in loader:
    t_batch = time.perf_counter()  # the batch in hand: with the feature, after rank 1's wait at its clean point
    loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
    accelerator.backward(loss)
    t_backward = time.perf_counter()  # DeepSpeed's backward and step ran here, with their collectives
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    if accelerator.sync_gradients:
        global_step += 1
        if global_step % 1000000 == 0:
            if accelerator.is_main_process:
                accelerator.save_state("never")
    t1 = time.perf_counter()
    times.append(t1 - t0)
    phases["draw"].append(t_batch - t0)
    phases["backward"].append(t_backward - t_batch)
    phases["rest"].append(t1 - t_backward)
    feature.append(inside[0])
    inside[0], t0 = 0.0, t1
    if global_step >= steps:
        break
accelerator.wait_for_everyone()
wrapped = type(accelerator.backward).__name__ == "BoundFunctionWrapper"
def median(values):
    tail = sorted(values[WARMUP:])
    return tail[len(tail) // 2]
print("RESULT " + json.dumps({"rank": accelerator.process_index, "median": median(times),
                              "inside": median(feature), "patched": wrapped, "loss": loss.item(),
                              **{name: median(values) for name, values in phases.items()}}), flush=True)
""".replace("WARMUP", str(WARMUP))


PHASES = (
    ("draw", "drawing the batch (feature on: with the wait at the clean point)"),
    ("backward", "the forward and `accelerator.backward` (DeepSpeed's backward and step: the collectives)"),
    ("rest", "`optimizer.step()` to `zero_grad()` and the step count"),
    ("median", "whole step"),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: Path, feature_on: bool, steps: int, width: int) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("ACCEL_NPU_DISABLE", "ACCEL_NPU_DISABLED_PATCHES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(k, None)
    if not feature_on:
        env["ACCEL_NPU_DISABLED_PATCHES"] = FEATURE
    cmd = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--main_process_port",
        str(_free_port()),
        "--config_file",
        str(REPO / "launch_configs" / "cpu_zero2.yaml"),
        str(script),
        str(steps),
        str(width),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, cwd=script.parent)
    out = [
        json.JSONDecoder().raw_decode(part)[0]
        for line in (proc.stdout + proc.stderr).splitlines()
        for part in line.split("RESULT ")[1:]
    ]  # two ranks' prints can share a line
    if proc.returncode != 0 or len(out) != 2:
        raise SystemExit(f"launch ({'on' if feature_on else 'off'}) failed:\n{proc.stderr[-4000:]}")
    if any(r["patched"] != feature_on for r in out):
        raise SystemExit(f"the feature's patch is {'absent' if feature_on else 'applied'}: {out}")
    return sorted(out, key=lambda r: r["rank"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="launches per side, interleaved")
    ap.add_argument("--steps", type=int, default=150, help=f"steps per launch (the first {WARMUP} not timed)")
    ap.add_argument("--width", type=int, default=1024, help="width of the 4 Linear layers")
    ap.add_argument("--quick", action="store_true", help=f"1 launch per side, {WARMUP + 10} steps: proves it runs")
    a = ap.parse_args(argv)
    if a.quick:
        a.runs, a.steps = 1, WARMUP + 10
    report = Report(  # before measuring: its header reads the load average and the commit now
        "step_boundary", "Per-step cost of the step-boundary cooperation (rank-0-only save_state)", MEASURES
    )
    on, off = [], []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(LOOP)
        for i in range(a.runs):
            for feature_on in (True, False) if i % 2 == 0 else (False, True):
                (on if feature_on else off).append(launch(script, feature_on, a.steps, a.width))
            print(
                f"  #{i + 1} ms/step (rank 0, rank 1): on {[round(r['median'] * 1e3, 3) for r in on[-1]]}, "
                f"off {[round(r['median'] * 1e3, 3) for r in off[-1]]}",
                flush=True,
            )
    if on[0][0]["loss"] != off[0][0]["loss"]:
        raise SystemExit(f"the sides trained differently: {on[0][0]['loss']} vs {off[0][0]['loss']}")
    rows = []
    for label, pick in (
        ("rank 0 (releases)", lambda r: r[0]["median"]),
        ("rank 1 (waits)", lambda r: r[1]["median"]),
        ("slower rank", lambda r: max(x["median"] for x in r)),
    ):
        s_on, s_off = [pick(r) * 1e3 for r in on], [pick(r) * 1e3 for r in off]
        cost_us = (statistics.median(s_on) - statistics.median(s_off)) * 1e3
        pairs = [(x - y) * 1e3 for x, y in zip(s_on, s_off)]
        rows.append(
            [
                label,
                median_spread(s_off, "{:.3f}", " ms"),
                median_spread(s_on, "{:.3f}", " ms"),
                f"{cost_us:+.0f} µs",
                f"{cost_us / (statistics.median(s_off) * 1e3) * 100:+.2f} %",
                median_spread(pairs, "{:+.0f}", " µs"),
            ]
        )
    inside = [[r[rank]["inside"] * 1e6 for r in on] for rank in (0, 1)]
    step_us = statistics.median(max(x["median"] for x in r) for r in on) * 1e6
    own = [
        [
            "rank 0: its store write at its next batch (the feature's own work)",
            median_spread(inside[0], "{:.0f}", " µs"),
            f"{statistics.median(inside[0]) / step_us * 100:.3f} %",
        ],
        [
            "rank 1: waiting there for rank 0's release",
            median_spread(inside[1], "{:.0f}", " µs"),
            f"{statistics.median(inside[1]) / step_us * 100:.3f} %",
        ],
    ]
    phase_rows, moved = [], {}
    for rank in (0, 1):
        for phase, label in PHASES:
            s_off = [r[rank][phase] * 1e3 for r in off]
            s_on = [r[rank][phase] * 1e3 for r in on]
            moved[(rank, phase)] = (statistics.median(s_on) - statistics.median(s_off)) * 1e3
            phase_rows.append(
                [
                    f"rank {rank}",
                    label,
                    median_spread(s_off, "{:.3f}", " ms"),
                    median_spread(s_on, "{:.3f}", " ms"),
                    f"{moved[(rank, phase)]:+.0f} µs",
                ]
            )
    report.text(
        f"`accelerate launch --config_file launch_configs/cpu_zero2.yaml`: 2 CPU ranks (gloo), DeepSpeed ZeRO-2 "
        f"bf16, 1 thread each. A train_*.py-shaped loop: 4 × Linear({a.width}, {a.width}) + GELU, batch 8 per "
        f"rank, AdamW, LambdaLR, a never-firing `if accelerator.is_main_process: save_state` block. Per launch "
        f"and rank: median wall time of steps {WARMUP + 1}-{a.steps}. {a.runs} launches per side, alternating "
        "(which side goes first alternates from pair to pair). "
        f"Off: `ACCEL_NPU_DISABLED_PATCHES={FEATURE}`. Same loss on both sides ({on[0][0]['loss']:.6g}). "
        f"Goal: ≤ 1 % of a step; no extra collective (the feature uses the store only)."
    )
    report.table(
        ["per step", "feature off", "feature on", "cost (difference of medians)", "% of step", "per-pair difference"],
        rows,
    )
    report.text(
        "Time inside the feature's functions (boundary.before_backward, after_backward, after_optimizer_step, "
        "clean_point), timed in the feature-on launches by the loop itself: per launch the median over steps, "
        "then median (min-max) over launches; % of the slower rank's median step. It does not move with "
        "what the other jobs on the machine do to whole steps."
    )
    report.table(["feature on, per step", "inside the feature", "% of step"], own)
    report.text(
        "Where each rank's step goes, in the launches with the feature and in those without it (the same "
        "launch otherwise): per launch and rank the median over steps of each phase, then median (min-max) "
        "over launches; the difference is on minus off. Drawing the batch holds rank 1's wait at its clean "
        "point when the feature is on; the forward and `accelerator.backward` hold DeepSpeed's backward and "
        "step, with the gradient collectives in which a rank waits for the other."
    )
    report.table(["rank", "phase", "feature off", "feature on", "difference (on - off)"], phase_rows)
    report.text(
        f"Rank 1, on minus off (medians): {moved[(1, 'draw')]:+.0f} µs drawing its batch, "
        f"{moved[(1, 'backward')]:+.0f} µs in the forward and `accelerator.backward`, "
        f"{moved[(1, 'rest')]:+.0f} µs in the rest, "
        f"{moved[(1, 'median')]:+.0f} µs per whole step; its median wait at the clean point "
        f"{statistics.median(inside[1]):.0f} µs."
    )
    print(report.render())
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Ulysses sequence parallelism on a video DiT: per-rank peak memory and step time at sp = 1, 2, 4 as the video grows.

The training step: benchmarks/_sequence_parallel_train.py, an accelerate script that knows nothing about sequence
parallelism (the real ``CogVideoXTransformer3DModel`` class with RoPE, tiny widths: 4 heads x 16, 2 layers, fp32,
AdamW; one latent video per step, 8 latent frames, 224 text tokens, the video tokens growing 4k -> 32k). Each case is
``accelerate launch`` with the shipped ZeRO-2 DeepSpeed config at fp32 (launch_configs/cpu_zero2.deepspeed.json,
bf16 off), ``--num_processes sp`` and, for sp > 1, ``--use_parallelism_config --parallelism_config_sp_size sp``:
one sequence-parallel group, the same global batch (1 sample) as the 1-rank run. One thread per rank
(OMP_NUM_THREADS=1) in every case, so the 1-rank run and each rank of the sp=2 run compute on one core each.

Memory: each rank's anonymous resident memory (``RssAnon`` in /proc/<pid>/status: heap and tensors, not the
page cache of mapped files), sampled every 20 ms by this script over the whole launch; the table gives the per-rank
peak (the largest rank's) and, beside it, the step's increase over the rank's RssAnon after ``prepare`` (read by the
rank before step 1): at these tiny widths the fixed part (torch, DeepSpeed, diffusers loaded: ~0.5 GB) weighs as much
as the activations, which dominate at a real model's width. torch has no allocator statistics for CPU tensors,
hence RssAnon. Step time: wall seconds of each step (batch to ``optimizer.step``), the slowest rank's, median over
the steps after the first (``--warmup``). Ideal split: the 1-rank step time / sp, the 1-rank run on one core as each
sp rank; the ratio step time / ideal is what Ulysses costs (its all_to_all exchanges, the work every rank repeats:
patch embedding, rotary tables, the loss over the gathered output, and diffusers' Ulysses attention recomputing
the attention forward in its backward). sp=4 needs 4 cores: on fewer its ranks share cores and the table gives its
memory only.

Leaves out: NPUs (no HCCL, no npu_fusion_attention: gloo all_to_all between CPU processes on one machine, SDPA on
CPU), bf16, real widths (a 5B model's weights, gradients and optimizer states are ZeRO-partitioned as without
sp), more than one sequence-parallel group (sp x dp).

Usage: python benchmarks/sequence_parallel.py [--tokens 4096,8192,16384,32768] [--sps 1,2,4] [--steps 3] [--quick]
Writes benchmarks/results/sequence_parallel.md (``--quick``: 512 and 1024 tokens, 1 layer, 2 steps, to
results/sequence_parallel_quick.md: a check that the benchmark runs, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _proc import mem_available, rss_anon
from _results import Report, mb

from tests.launch_utils import BIN, REPO, base_env, free_port

TRAIN = Path(__file__).resolve().parent / "_sequence_parallel_train.py"
FRAMES = 8  # latent frames: 29 video frames after CogVideoX's temporal compression 4
TEXT = 224  # text tokens (CogVideoX pads to 226; 224 divides by 4, as diffusers' equal split needs)
HEADS, HEAD_DIM = 4, 16


#: the code measured besides this script (tests/test_docs_figures.py: a later change makes its results stale)
MEASURES = ("plugins/sequence_parallel/", "benchmarks/_sequence_parallel_train.py")


def geometry(tokens: int) -> tuple[int, int]:
    """Latent (height, width), patch 2, giving ``tokens`` video tokens over FRAMES latent frames."""
    area = tokens * 4 // FRAMES
    height = 2 ** int(math.log2(math.isqrt(area)))
    width = area // height
    if FRAMES * (height // 2) * (width // 2) != tokens or height % 2 or width % 2:
        raise SystemExit(f"{tokens} video tokens are not {FRAMES} frames of an even latent grid")
    return height, width


def launch_config(directory: Path, processes: int) -> Path:
    import yaml

    ds = json.loads((REPO / "launch_configs" / "cpu_zero2.deepspeed.json").read_text())
    ds["bf16"]["enabled"] = False
    (directory / "zero2_fp32.json").write_text(json.dumps(ds))
    config = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": str(directory / "zero2_fp32.json"), "zero3_init_flag": False},
        "num_machines": 1,
        "num_processes": processes,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": False,
    }
    path = directory / f"zero2_fp32_n{processes}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_case(work: Path, tokens: int, sp: int, layers: int, steps: int) -> dict:
    """One launch: {"peak": {pid: bytes}, "ranks": [rank json...], "seconds": wall} (RuntimeError on failure)."""
    import psutil

    height, width = geometry(tokens)
    out = work / f"t{tokens}_sp{sp}"
    out.mkdir()
    switch = ["--use_parallelism_config", "--parallelism_config_sp_size", str(sp)] if sp > 1 else []
    cmd = [
        str(BIN / "accelerate"),
        "launch",
        "--main_process_port",
        str(free_port()),
        "--config_file",
        str(launch_config(work, sp)),
        *switch,
        str(TRAIN),
        *("--frames", str(FRAMES), "--height", str(height), "--width", str(width), "--text", str(TEXT)),
        *("--layers", str(layers), "--heads", str(HEADS), "--head-dim", str(HEAD_DIM)),
        *("--steps", str(steps), "--out", str(out)),
    ]
    env = base_env()
    # the launched ranks import this checkout's accel_npu
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    log = (out / "launch.log").open("w")
    started = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    parent, peak = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        try:
            ranks = [c.pid for c in parent.children(recursive=True) if str(TRAIN) in " ".join(c.cmdline())]
        except psutil.Error:
            ranks = []
        for pid in ranks:
            peak[pid] = max(peak.get(pid, 0), rss_anon(pid))
        time.sleep(0.02)
    log.close()
    seconds = time.time() - started
    results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(results) != sp:
        tail = (out / "launch.log").read_text()[-4000:]
        raise RuntimeError(f"{tokens} tokens, sp={sp}: exit {proc.returncode}, {len(results)} rank results\n{tail}")
    return {"peak": peak, "ranks": results, "seconds": seconds}


def step_time(case: dict, warmup: int) -> float:
    """Median over the steps after ``warmup`` of the slowest rank's wall seconds."""
    per_step = [max(walls) for walls in zip(*(r["wall"] for r in case["ranks"]))]
    return statistics.median(per_step[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096,8192,16384,32768", help="video tokens per sample")
    parser.add_argument("--sps", default="1,2,4", help="sequence-parallel sizes (1 first: the baseline)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the step time")
    parser.add_argument("--quick", action="store_true", help="512 and 1024 tokens, 1 layer, 2 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.layers, args.steps = "512,1024", 1, 2
    # read before anything is measured: the machine must be idle for the step times to mean anything
    report = Report(
        "sequence_parallel_quick" if args.quick else "sequence_parallel",
        "Ulysses sequence parallelism on a video DiT: per-rank peak memory and step time, sp = 1, 2, 4",
        MEASURES,
    )
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f} before measuring: other jobs share the machine", flush=True)
    cores = len(os.sched_getaffinity(0))
    token_counts = [int(t) for t in args.tokens.split(",")]
    sps = [int(s) for s in args.sps.split(",")]
    if sps[0] != 1:
        raise SystemExit("--sps must start with 1: the baseline every ratio is taken against")
    rows, goals = [], []
    with tempfile.TemporaryDirectory(prefix="sequence-parallel-") as tmp:
        work = Path(tmp)
        for tokens in token_counts:
            base = None
            for sp in sps:
                timed = sp <= cores
                if base is not None and sp * base["peak_rank"] > 0.9 * mem_available():
                    rows.append([str(tokens), str(sp), "-", "not run: estimated not to fit", *["-"] * 9])
                    continue
                case = run_case(work, tokens, sp, args.layers, args.steps if timed else args.warmup + 1)
                by_pid = {r["pid"]: r for r in case["ranks"]}
                peak_rank = max(case["peak"].get(pid, 0) for pid in by_pid)
                before = max(r["before_step1"] for r in case["ranks"])
                increase = max(case["peak"].get(pid, 0) - r["before_step1"] for pid, r in by_pid.items())
                seconds = step_time(case, args.warmup) if timed else None
                attention = sorted({tuple(a) for r in case["ranks"] for a in r["attention"]})
                loss = case["ranks"][0]["loss"][0]
                if sp == 1:
                    base = {"peak_rank": peak_rank, "increase": increase, "seconds": seconds, "loss": loss}
                ideal = base["seconds"] / sp
                row = [
                    str(tokens),
                    str(sp),
                    ", ".join(f"{h} x {n}" for h, n in attention),
                    mb(peak_rank),
                    f"{peak_rank / base['peak_rank']:.2f}×",
                    mb(before),
                    mb(increase),
                    f"{increase / base['increase']:.2f}×",
                    f"{seconds:.3f} s" if timed else f"not timed: {sp} ranks on {cores} cores",
                    f"{ideal:.3f} s" if timed and sp > 1 else "-",
                    f"{seconds / ideal:.2f}×" if timed and sp > 1 else "-",
                    f"{loss:.6f}",
                    f"{abs(loss - base['loss']):.1e}",
                ]
                rows.append(row)
                print(" | ".join(row), f"(launch {case['seconds']:.0f} s)", flush=True)
                if tokens == token_counts[-1] and sp == 2:
                    goals.append(
                        f"sp=2 at {tokens} video tokens: per-rank peak {peak_rank / base['peak_rank']:.2f}× of "
                        f"sp=1 (goal ≤ 0.6: {'met' if peak_rank <= 0.6 * base['peak_rank'] else 'not met'}), "
                        f"step increase {increase / base['increase']:.2f}× "
                        f"({'met' if increase <= 0.6 * base['increase'] else 'not met'}); step time "
                        + (
                            f"{seconds / ideal:.2f}× the ideal split (goal ≤ 1.15: "
                            f"{'met' if seconds <= 1.15 * ideal else 'not met'})"
                            if timed
                            else "not timed"
                        )
                    )
    report.table(
        [
            "video tokens",
            "sp",
            "attention per rank (heads x tokens)",
            "per-rank peak RssAnon",
            "peak / sp=1",
            "after prepare",
            "step increase",
            "increase / sp=1",
            "step time",
            "ideal split",
            "step time / ideal",
            "step-1 loss",
            "|Δ loss| vs sp=1",
        ],
        rows,
        caption=(
            f"CogVideoXTransformer3DModel, {HEADS} heads x {HEAD_DIM}, {args.layers} layer(s), {FRAMES} latent frames, "
            f"{TEXT} text tokens, fp32 ZeRO-2; {args.steps} steps, step time = median of steps {args.warmup + 1}.."
            f"{args.steps}; {cores} cores, 1 thread per rank. Attention tokens = video + text tokens."
        ),
    )
    report.text(
        "Per-rank peak RssAnon: the largest rank's peak anonymous resident memory over the launch (sampled every "
        "20 ms). After prepare: the rank's RssAnon before step 1 (the largest rank's). Step increase: peak - after "
        "prepare, the activations and transients of the step (the largest rank's). Ideal split: the sp=1 step time "
        "/ sp, both with one thread per rank. Goal (issue 44): per-rank peak at sp=2 ≤ 0.6× sp=1 at the longest "
        "sequence, step time ≤ 1.15× the ideal split."
    )
    report.text("\n".join(f"- {goal}" for goal in goals) or "- no sp=2 case at the longest sequence")
    print(report.render())
    report.write()


if __name__ == "__main__":
    main()

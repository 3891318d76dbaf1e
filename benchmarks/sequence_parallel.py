"""Ulysses sequence parallelism on a video DiT: per-rank memory and step time at sp = 1, 2, 4 as the video grows.

The training step: benchmarks/_sequence_parallel_train.py, an accelerate script that knows nothing about sequence
parallelism (the real ``CogVideoXTransformer3DModel`` class with RoPE, tiny widths: 4 heads x 16, 4 layers, fp32,
AdamW; one latent video per step, 8 latent frames, 224 text tokens, the video tokens growing 4k -> 32k). Each case is
``accelerate launch`` with the shipped ZeRO-2 DeepSpeed config at fp32 (launch_configs/cpu_zero2.deepspeed.json,
bf16 off), ``--num_processes sp`` and, for sp > 1, ``--use_parallelism_config --parallelism_config_sp_size sp``:
one sequence-parallel group, the same global batch (1 sample) as the 1-rank run. One thread per rank
(OMP_NUM_THREADS=1) in every case, so the 1-rank run and each rank of the sp=2 run compute on one core each.

Memory, from each rank's anonymous resident memory (``RssAnon`` in /proc/<pid>/status: heap and tensors, not the
page cache of mapped files; torch keeps no allocator statistics for CPU tensors), sampled every 20 ms by this
script over the whole launch:

- device-memory analog: the rank's peak minus its RssAnon once torch, accelerate, DeepSpeed, diffusers and the
  process group are loaded, before the model is built (``libraries``, read by the rank): the weights, gradients,
  optimizer states, activations and the step's transients, what an NPU would hold in device memory. It leaves out
  what a device adds (HCCL's buffers per communicator) and holds the heap glibc keeps after tensors are freed, as
  a device's caching allocator keeps freed blocks reserved (``--mmap-threshold``: glibc maps and unmaps each
  large allocation, and RssAnon follows the live tensors, the figure ``max_memory_allocated`` gives on a device);
- per-rank peak RssAnon: the whole process, the libraries included (~0.35 GB per rank here, host memory on an NPU;
  at these tiny widths as large as the activations, which dominate at a real model's width).

The largest rank's figure in each case. Step time: seconds of each step (batch to ``optimizer.step``), the
slowest rank's, median over the steps after the first (``--warmup``), as wall time and as the rank's CPU time
(``time.process_time``, every thread of the rank). CPU time leaves out waiting (for the other rank at an
all_to_all, for a core held by another job): it is the figure that other jobs on the machine hardly move; wall
time holds the waits. Ideal split: the 1-rank step time / sp, the 1-rank run on one core as each sp rank; the
ratio step time / ideal is what Ulysses costs (its all_to_all exchanges, the work every rank repeats: patch
embedding, rotary tables, the loss over the gathered output). The 1-rank run has the machine to itself, while
the sp ranks share its memory bandwidth and caches, which NPUs, each with its own memory, do not: so the 1-rank
run is also launched once per core at once (independent launches, nothing exchanged), and the ratio to that
ideal split with every core busy is what the exchange and the repeated work cost alone. sp=4 on fewer than 4
cores: its ranks share cores, so its wall time is oversubscribed and its CPU time is the comparable figure.

Layers: 4. What is not split (the input latents, the gathered output, the loss, the rotary tables) is the same
for any depth, while each layer's activations are split: a 2-layer model shows more of the former (0.61x at sp=2,
32k tokens, at 1aa0ac0) than a real video DiT's 30-42 layers would (``--layers``).

Leaves out: NPUs (no HCCL, no npu_fusion_attention: gloo all_to_all between CPU processes on one machine, SDPA on
CPU), bf16, real widths (a 5B model's weights, gradients and optimizer states are ZeRO-partitioned as without
sp), more than one sequence-parallel group (sp x dp).

Usage: python benchmarks/sequence_parallel.py [--tokens 4096,8192,16384,32768] [--sps 1,2,4] [--layers 4] [--steps 3]
[--mmap-threshold BYTES] [--no-busy-baseline] [--quick]. Writes benchmarks/results/sequence_parallel.md
(``--quick``: 512 and 1024 tokens, 1 layer, 2 steps, to results/sequence_parallel_quick.md: a check that the
benchmark runs, not a measurement).
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
MEASURES = ("plugins/sequence_parallel/", "plugins/attention/native_sdpa.py", "benchmarks/_sequence_parallel_train.py")


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


def run_case(
    work: Path, tokens: int, sp: int, layers: int, steps: int, mmap_threshold: int = 0, copies: int = 1
) -> dict:
    """One launch, or ``copies`` independent launches started together (the 1-rank run once per core: the ideal
    split with every core busy): {"peak": {pid: bytes}, "ranks": [rank json...], "copies": [[rank json...] per
    launch], "seconds": wall} (RuntimeError on failure)."""
    import psutil

    height, width = geometry(tokens)
    switch = ["--use_parallelism_config", "--parallelism_config_sp_size", str(sp)] if sp > 1 else []
    env = base_env()
    # the launched ranks import this checkout's accel_npu
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if mmap_threshold:
        # glibc: a fixed threshold also turns off its dynamic one (mallopt M_MMAP_THRESHOLD)
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    launches = []
    started = time.time()
    for copy in range(copies):
        out = work / (f"t{tokens}_sp{sp}" + (f"_copy{copy}" if copies > 1 else ""))
        out.mkdir()
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
        log = (out / "launch.log").open("w")
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        launches.append((out, log, proc, psutil.Process(proc.pid)))
    peak, ranks, polls = {}, [], 0
    while any(proc.poll() is None for _, _, proc, _ in launches):
        # listing the process tree reads all of /proc (milliseconds on a busy machine, a share of the 2 cores the
        # ranks run on at every poll): each poll until the ranks are up, then once a second
        if len(ranks) < sp * copies or polls % 50 == 0:
            ranks = []
            for _, _, _, parent in launches:
                try:
                    ranks += [c.pid for c in parent.children(recursive=True) if str(TRAIN) in " ".join(c.cmdline())]
                except psutil.Error:
                    pass
        for pid in ranks:
            peak[pid] = max(peak.get(pid, 0), rss_anon(pid))
        polls += 1
        time.sleep(0.02)
    seconds = time.time() - started
    per_copy = []
    for out, log, proc, _ in launches:
        log.close()
        results = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
        if proc.returncode != 0 or len(results) != sp:
            tail = (out / "launch.log").read_text()[-4000:]
            raise RuntimeError(f"{tokens} tokens, sp={sp}: exit {proc.returncode}, {len(results)} rank results\n{tail}")
        per_copy.append(results)
    return {"peak": peak, "ranks": [r for results in per_copy for r in results], "copies": per_copy, "seconds": seconds}


def step_seconds(case: dict, kind: str, warmup: int) -> float:
    """Median over the steps after ``warmup`` of the slowest rank's ``kind`` ("wall" or "cpu") seconds; for
    independent copies started together, the mean of their medians."""
    medians = []
    for ranks in case["copies"]:
        per_step = [max(seconds) for seconds in zip(*(r[kind] for r in ranks))]
        medians.append(statistics.median(per_step[warmup:]))
    return statistics.mean(medians)


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}×"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="4096,8192,16384,32768", help="video tokens per sample")
    parser.add_argument("--sps", default="1,2,4", help="sequence-parallel sizes (1 first: the baseline)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of the step time")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the ranks (bytes; 0: glibc's default): allocations above it are "
        "mapped and unmapped one by one, so RssAnon follows the live tensors instead of glibc's retained heap, at "
        "the cost of page faults in the step times",
    )
    parser.add_argument(
        "--no-busy-baseline",
        action="store_true",
        help="leave out the 1-rank run once per core at once (the ideal split with every core busy)",
    )
    parser.add_argument("--quick", action="store_true", help="512 and 1024 tokens, 1 layer, 2 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.layers, args.steps = "512,1024", 1, 2
    if args.steps <= args.warmup:
        raise SystemExit("--steps must exceed --warmup: the step time is taken over the steps after the warm-up")
    # read before anything is measured: the machine must be idle for the wall times to mean anything
    report = Report(
        "sequence_parallel_quick" if args.quick else "sequence_parallel",
        "Ulysses sequence parallelism on a video DiT: per-rank memory and step time, sp = 1, 2, 4",
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
    for tokens in token_counts:
        geometry(tokens)  # refuse a size before an hour of measuring, not after
    busy_copies = 0 if args.no_busy_baseline or cores < 2 or not any(1 < sp <= cores for sp in sps) else cores
    rows, goals = [], []
    with tempfile.TemporaryDirectory(prefix="sequence-parallel-") as tmp:
        work = Path(tmp)
        for tokens in token_counts:
            base = None
            for sp in sps:
                if base is not None and sp * base["peak"] > 0.9 * mem_available():
                    rows.append([str(tokens), str(sp), "-", "not run: estimated not to fit", *["-"] * 13])
                    continue
                case = run_case(work, tokens, sp, args.layers, args.steps, args.mmap_threshold)
                by_pid = {r["pid"]: r for r in case["ranks"]}
                peak = max(case["peak"].get(pid, 0) for pid in by_pid)
                analog = max(case["peak"].get(pid, 0) - r["libraries"] for pid, r in by_pid.items())
                libraries = max(r["libraries"] for r in case["ranks"])
                prepared = max(r["before_step1"] - r["libraries"] for r in case["ranks"])
                wall = step_seconds(case, "wall", args.warmup)
                cpu = step_seconds(case, "cpu", args.warmup)
                attention = sorted({tuple(a) for r in case["ranks"] for a in r["attention"]})
                loss = case["ranks"][0]["loss"][0]
                if sp == 1:
                    base = {"peak": peak, "analog": analog, "wall": wall, "cpu": cpu, "loss": loss}
                    busy = base
                    if busy_copies:
                        busy_case = run_case(
                            work, tokens, 1, args.layers, args.steps, args.mmap_threshold, copies=busy_copies
                        )
                        busy = {kind: step_seconds(busy_case, kind, args.warmup) for kind in ("wall", "cpu")}
                oversubscribed = sp > cores
                row = [
                    str(tokens),
                    str(sp),
                    ", ".join(f"{h} x {n}" for h, n in attention),
                    mb(analog),
                    ratio(analog, base["analog"]),
                    mb(peak),
                    ratio(peak, base["peak"]),
                    mb(libraries),
                    mb(prepared),
                    f"{wall:.3f} s" + (f" ({sp} ranks on {cores} cores)" if oversubscribed else ""),
                    "-" if sp == 1 else "oversubscribed" if oversubscribed else ratio(wall, base["wall"] / sp),
                    f"{cpu:.3f} s",
                    "-" if sp == 1 else ratio(cpu, base["cpu"] / sp),
                    "-"
                    if sp == 1 or busy is base
                    else "oversubscribed"
                    if oversubscribed
                    else ratio(wall, busy["wall"] / sp),
                    "-" if sp == 1 or busy is base else ratio(cpu, busy["cpu"] / sp),
                    f"{loss:.6f}",
                    f"{abs(loss - base['loss']):.1e}",
                ]
                rows.append(row)
                print(" | ".join(row), f"(launch {case['seconds']:.0f} s)", flush=True)
                if sp == 1 and busy is not base:
                    rows.append(
                        [
                            str(tokens),
                            f"1, {busy_copies} launches at once",
                            *["-"] * 7,
                            f"{busy['wall']:.3f} s",
                            "-",
                            f"{busy['cpu']:.3f} s",
                            *["-"] * 5,
                        ]
                    )
                    print(" | ".join(rows[-1]), flush=True)
                if tokens == token_counts[-1] and sp > 1:
                    goals.append(goal_line(tokens, sp, base, busy, analog, peak, wall, cpu, cores))
    report.table(
        [
            "video tokens",
            "sp",
            "attention per rank (heads x tokens)",
            "device-memory analog",
            "analog / sp=1",
            "per-rank peak RssAnon",
            "peak / sp=1",
            "libraries",
            "prepared",
            "step wall time",
            "wall / ideal",
            "step CPU time",
            "CPU / ideal",
            "wall / ideal, every core busy",
            "CPU / ideal, every core busy",
            "step-1 loss",
            "|Δ loss| vs sp=1",
        ],
        rows,
        caption=(
            f"CogVideoXTransformer3DModel, {HEADS} heads x {HEAD_DIM}, {args.layers} layer(s), {FRAMES} latent frames, "
            f"{TEXT} text tokens, fp32 ZeRO-2; {args.steps} steps, step times = median of steps {args.warmup + 1}.."
            f"{args.steps}; {cores} cores, 1 thread per rank"
            + (f"; glibc mmap threshold {args.mmap_threshold} bytes" if args.mmap_threshold else "")
            + ". Attention tokens = video + text tokens."
        ),
    )
    report.text(
        "Device-memory analog: the rank's peak RssAnon minus its RssAnon once the libraries and the process group "
        "are loaded, before the model is built (weights, gradients, optimizer states, activations and transients: "
        "what an NPU would hold in device memory; leaves out HCCL's buffers; holds the heap glibc keeps after "
        "tensors are freed, as a caching allocator keeps freed blocks, unless a glibc mmap threshold is given). "
        "Per-rank peak RssAnon: the whole process (sampled every 20 ms), the libraries included, "
        "host memory on an NPU. Libraries: that RssAnon before the model is built. Prepared: after prepare, over "
        "libraries (the tiny model's weights and ZeRO's buffers). Each the largest rank's. Step wall / CPU time: "
        "the slowest rank's, wall seconds and process CPU seconds (every thread of the rank; waits left out). "
        "Ideal split: the sp=1 step time / sp, both with one thread per rank. Every core busy: the 1-rank run "
        "launched once per core at once (independent, nothing exchanged; the mean of the launches' step times), "
        "sharing memory bandwidth and caches as the sp ranks do. Goal (issue 44): per-rank peak at "
        "sp=2 ≤ 0.6× sp=1 at the longest sequence, step time ≤ 1.15× the ideal split."
    )
    report.text("\n".join(f"- {goal}" for goal in goals) or "- no sp > 1 case at the longest sequence")
    print(report.render())
    report.write()


def goal_line(tokens, sp, base, busy, analog, peak, wall, cpu, cores) -> str:
    """The issue's goals at the longest sequence for one sp (the memory goal is stated for sp=2)."""

    def verdict(value: float, limit: float) -> str:
        return f"goal ≤ {limit}: {'met' if value <= limit else 'not met'}"

    memory = analog / base["analog"]
    cpu_ratio, wall_ratio = cpu / (base["cpu"] / sp), wall / (base["wall"] / sp)
    parts = [
        f"device-memory analog {memory:.2f}× of sp=1"
        + (f" ({verdict(memory, 0.6)})" if sp == 2 else f" (1/{sp} = {1 / sp:.2f})"),
        f"whole-process peak {peak / base['peak']:.2f}×"
        + (f" ({verdict(peak / base['peak'], 0.6)}, the libraries included)" if sp == 2 else ""),
        f"step CPU time {cpu_ratio:.2f}× the ideal split ({verdict(cpu_ratio, 1.15)})",
        f"step wall time {wall_ratio:.2f}× ("
        + (f"oversubscribed: {sp} ranks on {cores} cores" if sp > cores else verdict(wall_ratio, 1.15))
        + ")",
    ]
    if busy is not base:
        busy_cpu = cpu / (busy["cpu"] / sp)
        parts.append(f"against the ideal split with every core busy: CPU {busy_cpu:.2f}× ({verdict(busy_cpu, 1.15)})")
        if sp <= cores:
            busy_wall = wall / (busy["wall"] / sp)
            parts[-1] += f", wall {busy_wall:.2f}× ({verdict(busy_wall, 1.15)})"
    return f"sp={sp} at {tokens} video tokens: " + "; ".join(parts)


if __name__ == "__main__":
    main()

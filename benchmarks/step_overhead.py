"""Step-time overhead of accel-npu's patches on a ZeRO-3 training loop stock DeepSpeed also runs
(goal: <= 1 %), measured side by side in one run.

One process, world size 1 (gloo), ``deepspeed.initialize`` of a small model (4 Linear + GELU
layers) with ZeRO-3 and ``stage3_param_persistence_threshold`` 0: every parameter is partitioned,
so every forward and backward fetches every layer through
``PartitionedParameterCoordinator.fetch_sub_module`` (which accel-npu patches so that an inference-mode
eval between steps does not break the next step), and the collectives go through ``torch.distributed``
(patched by the hang watch). Each process times every step (forward, backward, AdamW step,
``loss.item()``) and reports the median after a warm-up; the worker checks that the patch is applied
(accel-npu) or absent (stock) and that the parameters are partitioned again after each step (so the fetch
ran). Processes alternate accel-npu /
``ACCEL_NPU_DISABLE=1``, so drift in machine load hits both alike; the table gives the median
(min-max) over processes and the ratio of the medians, plus the median (min-max) of each pair's ratio.

Usage: python benchmarks/step_overhead.py [--runs 7] [--steps 200]
Writes benchmarks/results/step_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import Report, median_spread

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("accel_npu/", "plugins/")

WARMUP = 30

ZERO3_LOOP = r"""
import inspect, json, os, socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import torch
import torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
import deepspeed
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
deepspeed.comm.init_distributed(dist_backend="gloo")
fetch = inspect.getattr_static(PartitionedParameterCoordinator, "fetch_sub_module")
wrapped = type(fetch).__name__ == "FunctionWrapper"
assert wrapped == (os.environ.get("ACCEL_NPU_DISABLE") != "1"), "patch not applied as expected"
torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
x = torch.randn(16, 256)
times, cpu = [], []
for step in range(int(sys.argv[1])):
    t0, c0 = time.perf_counter(), time.thread_time()
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    loss.item()
    times.append(time.perf_counter() - t0)
    cpu.append(time.thread_time() - c0)  # this thread's CPU time: not inflated by waiting for a core
    # partitioned again (numel 0 on this rank until fetched): the next forward fetches every layer
    assert all(p.numel() == 0 for p in engine.module.parameters()), "parameters not partitioned"
med = lambda xs: sorted(xs[%d:])[len(xs[%d:]) // 2]
print("RESULT " + json.dumps({"median": med(times), "cpu": med(cpu), "loss": loss.item()}))
""" % (WARMUP, WARMUP)  # noqa: UP031 - the template is Python code full of braces


#: the one patch that changes the path itself: stock DeepSpeed on CPU builds its shm comm op and then
#: runs a slower step (it also asks numactl for the NUMA cores on every step); with this patch left
#: unapplied both sides run the same DeepSpeed code and the ratio is the patches' overhead
SHM_OP = "deepspeed.comm.torch:build_shm_op"


def env(disabled: bool, disabled_patches: str = "") -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.pop("ACCEL_NPU_DISABLE", None)
    e.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode cached, as users run Python
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    e.pop("ACCEL_NPU_DISABLED_PATCHES", None)
    if disabled:
        e["ACCEL_NPU_DISABLE"] = "1"
    if disabled_patches:
        e["ACCEL_NPU_DISABLED_PATCHES"] = disabled_patches
    return e


def zero3_step(disabled: bool, steps: int, disabled_patches: str = "") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ZERO3_LOOP, str(steps)],
        env=env(disabled, disabled_patches),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise SystemExit(f"ZeRO-3 loop ({'stock' if disabled else 'accel-npu'}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="processes per side, interleaved")
    ap.add_argument("--steps", type=int, default=200, help=f"steps per process (the first {WARMUP} not timed)")
    a = ap.parse_args(argv)
    report = Report(  # before measuring: its header reads the load average and the commit now
        "step_overhead", "Step-time overhead of accel-npu's patches: ZeRO-3 fetch path (stock runs it too)", MEASURES
    )
    ours, same, stock = [], [], []
    sides = [(same, (False, SHM_OP)), (stock, (True,)), (ours, (False,))]
    for i in range(a.runs):
        for runs, args in sides[i % 3 :] + sides[: i % 3]:  # each side goes first in turn
            runs.append(zero3_step(args[0], a.steps, *args[1:]))
        print(
            f"  #{i + 1} CPU ms/step: accel-npu without the shm-op patch {same[-1]['cpu'] * 1e3:.3f}, stock "
            f"{stock[-1]['cpu'] * 1e3:.3f}, accel-npu {ours[-1]['cpu'] * 1e3:.3f}",
            flush=True,
        )
    if not ours[0]["loss"] == same[0]["loss"] == stock[0]["loss"]:
        raise SystemExit(
            f"the sides trained differently: loss {ours[0]['loss']}, {same[0]['loss']}, {stock[0]['loss']}"
        )
    rows = []
    for measure, field in (("CPU time", "cpu"), ("wall time", "median")):
        s = [r[field] * 1e3 for r in stock]
        for label, side in (
            (
                f"accel-npu, `ACCEL_NPU_DISABLED_PATCHES={SHM_OP}` (the same DeepSpeed path as "
                "stock: the patches' overhead)",
                same,
            ),
            ("accel-npu, all patches (stock's CPU shm comm op not built)", ours),
        ):
            o = [r[field] * 1e3 for r in side]
            pairs = [x / y for x, y in zip(o, s)]
            rows.append(
                [
                    measure,
                    label,
                    median_spread(s, "{:.3f}", " ms"),
                    median_spread(o, "{:.3f}", " ms"),
                    f"{statistics.median(o) / statistics.median(s):.3f}",
                    median_spread(pairs, "{:.3f}"),
                ]
            )
    report.text(
        f"One process, world size 1 (gloo), `deepspeed.initialize`, ZeRO-3 with "
        f"stage3_param_persistence_threshold 0 (every layer fetched through the patched "
        f"`fetch_sub_module` every forward and backward), 4 × Linear(256, 256) + GELU, batch 16, "
        f"torch AdamW, 1 thread. Per process: median step time (CPU time of the training thread, which waiting "
        f"for a core on a shared machine does not inflate; and wall time) of steps {WARMUP + 1}-{a.steps}; "
        f"{a.runs} processes per side, interleaved (each side first in turn); same loss on both sides "
        f"({ours[0]['loss']:.6g}). "
        f"Goal: ≤ 1 % overhead."
    )
    report.table(
        [
            "per step",
            "ZeRO-3 step (fetch path)",
            "stock (ACCEL_NPU_DISABLE=1)",
            "accel-npu",
            "ratio of medians",
            "per-run ratios",
        ],
        rows,
    )
    print(report.render())
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

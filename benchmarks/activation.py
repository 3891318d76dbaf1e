"""Activation cost and hot-path overhead of accel-npu, measured side by side in one run.

1. `python -c "import torch"`: CPU time (user + system, from wait4) and wall time with accel-npu
   installed vs ACCEL_NPU_DISABLE=1, runs interleaved so drift in machine load hits both alike
   (goal: CPU-time ratio <= 1.01). A plain process: activation waits for the first
   import of what accel-npu patches (accel_npu/activation/triggers.py).
2. The same where accel-npu does activate: `import torch` in a launched rank (LOCAL_RANK set: it
   activates inside `import torch`) and `import torch, accelerate` (it activates at accelerate's import).
3. accel-npu's activation alone, timed inside one process (`import accel_npu.auto` after torch).
4. A small training loop (autocast("cpu"), foreach AdamW, .numpy() of the loss — the patched entry
   points on the hot path; a launched rank (LOCAL_RANK set: the autocast patch belongs to the CUDA
   façade, which applies there) that imports accelerate, so the patches are applied, which the loop
   checks): median step time with vs without accel-npu, which side goes first alternating (goal:
   <= 1 %). Step times on a shared machine vary by more than 1 %, so the cost of the step's patched
   calls is also measured per call (min of repeats) and set against the step time.

Usage: python benchmarks/activation.py [--runs 15] [--loops 5]
Writes benchmarks/results/activation.md.
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
MEASURES = ("accel_npu/", "plugins/", "_accel_npu_startup.py")

LOOP = r"""
import inspect, json, os, time, torch
import accelerate  # activates accel-npu (unless disabled): the loop runs through the patched entry points
wrapped = type(inspect.getattr_static(torch.autocast, "__init__")).__name__ == "FunctionWrapper"
assert wrapped == (os.environ.get("ACCEL_NPU_DISABLE") != "1"), "patches not applied as expected"
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
x = torch.randn(64, 256)
times = []
for step in range(230):
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    loss.detach().numpy()
    times.append(time.perf_counter() - t0)
print(json.dumps(sorted(times[30:])[len(times[30:]) // 2]))
"""


CALLS = r"""
import json, timeit, torch
import accelerate  # activates accel-npu (unless disabled)
x = torch.randn(4)
def autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pass
n = 20000
# min of repeats: the least-disturbed estimate of one call's cost
print(json.dumps({name: min(timeit.repeat(fn, number=n, repeat=7)) / n
                  for name, fn in (("autocast", autocast), ("numpy", lambda: x.numpy()))}))
"""


def call_costs(disabled: bool) -> dict:
    """Seconds per call of the patched entry points the training loop calls every step."""
    out = subprocess.run(
        [sys.executable, "-c", CALLS], env=env(disabled, **LAUNCHED), check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


#: the training loop and the per-call costs run as a launched rank would: the patches on its hot path (autocast
#: among them) belong to the CUDA façade, which applies in launched ranks only (accel_npu/scopes.py)
LAUNCHED = {"LOCAL_RANK": "0"}


def env(disabled: bool, **extra: str) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    e.pop("ACCEL_NPU_DISABLE", None)
    # Python as users run it: with bytecode caching (some sandboxes turn it off, which would make
    # every run recompile accel-npu's sources and measure the compiler, not accel-npu).
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    if disabled:
        e["ACCEL_NPU_DISABLE"] = "1"
    return e


def time_import(disabled: bool, code: str = "import torch", **extra_env: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `python -c <code>`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(env(disabled), **extra_env))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"`python -c {code!r}` failed (status {status})")
    return wall, usage.ru_utime + usage.ru_stime


#: (row label, code, extra environment) of each import measured
IMPORTS = (
    ("`import torch`, plain process (activation waits)", "import torch", {}),
    ("`import torch`, launched rank (LOCAL_RANK=0: activates inside)", "import torch", {"LOCAL_RANK": "0"}),
    ("`import torch, accelerate` (activates at accelerate's import)", "import torch, accelerate", {}),
)


ACTIVATE = r"""
import time, torch          # autoload off: accel-npu is not active yet
t0 = time.perf_counter()
import accel_npu.auto       # exactly what the torch.backends entry point does
print((time.perf_counter() - t0))
"""


DEFERRED = r"""
import time, torch          # autoload off: accel-npu's entry point has not run yet
t0 = time.perf_counter()
from accel_npu.activation.autoload import activate_from_torch
activate_from_torch()       # exactly what the torch.backends entry point runs; in a plain process it waits
print((time.perf_counter() - t0))
"""


def deferred_time() -> float:
    """accel-npu's share of `import torch` in a plain process (the entry point decides to wait)."""
    out = subprocess.run(
        [sys.executable, "-c", DEFERRED],
        env=dict(env(False), TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def activation_time() -> float:
    """accel-npu's own share of `import torch`, timed inside one process (no process-start noise)."""
    out = subprocess.run(
        [sys.executable, "-c", ACTIVATE],
        env=dict(env(False), TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def step_time(disabled: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", LOOP], env=env(disabled, **LAUNCHED), check=True, capture_output=True, text=True
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--loops", type=int, default=5)
    a = ap.parse_args()
    report = Report(
        "activation", "Activation cost: import torch and a training step, with vs without accel-npu", MEASURES
    )
    for _, code, extra in IMPORTS:  # warm-up: write bytecode caches, fill the page cache
        time_import(False, code, **extra), time_import(True, code, **extra)
    samples = {label: ([], []) for label, _, _ in IMPORTS}
    for _ in range(a.runs):  # interleaved so drift in machine load hits both sides alike
        for label, code, extra in IMPORTS:
            samples[label][0].append(time_import(False, code, **extra))
            samples[label][1].append(time_import(True, code, **extra))
    act = [activation_time() for _ in range(a.runs)]
    waits = [deferred_time() for _ in range(a.runs)]
    s_on, s_off = [], []
    for i in range(a.loops):  # which side goes first alternates
        for disabled in (False, True) if i % 2 == 0 else (True, False):
            (s_off if disabled else s_on).append(step_time(disabled))
    calls_on, calls_off = call_costs(False), call_costs(True)
    ms = "{:.0f}"
    rows = []
    for label, _, _ in IMPORTS:
        on, off = samples[label]
        cpu_on, cpu_off = [c for _, c in on], [c for _, c in off]
        # the ratio of each interleaved pair: its spread shows the noise the goal is read against
        pair_ratio = sorted(x / y for x, y in zip(cpu_on, cpu_off))
        rows.append(
            [
                f"{label}: CPU time (user+sys), {a.runs} runs",
                median_spread([x * 1e3 for x in cpu_on], ms, " ms"),
                median_spread([x * 1e3 for x in cpu_off], ms, " ms"),
                f"{statistics.median(cpu_on) / statistics.median(cpu_off):.3f} "
                f"(pairs {pair_ratio[0]:.3f}-{pair_ratio[-1]:.3f})",
                "<= 1.01" if label == IMPORTS[0][0] else "",
            ]
        )
    on, off = samples[IMPORTS[0][0]]
    wall_on, wall_off = [w for w, _ in on], [w for w, _ in off]
    rows += [
        [
            f"{IMPORTS[0][0]}: wall time, {a.runs} runs",
            median_spread([x * 1e3 for x in wall_on], ms, " ms"),
            median_spread([x * 1e3 for x in wall_off], ms, " ms"),
            f"{statistics.median(wall_on) / statistics.median(wall_off):.3f}",
            "",
        ],
        [
            f"accel-npu's share of `import torch` in a plain process (in-process: the entry point waits), {a.runs} "
            "runs",
            median_spread([x * 1e3 for x in waits], "{:.2f}", " ms"),
            "-",
            "-",
            "",
        ],
        [
            f"accel-npu's activation alone (in-process), {a.runs} runs",
            median_spread([x * 1e3 for x in act], "{:.1f}", " ms"),
            "-",
            "-",
            "",
        ],
        [
            f"train step (autocast, foreach AdamW, .numpy(); patches applied), median of {a.loops}",
            median_spread([x * 1e3 for x in s_on], "{:.3f}", " ms"),
            median_spread([x * 1e3 for x in s_off], "{:.3f}", " ms"),
            f"{statistics.median(s_on) / statistics.median(s_off):.3f}",
            "<= 1.01",
        ],
    ]
    extra = sum(calls_on.values()) - sum(calls_off.values())
    for name, label in (
        ("autocast", '`with torch.autocast("cpu", bfloat16)` enter+exit'),
        ("numpy", "`tensor.numpy()`"),
    ):
        rows.append(
            [
                f"one {label} call (min of 7 x 20,000)",
                f"{calls_on[name] * 1e6:.2f} us",
                f"{calls_off[name] * 1e6:.2f} us",
                f"{calls_on[name] / calls_off[name]:.3f}",
                "",
            ]
        )
    rows.append(
        [
            "the step's patched calls: added time per step / step time",
            f"{extra * 1e6:+.2f} us",
            f"{statistics.median(s_off) * 1e3:.3f} ms",
            f"{1 + extra / statistics.median(s_off):.4f}",
            "<= 1.01",
        ]
    )
    report.text(
        "Each import is a fresh `python -c` process (OMP_NUM_THREADS=1, bytecode caching on); "
        "accel-npu vs ACCEL_NPU_DISABLE=1, interleaved. Values: median (min-max). A plain process "
        "activates at the first import of what accel-npu patches (docs/activation.md); a launched "
        "rank, an Ascend machine or an installed third-party plugin activates inside `import torch`."
    )
    report.table(["measure", "accel-npu", "disabled", "ratio", "goal"], rows)
    print(report.render())
    report.write()


if __name__ == "__main__":
    main()

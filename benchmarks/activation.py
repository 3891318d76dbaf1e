"""Activation cost and hot-path overhead of accel-npu, measured side by side in one run.

1. `python -c "import torch"`: median wall time with accel-npu active vs ACCEL_NPU_DISABLE=1,
   runs interleaved (goal: <= +30 ms).
2. A small training loop (autocast, AdamW, .numpy() of the loss — the patched entry points on
   the hot path): median step time with vs without accel-npu (goal: <= 1 % difference).

Usage: python benchmarks/activation.py [--runs 20] [--loops 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOOP = r'''
import json, time, torch
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
'''


def env(disabled: bool) -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.pop("ACCEL_NPU_DISABLE", None)
    # Python as users run it: with bytecode caching (some sandboxes turn it off, which would make
    # every run recompile accel-npu's sources and measure the compiler, not accel-npu).
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    if disabled:
        e["ACCEL_NPU_DISABLE"] = "1"
    return e


def time_import(disabled: bool) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env(disabled), check=True)
    return time.perf_counter() - t0


ACTIVATE = r'''
import time, torch          # autoload off: accel-npu is not active yet
t0 = time.perf_counter()
import accel_npu.auto       # exactly what the torch.backends entry point does
print((time.perf_counter() - t0))
'''


def activation_time() -> float:
    """accel-npu's own share of `import torch`, timed inside one process (no process-start noise)."""
    out = subprocess.run([sys.executable, "-c", ACTIVATE], env=dict(env(False), TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def step_time(disabled: bool) -> float:
    out = subprocess.run([sys.executable, "-c", LOOP], env=env(disabled), check=True,
                         capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--loops", type=int, default=5)
    a = ap.parse_args()
    time_import(False), time_import(True)  # warm-up: write bytecode caches, fill the page cache
    on, off = [], []
    for _ in range(a.runs):  # interleaved so drift in machine load hits both sides alike
        on.append(time_import(False))
        off.append(time_import(True))
    act = statistics.median(activation_time() for _ in range(a.runs))
    s_on, s_off = [], []
    for _ in range(a.loops):
        s_on.append(step_time(False))
        s_off.append(step_time(True))
    imp_on, imp_off = statistics.median(on), statistics.median(off)
    st_on, st_off = statistics.median(s_on), statistics.median(s_off)
    print(f"{'measure':<34}{'accel-npu':>12}{'disabled':>12}{'difference':>14}{'goal':>12}")
    print(f"{'import torch, median of %d (ms)' % a.runs:<34}{imp_on * 1e3:>12.1f}{imp_off * 1e3:>12.1f}"
          f"{(imp_on - imp_off) * 1e3:>+13.1f} ms{'<= +30 ms':>12}")
    print(f"{'activation alone, median of %d (ms)' % a.runs:<34}{act * 1e3:>12.1f}{'-':>12}"
          f"{act * 1e3:>+13.1f} ms{'<= +30 ms':>12}")
    print(f"{'train step, median of %d (ms)' % a.loops:<34}{st_on * 1e3:>12.3f}{st_off * 1e3:>12.3f}"
          f"{(st_on / st_off - 1) * 100:>+13.2f} %{'<= 1 %':>12}")


if __name__ == "__main__":
    main()

"""Per-call cost of the torch.cuda façade's hot-path wrappers (plugins/cuda_compat), measured side by
side in one run: ``Tensor.to``, ``Module.to`` and factory functions are wrapped in every process
where CUDA is absent, so calls that never mention CUDA pay for a type check.

Each case runs in its own fresh process, rotating accel-npu (a launched rank: LOCAL_RANK=0, so
activation is immediate), accel-npu without the façade (``ACCEL_NPU_DISABLED_PLUGINS=cuda_compat``:
what the rest of accel-npu costs, e.g. its background threads) and stock (``ACCEL_NPU_DISABLE=1``);
each process times N calls (best of 5 repeats, per call) after checking the wrappers are (or are not)
installed. The table gives the median (min-max) over processes and the façade's share: accel-npu
minus accel-npu without it.

Usage: python benchmarks/cuda_compat_overhead.py [--runs 3] [--calls 20000]
Writes benchmarks/results/cuda_compat_overhead.md.
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
MEASURES = ("plugins/cuda_compat/", "accel_npu/patching/")

CASES = {
    "x.to(torch.float16)": "x.to(torch.float16)",
    "x.to('cpu')": "x.to('cpu')",
    "x.to('cuda') (remapped)": "x.to('cuda')",
    "torch.zeros(16)": "torch.zeros(16)",
    "torch.zeros(16, device='cpu')": "torch.zeros(16, device='cpu')",
    "torch.zeros(16, device='cuda') (remapped)": "torch.zeros(16, device='cuda')",
    "model.to('cpu') (Linear)": "m.to('cpu')",
    "torch.cuda.is_available()": "torch.cuda.is_available()",
}

WORKER = r"""
import json, os, sys, timeit
import torch
import wrapt
stock = os.environ.get("ACCEL_NPU_DISABLE") == "1" or "cuda_compat" in os.environ.get("ACCEL_NPU_DISABLED_PLUGINS", "")
import inspect
wrapped = isinstance(inspect.getattr_static(torch.Tensor, "to"), wrapt.FunctionWrapper)
assert wrapped != stock, "wrappers not as expected"
x = torch.zeros(16)
m = torch.nn.Linear(4, 4)
calls = int(sys.argv[1])
out = {}
for name, stmt in json.loads(sys.argv[2]).items():
    if stock and "cuda" in stmt and "is_available" not in stmt:
        out[name] = None  # stock raises: no CUDA here
        continue
    t = timeit.Timer(stmt, globals=globals())
    out[name] = min(t.repeat(5, calls)) / calls * 1e9
print("RESULT " + json.dumps(out))
"""


def run(extra: dict, calls: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update(OMP_NUM_THREADS="1", LOCAL_RANK="0", **extra)
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(calls), json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[7:])


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calls", type=int, default=20000)
    a = p.parse_args(argv)
    report = Report("cuda_compat_overhead", "torch.cuda façade: per-call cost of the hot-path wrappers", MEASURES)
    kinds = {"ours": {}, "without": {"ACCEL_NPU_DISABLED_PLUGINS": "cuda_compat"}, "stock": {"ACCEL_NPU_DISABLE": "1"}}
    got = {kind: {k: [] for k in CASES} for kind in kinds}
    for _ in range(a.runs):
        for kind, extra in kinds.items():
            for k, v in run(extra, a.calls).items():
                if v is not None:
                    got[kind][k].append(v)
    rows = []
    for k in CASES:
        ours, without, stock = got["ours"][k], got["without"][k], got["stock"][k]
        if ours and without:
            extra = statistics.median(ours) - statistics.median(without)
            diff, per_thousand = f"{extra:+.0f} ns", f"{extra / 1e3:+.1f} ms"
        else:
            diff = per_thousand = "raises without it"
        rows.append(
            [
                f"`{k}`",
                median_spread(stock, "{:.0f}", " ns"),
                median_spread(without, "{:.0f}", " ns"),
                median_spread(ours, "{:.0f}", " ns"),
                diff,
                per_thousand,
            ]
        )
    report.table(
        [
            "call",
            "stock (ACCEL_NPU_DISABLE=1)",
            "accel-npu without the façade",
            "accel-npu",
            "façade's cost",
            "per 1,000 calls",
        ],
        rows,
        caption=f"Per call, best of 5 × {a.calls} calls, median (min-max) over {a.runs} processes each, one thread.",
    )
    report.write()
    print(report.render())


if __name__ == "__main__":
    main()

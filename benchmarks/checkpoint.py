"""Checkpoint memory under DeepSpeed ZeRO-3, stock and accel-npu side by side in one run.

Two launches of the same worker (``accelerate launch``, N = 2 CPU ranks, gloo, ZeRO-3 bf16): stock
(``ACCEL_NPU_DISABLE=1``) and accel-npu. Memory is rank 0's RssAnon above its value just before the
operation, each operation after ``malloc_trim``.

1. Saving. ``save_state``: under DeepSpeed accelerate's own ``save_state`` already calls
   ``save_checkpoint`` on every rank (each writes its partition); accel-npu makes it atomic. Goal for
   ours: <= model/N + 10 %. ``save_model`` (all ranks): stock gathers the whole 16-bit model into
   rank 0; ours streams one output shard at a time. ``get_state_dict`` (all ranks) is listed for
   scale only: it is the gather itself (what stock ``save_model`` does), not a save.
2. Peak RssAnon of ``accel-npu consolidate`` (ZeRO-3 checkpoint, --max-shard-size S) vs
   ``zero_to_fp32`` without sharding, each above the same process baseline. Goal: <= 2 x S.
3. A frozen fp32 tower held by the trained model: resident tensors per rank, and rank 0's extra
   RssAnon while the tower runs a forward (stock: ZeRO-3 partitions it in bf16 and gathers it for
   each forward; ours keeps it whole, fp32, out of the engine).

Usage: python benchmarks/checkpoint.py [--layers 32] [--tower-layers 16] [--width 1024] [--shard-mb 20]
Writes benchmarks/results/checkpoint.md. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _proc import rss_anon
from _results import Report

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = (
    "plugins/checkpoints/",
    "plugins/frozen_towers/",
    "plugins/deepspeed/",
    "accel_npu/_torch/",
    "accel_npu/cli/",
)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MB = 1024 * 1024


class Peak:
    """Samples RssAnon of a process every few ms; ``extra`` = peak above the value at start."""

    def __init__(self, pid: int | str = "self", interval: float = 0.002):
        self.pid, self.interval = pid, interval

    def __enter__(self):
        self.start = rss_anon(self.pid)
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_anon(self.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        try:
            self.peak = max(self.peak, rss_anon(self.pid))
        except (FileNotFoundError, ProcessLookupError):
            pass

    @property
    def extra(self) -> int:
        return self.peak - self.start


def trim() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------
# the worker, started by `accelerate launch` on every rank (no accel_npu import, like a user)
def worker(a) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(a.hang_s, exit=True)  # a hung collective dies with its traceback
    import torch
    from accelerate import Accelerator

    class Tower(torch.nn.Module):
        def __init__(self, width, layers):
            super().__init__()
            self.config = {"kind": "frozen tower"}
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x.to(layer.weight.dtype))
            return x

    class Net(torch.nn.Module):
        def __init__(self, width, layers, tower_layers):
            super().__init__()
            self.transformer = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
            self.tower = Tower(width, tower_layers).requires_grad_(False)

        def forward(self, x):
            with torch.no_grad():
                cond = self.tower(x)
            dtype = self.transformer[0].weight.dtype
            return self.transformer((x + cond).to(dtype)).float().pow(2).mean()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = Net(a.width, a.layers, a.tower_layers)
    tower_params = list(model.tower.parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), batch_size=1)
    before_prepare = rss_anon()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    x = torch.randn(1, a.width)
    loss = model(x)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    trim()
    rank = accelerator.process_index

    def resident(p):
        t = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
        return t.numel() * t.element_size()

    rec = {
        "rank": rank,
        "rss_after_step": rss_anon(),
        "accelerate_num_processes": accelerator.num_processes,
        "rss_before_prepare": before_prepare,
        "tower_bytes": sum(resident(p) for p in tower_params),
        "tower_dtype": str(
            tower_params[0].ds_tensor.dtype if hasattr(tower_params[0], "ds_tensor") else tower_params[0].dtype
        ),
        "model_bf16_bytes": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()) * 2,
    }
    # the frozen tower's forward: stock gathers its ZeRO-3 partitions (bf16) for the call
    tower = getattr(model, "module", model).tower
    trim()
    with torch.no_grad(), Peak() as p:
        tower(x)
    rec["tower_forward_extra"] = p.extra
    # freed memory goes back to the OS before each measurement (glibc keeps it otherwise, and a
    # later allocation reusing it would not show in RssAnon)
    trim()
    with Peak() as p:
        sd = accelerator.get_state_dict(model)  # all ranks: the whole 16-bit model gathered into rank 0
    rec["get_state_dict_extra"] = p.extra
    del sd
    trim()
    with Peak() as p:
        accelerator.save_state(os.path.join(a.out, "ckpt"))
    rec["save_state_extra"] = p.extra
    trim()
    with Peak() as p:
        accelerator.save_model(model, os.path.join(a.out, "model"), max_shard_size=f"{a.shard_mb}MB")
    rec["save_model_extra"] = p.extra
    rec["ckpt_bytes"] = sum(f.stat().st_size for f in Path(a.out, "ckpt").rglob("*") if f.is_file())
    trim()
    sys.stdout.write("RESULT " + json.dumps(rec) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()
    accelerator.wait_for_everyone()


# ------------------------------------------------------------------------------------------
# the driver
def launch(a, tmp: Path, name: str, **env_extra) -> list[dict]:
    ds = {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": True},
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
    }
    d = tmp / name
    d.mkdir(parents=True)
    (d / "ds.json").write_text(json.dumps(ds))
    (d / "acc.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  deepspeed_config_file: {d / 'ds.json'}\n  zero3_init_flag: false\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nmain_training_function: main\nuse_cpu: false\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **env_extra)
    cmd = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(d / "acc.yaml"),
        "--main_process_port",
        str(_free_port()),
        __file__,
        "--worker",
        "--out",
        str(d),
        "--width",
        str(a.width),
        "--layers",
        str(a.layers),
        "--tower-layers",
        str(a.tower_layers),
        "--shard-mb",
        str(a.shard_mb),
        "--hang-s",
        str(a.hang_s),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    recs = [json.loads(line.split("RESULT ", 1)[1]) for line in (p.stdout + p.stderr).splitlines() if "RESULT " in line]
    if p.returncode != 0 or len(recs) != 2:
        sys.exit(f"benchmark launch {name} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    return sorted(recs, key=lambda r: r["rank"])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_of(code: str) -> int:
    """Peak RssAnon of `python -c code` above its own baseline (the value printed as BASE)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    while True:  # "BASE": imports done (DeepSpeed logs a line or two before)
        line = proc.stdout.readline()
        if not line or line.startswith("BASE"):
            break
    with Peak(proc.pid) as p:
        out, _ = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"consolidation run failed: {code}\n{out}")
    return p.peak - p.start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hang-s", type=float, default=900, help="a launch still running after this dies with a traceback")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32, help="trained Linear(width, width) layers")
    ap.add_argument("--tower-layers", type=int, default=16, help="frozen fp32 tower layers")
    ap.add_argument("--shard-mb", type=int, default=20)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    report = Report("checkpoint", "Checkpoint memory under DeepSpeed ZeRO-3: stock vs accel-npu", MEASURES)
    with tempfile.TemporaryDirectory(prefix="accel_npu_ckpt_bench_") as tmpdir:
        tmp = Path(tmpdir)
        stock = launch(a, tmp, "stock", ACCEL_NPU_DISABLE="1")
        # the synchronous save_state: in the background (accel-npu's default in launched ranks) each rank holds a
        # host copy of its own state instead, measured with the write by benchmarks/checkpoint_async.py
        ours = launch(a, tmp, "ours", ACCEL_NPU_ASYNC_CHECKPOINT="0")
        if not ours[0]["ckpt_bytes"]:
            sys.exit(f"the accel-npu launch left no checkpoint files in {tmp / 'ours' / 'ckpt'}")
        ckpt = tmp / "ours" / "ckpt"
        shard = a.shard_mb * MB
        base = (
            "import torch, deepspeed.utils.zero_to_fp32 as z, accel_npu.plugins.checkpoints.consolidate as c; "
            "print('BASE', flush=True); "
        )
        ours_peak = peak_of(
            base
            + f"c.consolidate({str(ckpt)!r}, {str(tmp / 'cons')!r}, max_shard_size='{a.shard_mb}MB', progress=False)"
        )
        z2f_peak = peak_of(
            base + f"z.convert_zero_checkpoint_to_state_dict({str(ckpt)!r}, {str(tmp / 'z2f')!r}, max_shard_size=None, "
            "safe_serialization=True)"
        )

    s0, o0 = stock[0], ours[0]
    model = o0["model_bf16_bytes"]
    n = len(ours)

    def extra(r, key):
        return f"{r[key] / MB:.1f} MB = {r[key] / model:.2f}× model"

    report.text(
        f"Model: {a.layers} trained `Linear({a.width}, {a.width})` (+bias; {model / MB:.1f} MB in bf16) and a "
        f"frozen fp32 tower of {a.tower_layers} `Linear({a.width}, {a.width})`; ZeRO-3 bf16, N = {n} CPU ranks "
        "(gloo), `accelerate launch`. Memory: rank 0's RssAnon above its value just before the operation, "
        "after `malloc_trim`. Stock = the same launch with `ACCEL_NPU_DISABLE=1`; accel-npu's `save_state` is its "
        "synchronous one (`ACCEL_NPU_ASYNC_CHECKPOINT=0`: in the background, its default in launched ranks, each "
        "rank holds a host copy of its own state, benchmarks/checkpoint_async.py). "
        f"accelerate's own view of the job: {s0['accelerate_num_processes']} process(es) stock, "
        f"{o0['accelerate_num_processes']} with accel-npu (stock accelerate does not see gloo ranks as a "
        "multi-process DeepSpeed job, while DeepSpeed itself partitions over all ranks: the stock column is "
        "what stock does on CPU ranks)."
    )
    report.table(
        ["operation (all ranks call it)", "stock", "accel-npu", "goal (accel-npu)"],
        [
            [
                "`save_state`",
                extra(s0, "save_state_extra"),
                extra(o0, "save_state_extra"),
                f"≤ model/N + 10 % = {1 / n + 0.1:.2f}× model",
            ],
            [f"`save_model`, {a.shard_mb} MB shards", extra(s0, "save_model_extra"), extra(o0, "save_model_extra"), ""],
            [
                "`get_state_dict` (the gather itself, for scale; not a save)",
                extra(s0, "get_state_dict_extra"),
                extra(o0, "get_state_dict_extra"),
                "",
            ],
        ],
        caption="1. Saving: rank 0's extra RssAnon",
    )
    report.table(
        ["tool", "peak above baseline", "goal"],
        [
            [
                f"`accel-npu consolidate`, {a.shard_mb} MB shards",
                f"{ours_peak / MB:.1f} MB = {ours_peak / shard:.2f}× shard",
                "≤ 2× shard",
            ],
            ["`zero_to_fp32`, unsharded", f"{z2f_peak / MB:.1f} MB = {z2f_peak / shard:.2f}× shard", ""],
        ],
        caption=f"2. Consolidating the accel-npu run's ZeRO-3 checkpoint ({o0['ckpt_bytes'] / MB:.1f} MB on disk)",
    )
    report.table(
        ["per rank", "stock", "accel-npu"],
        [
            [
                "resident tower tensors",
                f"{s0['tower_bytes'] / MB:.1f} MB ({s0['tower_dtype']})",
                f"{o0['tower_bytes'] / MB:.1f} MB ({o0['tower_dtype']})",
            ],
            [
                "rank 0 extra RssAnon during a tower forward",
                f"{s0['tower_forward_extra'] / MB:.1f} MB",
                f"{o0['tower_forward_extra'] / MB:.1f} MB",
            ],
            [
                "rank 0 RssAnon after one training step",
                f"{s0['rss_after_step'] / MB:,.0f} MB",
                f"{o0['rss_after_step'] / MB:,.0f} MB",
            ],
        ],
        caption="3. The frozen fp32 tower",
    )
    print(report.render())
    report.write()


if __name__ == "__main__":
    main()

"""Checkpoint memory under DeepSpeed ZeRO (issue 5). Prints a table.

1. Rank-0 extra RssAnon while saving under ZeRO-3 with N = 2 ranks (bf16): the sharded path
   (``save_state``: every rank writes its own partition) and ``save_model`` from all ranks
   (one output shard gathered at a time) vs stock ``get_state_dict`` (the whole 16-bit model
   gathered into rank 0). Goal: sharded <= model/N + 10 %.
2. Peak RssAnon of ``accel-npu consolidate`` (ZeRO-3 checkpoint, --max-shard-size S) vs
   ``zero_to_fp32`` without sharding, each above the same process baseline. Goal: <= 2 x S.
3. Per-rank memory of a frozen fp32 tower under ZeRO-3 with item 1 (kept out of the engine:
   whole, fp32) and without it (ACCEL_NPU_FROZEN_MODULES=none: DeepSpeed partitions and casts it).

Usage: python benchmarks/checkpoint.py [--layers 32] [--tower-layers 16] [--width 1024] [--shard-mb 20]
Runs real ``accelerate launch`` processes on CPU (gloo); a few minutes on 2 cores.
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

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MB = 1024 * 1024


def rss_anon(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


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

    rec = {"rank": rank, "rss_after_step": rss_anon(), "rss_before_prepare": before_prepare,
           "tower_bytes": sum(resident(p) for p in tower_params),
           "tower_dtype": str(tower_params[0].ds_tensor.dtype if hasattr(tower_params[0], "ds_tensor")
                              else tower_params[0].dtype),
           "model_bf16_bytes": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                   for p in model.parameters()) * 2}
    if a.measure_saves:
        # freed memory goes back to the OS before each measurement (glibc keeps it otherwise, and a
        # later allocation reusing it would not show in RssAnon)
        trim()
        with Peak() as p:
            sd = accelerator.get_state_dict(model)  # all ranks: the stock gather into rank 0
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
        trim()
    sys.stdout.write("RESULT " + json.dumps(rec) + "\n")  # one write: ranks share the pipe
    sys.stdout.flush()
    accelerator.wait_for_everyone()


# ------------------------------------------------------------------------------------------
# the driver
def launch(a, tmp: Path, name: str, measure_saves: bool, **env_extra) -> list[dict]:
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                "stage3_gather_16bit_weights_on_model_save": True},
          "bf16": {"enabled": True}, "train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
          "gradient_accumulation_steps": 1}
    d = tmp / name
    d.mkdir(parents=True)
    (d / "ds.json").write_text(json.dumps(ds))
    (d / "acc.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
        f"deepspeed_config:\n  deepspeed_config_file: {d / 'ds.json'}\n  zero3_init_flag: false\n"
        "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nmain_training_function: main\nuse_cpu: false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, **env_extra)
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(d / "acc.yaml"),
           "--main_process_port", str(_free_port()), __file__, "--worker",
           "--out", str(d), "--width", str(a.width), "--layers", str(a.layers), "--tower-layers",
           str(a.tower_layers), "--shard-mb", str(a.shard_mb)] + (["--measure-saves"] if measure_saves else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    recs = [json.loads(line.split("RESULT ", 1)[1]) for line in (p.stdout + p.stderr).splitlines()
            if "RESULT " in line]
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
    ap.add_argument("--measure-saves", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=32, help="trained Linear(width, width) layers")
    ap.add_argument("--tower-layers", type=int, default=16, help="frozen fp32 tower layers")
    ap.add_argument("--shard-mb", type=int, default=20)
    a = ap.parse_args()
    if a.worker:
        return worker(a)

    with tempfile.TemporaryDirectory(prefix="accel_npu_ckpt_bench_") as tmpdir:
        tmp = Path(tmpdir)
        ours = launch(a, tmp, "ours", measure_saves=True)
        stock_towers = launch(a, tmp, "no_item1", measure_saves=False, ACCEL_NPU_FROZEN_MODULES="none")
        ckpt = tmp / "ours" / "ckpt"
        shard = a.shard_mb * MB
        base = "import torch, deepspeed.utils.zero_to_fp32 as z, accel_npu.plugins.checkpoints.consolidate as c; print('BASE', flush=True); "
        ours_peak = peak_of(base + f"c.consolidate({str(ckpt)!r}, {str(tmp / 'cons')!r}, max_shard_size='{a.shard_mb}MB', progress=False)")
        z2f_peak = peak_of(base + f"z.convert_zero_checkpoint_to_state_dict({str(ckpt)!r}, {str(tmp / 'z2f')!r}, max_shard_size=None, safe_serialization=True)")

    r0 = ours[0]
    model = r0["model_bf16_bytes"]
    rows = [
        ("1. rank-0 extra RssAnon while saving, ZeRO-3, N=2", "", ""),
        ("   model (bf16, all ranks together)", f"{model / MB:8.1f} MB", ""),
        ("   save_state (sharded, atomic)", f"{r0['save_state_extra'] / MB:8.1f} MB",
         f"{r0['save_state_extra'] / model:5.2f} x model (goal <= {0.5 + 0.1:.2f})"),
        (f"   save_model, all ranks ({a.shard_mb} MB shards)", f"{r0['save_model_extra'] / MB:8.1f} MB",
         f"{r0['save_model_extra'] / model:5.2f} x model"),
        ("   stock get_state_dict gather", f"{r0['get_state_dict_extra'] / MB:8.1f} MB",
         f"{r0['get_state_dict_extra'] / model:5.2f} x model"),
        (f"2. consolidation peak above baseline, ZeRO-3 ckpt ({a.shard_mb} MB shards)", "", ""),
        ("   accel-npu consolidate", f"{ours_peak / MB:8.1f} MB", f"{ours_peak / shard:5.2f} x shard (goal <= 2)"),
        ("   zero_to_fp32, unsharded", f"{z2f_peak / MB:8.1f} MB", f"{z2f_peak / shard:5.2f} x shard"),
        ("3. frozen fp32 tower, per rank, ZeRO-3 N=2", "", ""),
    ]
    for label, recs in (("with item 1 (kept out of the engine)", ours),
                        ("without (ACCEL_NPU_FROZEN_MODULES=none)", stock_towers)):
        r = recs[0]
        rows.append((f"   {label}: resident tower tensors", f"{r['tower_bytes'] / MB:8.1f} MB",
                     f"{r['tower_dtype']}; rank RssAnon after 1 step {r['rss_after_step'] / MB:.0f} MB"))
    width = max(len(r[0]) for r in rows)
    print(f"params: trained {a.layers} x {a.width}^2 (+bias), frozen tower {a.tower_layers} x {a.width}^2 fp32")
    for label, value, note in rows:
        print(f"{label:<{width}}  {value:>11}  {note}")


if __name__ == "__main__":
    main()

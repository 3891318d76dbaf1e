"""Asynchronous save_state under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 (ACCEL_NPU_ASYNC_CHECKPOINT=1), against
the synchronous save_state and stock's, in one run.

One launch per shape (``accelerate launch``, N = 2 CPU ranks, gloo, fp32), a DiT-shaped model (a stack of
``nn.TransformerEncoderLayer`` over patch tokens with a timestep embedding; AdamW). Each launch measures, on
every rank: ``save_state`` synchronously (the time training is blocked: the whole write); ``save_state``
asynchronously (the time it blocks: the state dicts, the copies made at once, accelerate's small files) and the
time the next step waited for the copies made after it returned, followed by training steps, those begun while
a background write was in flight on any rank timed apart from those begun once every rank's had ended (the
baseline, in the same minutes); how long the background write took; and the CPU the copy thread (the deferred
copy of the state) and the writer thread (serialization, CRC-32, the file writes) ran for each save, each
thread's own account (``/proc/self/task/<tid>/schedstat``). Synchronous is accel-npu's atomic
save_state with the switch off; stock is a second
launch of the same worker with ``ACCEL_NPU_DISABLE=1``, synchronous saves only (ZeRO only: stock accelerate
trains an FSDP config as DDP on CPU ranks, docs/checkpoints.md).

Usage: python benchmarks/checkpoint_async.py [--dim 512] [--layers 6] [--saves 3] [--shapes zero2,zero3,fsdp2]
Writes benchmarks/results/checkpoint_async.md. About 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _results import Report

from tests.launch_utils import BIN, FSDP2_CPU_CONFIG, free_port, results, write_deepspeed_config

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("plugins/checkpoints/", "accel_npu/_torch/")


def worker(a) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from accel_npu.plugins.checkpoints import background

    if a.writer_nice is not None:  # a value to compare with the writer's own (background._WRITER_NICE)
        background._WRITER_NICE = a.writer_nice
    accelerator = Accelerator()
    set_seed(0)

    class DiT(torch.nn.Module):
        def __init__(self, dim, layers, patch=16, channels=4):
            super().__init__()
            self.embed = torch.nn.Linear(channels * patch, dim)
            self.time = torch.nn.Sequential(torch.nn.Linear(1, dim), torch.nn.SiLU(), torch.nn.Linear(dim, dim))
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(dim, 8, 4 * dim, batch_first=True, norm_first=True)
                for _ in range(layers)
            )
            self.out = torch.nn.Linear(dim, channels * patch)

        def forward(self, x, t):
            h = self.embed(x) + self.time(t)[:, None]
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    model = DiT(a.dim, a.layers)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(64, a.tokens, 64), torch.rand(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)
    position = [0]

    def step() -> float:
        x, t = batches[position[0] % len(batches)]
        position[0] += 1
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x, t), x)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    def thread_cpu(tid) -> float:
        """CPU seconds a thread of this process has run (schedstat's first field); 0 before it exists."""
        try:
            return int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0]) / 1e9
        except (OSError, TypeError):
            return 0.0

    for _ in range(3):
        step()
    quiet = [step() for _ in range(a.steps)]
    out = Path(a.out)
    sync_s, async_s, waited_s, during, after, write_s = [], [], [], [], [], []
    copy_cpu, write_cpu = [], []
    for i in range(a.saves):
        os.environ["ACCEL_NPU_ASYNC_CHECKPOINT"] = "0"
        accelerator.wait_for_everyone()
        started = time.perf_counter()
        accelerator.save_state(out / f"sync_{i}")
        sync_s.append(time.perf_counter() - started)
        if a.stock:
            step()
            continue
        os.environ["ACCEL_NPU_ASYNC_CHECKPOINT"] = "1"
        accelerator.wait_for_everyone()
        cpu = thread_cpu(background._copier.native_id), thread_cpu(background._writer.native_id)
        started = time.perf_counter()
        accelerator.save_state(out / f"async_{i}")
        returned = time.perf_counter()
        async_s.append(returned - started)
        pending = background._pending  # its waited_s: how long the next step waited for the copies
        # every rank takes the same number of steps (a rank whose write ended first must not stop early: the
        # other would wait alone in the next step's collectives); those begun while a write was in flight on any
        # rank are timed apart from those begun after every rank's had ended (the baseline, in the same minutes:
        # the machine's load drifts), and this rank's write took until the first step that began without it
        finished = None
        for _ in range(a.steps * 4):
            begun = time.perf_counter()
            mine = background._writer.jobs.unfinished_tasks > 0
            if mine is False and finished is None:
                finished = begun
            anyone = torch.tensor([float(mine)])
            torch.distributed.all_reduce(anyone, op=torch.distributed.ReduceOp.MAX)
            (during if anyone.item() else after).append(step())
        background.wait_for_pending()
        copy_cpu.append(thread_cpu(background._copier.native_id) - cpu[0])
        write_cpu.append(thread_cpu(background._writer.native_id) - cpu[1])
        waited_s.append(pending.waited_s if pending is not None else 0.0)
        write_s.append((finished if finished is not None else time.perf_counter()) - returned)
    accelerator.wait_for_everyone()
    files = sum(p.stat().st_size for p in (out / "sync_0").rglob("*") if p.is_file())
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": accelerator.process_index,
                "params": params,
                "checkpoint_bytes": files,
                "quiet": quiet,
                "sync": sync_s,
                "async": async_s,
                "waited": waited_s,
                "during": during,
                "after": after,
                "write": write_s,
                "copy_cpu": copy_cpu,
                "write_cpu": write_cpu,
            }
        ),
        flush=True,
    )
    accelerator.end_training()


def launch(a, tmp: Path, shape: str, stock: bool = False) -> list[dict]:
    d = tmp / (f"{shape}_stock" if stock else shape)
    if shape == "fsdp2":
        d.mkdir(parents=True)
        cfg = d / "fsdp2.yaml"
        cfg.write_text(json.dumps(FSDP2_CPU_CONFIG))  # YAML reads JSON
    else:
        ds = {
            "zero_optimization": {"stage": int(shape[-1]), "stage3_param_persistence_threshold": 0},
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
        }
        cfg = write_deepspeed_config(d, ds, "ds.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if stock:
        env["ACCEL_NPU_DISABLE"] = "1"
    args = ["--worker", "--out", str(d / "out"), "--dim", str(a.dim), "--layers", str(a.layers)]
    args += ["--tokens", str(a.tokens), "--saves", str(a.saves), "--steps", str(a.steps)]
    args += ["--stock"] if stock else []
    args += ["--writer-nice", str(a.writer_nice)] if a.writer_nice is not None else []
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(cfg)]
    cmd += ["--main_process_port", str(free_port()), __file__, *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    recs = results(p)
    if p.returncode != 0 or len(recs) != 2:
        sys.exit(f"benchmark launch {d.name} failed (exit {p.returncode}):\n{p.stderr[-4000:]}")
    shutil.rmtree(d / "out", ignore_errors=True)  # at the size a launch's checkpoints take ~20 GB of disk
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64, help="patch tokens per sample")
    ap.add_argument("--saves", type=int, default=3, help="saves of each kind")
    ap.add_argument("--steps", type=int, default=5, help="steps timed without a write in flight")
    ap.add_argument("--shapes", default="zero2,zero3,fsdp2", help="which of zero2, zero3, fsdp2 (comma-separated)")
    ap.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--writer-nice", type=int, default=None, help="the writer thread's nice value (default: accel-npu's own)"
    )
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    shapes = [x for x in a.shapes.split(",") if x]
    report = Report(
        "checkpoint_async", "Asynchronous save_state under DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 (2 CPU ranks)", MEASURES
    )
    rows, step_rows = [], []

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.0f} ms"

    with tempfile.TemporaryDirectory(prefix="accel_npu_async_bench_") as tmpdir:
        for shape in shapes:
            recs = launch(a, Path(tmpdir), shape)
            stock = launch(a, Path(tmpdir), shape, stock=True) if shape != "fsdp2" else None
            # a save blocks training until its slowest rank returns (and, asynchronously, until the next step
            # has waited for the copies); steps are the slower rank's
            sync = [max(r["sync"][i] for r in recs) for i in range(a.saves)]
            blocked = [max(r["async"][i] + r["waited"][i] for r in recs) for i in range(a.saves)]
            waited = [max(r["waited"][i] for r in recs) for i in range(a.saves)]
            write = [max(r["write"][i] for r in recs) for i in range(a.saves)]
            copy_cpu = [max(r["copy_cpu"][i] for r in recs) for i in range(a.saves)]
            write_cpu = [max(r["write_cpu"][i] for r in recs) for i in range(a.saves)]
            # both ranks classify each step alike (any rank's write in flight): the slower rank's time per step
            during = [max(vals) for vals in zip(*(r["during"] for r in recs))]
            after = [max(vals) for vals in zip(*(r["after"] for r in recs))]
            quiet = statistics.median(after or [max(vals) for vals in zip(*(r["quiet"] for r in recs))])
            params, size = recs[0]["params"], recs[0]["checkpoint_bytes"]
            s, b = statistics.median(sync), statistics.median(blocked)
            st = statistics.median(max(r["sync"][i] for r in stock) for i in range(a.saves)) if stock else None
            name = {"zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2"}[shape]
            rows.append(
                [
                    name,
                    f"{params / 1e6:.1f} M / {size / 2**20:.0f} MB",
                    ms(st) if st is not None else "n/a",
                    ms(s),
                    f"{ms(b)} ({ms(statistics.median(waited))})",
                    f"{st / b:.0f}×" if st is not None else "n/a",
                    f"{s / b:.0f}×",
                    ms(statistics.median(write)),
                    f"{ms(statistics.median(copy_cpu))} / {ms(statistics.median(write_cpu))}",
                ]
            )
            d = statistics.median(during) if during else float("nan")
            each = ", ".join(f"{x / quiet:.2f}" for x in during)  # in the order they ran, save after save
            step_rows.append([name, ms(quiet), ms(d), f"{d / quiet:.2f}×", each, f"{len(during)} / {len(after)}"])
    report.text(
        f"Model: DiT-shaped, {a.layers} `TransformerEncoderLayer({a.dim}, 8 heads, {4 * a.dim})` over {a.tokens} "
        f"patch tokens, fp32, AdamW; N = 2 CPU ranks (gloo), `accelerate launch`, {a.saves} saves of each kind per "
        "launch (medians; a save counts as long as its slower rank). Stock = `ACCEL_NPU_DISABLE=1`, a launch of its "
        "own (ZeRO only: stock trains an FSDP config as DDP on CPU ranks); synchronous = accel-npu's atomic "
        "save_state with ACCEL_NPU_ASYNC_CHECKPOINT=0; asynchronous = 1, blocked = save_state's return plus the "
        "next step's wait for the copies the writer makes (in brackets). The writer thread's nice value: "
        + (f"{a.writer_nice} (set by --writer-nice)" if a.writer_nice is not None else "accel-npu's own")
        + "."
    )
    report.table(
        [
            "shape",
            "parameters / checkpoint",
            "stock save_state",
            "sync save_state",
            "async: blocked (step's wait)",
            "less blocked than stock",
            "than sync",
            "write",
            "CPU: copy / write",
        ],
        rows,
        caption="1. Training blocked per save (write: the background write's duration after save_state returned; "
        "CPU: what the copy thread and the writer thread ran per save, the busier rank's, from "
        "/proc/self/task/<tid>/schedstat)",
    )
    report.table(
        [
            "shape",
            "step, no write",
            "step, write in flight",
            "ratio",
            "each step in flight",
            "steps in flight / without",
        ],
        step_rows,
        caption="2. Step time (slower rank's median) while a background write is in flight on any rank, against the "
        "steps of the same loops that began once every rank's write had ended; each step in flight: its time over "
        "the median without, in the order they ran (the first after each save_state makes the host copy)",
    )
    path = report.write()
    print(path.read_text())


if __name__ == "__main__":
    main()

"""An official diffusers script's step time with accel-npu active vs ``ACCEL_NPU_DISABLE=1`` (stock).

diffusers' ``examples/text_to_image/train_text_to_image.py`` (vendored byte for byte, run unchanged) trains a tiny
Stable Diffusion (tests/scripts/tiny_sd.py: random weights, the real classes) on one rank, ``accelerate launch
--num_processes 1``, at fp32 (``--mixed_precision no``) and bf16. Launches alternate active / stock, and which one
goes first alternates from pair to pair, so drift in machine load hits both halves alike.

What is measured, per launch, by this script and not by the training script: the wall-clock instant each step first
shows in the script's own tqdm progress bar (``| N/STEPS [``), read from the launch's output as it arrives; the step
time is (instant of the last step - instant of the first step after ``--warmup``) / the steps between, in wall
time and in the CPU time the launcher and its rank used (read from /proc through psutil at those instants). The launch's
whole wall time (interpreter start, imports, model load, training, final save) is reported beside it. The table gives
the median (min-max) over launches per half, the ratio of the medians, and the median (min-max) of each pair's ratio.

Both halves run the script through benchmarks/_torchvision_guard.py, which applies torchvision's own proposed guard
(pytorch/vision#9086) so that stock can import this machine's CUDA-built torchvision at all; the script runs unchanged.

Leaves out: multi-rank launches (the 2-rank official-script runs are the compatibility matrix's), NPU time (CPU
only here), and models of real size (a tiny UNet's step is short, so per-step overhead weighs more than it would).

Usage: python benchmarks/official_step_time.py [--launches 10] [--steps 40] [--warmup 10]
Writes benchmarks/results/official_step_time.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _results import Report, median_spread

from tests.launch_utils import BIN, RELEASE_EXAMPLES, SCRIPTS, base_env, free_port
from tests.official_scripts import StreamedLaunch
from tests.torchvision_site import with_torchvision

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = (
    "accel_npu/",
    "plugins/",
    "_accel_npu_startup.py",
    "third_party/diffusers-v0.40.0/examples/text_to_image/train_text_to_image.py",
    "tests/scripts/tiny_sd.py",
    "benchmarks/_torchvision_guard.py",
)

SCRIPT = RELEASE_EXAMPLES / "text_to_image" / "train_text_to_image.py"
# both halves run the script through this runner: it makes the registry's CUDA-built torchvision importable beside
# the CPU torch (read its docstring), and changes nothing else
GUARD = Path(__file__).resolve().parent / "_torchvision_guard.py"
HALVES = {"accel-npu": {}, "stock": {"ACCEL_NPU_DISABLE": "1"}}


def launch(work: Path, precision: str, steps: int, env: dict, out: Path) -> TimedLaunch:
    args = [
        str(BIN / "accelerate"),
        "launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--dynamo_backend",
        "no",
        "--mixed_precision",
        precision,
        "--main_process_port",
        str(free_port()),
        str(GUARD),
        str(SCRIPT),
        "--pretrained_model_name_or_path",
        str(work / "model"),
        "--train_data_dir",
        str(work / "data"),
        "--caption_column",
        "text",
        "--resolution",
        "32",
        "--train_batch_size",
        "2",
        "--max_train_steps",
        str(steps),
        "--learning_rate",
        "1e-4",
        "--seed",
        "0",
        "--output_dir",
        str(out),
        "--dataloader_num_workers",
        "0",
        "--checkpointing_steps",
        str(steps * 10),
    ]
    return TimedLaunch(args, env, work, steps, out)


class TimedLaunch(StreamedLaunch):
    """A launch whose progress-bar steps are stamped with the wall clock and with the CPU time (user + system) the
    launcher and its rank have used so far: CPU time per step does not grow when other jobs share the machine."""

    def __init__(self, *args, **kwargs):
        self.cpu_seen: dict[int, float] = {}
        super().__init__(*args, **kwargs)

    def first_seen(self, step: int) -> None:
        import psutil

        super().first_seen(step)
        self.cpu_seen[step] = tree_cpu_seconds(psutil, self.proc.pid)


def tree_cpu_seconds(psutil, pid: int) -> float:
    try:
        root = psutil.Process(pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
    except psutil.NoSuchProcess:
        return float("nan")


def per_step(run: TimedLaunch, warmup: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) per step, from the first step shown after ``warmup`` to the last."""
    seen = sorted(n for n in run.step_seen if n >= warmup)
    if len(seen) < 2 or seen[-1] != run.steps:
        raise RuntimeError(f"the progress bar did not show steps {warmup}..{run.steps}:\n{run.explain()}")
    first, last = seen[0], seen[-1]
    steps = last - first
    return (run.step_seen[last] - run.step_seen[first]) / steps, (run.cpu_seen[last] - run.cpu_seen[first]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=10, help="launches per half and precision")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the step time")
    parser.add_argument("--precisions", default="no,bf16")
    args = parser.parse_args()
    report = Report("official_step_time", __doc__.split("\n")[0].rstrip("."), MEASURES)  # before measuring
    with tempfile.TemporaryDirectory(prefix="official-step-time-") as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, str(SCRIPTS / "tiny_sd.py"), str(work / "model"), str(work / "data")],
            check=True,
            capture_output=True,
            env=base_env(),
        )
        env = with_torchvision(base_env(HF_DATASETS_CACHE=str(work / "datasets-cache")))
        rows = []
        for precision in args.precisions.split(","):
            step = {half: [] for half in HALVES}
            cpu = {half: [] for half in HALVES}
            wall = {half: [] for half in HALVES}
            for i in range(args.launches):
                order = list(HALVES) if i % 2 == 0 else list(HALVES)[::-1]
                for half in order:
                    run = launch(work, precision, args.steps, dict(env, **HALVES[half]), work / f"out-{half}-{i}")
                    run.wait(1800)
                    if run.returncode != 0:
                        raise RuntimeError(f"{half} {precision} launch {i}: {run.explain()}")
                    wall_step, cpu_step = per_step(run, args.warmup)
                    step[half].append(wall_step)
                    cpu[half].append(cpu_step)
                    wall[half].append(run.seconds)
                    print(
                        f"{precision} {i} {half}: {wall_step * 1e3:.1f} ms/step, {cpu_step * 1e3:.1f} ms CPU/step, "
                        f"launch {run.seconds:.1f} s",
                        flush=True,
                    )
            for label, values in (("wall", step), ("CPU", cpu)):
                ratios = [a / s for a, s in zip(values["accel-npu"], values["stock"])]
                rows.append(
                    [
                        "fp32" if precision == "no" else precision,
                        label,
                        median_spread([s * 1e3 for s in values["stock"]], "{:.1f}"),
                        median_spread([s * 1e3 for s in values["accel-npu"]], "{:.1f}"),
                        f"{statistics.median(values['accel-npu']) / statistics.median(values['stock']):.3f}",
                        median_spread(ratios, "{:.3f}"),
                    ]
                )
            rows.append(
                [
                    "fp32" if precision == "no" else precision,
                    "whole launch, s",
                    median_spread(wall["stock"], "{:.1f}"),
                    median_spread(wall["accel-npu"], "{:.1f}"),
                    f"{statistics.median(wall['accel-npu']) / statistics.median(wall['stock']):.3f}",
                    "",
                ]
            )
    report.table(
        [
            "precision",
            "measure",
            "stock ms/step",
            "accel-npu ms/step",
            "ratio of medians",
            "pair ratios",
        ],
        rows,
    )
    report.text(
        "wall: from the first step after the warm-up to the last, as each first showed in the script's own progress "
        "bar. CPU: the CPU time (user + system) the launcher and its rank used over the same steps, read from the "
        "processes (psutil) at those instants: it does not grow when other jobs share the machine. Whole launch: "
        "interpreter start to exit, in seconds. Goal: ratio <= 1.01."
    )
    print(report.render())
    report.write()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""2 ranks train with the loss of 1 rank, full variant: 2-rank DDP vs 1 rank, 100 steps.

A Qwen-Image-shaped DiT (real QwenImageTransformer2DModel, reduced width), 6-block bf16
checkpoint; the unchanged script (tests/scripts/train_qwen_truncated.py) loads it without
torch_dtype and keeps 2 blocks; ACCEL_NPU_TRUNCATE=QwenImageTransformer2DModel:2 makes the
load read only those. Same global batch and seed for both runs. Prints the loss curve every
10 steps and asserts mean |loss2 - loss1| < 5e-3.

Usage: python benchmarks/loss_equality.py [--steps 100]
Writes benchmarks/results/loss_equality.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))

#: the code this benchmark measures besides itself (tests/test_docs_figures.py: a later change makes the results stale)
MEASURES = ("accel_npu/", "plugins/", "tests/scripts/train_qwen_truncated.py")


def main(argv=None) -> int:
    import tiny_models as tm
    import torch

    from tests.launch_utils import SCRIPTS, accelerate_launch, base_env, explain, results

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args(argv)
    from _results import Report

    report = Report("loss_equality", "Loss equality: 2-rank DDP vs 1 rank, same global batch", MEASURES)
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "qwen6"
        tm.randomize(tm.qwen(num_layers=6)).to(torch.bfloat16).save_pretrained(str(ckpt), max_shard_size="60KB")
        losses = {}
        for n in (1, 2):
            proc = accelerate_launch(
                [
                    "--num_processes",
                    str(n),
                    "--num_machines",
                    "1",
                    "--mixed_precision",
                    "no",
                    "--dynamo_backend",
                    "no",
                    str(SCRIPTS / "train_qwen_truncated.py"),
                    str(ckpt),
                    "--steps",
                    str(a.steps),
                ],
                env=base_env(ACCEL_NPU_TRUNCATE="QwenImageTransformer2DModel:2"),
                timeout=1800,
            )
            if proc.returncode != 0:
                print(explain(proc))
                return 1
            losses[n] = results(proc)[0]["losses"]
    one, two = losses[1], losses[2]
    print(f"{a.steps} Step Loss Curve (1 rank | 2 ranks):")
    for i in range(9, a.steps, 10):
        print(f"Step {i + 1}: loss={one[i]:.4f} | {two[i]:.4f}")
    diff = sum(abs(x - y) for x, y in zip(one, two)) / len(one)
    print(f"mean |loss2 - loss1| over {a.steps} steps = {diff:.2e} (goal < 5e-3)")
    report.text(
        f"The scaled-down Qwen-Image DiT (6-block bf16 QwenImage checkpoint, 2 kept via "
        f"ACCEL_NPU_TRUNCATE, loaded without torch_dtype), {a.steps} steps, CPU (gloo). "
        f"Mean |loss(2 ranks) - loss(1 rank)| over {a.steps} steps = {diff:.1e} (goal < 5e-3)."
    )
    report.table(
        ["step", "loss, 1 rank", "loss, 2 ranks"],
        [[str(i + 1), f"{one[i]:.4f}", f"{two[i]:.4f}"] for i in range(9, a.steps, 10)],
    )
    report.write()
    assert diff < 5e-3
    return 0


if __name__ == "__main__":
    sys.exit(main())

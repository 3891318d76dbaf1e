"""Every shell block of docs/quickstart.md, executed in order as a user would (docs that rot are defects).

The blocks run from a scratch copy of the repository root (every top-level entry symlinked),
so their `outputs/` never touch the tree. One substitution: `pip install` runs as
`pip install --dry-run --no-index --no-build-isolation` — the test environment is already
installed from this tree, and a real reinstall would pull the package out from under
everyone else using the same environment; the dry run still checks that the line resolves.

The README's first command is the same `accelerate launch` line without `--max_steps`.
"""

import json
import os
import re
import subprocess

import pytest

from tests.launch_utils import BIN, REPO, base_env

QUICKSTART = REPO / "docs" / "quickstart.md"
SKIP_TOP_LEVEL = {".git", ".venv", ".ci-venv", "outputs", "out", "tmp", ".pytest_cache", "build", "dist"}


def shell_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", QUICKSTART.read_text(), flags=re.S | re.M)


def scratch_root(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in SKIP_TOP_LEVEL and not entry.name.endswith(".egg-info"):
            (root / entry.name).symlink_to(entry)
    return root


def run_block(block: str, cwd, env) -> subprocess.CompletedProcess:
    block = re.sub(r"\bpip install\b", "pip install --dry-run --no-index --no-build-isolation", block)
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_quickstart_has_the_readme_command():
    blocks = shell_blocks()
    assert len(blocks) >= 6
    assert any(
        b.startswith(
            "accelerate launch --config_file launch_configs/cpu_zero3.yaml docs/examples/train_dit.py --max_steps "
        )
        for b in blocks
    )
    assert (
        "accelerate launch --config_file launch_configs/cpu_zero3.yaml docs/examples/train_dit.py"
        in (REPO / "README.md").read_text()
    )


@pytest.mark.slow
def test_every_quickstart_block_runs(tmp_path):
    root = scratch_root(tmp_path)
    env = base_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    outputs = {}
    for block in shell_blocks():
        proc = run_block(block, root, env)
        assert proc.returncode == 0, (
            f"quickstart block failed:\n{block}\nexit {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-5000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
        )
        outputs[block.strip()] = proc.stdout + proc.stderr

    def output_of(fragment: str) -> str:
        return next(out for cmd, out in outputs.items() if fragment in cmd)

    env_out = output_of("accel-npu env")
    assert re.search(r"^  name\s+cpu$", env_out, re.M) and re.search(r"^  precision\s+loaded ", env_out, re.M)

    # First training run: builds the tiny models, trains 12 steps on 2 ranks, reports as documented.
    first = output_of("--max_steps 12")
    assert "Building the tiny qwen-image models into outputs/tiny-models/qwen-image (first run)" in first
    # ZeRO-3 with zero3_init_flag: the DiT loads straight into partitions (the frozen VAE too; it is
    # rebuilt whole, fp32, when it is kept out of the engine at prepare: the "frozen towers" line)
    assert (
        "accel-npu: QwenImageTransformer2DModel loaded into ZeRO-3 partitions (zero3_init_flag, bfloat16) "
        "over 2 ranks: rank 0 read" in first
    )
    assert (
        "qwen-image: 0.09M trainable + 0.47M frozen parameters, 2 process(es), DistributedType.DEEPSPEED, "
        "steps 0 -> 12" in first
    )
    assert "frozen towers: vae float32, text_encoder float32" in first
    assert "accel-npu: torch.autocast('cuda', dtype=bfloat16) runs as torch.autocast('cpu', dtype=bfloat16)" in first
    assert "train: 100%|██████████| 12/12" in first  # the live progress bar
    assert re.search(r"Loss table\n  step \|      loss \|  eval mse \|  s/step\n-+\+", first)
    assert re.search(r"^\s+12 \| +\d+\.\d{4} \| +\d+\.\d{4} \|", first, re.M)  # last row has the eval metric

    out = root / "outputs" / "train_dit"
    ls = output_of("ls outputs/train_dit")
    for name in ("checkpoint-12", "loss_curve.png", "loss_history.json", "transformer"):
        assert name in ls
    png = (out / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000

    assert re.search(r"^QwenImageTransformer2DModel \d+ parameters$", output_of("from_pretrained"), re.M)
    assert "transformer" in output_of("accel-npu consolidate")
    assert (root / "outputs" / "consolidated" / "transformer" / "config.json").is_file()

    # Second run: resumes from checkpoint-12 instead of starting over, reuses the cached models.
    second = output_of("--max_steps 16")
    assert "Resuming from outputs/train_dit/checkpoints/checkpoint-12 (step 12)" in second
    assert "steps 12 -> 16" in second and "Building the tiny" not in second
    history = json.loads((out / "loss_history.json").read_text())
    steps = [r["step"] for r in history]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 16 and 12 in steps
    losses = [r["loss"] for r in history]
    assert losses[-1] < losses[0] * 0.9, losses  # it learns
    assert sorted(os.listdir(out / "checkpoints")) == ["checkpoint-12", "checkpoint-16"]

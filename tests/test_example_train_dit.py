"""docs/examples/train_dit.py: an unchanged CUDA-style script, its Cosmos variant, --model_path, and
what stock accelerate/DeepSpeed make of the README's first command.

The README command itself (2 ranks, ZeRO-3, loss table, PNG, transformer/, resume) runs in
tests/test_docs_quickstart.py, through the quickstart page.
"""

import ast
import re
import subprocess
import sys

import pytest

from tests.launch_utils import REPO, accelerate_launch, base_env

SCRIPT = REPO / "docs" / "examples" / "train_dit.py"
README_ARGS = ["--config_file", "launch_configs/cpu_zero3.yaml", "docs/examples/train_dit.py"]


def test_script_is_a_plain_cuda_style_script():
    source = SCRIPT.read_text()
    tree = ast.parse(source)
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "accel_npu" not in imported and "torch_npu" not in imported
    code = "\n".join(l for l in source.splitlines() if not l.lstrip().startswith("#"))
    body = code.split('"""', 2)[-1]  # after the module docstring
    for device_branch in (
        r"is_available\(",
        r"\bnpu\b",
        r"device_type\s*==",
        r"\.cuda\(",
        r"[\"']cpu[\"']",
        "ACCEL_NPU",
    ):
        assert not re.search(device_branch, body), device_branch
    # ... and it is CUDA-written: the very lines a port to NPU by hand would edit are there.
    assert 'torch.autocast("cuda", dtype=torch.bfloat16)' in source
    assert "fused=True" in source and "@torch.inference_mode()" in source and "pred.cpu().numpy()" in source
    assert "accelerator.save_state(" in source and "accelerator.load_state(" in source


def run_script(args, tmp_path, **env):
    """Plain `python train.py`: no launcher, so the CUDA façade family is opted in, as docs/cuda-compat.md
    tells a user debugging a CUDA-written script without one."""
    env.setdefault("ACCEL_NPU_CUDA_FACADE", "1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_cosmos_variant_single_process_then_model_path_and_resume(tmp_path):
    common = [
        "--model_type",
        "cosmos",
        "--output_dir",
        "run",
        "--checkpointing_steps",
        "2",
        "--eval_steps",
        "2",
        "--log_steps",
        "1",
    ]
    first = run_script([*common, "--cache_dir", "cache", "--max_steps", "3"], tmp_path)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-5000:]
    assert "Building the tiny cosmos models into cache/cosmos (first run)" in out
    assert "cosmos: 0.05M trainable + 0.47M frozen parameters, 1 process(es), DistributedType.NO, steps 0 -> 3" in out
    # Plain `python train.py` on CPU, opted in: autocast('cuda') really runs bf16, so eval's .numpy() sees bf16.
    assert "runs as torch.autocast('cpu', dtype=bfloat16)" in out
    assert ".numpy() on a bfloat16 tensor returns a float32 array" in out
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-3"]

    # --model_path: the directory the first run built is a pipeline-style checkpoint like any other.
    second = run_script([*common, "--model_path", str(tmp_path / "cache" / "cosmos"), "--max_steps", "5"], tmp_path)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2[-5000:]
    assert "Resuming from run/checkpoints/checkpoint-3 (step 3)" in out2 and "steps 3 -> 5" in out2
    assert "Building the tiny" not in out2

    from diffusers import CosmosTransformer3DModel

    trained = CosmosTransformer3DModel.from_pretrained(tmp_path / "run" / "transformer")
    assert trained.config.num_layers == 2 and trained.config.text_embed_dim == 32


@pytest.mark.slow
def test_readme_command_stock_does_not_start(tmp_path):
    """Stock accelerate + DeepSpeed, the README command as written (shortened)."""
    proc = accelerate_launch(
        [*README_ARGS, "--max_steps", "2", "--output_dir", str(tmp_path / "stock")],
        env=base_env(ACCEL_NPU_DISABLE="1"),
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Expected a string path to an existing deepspeed config" in out and "cpu_zero3.deepspeed.json" in out
    assert "Loss table" not in out


@pytest.mark.slow
def test_without_the_precision_plugin_autocast_cuda_is_off_and_the_first_step_fails(tmp_path):
    """Only the precision plugin blocked: torch disables autocast('cuda'); fp32 activations meet bf16 weights."""
    proc = accelerate_launch(
        [
            *README_ARGS,
            "--max_steps",
            "2",
            "--output_dir",
            str(tmp_path / "run"),
            "--cache_dir",
            str(tmp_path / "cache"),
        ],
        env=base_env(ACCEL_NPU_DISABLED_PLUGINS="precision"),
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "CUDA is not available or torch_xla is imported. Disabling autocast." in out  # torch's own warning
    assert "expected m1 and m2 to have the same dtype, but got: float != c10::BFloat16" in out
    assert "Loss table" not in out

"""Plain DDP on a DiT with structurally unused parameters.

QwenImageTransformer2DModel's last block computes a text stream nothing reads. Stock DDP (the
default find_unused_parameters=False) dies at step 2; with accel-npu it trains unchanged, and two
ranks end where one process ends.
"""

import sys

import pytest
import torch

from tests.launch_utils import accelerate_launch, base_env, explain, results

SCRIPT = "tests/scripts/ddp_unused_params.py"
PATCH = "torch.nn.parallel.distributed:DistributedDataParallel.__init__"
UNUSED = {
    "transformer_blocks.1.attn.to_add_out.weight",
    "transformer_blocks.1.attn.to_add_out.bias",
    "transformer_blocks.1.txt_mlp.net.0.proj.weight",
    "transformer_blocks.1.txt_mlp.net.0.proj.bias",
    "transformer_blocks.1.txt_mlp.net.2.weight",
    "transformer_blocks.1.txt_mlp.net.2.bias",
}


@pytest.mark.slow
def test_ddp_trains_a_dit_with_unused_parameters_like_one_process(tmp_path):
    import subprocess

    # Stock DDP with the rest of accel-npu on (fully stock accelerate starts one process on CPU).
    stock = accelerate_launch(
        ["--num_processes", "2", SCRIPT, "--steps", "3", "--out", str(tmp_path / "stock.pt")],
        env=base_env(ACCEL_NPU_DISABLED_PATCHES=PATCH),
        timeout=300,
    )
    assert stock.returncode != 0 and not results(stock), explain(stock)
    assert "Expected to have finished reduction in the prior iteration" in stock.stderr, explain(stock)

    ours = accelerate_launch(["--num_processes", "2", SCRIPT, "--out", str(tmp_path / "ddp.pt")])
    ranks = results(ours)
    assert ours.returncode == 0 and [r["world"] for r in ranks] == [2, 2], explain(ours)
    lines = [l for l in ours.stderr.splitlines() if "accel-npu: DDP:" in l]
    assert len(lines) == 2 and "6 parameter(s) of QwenImageTransformer2DModel" in lines[0], explain(ours)

    one = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path / "one.pt")],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    [single] = results(one)
    assert one.returncode == 0 and single["world"] == 1 and single["steps"] == 100, explain(one)
    # the unused parameters keep no gradient on two ranks, as on one
    assert set(single["no_grad"]) == UNUSED and all(set(r["no_grad"]) == UNUSED for r in ranks)

    ddp, reference = torch.load(tmp_path / "ddp.pt"), torch.load(tmp_path / "one.pt")
    assert ddp.keys() == reference.keys()
    worst = max((ddp[k] - reference[k]).abs().max().item() for k in reference)
    assert worst < 1e-5, worst
    moved = max((ddp[k] - reference[k]).abs().max().item() for k in reference if k in UNUSED)
    assert moved == 0.0  # never updated on either side

"""Ulysses sequence parallelism under FSDP2 (plugins/sequence_parallel/fsdp2.py, docs/sequence-parallel.md).

The fact it builds on, torch's (tests/scripts/fsdp2_gradient_reduction.py never imports accel_npu), on 2 gloo
ranks: ``fully_shard`` averages gradients over its ranks, where the ranks of one sequence-parallel group must sum
their partial gradients: the gather's backward sums the output's gradient over the group first. Launched (slow):
diffusers v0.40.0's train_dreambooth_lora_flux2.py, unchanged, fp32 FSDP2, sp=2 on 2 ranks against 1 rank, with the
witnesses of tests/test_sequence_parallel.py (tests/sp_witness); a Flux transformer and an action head trained on
its gathered output, one model (tests/scripts/sp_action_head.py --together); each with the negative, diffusers'
gather backward as upstream has it (FSDP2's own mean alone)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.launch_utils import (
    OFFICIAL_EXAMPLES,
    REPO,
    SCRIPTS,
    accelerate_launch,
    base_env,
    explain,
    run_concurrently,
    torchrun_launch,
)

sys.path.insert(0, str(SCRIPTS))

WITNESS = REPO / "tests" / "sp_witness"
#: the patches that sum the gathered output's gradient over the SP group (plugins/sequence_parallel/loss_average.py)
GATHER_PATCHES = ",".join(
    f"diffusers.hooks.context_parallel:{name}.backward" for name in ("AllGatherFunction", "AllGatherAnythingFunction")
)


@pytest.mark.slow
def test_fsdp2_averages_gradients_over_its_ranks_and_sums_them_with_a_divide_factor_of_one():
    proc = torchrun_launch([str(SCRIPTS / "fsdp2_gradient_reduction.py")], env=base_env(ACCEL_NPU_DISABLE="1"))
    assert proc.returncode == 0, explain(proc)
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("REDUCED ")]
    reduced = json.loads(line.split(" ", 1)[1])
    assert reduced["world"] == 2
    assert abs(reduced["default"] - 1 / 2) < 1e-6, reduced  # the mean: half of an SP group's summed gradient
    assert abs(reduced["divide_by_1_sum_only"] - 1) < 1e-6, reduced


def test_a_model_that_is_not_a_diffusers_one_is_refused_under_fsdp2_before_it_is_sharded():
    """Under FSDP2 only a diffusers model is split (accelerate's ALST runs under DeepSpeed only): any other model
    with sp_size > 1 is refused before accelerate's _prepare_fsdp2 runs; without sp, or without a model, it runs."""
    from types import SimpleNamespace

    import torch

    from accel_npu.errors import ConfigError
    from accel_npu.plugins.sequence_parallel.fsdp2 import prepare_fsdp2

    called = []

    def upstream(*args, **kwargs):
        called.append(args)
        return args

    model, loader = torch.nn.Linear(2, 2), [1, 2]
    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=2))
    with pytest.raises(ConfigError, match="under FSDP2 splits diffusers models; Linear is not one"):
        prepare_fsdp2(upstream, accelerator, (model, loader), {})
    assert called == []
    prepare_fsdp2(upstream, accelerator, (loader,), {})  # no model in this call: nothing to split
    prepare_fsdp2(upstream, SimpleNamespace(parallelism_config=SimpleNamespace(sp_size=1)), (model,), {})
    assert len(called) == 2


# ------------------------------------------------------------------------------------------------
# launched: diffusers v0.40.0's train_dreambooth_lora_flux2.py (it handles FSDP), unchanged, fp32 FSDP2
# ------------------------------------------------------------------------------------------------
FLUX2 = OFFICIAL_EXAMPLES / "dreambooth" / "train_dreambooth_lora_flux2.py"
STEPS = 4


def _fsdp2_config(directory: Path, processes: int, sp: int | None = None) -> Path:
    """An accelerate FSDP2 YAML (tools/compatibility.py's FSDP2_CONFIG at fp32), with parallelism_config at ``sp``."""
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        },
        "mixed_precision": "no",
        "num_machines": 1,
        "num_processes": processes,
        "machine_rank": 0,
        "use_cpu": False,
    }
    if sp:
        cfg["parallelism_config"] = {"parallelism_config_sp_size": sp}
    path = directory / f"fsdp2_n{processes}{f'_sp{sp}' if sp else ''}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _flux2_args(pipe: Path, images: Path, out: Path) -> list[str]:
    return [
        str(FLUX2),
        *("--pretrained_model_name_or_path", str(pipe), "--instance_data_dir", str(images)),
        *("--instance_prompt", "a photo of sks dog", "--output_dir", str(out), "--resolution", "16"),
        *("--train_batch_size", "1", "--max_train_steps", str(STEPS), "--rank", "4", "--max_sequence_length", "16"),
        *("--seed", "0", "--learning_rate", "1e-2", "--report_to", "tensorboard", "--checkpointing_steps", "100"),
    ]


@pytest.fixture(scope="module")
def flux2_runs(tmp_path_factory):
    """{name: (CompletedProcess, output dir, witness records per rank)}: sp=2 on 2 ranks, the same global batch on
    1 rank, and sp=2 with diffusers' gather backward as upstream has it (FSDP2's own mean alone)."""
    import subprocess

    from tests.torchvision_site import with_torchvision

    root = tmp_path_factory.mktemp("sequence_parallel_fsdp2")
    # built in a process of its own: Flux2's PixtralProcessor needs torchvision, which the test venv may lack
    build = (
        "import tiny_flux2 as t; "
        f"t.flux2_pipeline({str(root / 'flux2')!r}); t.dreambooth_images({str(root / 'images')!r})"
    )
    built = subprocess.run(
        [sys.executable, "-c", build],
        env=with_torchvision(base_env()),
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    one, two_sp = _fsdp2_config(root, 1), _fsdp2_config(root, 2, sp=2)
    plans = {
        "sp2": (two_sp, {}),
        "sp1": (one, {}),
        "sp2_averaging": (two_sp, {"ACCEL_NPU_DISABLED_PATCHES": GATHER_PATCHES}),
    }

    def launch(name):
        config, extra = plans[name]
        out, witness = root / name, root / f"{name}_witness"
        out.mkdir()
        witness.mkdir()
        env = with_torchvision(base_env(SP_WITNESS_DIR=str(witness), **extra))
        env["PYTHONPATH"] = f"{WITNESS}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(WITNESS)
        args = ["--config_file", str(config), *_flux2_args(root / "flux2", root / "images", out)]
        proc = accelerate_launch(args, env=env, timeout=900, cwd=root)
        return proc, out, [json.loads(p.read_text()) for p in sorted(witness.glob("rank*.json"))]

    names = list(plans)
    return dict(zip(names, run_concurrently(*[lambda n=n: launch(n) for n in names])))


def _attention(record: dict) -> set[tuple[int, int]]:
    """(heads, tokens) of the SDPA calls with the transformer's head_dim 16."""
    return {(shape[1], shape[2]) for shape in record["sdpa"] if shape[-1] == 16}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_flux2_lora_sp2_under_fsdp2_trains_as_one_rank_with_the_same_global_batch(flux2_runs):
    """diffusers v0.40.0's train_dreambooth_lora_flux2.py, unchanged, fp32 FSDP2 (each transformer block its own
    fully_shard group), ``parallelism_config_sp_size: 2`` on 2 ranks against 1 rank: the split is seen by torch's
    SDPA and all_to_all; the loss at every step, the squared gradient norm (summed over the two ranks' shards) and
    the LoRA after 4 steps are the one rank's. With the gather's backward as upstream has it (FSDP2's own mean
    alone), the gradient is half."""
    import torch

    from tests.test_sequence_parallel import _lora, _losses

    sp2, sp1, averaging = flux2_runs["sp2"], flux2_runs["sp1"], flux2_runs["sp2_averaging"]
    for proc, _, _ in (sp2, sp1, averaging):
        assert proc.returncode == 0, explain(proc)
    # Flux2: 16 text + 64 image tokens, 2 heads, 1 double + 1 single block
    (w1,), (r0, r1) = sp1[2], sp2[2]
    assert (2, 80) in _attention(w1) and (1, 80) not in _attention(w1) and w1["all_to_all"] == []
    for rank in (r0, r1):
        assert (1, 80) in _attention(rank) and (2, 80) not in _attention(rank)
        # q, k, v and the output, forward and backward, per attention (2) per step
        assert len(rank["all_to_all"]) == 8 * 2 * STEPS
        assert {tuple(a) for a in rank["all_to_all"]} == {(2, 40 * 2 * 16)}
    loss1, loss2 = _losses(sp1[1]), _losses(sp2[1])
    assert sorted(loss1) == sorted(loss2) == list(range(1, STEPS + 1))
    assert all(abs(loss1[step] - loss2[step]) <= 1e-5 for step in loss1), (loss1, loss2)
    assert len(w1["grad_sq"]) == STEPS
    for step, (g0, g1, g) in enumerate(zip(r0["grad_sq"], r1["grad_sq"], w1["grad_sq"])):
        assert g0 > 0 and g1 > 0 and abs(g0 + g1 - g) <= 1e-5 * g, (step, g0, g1, g)
    lora1, lora2 = _lora(sp1[1]), _lora(sp2[1])
    assert lora1.keys() == lora2.keys() and len(lora1) > 0
    assert max((lora1[k] - lora2[k]).abs().max().item() for k in lora1) <= 1e-4
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in lora2.items())
    assert all(v.dtype == torch.float32 for v in lora2.values())

    # the negative: the same split, the gather's gradient not summed: fully_shard's mean over both ranks halves the
    # group's summed gradient, a quarter of the squared norm at step 1
    a0, a1 = averaging[2]
    assert (1, 80) in _attention(a0) and len(a0["all_to_all"]) == 8 * 2 * STEPS
    g = w1["grad_sq"][0]
    assert abs(a0["grad_sq"][0] + a1["grad_sq"][0] - g / 4) <= 1e-5 * g, (a0["grad_sq"], a1["grad_sq"], g)
    # Adam's step barely depends on the gradient's scale (measured: 6.8e-4 apart), yet out of the proof's 1e-4
    lora_avg = _lora(averaging[1])
    assert max((lora1[k] - lora_avg[k]).abs().max().item() for k in lora1) > 1e-4


@pytest.fixture(scope="module")
def head_runs(tmp_path_factory):
    """{name: CompletedProcess}: tests/scripts/sp_action_head.py --together (the transformer and its action head one
    model) under fp32 FSDP2, sp=2 on 2 ranks, 1 rank, and sp=2 with the gather's backward as upstream has it."""
    root = tmp_path_factory.mktemp("sequence_parallel_fsdp2_head")
    one, two_sp = _fsdp2_config(root, 1), _fsdp2_config(root, 2, sp=2)
    plans = {"sp2": (two_sp, {}), "sp1": (one, {}), "sliced": (two_sp, {"ACCEL_NPU_DISABLED_PATCHES": GATHER_PATCHES})}

    def launch(name):
        config, extra = plans[name]
        args = ["--config_file", str(config), str(SCRIPTS / "sp_action_head.py"), "--together"]
        return accelerate_launch(args, env=base_env(**extra), timeout=600, cwd=root)

    names = list(plans)
    return dict(zip(names, run_concurrently(*[lambda n=n: launch(n) for n in names])))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_module_trained_on_the_gathered_output_gets_the_gradient_of_one_rank_under_fsdp2(head_runs):
    """A Flux transformer and an action head reading its gathered output, one model (FSDP2 prepares one), one
    AdamW whose eps is far above every gradient (each parameter's change is its gradient, scaled), one step at fp32
    FSDP2, sp=2 on 2 ranks against 1 rank: every parameter, the head's and the transformer's, changes as on one
    rank. The negative, the gather's backward as upstream has it: the transformer gets half its gradient (FSDP2's
    mean over the two ranks of its partial gradients), the head its own (measured: 0.50x and 1.00x)."""
    from tests.launch_utils import results
    from tests.test_sequence_parallel import head_step_as_on_one_rank

    for name, proc in head_runs.items():
        assert proc.returncode == 0, (name, explain(proc))
    one, sliced = head_step_as_on_one_rank(*(results(head_runs[name]) for name in ("sp1", "sp2", "sliced")))
    for rank in sliced:
        assert abs(rank["transformer"] / one["transformer"] - 0.5) < 0.01, (rank, one)
        assert abs(rank["head"] / one["head"] - 1) < 1e-5, (rank, one)

"""A DiT4DiT-shaped model trained by an unchanged script under real DeepSpeed,
2 CPU ranks over gloo, ZeRO-2 and ZeRO-3 bf16.

Model: a small diffusers CosmosTransformer3DModel (trained) + a small frozen fp32 AutoencoderKLWan
+ a small frozen transformers T5EncoderModel, all attributes of one nn.Module, all loaded with
from_pretrained after the Accelerator exists (under ZeRO-3 transformers builds T5 under zero.Init)
and frozen afterwards (tests/scripts/train_dit4dit.py, which never imports accel_npu).

Launches (each ~20-40 s here; all but Z3 run B side by side, B right after A), assertions combined:
  Z2 ours   towers fp32 + bit-identical, transformer bf16 and changed; save_state; gathered weights
  Z2 stock  ACCEL_NPU_DISABLE=1: "Input type (float) and bias type (c10::BFloat16)"
  Z3 stock  ACCEL_NPU_DISABLE=1: T5 left partitioned in bf16, transformer not cast to bf16
  Z3 run A  save at step 2, SIGKILL of rank 1 in the middle of the next save into the same dir
  Z3 run B  resume from that dir: losses of steps 3-4 equal run A's; towers (incl. the zero.Init
            T5) fp32 and bit-identical to the files; save_state + all-rank get_state_dict +
            all-rank save_model; then DiT4DiT's rank-0-only get_state_dict -> clear error in time
Then `accel-npu consolidate` on the ZeRO-2 and ZeRO-3 checkpoints: bit-exact to the live gathered
weights, from_pretrained round trip, incomplete checkpoint -> error listing what is missing.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch_utils import (
    SCRIPTS,
    accelerate_launch,
    base_env,
    explain,
    results,
    write_deepspeed_config,
    zero_config,
)

pytestmark = pytest.mark.slow

TIMEOUT_S = 5  # ACCEL_NPU_COLLECTIVE_TIMEOUT for the rank-0-only get_state_dict check


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Tiny pretrained components on disk, like a diffusers model repo (transformer/, vae/, text_encoder/):
    tests/scripts/tiny_dits.py's dit4dit, the folder tools/compatibility.py's DiT4DiT rows train too."""
    sys.path.insert(0, str(SCRIPTS))
    import tiny_dits

    root = tmp_path_factory.mktemp("dit4dit")
    tiny_dits.dit4dit(str(root / "pretrained"))
    return root


def _launch(work: Path, stage: int, name: str, *args: str, disable: bool = False):
    # explicit batch sizes: stock accelerate on CPU believes it is 1 process and would fill "auto"
    # with a world size of 1, failing before the interesting part
    ds = dict(
        zero_config(stage, bf16=True),
        train_batch_size=4,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=1,
    )
    yaml = write_deepspeed_config(work / f"cfg_{name}", ds)
    extra = {"ACCEL_NPU_DISABLE": "1"} if disable else {}
    env = base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT=str(TIMEOUT_S), **extra)
    # an explicit rendezvous port: accelerate's DeepSpeed path ignores MASTER_PORT (29500 otherwise)
    return accelerate_launch(
        [
            "--config_file",
            str(yaml),
            "--main_process_port",
            env["MASTER_PORT"],
            str(SCRIPTS / "train_dit4dit.py"),
            "--pretrained",
            str(work / "pretrained"),
            *args,
        ],
        env=env,
        timeout=600,
    )


def _zero3_runs_a_then_b(work: Path):
    """Z3 run A (save at step 2, rank 1 killed in the next save into the same directory), then run B
    resuming from what survived: save every way, then DiT4DiT's rank-0-only get_state_dict."""
    ckpt = work / "ckpt_z3"
    run_a = _launch(
        work,
        3,
        "z3a",
        "--steps",
        "4",
        "--save-at",
        "2",
        "--save-at",
        "4",
        "--save-dir",
        str(ckpt),
        "--kill-in-save",
        "2",
    )
    run_b = _launch(
        work,
        3,
        "z3b",
        "--resume",
        str(ckpt),
        "--start-step",
        "2",
        "--steps",
        "2",
        "--towers-out",
        str(work / "towers_z3.pt"),
        "--final-save",
        str(work / "ckpt_z3b"),
        "--gathered",
        str(work / "gathered_z3.pt"),
        "--save-model",
        str(work / "model_z3"),
        "--rank0-get-state-dict",
    )
    return run_a, run_b


@pytest.fixture(scope="module")
def launches(work):
    """Every launch, started when the module's first test asks: Z2 ours, Z2 stock, Z3 stock side by side
    with Z3 run A, and run B right after run A; the ZeRO-3 ones run while the ZeRO-2 test checks its
    own. Each test takes the results of its launches (futures)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield {
            "z2": pool.submit(
                _launch,
                work,
                2,
                "z2",
                "--steps",
                "3",
                "--towers-out",
                str(work / "towers_z2.pt"),
                "--final-save",
                str(work / "ckpt_z2"),
                "--gathered",
                str(work / "gathered_z2.pt"),
            ),
            "z2_stock": pool.submit(_launch, work, 2, "z2_stock", "--steps", "1", disable=True),
            "z3_a_then_b": pool.submit(_zero3_runs_a_then_b, work),
            "z3_stock": pool.submit(_launch, work, 3, "z3_stock", "--steps", "1", disable=True),
        }


def _kind(proc, kind):
    return [r for r in results(proc) if r.get("kind") == kind]


def _files(directory) -> dict:
    import torch
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _assert_towers(proc, work: Path, towers_file: Path):
    import torch

    finals = _kind(proc, "final")
    assert [r["rank"] for r in finals] == [0, 1], explain(proc)
    for r in finals:
        assert r["tower_dtypes"] == ["torch.float32"], r
        assert not r["tower_partitioned"] and r["towers_in_engine"] == 0, r
        assert r["tower_grads"] == 0 and r["tower_requires_grad"] == 0, r
        assert r["transformer_dtype"] == "torch.bfloat16", r
        assert r["eval_reaches_towers"] and r["train_reaches_towers"], r
    towers = torch.load(towers_file)
    for name in ("vae", "text_encoder"):
        on_disk = _files(work / "pretrained" / name)
        live = towers[name]
        for key, ref in on_disk.items():
            assert live[key].dtype == torch.float32 and torch.equal(live[key], ref), f"{name}.{key}"
    te = towers["text_encoder"]
    assert torch.equal(te["encoder.embed_tokens.weight"], te["shared.weight"])  # tie kept


def _consolidate(capfd, *args):
    """`accel-npu consolidate ARGS`, in this process (deepspeed is imported once, not per call)."""
    from accel_npu.cli import main

    capfd.readouterr()
    rc = main(["consolidate", *map(str, args)])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["accel-npu", "consolidate", *map(str, args)], rc, out, err)


def _assert_consolidated_matches(capfd, work: Path, ckpt: Path, gathered_file: Path, out: Path):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from diffusers import CosmosTransformer3DModel

    p = _consolidate(capfd, ckpt, out, "--dtype", "bf16", "--max-shard-size", "50KB")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "consolidating" in p.stderr  # the progress bar
    gathered = torch.load(gathered_file)
    live = {k[len("transformer.") :]: v for k, v in gathered.items() if k.startswith("transformer.")}
    # towers kept out of the engine still appear in get_state_dict, in their own dtype
    assert {str(v.dtype) for k, v in gathered.items() if k.startswith(("vae.", "text_encoder."))} == {"torch.float32"}
    comp = out / "transformer"
    assert (comp / "config.json").is_file()
    assert (comp / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(glob.glob(str(comp / "diffusion_pytorch_model-*-of-*.safetensors"))) >= 2
    written = _files(comp)
    assert set(written) == set(live)
    for key, value in live.items():
        assert written[key].dtype == value.dtype == torch.bfloat16 and torch.equal(written[key], value), key
    # from_pretrained round trip
    model = CosmosTransformer3DModel.from_pretrained(comp, torch_dtype=torch.bfloat16)
    sd = model.state_dict()
    for key, value in live.items():
        assert torch.equal(sd[key].to(torch.bfloat16), value), key
    # fp32: exactly the master weights zero_to_fp32 reconstructs
    out32 = Path(str(out) + "_fp32")
    p = _consolidate(capfd, ckpt, out32, "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    ref = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    w32 = _files(out32 / "transformer")
    assert set(w32) == {k[len("transformer.") :] for k in ref}
    assert all(torch.equal(w32[k[len("transformer.") :]], v) for k, v in ref.items())
    return live


def test_zero2_towers_stay_fp32_and_stock_fails(work, launches, capfd):
    import torch

    ours, stock = launches["z2"].result(), launches["z2_stock"].result()
    assert ours.returncode == 0, explain(ours)
    _assert_towers(ours, work, work / "towers_z2.pt")
    # the stock half: DeepSpeed cast the fp32 VAE to bf16
    assert stock.returncode != 0
    assert "Input type (float) and bias type (c10::BFloat16) should be the same" in stock.stdout + stock.stderr, (
        explain(stock)
    )
    live = _assert_consolidated_matches(capfd, work, work / "ckpt_z2", work / "gathered_z2.pt", work / "export_z2")
    before = _files(work / "pretrained" / "transformer")
    assert any(not torch.equal(before[k].to(torch.bfloat16), v) for k, v in live.items())  # it trained


def test_zero3_kill_resume_consolidate_and_rank0_only_gather(work, launches, capfd):
    import torch

    ckpt = work / "ckpt_z3"
    (run_a, run_b), stock = launches["z3_a_then_b"].result(), launches["z3_stock"].result()

    # stock ZeRO-3: T5, built under zero.Init before it was frozen, stays partitioned in bf16 (not
    # its checkpoint's fp32), and the engine skips the bf16 cast of everything else
    stock_final = _kind(stock, "final")
    assert stock_final, explain(stock)
    assert "torch.bfloat16" in stock_final[0]["tower_dtypes"] and stock_final[0]["tower_partitioned"]
    assert stock_final[0]["towers_in_engine"] > 0 and stock_final[0]["transformer_dtype"] == "torch.float32"

    # run A: the second save into the same directory was killed in its middle (rank 1 SIGKILLed
    # after writing its shards)
    assert run_a.returncode != 0
    assert _kind(run_a, "dying"), explain(run_a)
    saved = sorted((r["step"], r["rank"]) for r in _kind(run_a, "saved"))
    # in a launched rank save_state writes in the background by default: rank 0's step-4 save_state may return
    # (its files handed to its writer) before rank 1 dies; that checkpoint is never published (the resume below
    # equals run A's steps 3 and 4 only from step 2's state)
    assert saved in ([(2, 0), (2, 1)], [(2, 0), (2, 1), (4, 0)]), saved
    manifest = json.loads((ckpt / "accel_npu_checkpoint.json").read_text())
    assert manifest["world_size"] == 2 and manifest["zero_stage"] == 3
    assert (ckpt / "latest").read_text() == "pytorch_model"
    losses_a = {(r["rank"], r["step"]): r["loss"] for r in _kind(run_a, "step")}

    # run B: resume from the checkpoint that survived, then save every way, then DiT4DiT's
    # rank-0-only get_state_dict
    losses_b = {(r["rank"], r["step"]): r["loss"] for r in _kind(run_b, "step")}
    assert set(losses_b) == {(0, 3), (0, 4), (1, 3), (1, 4)}, explain(run_b)
    for key, loss in losses_b.items():
        assert loss == losses_a[key], (key, loss, losses_a[key])  # resume equality, exact
    _assert_towers(run_b, work, work / "towers_z3.pt")

    # rank-0-only get_state_dict while rank 1 waits in wait_for_everyone: rank 1 joins its gathers,
    # and it equals get_state_dict called on every rank (the gathered file)
    import torch as _torch

    got = _kind(run_b, "rank0_gsd")
    assert len(got) == 1 and got[0]["rank"] == 0 and got[0]["ok"], explain(run_b)
    reference = _torch.load(work / "gathered_z3.pt")
    assert got[0]["sums"] == {k: v.float().sum().item() for k, v in reference.items()}
    assert run_b.returncode == 0, explain(run_b)

    # save_model from every rank (one shard gathered at a time) == get_state_dict from every rank
    gathered = torch.load(work / "gathered_z3.pt")
    saved = _files(work / "model_z3")
    assert (work / "model_z3" / "model.safetensors.index.json").is_file()
    assert set(saved) == set(gathered)
    assert all(torch.equal(saved[k], v) and saved[k].dtype == v.dtype for k, v in gathered.items())

    live = _assert_consolidated_matches(capfd, work, work / "ckpt_z3b", work / "gathered_z3.pt", work / "export_z3")
    before = _files(work / "pretrained" / "transformer")
    assert any(not torch.equal(before[k].to(torch.bfloat16), v) for k, v in live.items())

    # an incomplete checkpoint: clear error listing what is missing, nothing written
    broken = work / "ckpt_z3_broken"
    shutil.copytree(work / "ckpt_z3b", broken)
    for f in glob.glob(str(broken / "pytorch_model" / "*zero_pp_rank_1_*optim_states.pt")):
        os.remove(f)
    out = work / "export_broken"
    p = _consolidate(capfd, broken, out)
    assert p.returncode == 1
    assert "incomplete" in p.stderr and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in p.stderr, p.stderr
    assert "Nothing was written" in p.stderr
    assert not out.exists() and not list(work.glob(".export_broken*"))

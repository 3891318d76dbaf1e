"""The torch.cuda façade (plugins/cuda_compat) on the cpu backend.

Launch (slow, one launch per half, shared): tests/scripts/dit_ddp_cuda_train.py, a plain-PyTorch
DDP script in the shape of facebookresearch/DiT train.py (assert torch.cuda.is_available(),
init_process_group("nccl"), set_device(rank % device_count()), model.to(device),
DDP(device_ids=[rank]), torch.cuda.amp autocast fp16 + GradScaler, torch.cuda.Event timing,
max_memory_allocated, empty_cache, rank-0 torch.save), under `accelerate launch --num_processes 2`.
In-process: each entry against stock (``stock()`` puts every original back), pass-through where
CUDA is available, and libraries still told the truth.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

import accel_npu
from accel_npu.plugins import cuda_compat
from accel_npu.plugins.cuda_compat import facade
from tests.inprocess import stock

from .launch_utils import SCRIPTS, accelerate_launch, base_env, explain, results, run_concurrently, torchrun_launch

STEPS = 30


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = tmp_path_factory.mktemp("dit")
    args = ["--num_processes", "2", str(SCRIPTS / "dit_ddp_cuda_train.py"), "--steps", str(STEPS)]
    twin = ["--num_processes", "2", str(SCRIPTS / "dit_accelerate_fp16_train.py"), "--steps", str(STEPS)]
    stock = base_env(ACCEL_NPU_DISABLE="1")
    torchrun_args = [
        str(SCRIPTS / "dit_ddp_cuda_train.py"),
        "--steps",
        str(STEPS),
        "--results-dir",
        str(out / "torchrun"),
    ]
    ours, theirs, twin_ours, twin_stock, by_torchrun = run_concurrently(
        lambda: accelerate_launch([*args, "--results-dir", str(out / "ours")]),
        lambda: accelerate_launch([*args, "--results-dir", str(out / "stock")], env=stock),
        lambda: accelerate_launch([*twin, "--results-dir", str(out / "twin_ours")], cwd=SCRIPTS),
        lambda: accelerate_launch([*twin, "--results-dir", str(out / "twin_stock")], env=stock, cwd=SCRIPTS),
        lambda: torchrun_launch(torchrun_args),
    )
    return out, ours, theirs, twin_ours, twin_stock, by_torchrun


@pytest.mark.slow
def test_cuda_written_ddp_script_trains_unchanged_on_two_cpu_ranks(launches):
    out, proc, *_ = launches
    assert proc.returncode == 0, explain(proc)
    recs = results(proc)
    assert [r["rank"] for r in recs] == [0, 1], explain(proc)
    for r in recs:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["autocast_dtype"] == "torch.float16"  # fp16 really ran
        assert r["scaler_enabled"] is True and r["scale"] > 1.0  # with loss scaling
        losses = r["losses"]
        assert len(losses) == STEPS and all(map(lambda v: v == v and abs(v) < 1e3, losses))
        assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]), losses
        assert all(ms > 0 for ms in r["step_ms"])  # Event timing measured something
        assert r["peak_memory"] > 0
    # the ranks trained on different shards of the data (two real ranks, not two copies of rank 0)
    assert recs[0]["losses"] != recs[1]["losses"]
    path = out / "ours" / f"{STEPS:07d}.pt"
    assert recs[0]["checkpoint"] == str(path) and recs[1]["checkpoint"] is None
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    assert set(ckpt) == {"model", "opt", "scaler", "args"}
    assert ckpt["model"]["out.weight"].shape == (16, 64) and ckpt["scaler"]["scale"] > 1.0


@pytest.mark.slow
def test_the_same_script_trains_unchanged_under_torchrun(launches):
    out, *_, proc = launches
    assert proc.returncode == 0, explain(proc)
    recs = results(proc)
    assert [(r["rank"], r["world_size"], r["backend"]) for r in recs] == [(0, 2, "gloo"), (1, 2, "gloo")], explain(proc)
    for r in recs:
        assert r["autocast_dtype"] == "torch.float16" and r["scaler_enabled"] is True and r["scale"] > 1.0, r
        assert statistics.mean(r["losses"][-10:]) < statistics.mean(r["losses"][:10]), r["losses"]
    assert (out / "torchrun" / f"{STEPS:07d}.pt").is_file()


@pytest.mark.slow
def test_stock_stops_at_its_first_cuda_call(launches):
    out, _, proc, *_ = launches
    assert proc.returncode != 0, explain(proc)
    assert "AssertionError: Training currently requires at least one GPU." in proc.stdout + proc.stderr
    assert not results(proc) and not (out / "stock").exists()


@pytest.mark.slow
def test_accelerator_twin_with_mixed_precision_fp16_scales_its_loss_on_two_cpu_ranks(launches):
    """The same model and data through Accelerator(mixed_precision="fp16"): accelerate builds its scaler
    itself (accelerate.utils.get_grad_scaler). Stock accelerate on CPU runs fp32 with no scaler (and,
    without accel-npu, as rank 0 of 1); on the cpu backend fp16 autocast runs with loss scaling, as on npu."""
    out, _, _, ours, stock, _ = launches
    assert ours.returncode == 0, explain(ours)
    recs = results(ours)
    assert [(r["rank"], r["world_size"]) for r in recs] == [(0, 2), (1, 2)], explain(ours)
    for r in recs:
        assert r["autocast_dtype"] == "torch.float16" and r["scaler_enabled"] is True and r["scale"] > 1.0, r
        losses = r["losses"]
        assert len(losses) == STEPS and all(v == v for v in losses)
        assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]), losses
    saved = torch.load(out / "twin_ours" / "scaler.pt", weights_only=False)  # accelerate's save_state writes it
    assert saved["scale"] > 1.0
    assert stock.returncode == 0, explain(stock)
    assert all(
        r["world_size"] == 1 and r["autocast_dtype"] == "torch.float32" and r["scaler"] is None for r in results(stock)
    ), explain(stock)


# -- in-process ------------------------------------------------------------------------------------
@pytest.fixture
def active(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    accel_npu.patch()
    facade.reset()
    yield
    facade.reset()
    accel_npu.patch()


def test_each_entry_answers_for_cpu_and_stock_fails(active):
    assert torch.cuda.is_available() is True and torch.cuda.device_count() == 2
    torch.cuda.set_device(1)
    assert torch.cuda.current_device() == 1
    with torch.cuda.device(0):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 1
    assert torch.cuda.get_device_properties(0).major == 0 and torch.cuda.get_device_capability() == (0, 0)
    assert torch.cuda.get_device_name().startswith("cpu")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    torch.cuda.synchronize()
    assert 15 < start.elapsed_time(end) < 2000
    assert torch.cuda.memory_allocated() > 0 and torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
    x = torch.zeros(3, device="cuda")
    m = torch.nn.Linear(2, 2).to(1).cuda()
    for t in (
        x,
        x.cuda(),
        x.to("cuda:1"),
        x.to(0),
        x.to(torch.device("cuda", 1)),
        torch.randn(2, device=0),
        torch.ones_like(x, device="cuda"),
        next(m.parameters()),
    ):
        assert t.device.type == "cpu"
    assert x.to(torch.float16).dtype == torch.float16 and x.to(x).device.type == "cpu"  # other .to() forms untouched
    import torch.distributed as dist

    assert dist.Backend("nccl") == "gloo"
    with stock():
        assert torch.cuda.is_available() is False and torch.cuda.device_count() == 0
        assert dist.Backend("nccl") == "nccl"
        for call in (
            lambda: torch.cuda.set_device(0),
            lambda: torch.cuda.Event(enable_timing=True),
            lambda: torch.zeros(3, device="cuda"),
            lambda: x.cuda(),
            lambda: x.to("cuda"),
            lambda: torch.cuda.synchronize(),
        ):
            with pytest.raises((RuntimeError, AssertionError, AttributeError)):
                call()


def test_libraries_get_the_truth(active):
    from transformers.utils import is_torch_cuda_available

    assert torch.cuda.is_available() is True  # the user's code
    assert is_torch_cuda_available() is False  # transformers (site-packages): no CUDA kernels
    assert torch.amp.autocast_mode.is_autocast_available("cuda") in (True, False)  # torch itself still works


def test_every_entry_is_a_declared_patch_and_reversible(active):
    from accel_npu.patching import get_ledger

    ours = [p for p in get_ledger().patches if p.plugin == "cuda_compat"]
    declared = cuda_compat.accel_npu_register_patches()
    assert {p.target for p in ours} == {p.target for p in declared} and len(declared) > 40
    assert all(p.applied for p in ours), [p for p in ours if not p.applied]
    assert "torch.cuda:is_available" in {p.target for p in ours}
    from accel_npu.patching import original_of

    original = original_of("torch.cuda:is_available")
    assert original is not None and torch.cuda.is_available is not original
    accel_npu.unpatch()
    try:
        assert torch.cuda.is_available is original
        assert torch.Tensor.to is torch._C.TensorBase.to
    finally:
        accel_npu.patch()


def test_passes_through_where_cuda_is_available(active, monkeypatch):
    monkeypatch.setattr(facade, "cuda_available", lambda: True)
    facade.reset()
    assert torch.cuda.is_available() is False  # torch's own answer, untouched
    assert torch.cuda.device_count() == 0
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    import torch.distributed as dist

    assert dist.Backend("nccl") == "nccl"

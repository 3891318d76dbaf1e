"""When a diffusers load leaves its weights to FSDP's broadcast from rank 0 (in-process; the
2-rank behaviour is tests/test_loading_acceptance.py::test_fsdp2_cpu_ram_efficient_loading_reads_on_rank0_only)."""
import pytest
import torch

from accel_npu._torch import markers
from accel_npu._torch.zero import outside_zero_init
from accel_npu.plugins.loading.placement import fsdp as fsdp_loading

FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "True", "WORLD_SIZE": "2"}


@pytest.fixture
def fsdp_env(monkeypatch):
    for k, v in FSDP_ENV.items():
        monkeypatch.setenv(k, v)
    return monkeypatch


@pytest.mark.parametrize("rank,reads", [("0", True), ("1", False)])
def test_only_rank0_reads_under_fsdp_efficient_loading(fsdp_env, rank, reads):
    fsdp_env.setenv("RANK", rank)
    assert fsdp_loading.reads_elsewhere() is (not reads)


@pytest.mark.parametrize("unset", ["ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING"])
def test_every_rank_reads_without_fsdp_or_without_the_setting(fsdp_env, unset):
    fsdp_env.setenv("RANK", "1")
    fsdp_env.setenv(unset, "false")
    assert not fsdp_loading.reads_elsewhere()


def test_frozen_loads_and_single_rank_runs_read(fsdp_env):
    fsdp_env.setenv("RANK", "1")
    with outside_zero_init():  # pipeline components, zero3_init_context_manager(enable=False)
        assert not fsdp_loading.reads_elsewhere()
    fsdp_env.setenv("WORLD_SIZE", "1")
    fsdp_env.setenv("RANK", "0")
    assert not fsdp_loading.reads_elsewhere()


def test_materialize_empty_keeps_ties_and_takes_the_given_dtypes():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=True))
    model[1].weight = model[0].weight  # tied, as lm_head / embeddings
    nbytes = fsdp_loading.materialize_empty(model, {"1.bias": torch.bfloat16})
    assert model[1].weight is model[0].weight and model[0].weight.device.type == "cpu"
    assert model[1].bias.dtype == torch.bfloat16 and model[0].weight.dtype == torch.float32
    assert nbytes == 10 * 4 * 4 + 10 * 2  # the tied weight once


def test_a_model_called_before_fsdp_manages_it_reads_its_files_first():
    whole = torch.nn.Linear(3, 2)
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    fsdp_loading.materialize_empty(model, {})
    fsdp_loading.attach_fill(model, lambda: whole)
    x = torch.randn(1, 3)
    assert torch.equal(model(x), whole(x))  # filled on the first call
    assert getattr(model, markers.FILL) is None


def test_a_model_managed_by_fsdp_is_not_filled_again():
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    fsdp_loading.materialize_empty(model, {})
    calls = []
    fsdp_loading.attach_fill(model, lambda: calls.append(1) or torch.nn.Linear(3, 2))
    model._is_fsdp_managed_module = True  # what fully_shard / FSDP1 set on the modules they manage
    model(torch.randn(1, 3))
    assert calls == []


def test_fsdp2_full_state_dict_is_released_tensor_by_tensor():
    """accelerate's fsdp2_load_full_state_dict gets rank 0's whole weights as ``original_sd``;
    each full tensor is dropped once read (broadcast and sharded), and the caller's dict no longer
    pins them."""
    import gc
    import weakref

    from collections import OrderedDict

    original_sd = OrderedDict(a=torch.ones(4), b=torch.ones(4))  # what model.state_dict() returns
    refs = {k: weakref.ref(v) for k, v in original_sd.items()}
    alive_after_read = {}

    def fake_load(accelerator, model, full_sd, cpu_offload=False):
        for name in ("a", "b"):
            assert name in full_sd
            tensor = full_sd[name]  # what accelerate does on rank 0: read, broadcast, shard
            del tensor
            gc.collect()
            alive_after_read[name] = refs[name]() is not None
        return model

    out = fsdp_loading.load_full_state_dict_releasing(fake_load, None, ("acc", "model", original_sd), {})
    assert out == "model" and original_sd == {}
    assert alive_after_read == {"a": False, "b": False}

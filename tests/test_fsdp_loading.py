"""When a diffusers load leaves its weights to FSDP's broadcast from rank 0 (in-process; the
2-rank behaviour is tests/test_loading_acceptance.py::test_fsdp2_cpu_ram_efficient_loading_reads_on_rank0_only)."""

import json
import os
import subprocess
import sys

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


FSDP2_PROBE = r"""
import gc, json, os, sys, weakref
import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

port, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                  LOCAL_RANK=str(rank))
dist.init_process_group("gloo", rank=rank, world_size=world)
import accelerate
from accelerate.utils import fsdp_utils

torch.manual_seed(0)
# Linear(32, 31): 31 rows do not split evenly over 2 ranks (padding in distribute_tensor and FSDP2)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 31 if i % 2 else 32) for i in range(4)])
reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
original_sd = model.state_dict()                   # what accelerate's prepare keeps of rank 0's weights
refs = [weakref.ref(v) for v in original_sd.values()]
model = model.to(torch.device("meta"))
mesh = init_device_mesh("cpu", (world,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
alive_at_scatter, full_inputs, uneven_shards, uneven_alive = [], [], [], []
real_distribute = dtensor.distribute_tensor

def recording_distribute(tensor, *args, **kwargs):
    # accelerate and accel-npu both import it from torch.distributed.tensor at call time
    gc.collect()
    alive_at_scatter.append(sum(r() is not None for r in refs))
    full_inputs.append(tensor.untyped_storage())   # kept alive: distinct storages stay distinct
    # shorter-than-padded shards that FSDP2 copies into padded ones when loaded: still held?
    uneven_alive.append(sum(r() is not None for r in uneven_shards))
    out = real_distribute(tensor, *args, **kwargs)
    if out._local_tensor.size(0) * world < tensor.size(0):
        uneven_shards.append(weakref.ref(out._local_tensor))
    return out

dtensor.distribute_tensor = recording_distribute
class Acc:
    is_main_process = rank == 0
fsdp_utils.fsdp2_load_full_state_dict(Acc(), model, original_sd)
del original_sd
gc.collect()
storages = {s.data_ptr(): s.nbytes() for s in full_inputs}
same = all(torch.equal(model.state_dict()[k].full_tensor(), v) for k, v in reference.items())
print("RESULT " + json.dumps({"accelerate": accelerate.__version__, "alive": alive_at_scatter, "same": same,
                              "after": sum(r() is not None for r in refs), "rank": rank,
                              "input_storages": len(storages), "input_bytes": sum(storages.values()),
                              "uneven_alive": uneven_alive,
                              "model_bytes": sum(v.numel() * v.element_size() for v in reference.values()),
                              "largest_bytes": max(v.numel() * v.element_size() for v in reference.values())}))
dist.barrier()  # neither rank tears gloo down while the other still uses it
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # gloo's threads can still abort a rank in interpreter teardown ("terminate called ...")
"""


def _load_full_state_dict(tmp_path, pythonpath: str = "", world: int = 1, **env) -> list[dict]:
    """accelerate's real fsdp2_load_full_state_dict on a ``world``-rank gloo group and FSDP2 model.
    Witnessed by wrapping torch's distribute_tensor (which accelerate calls for every parameter):
    how many of rank 0's full tensors are alive at each call (weakrefs), and the storages of the
    full-shape tensors each rank hands it (stock: a new full-size receive buffer per parameter)."""
    from tests.launch_utils import base_env, free_port

    extra = (
        {"PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH", "")) if p)}
        if pythonpath
        else {}
    )
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FSDP2_PROBE, port, str(r), str(world)],
            env=base_env(**extra, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for r in range(world)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.split("RESULT ", 1)[1]))
    return out


@pytest.mark.slow
def test_fsdp2_full_state_dict_is_released_tensor_by_tensor(tmp_path):
    """Installed accelerate: each full tensor is freed as it is scattered; stock keeps all 8 alive."""
    [ours] = _load_full_state_dict(tmp_path)
    [stock] = _load_full_state_dict(tmp_path, ACCEL_NPU_DISABLE="1")
    assert stock["alive"] == [8] * 8 and stock["same"]
    assert ours["same"] and ours["after"] == 0
    assert ours["alive"] == [7, 6, 5, 4, 3, 2, 1, 0], ours  # the one being scattered: a detached view


@pytest.mark.slow
def test_fsdp2_other_ranks_receive_into_their_shards_only(tmp_path):
    """2 ranks (installed accelerate): stock's rank 1 allocates a full-size receive buffer for every
    parameter (8 storages, the whole model); ours hands distribute_tensor views of one buffer the
    size of the largest parameter, and holds no unevenly split shard twice. Every rank's shards
    equal the original weights, both ways."""
    ours = _load_full_state_dict(tmp_path, world=2)
    stock = _load_full_state_dict(tmp_path, world=2, ACCEL_NPU_DISABLE="1")
    assert all(r["same"] for r in ours + stock), (ours, stock)
    assert stock[1]["input_storages"] == 8 and stock[1]["input_bytes"] >= stock[1]["model_bytes"], stock[1]
    assert ours[1]["input_storages"] == 1 and ours[1]["input_bytes"] == ours[1]["largest_bytes"], ours[1]
    assert ours[0]["alive"] == [7, 6, 5, 4, 3, 2, 1, 0] and stock[0]["alive"] == [8] * 8, (ours[0], stock[0])
    # rank 1's 15-of-16-row shards (weight, bias of both Linear(32, 31)): stock keeps each until the
    # model's final load_state_dict, where FSDP2 copies it into a padded one (its whole shard twice);
    # ours loads each as it is scattered, so the unpadded one is gone before the next scatter
    assert stock[1]["uneven_alive"] == [0, 0, 0, 1, 2, 2, 2, 3], stock[1]
    assert ours[1]["uneven_alive"] == [0] * 8, ours[1]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["1.10.1", "1.12.0", "1.13.0", "1.16.0"])
def test_fsdp2_release_works_on_every_supported_accelerate(version, tmp_path):
    """The patch declares accelerate>=1.10.1: on each pip-installed release (1.10-1.12 take no
    cpu_offload; 1.10/1.11 broadcast on the mesh's group) it replaces the real function the same way."""
    from accel_npu.plugins.loading import FSDP2_LOAD_FULL_STATE_DICT

    assert FSDP2_LOAD_FULL_STATE_DICT.supports == "accelerate>=1.10.1,<1.17"
    target = tmp_path / f"accelerate-{version}"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "--no-deps",
            "--target",
            str(target),
            f"accelerate=={version}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-2000:]
    [ours] = _load_full_state_dict(tmp_path, str(target))
    [stock] = _load_full_state_dict(tmp_path, str(target), ACCEL_NPU_DISABLE="1")
    assert ours["accelerate"] == stock["accelerate"] == version
    assert stock["alive"] == [8] * 8
    assert ours["same"] and ours["alive"] == [7, 6, 5, 4, 3, 2, 1, 0], ours


TOP_LEVEL_PROBE = r"""
import json, os, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)
from accelerate.utils import fsdp_utils


class WithPadToken(torch.nn.Module):  # as diffusers' ZImageTransformer2DModel: x_pad_token on the model itself
    def __init__(self):
        super().__init__()
        self.x_pad_token = torch.nn.Parameter(torch.randn(1, 8))
        self.proj = torch.nn.Linear(8, 8)


torch.manual_seed(0)
model = WithPadToken()
reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
original_sd = model.state_dict()
model = model.to(torch.device("meta"))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
class Acc:
    is_main_process = True
try:
    fsdp_utils.fsdp2_load_full_state_dict(Acc(), model, original_sd)
    result = {"same": all(torch.equal(model.state_dict()[k].full_tensor(), v) for k, v in reference.items())}
except Exception as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"}
print("RESULT " + json.dumps(result))
dist.destroy_process_group()
"""


def _accelerate_before(version: str) -> bool:
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__) < Version(version)


@pytest.mark.slow
@pytest.mark.parametrize("stock", [False, True])
def test_fsdp2_full_state_dict_of_a_model_with_its_own_parameters(tmp_path, stock):
    """A parameter held by the model itself (diffusers' ZImageTransformer2DModel.x_pad_token) on a model
    without transformers' get_parameter_or_buffer: stock accelerate splits its name at a dot it lacks."""
    from tests.launch_utils import base_env, free_port

    env = base_env(**({"ACCEL_NPU_DISABLE": "1"} if stock else {}))
    proc = subprocess.run(
        [sys.executable, "-c", TOP_LEVEL_PROBE, str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    if stock and _accelerate_before("1.16"):
        assert result == {"error": "ValueError: not enough values to unpack (expected 2, got 1)"}, result
    else:  # accelerate 1.16 rewrote fsdp2_load_full_state_dict (one loop, parameters of the model itself too)
        assert result == {"same": True}, result

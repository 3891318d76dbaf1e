"""The torch.cuda façade on the npu backend, against the torch_npu stand-in (tests/contract/standin).

Routes: torch.cuda.X -> torch.npu.X (torch_npu/npu/__init__.py, torch_npu/npu/memory.py: the
functions torch_npu's contrib/transfer_to_npu.py maps with ``_apply_patches([['cuda', torch_npu.npu]])``,
Ascend/pytorch master 9e73e708a), "cuda[:N]" -> "npu[:N]", Backend("nccl") -> "hccl" (what
transfer_to_npu's ``_wrapper_hccl`` does). The probe records which torch.npu functions were called.
And with torch_npu's own transfer_to_npu imported before or after accel-npu's façade, the two agree.
"""

from __future__ import annotations

import pytest

from ..launch_utils import results
from .test_npu_contract import env_with, make_site, py

pytestmark = pytest.mark.contract

ROUTES = """
import json, warnings, torch, torch_npu
{before}
calls = []
for name in ("set_device", "current_device", "synchronize", "empty_cache", "memory_allocated"):
    real = getattr(torch.npu, name)
    setattr(torch.npu, name, (lambda n, f: lambda *a, **k: (calls.append([n, list(a)]), f(*a, **k))[1])(name, real))
import torch.distributed as dist
from accel_npu.plugins.cuda_compat import facade
out = {{"available": torch.cuda.is_available(), "count": torch.cuda.device_count()}}
torch.cuda.set_device(3)
out["current"] = torch.cuda.current_device()
torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.memory_allocated()
{after}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with torch.autocast("cuda", dtype=torch.float16) as ac:
        out["autocast"] = ac.device
out.update(calls=calls, nccl=str(dist.Backend("nccl")),
           remap=[str(facade.remap(d, ints=True)) for d in ("cuda", "cuda:1", torch.device("cuda", 2), 5, "cpu")],
           cuda_is_npu_function=torch.cuda.is_available is torch.npu.is_available)
print("RESULT " + json.dumps(out))
"""

TRANSFER = "import torch_npu.contrib.transfer_to_npu"


@pytest.mark.slow
@pytest.mark.parametrize("order", ["facade only", "transfer_to_npu first", "transfer_to_npu after"])
def test_cuda_routes_to_torch_npu(tmp_path, order):
    site = make_site(tmp_path)
    code = ROUTES.format(
        before=TRANSFER if order == "transfer_to_npu first" else "",
        after=TRANSFER if order == "transfer_to_npu after" else "",
    )
    proc = py(code, env_with(site))
    (r,) = results(proc) or [None]
    assert r is not None, proc.stderr[-3000:]
    assert r["available"] is True and r["count"] == 8, r
    assert r["current"] == 0  # the stand-in's torch.npu.current_device
    assert r["calls"][:5] == [
        ["set_device", [3]],
        ["current_device", []],
        ["synchronize", []],
        ["empty_cache", []],
        ["memory_allocated", []],
    ], r
    assert r["autocast"] == "npu" and r["nccl"] == "hccl"
    assert r["remap"] == ["npu", "npu:1", "npu:2", "npu:5", "cpu"]
    # on an Ascend box accel-npu activates inside `import torch` (torch_npu is installed), so transfer_to_npu
    # always comes second and replaces torch.cuda's functions with torch.npu's: both say the same thing
    assert r["cuda_is_npu_function"] is (order != "facade only")


@pytest.mark.slow
def test_stock_npu_cuda_calls(tmp_path):
    site = make_site(tmp_path)
    code = (
        "import json, torch, torch_npu, torch.distributed as dist\n"
        "print('RESULT ' + json.dumps({'available': torch.cuda.is_available(), 'count': torch.cuda.device_count(),"
        " 'nccl': str(dist.Backend('nccl'))}))"
    )
    (r,) = results(py(code, env_with(site, ACCEL_NPU_DISABLE="1")))
    assert r == {"available": False, "count": 0, "nccl": "nccl"}


# torch.compile on an NPU goes through torch_npu's own inductor device: torch_npu/utils/_dynamo_device.py
# registers NpuInterface (its functions are torch_npu.npu's) with torch._dynamo.device_interface, and
# torch_npu/_inductor/__init__.py its scheduling and device op overrides for "npu" (Ascend/pytorch
# v7.2.0-pytorch2.7.1). Nothing there reads torch.cuda; inductor reads torch.cuda only for CUDA devices
# (torch/_inductor/codecache.py get_system: torch.cuda.get_device_properties). So the façade must answer the
# script and leave torch's own frames with torch's answers: a call made from a file inside torch is stock's.
INTERNAL = """
import json, os, torch, torch_npu
from torch._dynamo.device_interface import get_interface_for_device
def outcome(call):
    try:
        return repr(call())
    except Exception as exc:
        return type(exc).__name__
calls = ("torch.cuda.is_available()", "torch.cuda.device_count()", "torch.cuda.get_device_name()")
source = "out = {" + ", ".join(f"{c!r}: outcome(lambda: {c})" for c in calls) + "}"
script = {}
exec(compile(source, "train.py", "exec"), {"torch": torch, "outcome": outcome}, script)
# the same calls as torch's own code makes them: compiled with a file name inside torch/_inductor
internal = {}
exec(compile(source, os.path.join(os.path.dirname(torch.__file__), "_inductor", "probe.py"), "exec"),
     {"torch": torch, "outcome": outcome}, internal)
print("RESULT " + json.dumps({"script": script["out"], "torch": internal["out"],
                              "cuda_interface": get_interface_for_device("cuda").__name__}))
"""


@pytest.mark.slow
def test_torch_internals_see_torch_answers_on_npu_while_the_script_sees_the_npus(tmp_path):
    site = make_site(tmp_path)
    (ours,) = results(py(INTERNAL, env_with(site, LOCAL_RANK="0")))
    (stock,) = results(py(INTERNAL, env_with(site, ACCEL_NPU_DISABLE="1")))
    assert ours["script"] == {
        "torch.cuda.is_available()": "True",
        "torch.cuda.device_count()": "8",
        "torch.cuda.get_device_name()": "'Ascend910B1'",
    }, ours
    assert ours["torch"] == stock["torch"] == stock["script"], (ours, stock)
    assert ours["torch"]["torch.cuda.is_available()"] == "False"
    assert ours["cuda_interface"] == stock["cuda_interface"] == "CudaInterface"

"""Stock paths stay stock: TorchScript, torch.compile and where the CUDA façade answers.

- TorchScript: a function calling each torch callable the ledger wraps is scripted and traced in a launched
  rank (the façade's wrappers installed) and with ACCEL_NPU_DISABLE=1: the same outcome, compiled code and
  result for every one (tests/scripts/torchscript_probe.py). Mutant: without the ledger's TorchScript entry
  for wrappers (accel_npu/patching/torchscript.py), the comparison fails.
- torch.compile: accelerate's ``--dynamo_backend inductor`` on a plain accelerate script, and ``torch.compile``
  of a CUDA-idiom script (``device = "cuda" if torch.cuda.is_available() else "cpu"``) in a launched rank and in
  a plain process: each compiles and steps, with stock's numbers.
- Where the façade answers: a plain process that imports diffusers sees stock torch (the façade's targets are
  torch's own objects); a launched rank and ACCEL_NPU_CUDA_FACADE=1 get it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch_utils import SCRIPTS, accelerate_launch, base_env, explain, results, run_concurrently

# One call per torch target the ledger wraps (a function body over 1-D float tensors a, b), without CUDA
# literals: code that stock runs. Calls TorchScript cannot compile are kept: both sides must fail alike.
SAMPLES = {
    "torch.distributed.launcher.api:launch_agent": "return torch.distributed.launcher.api.launch_agent(None, None)",
    "torch.amp.autocast_mode:autocast.__init__": "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
    "    c = torch.mm(a.unsqueeze(1), b.unsqueeze(0))\n"
    "return c.float()",
    "torch.nn.functional:layer_norm": "return F.layer_norm(a, [3])",
    "torch.nn.functional:group_norm": "return F.group_norm(a.view(1, 3, 1), 1)",
    "torch:cat": "return torch.cat([a, b])",
    "torch:stack": "return torch.stack([a, b])",
    "torch.amp.grad_scaler:GradScaler.__init__": "return torch.amp.GradScaler('cpu').get_scale()",
    "torch._tensor:Tensor.numpy": "return a.numpy()",
    "torch.optim.adamw:AdamW.__init__": "return torch.optim.AdamW([a])",
    **{
        f"torch.cuda:{name}": f"return torch.cuda.{name}({arg})"
        for name, arg in [
            ("is_available", ""),
            ("device_count", ""),
            ("current_device", ""),
            ("set_device", "0"),
            ("get_device_name", ""),
            ("get_device_properties", "0"),
            ("get_device_capability", ""),
            ("is_bf16_supported", ""),
            ("synchronize", ""),
            ("empty_cache", ""),
            ("memory_allocated", ""),
            ("max_memory_allocated", ""),
            ("memory_reserved", ""),
            ("max_memory_reserved", ""),
            ("reset_peak_memory_stats", ""),
            ("current_stream", ""),
            ("default_stream", ""),
            ("manual_seed", "0"),
            ("manual_seed_all", "0"),
        ]
    },
    "torch.cuda.streams:Event.__new__": "return torch.cuda.Event(enable_timing=True)",
    "torch.cuda.streams:Stream.__new__": "return torch.cuda.Stream()",
    "torch.cuda:device.__enter__": "with torch.cuda.device(0):\n    c = a + b\nreturn c",
    "torch.cuda:device.__exit__": "with torch.cuda.device(-1):\n    c = a * b\nreturn c",
    "torch._tensor:Tensor.to": "return a.to(torch.float64) + b.to('cpu')",
    "torch._tensor:Tensor.cuda": "return a.cuda()",
    "torch.nn.modules.module:Module.to": "return torch.nn.Linear(3, 1).to(torch.float64)(a.double())",
    "torch.nn.modules.module:Module.cuda": "return torch.nn.Linear(3, 1).cuda()(a)",
    "torch:zeros": "return torch.zeros(3) + a",
    "torch:ones": "return torch.ones(3, dtype=torch.float64)",
    "torch:empty": "return torch.empty(3).shape[0] + a",
    "torch:full": "return torch.full([3], 2.0) * a",
    "torch:rand": "return torch.rand(3) + a",
    "torch:randn": "return torch.randn(3) + a",
    "torch:randint": "return torch.randint(0, 5, [3])",
    "torch:randperm": "return torch.randperm(4)",
    "torch:arange": "return torch.arange(3) + a",
    "torch:linspace": "return torch.linspace(0.0, 1.0, 3) * b",
    "torch:logspace": "return torch.logspace(0.0, 1.0, 3) * b",
    "torch:eye": "return torch.eye(3) @ a",
    "torch:tensor": "return torch.tensor([1.0, 2.0, 3.0]) * a",
    "torch:as_tensor": "return torch.as_tensor(a) * 2",
    "torch:zeros_like": "return torch.zeros_like(a) + b",
    "torch:ones_like": "return torch.ones_like(a) + b",
    "torch:empty_like": "return torch.empty_like(a).shape[0] + b",
    "torch:full_like": "return torch.full_like(a, 3.0)",
    "torch:rand_like": "return torch.rand_like(a)",
    "torch:randn_like": "return torch.randn_like(a)",
    "torch:randint_like": "return torch.randint_like(a, 0, 5)",
    "torch.serialization:load": "return torch.load('/nonexistent.pt')",
    "torch.distributed.distributed_c10d:Backend.__new__": "return torch.distributed.Backend('gloo')",
    "torch.library:register_fake": "return torch.library.register_fake('aten::sin')",
    "torch.nn.parallel.distributed:DistributedDataParallel.__init__": "return "
    "torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))",
    **{
        f"torch.distributed:{name}": f"return torch.distributed.{name}({arg})"
        for name, arg in [
            ("all_reduce", "a"),
            ("broadcast", "a, 0"),
            ("all_gather", "[a], b"),
            ("all_gather_into_tensor", "a, b"),
            ("reduce_scatter", "a, [b]"),
            ("reduce_scatter_tensor", "a, b"),
            ("barrier", ""),
            ("reduce", "a, 0"),
            ("gather", "a"),
            ("scatter", "a"),
            ("all_to_all", "[a], [b]"),
            ("all_to_all_single", "a, b"),
            ("all_gather_single", "a, b"),
            ("reduce_scatter_single", "a, b"),  # torch >= 2.13
            ("all_gather_object", "[a], b"),
            ("broadcast_object_list", "[a]"),
            ("gather_object", "a"),
            ("scatter_object_list", "[a], [b]"),
            ("init_process_group", "'gloo'"),
        ]
    },
}


def _torch_targets() -> set[str]:
    from tests.inprocess import declared_patches

    return {p.target for p in declared_patches() if p.module.split(".")[0] == "torch"}


def test_every_wrapped_torch_callable_has_a_torchscript_sample():
    assert set(SAMPLES) == _torch_targets()


def _probe(tmp_path, name, *flags, **env):
    work = tmp_path / name
    work.mkdir()
    samples = work / "samples.json"
    samples.write_text(json.dumps(SAMPLES))
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "torchscript_probe.py"), str(samples), str(work), *flags],
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(work),
    )


def _report(proc):
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, explain(proc)
    return json.loads(line[len("RESULT ") :])


def differing(ours: dict, stock: dict) -> dict:
    """Samples whose outcome differs: scripted (compiled or the error type, compiled code, result) always;
    traced where stock traced it (a trace runs the Python wrappers: where stock's CUDA call fails, a launched
    rank's façade answers it, as it answers the same call outside a trace)."""
    names = (set(ours) | set(stock)) - {"wrapped"}
    out = {}
    for name in sorted(names):
        mine, theirs = ours.get(name) or {}, stock.get(name) or {}
        stock_traced = (theirs.get("trace") or {}).get("compiled") == "ok"
        if mine.get("script") != theirs.get("script") or (stock_traced and mine.get("trace") != theirs.get("trace")):
            out[name] = {"ours": mine, "stock": theirs}
    return out


def test_differing_names_every_difference():
    same = {"script": {"compiled": "ok", "result": [1.0]}, "trace": {"compiled": "ok", "result": [1.0]}}
    other = {"script": {"compiled": "RuntimeError"}, "trace": same["trace"]}
    traced_other = {"script": same["script"], "trace": {"compiled": "ok", "result": [2.0]}}
    stock_cannot_trace = {"script": same["script"], "trace": {"compiled": "AssertionError"}}
    assert differing({"wrapped": "x", "t:a": same}, {"wrapped": "y", "t:a": same}) == {}
    assert set(differing({"t:a": same, "t:b": same}, {"t:a": other})) == {"t:a", "t:b"}
    assert set(differing({"t:a": traced_other}, {"t:a": same})) == {"t:a"}
    assert differing({"t:a": same}, {"t:a": stock_cannot_trace}) == {}


@pytest.mark.slow
def test_torchscript_compiles_every_wrapped_torch_callable_as_stock(tmp_path):
    ours, stock, mutant = run_concurrently(
        lambda: _probe(tmp_path, "ours", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"),
        lambda: _probe(tmp_path, "stock", ACCEL_NPU_DISABLE="1"),
        lambda: _probe(tmp_path, "mutant", "--break-torchscript-sync", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"),
    )
    ours, stock, mutant = _report(ours), _report(stock), _report(mutant)
    # the wrappers were there (a launched rank), and stock had none
    assert ours["wrapped"] == "FunctionWrapper" and stock["wrapped"] == "builtin_function_or_method"
    assert differing(ours, stock) == {}
    # traces that differ at all are of CUDA calls stock cannot run here (the façade answers them)
    traced_apart = {n for n in SAMPLES if ours[n]["trace"] != stock[n]["trace"]}
    assert all(n.startswith("torch.cuda") or n.endswith(".cuda") for n in traced_apart), sorted(traced_apart)
    # the samples are not vacuous: most compile and run under both, torch.stack and torch.cat among them
    scripted = {n for n, r in stock.items() if n != "wrapped" and r["script"].get("compiled") == "ok"}
    assert {"torch:stack", "torch:cat", "torch:zeros", "torch.nn.functional:layer_norm"} <= scripted
    assert len(scripted) >= 25, sorted(scripted)
    # mutant: without the ledger's TorchScript entries the wrapped functions do not compile (as reported)
    broken = differing(mutant, stock)
    assert {"torch:stack", "torch:cat"} <= set(broken), sorted(broken)
    assert broken["torch:stack"]["ours"]["script"]["compiled"] != "ok"


# -- torch.compile ---------------------------------------------------------------------------------------
def _compile_run(shape, launcher, **env):
    script = [str(SCRIPTS / "compile_train.py"), shape]
    if launcher == "accelerate":
        extra = ["--dynamo_backend", "inductor"] if shape == "accelerate" else []
        return accelerate_launch(["--num_processes", "1", *extra, *script], env=base_env(**env), timeout=600)
    return subprocess.run([sys.executable, *script], env=base_env(**env), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled_runs():
    """Each shape with accel-npu (launched; plain) and stock; the CUDA idiom's stock half is a plain process
    (stock torch has no CUDA here, so the idiom picks "cpu" wherever it runs)."""
    names = ["accelerate-ours", "accelerate-stock", "idiom-launched", "idiom-plain", "idiom-stock"]
    runs = run_concurrently(
        lambda: _compile_run("accelerate", "accelerate"),
        lambda: _compile_run("accelerate", "accelerate", ACCEL_NPU_DISABLE="1"),
        lambda: _compile_run("cuda-idiom", "accelerate"),
        lambda: _compile_run("cuda-idiom", "python"),
        lambda: _compile_run("cuda-idiom", "python", ACCEL_NPU_DISABLE="1"),
    )
    return dict(zip(names, runs))


def _result(proc):
    found = results(proc)
    assert proc.returncode == 0 and len(found) == 1, explain(proc)
    return found[0]


def _same_numbers(a, b):
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-6, abs=1e-7)
    assert a["weights"] == pytest.approx(b["weights"], rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_accelerate_dynamo_backend_inductor_compiles_and_steps_as_stock(compiled_runs):
    ours, stock = _result(compiled_runs["accelerate-ours"]), _result(compiled_runs["accelerate-stock"])
    for r in (ours, stock):
        assert r["compiled"] == "OptimizedModule" and r["graphs"] >= 1, r  # inductor really compiled it
    assert ours["device"] == stock["device"] == "cpu"
    _same_numbers(ours, stock)


@pytest.mark.slow
def test_torch_compile_of_the_cuda_idiom_in_a_launched_rank_and_a_plain_process(compiled_runs):
    launched, plain, stock = (_result(compiled_runs[k]) for k in ("idiom-launched", "idiom-plain", "idiom-stock"))
    assert launched["device"] == "cuda"  # the launched rank's script sees the façade ("cuda" runs on cpu)
    assert plain["device"] == stock["device"] == "cpu"  # a plain process sees stock torch
    for r in (launched, plain, stock):
        assert r["compiled"] == "OptimizedModule" and r["graphs"] >= 1, r
    _same_numbers(launched, stock)
    _same_numbers(plain, stock)


# -- where the façade answers ----------------------------------------------------------------------------
SEES = r"""
import json, sys, torch
if sys.argv[1:] != ["torch-only"]:
    import diffusers, accelerate.accelerator, transformers.modeling_utils
import torch.distributed.launcher.api, torch.nn.parallel
from accel_npu.patching import get_ledger
facade = [p for p in get_ledger().patches if p.scope is not None]
print("RESULT " + json.dumps({
    "is_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count(),
    "stock_objects": torch.stack is torch._C._VariableFunctions.stack and type(torch.cuda.is_available).__name__ ==
    "function",
    "autocast_cuda_enabled": torch.autocast("cuda").fast_dtype is not None and torch.autocast("cuda")._enabled,
    "facade_statuses": sorted({p.status for p in facade if p.status != "not imported"}),
    "facade_patches": len(facade)}))
"""


def _sees(*flags, **env):
    proc = subprocess.run(
        [sys.executable, "-c", SEES, *flags], env=base_env(**env), capture_output=True, text=True, timeout=300, cwd="/"
    )
    return _result(proc), proc


@pytest.mark.slow
def test_where_the_facade_answers():
    # the seven processes are independent (each reads only its own environment): they run side by side. Every
    # façade patch's status is read where diffusers, accelerate and transformers are imported (plain, stock, a
    # launched rank, the value named once); the other three switches decide the one scope every patch consults,
    # read on the patches of torch's own targets (all but three) without those imports, a third of the CPU each
    variants = (
        ((), {}),
        ((), {"ACCEL_NPU_DISABLE": "1"}),
        ((), {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
        (("torch-only",), {"ACCEL_NPU_CUDA_FACADE": "1"}),
        (("torch-only",), {"ACCELERATE_USE_CPU": "False"}),
        (("torch-only",), {"LOCAL_RANK": "0", "ACCEL_NPU_CUDA_FACADE": "0"}),
        ((), {"LOCAL_RANK": "0", "ACCEL_NPU_CUDA_FACADE": "maybe"}),
    )
    seen = run_concurrently(*(lambda flags=flags, env=env: _sees(*flags, **env) for flags, env in variants))
    (plain, proc), (stock, _), *launched, (off, _), (bad, bad_proc) = seen
    # a process that merely imports diffusers: stock torch, every façade patch inactive and saying why
    assert plain["is_available"] is False and plain["device_count"] == 0 and plain["stock_objects"], plain
    assert plain["autocast_cuda_enabled"] is False  # stock disables autocast("cuda") without CUDA
    assert plain["facade_patches"] > 40 and plain["facade_statuses"] == [
        "inactive here: not a launched rank (accelerate launch / torchrun); ACCEL_NPU_CUDA_FACADE=1 turns it on here"
    ]
    assert "torch.cuda answers" not in proc.stderr
    assert {k: plain[k] for k in ("is_available", "device_count", "stock_objects", "autocast_cuda_enabled")} == {
        k: stock[k] for k in ("is_available", "device_count", "stock_objects", "autocast_cuda_enabled")
    }
    # a launched rank (torchrun, accelerate launch, the DeepSpeed launcher set LOCAL_RANK), or opted in
    for (_, env), (on, _) in zip(variants[2:5], launched, strict=True):
        assert on["is_available"] is True and on["autocast_cuda_enabled"] is True, env
        assert not on["stock_objects"] and on["facade_statuses"] == ["applied"], env
        if "LOCAL_WORLD_SIZE" in env:
            assert on["device_count"] == 2, on
    # opted out of a launched rank; a value that means nothing is named once and leaves torch stock
    assert off["is_available"] is False and off["facade_statuses"] == ["inactive here: ACCEL_NPU_CUDA_FACADE=0"]
    assert bad["is_available"] is False and bad["stock_objects"], bad
    assert bad_proc.stderr.count("ACCEL_NPU_CUDA_FACADE='maybe' is not one of auto, 1, 0") == 1, bad_proc.stderr[-2000:]


@pytest.mark.slow
def test_a_cuda_script_run_plainly_is_told_how_to_start_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import torch, diffusers, sys\n"
        "assert sys.argv[1] != 'cuda' or torch.cuda.is_available(), 'Training requires a GPU.'\n"
        "assert sys.argv[1] != 'other', 'some other check'\n"
    )
    told = "accel-npu: this CUDA-written script met torch without CUDA"
    runs = run_concurrently(
        *(
            lambda arg=arg: subprocess.run(
                [sys.executable, str(script), arg], env=base_env(), capture_output=True, text=True, timeout=300
            )
            for arg in ("cuda", "other")
        )
    )
    cuda, other = runs
    assert cuda.returncode == 1 and "AssertionError: Training requires a GPU." in cuda.stderr
    assert told in cuda.stderr and "ACCEL_NPU_CUDA_FACADE=1" in cuda.stderr
    assert other.returncode == 1 and "some other check" in other.stderr and told not in other.stderr


def test_torchscript_entries_follow_the_wrappers_through_unpatch_and_repatch():
    """In-process (the façade opted in): whichever state TorchScript's table was built in, a scripted
    torch.stack / torch.cat / torch.zeros compiles, patched, unpatched and patched again."""
    import torch
    from torch.jit._builtins import _find_builtin

    from tests.inprocess import stock

    # re-armed: deepspeed.zero.Init puts back on exit the torch.zeros it saved when it was imported
    # (partition_parameters.py), in this worker possibly a wrapper from before another test's re-arming
    with stock():
        pass

    def script_and_run():
        unit = torch.jit.CompilationUnit(
            "def f(a: Tensor, b: Tensor):\n"
            "    return torch.stack([a, b]).sum(0) + torch.cat([a, b])[:2] + torch.zeros(2)\n"
        )
        return unit.f(torch.ones(2), torch.ones(2)).tolist()

    assert type(torch.stack).__name__ == "FunctionWrapper"
    assert script_and_run() == [3.0, 3.0]
    assert _find_builtin(torch.stack) == "aten::stack" and _find_builtin(torch.zeros) == "aten::zeros"
    with stock():
        assert type(torch.stack).__name__ == "builtin_function_or_method"
        assert _find_builtin(torch.stack) == "aten::stack" and script_and_run() == [3.0, 3.0]
    assert type(torch.stack).__name__ == "FunctionWrapper"
    assert _find_builtin(torch.stack) == "aten::stack" and script_and_run() == [3.0, 3.0]


def test_torchscript_entries_hold_when_the_table_was_built_under_someone_elses_function():
    """deepspeed.zero.Init swaps torch.zeros for its own function while a model is built; a table built then
    holds that function's id, neither the original's nor a wrapper's. Patched, unpatched and patched again
    afterwards, a scripted torch.zeros still compiles as aten::zeros."""
    import torch
    import torch.jit._builtins as builtins

    import accel_npu
    from tests.inprocess import stock

    accel_npu.patch()
    current = torch.zeros

    def someone_elses_zeros(*args, **kwargs):
        return current(*args, **kwargs)

    # built again below, as a first script inside zero.Init builds it: from torch's modules as they are then
    # (the entries an earlier build registered are left out, or the rebuild would find them)
    ops = builtins._builtin_ops
    builtins._builtin_ops = [entry for entry in ops if getattr(entry[0], "__name__", None) != "zeros"]
    builtins._builtin_table = None
    torch.zeros = someone_elses_zeros
    try:
        builtins._get_builtin_table()
    finally:
        torch.zeros = current
        builtins._builtin_ops = ops
    assert builtins._find_builtin(torch.zeros) is None  # the state the ledger now meets
    with stock():
        assert builtins._find_builtin(torch.zeros) == "aten::zeros"
    assert type(torch.zeros).__name__ == "FunctionWrapper" and builtins._find_builtin(torch.zeros) == "aten::zeros"
    unit = torch.jit.CompilationUnit("def f(a: Tensor):\n    return a + torch.zeros(2)\n")
    assert unit.f(torch.ones(2)).tolist() == [1.0, 1.0]


def test_a_removed_wrapper_put_back_by_someone_else_still_compiles():
    """deepspeed.zero.Init saves torch.zeros when partition_parameters is imported and puts that object back
    whenever a zero.Init context exits: after accel-npu has been re-armed, an earlier wrapper. TorchScript still
    compiles it as aten::zeros (its entry is kept, and the object with it)."""
    import torch
    import torch.jit._builtins as builtins

    import accel_npu
    from tests.inprocess import stock

    accel_npu.patch()
    builtins._get_builtin_table()
    saved = torch.zeros  # what partition_parameters.py saves at its import (_orig_torch_zeros)
    assert type(saved).__name__ == "FunctionWrapper"
    with stock():
        pass
    assert torch.zeros is not saved
    torch.zeros = saved  # a zero.Init context exits
    try:
        unit = torch.jit.CompilationUnit("def f(a: Tensor):\n    return a + torch.zeros(2)\n")
        assert unit.f(torch.ones(2)).tolist() == [1.0, 1.0]
    finally:
        with stock():  # the ledger restores the original over the object put back, then re-arms
            pass

"""The npu backend against a STAND-IN torch_npu / mx_driving (tests/contract/standin/), which only
these tests put on PYTHONPATH of their subprocesses. What is checked is accel-npu's side of the
contract written down in docs/npu-contract.md, never Ascend itself.

Too many processes (in the real `accelerate launch`), worker environment defaults, torch/torch_npu
pairing, libraries on the loader path, the mx_driving patcher, and the NPU half of the precision
fixes (AdamW fused by default, no grad_scale/found_inf into the fused step).
Stock = ACCEL_NPU_DISABLE=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..launch_utils import BIN, SCRIPTS, accelerate_launch, base_env, explain, hccl_default_ports_busy, results

pytestmark = pytest.mark.contract

STANDIN = Path(__file__).parent / "standin"
TORCH_BASE = torch.__version__.split("+")[0]
TORCH_LIB = str(Path(torch.__file__).parent / "lib")


def make_site(
    tmp_path: Path, version: str = f"{TORCH_BASE}.post1", mx: str | None = None, autoload: bool = False
) -> Path:
    """A site directory holding the stand-in torch_npu (at ``version``) and optionally mx_driving;
    ``autoload``: with torch_npu's ``torch.backends`` entry point, as the real wheel has (setup.py)."""
    site = tmp_path / "site"
    shutil.copytree(STANDIN / "torch_npu" / "torch_npu", site / "torch_npu")
    (site / "torch_npu" / "lib").mkdir()
    (site / "torch_npu" / "lib" / "libtorch_npu.so").write_bytes(b"")  # placeholder: only its path matters
    info = site / f"torch_npu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n")
    if autoload:
        (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    if mx:
        shutil.copytree(STANDIN / f"mx_driving_{mx}" / "mx_driving", site / "mx_driving")
    return site


def env_with(site: Path, **extra) -> dict:
    env = base_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def py(code: str, env: dict) -> subprocess.CompletedProcess:
    """``code`` as a training script on an Ascend machine: the CUDA façade family answers as in a launched rank
    (opted in: a plain process leaves it off, tests/test_stock_paths.py)."""
    env = {"ACCEL_NPU_CUDA_FACADE": "1", **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, cwd="/")


def npu_report(env: dict) -> dict:
    proc = subprocess.run(
        [str(BIN / "accel-npu"), "env", "--json", "--no-import"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def last_line(proc) -> str:
    return [line for line in proc.stderr.splitlines() if line.strip()][-1]


# -- process count and worker environment: the real launcher --------------------------------------
@pytest.mark.slow
def test_too_many_processes_refused_before_any_worker(tmp_path):
    site = make_site(tmp_path)
    args = ["--multi_gpu", "--num_processes", "4", "--num_machines", "1", str(SCRIPTS / "print_worker_env.py")]
    extra = {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    ours = accelerate_launch(args, env=env_with(site, **extra))
    assert ours.returncode != 0
    out = ours.stdout + ours.stderr
    assert "4 processes requested but only 2 NPU(s) are visible (ASCEND_RT_VISIBLE_DEVICES=0,1)" in out, explain(ours)
    assert "Use --num_processes 2" in out
    assert not results(ours)  # no worker started

    # --gpu_ids narrows the devices after the launcher counted 8: still refused
    narrowed = accelerate_launch(["--gpu_ids", "0,1", *args], env=env_with(site))
    assert narrowed.returncode != 0 and not results(narrowed), explain(narrowed)
    assert (
        "4 processes requested but only 2 NPU(s) are visible (ASCEND_RT_VISIBLE_DEVICES=0,1)"
        in narrowed.stdout + narrowed.stderr
    ), explain(narrowed)

    stock = accelerate_launch(args, env=env_with(site, ACCEL_NPU_DISABLE="1", **extra))
    # stock accelerate starts all 4 ranks on 2 devices (HCCL fails much later on real hardware)
    assert stock.returncode == 0, explain(stock)
    recs = results(stock)
    assert [r["rank"] for r in recs] == [0, 1, 2, 3]
    assert all(r["env"]["TASK_QUEUE_ENABLE"] is None for r in recs)  # stock: no Ascend defaults
    assert all(r["env"]["TORCH_HCCL_ENABLE_MONITORING"] is None and r["env"]["HCCL_DESYNC_DEBUG"] is None for r in recs)
    assert all(r["torch_npu"] for r in recs)


@pytest.mark.slow
def test_worker_environment_defaults_user_values_win(tmp_path):
    site = make_site(tmp_path)
    proc = accelerate_launch(
        ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", str(SCRIPTS / "print_worker_env.py")],
        env=env_with(
            site,
            HCCL_EXEC_TIMEOUT="99",
            ASCEND_RT_VISIBLE_DEVICES="0,1",
            TORCH_HCCL_DESYNC_DEBUG="0",
            TORCH_HCCL_TRACE_BUFFER_SIZE="50",
        ),
    )
    assert proc.returncode == 0, explain(proc)
    recs = results(proc)
    assert len(recs) == 2
    for r in recs:
        assert r["env"]["TASK_QUEUE_ENABLE"] == "2"
        assert r["env"]["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
        assert r["env"]["CPU_AFFINITY_CONF"] == "1"
        assert r["env"]["HCCL_CONNECT_TIMEOUT"] == "1200"
        assert r["env"]["HCCL_EXEC_TIMEOUT"] == "99"  # the user's value wins
        assert r["env"]["DEEPSPEED_TIMEOUT"] == "30"  # DeepSpeed's 10 min would kill jobs at 600 s
        assert r["env"]["DS_ACCELERATOR"] == "npu"
        # hang diagnosis: torch_npu's watchdog, desync report, heartbeat monitor and flight recorder;
        # a user value for either name of a renamed switch leaves both alone
        # (both watchdog switches stay at torch_npu's defaults: asynchronous error handling is already on)
        assert r["env"]["HCCL_ASYNC_ERROR_HANDLING"] is None and r["env"]["TORCH_HCCL_ASYNC_ERROR_HANDLING"] is None
        assert r["env"]["TORCH_HCCL_DESYNC_DEBUG"] == "0" and r["env"]["HCCL_DESYNC_DEBUG"] is None
        assert r["env"]["TORCH_HCCL_ENABLE_MONITORING"] == "1" and r["env"]["TORCH_HCCL_DUMP_ON_TIMEOUT"] == "1"
        assert r["env"]["TORCH_HCCL_TRACE_BUFFER_SIZE"] == "50"
        assert r["torch_npu"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no-device-nodes", "visible-ids-descending"])
def test_torch_npu_without_a_usable_npu_refuses_the_launch(case, tmp_path):
    """torch_npu installed, no usable NPU: stock trains on the CPU without a word; accel-npu refuses
    with the cause, unless ACCEL_NPU_BACKEND=cpu says the CPU is meant."""
    site = make_site(tmp_path)
    extra = {"STANDIN_NPU_DEVICE_COUNT": "0"} if case == "no-device-nodes" else {"ASCEND_RT_VISIBLE_DEVICES": "1,0"}
    args = ["--num_processes", "2", "--num_machines", "1", str(SCRIPTS / "print_worker_env.py")]
    refused = accelerate_launch(args, env=env_with(site, **extra))
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and not results(refused), explain(refused)
    assert "torch_npu is installed but no NPU is usable:" in out and "Traceback" not in out, explain(refused)
    if case == "no-device-nodes":
        assert "there are no /dev/davinci* device nodes" in out
    else:
        assert "ASCEND_RT_VISIBLE_DEVICES=1,0: the ids are not in ascending order" in out and "=0,1" in out
    on_purpose = accelerate_launch(args, env=env_with(site, ACCEL_NPU_BACKEND="cpu", **extra))
    assert on_purpose.returncode == 0 and len(results(on_purpose)) == 2, explain(on_purpose)
    stock = accelerate_launch(args, env=env_with(site, ACCEL_NPU_DISABLE="1", **extra))
    assert stock.returncode == 0 and results(stock), explain(stock)  # stock: on the CPU, without a word


@pytest.mark.slow
def test_npu_config_without_torch_npu_refuses_the_launch(tmp_path):
    """launch_configs/npu_zero2.yaml on a machine without torch_npu: refused, not trained on the CPU."""
    from ..launch_utils import REPO

    proc = accelerate_launch(
        ["--config_file", str(REPO / "launch_configs" / "npu_zero2.yaml"), str(SCRIPTS / "print_worker_env.py")]
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not results(proc), explain(proc)
    assert "npu_zero2.yaml was written for the npu backend, but torch_npu is not installed here" in out
    assert "ACCEL_NPU_BACKEND=cpu" in out and "Traceback" not in out, explain(proc)


@pytest.mark.slow
def test_decord_fix_holds_with_transfer_to_npu_imported(tmp_path):
    """transfer_to_npu makes torch.cuda.is_available() answer for the NPUs: accel-npu's "is CUDA
    here" must still say no, so decord.gpu(0) decodes on the CPU (decord has no NPU decoder)."""
    import numpy as np

    from tests.test_video import make_frames, write_raw_avi

    site = make_site(tmp_path)
    clip = write_raw_avi(tmp_path / "clip.avi", make_frames())
    code = (
        "import torch, torch_npu\nimport torch_npu.contrib.transfer_to_npu\nimport decord\n"
        f"reader = decord.VideoReader({clip!r}, ctx=decord.gpu(0))\n"
        "print('RESULT', torch.cuda.is_available(), len(reader), int(reader[3].asnumpy().sum()))"
    )
    ours = py(code, env_with(site))
    assert ours.returncode == 0, explain(ours)
    expected = int(np.asarray(make_frames()[3], dtype=np.int64).sum())
    assert f"RESULT True 6 {expected}" in ours.stdout, explain(ours)
    stock = py(code, env_with(site, ACCEL_NPU_DISABLE="1"))
    assert stock.returncode != 0 and "CUDA not enabled" in stock.stderr, explain(stock)


def py_probes(probes: dict[str, str], env: dict) -> dict[str, subprocess.CompletedProcess]:
    """Each of ``probes`` (name: code) run in turn in one ``py`` process, each in a namespace of its own, for
    probes that need the stand-in's import and accel-npu's activation behind them but no process of their own.
    Returns, per probe, the process with the stdout that probe printed (stderr and exit status: the process's)."""
    code = "".join(
        f"print('PROBE-BEGIN {name}', flush=True)\n"
        f"exec(compile({source!r}, {name!r}, 'exec'), {{'__name__': '__main__'}})\n"
        f"print('PROBE-END {name}', flush=True)\n"
        for name, source in probes.items()
    )
    proc = py(code, env)
    out = {}
    for name in probes:
        printed = proc.stdout.split(f"PROBE-BEGIN {name}\n", 1)[-1].split(f"PROBE-END {name}\n", 1)
        stdout = printed[0] if len(printed) == 2 else ""  # a probe that did not finish printed nothing of use
        out[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, proc.stderr)
    return out


INTERNAL_FORMAT_PROBE = (
    "import torch, torch_npu\n"
    "try:\n    torch.npu.config.allow_internal_format\n    readable = True\n"
    "except AttributeError:\n    readable = False\n"
    "print('RESULT', readable, torch_npu._C.options_set)"
)


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The allow_internal_format, AdamW/autocast and GradScaler probes: one process with accel-npu (the
    allow_internal_format one first: the options set before any probe ran), one stock."""
    site = make_site(tmp_path_factory.mktemp("probes"))
    return {
        "ours": py_probes(
            {"internal_format": INTERNAL_FORMAT_PROBE, "adamw": ADAMW_PROBE, "scaler": SCALER_PROBE}, env_with(site)
        ),
        "stock": py_probes({"adamw": ADAMW_PROBE, "scaler": SCALER_PROBE}, env_with(site, ACCEL_NPU_DISABLE="1")),
    }


@pytest.mark.slow
def test_allow_internal_format_is_left_as_torch_npu_sets_it(probes):
    """torch_npu's default is already "disable" and its config is write-only (upstream
    npu_config.py `_npuConfig`): accel-npu sets nothing, so nothing in a script that reads or sets it
    changes. Witness: the options the stand-in's `_npu_setOption` received."""
    proc = probes["ours"]["internal_format"]
    assert proc.returncode == 0, explain(proc)
    assert "RESULT False []" in proc.stdout, explain(proc)


# -- torch/torch_npu pairing and libraries on the loader path -------------------------------------
@pytest.mark.slow
def test_torch_torch_npu_pairing_mismatch_is_one_clear_error(tmp_path):
    site = make_site(tmp_path, version="2.7.1.post2")
    stock = py("import torch, torch_npu", env_with(site, ACCEL_NPU_DISABLE="1"))
    assert "undefined symbol" in last_line(stock)
    # known from metadata alone: said once at startup even when nothing imports torch_npu directly
    quiet = py("import torch", env_with(site))
    assert quiet.returncode == 0
    assert quiet.stderr.count("are not a pair") == 1 and "pip install 'torch==2.7.1'" in quiet.stderr, quiet.stderr
    # still an ImportError for code that probes `try: import torch_npu`
    ours = py(
        "import torch\ntry:\n import torch_npu\nexcept ImportError as e:\n print('caught', type(e).__name__)\n raise",
        env_with(site),
    )
    assert ours.returncode != 0 and "caught NpuEnvironmentError" in ours.stdout, ours.stderr[-2000:]
    line = last_line(ours)
    assert line.startswith(
        "accel_npu.plugins.devices.npu.diagnostics.NpuEnvironmentError: accel-npu: torch_npu cannot be loaded"
    ), line
    assert f"torch {torch.__version__} and torch_npu 2.7.1.post2 are not a pair" in line
    assert "Fix: pip install 'torch==2.7.1'" in line

    npu = npu_report(env_with(site))["sections"]["NPU"]
    assert (
        npu["torch/torch_npu pairing"].startswith("PROBLEM: torch ")
        and "pip install 'torch==2.7.1'" in npu["torch/torch_npu pairing"]
    )
    assert "undefined symbol" in npu["import torch_npu"]


@pytest.mark.slow
def test_broken_torch_npu_refuses_launch_before_workers(tmp_path):
    site = make_site(tmp_path, version="2.7.1.post2")
    proc = accelerate_launch(
        ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", str(SCRIPTS / "print_worker_env.py")],
        env=env_with(site),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not results(proc)
    assert "LaunchError: accel-npu: torch_npu cannot be loaded" in out and "Traceback" not in out, explain(proc)
    assert "pip install 'torch==2.7.1'" in out


@pytest.mark.slow
def test_missing_libraries_on_loader_path(tmp_path):
    site = make_site(tmp_path)
    base = dict(STANDIN_REQUIRE_LD_LIBRARY_PATH="1", LD_LIBRARY_PATH="")
    stock = py("import torch, torch_npu", env_with(site, ACCEL_NPU_DISABLE="1", **base))
    assert last_line(stock) == "OSError: libc10.so: cannot open shared object file: No such file or directory"
    ours = py("import torch, torch_npu", env_with(site, **base))
    line = last_line(ours)
    fix = f"export LD_LIBRARY_PATH={TORCH_LIB}:{site / 'torch_npu' / 'lib'}:$LD_LIBRARY_PATH"
    assert "NpuEnvironmentError" in line and fix in line, line
    assert f"libtorch_npu.so: {site / 'torch_npu' / 'lib'} (not on LD_LIBRARY_PATH)" in line

    npu = npu_report(env_with(site, **base))["sections"]["NPU"]
    assert npu["libtorch_npu.so"] == f"{site / 'torch_npu' / 'lib'} (not on LD_LIBRARY_PATH)"
    assert npu["libc10.so"] == f"{TORCH_LIB} (not on LD_LIBRARY_PATH)"
    assert fix in npu["import torch_npu"]

    # the printed fix is exact: with it applied torch_npu loads (the report imports it)
    npu = npu_report(
        env_with(site, STANDIN_REQUIRE_LD_LIBRARY_PATH="1", LD_LIBRARY_PATH=f"{TORCH_LIB}:{site / 'torch_npu' / 'lib'}")
    )["sections"]["NPU"]
    assert npu["torch/torch_npu pairing"].startswith("ok") and npu["devices"] == 8 and "import torch_npu" not in npu
    assert npu["libtorch_npu.so"].endswith("(on LD_LIBRARY_PATH)")


@pytest.mark.slow
@pytest.mark.parametrize("lib", ["libhccl.so", "libascendcl.so"])
def test_cann_not_sourced_gets_set_env_not_ld_library_path(lib, tmp_path):
    """A CANN library missing from the loader path: the fix is CANN's set_env.sh,
    found beside ASCEND_TOOLKIT_HOME; torch's own libraries keep the LD_LIBRARY_PATH fix (above).
    Also when the script imports torch_npu before torch: torch_npu turns autoload off while it
    imports torch, so none of accel-npu's entry point runs, and the startup hook diagnoses it (stock,
    torch_npu's own ImportError: test_cann_not_sourced_under_torch_backend_autoload)."""
    site = make_site(tmp_path)
    env = env_with(site, STANDIN_MISSING_CANN_LIB=lib, ASCEND_TOOLKIT_HOME="/opt/Ascend/ascend-toolkit/latest")
    line = last_line(py("import torch, torch_npu", env))
    assert "NpuEnvironmentError" in line and f"{lib} is part of CANN" in line, line
    assert "Fix: source /opt/Ascend/ascend-toolkit/set_env.sh" in line and "LD_LIBRARY_PATH" not in line, line
    default = last_line(py("import torch_npu", env_with(site, STANDIN_MISSING_CANN_LIB=lib)))
    assert "NpuEnvironmentError" in default and f"{lib} is part of CANN" in default, default
    assert "Fix: source /usr/local/Ascend/ascend-toolkit/set_env.sh" in default, default


#: prints the ``torch.backends`` entry points in the order torch is about to call them (what
#: torch/__init__.py ``_import_device_backends`` iterates), then imports torch
ORDER_THEN_IMPORT_TORCH = (
    "from importlib.metadata import entry_points; "
    "print('ORDER', [e.name for e in entry_points(group='torch.backends')], flush=True); "
    "import torch"
)


def backend_entry_points(proc) -> list[str]:
    return eval(next(l for l in proc.stdout.splitlines() if l.startswith("ORDER"))[len("ORDER ") :])


@pytest.mark.slow
def test_cann_not_sourced_under_torch_backend_autoload(tmp_path):
    """torch >= 2.5 imports torch_npu inside `import torch` (its torch.backends entry point) and wraps a
    failure in "Failed to load the backend extension" (torch/__init__.py _import_device_backends).
    Stock: torch's message over torch_npu's ImportError. Ours: accel-npu's diagnosis is that
    ImportError, one line with CANN's set_env.sh -- in either entry-point order."""
    site = make_site(tmp_path, autoload=True)
    cann = dict(STANDIN_MISSING_CANN_LIB="libhccl.so", ASCEND_TOOLKIT_HOME="/opt/Ascend/ascend-toolkit/latest")

    def diagnosis(proc) -> str:
        lines = [
            line
            for line in proc.stderr.splitlines()
            if line.startswith(
                "accel_npu.plugins.devices.npu.diagnostics.NpuEnvironmentError: accel-npu: torch_npu cannot be loaded"
            )
        ]
        assert len(lines) == 1 and "libhccl.so is part of CANN" in lines[0], proc.stderr[-3000:]
        assert "Fix: source /opt/Ascend/ascend-toolkit/set_env.sh" in lines[0]
        return lines[0]

    def stock_shows_torch_and_torch_npu_only(stock):
        assert stock.returncode != 0 and last_line(stock).startswith(
            "RuntimeError: Failed to load the backend extension: torch_npu"
        ), stock.stderr[-2000:]
        assert "ImportError: libhccl.so: cannot open shared object file" in stock.stderr
        assert "accel-npu" not in stock.stderr and "accel_npu" not in stock.stderr, stock.stderr[-2000:]

    # stock, ACCEL_NPU_DISABLE=1: accel-npu's entry point and startup hook do nothing, so the order
    # below does not matter to it (one run for both)
    first = env_with(site, **cann)
    stock_shows_torch_and_torch_npu_only(py("import torch", dict(first, ACCEL_NPU_DISABLE="1")))

    # torch_npu found after accel-npu (appended to sys.path): accel-npu's entry point runs first
    append = f"import sys; sys.path.append({str(site)!r}); "
    ours = py(append + ORDER_THEN_IMPORT_TORCH, base_env(**cann))
    assert backend_entry_points(ours)[-1] == "torch_npu", ours.stdout
    assert ours.returncode != 0 and last_line(ours).startswith("RuntimeError: Failed to load the backend extension")
    diagnosis(ours)

    # found the other way round (torch_npu first on sys.path, through PYTHONPATH): its entry point
    # runs, and fails, before accel-npu's. The startup hook (accel_npu_startup.pth, which every install
    # shape puts in site-packages: tests/test_install_shapes.py) diagnoses the import in a bare `python`
    assert "_accel_npu_startup" in sys.modules, (
        "accel_npu_startup.pth did not run in this interpreter: an "
        "install from before setup.py wrote it? pip install -e . again"
    )
    bare = py(ORDER_THEN_IMPORT_TORCH, first)
    assert backend_entry_points(bare)[0] == "torch_npu", bare.stdout
    assert bare.returncode != 0 and last_line(bare).startswith(
        "RuntimeError: Failed to load the backend extension: torch_npu"
    ), bare.stderr[-3000:]
    diagnosis(bare)
    # accel-npu's own command says it as one line
    proc = subprocess.run(
        [str(BIN / "accel-npu"), "env", "--no-import"], env=first, capture_output=True, text=True, timeout=180, cwd="/"
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: accel-npu: torch_npu cannot be loaded (ImportError: libhccl.so"), proc.stderr
    assert "Fix: source /opt/Ascend/ascend-toolkit/set_env.sh" in proc.stderr.splitlines()[0]


# -- mx_driving patcher (DrivingSDK's real module paths) ------------------------------------------
MX_PROBE = """
import torch
import transformers
from transformers.models.qwen3 import modeling_qwen3
import mx_driving
print('RESULT', __import__('json').dumps({'calls': mx_driving.CALLS, 'cuda': torch.cuda.is_available is
torch.npu.is_available,
      'rms_norm_from': modeling_qwen3.Qwen3RMSNorm.forward.__module__,
      'transformers_spec_loader': type(transformers.__spec__.loader).__name__}))
"""


@pytest.mark.slow
def test_mx_driving_patcher_2_0_adds_transformers_npu_before_transformers_is_imported(tmp_path):
    """patcher 2.0 (DrivingSDK master): default_patcher.add(TransformersNPU).apply(), before the
    script's `import transformers`; importing mx_driving.patcher brings transfer_to_npu."""
    site = make_site(tmp_path, mx="v2")
    ours = results(py(MX_PROBE, env_with(site, ACCEL_NPU_MX_DRIVING="1")))[0]
    assert ours["calls"] == [
        "default_patcher.add(TransformersNPU)",
        "default_patcher.apply() [transformers imported before: False]",
    ], ours
    assert ours["rms_norm_from"] == "mx_driving.patcher.transformers_patch", ours  # TransformersNPU applied
    assert ours["cuda"] is True  # transfer_to_npu came with mx_driving.patcher (torch.cuda -> torch.npu)
    assert ours["transformers_spec_loader"] != "_AlreadyImported", ours  # transformers ran once, its spec intact
    off = results(py(MX_PROBE, env_with(site)))[0]  # off unless ACCEL_NPU_MX_DRIVING=1
    stock = results(py(MX_PROBE, env_with(site, ACCEL_NPU_MX_DRIVING="1", ACCEL_NPU_DISABLE="1")))[0]
    for other in (off, stock):
        assert other["calls"] == [] and other["rms_norm_from"] == "transformers.models.qwen3.modeling_qwen3", other
        assert other["cuda"] is False, other  # no transfer_to_npu


@pytest.mark.slow
def test_mx_driving_patcher_1_0_builder(tmp_path):
    """patcher 1.0 (DrivingSDK branch_v7.2.RC1 .. branch_v26.0.0): default_patcher_builder.build().__enter__(),
    whose __enter__ imports transfer_to_npu; no TransformersNPU exists there, and `accel-npu env` says so."""
    site = make_site(tmp_path, mx="v1")
    ours = py(
        "import torch, torch_npu, mx_driving; print('CALLS', mx_driving.CALLS)",
        env_with(site, ACCEL_NPU_MX_DRIVING="1"),
    )
    assert (
        "CALLS ['default_patcher_builder.build().__enter__()', 'transfer_to_npu', 'patch index -> torch', "
        "'patch batch_matmul -> torch']"
    ) in ours.stdout, explain(ours)
    status = npu_report(env_with(site, ACCEL_NPU_MX_DRIVING="1"))["sections"]["NPU"]["mx_driving"]
    assert status == (
        "applied: mx_driving.patcher.default_patcher_builder.build().__enter__() (patcher 1.0: no TransformersNPU)"
    ), status


# -- precision, NPU half: autocast remap and fused AdamW ------------------------------------------
ADAMW_PROBE = """
import json, torch, torch_npu
p = torch.nn.Parameter(torch.randn(4))
opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
loss = (p * 2).sum()
scaler.scale(loss).backward()
before = p.detach().clone()
scaler.step(opt); scaler.update()
import warnings
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with torch.autocast("cuda", dtype=torch.bfloat16) as ac:
        autocast = [ac.device, str(ac.fast_dtype), torch.is_autocast_enabled(ac.device)]
print("RESULT " + json.dumps({"autocast": autocast, "fused": opt.param_groups[0]["fused"],
      "scaling_into_step": getattr(opt, "_step_supports_amp_scaling", False), "moved": float((p.detach() -
      before).abs().max())}))
"""


@pytest.mark.slow
def test_npu_autocast_remap_and_adamw_fused_without_grad_scale_in_the_fused_step(probes):
    ours, stock = (results(probes[side]["adamw"])[0] for side in ("ours", "stock"))
    assert ours["autocast"] == ["npu", "torch.bfloat16", True]  # autocast("cuda") remapped on the npu backend
    assert stock["autocast"] == ["cuda", "torch.bfloat16", False]  # stock: disabled
    assert ours["fused"] is True and ours["scaling_into_step"] is False
    assert stock["fused"] is None and stock["scaling_into_step"] is False
    # the scaler unscaled the gradient itself: an AdamW step moves each weight by ~lr
    assert abs(ours["moved"] - 0.1) < 1e-4 and abs(stock["moved"] - 0.1) < 1e-4


SCALER_PROBE = """
import json, warnings, torch, torch_npu
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    scalers = [torch.cuda.amp.GradScaler(), torch.amp.GradScaler("cuda"), torch.GradScaler("cuda")]
print("RESULT " + json.dumps({"scalers": [[s._device, s.is_enabled()] for s in scalers]}))
"""


@pytest.mark.slow
def test_npu_cuda_grad_scaler_scales_on_npu(probes):
    """A "cuda" GradScaler is torch's GradScaler on "npu" where autocast('cuda') runs on npu (torch_npu
    implements its _amp_foreach_non_finite_check_and_unscale_ / _amp_update_scale_ kernels: Ascend/pytorch
    test/custom_ops/test_amp_foreach_non_finite_check_and_unscale.py); stock disables it."""
    assert results(probes["ours"]["scaler"])[0]["scalers"] == [["npu", True]] * 3
    assert results(probes["stock"]["scaler"])[0]["scalers"] == [["cuda", False]] * 3


@pytest.mark.slow
def test_910a_without_bf16_says_autocast_runs_fp32(tmp_path):
    """A 910A has no bf16 (torch.npu.get_amp_supported_dtype() lists only fp16/fp32): autocast('cuda',
    bf16) is off there, and accel-npu says so once instead of claiming a bf16 remap."""
    site = make_site(tmp_path)
    proc = py(ADAMW_PROBE, env_with(site, STANDIN_NPU_SOC="Ascend910A"))
    ours = results(proc)[0]
    assert ours["autocast"] == ["npu", "torch.bfloat16", False], ours
    assert proc.stderr.count("has no bfloat16 autocast") == 1 and "runs in float32" in proc.stderr
    assert "runs as torch.autocast('npu'" not in proc.stderr


@pytest.mark.slow
def test_selftest_runs_the_npu_checks_and_fails_without_cann(tmp_path):
    """`accel-npu env --selftest` on the npu backend (the stand-in, a 910A, one visible NPU): the npu
    plugin's checks run against torch_npu; this machine has no CANN libraries and the stand-in no NPU
    kernels, so those checks fail, each saying why, and the exit status is 1."""
    from ..test_selftest import check_lines, selftest

    site = make_site(tmp_path)
    proc = selftest(
        env_with(
            site,
            ASCEND_RT_VISIBLE_DEVICES="0",
            STANDIN_NPU_SOC="Ascend910A",
            ASCEND_TOOLKIT_HOME="/opt/Ascend/ascend-toolkit/latest",
        ),
        timeout_s=150,
    )
    lines = check_lines(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("accel-npu self-test: backend npu (npu, hccl, 1 device(s))"), proc.stdout
    assert lines["CANN libraries"].startswith("failed: OSError: cannot load libascendcl.so"), lines
    assert "Fix: source /opt/Ascend/ascend-toolkit/set_env.sh" in lines["CANN libraries"], lines
    assert lines["import torch_npu"] == f"ok (torch_npu {TORCH_BASE}.post1)", lines
    assert lines["CANN / SoC / bf16"] == (
        "ok (CANN 8.2.RC1, SoC Ascend910A, bf16 NOT supported (autocast bf16 runs float32, AdamW uses foreach))"
    ), lines
    assert lines["visible devices"] == "ok (torch.npu.device_count() = 1 (ASCEND_RT_VISIBLE_DEVICES=0))", lines
    assert lines["mx_driving"] == "skipped: ACCEL_NPU_MX_DRIVING is not 1", lines
    assert lines["matmul"].startswith("failed:"), lines  # the stand-in has no NPU kernels
    # the launch went through accel-npu's launcher (its worker defaults), though torch_npu, imported by this
    # process, left TORCH_DEVICE_BACKEND_AUTOLOAD=0 in its environment
    assert (
        lines["launch (torchrun)"] == "ok (1 rank(s); DS_ACCELERATOR=npu, DEEPSPEED_TIMEOUT=30, HCCL_EXEC_TIMEOUT=1800)"
    )
    assert lines["ZeRO-2 step"].startswith(
        "failed: 1-rank torchrun exited with status 1 before reporting: rank 0 failed:"
    ), lines  # DeepSpeed needs more of torch.npu than the stand-in has
    assert (
        proc.stdout.rstrip()
        .splitlines()[-1]
        .startswith(
            f"{sum(not s.startswith('failed') for s in lines.values())}"
            f" of {len(lines)} checks did not fail; FAILED: CANN libraries"
        )
    )


# -- device visibility read as torch_npu reads it -------------------------------------------------
VISIBILITY_VALUES = ["0,1", "3,1", "0, 1", "1,0", "0,,1", "0,1,", "", "abc", "0,9", "7", "8", "0-3", "2,3,4", " 0,1"]


@pytest.mark.slow
def test_visible_devices_are_counted_as_the_standin_torch_npu_counts_them(tmp_path):
    """Our parse against the stand-in's (which mirrors torch_npu/npu/__init__.py, cited there), value
    by value, on an 8-NPU machine."""
    from accel_npu.plugins.devices.npu.visibility import visible_devices

    code = (
        "import json, os, sys, torch, torch_npu\nout = {}\nfor v in json.loads(sys.argv[1]):\n"
        "    os.environ['ASCEND_RT_VISIBLE_DEVICES'] = v\n    out[v] = torch.npu.device_count()\n"
        "print('RESULT ' + json.dumps(out))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(VISIBILITY_VALUES)],
        env=env_with(make_site(tmp_path), ACCEL_NPU_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=180,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    standin = json.loads(proc.stdout.split("RESULT ", 1)[1])
    ours = {v: visible_devices(v, 8).count for v in VISIBILITY_VALUES}
    assert ours == standin
    assert {v: n for v, n in standin.items() if v in ("3,1", "0, 1", "0,9")} == {"3,1": 0, "0, 1": 1, "0,9": 1}


@pytest.mark.slow
@pytest.mark.parametrize("gpu_ids,standin_count,fix", [("3,1", 0, "1,3"), ("0, 1", 1, "0,1")])
def test_gpu_ids_torch_npu_reads_differently_are_refused_before_any_worker(gpu_ids, standin_count, fix, tmp_path):
    site = make_site(tmp_path)
    args = [
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--gpu_ids",
        gpu_ids,
        str(SCRIPTS / "print_worker_env.py"),
    ]
    ours = accelerate_launch(args, env=env_with(site))
    out = ours.stdout + ours.stderr
    assert ours.returncode != 0 and not results(ours), explain(ours)  # no worker started
    assert "Traceback" not in out and "ASCEND_RT_VISIBLE_DEVICES" in out and f"--gpu_ids {fix}" in out, explain(ours)
    stock = accelerate_launch(args, env=env_with(site, ACCEL_NPU_DISABLE="1"))
    # stock starts both workers, which torch_npu gives fewer NPUs than processes
    assert [r["npu_count"] for r in results(stock)] == [standin_count, standin_count], explain(stock)


@pytest.mark.slow
def test_desync_debug_is_left_off_and_a_busy_hccl_port_range_is_avoided(tmp_path):
    """HCCL_DESYNC_DEBUG costs two store writes per collective: torch_npu's default (off) stays. With
    another job holding HCCL's default ports, the workers get a free HCCL_IF_BASE_PORT."""
    import socket

    site = make_site(tmp_path)
    args = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", str(SCRIPTS / "print_worker_env.py")]
    with hccl_default_ports_busy() as busy:
        proc = accelerate_launch(args, env=env_with(site, ASCEND_RT_VISIBLE_DEVICES="0,1"))
    assert proc.returncode == 0, explain(proc)
    for r in results(proc):
        assert r["env"]["HCCL_DESYNC_DEBUG"] is None and r["env"]["TORCH_HCCL_DESYNC_DEBUG"] is None
        port = int(r["env"]["HCCL_IF_BASE_PORT"])
        assert port > busy
        with socket.socket() as probe:  # an independent look: the chosen range is bindable
            probe.bind(("", port))


@pytest.mark.slow
def test_an_npu_used_in_a_forked_dataloader_worker_is_explained_after_the_traceback(tmp_path):
    site = make_site(tmp_path)
    script = str(SCRIPTS / "npu_forked_worker.py")
    ours = subprocess.run(
        [sys.executable, script], env=env_with(site), capture_output=True, text=True, timeout=180, cwd="/"
    )
    stock = subprocess.run(
        [sys.executable, script],
        env=env_with(site, ACCEL_NPU_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=180,
        cwd="/",
    )
    for proc in (ours, stock):  # the stand-in's torch_npu refused in the worker; the DataLoader re-raised it
        assert proc.returncode == 1 and "Cannot re-initialize NPU in forked subprocess" in proc.stderr, proc.stderr
    assert 'multiprocessing_context="spawn"' in last_line(ours), ours.stderr[-2000:]
    assert "accel-npu" not in stock.stderr


@pytest.mark.parametrize(
    "message,names",
    [
        # vllm-ascend #405: HcclGetRootInfo with port 60000 held by another job
        (
            "createHCCLComm: HCCL function error: HcclGetRootInfo(&hcclID), error code is 11\nEJ0003: Failed to bind "
            "the IP "
            "port. Reason: The IP address and port have been bound already.\nhost nic listen start failed, port[60000]",
            "HCCL_IF_BASE_PORT=60032",
        ),
        ("Communication_Error_Bind_IP_Port(EI0019)", "HCCL_IF_BASE_PORT="),
        # csrc/core/npu/NPUGraph.cpp capture_begin (v7.1.0.2 .. master)
        (
            "Do not support TASK_QUEUE_ENABLE = 2 during NPU graph capture, please export TASK_QUEUE_ENABLE=1/0.",
            "TASK_QUEUE_ENABLE=1",
        ),
    ],
)
def test_hccl_port_clash_and_graph_capture_errors_are_explained(message, names, monkeypatch):
    from accel_npu.plugins.explain_errors.excepthook import explanations

    monkeypatch.delenv("HCCL_IF_BASE_PORT", raising=False)
    try:
        raise RuntimeError("the collective failed") from RuntimeError(message)
    except RuntimeError as exc:
        lines = explanations(exc)
    assert len(lines) == 1 and names in lines[0], lines
    assert explanations(RuntimeError("a bug in the script")) == []


PARTIAL_STATE_PROBE = (
    "import json, os\nfrom accelerate import PartialState\nstate = PartialState()\n"
    "print('RESULT ' + json.dumps({'rank': state.process_index, 'backend': state.backend, "
    "'device': str(state.device)}), flush=True)"
)


@pytest.mark.slow
def test_a_rank_without_a_usable_npu_refuses_instead_of_training_on_the_cpu(tmp_path):
    """A per-rank ASCEND_RT_VISIBLE_DEVICES (here `env VAR=1,0 python`, as a wrapper script would set it)
    slips past the launcher's check, which reads torchrun's own environment: each rank's torch_npu sees
    no NPU. accel-npu's cpu backend used to start gloo ranks there without a word; now each rank refuses
    with the variable's name and the fix, before any process group (no rendezvous, so no hang), unless
    ACCEL_NPU_BACKEND=cpu says the CPU is meant. Stock never names the cause."""
    site = make_site(tmp_path)
    cmd = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--no-python",
        "env",
        "ASCEND_RT_VISIBLE_DEVICES=1,0",
        sys.executable,
        "-c",
        PARTIAL_STATE_PROBE,
    ]

    def run(**extra):
        return subprocess.run(cmd, env=env_with(site, **extra), capture_output=True, text=True, timeout=240, cwd="/")

    ours = run()
    assert ours.returncode != 0 and not results(ours), explain(ours)
    refusals = [line for line in ours.stderr.splitlines() if line.startswith("accel_npu.errors.NoUsableDeviceError")]
    # each rank refuses; torchrun may stop the second before it prints (SIGTERM after the first exits)
    assert refusals and all(
        "has no usable NPU, and a rank of a launched job does not fall back to the CPU" in line
        and "ASCEND_RT_VISIBLE_DEVICES=1,0: the ids are not in ascending order" in line
        and "ASCEND_RT_VISIBLE_DEVICES=0,1" in line
        for line in refusals
    ), explain(ours)
    on_purpose = run(ACCEL_NPU_BACKEND="cpu")
    recs = results(on_purpose)
    assert on_purpose.returncode == 0 and [(r["rank"], r["backend"], r["device"].split(":")[0]) for r in recs] == [
        (0, "gloo", "cpu"),
        (1, "gloo", "cpu"),
    ], explain(on_purpose)
    stock = run(ACCEL_NPU_DISABLE="1")
    assert "ASCEND_RT_VISIBLE_DEVICES" not in stock.stdout + stock.stderr, explain(stock)


# -- across machines: what each machine checks before its workers start ----------------------------
@pytest.mark.slow
def test_two_machines_check_their_hccl_interface_before_any_worker_starts(tmp_path):
    """Two 'machines' on this one (static rendezvous on 127.0.0.1), one NPU rank each, the stand-in
    torch_npu. A HCCL_SOCKET_IFNAME no interface here matches, or a HCCL_IF_IP that is not this
    machine's, is refused before any worker starts, naming the variable, the value, this machine's
    interfaces and the fix; stock starts the workers (on Ascend HCCL fails only at its first
    communicator, after the model loaded). Good values pass, and the workers get HCCL_CONNECT_TIMEOUT."""
    from ..launch_utils import free_port, run_concurrently

    site = make_site(tmp_path)

    def machine(rank: int, port: int, **extra):
        args = [
            "--multi_gpu",
            "--num_machines",
            "2",
            "--machine_rank",
            str(rank),
            "--num_processes",
            "2",
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            str(SCRIPTS / "print_worker_env.py"),
        ]
        return lambda: accelerate_launch(args, env=env_with(site, ASCEND_RT_VISIBLE_DEVICES="0", **extra), timeout=240)

    good, stock = free_port(), free_port()
    main, other, bad_name, bad_ip = run_concurrently(
        machine(0, good, HCCL_IF_IP="127.0.0.1"),
        machine(1, good, HCCL_SOCKET_IFNAME="lo"),
        machine(1, free_port(), HCCL_SOCKET_IFNAME="=enp61s0f0"),
        machine(1, free_port(), HCCL_IF_IP="203.0.113.7"),
    )
    for proc in (main, other):
        assert proc.returncode == 0, explain(proc)
    recs = results(main) + results(other)
    assert sorted(r["rank"] for r in recs) == [0, 1], explain(main) + explain(other)
    assert all(r["env"]["HCCL_CONNECT_TIMEOUT"] == "1200" for r in recs), recs  # the default for 2 ranks

    for proc, value in ((bad_name, "HCCL_SOCKET_IFNAME==enp61s0f0"), (bad_ip, "HCCL_IF_IP=203.0.113.7")):
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and not results(proc) and "Traceback" not in out, explain(proc)
        assert "LaunchError: accel-npu: machine rank 1 of 2 refuses to start its workers: " + value in out, explain(
            proc
        )
        assert "it has: lo 127.0.0.1" in out, explain(proc)  # what this machine has
    assert "no interface on this machine matches that exact name" in bad_name.stderr + bad_name.stdout
    assert "is not an address of this machine" in bad_ip.stderr + bad_ip.stdout

    stock_main, stock_other = run_concurrently(
        machine(0, stock, ACCEL_NPU_DISABLE="1", HCCL_IF_IP="203.0.113.7"),
        machine(1, stock, ACCEL_NPU_DISABLE="1", HCCL_SOCKET_IFNAME="=enp61s0f0"),
    )
    stock_recs = results(stock_main) + results(stock_other)
    assert sorted(r["rank"] for r in stock_recs) == [0, 1], explain(stock_main) + explain(stock_other)
    assert {r["env"]["HCCL_IF_IP"] or r["env"]["HCCL_SOCKET_IFNAME"] for r in stock_recs} == {
        "203.0.113.7",
        "=enp61s0f0",
    }
    assert all(r["env"]["HCCL_CONNECT_TIMEOUT"] is None for r in stock_recs)

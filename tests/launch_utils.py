"""Helpers to run real `accelerate launch` / torchrun processes from tests (no mocks)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
# upstream files vendored byte for byte (third_party/README.md)
THIRD_PARTY = REPO / "third_party"
# diffusers v0.40.0's training scripts
UPSTREAM_EXAMPLES = THIRD_PARTY / "diffusers-v0.40.0" / "examples"


# the installed diffusers' release: which official scripts its users run, and how they launch (below)
INSTALLED_DIFFUSERS = Version(importlib.metadata.version("diffusers"))


def _examples_of_installed_diffusers() -> Path:
    """The vendored examples/ a user of the installed diffusers runs: each official script starts with
    check_min_version(<its release>), so v0.40.0's stop under an older diffusers, whose users run the scripts
    of their release: v0.39.0's (what pip resolves beside transformers 4.x, torch_npu 2.5.1's set) and
    v0.35.2's (the lower set), vendored for the version matrix."""
    for release, folder in (("0.40.0", UPSTREAM_EXAMPLES.parent.name), ("0.39.0", "diffusers-v0.39.0")):
        if INSTALLED_DIFFUSERS >= Version(release):
            return THIRD_PARTY / folder / "examples"
    return THIRD_PARTY / "diffusers-v0.35.2" / "examples"  # the declared lower bound's


# the official scripts of the installed diffusers' release (the ones the version matrix's "official" check runs)
RELEASE_EXAMPLES = _examples_of_installed_diffusers()


def release_examples_env(env: dict) -> dict:
    """``env`` for a launch of a RELEASE_EXAMPLES script. The LoRA scripts end with
    ``load_lora_weights(output_dir)``, no weight_name; diffusers before 0.41 refuses that under HF_HUB_OFFLINE even
    for a local folder (loaders/lora_base.py ``_best_guess_weight_name``), so their launches run without it:
    every path the tests' runs read is local, and online mode reaches no hub."""
    if INSTALLED_DIFFUSERS < Version("0.41.0"):
        env = {k: v for k, v in env.items() if k != "HF_HUB_OFFLINE"}
    return env


BIN = Path(sys.executable).parent


def source_tree(dest: Path) -> Path:
    """The repository's files as a fresh clone of this working tree has them (tracked, and untracked but not
    ignored): what a wheel is built from, never this checkout's venvs, .nox sessions or build output."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import versions  # benchmarks/versions.py: the snapshot nox sessions install

    versions.snapshot(REPO, dest)
    return dest


# the official scripts the tests run: the vendored copies, or a checkout's examples/ named by DIFFUSERS_EXAMPLES_DIR
OFFICIAL_EXAMPLES = Path(os.environ.get("DIFFUSERS_EXAMPLES_DIR") or UPSTREAM_EXAMPLES)
# CI runs one official script per distinct shape; RUN_OFFICIAL_MATRIX=1 runs the tests/test_official_*.py
# launches beyond that subset too (minutes each; tools/compatibility.py runs the whole matrix)
OFFICIAL_MATRIX = os.environ.get("RUN_OFFICIAL_MATRIX", "") == "1"
OFFICIAL_MATRIX_REASON = (
    "beyond CI's subset of official scripts (one per shape): set RUN_OFFICIAL_MATRIX=1 to run "
    "these launches, or run tools/compatibility.py"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def hccl_default_ports_busy():
    """Another job's listener inside HCCL's default port range while the block runs (CANN's default
    HCCL_IF_BASE_PORT; yields the port held)."""
    from accel_npu.plugins.devices.npu.worker_env import HCCL_DEFAULT_BASE_PORT

    port = HCCL_DEFAULT_BASE_PORT + 3
    with socket.socket() as held:
        try:
            held.bind(("", port))
            held.listen()
        except OSError:
            pass  # something on this machine holds it already: the case under test either way
        yield port


def base_env(**extra: str) -> dict[str, str]:
    """A clean environment for launched processes: one thread per rank, no accel-npu switches
    inherited from the test runner, unless given in ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_NPU_", "ACCELERATE_"))}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "MASTER_PORT": str(free_port()),
        }
    )
    # stock DeepSpeed JIT-builds its shm comm op under a lock file (torch/utils/file_baton.py): one build
    # folder per venv, so two venvs' runs never rebuild each other's, nor wait on a lock a killed build left
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


#: accelerate's FSDP2 config for 2 CPU ranks, fp32: sharded state dicts, no auto wrap (the test models are tiny)
FSDP2_CPU_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "NO_WRAP",
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    },
    "num_machines": 1,
    "num_processes": 2,
    "machine_rank": 0,
    "mixed_precision": "no",
    "use_cpu": False,
}


def write_deepspeed_config(
    directory: Path,
    ds_config: dict,
    name: str = "ds_config.json",
    *,
    num_processes: int = 2,
    accelerate_extra: dict | None = None,
) -> Path:
    """Write a DeepSpeed JSON and an accelerate YAML pointing at it; return the YAML path."""
    directory.mkdir(parents=True, exist_ok=True)
    ds_path = directory / name
    ds_path.write_text(json.dumps(ds_config, indent=2))
    cfg = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {"deepspeed_config_file": str(ds_path), "zero3_init_flag": False},
        "num_machines": 1,
        "num_processes": num_processes,
        "machine_rank": 0,
        "main_training_function": "main",
        "use_cpu": False,
    }
    cfg.update(accelerate_extra or {})
    yaml_path = directory / (Path(name).stem + ".yaml")
    yaml_path.write_text(yaml.safe_dump(cfg))
    return yaml_path


@contextlib.contextmanager
def one_rank_deepspeed_group(monkeypatch):
    """A 1-rank gloo group with DeepSpeed's comm layer on it, as `accelerate launch` gives one
    (deepspeed.zero.Init needs LOCAL_RANK), for in-process tests. On leaving: any HF DeepSpeed config
    selected inside is unset and the group destroyed."""
    import torch.distributed as dist

    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(k, v)
    # accelerate's DeepSpeedPlugin sets ACCELERATE_USE_DEEPSPEED in os.environ: a later test's Accelerator()
    # in this worker would then take the DeepSpeed path
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        import importlib

        import deepspeed
        import deepspeed.utils.groups

        # DeepSpeed caches its groups per process: those of an earlier test's (destroyed) group are stale
        importlib.reload(deepspeed.utils.groups)
        # DeepSpeed's comm backend set up now, with accel-npu active (no shm op build); stock halves reuse it
        deepspeed.comm.init_distributed(dist_backend="gloo")
        yield
    finally:
        import gc

        from transformers.integrations import unset_hf_deepspeed_config

        from accel_npu._torch import zero

        unset_hf_deepspeed_config()
        dist.destroy_process_group()
        # this test's engines are done: one still referenced somewhere must not make a later test's
        # loads in this worker "beside a live engine" (built whole)
        gc.collect()
        zero._engines.clear()


@contextlib.contextmanager
def accelerator_deepspeed_session(monkeypatch):
    """accel-npu's patches applied and a one-rank DeepSpeed group (``one_rank_deepspeed_group``) for a test
    that builds Accelerators in-process; on leaving, accelerate's shared state is reset (a later test's
    ``Accelerator()`` in this worker must not inherit this one's DeepSpeed plugin) and the patches reapplied."""
    import accel_npu

    accel_npu.patch()
    with one_rank_deepspeed_group(monkeypatch):
        try:
            yield
        finally:
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(True)
            GradientState._reset_state()
    accel_npu.patch()


#: ZeRO-3 bf16, every parameter partitioned: what accelerate's plugin hands transformers/diffusers in tests
#: that select it in-process (``select_zero3_plugin``)
ZERO3_BF16_T0 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "bf16": {"enabled": True},
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
}


def select_zero3_plugin():
    """accelerate's ZeRO-3 plugin (zero3_init_flag true) selected, as ``Accelerator()`` leaves it at launch.
    Returns (config, plugin); the caller keeps the plugin alive (transformers holds a weak reference)."""
    from accelerate.utils import DeepSpeedPlugin

    config = json.loads(json.dumps(ZERO3_BF16_T0))  # a copy: DeepSpeed fills in its config
    plugin = DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=True)
    plugin.set_deepspeed_weakref()
    return config, plugin


def partitioned(model) -> bool:
    """Whether DeepSpeed's zero.Init built ``model`` in ZeRO-3 partitions (any parameter holds a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def restore_torch_linear() -> None:
    """deepspeed.zero.Init swaps F.linear for its memory-efficient version for the rest of the process
    ("This will persist unless manually reset"): put torch's back so outputs compare bit for bit and later
    tests see torch's own."""
    import torch
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as ds_init

    torch.nn.functional.linear = getattr(ds_init, "linear_bk", torch.nn.functional.linear)


def shipped_zero_configs(directory: Path) -> dict[str, Path]:
    """The configs the upstream-script tests launch: ``zero2`` = the shipped cpu_zero2 as it is;
    ``zero3_t0`` = the shipped cpu_zero3 (zero3_init_flag true) with stage3_param_persistence_threshold
    0, every parameter partitioned as a real-size UNet is. Written into ``directory``."""
    out = {}
    for label, base, threshold0 in (("zero2", "cpu_zero2", False), ("zero3_t0", "cpu_zero3", True)):
        ds = json.loads((REPO / "launch_configs" / f"{base}.deepspeed.json").read_text())
        if threshold0:
            ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        ds_path = directory / f"{label}.deepspeed.json"
        ds_path.write_text(json.dumps(ds, indent=2))
        cfg = yaml.safe_load((REPO / "launch_configs" / f"{base}.yaml").read_text())
        cfg["deepspeed_config"]["deepspeed_config_file"] = str(ds_path)
        out[label] = directory / f"{label}.yaml"
        out[label].write_text(yaml.safe_dump(cfg))
    return out


def zero_config(stage: int, bf16: bool = False, **zero_extra) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True})
    zero.update(zero_extra)
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc/<pid>/stat), parents first."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.append(child)
                frontier.append(child)
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it. torch's elastic agent starts each rank in a session
    of its own (torch/distributed/elastic/multiprocessing/subprocess_handler: start_new_session=True), so
    killing the launcher's process group leaves the ranks running, orphaned."""
    for member in reversed(process_tree(pid)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def _run(cmd: list[str], env: dict[str, str], cwd: Path | None, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True), but a timeout kills the whole process tree."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def accelerate_launch(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `accelerate launch ARGS` as a user would; returns the finished process (text output)."""
    if "--main_process_port" not in args:
        # accelerate's DeepSpeed path ignores MASTER_PORT (always 29500): pick a free port here.
        args = ["--main_process_port", str(free_port()), *args]
    cmd = [str(BIN / "accelerate"), "launch", *args]
    return _run(cmd, env or base_env(), cwd, timeout)


def torchrun_launch(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None, nproc: int = 2
) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc_per_node NPROC ARGS` on the environment's MASTER_PORT (``base_env``
    picks a free one); returns the finished process (text output). Stock accelerate starts one
    process on a CPU-only machine, so this is how a stock half gets its ranks."""
    env = env or base_env()
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", env["MASTER_PORT"], *args]
    return _run(cmd, env, cwd, timeout)


def run_concurrently(*calls):
    """Call each function in its own thread and return their results in order: independent
    launches overlap (a launch leaves a core idle while its launcher starts and its ranks exit).
    Only for launches whose assertions do not time anything. The first exception is re-raised."""
    import threading

    out, errors = [None] * len(calls), [None] * len(calls)

    def run(i, fn):
        try:
            out[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return out


def results(proc: subprocess.CompletedProcess) -> list[dict]:
    """The `RESULT {json}` records printed by test scripts, sorted by rank; also when two ranks' lines ended
    up on one line (a record cut short by another rank's print is not a record: skipped)."""
    out = []
    decoder = json.JSONDecoder()
    for line in (proc.stdout + proc.stderr).splitlines():
        for part in line.split("RESULT ")[1:]:
            try:
                out.append(decoder.raw_decode(part)[0])
            except ValueError:
                pass
    return sorted(out, key=lambda r: r.get("rank", 0))


def ended_by_launcher(text: str, rank: int) -> bool:
    """torchrun's failure summary shows ``rank`` ended by SIGTERM: its agent stops every worker once one
    has failed (torch/distributed/elastic/multiprocessing/api.py), so a rank failing later than another
    may be ended before it prints its own error."""
    return re.search(rf"rank\s*: {rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*: -15", text) is not None


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"

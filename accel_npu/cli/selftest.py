"""``accel-npu env --selftest``: the one command to run on a new machine.

Every check runs in a fresh subprocess with the environment launched workers get (the backend's
launch defaults, accel-npu's bootstrap): one ``python -m accel_npu.cli.selftest`` process for the
single-process checks, and one real ``torchrun`` launch (which goes through accel-npu's launcher)
for the distributed ones. Both run at the same time; each check prints one line
(``ok`` / ``failed: why`` / ``skipped: why``) and any failure makes the exit status non-zero.

Checks come from two places: the active backend's plugin (``accel_npu_selftest_checks``: CANN
libraries, ``import torch_npu``, SoC and bf16, visible devices, ...) and the device checks below,
which are the same on every backend (matmul, autocast("cuda"), AdamW fused vs foreach, GradScaler,
accelerate's fp16 scaler, bf16 ``.numpy()``). A check is a ``"module:function"`` called with no arguments in the
subprocess:
it returns a one-line detail, raises :class:`CheckSkipped`, or raises anything else (failed).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time

from accel_npu._torch.nodes import SINGLE

#: a check line's marker in the subprocesses' output
MARK = "ACCEL_NPU_SELFTEST "
#: wall-clock limit of the two subprocesses, which run side by side (`--timeout`); the summary line
#: says how long each took, so a machine that needs more shows it
DEFAULT_TIMEOUT_S = 110


class CheckSkipped(Exception):
    """Raised by a check that does not apply here; the message says why."""


# -- the device checks every backend runs (in the single-process subprocess) -------------------------
def _device():
    import torch

    from accel_npu.backend import current_backend

    backend = current_backend()
    return (
        torch,
        backend,
        (torch.device(backend.device_type, 0) if backend.device_type != "cpu" else torch.device("cpu")),
    )


def check_matmul() -> str:
    torch, backend, device = _device()
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=gen)
    got = (a.to(device) @ a.to(device)).cpu().double()
    want = a.double() @ a.double()
    diff = float((got - want).abs().max())
    if diff > 1e-2:
        raise AssertionError(f"64x64 float32 matmul on {device} differs from the CPU by {diff:.3g}")
    defaults = ", ".join(
        f"{k}={os.environ[k]}"
        for k in ("TASK_QUEUE_ENABLE", "PYTORCH_NPU_ALLOC_CONF", "CPU_AFFINITY_CONF")
        if k in os.environ
    )
    return f"64x64 float32 on {device} matches the CPU (max diff {diff:.1e})" + (f"; {defaults}" if defaults else "")


def _bf16_supported(torch, backend) -> bool:
    if backend.device_type == "cpu":
        return True
    module = getattr(torch, backend.device_type, None)
    probe = getattr(module, "is_bf16_supported", None)
    return bool(probe()) if probe else True


def check_autocast() -> str:
    torch, backend, device = _device()
    layer = torch.nn.Linear(8, 8).to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 8, device=device))
    want = torch.bfloat16 if _bf16_supported(torch, backend) else torch.float32
    if out.device.type != device.type or out.dtype != want:
        raise AssertionError(
            f"torch.autocast('cuda', bfloat16) gave {out.dtype} on {out.device}; expected {want} on {device.type}"
        )
    return f"torch.autocast('cuda', bfloat16) -> {str(out.dtype).replace('torch.', '')} on {out.device.type}" + (
        "" if want == torch.bfloat16 else " (this device has no bfloat16: float32 is right)"
    )


def check_adamw() -> str:
    torch, backend, device = _device()
    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(256, generator=gen), torch.randn(256, generator=gen)
    results, used = {}, {}
    for kind in ("fused", "foreach"):
        p = torch.nn.Parameter(start.clone().to(device))
        opt = torch.optim.AdamW([p], lr=0.1, **{kind: True})
        p.grad = grad.clone().to(device)
        opt.step()
        results[kind] = p.detach().cpu()
        used[kind] = bool(opt.param_groups[0].get("fused"))
    diff = float((results["fused"] - results["foreach"]).abs().max())
    moved = float((results["foreach"] - start).abs().max())
    if diff > 1e-5 or not 0.05 < moved < 0.15:
        raise AssertionError(f"one AdamW step: fused and foreach differ by {diff:.3g} (step size {moved:.3g})")
    kernel = "fused kernel" if used["fused"] else "fused unavailable here (foreach used)"
    return f"one step on {device.type}, {kernel} vs foreach: max diff {diff:.1e}"


def check_grad_scaler() -> str:
    torch, backend, device = _device()
    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.AdamW([p], lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = (p * 2).sum()
    scaler.scale(loss).backward()
    p.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    moved = float((p.detach().cpu() - 1).abs().max())
    if moved != 0 or scaler.get_scale() != 512.0:
        raise AssertionError(
            f"a step with an inf gradient was not skipped (weights moved {moved}, scale {scaler.get_scale()})"
        )
    return f"float16 GradScaler on {device.type}: the step with an injected inf was skipped, scale 1024 -> 512"


def check_accelerate_fp16() -> str:
    """accelerate's own fp16 path: ``mixed_precision: fp16`` makes the Accelerator build its scaler with
    ``accelerate.utils.get_grad_scaler`` (torch.npu.amp.GradScaler on NPU, torch.amp.GradScaler("cuda")
    elsewhere) and step the optimizer the script made: a default AdamW, fused on npu. torch_npu's
    scaler hands ``grad_scaler=`` to an optimizer whose ``_step_supports_amp_scaling`` is set, which
    torch's AdamW.step does not take; a disabled "cuda" scaler would train fp16 unscaled."""
    torch, backend, device = _device()
    from accelerate.utils import get_grad_scaler

    p = torch.nn.Parameter(torch.ones(4, device=device))
    opt = torch.optim.AdamW([p], lr=0.1, weight_decay=0.0)
    scaler = get_grad_scaler()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = (p * 2).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    moved = float((p.detach().cpu() - 1).abs().max())
    kind = f"{type(scaler).__module__}.{type(scaler).__name__}"
    if not scaler.is_enabled():
        raise AssertionError(
            f"accelerate's fp16 scaler ({kind}) is disabled here: fp16 would train without loss scaling"
        )
    if abs(moved - 0.1) > 1e-3:
        raise AssertionError(
            f"one AdamW step through accelerate's fp16 scaler ({kind}) moved the weights by {moved:.3g}, not lr=0.1"
        )
    fused = "fused" if opt.param_groups[0].get("fused") else "not fused"
    return f"{kind} on {device.type} (scale {scaler.get_scale():g}) stepped AdamW ({fused}) by lr"


def check_bf16_numpy() -> str:
    import warnings

    torch, backend, device = _device()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        array = torch.full((3,), 1.5, dtype=torch.bfloat16, device=device).cpu().numpy()
    if array.tolist() != [1.5, 1.5, 1.5]:
        raise AssertionError(f"bfloat16 .numpy() gave {array!r}")
    return f"bfloat16 tensor .cpu().numpy() -> {array.dtype} array"


DEVICE_CHECKS = (
    ("matmul", "accel_npu.cli.selftest:check_matmul"),
    ("autocast('cuda')", "accel_npu.cli.selftest:check_autocast"),
    ("AdamW fused vs foreach", "accel_npu.cli.selftest:check_adamw"),
    ("GradScaler inf step", "accel_npu.cli.selftest:check_grad_scaler"),
    ("accelerate fp16 scaler step", "accel_npu.cli.selftest:check_accelerate_fp16"),
    ("bf16 .numpy()", "accel_npu.cli.selftest:check_bf16_numpy"),
)
#: what the torchrun launch reports (accel_npu/cli/_selftest_dist.py), in order
LAUNCH_CHECKS = ("launch (torchrun)", "all_reduce + barrier", "timeout ordering", "get_accelerator()", "ZeRO-2 step")


# -- running checks in the subprocess -------------------------------------------------------------
def emit(name: str, status: str, detail: str) -> None:
    print(MARK + json.dumps({"name": name, "status": status, "detail": detail}), flush=True)


def run_check(name: str, ref: str) -> None:
    module_name, _, function = ref.partition(":")
    try:
        detail = getattr(importlib.import_module(module_name), function)()
    except CheckSkipped as exc:
        emit(name, "skipped", str(exc))
    except BaseException as exc:  # noqa: BLE001 - one failed line, then the next check
        emit(name, "failed", one_line(f"{type(exc).__name__}: {exc}"))
        if environment_trace():
            import traceback

            traceback.print_exc()
    else:
        emit(name, "ok", str(detail or ""))


def one_line(text: str, limit: int = 400) -> str:
    """The first line of an error (torch's dispatcher errors list every kernel), at most ``limit`` chars."""
    first = (text.strip().splitlines() or [""])[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."


def environment_trace() -> bool:
    from accel_npu import environment

    return environment.flag("ACCEL_NPU_TRACE")


def _subprocess_main(checks: list[list[str]]) -> int:
    from accel_npu import activation

    activation.activate(strict=False)  # before torch: a failing torch_npu gets accel-npu's diagnosis
    for name, ref in checks:
        run_check(name, ref)
    return 0


# -- the command ----------------------------------------------------------------------------------
def checks_for(backend) -> list[tuple[str, str]]:
    from accel_npu.manager import get_plugin_manager

    checks: list[tuple[str, str]] = []
    for result in get_plugin_manager().hook.accel_npu_selftest_checks(backend=backend):
        checks.extend(tuple(c) for c in result or ())
    return checks + list(DEVICE_CHECKS)


def worker_environment(backend, num_processes: int, environ) -> tuple[dict, str | None]:
    """What a launcher gives its workers (the plugins' launch defaults where this environment sets
    nothing, accel-npu's bootstrap first on PYTHONPATH), and why it would refuse (None: it would not)."""
    import accel_npu.activation._bootstrap as bootstrap
    from accel_npu import environment
    from accel_npu.manager import get_plugin_manager

    pm = get_plugin_manager()
    env, refused = dict(environ), None
    try:
        pm.hook.accel_npu_check_launch(backend=backend, num_processes=num_processes, env=dict(env), nodes=SINGLE)
    except Exception as exc:  # noqa: BLE001 - reported as a failed line; the checks still run
        refused = str(exc)
    for defaults in pm.hook.accel_npu_launch_env(backend=backend, env=dict(env), nodes=SINGLE, launching=True):
        for key, value in (defaults or {}).items():
            env.setdefault(key, str(value))
    # the single-process checks stand in for a launched rank, where the CUDA façade family applies
    # (accel_npu/scopes.py); a value the user set is what their ranks get, so it is kept
    environment.opt_into_cuda_facade(env)
    paths = [os.path.dirname(os.path.abspath(bootstrap.__file__))]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env, refused


def _parse(output: str) -> list[dict]:
    lines = []
    for line in output.splitlines():
        if line.startswith(MARK):
            try:
                lines.append(json.loads(line[len(MARK) :]))
            except ValueError:
                continue
    return lines


def _rank_error(stderr: str) -> str | None:
    """A launched rank's own one-line reason (accel_npu/cli/_selftest_dist.py prints it)."""
    lines = [line for line in (stderr or "").splitlines() if line.startswith("accel-npu self-test: rank ")]
    return one_line(lines[0][len("accel-npu self-test: ") :]) if lines else None


def _tail(text: str, n: int = 3) -> str:
    lines = [l for l in (text or "").splitlines() if l.strip()]
    return " | ".join(lines[-n:])[-600:]


def run_selftest(out=None, timeout: float = DEFAULT_TIMEOUT_S) -> int:
    out = out or sys.stdout
    # the environment as the user set it: importing torch_npu leaves TORCH_DEVICE_BACKEND_AUTOLOAD=0
    # in os.environ (torch_npu/__init__.py), which would switch accel-npu off in the launch below
    env = dict(os.environ)
    from accel_npu import activation
    from accel_npu.backend import current_backend

    activation.activate(strict=False)
    try:
        import torch  # noqa: F401 - imported for its effect: the torch.backends entry points run
    except RuntimeError as exc:  # a torch.backends entry point failed (torch_npu without CANN, ...)
        why = exc.__cause__ if exc.__cause__ is not None else exc
        print(f"  import torch  failed: {why} ({exc})", file=out, flush=True)
        return 1

    backend = current_backend()
    started = time.monotonic()
    checks = checks_for(backend)
    nproc = 2 if backend.device_type == "cpu" or (backend.device_count or 0) >= 2 else 1
    worker_env, refused = worker_environment(backend, 1, env)
    print(
        f"accel-npu self-test: backend {backend.name} ({backend.device_type}, {backend.dist_backend}, "
        f"{backend.device_count} device(s)); every check in a fresh process with the workers' environment",
        file=out,
        flush=True,
    )
    launch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "_selftest_dist.py"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    single = subprocess.Popen(
        [sys.executable, "-m", "accel_npu.cli.selftest", json.dumps(checks)],
        env=worker_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    results: list[dict] = []
    if refused:
        results.append({"name": "worker environment", "status": "failed", "detail": refused})
    results += _collect(single, [n for n, _ in checks], timeout - (time.monotonic() - started), "single-process checks")
    single_s = time.monotonic() - started
    results += _collect(launch, list(LAUNCH_CHECKS), timeout - (time.monotonic() - started), f"{nproc}-rank torchrun")
    launch_s = time.monotonic() - started
    width = max(len(r["name"]) for r in results)
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['detail']}"
        detail = f" ({r['detail']})" if r["status"] == "ok" and r["detail"] else ""
        print(f"  {r['name'].ljust(width)}  {status}{detail}", file=out, flush=True)
    failed = [r["name"] for r in results if r["status"] == "failed"]
    print(
        f"{len(results) - len(failed)} of {len(results)} checks did not fail"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
        + f" (single-process checks done after {single_s:.0f} s, the {nproc}-rank launch after {launch_s:.0f} s, "
        f"side by side; --timeout {timeout:.0f} s)",
        file=out,
        flush=True,
    )
    return 1 if failed else 0


def _collect(proc: subprocess.Popen, names: list[str], timeout: float, what: str) -> list[dict]:
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 5))
        why = f"{what} exited with status {proc.returncode} before reporting: {_rank_error(stderr) or _tail(stderr)}"
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        why = f"{what} did not finish within {timeout:.0f} s: {_tail(stderr)}"
    got = {r["name"]: r for r in _parse(stdout)}
    return [got.get(name, {"name": name, "status": "failed", "detail": why}) for name in names] + [
        r for name, r in got.items() if name not in names
    ]


if __name__ == "__main__":
    # run as the importable module, whose CheckSkipped the plugins' checks raise (not __main__'s copy)
    from accel_npu.cli import selftest as _selftest

    sys.exit(_selftest._subprocess_main(json.loads(sys.argv[1])))

"""`accel-npu env --selftest` on this CPU machine: every check really runs — the
device checks on the cpu backend, a 2-rank torchrun through accel-npu's launcher (gloo all_reduce,
DeepSpeed's cpu accelerator, one ZeRO-2 step) — NPU-only ones say why they are skipped, exit 0.
The failing case (non-zero exit) runs against the torch_npu stand-in: tests/contract."""

import subprocess

import pytest

from .launch_utils import BIN, base_env


def selftest(env, timeout_s=240):
    return subprocess.run(
        [str(BIN / "accel-npu"), "env", "--selftest", "--timeout", str(timeout_s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 60,
        cwd="/",
    )


def check_lines(stdout: str) -> dict[str, str]:
    """{check title: 'ok (...)' / 'failed: ...' / 'skipped: ...'} from the report's indented lines."""
    lines = {}
    for line in stdout.splitlines():
        if line.startswith("  "):
            title, _, status = line.strip().partition("  ")
            lines[title.strip()] = status.strip()
    return lines


@pytest.mark.slow
def test_selftest_on_cpu_runs_every_check_and_exits_0():
    proc = selftest(base_env())
    lines = check_lines(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.startswith("accel-npu self-test: backend cpu (cpu, gloo"), proc.stdout
    assert lines["matmul"].startswith("ok (64x64 float32 on cpu matches the CPU")
    assert lines["autocast('cuda')"] == "ok (torch.autocast('cuda', bfloat16) -> bfloat16 on cpu)"
    assert lines["AdamW fused vs foreach"].startswith("ok (one step on cpu, fused kernel vs foreach")
    assert lines["GradScaler inf step"].startswith(
        "ok (float16 GradScaler on cpu: the step with an injected inf was skipped"
    )
    assert lines["accelerate fp16 scaler step"] == (
        "ok (torch.amp.grad_scaler.GradScaler on cpu (scale 65536) stepped AdamW (not fused) by lr)"
    )
    assert lines["bf16 .numpy()"] == "ok (bfloat16 tensor .cpu().numpy() -> float32 array)"
    assert lines["launch (torchrun)"].startswith("ok (2 rank(s); DS_ACCELERATOR=cpu")  # the launcher's default
    assert lines["all_reduce + barrier"] == "ok (gloo over 2 ranks on cpu)"
    # read from the live group: DeepSpeed's init_distributed gives it 10 minutes (deepspeed/constants.py)
    assert (
        lines["timeout ordering"] == "skipped: gloo has no HCCL_EXEC_TIMEOUT (the live process group's timeout: 600 s)"
    )
    assert lines["get_accelerator()"] == "ok (cpu/gloo)"
    assert lines["ZeRO-2 step"].startswith("ok (one step on 2 rank(s), weights moved")
    assert not [t for t, s in lines.items() if s.startswith("failed")], lines
    assert "CANN libraries" not in lines  # the npu plugin's checks belong to the npu backend


def test_accelerate_fp16_check_fails_where_the_scaler_is_disabled(monkeypatch):
    """The check's other half: a scaler accelerate builds disabled (accelerate < 1.16 builds
    torch.amp.GradScaler("cuda") on a cpu machine, which torch disables without CUDA) fails the check,
    whatever accelerate is installed; with accelerate >= 1.16 stock builds GradScaler("cpu") itself."""
    import warnings

    import accelerate.utils
    import torch
    from packaging.version import Version

    import accel_npu
    from accel_npu.cli.selftest import check_accelerate_fp16
    from tests.inprocess import stock

    accel_npu.patch()
    assert check_accelerate_fp16().startswith("torch.amp.grad_scaler.GradScaler on cpu")
    with stock(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if Version(accelerate.__version__) >= Version("1.16"):
            assert check_accelerate_fp16().startswith("torch.amp.grad_scaler.GradScaler on cpu")
        else:
            with pytest.raises(AssertionError, match="is disabled here"):
                check_accelerate_fp16()
        monkeypatch.setattr(accelerate.utils, "get_grad_scaler", lambda **kw: torch.amp.GradScaler("cuda"))
        with pytest.raises(AssertionError, match="is disabled here"):
            check_accelerate_fp16()

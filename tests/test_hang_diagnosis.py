"""Hang diagnosis: one rank stalls before a collective.

With accel-npu the job fails within ACCEL_NPU_HANG_TIMEOUT (+ a bounded report), every rank that
can prints its Python stacks, and one line names the rank that did not arrive. Stock, the same
run waits on. Witnesses: torchrun's own per-rank log files (--log_dir/--tee), the line numbers
of the collectives in the script's source, wall-clock times, the launcher's exit status.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch_utils import BIN, REPO, SCRIPTS, accelerate_launch, base_env, explain, free_port

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "stall_one_rank.py"
HANG_TIMEOUT = 5
#: from rank 0 entering the collective to the launcher's exit: the timeout, a query round, the
#: launcher stopping the other rank; generous for a loaded 2-core machine
BOUND = HANG_TIMEOUT + 25


def _line(marker: str) -> int:
    """The line number of the script's line containing ``marker`` (read from its source)."""
    lines = SCRIPT.read_text().splitlines()
    [number] = [i for i, text in enumerate(lines, 1) if marker in text]
    return number


def _rank_logs(log_dir: Path, rank: int) -> tuple[str, str]:
    """(stdout, stderr) of one local rank, from the files torchrun's --tee writes."""
    [directory] = [p for p in log_dir.rglob(str(rank)) if (p / "stderr.log").exists()]
    return (directory / "stdout.log").read_text(), (directory / "stderr.log").read_text()


def _entered_at(stdout: str) -> float:
    [entering] = [
        json.loads(line.split("RESULT ", 1)[1])
        for line in stdout.splitlines()
        if "RESULT " in line and '"entering"' in line
    ]
    return entering["at"]


def _torchrun(log_dir: Path, *script_args: str) -> list[str]:
    return [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "--log_dir",
        str(log_dir),
        "--tee",
        "3",
        str(SCRIPT),
        *script_args,
    ]


def _check_report(log_dir: Path, proc, ended_at: float, function: str, marker: str) -> None:
    out0, err0 = _rank_logs(log_dir, 0)
    _, err1 = _rank_logs(log_dir, 1)
    assert proc.returncode != 0, explain(proc)
    waited = ended_at - _entered_at(out0)
    assert HANG_TIMEOUT <= waited < BOUND, (waited, explain(proc))
    assert '"total"' not in out0  # the collective never completed
    # rank 0's stack points at the script's collective; rank 1's at its sleep
    assert f'File "{SCRIPT}", line {_line(marker)}, in {function}' in err0, err0[-4000:]
    assert f'File "{SCRIPT}", line {_line("time.sleep(a.stall)")}, in main' in err1, err1[-4000:]
    assert "accel-npu hang: rank(s) [1] did not arrive" in err0, err0[-4000:]


def test_stalled_rank_named_with_stacks_and_the_job_fails_where_stock_waits_on(tmp_path):
    # Stock half, started first and left running beside the two accel-npu runs: the plain gloo
    # run (the DeepSpeed one does not start at all stock on CPU: tests/test_launch_cpu.py).
    stock_logs = tmp_path / "stock"
    stock = subprocess.Popen(
        _torchrun(stock_logs, "--plain"),
        env=base_env(ACCEL_NPU_DISABLE="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        # 1. DeepSpeed ZeRO-2 through `accelerate launch` with the shipped CPU config: one training
        #    step, then rank 0 waits inside torch.distributed.all_reduce (gloo blocks there).
        logs = tmp_path / "deepspeed"
        proc = accelerate_launch(
            [
                "--config_file",
                str(REPO / "launch_configs" / "cpu_zero2.yaml"),
                "--log_dir",
                str(logs),
                "--tee",
                "3",
                str(SCRIPT),
            ],
            env=base_env(ACCEL_NPU_HANG_TIMEOUT=str(HANG_TIMEOUT)),
            timeout=300,
        )
        _check_report(logs, proc, time.time(), "sum_losses", "dist.all_reduce(total)")

        # 2. Plain gloo through torchrun: rank 0 blocks on an async collective's handle, outside the
        #    collective call, as a host does on HCCL/NCCL. Under torch >= 2.13 the collective is
        #    all_gather_single: unwatched, the report would count the barrier before it and name no one.
        logs = tmp_path / "plain"
        proc = subprocess.run(
            _torchrun(logs, "--plain"),
            env=base_env(ACCEL_NPU_HANG_TIMEOUT=str(HANG_TIMEOUT)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        _check_report(logs, proc, time.time(), "sum_asynchronously", "handle.wait()")
        import torch.distributed as dist

        collective = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_reduce"
        assert f"since {collective} #" in _rank_logs(logs, 0)[1], _rank_logs(logs, 0)[1][-4000:]

        # Stock: the same plain run is still waiting well past the bound the accel-npu runs met.
        stock_entered = None
        deadline = time.monotonic() + 240
        while stock_entered is None and time.monotonic() < deadline and stock.poll() is None:
            try:
                stock_entered = _entered_at(_rank_logs(stock_logs, 0)[0])
            except (ValueError, OSError):  # not there yet
                time.sleep(0.5)
        assert stock_entered is not None, "stock rank 0 never reached the collective"
        time.sleep(max(0.0, stock_entered + BOUND - time.time()))
        assert stock.poll() is None, "stock run ended: it should still be waiting for rank 1"
        _, stock_err0 = _rank_logs(stock_logs, 0)
        assert "accel-npu hang" not in stock_err0
    finally:
        if stock.poll() is None:
            os.killpg(stock.pid, signal.SIGKILL)
        stock.wait()

"""The launch helpers the slow tests share: a timed-out or killed launch leaves no rank running."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.launch_utils import _run, kill_tree, process_tree

# a "launcher" whose "rank" starts a session of its own, as torch's elastic agent starts ranks
LAUNCHER = (
    "import subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True); "
    "print(p.pid, flush=True); time.sleep(120)"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_kill_tree_reaches_ranks_in_sessions_of_their_own():
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    rank = int(launcher.stdout.readline())
    assert rank in process_tree(launcher.pid)
    os.killpg(launcher.pid, 9)  # what killing the launcher's group does: the rank survives
    launcher.wait(10)
    assert _alive(rank)
    os.kill(rank, 9)

    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    rank = int(launcher.stdout.readline())
    kill_tree(launcher.pid)
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


@pytest.mark.slow
def test_run_timeout_kills_the_ranks():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as info:  # 8 s: time to print its rank on a busy machine
        _run([sys.executable, "-c", LAUNCHER], dict(os.environ), None, timeout=8)
    rank = int(info.value.output.split()[0])
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)

"""The hang watch's thread never outlives the interpreter's finalization: a watchdog inside a store
call when the script ends is joined at exit, so the finished run exits 0 instead of aborting with
"terminate called without an active exception" (SIGABRT). Fast: one process, one gloo rank."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch_utils import SCRIPTS, base_env


@pytest.mark.slow
def test_watchdog_inside_a_store_call_at_exit_does_not_abort_the_finished_script():
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "hang_watch_store_call_at_exit.py")],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "inside" in proc.stdout, proc.stdout + proc.stderr  # the main thread ended during the store call
    assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]  # it was -6 (SIGABRT) before the join at exit

"""The fast loop's guard (tests/process_guard.py, hooked in tests/conftest.py), run by pytest on a small
tree of its own: a plain ``pytest`` deselects the tests marked slow, ``--runslow`` runs them, and an
unmarked test that starts a process fails naming it, while a library starting one does not count."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.launch_utils import REPO, base_env

pytestmark = pytest.mark.slow  # runs pytest in a process of its own

TESTS = """
import subprocess, sys

import pytest

import helper


def test_in_process():
    assert 1 + 1 == 2


def test_starts_a_process_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.slow
def test_starts_a_process_marked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_library_starts_one():
    helper.run_a_process()
"""
HELPER = """
import subprocess, sys


def run_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def _run(tmp_path, *args) -> str:
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\nmarkers =\n    slow: starts processes\n")
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "conftest.py").write_text(
        "from tests.conftest import *  # noqa: F403 (the hooks under test)\n"
    )
    (tmp_path / "tests" / "test_sample.py").write_text(TESTS)
    (tmp_path / "lib").mkdir(exist_ok=True)
    (tmp_path / "lib" / "helper.py").write_text(HELPER)
    # the repository's tests package (the conftest hooks) and the library, importable in the inner run
    env = base_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'lib'}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-rf",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "tests" / "test_sample.py"),
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.stdout + proc.stderr


def test_a_plain_run_deselects_slow_and_fails_an_unmarked_test_that_starts_a_process(tmp_path):
    out = _run(tmp_path)
    assert "2 passed, 1 deselected" in out and "1 failed" in out, out
    assert "slow tests (they start processes) deselected: --runslow runs them too" in out, out
    assert "FAILED tests/test_sample.py::test_starts_a_process_unmarked" in out, out
    assert re.search(r"this test starts processes \(\S*python\S* -c pass\) but is not marked slow", out), out
    assert "test_a_library_starts_one" not in out, out  # a library's process is not the test's


def test_runslow_runs_the_marked_tests_too(tmp_path):
    out = _run(tmp_path, "--runslow")
    assert "1 failed, 3 passed" in out and "deselected" not in out, out

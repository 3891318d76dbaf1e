"""Which tests start processes, for tests/conftest.py: a plain ``pytest`` runs the in-process tests only
(the fast loop), so every test that starts a process must be marked ``slow``; an unmarked one fails,
naming the command it started.

A process counts when test code starts it: the innermost caller outside the standard library is a file
under tests/ (``subprocess.run`` in a test or in tests/launch_utils.py, ``multiprocessing`` used by a
test). A library starting its own (DataLoader workers, a compiler probe) is the library's business.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

_STDLIB = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
_originals: dict = {}
#: where test code lives: the session's tests/ folder (set by install)
test_root = Path(__file__).resolve().parent
#: the commands unmarked test code started while the current test ran (None: not watching)
started: list[str] | None = None


def _caller_is_test_code() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        # the standard library and frozen modules (<frozen importlib._bootstrap>) are passed through
        if not path.startswith((*_STDLIB, "<")) or "site-packages" in path:
            return Path(path).resolve().is_relative_to(test_root)
        frame = frame.f_back
    return False


def _describe(args) -> str:
    try:
        command = " ".join(os.fsdecode(a) for a in list(args[0] or [])[:3])
        return command if len(command) <= 80 else command[:77] + "..."
    except (TypeError, IndexError):
        return "a process"


def _watching(original, describe):
    def watched(*args, **kwargs):
        if started is not None and _caller_is_test_code():
            started.append(describe(args))
        return original(*args, **kwargs)

    watched.__wrapped__ = original
    return watched


# subprocess binds fork_exec at import (subprocess._fork_exec); multiprocessing calls _posixsubprocess.fork_exec
# (spawn, forkserver) or os.fork (fork); posix_spawn serves subprocess where close_fds=False
_TARGETS = [
    (subprocess, "_fork_exec", _describe),
    (_posixsubprocess, "fork_exec", _describe),
    (os, "fork", lambda args: "os.fork()"),
    (os, "posix_spawn", lambda args: os.fsdecode(args[0])),
    (os, "posix_spawnp", lambda args: os.fsdecode(args[0])),
]


def install(root: Path) -> None:
    global test_root
    test_root = root.resolve()
    for module, name, describe in _TARGETS:
        original = getattr(module, name, None)
        if original is not None and (module, name) not in _originals:
            _originals[(module, name)] = original
            setattr(module, name, _watching(original, describe))


def uninstall() -> None:
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


def failure_message(commands: list[str]) -> str:
    shown = ", ".join(sorted(set(commands))[:3])
    return (
        f"this test starts processes ({shown}) but is not marked slow: mark it @pytest.mark.slow "
        "(a plain `pytest` runs the in-process tests only; `--runslow` runs the marked ones too)"
    )

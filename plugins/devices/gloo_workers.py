"""Wait, at exit, until gloo's worker threads have put down their last work.

A gloo worker (torch's ``ProcessGroupGloo::runLoop``, thread name ``pt_gloo_runloop``) destroys
each work it ran after the caller's ``wait()`` has returned. Destroying a work drops its tensors,
and dropping a tensor that Python also references takes the GIL (c10 ``intrusive_ptr`` calls
``decref_pyobject`` on the 2 -> 1 transition). If the process reaches interpreter finalization
first, the worker's ``take_gil`` ends the thread with ``pthread_exit``, whose forced unwind through
a ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
exception", SIGABRT, exit -6, after training finished. Freeing a process group joins its workers
(``~ProcessGroupGloo``), but DeepSpeed keeps its groups (``deepspeed.utils.groups``, the engine,
each parameter's ``_dp_group``) to the end, so their workers reach teardown.

Nothing in torch says whether a worker still holds a work, so this reads what the kernel says
each worker thread is doing (``/proc/self/task/<tid>/syscall``). An idle worker sleeps in
``workProduceCV_.wait(lock)``: a futex ``FUTEX_WAIT_BITSET`` with no timeout. Every other state
means it may still be about to drop a work: running or runnable, waiting for the work mutex
(``FUTEX_WAIT``), for the GIL (a timed wait), or for a peer inside a collective (gloo's waits are
timed). The caller sleeps meanwhile, which releases the GIL the worker may need.
"""

from __future__ import annotations

import os
import platform
import time

# futex(2)'s syscall number as /proc/<tid>/syscall prints it, per architecture.
_FUTEX_SYSCALL = {"x86_64": "202", "aarch64": "98"}
_FUTEX_CMD_MASK = 0x7F  # drops FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256)
_FUTEX_WAIT_BITSET = 9  # what glibc's pthread_cond_wait uses; mutexes use FUTEX_WAIT (0)
_THREAD_NAME = "pt_gloo_runloop"  # set by ProcessGroupGloo::runLoop (torch >= 2.6)


def _worker_states() -> dict[str, str]:
    """tid -> the first fields of /proc/self/task/<tid>/syscall, for gloo worker threads."""
    states = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _THREAD_NAME:
                    continue
            with open(f"/proc/self/task/{tid}/syscall") as f:
                states[tid] = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return states


def _idle(syscall_line: str, futex: str) -> bool:
    fields = syscall_line.split()  # nr, then args: uaddr, op, val, timeout, ...
    return (
        len(fields) >= 5
        and fields[0] == futex
        and int(fields[2], 16) & _FUTEX_CMD_MASK == _FUTEX_WAIT_BITSET
        and int(fields[4], 16) == 0
    )


def busy_workers() -> dict[str, str] | None:
    """tid -> state of every gloo worker thread not idle in its queue wait; None if unknowable here."""
    futex = _FUTEX_SYSCALL.get(platform.machine())
    if futex is None or not os.path.isdir("/proc/self/task"):
        return None
    try:
        states = _worker_states()
    except OSError:  # e.g. a kernel that does not let a process read its threads' syscalls
        return None
    return {tid: line for tid, line in states.items() if not _idle(line, futex)}


def wait_until_idle(timeout_s: float, poll_s: float = 0.002) -> dict[str, str] | None:
    """Sleep (GIL released) until every gloo worker is idle or ``timeout_s`` passes.

    Returns the workers still busy (empty: all idle), or None where thread states cannot be read
    (not Linux, an architecture whose futex number is not listed above).
    """
    deadline = time.monotonic() + timeout_s
    busy = busy_workers()
    while busy and time.monotonic() < deadline:
        time.sleep(poll_s)
        busy = busy_workers()
    return busy

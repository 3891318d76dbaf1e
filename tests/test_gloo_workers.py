"""gloo_workers tells an idle gloo worker (asleep in its queue wait) from one that may still drop a work.

The launch-level half (stock aborts, accel-npu exits 0) is in test_launch_cpu.py; here the
classification is checked on real gloo threads of a one-rank group, and on /proc syscall lines
recorded from a C++ program whose threads waited on a std::mutex and on a condition variable
with and without a timeout (x86_64, glibc 2.36).
"""

import platform
import subprocess
import sys

import pytest

from accel_npu.plugins.devices import gloo_workers

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64") or sys.platform != "linux",
    reason="reads Linux /proc thread syscalls",
)

FUTEX = gloo_workers._FUTEX_SYSCALL.get(platform.machine(), "202")


@pytest.mark.parametrize(
    "line, idle",
    [
        # std::condition_variable::wait (gloo's idle queue wait): FUTEX_WAIT_BITSET|PRIVATE|CLOCK_REALTIME, no timeout
        (f"{FUTEX} 0x557d970da148 0x189 0x0 0x0 0x0 0xffffffff 0x7f393ac1bd70 0x7f393b4a3f16", True),
        # std::mutex contention (the work mutex, before the work is dropped): FUTEX_WAIT|PRIVATE
        (f"{FUTEX} 0x557d970da160 0x80 0x2 0x0 0x0 0x0 0x7f393b41ce88 0x7f393b4a412b", False),
        # a timed condition wait (the GIL, gloo's recv inside a collective): a timeout pointer
        (f"{FUTEX} 0x557d970da148 0x89 0x0 0x7f393a41ae70 0x0 0xffffffff 0x7f393a41ad60 0x7f393b4a3f16", False),
        ("running", False),
        ("-1 0x7f393a41ad60 0x7f393b4a3f16", False),  # blocked outside a syscall (e.g. a page fault)
        ("230 0x1 0x0 0x7f0 0x0 0x0 0x0 0x7f3 0x7f3", False),  # clock_nanosleep: Python code sleeping
    ],
)
def test_only_an_untimed_condition_wait_counts_as_idle(line, idle):
    assert gloo_workers._idle(line, FUTEX) is idle


PROBE = r"""
import os, threading, time, torch, torch.distributed as dist
from accel_npu.plugins.devices import gloo_workers
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
print("after_wait", len(gloo_workers.wait_until_idle(5.0)))
main, started, release, inline, callback = threading.get_ident(), threading.Event(), threading.Event(), [], {}
def late(fut):
    if threading.get_ident() == main:  # completed before .then(): ran inline, not on the worker
        inline.append(True)
        return
    callback["tid"] = str(threading.get_native_id())
    started.set()
    release.wait(60)  # on the worker thread, which still holds the work (a timed wait, unlike the queue's)
    callback["ended"] = time.monotonic()
for attempt in range(1000):  # one rank: the work may complete before .then() attaches
    inline.clear()
    dist.all_reduce(torch.ones(4), async_op=True).get_future().then(late)
    if not inline:
        break
started.wait(60)
# the callback's worker is busy every time it is looked at; the other worker is idle at least once (on a
# loaded machine it can be caught off its queue wait for an instant: scheduled, a page fault)
seen = []
for _ in range(10):
    seen.append(gloo_workers.busy_workers())
    time.sleep(0.02)
print("callback_busy", all(callback["tid"] in busy for busy in seen))
print("fewest_busy", min(len(busy) for busy in seen))
print("gave_up_on_it", callback["tid"] in gloo_workers.wait_until_idle(0.1))  # the busy ones, after its timeout
threading.Timer(0.5, release.set).start()
drained = gloo_workers.wait_until_idle(60.0)
print("drained", len(drained), time.monotonic() >= callback.get("ended", float("inf")))
"""


@pytest.mark.slow
def test_a_worker_running_a_work_callback_is_busy_until_it_drops_the_work():
    from tests.launch_utils import base_env, free_port

    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=base_env(PORT=str(free_port())), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert out["after_wait"] == "0"
    assert out["callback_busy"] == "True"
    assert out["fewest_busy"] == "1"  # one of the group's two workers
    assert out["gave_up_on_it"] == "True"
    assert out["drained"] == "0 True", out  # idle only once the callback had returned

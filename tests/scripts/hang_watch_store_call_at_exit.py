"""The hang watch's thread inside a store call (GIL released) when the script ends.

One gloo rank; the watchdog is armed with a world of 2 and a 2.5 s timeout (0.25 s polls), and its
store's counter read blocks for 1 s inside TCPStore, as a round trip to the store can on a loaded
machine. The main thread ends while the watchdog is in that call, and interpreter teardown then
takes a while with the GIL released (a slow ``__del__``, as freeing a large model's state is). A
daemon thread that comes back from C++ after Python started finalizing is ended with
``pthread_exit``, whose forced unwind through pybind11's ``gil_scoped_release`` destructor
(noexcept) calls ``std::terminate``: "terminate called without an active exception", SIGABRT.
Prints ``inside`` once the watchdog is in the call. Never part of a training run.
"""

import datetime
import sys
import threading
import time

import torch.distributed as dist

from accel_npu.plugins.hang_watch import watch

server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
dist.init_process_group("gloo", store=server, rank=0, world_size=1)
client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10))
inside = threading.Event()


class SlowStore:
    """The watchdog's own store connection, whose ``add`` spends 1 s in C++ with the GIL released."""

    def add(self, key, amount):
        inside.set()
        try:
            client.wait([f"never-{time.monotonic()}"], datetime.timedelta(seconds=1))
        except Exception:  # noqa: BLE001 - the timeout: the call is over
            pass
        return 0

    def __getattr__(self, name):
        return getattr(client, name)


watch.Watchdog._own_store = lambda self: SlowStore()
dog = watch.Watchdog(watch.Calls(0, 2, 2.5, None, dist.distributed_c10d._get_default_group()))
dog.start()
if not inside.wait(10):
    sys.exit("the watchdog never called its store")
print("inside", flush=True)


class SlowTeardown:
    def __del__(self, sleep=time.sleep):  # a default argument: module globals are gone by then
        sleep(2)


keep = SlowTeardown()

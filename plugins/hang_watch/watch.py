"""Which collective each rank is in, and the watchdog thread that turns a stuck one into a report.

The hot path only counts collectives per process group. A rank that has waited the hang timeout
(in one call, or idle while another rank is behind: HCCL/NCCL collectives return once queued)
asks every rank for its counters over the process group's store, on a connection of its own so a
blocked main thread cannot block it; it names the ranks that did not arrive, every rank prints its
stacks and exits 1. docs/troubleshooting.md ("A job hangs in a collective") describes the report.
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from types import SimpleNamespace

from accel_npu import environment
from accel_npu._torch.dist import collective_hooks as _hooks
from accel_npu._torch.dist import default_group_timeout, first_timeout, hccl_exec_timeout

from .collectives import COLLECTIVES, SINGLE_TENSOR_COLLECTIVES

log = logging.getLogger("accel_npu")

EXIT_STATUS = 1
_PREFIX = "accel_npu/hang"
_QUERY = f"{_PREFIX}/query"  # counter: one round per suspicion
_ABORT = f"{_PREFIX}/abort"  # the reporting rank (compare_set: one reporter)
_REPORTED = f"{_PREFIX}/reported"  # the reporter has printed its summary
_PRINTED = f"{_PREFIX}/printed"  # counter: ranks that printed their stacks


def _answer_key(round_: int, rank: int) -> str:
    return f"{_PREFIX}/answer/{round_}/{rank}"


def _exited_key(rank: int) -> str:
    return f"{_PREFIX}/exited/{rank}"


def default_timeout(group_timeout: float) -> float:
    """Just under the process-group timeout: a report (timeout + two polls + a query round) is out
    before torch ends the stuck collective itself."""
    return group_timeout - min(60.0, group_timeout / 4)


def poll_interval(timeout: float) -> float:
    return min(5.0, max(0.25, timeout / 10))


class Calls:
    """This process's collectives. Written by the wrapped calls, read by the watchdog thread.

    Groups are held by key (see ``group_key``), never by a strong reference: destroy_process_group
    must still free a gloo group, whose destructor joins its worker threads. A group kept alive
    past it is freed only in interpreter teardown, where a worker still dropping its last work
    needs the GIL and aborts the process (exit -6 after training finished)."""

    __slots__ = (
        "rank",
        "world",
        "timeout",
        "group_timeout",
        "default_group",
        "counts",
        "ops",
        "inflight",
        "last",
        "changed_at",
    )

    def __init__(self, rank: int, world: int, timeout: float, group_timeout: float | None, default_group) -> None:
        self.rank, self.world, self.timeout, self.group_timeout = rank, world, timeout, group_timeout
        self.default_group = weakref.ref(default_group)  # dist.group.WORLD: counted as None, like group=None
        self.counts: dict = {}  # group key -> collectives entered on that group
        self.ops: dict = {}  # group key -> name of the last collective entered on it
        self.inflight: dict = {}  # thread id -> (name, group key, sequence number, entered at)
        self.last = None  # (name, group key, sequence number) of the last call that returned
        self.changed_at = time.monotonic()


def group_key(group):
    """How Calls refers to a group: None for the default one, else a weak reference (equal for the
    same live group). A group object that cannot be weakly referenced is kept as it is."""
    if group is None:
        return None
    try:
        return weakref.ref(group)
    except TypeError:
        return group


def _group_of(key):
    """The group a key refers to; None once it has been freed."""
    from torch.distributed import distributed_c10d as c10d

    if key is None:
        return c10d._get_default_group()
    return key() if isinstance(key, weakref.ref) else key


_calls: Calls | None = None
_off = False  # decided: nothing to watch in this process (one rank, or ACCEL_NPU_HANG_TIMEOUT=0)
_arm_lock = threading.Lock()


def _group_position(function) -> int:
    try:
        return list(inspect.signature(function).parameters).index("group")
    except (TypeError, ValueError):
        return -1


_get_ident = threading.get_ident
_monotonic = time.monotonic


def collective_wrapper(name: str):
    """The wrapt wrapper for the collective ``name``: records entry and exit, and calls
    ``accel_npu._torch.dist.collective_hooks`` when another plugin has set them."""
    at = -2  # position of the `group` parameter; -2: not looked up yet, -1: none

    def wrapper(wrapped, instance, args, kwargs):
        hooks = _hooks
        if hooks.before is None and hooks.failed is None:
            return counted(wrapped, args, kwargs)
        if hooks.before is not None:
            hooks.before(name)
        try:
            return counted(wrapped, args, kwargs)
        except Exception as exc:
            clearer = hooks.failed(exc) if hooks.failed is not None else None
            if clearer is None:
                raise
            raise clearer from None  # the other rank's error says why; the transport's adds nothing

    def counted(wrapped, args, kwargs):
        nonlocal at
        calls = _calls
        if calls is None:
            if _off or (calls := arm()) is None:
                return wrapped(*args, **kwargs)
        inflight = calls.inflight
        me = _get_ident()
        if me in inflight:  # e.g. all_gather_object calls all_gather: one collective, counted once
            return wrapped(*args, **kwargs)
        if "group" in kwargs:
            group = kwargs["group"]
        else:
            if at == -2:
                at = _group_position(wrapped)
            group = args[at] if -1 < at < len(args) else None
        group = None if group is calls.default_group() else group_key(group)
        counts = calls.counts
        seq = counts[group] = counts.get(group, 0) + 1
        calls.ops[group] = name
        calls.changed_at = entered = _monotonic()
        inflight[me] = (name, group, seq, entered)
        try:
            return wrapped(*args, **kwargs)
        finally:
            del inflight[me]
            calls.last = (name, group, seq)
            calls.changed_at = _monotonic()

    return wrapper


#: One wrapper per collective, named by path in the plugin's patches (".watch:COLLECTIVE_WRAPPERS.all_reduce");
#: each keeps its own collective's name and `group` position.
COLLECTIVE_WRAPPERS = SimpleNamespace(
    **{name: collective_wrapper(name) for name in (*COLLECTIVES, *SINGLE_TENSOR_COLLECTIVES)}
)


def init_wrapper(wrapped, instance, args, kwargs):
    """init_process_group: start watching as soon as the group is up, so that a rank stuck before
    its first collective still answers and prints its stacks."""
    result = wrapped(*args, **kwargs)
    if _calls is None and not _off:
        arm()
    return result


def _group_timeout_seconds() -> float | None:
    """When torch ends a stuck collective of the default group (accel_npu._torch.dist)."""
    import torch.distributed as dist

    found = [default_group_timeout()]
    try:
        if dist.get_backend() == "hccl":
            from accel_npu.backend import current_backend

            # the group is up, so the NPU is in use: asking its SoC costs nothing more
            found.append(hccl_exec_timeout(os.environ, soc=current_backend().model()))
    except RuntimeError:
        pass
    return first_timeout(found)


def arm() -> Calls | None:
    """Start watching when a default process group of more than one rank is up (once per group).

    Returns the bookkeeping, or None while there is nothing to watch. Raises ConfigError for an
    unreadable ACCEL_NPU_HANG_TIMEOUT (the launcher refuses it before workers start)."""
    global _calls, _off
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None  # not yet: torch raises its own error for a collective without a group
    with _arm_lock:
        if _calls is not None or _off:
            return _calls
        world = dist.get_world_size()
        configured = environment.hang_timeout()
        if world < 2 or configured == 0:
            _off = True
            return None
        group_timeout = _group_timeout_seconds()
        if configured is None and not group_timeout:
            _off = True
            return None
        timeout = configured if configured is not None else default_timeout(group_timeout)
        if configured is not None and group_timeout and configured >= group_timeout:
            log.warning(
                "accel-npu: ACCEL_NPU_HANG_TIMEOUT=%g s is not below the %g s after which torch ends a stuck "
                "collective (the process-group timeout, or HCCL_EXEC_TIMEOUT): it does so first, without the "
                "hang report",
                configured,
                group_timeout,
            )
        from torch.distributed import distributed_c10d as c10d

        calls = Calls(dist.get_rank(), world, timeout, group_timeout, c10d._get_default_group())
        watchdog = Watchdog(calls)
        _calls = calls
        watchdog.start()
        return calls


def _disarm() -> None:
    global _calls
    with _arm_lock:
        _calls = None


# -- the watchdog --------------------------------------------------------------------------------


def _group_info(key) -> tuple[str, list[int]]:
    """(name as every rank knows it, global ranks) of a group, given its key (see ``group_key``)."""
    from torch.distributed import distributed_c10d as c10d

    pg = _group_of(key)
    if pg is None:
        return "?", []
    try:
        name = c10d._world.pg_names.get(pg) or "?"
    except Exception:  # noqa: BLE001 - private torch state: only a label in the report
        name = "?"
    try:
        ranks = list(c10d.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a group being torn down: only a label in the report
        ranks = []
    return name, ranks


def _ranks_text(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class Watchdog(threading.Thread):
    def __init__(self, calls: Calls) -> None:
        super().__init__(name="accel-npu-hang-watch", daemon=True)
        self.calls = calls
        self.interval = poll_interval(calls.timeout)
        self.answer_wait = self.interval + 2.0
        self.answered = 0
        self.next_idle_check = 0.0
        self.store = self._own_store()
        self.store_failed = False
        self.stopping = threading.Event()
        atexit.register(self._stop_at_exit)

    # -- the store ---------------------------------------------------------------------------
    def _own_store(self):
        try:
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: local reports only
            return None
        try:
            store = store.clone()  # its own connection: not blocked behind the main thread's store calls
        except Exception:  # noqa: BLE001 - a store without clone(): share it
            return store
        try:
            store.set_timeout(timedelta(seconds=self.answer_wait + 5))
        except Exception:  # noqa: BLE001 - a store without timeouts keeps its own
            pass
        return store

    def _store(self, op: str, *args):
        """One store call; None (and local-only reports from then on) when the store is gone."""
        if self.store is None or self.store_failed:
            return None
        try:
            return getattr(self.store, op)(*args)
        except Exception as exc:  # noqa: BLE001 - e.g. the store's host process is stopped
            self.store_failed = True
            log.warning(
                "accel-npu: hang watch cannot reach the process group's store (%s): a hang report will "
                "show this rank only",
                exc,
            )
            return None

    def _stop_at_exit(self) -> None:
        """atexit: end the loop and join it while Python is alive, then say this rank left.

        A daemon thread that returns from a store call (pybind11 releases the GIL for it) after the
        interpreter started finalizing is ended with ``pthread_exit``, whose forced unwind through
        pybind11's ``gil_scoped_release`` destructor (noexcept) calls ``std::terminate``: SIGABRT
        after training finished. atexit runs before finalization (CPython ``Py_FinalizeEx``).
        """
        self.stopping.set()
        if self.is_alive() and threading.current_thread() is not self:
            # one store call at most (its timeout), or a query round under way
            self.join(timeout=2 * self.answer_wait + 5)
        self._mark_exited()

    def _mark_exited(self) -> None:
        """Tell a rank that later idles (a long save on rank 0) that this one left, not stalled."""
        if self.store is not None and not self.store_failed:
            try:
                self.store.set_timeout(timedelta(seconds=2))  # never hold up the process's exit
                self.store.set(_exited_key(self.calls.rank), "1")
            except Exception:  # noqa: BLE001 - at exit: the store may be gone with rank 0
                pass

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        import torch.distributed as dist

        try:
            while not self.stopping.wait(self.interval):
                if not dist.is_initialized():  # destroy_process_group: this group is over
                    self._mark_exited()
                    _disarm()
                    return
                self._answer_queries()
                if self._store("check", [_ABORT]):
                    self._follow()
                suspicion = self._suspect(time.monotonic())
                if suspicion:
                    self._investigate(*suspicion)
        except Exception as exc:  # noqa: BLE001 - diagnostics must never take training down
            log.warning("accel-npu: hang watch stopped: %s: %s", type(exc).__name__, exc)

    def _suspect(self, now: float):
        calls = self.calls
        for name, group, seq, entered in list(calls.inflight.values()):
            if now - entered >= calls.timeout:
                return ("inside", (name, group, seq), now - entered)
        idle = now - calls.changed_at
        if not calls.inflight and calls.last is not None and idle >= calls.timeout and now >= self.next_idle_check:
            self.next_idle_check = now + calls.timeout
            return ("after", calls.last, idle)
        return None

    # -- what a rank tells the others ------------------------------------------------------------
    def _state(self) -> dict:
        calls, now = self.calls, time.monotonic()
        counts: dict = {}
        for group, n in dict(calls.counts).items():
            name, _ = _group_info(group)
            entry = counts.setdefault(name, [0, ""])
            entry[0] += n  # None and dist.group.WORLD both count on the default group
            entry[1] = calls.ops.get(group, entry[1])
        inside = [[n, _group_info(g)[0], s, round(now - t, 1)] for n, g, s, t in list(calls.inflight.values())]
        last = calls.last
        return {
            "counts": counts,
            "inside": inside,
            "last": [last[0], _group_info(last[1])[0], last[2]] if last else None,
            "quiet": round(now - calls.changed_at, 1),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def _answer_queries(self) -> None:
        latest = self._store("add", _QUERY, 0)
        if latest and latest > self.answered:
            state = json.dumps(self._state())
            # every round not answered yet: two ranks may suspect within one poll of each other
            for round_ in range(max(self.answered + 1, latest - 7), latest + 1):
                self._store("set", _answer_key(round_, self.calls.rank), state)
            self.answered = latest

    # -- a suspicion: ask everyone, decide, report -----------------------------------------------
    def _investigate(self, kind: str, call, waited: float) -> None:
        calls = self.calls
        answers: dict = {}
        exited: set = set()
        round_ = self._store("add", _QUERY, 1)
        if not round_ and kind == "after":
            return  # no store: nothing says another rank is behind
        if round_:
            self._answer_queries()
            deadline = time.monotonic() + self.answer_wait
            pending = [r for r in range(calls.world) if r != calls.rank]
            while pending and time.monotonic() < deadline and not self.store_failed:
                self._answer_queries()  # another rank may be asking at the same time
                pending = [r for r in pending if not self._store("check", [_answer_key(round_, r)])]
                if pending:
                    time.sleep(0.05)
            for r in range(calls.world):
                if r != calls.rank and r not in pending:
                    raw = self._store("get", _answer_key(round_, r))
                    if raw is not None:
                        answers[r] = json.loads(raw)
            exited = {r for r in pending if self._store("check", [_exited_key(r)])}
        verdict = self._verdict(kind, call, waited, answers, exited)
        if verdict is None:
            return  # idle, and nobody is behind: a long stretch without collectives, not a hang
        if self.store is not None and not self.store_failed:
            winner = self._store("compare_set", _ABORT, "", str(calls.rank))
            if winner is not None and winner.decode() != str(calls.rank):
                self._follow()  # another rank reports: this one prints its stacks like the rest
        _write(verdict + "\n" + self._own_report())
        self._store("set", _REPORTED, "1")
        self._wait_for_others(expected=1 + len(answers))
        _exit()

    def _verdict(self, kind: str, call, waited: float, answers: dict, exited: set) -> str | None:
        calls = self.calls
        name, group, seq = call
        gname, members = _group_info(group)
        store_note = (
            ""
            if self.store is not None and not self.store_failed
            else (" (the process group's store cannot be reached: the other ranks' state is unknown)")
        )
        behind, other = [], []
        for r in members or range(calls.world):
            if r == calls.rank:
                continue
            if r in exited:
                if kind == "inside":  # an idle rank is not waiting for a rank that finished
                    behind.append(r)
                    other.append(f"rank {r} has exited")
            elif r not in answers:
                behind.append(r)
                other.append(
                    f"rank {r}: no answer within {self.answer_wait:g} s (stopped, e.g. SIGSTOP, or "
                    "blocked holding the GIL: it prints no stack)"
                )
            else:
                a = answers[r]
                n, op = a["counts"].get(gname, [0, ""])
                where = _where(a)
                if n < seq:
                    behind.append(r)
                    other.append(f"rank {r} is at #{n} on that group{where}")
                elif n == seq and op == name:
                    continue
                else:
                    other.append(f"rank {r} called {op} as #{n} on that group instead (mismatched collectives){where}")
        title = f"{name} #{seq} of group {gname} ({_ranks_text(members)})" if members else f"{name} #{seq}"
        timeout = f"ACCEL_NPU_HANG_TIMEOUT={_seconds(calls.timeout)} s"
        if kind == "inside":
            head = f"rank {calls.rank} has waited {waited:.1f} s in {title} ({timeout})"
        else:
            if not behind:
                return None
            head = (
                f"rank {calls.rank} has entered no collective for {waited:.1f} s since {title} returned "
                f"({timeout}; the host blocks elsewhere, e.g. on the device, see its stack)"
            )
        if behind:
            line = f"accel-npu hang: rank(s) {behind} did not arrive: {head}. " + "; ".join(other) + "."
        elif other:
            line = (
                f"accel-npu hang: every rank arrived, but not at the same collective: {head}. " + "; ".join(other) + "."
            )
        else:
            line = (
                f"accel-npu hang: every rank of the group is in it, yet it does not complete (network, device "
                f"or a peer process outside this job): {head}."
            )
        limit = f" of {_seconds(calls.group_timeout)} s" if calls.group_timeout else ""
        return (
            line + store_note + f" Every rank that can prints its stacks; the job fails (exit {EXIT_STATUS}) "
            f"instead of waiting for the process-group timeout{limit}."
        )

    def _follow(self) -> None:
        """Another rank reported: print this rank's stacks, wait for the report, exit."""
        _write(self._own_report())
        self._store("add", _PRINTED, 1)
        deadline = time.monotonic() + self.answer_wait + 5
        while time.monotonic() < deadline and not self._store("check", [_REPORTED]) and not self.store_failed:
            time.sleep(0.05)
        _exit()

    def _wait_for_others(self, expected: int) -> None:
        deadline = time.monotonic() + self.answer_wait
        while time.monotonic() < deadline and not self.store_failed:
            if (self._store("add", _PRINTED, 0) or 0) >= expected - 1:
                return
            time.sleep(0.05)

    def _own_report(self) -> str:
        calls, now = self.calls, time.monotonic()
        inside = list(calls.inflight.values())
        if inside:
            where = "; ".join(f"in {n} #{s} of group {_group_info(g)[0]} for {now - t:.1f} s" for n, g, s, t in inside)
        elif calls.last:
            n, g, s = calls.last
            where = (
                f"in no collective; the last, {n} #{s} of group {_group_info(g)[0]}, "
                f"returned {now - calls.changed_at:.1f} s ago"
            )
        else:
            where = "in no collective, and has called none yet"
        return (
            f"accel-npu hang report, rank {calls.rank} of {calls.world} (pid {os.getpid()}, host "
            f"{socket.gethostname()}): {where}. Python stacks of its threads (most recent call last):\n" + _stacks()
        )


def _where(answer: dict) -> str:
    if answer.get("inside"):
        return "".join(f", now in {n} #{s} of group {g} for {t} s" for n, g, s, t in answer["inside"])
    if answer.get("last"):
        n, g, s = answer["last"]
        return f" (last: {n} #{s} of group {g}; in no collective for {answer['quiet']} s)"
    return " (it has called no collective yet)"


def _seconds(value: float) -> str:
    return f"{value:g}"


def _stacks() -> str:
    """Every thread's Python stack but the watchdog's own, main thread first."""
    frames = sys._current_frames()
    me = threading.get_ident()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == me:
            continue
        thread = threads.get(ident)
        label = f"{thread.name}{' (daemon)' if thread.daemon else ''}" if thread else f"thread {ident}"
        parts.append(f"Thread {label}:\n" + "".join(traceback.format_stack(frames[ident])))
    return "".join(parts)


def _write(text: str) -> None:
    try:
        sys.stderr.write(text if text.endswith("\n") else text + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - stderr closed or replaced: the raw descriptor still works
        os.write(2, text.encode(errors="replace"))


def _exit() -> None:
    """End the process now: the main thread is stuck in the collective, so no clean exit can run.
    The launcher (torchrun, accelerate launch) then stops the other ranks."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - stdout may be closed; the exit must still happen
        pass
    os._exit(EXIT_STATUS)

"""Reading while the model is built: a local load starts reading the tensors it will most likely
keep before diffusers constructs the model on meta.

Construction (the model's ``__init__``: Python, and tables such as QwenImage's rope frequencies)
is work stock does before a byte is read; on a small or truncated checkpoint it takes as long as
the read. Which keys the load keeps is known from the index and the requested depth, their
dtypes from ``torch_dtype`` (fp32 for ``_keep_in_fp32_modules``; the default dtype without it),
before the model exists. So this rank's load slot is taken first, the kernel is asked for the
first bytes (``POSIX_FADV_WILLNEED``), and tensors that need a cast are cast in the load threads,
in file order, for as long as the main thread constructs (up to ``PREFETCH_BYTES``). The
placement then takes a prefetched tensor only where the real cast would leave it unchanged (same
dtype, contiguous) and reads anything else as before: a wrong guess costs time, never a different
result.
"""
from __future__ import annotations

import contextlib
import re
import threading

from accel_npu._torch.dist import local_world_size
from accel_npu._torch.safetensors_io import DTYPE_BYTES, Checkpoint, validate
from accel_npu.plugins.loading.lazy import READAHEAD_BYTES, Readahead, _OpenShards
from accel_npu.plugins.loading.slots import load_slot, load_threads, slot_count

#: the first numeric path component of a key (``transformer_blocks.7.attn.to_q.weight`` -> 7), as
#: truncation.layer_indices reads it
_FIRST_INDEX = re.compile(r"(?:^|\.)(\d+)\.")
#: checkpoint bytes cast at most before the placement takes over (bounds what a wrong guess wastes)
PREFETCH_BYTES = 1 << 30
#: safetensors dtype name -> torch dtype name (the floating ones a load may cast)
_FLOATING = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def predicted_keys(ckpt: Checkpoint, depth_requested: int | None, depth_in_checkpoint: int | None) -> list[str]:
    """Checkpoint keys a load of this depth keeps: all of them, or, when the call asks for fewer
    blocks than the checkpoint has, those outside the blocks past the requested depth (keys whose
    first numeric path component is at least the depth)."""
    keys = list(ckpt.weight_map)
    if depth_requested is None or depth_in_checkpoint is None or depth_requested >= depth_in_checkpoint:
        return keys
    kept = []
    for k in keys:  # thousands of keys before construction starts: one C-level search each
        found = _FIRST_INDEX.search(k)
        if found is None or int(found.group(1)) < depth_requested:
            kept.append(k)
    return kept


class Prefetch:
    """Reads and casts ``keys`` in file order in ``threads`` threads, from inside this rank's load
    slot (held until :meth:`close`); :meth:`future` hands each pending cast over once."""

    def __init__(self, ckpt: Checkpoint, keys: list[str], target_dtype, threads: int):
        self.ckpt, self.target_dtype, self.threads = ckpt, target_dtype, threads
        self._lock = threading.Lock()
        self._futures: dict = {}
        self._stack = contextlib.ExitStack()
        self._pool = None
        self._driver = None
        self._stop = False       # close(): drop everything
        self._in_flight = None   # the driver's bound on casts in flight (a threading.Semaphore)
        self._handed_over = False  # the placement reads on: submit nothing more
        self.files = self._files(keys)
        self.requested: dict[str, list[tuple[int, int]]] = {}  # file -> byte ranges asked of the kernel

    @staticmethod
    def _in_order(ckpt: Checkpoint, keys) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(ckpt.weight_map[k], []).append(k)
        return {name: sorted(by_file[name], key=lambda k: ckpt.headers[name][k][2]) for name in sorted(by_file)}

    def _files(self, keys) -> dict[str, list[str]]:
        validate(self.ckpt, keys)  # headers read (check_job finds them read); a bad file raises here first
        return self._in_order(self.ckpt, keys)

    def start(self, what: str) -> "Prefetch":
        import torch

        nbytes = out_bytes = 0
        casts = []
        for name, keys in self.files.items():
            header = self.ckpt.headers[name]
            for k in keys:
                dtype, shape, begin, end = header[k]
                nbytes += end - begin
                target = self.target_dtype(k, dtype)
                numel = 1
                for n in shape:
                    numel *= n
                out_bytes += numel * (target.itemsize if target is not None else DTYPE_BYTES.get(dtype, 0))
                if target is not None and getattr(torch, _FLOATING.get(dtype, ""), None) != target:
                    casts.append((name, k, target))
        budget = max(nbytes, out_bytes)
        slots = slot_count(budget)
        self._stack.enter_context(load_slot(budget, what=what, slots=slots))
        self.threads = self.threads or load_threads(min(local_world_size(), slots or local_world_size()))
        self._driver = threading.Thread(target=self._run, args=(casts,), name="accel-npu-prefetch", daemon=True)
        self._driver.start()
        return self

    def _run(self, casts) -> None:
        """Ask for the first bytes, then submit casts in file order, at most two per thread in flight,
        until the placement takes over (the threads cast while the main thread builds the model; the
        placement reads the rest as it reads any load, so memory and readahead stay bounded as there)."""
        ahead = Readahead(self.ckpt, self.files, window=READAHEAD_BYTES)
        try:
            first = next((k for keys in self.files.values() for k in keys), None)
            if first is not None:
                ahead.reached(first)
            if not casts:
                return
            from concurrent.futures import ThreadPoolExecutor

            shards = _OpenShards(self.ckpt)
            self._stack.callback(shards.close_all)
            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="accel-npu-load")
            with self._lock:
                if self._stop:
                    pool.shutdown(wait=False)
                    return
                self._pool = pool
            in_flight = self._in_flight = threading.Semaphore(2 * self.threads)
            submitted = 0
            for name, k, target in casts:
                begin, end = self.ckpt.headers[name][k][2:4]
                if submitted and submitted + end - begin > PREFETCH_BYTES:
                    break
                in_flight.acquire()  # hand_over() and close() release it once: the flags are read next
                with self._lock:
                    if self._stop or self._handed_over:
                        return
                    ahead.reached(k)
                    future = pool.submit(_cast, shards.get(name, k), target)
                    future.add_done_callback(lambda _: in_flight.release())
                    self._futures[k] = future
                submitted += end - begin
        except Exception:  # a guess that failed (the placement reads those tensors itself)
            return
        finally:
            self.requested = ahead.requested_ranges()
            ahead.close()

    def hand_over(self) -> dict[str, list[tuple[int, int]]]:
        """The placement starts reading: stop submitting; returns the byte ranges already asked of
        the kernel (its own readahead skips them)."""
        self._handed_over = True
        self._wake_driver()
        if self._driver is not None:
            self._driver.join()
        return self.requested

    def _wake_driver(self) -> None:
        in_flight = self._in_flight
        if in_flight is not None:
            in_flight.release()

    def future(self, key: str):
        """The pending cast of ``key`` (handed over once), or None."""
        if self._driver is not None:
            self._driver.join()
        with self._lock:
            return self._futures.pop(key, None)

    def close(self) -> None:
        """Stop, drop what was not taken, release the load slot."""
        with self._lock:
            self._stop = True
            pool, self._futures = self._pool, {}
        self._wake_driver()
        if self._driver is not None:
            self._driver.join()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._stack.close()


def _cast(tensor, dtype):
    return tensor.to(dtype).contiguous()

"""Reading while the model is built: a local load starts reading the tensors it will most likely
keep before diffusers constructs the model on meta.

Construction (the model's ``__init__``: Python, and tables such as QwenImage's rope frequencies)
is work stock does before a byte is read; on a small or truncated checkpoint it takes as long as
the read. Which keys the load keeps is known from the index and the requested depth, their
dtypes from ``torch_dtype`` (fp32 for ``_keep_in_fp32_modules``; the default dtype without it),
before the model exists. So this rank's load slot is taken first, the kernel is asked for the
first bytes (``POSIX_FADV_WILLNEED``), and tensors that need a cast are cast in the load threads,
in file order, up to ``PREFETCH_BYTES``: while the main thread constructs, and on while the
placement reads whatever lies past that bound. The placement takes a prefetched tensor only where
the real cast would leave it unchanged (same dtype, contiguous) and reads anything else as before:
a wrong guess costs time, never a different result.
"""

from __future__ import annotations

import contextlib
import re
import threading

from accel_npu._torch.dist import local_world_size
from accel_npu._torch.memory import copy_prefaulted
from accel_npu._torch.safetensors_io import DTYPE_BYTES, Checkpoint, validate
from accel_npu.plugins.loading.lazy import READAHEAD_BYTES, Readahead, _OpenShards
from accel_npu.plugins.loading.slots import load_slot, load_threads, slot_count

#: the first numeric path component of a key (``transformer_blocks.7.attn.to_q.weight`` -> 7), as
#: truncation.layer_indices reads it
_FIRST_INDEX = re.compile(r"(?:^|\.)(\d+)\.")
#: checkpoint bytes the prefetch casts at most (bounds what a wrong guess wastes); the placement reads the rest
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
    """Casts ``keys`` in file order in ``threads`` threads, from inside this rank's load slot (held
    until :meth:`close`); :meth:`future` hands each cast over once, as a future of the final tensor.

    The threads take the casts in pieces of about ``PIECE_BYTES`` of the file each, a large tensor
    split across pieces. While the model is built they copy a whole piece with one
    ``torch._foreach_copy_`` call (which releases the GIL): a thread needs the GIL once a piece, not
    once a tensor, and no thread idles while another casts the last large tensor. Once it is built
    (:meth:`model_built`) they copy a MB at a time, each MB's destination pages faulted in first
    (``copy_prefaulted``: fewer traps into the kernel than the copy's own page faults). One future a
    tensor, as a piece may hold many.
    """

    def __init__(self, ckpt: Checkpoint, keys: list[str], target_dtype, threads: int):
        self.ckpt, self.target_dtype, self.threads = ckpt, target_dtype, threads
        self._lock = threading.Lock()
        self._futures: dict = {}  # key -> its cast's future, until handed over
        self._stack = contextlib.ExitStack()
        self._workers: list[threading.Thread] = []
        self._stop = False  # close(): take no more pieces
        self._ahead: Readahead | None = None
        self.casting = False  # most kept bytes change dtype (the readahead leaves more to the readers' faults)
        self._pieces: _Pieces | None = None
        self.files = self._files(keys)

    @staticmethod
    def _in_order(ckpt: Checkpoint, keys) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(ckpt.weight_map[k], []).append(k)
        return {name: sorted(by_file[name], key=lambda k: ckpt.headers[name][k][2]) for name in sorted(by_file)}

    def _files(self, keys) -> dict[str, list[str]]:
        validate(self.ckpt, keys)  # headers read (check_job finds them read); a bad file raises here first
        return self._in_order(self.ckpt, keys)

    def start(self, what: str) -> Prefetch:
        import torch

        nbytes = out_bytes = cast_bytes = 0
        casts = []  # (file, key, target dtype, numel) of the tensors a cast changes, in file order
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
                    casts.append((name, k, target, numel))
                    cast_bytes += end - begin
        budget = max(nbytes, out_bytes)
        slots = slot_count(budget)
        self._stack.enter_context(load_slot(budget, what=what, slots=slots))
        self.threads = self.threads or load_threads(min(local_world_size(), slots or local_world_size()))
        self.casting = 2 * cast_bytes > nbytes  # mostly casts: copies, not reads, bound the load
        self._ahead = Readahead(self.ckpt, self.files, window=READAHEAD_BYTES, casting=self.casting)
        self._stack.callback(self._ahead.close)
        casts = self._bounded(casts)
        if not casts:  # nothing to cast: ask for the first window's bytes (beside construction)
            first = next((k for keys in self.files.values() for k in keys), None)
            if first is not None:
                self._workers = [
                    threading.Thread(
                        target=self._ahead.reached, args=(first,), name="accel-npu-prefetch_0", daemon=True
                    )
                ]
                self._workers[0].start()
            return self
        shards = _OpenShards(self.ckpt)
        self._stack.callback(shards.close_all)
        pieces = self._pieces = _Pieces(casts, shards, self._ahead, self.ckpt, self.threads)
        self._futures = dict(pieces.futures)
        with pieces._lock:  # each thread's first piece taken here, before the main thread constructs
            first = [pieces._take() for _ in range(self.threads)]
        self._workers = [
            threading.Thread(target=self._work, args=(pieces, piece), name=f"accel-npu-prefetch_{i}", daemon=True)
            for i, piece in enumerate(first)
        ]
        for w in self._workers:
            w.start()
        return self

    def _bounded(self, casts):
        """The first casts, in file order, up to ``PREFETCH_BYTES`` of the file (at least one)."""
        out, total = [], 0
        for name, k, target, numel in casts:
            begin, end = self.ckpt.headers[name][k][2:4]
            if out and total + end - begin > PREFETCH_BYTES:
                break
            out.append((name, k, target, numel))
            total += end - begin
        return out

    def _work(self, pieces: _Pieces, first) -> None:
        try:
            if first is not None:
                pieces.cast(first)
            while not self._stop and pieces.cast_next():
                pass
        except BaseException as exc:  # noqa: BLE001 - a thread that ends must not leave a future the placement waits on
            pieces.abandon(exc)

    def model_built(self) -> None:
        """Construction is over: the main thread has little Python left, so the threads may take
        the GIL once a MB and copy with their destination faulted in ahead (``copy_prefaulted``)."""
        if self._pieces is not None:
            self._pieces.built = True

    def hand_over(self) -> dict[str, list[tuple[int, int]]]:
        """The placement starts reading (the casts go on): the byte ranges already asked of the
        kernel (its own readahead skips them)."""
        return self._ahead.requested_ranges() if self._ahead is not None else {}

    def future(self, key: str):
        """The future of ``key``'s cast (handed over once), or None."""
        with self._lock:
            return self._futures.pop(key, None)

    def close(self) -> None:
        """Stop, drop what was not taken, release the load slot."""
        self._stop = True
        for w in self._workers:
            w.join()
        with self._lock:
            for future in self._futures.values():
                future.cancel()  # never started: nothing holds it
            self._futures = {}
        self._stack.close()


#: bytes of the file one piece casts (a thread takes the GIL once a piece)
PIECE_BYTES = 4 << 20


class _Pieces:
    """The casts cut into pieces of about ``PIECE_BYTES``, handed to the threads in file order.

    A piece is a list of (destination, source) flat slices; a tensor's output is allocated (untouched:
    its pages are first written by the copy, in the thread that copies them) and its source viewed
    when its first piece is taken, and its future completes when its last piece is copied.
    """

    def __init__(self, casts, shards: _OpenShards, ahead: Readahead, ckpt: Checkpoint, threads: int):
        from concurrent.futures import Future

        self.casts, self.shards, self.ahead, self.ckpt, self.threads = casts, shards, ahead, ckpt, threads
        self._left = sum(ckpt.headers[name][k][3] - ckpt.headers[name][k][2] for name, k, _, _ in casts)
        self.futures = {k: Future() for _, k, _, _ in casts}
        self._lock = threading.Lock()
        self._next = 0  # the first cast not wholly handed out
        self._taken = 0  # pieces handed out
        self._offset = 0  # its elements already handed out
        self._tensors: dict[str, tuple] = {}  # key -> (output, source, elements not yet copied)
        self.built = False  # construction is over (Prefetch.model_built)

    def cast_next(self) -> bool:
        """Take the next piece and copy it; False when none is left."""
        with self._lock:
            piece = self._take()
        if piece is None:
            return False
        self.cast(piece)
        return True

    def cast(self, piece) -> None:
        """Copy ``piece``; complete the futures of the tensors it finishes."""
        import torch

        self.ahead.reached(piece[0][0])  # outside the lock: the first request asks for a whole window
        try:
            if self.built:  # the main thread mostly waits now: the GIL once a MB, pages faulted in ahead
                for _, dst, src in piece:
                    copy_prefaulted(dst, src)
            else:  # while it constructs (Python holding the GIL), the GIL once a piece
                torch._foreach_copy_([dst for _, dst, _ in piece], [src for _, _, src in piece])
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the placement reads these tensors itself
            self._fail([k for k, _, _ in piece], exc)
            return
        with self._lock:
            done = []
            for k, dst, _ in piece:
                if k not in self._tensors:
                    continue  # another of its pieces failed
                out, src, left = self._tensors[k]
                left -= dst.numel()
                self._tensors[k] = (out, src, left)
                if not left:
                    done.append((k, out))
                    del self._tensors[k]
        for k, out in done:
            self.futures[k].set_result(out)

    def _take(self):
        """The next piece: whole tensors and slices of one, up to ``PIECE_BYTES`` of the file."""
        import torch

        piece, size = [], 0
        # guided: each thread's first piece small (taken before construction), then a share of what is
        # left (large first, small last: few GIL acquisitions, and the threads finish together)
        limit = PIECE_BYTES if self._taken < self.threads else max(PIECE_BYTES, self._left // (2 * self.threads))
        self._taken += 1
        while self._next < len(self.casts) and size < limit:
            name, k, target, numel = self.casts[self._next]
            if self._offset and k not in self._tensors:  # an earlier piece of it failed: skip the rest
                self._left -= (numel - self._offset) * DTYPE_BYTES[self.ckpt.headers[name][k][0]]
                self._next, self._offset = self._next + 1, 0
                continue
            if self._offset == 0:
                if not self.futures[k].set_running_or_notify_cancel():  # close() cancelled it
                    self._next += 1
                    continue
                try:
                    src = self.shards.get(name, k).view(-1)
                    out = torch.empty(self.ckpt.headers[name][k][1], dtype=target, device="cpu")
                except Exception as exc:  # noqa: BLE001 - the placement reads it again and reports what is wrong
                    self._fail([k], exc, locked=True)
                    self._next += 1
                    continue
                self._tensors[k] = (out, src, numel)
            out, src, _ = self._tensors[k]
            itemsize = src.element_size()
            n = min(numel - self._offset, max(1, (limit - size) // itemsize))
            piece.append((k, out.view(-1)[self._offset : self._offset + n], src[self._offset : self._offset + n]))
            size += n * itemsize
            self._left -= n * itemsize
            self._offset += n
            if self._offset == numel:
                self._next, self._offset = self._next + 1, 0
        return piece or None

    def _fail(self, keys, exc, locked=False) -> None:
        """``keys`` fail with ``exc``: their slices not yet copied are skipped, and no copy completes them."""
        with contextlib.nullcontext() if locked else self._lock:
            for k in keys:
                self._tensors.pop(k, None)
        for k in keys:
            future = self.futures[k]
            if not future.done():
                future.set_exception(exc)

    def abandon(self, exc) -> None:
        """Every cast not yet done fails with ``exc`` (the placement reads those tensors itself)."""
        from concurrent.futures import InvalidStateError

        for future in self.futures.values():
            if future.done() or not (future.running() or future.set_running_or_notify_cancel()):
                continue  # done, or cancelled by close()
            try:
                future.set_exception(exc)
            except InvalidStateError:  # another thread completed it meanwhile
                pass

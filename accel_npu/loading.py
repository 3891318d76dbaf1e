"""Bounded-memory model loading (issue 4): the machinery behind plugins/loading.py.

What happens to a ``from_pretrained`` of a local safetensors checkpoint:

1. **Truncation before reading.** A depth override (``num_layers=2`` / ``num_hidden_layers=2``,
   or ``ACCEL_NPU_TRUNCATE=Class:2``) builds the shallow model on meta, then opens only the
   shards that hold its tensors and reads only those tensors (``safe_open``). The dropped
   layers' keys become one summary line. Asking for more layers than the checkpoint has is a
   :class:`LoadError` naming the missing keys.
2. **Validation before materialization.** Every needed shard is opened (header only) and
   every key the index places in it is checked before the first byte of a weight is read:
   a missing shard, a corrupt/truncated file or a key no shard has is one :class:`LoadError`
   naming the file and the key. Nothing half-loaded is ever returned.
3. **Meta-init that is correct.** Construction is exactly stock diffusers' (parameters on
   meta, buffers and plain tensor attributes real); tensors are assigned with diffusers' own
   ``load_model_dict_into_meta`` (same casting, ``keep_in_fp32`` rules), one tensor at a time.
   Afterwards nothing may be on meta (parameters, buffers, plain tensor attributes).
4. **Staggered materialization.** On a multi-rank node, at most K ranks read at once, K from
   free host memory / bytes to load (or ``ACCEL_NPU_LOAD_SLOTS``). Slots are ``flock`` files:
   a rank that dies releases its slot. ``malloc_trim(0)`` after each load.
5. **Frozen towers.** Inside ``DeepSpeedPlugin.zero3_init_context_manager(enable=False)`` and
   ``DiffusionPipeline.from_pretrained`` transformers' ``HfDeepSpeedConfig`` weakref is cleared,
   so those loads stay outside ``zero.Init`` and keep the checkpoint dtype.

Calls outside the supported subset (hub ids, ``device_map``, quantization, variants, ...)
go to the stock implementation unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from accel_npu import environment
from accel_npu.errors import AccelNpuError, ConfigError

log = logging.getLogger("accel_npu")

#: config keys that set the number of repeated blocks, in lookup order
DEPTH_KEYS = ("num_layers", "num_hidden_layers", "n_layer", "num_blocks", "depth")

SAFE_WEIGHTS = "diffusion_pytorch_model.safetensors"
SAFE_INDEX = "diffusion_pytorch_model.safetensors.index.json"


class LoadError(AccelNpuError):
    """A checkpoint that cannot be loaded as asked; names the file and key and says what to do."""


class LoadSlotTimeout(LoadError):
    """Waited longer than ACCEL_NPU_LOAD_TIMEOUT for a load slot."""


# ------------------------------------------------------------------------------------------------
# configuration
# ------------------------------------------------------------------------------------------------
def truncation_map(raw: str | None = None) -> dict[str, int]:
    """``ACCEL_NPU_TRUNCATE`` parsed: ``{"QwenImageTransformer2DModel": 2, ...}``."""
    raw = environment.get("ACCEL_NPU_TRUNCATE") if raw is None else raw
    out: dict[str, int] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, layers = item.partition(":")
        try:
            n = int(layers)
        except ValueError:
            n = -1
        if not sep or not name.strip() or n < 1:
            raise ConfigError(
                f"accel-npu: ACCEL_NPU_TRUNCATE={raw!r}: {item!r} is not 'ClassName:layers' with layers >= 1 "
                "(example: ACCEL_NPU_TRUNCATE=QwenImageTransformer2DModel:2)")
        out[name.strip()] = n
    return out


def truncation_for(cls) -> int | None:
    """Layers ACCEL_NPU_TRUNCATE asks for this class (matched on the class or one of its bases)."""
    wanted = truncation_map()
    if not wanted:
        return None
    for klass in getattr(cls, "__mro__", (cls,)):
        if klass.__name__ in wanted:
            return wanted[klass.__name__]
    return None


def depth_key(config: dict) -> str | None:
    return next((k for k in DEPTH_KEYS if isinstance(config.get(k), int)), None)


# ------------------------------------------------------------------------------------------------
# host memory
# ------------------------------------------------------------------------------------------------
_libc = None


def malloc_trim() -> bool:
    """Give freed heap memory back to the OS (glibc keeps freed blocks otherwise)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(_libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return False


def available_memory() -> int | None:
    """MemAvailable of this node (bytes), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ------------------------------------------------------------------------------------------------
# load slots
# ------------------------------------------------------------------------------------------------
def _local_world_size() -> int:
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


def is_local_main() -> bool:
    return os.environ.get("LOCAL_RANK", "0") in ("", "0")


def _whole_number_env(name: str) -> int:
    """A set variable that must be a whole number >= 1 (else one ConfigError naming it)."""
    raw = environment.get(name).strip()
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"accel-npu: {name}={raw!r} is not a whole number >= 1")
    return n


def slot_count(nbytes: int) -> int | None:
    """How many ranks of this node may materialize at once; None = no staggering."""
    raw = environment.get("ACCEL_NPU_LOAD_SLOTS").strip()
    local = _local_world_size()
    if raw:
        return _whole_number_env("ACCEL_NPU_LOAD_SLOTS")
    if local <= 1:
        return None
    avail = available_memory()
    if avail is None or nbytes <= 0:
        return local
    # Each loading rank needs its bytes once more transiently (read + cast); keep 20 % headroom.
    k = int(0.8 * avail // (2 * nbytes))
    return max(1, min(local, k))


def _slot_dir() -> str:
    job = (os.environ.get("TORCHELASTIC_RUN_ID") or
           f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}")
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", job)
    base = os.environ.get("TMPDIR") or "/tmp"
    path = os.path.join(base, f"accel-npu-load-slots-{os.getuid()}", job)
    os.makedirs(path, exist_ok=True)
    return path


def _who() -> dict:
    return {"pid": os.getpid(), "rank": os.environ.get("RANK"), "local_rank": os.environ.get("LOCAL_RANK"),
            "host": socket.gethostname(), "since": time.time()}


def _describe_holders(directory: str, slots: int) -> str:
    parts = []
    for i in range(slots):
        try:
            with open(os.path.join(directory, f"slot-{i}.holder")) as f:
                h = json.load(f)
            alive = _pid_alive(int(h["pid"]))
            parts.append(f"slot {i}: rank {h.get('rank')} (pid {h['pid']} on {h.get('host')}, "
                         f"holding for {time.time() - float(h['since']):.0f} s{'' if alive else ', process gone'})")
        except (OSError, ValueError, KeyError):
            parts.append(f"slot {i}: holder unknown")
    return "; ".join(parts)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


_held_depth = 0


@contextlib.contextmanager
def load_slot(nbytes: int, what: str = "weights", slots: int | None = None,
              timeout: float | None = None) -> Iterator[int | None]:
    """Hold one of this node's load slots while materializing ``nbytes``.

    Yields the slot number (None when no staggering applies). A process that dies releases its
    slot (the lock is an OS file lock). Waiting longer than ``ACCEL_NPU_LOAD_TIMEOUT`` raises
    :class:`LoadSlotTimeout` naming the ranks that hold the slots.
    """
    global _held_depth
    if _held_depth:  # nested load (a model whose from_pretrained loads sub-models): already holding
        yield None
        return
    slots = slot_count(nbytes) if slots is None else slots
    if not slots:
        yield None
        return
    from filelock import FileLock, Timeout

    if timeout is None:
        try:
            timeout = float(environment.get("ACCEL_NPU_LOAD_TIMEOUT"))
        except ValueError:
            raise ConfigError("accel-npu: ACCEL_NPU_LOAD_TIMEOUT must be a number of seconds") from None
    directory = _slot_dir()
    locks = [FileLock(os.path.join(directory, f"slot-{i}.lock")) for i in range(slots)]
    start = time.monotonic()
    first = int(os.environ.get("LOCAL_RANK", "0") or 0) % slots
    order = [(first + i) % slots for i in range(slots)]
    held = None
    reported = False
    while held is None:
        for i in order:
            try:
                locks[i].acquire(timeout=0)
            except Timeout:
                continue
            held = i
            break
        if held is not None:
            break
        waited = time.monotonic() - start
        if waited > timeout:
            raise LoadSlotTimeout(
                f"accel-npu: rank {os.environ.get('RANK', '?')} waited {waited:.0f} s for one of {slots} load "
                f"slot(s) to load {what} and gave up; held by: {_describe_holders(directory, slots)}. "
                "A rank that hangs while loading blocks the others: check that rank's log; raise "
                "ACCEL_NPU_LOAD_TIMEOUT for very slow storage, or ACCEL_NPU_LOAD_SLOTS if memory allows.")
        if not reported and waited > 5:
            log.info("accel-npu: rank %s waiting for a load slot (%s)", os.environ.get("RANK"),
                     _describe_holders(directory, slots))
            reported = True
        time.sleep(0.05)
    holder = os.path.join(directory, f"slot-{held}.holder")
    try:
        with open(holder, "w") as f:
            json.dump(_who(), f)
    except OSError:
        pass
    _held_depth += 1
    try:
        yield held
    finally:
        _held_depth -= 1
        locks[held].release()
        malloc_trim()


def loading_report() -> dict:
    """The loading section of ``accel-npu env`` (never raises)."""
    info: dict = {}
    try:
        wanted = truncation_map()
        info["truncate (ACCEL_NPU_TRUNCATE)"] = ", ".join(f"{k} -> {v} layers" for k, v in wanted.items()) or "off"
    except ConfigError as exc:
        info["truncate (ACCEL_NPU_TRUNCATE)"] = f"INVALID: {exc}"
    raw = environment.get("ACCEL_NPU_LOAD_SLOTS").strip()
    info["load slots (ACCEL_NPU_LOAD_SLOTS)"] = raw or "from free memory (multi-rank nodes only)"
    info["slot timeout s (ACCEL_NPU_LOAD_TIMEOUT)"] = environment.get("ACCEL_NPU_LOAD_TIMEOUT")
    try:
        info["load threads (ACCEL_NPU_LOAD_THREADS)"] = str(load_threads(_local_world_size()))
    except ConfigError as exc:
        info["load threads (ACCEL_NPU_LOAD_THREADS)"] = f"INVALID: {exc}"
    from accel_npu.zero3_loading import switched_on

    info["ZeRO-3 loads (ACCEL_NPU_ZERO3_INIT)"] = ("straight into partitions, read once by rank 0" if switched_on()
                                                   else "off: whole model on every rank, as stock")
    from accel_npu.fsdp_loading import efficient_loading_requested

    info["FSDP loads (fsdp_cpu_ram_efficient_loading)"] = (
        "rank 0 reads, the other ranks get its weights at prepare" if efficient_loading_requested()
        else "off in this environment: every rank reads, as stock")
    avail = available_memory()
    info["MemAvailable"] = f"{avail / 2**30:.1f} GiB" if avail else "unknown"
    info["malloc_trim"] = "available" if malloc_trim() else "not available (not glibc?)"
    return info


# ------------------------------------------------------------------------------------------------
# checkpoint files
# ------------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A local safetensors checkpoint: which file holds which key (header-level, nothing read)."""

    folder: str
    index_file: str | None
    weight_map: dict[str, str]                      # key -> file name (relative to folder)
    headers: dict[str, dict[str, tuple]] = field(default_factory=dict)  # file -> key -> (dtype, shape)

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)


def _read_header(path: str) -> dict[str, tuple]:
    """{key: (dtype, shape, first byte, end byte)} of one safetensors file, checked against its size."""
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"file is {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 1024 * 1024):
                raise ValueError(f"header length {n} does not fit the file size {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise LoadError(f"accel-npu: {path} is not a readable safetensors file ({exc}). "
                        "Re-download or re-save this shard.") from exc
    out = {}
    data_len = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise LoadError(f"accel-npu: {path}: header entry for key {key!r} is malformed") from exc
        if end > data_len or begin > end:
            raise LoadError(
                f"accel-npu: {path} is truncated or corrupt: key {key!r} needs bytes {begin}..{end} of the "
                f"data section but the file holds only {data_len}. Re-download or re-save this shard.")
        # dtype, shape, and the tensor's byte range in the file (for readahead)
        out[key] = (info.get("dtype"), tuple(info.get("shape", ())), 8 + n + begin, 8 + n + end)
    return out


def open_checkpoint(folder: str) -> Checkpoint | None:
    """The local safetensors checkpoint in ``folder``, or None when it is not one we handle."""
    index_path = os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
            weight_map = dict(index["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoadError(f"accel-npu: {index_path} is not a valid checkpoint index ({exc}).") from exc
        return Checkpoint(folder, index_path, weight_map)
    single = os.path.join(folder, SAFE_WEIGHTS)
    if os.path.isfile(single):
        header = _read_header(single)
        return Checkpoint(folder, None, {k: SAFE_WEIGHTS for k in header}, {SAFE_WEIGHTS: header})
    return None


def validate(ckpt: Checkpoint, keys: list[str]) -> list[str]:
    """Check that every key is where the index says, in a readable file; returns the files needed."""
    needed = sorted({ckpt.weight_map[k] for k in keys})
    for name in needed:
        path = ckpt.path(name)
        if not os.path.isfile(path):
            example = next(k for k in keys if ckpt.weight_map[k] == name)
            raise LoadError(
                f"accel-npu: shard {path} named in {ckpt.index_file} is missing (it should hold {example!r} "
                f"and {sum(1 for k in keys if ckpt.weight_map[k] == name) - 1} other needed tensor(s)). "
                "Download the complete checkpoint.")
        if name not in ckpt.headers:
            ckpt.headers[name] = _read_header(path)
    for k in keys:
        name = ckpt.weight_map[k]
        if k not in ckpt.headers[name]:
            raise LoadError(
                f"accel-npu: {ckpt.index_file or ckpt.folder} says key {k!r} is in {ckpt.path(name)}, but that "
                "shard has no such tensor. The index and the shards do not belong together: re-download "
                "or re-save the checkpoint.")
    return needed


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}


def nbytes_of(ckpt: Checkpoint, keys) -> int:
    total = 0
    for k in keys:
        dtype, shape = ckpt.headers[ckpt.weight_map[k]][k][:2]
        n = 1
        for s in shape:
            n *= s
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def readahead(ckpt: Checkpoint, files: dict[str, list[str]]) -> None:
    """Ask the kernel to start reading the byte ranges of these tensors now (POSIX_FADV_WILLNEED).

    The reads then overlap with casting the tensors before them instead of stalling each
    page fault on storage; only the ranges of the listed tensors are requested. Best effort.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    for name, keys in files.items():
        header = ckpt.headers.get(name)
        if header is None:
            continue
        ranges = sorted(header[k][2:4] for k in keys if k in header)
        merged: list[list[int]] = []
        for begin, end in ranges:  # adjacent tensors: one request
            if merged and begin <= merged[-1][1] + (1 << 20):
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([begin, end])
        try:
            fd = os.open(ckpt.path(name), os.O_RDONLY)
        except OSError:
            continue
        try:
            for begin, end in merged:
                os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


class LazyTensors:
    """A read-once mapping: ``items()`` reads each kept tensor from its shard as it is consumed.

    Shards are visited in order, one open at a time; only the listed keys are read. With
    ``convert`` (key, tensor -> tensor in its final dtype) and ``threads`` > 1, the reads and
    casts of the next few tensors run in a small thread pool while the caller assigns the
    current one (the cast to fp32 is what bounds loading; torch releases the GIL while casting).
    Results are identical and yielded in the same order.
    """

    def __init__(self, ckpt: Checkpoint, keys: list[str], progress=None, convert=None, threads: int = 1):
        self.ckpt, self.keys, self.progress = ckpt, keys, progress
        self.convert, self.threads = convert, threads
        self.read = 0

    def __len__(self):
        return len(self.keys)

    def __contains__(self, key):
        return key in self.keys

    def _by_file(self, only=None) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = {}
        for k in self.keys:
            if only is None or k in only:
                by_file.setdefault(self.ckpt.weight_map[k], []).append(k)
        return {name: by_file[name] for name in sorted(by_file)}

    def order(self) -> list[str]:
        """The keys in the order :meth:`items` reads them (shard by shard)."""
        return [k for keys in self._by_file().values() for k in keys]

    def items(self, only=None):
        from safetensors import safe_open

        files = self._by_file(only)
        readahead(self.ckpt, files)
        pool = None
        if self.convert is not None and self.threads > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="accel-npu-load")
        try:
            for name, keys in files.items():
                path = self.ckpt.path(name)
                try:
                    handle = safe_open(path, framework="pt", device="cpu")
                except Exception as exc:
                    raise LoadError(f"accel-npu: cannot open {path}: {exc}") from exc
                with handle as f:
                    yield from self._read_file(f, path, keys, pool)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _get(self, f, path: str, key: str):
        try:
            return f.get_tensor(key)  # a view of the file's mmap: nothing is read yet
        except Exception as exc:
            raise LoadError(f"accel-npu: reading {key!r} from {path} failed: {exc}") from exc

    def _read_file(self, f, path: str, keys: list[str], pool):
        import collections

        pending: collections.deque = collections.deque()
        ahead = 2 * self.threads
        todo = iter(keys)
        while True:
            while pool is not None and len(pending) < ahead:
                k = next(todo, None)
                if k is None:
                    break
                pending.append((k, pool.submit(self.convert, k, self._get(f, path, k))))
            if pool is not None:
                if not pending:
                    return
                k, fut = pending.popleft()
                tensor = fut.result()
            else:
                k = next(todo, None)
                if k is None:
                    return
                tensor = self._get(f, path, k)
                if self.convert is not None:
                    tensor = self.convert(k, tensor)
            size = _file_bytes(self.ckpt, self.ckpt.weight_map[k], k, tensor)
            self.read += size
            if self.progress is not None:
                self.progress.update(size)
            yield k, tensor
            del tensor


def _file_bytes(ckpt: Checkpoint, name: str, key: str, tensor) -> int:
    entry = ckpt.headers.get(name, {}).get(key)
    if entry is not None:
        return entry[3] - entry[2]
    return tensor.numel() * tensor.element_size()


def load_threads(loading_ranks: int) -> int:
    """Threads one rank uses to cast while loading: ``ACCEL_NPU_LOAD_THREADS``, else this node's
    cores divided among the ranks loading at the same time (at most 4)."""
    if environment.get("ACCEL_NPU_LOAD_THREADS").strip():
        return _whole_number_env("ACCEL_NPU_LOAD_THREADS")
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // max(1, loading_ranks)))


# ------------------------------------------------------------------------------------------------
# checks on the loaded model
# ------------------------------------------------------------------------------------------------
def tensors_on_meta(model) -> list[str]:
    """Names of parameters, buffers and plain tensor attributes still on the meta device."""
    import torch

    left = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                left.append(prefix + name)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                left.append(prefix + name)
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and not name.startswith("_") and v.is_meta:
                left.append(prefix + name)
    return sorted(set(left))


def _short(keys, n=8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def _layer_indices(keys) -> list[int]:
    found = set()
    for k in keys:
        for m in re.finditer(r"\.(\d+)\.", f".{k}"):
            found.add(int(m.group(1)))
            break
    return sorted(found)


# ------------------------------------------------------------------------------------------------
# frozen towers: loads outside zero.Init
# ------------------------------------------------------------------------------------------------
_frozen = contextvars.ContextVar("accel_npu_frozen_load", default=False)


@contextlib.contextmanager
def outside_zero_init() -> Iterator[None]:
    """Clear transformers' HfDeepSpeedConfig weakref for the duration (accelerate #3170)."""
    token = _frozen.set(True)
    ds = None
    saved = None
    try:
        import sys

        ds = sys.modules.get("transformers.integrations.deepspeed")
        if ds is not None and hasattr(ds, "_hf_deepspeed_config_weak_ref"):
            saved = ds._hf_deepspeed_config_weak_ref
            ds._hf_deepspeed_config_weak_ref = None
        yield
    finally:
        if ds is not None and saved is not None:
            ds._hf_deepspeed_config_weak_ref = saved
        _frozen.reset(token)


def in_frozen_load() -> bool:
    return _frozen.get()


# ------------------------------------------------------------------------------------------------
# progress
# ------------------------------------------------------------------------------------------------
def progress_bar(total: int, desc: str, shards: int):
    if not is_local_main() or (shards <= 1 and total < (256 << 20)):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)


# ------------------------------------------------------------------------------------------------
# diffusers ModelMixin.from_pretrained
# ------------------------------------------------------------------------------------------------
#: kwargs stock diffusers pops, with the value under which we can take the call over
_DIFFUSERS_NEUTRAL = {
    "ignore_mismatched_sizes": (False,),
    "device_map": (None,),
    "max_memory": (None,),
    "offload_folder": (None,),
    "offload_state_dict": (None, False),
    "variant": (None,),
    "use_safetensors": (None, True),
    "quantization_config": (None,),
    "parallel_config": (None,),
    "use_flashpack": (False,),
    "flashpack_kwargs": (None, {}),
    "low_cpu_mem_usage": (None, True),
    "from_flax": (False,),
}
_DIFFUSERS_PASSED = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision")


@dataclass
class _Plan:
    original: Any  # the path object exactly as passed (stock registers it in the config)
    path: str
    folder: str
    ckpt: Checkpoint
    kwargs: dict
    torch_dtype: Any
    output_loading_info: bool
    subfolder: str | None


def _diffusers_plan(cls, args, kwargs) -> _Plan | None:
    import torch

    kwargs = dict(kwargs)
    if args:
        if len(args) > 1:
            return None
        path = args[0]
    else:
        path = kwargs.pop("pretrained_model_name_or_path", None)
    if not isinstance(path, (str, os.PathLike)):
        return None
    original, path = path, os.fspath(path)
    for name, neutral in _DIFFUSERS_NEUTRAL.items():
        if name in kwargs and not any(kwargs[name] is v or kwargs[name] == v for v in neutral):
            return None
    if os.environ.get("HF_ENABLE_PARALLEL_LOADING", "").upper() in ("1", "YES", "TRUE", "ON") \
            and kwargs.get("low_cpu_mem_usage") is False:
        return None
    dtype = kwargs.get("dtype", None)
    torch_dtype = dtype if dtype is not None else kwargs.get("torch_dtype", None)
    if torch_dtype is not None and (not isinstance(torch_dtype, torch.dtype)
                                    or torch_dtype == getattr(torch, "float8_e4m3fn", None)):
        return None
    subfolder = kwargs.get("subfolder")
    folder = os.path.join(path, subfolder or "")
    if not os.path.isdir(folder):
        return None
    try:
        import accelerate  # noqa: F401  (stock needs it for low_cpu_mem_usage too)
    except ImportError:
        return None
    ckpt = open_checkpoint(folder)
    if ckpt is None:
        return None
    return _Plan(original, path, folder, ckpt, kwargs, torch_dtype, bool(kwargs.get("output_loading_info", False)),
                 subfolder)


def _diffusers_load(cls, plan: _Plan):
    import torch
    from diffusers.models import modeling_utils as mu
    from diffusers.models.model_loading_utils import load_model_dict_into_meta
    import accelerate

    kwargs = dict(plan.kwargs)
    for name in (*_DIFFUSERS_NEUTRAL, "output_loading_info", "torch_dtype", "dtype", "subfolder",
                 "disable_mmap"):
        kwargs.pop(name, None)
    passed = {k: kwargs.pop(k) for k in _DIFFUSERS_PASSED if k in kwargs}

    truncate_to = truncation_for(cls)
    user_agent = {"diffusers": getattr(mu, "__version__", ""), "file_type": "model", "framework": "pytorch",
                  "model_class": cls.__name__}
    config, unused_kwargs, _commit = cls.load_config(
        plan.path, return_unused_kwargs=True, return_commit_hash=True, subfolder=plan.subfolder,
        user_agent=user_agent, **passed, **kwargs)
    import copy

    config = copy.deepcopy(config)
    if config.get("quantization_config") is not None:
        raise _Fallback()
    dkey = depth_key(config)
    ckpt_depth = config.get(dkey) if dkey else None
    if truncate_to is not None and dkey and dkey not in unused_kwargs and dkey not in kwargs:
        unused_kwargs[dkey] = truncate_to
    requested_depth = unused_kwargs.get(dkey) if dkey else None

    keep_in_fp32 = cls._keep_in_fp32_modules
    if keep_in_fp32 is not None and not isinstance(keep_in_fp32, list):
        keep_in_fp32 = [keep_in_fp32]
    keep_in_fp32 = keep_in_fp32 or []

    torch_dtype = plan.torch_dtype
    dtype_orig = cls._set_default_torch_dtype(torch_dtype) if torch_dtype is not None else None
    try:
        with mu.ContextManagers([mu.no_init_weights(), accelerate.init_empty_weights()]):
            model = cls.from_config(config, **unused_kwargs)
    finally:
        if dtype_orig is not None:
            torch.set_default_dtype(dtype_orig)

    ckpt = plan.ckpt
    if ckpt.index_file is None and _has_deprecated_attention_keys(model, ckpt):
        raise _Fallback()
    model_sd = model.state_dict()
    expected = list(model_sd.keys())
    loaded = set(ckpt.weight_map)
    kept = [k for k in expected if k in loaded]
    missing = [k for k in expected if k not in loaded]
    unexpected = sorted(loaded - set(expected))
    if cls._keys_to_ignore_on_load_unexpected is not None:
        for pat in cls._keys_to_ignore_on_load_unexpected:
            unexpected = [k for k in unexpected if re.search(pat, k) is None]

    on_meta = set(tensors_on_meta(model))
    missing_meta = [k for k in missing if k in on_meta]
    if missing_meta:
        hint = ""
        if requested_depth is not None and ckpt_depth is not None and requested_depth > ckpt_depth:
            hint = (f" {cls.__name__} was asked for {dkey}={requested_depth}, but the checkpoint has "
                    f"{ckpt_depth}: ask for at most {ckpt_depth}.")
        raise LoadError(
            f"accel-npu: {plan.folder} has no tensor for {len(missing_meta)} parameter(s) of {cls.__name__}: "
            f"{_short(missing_meta)}.{hint} (Stock diffusers would leave them on the meta device.)")

    needed_files = validate(ckpt, kept)
    nbytes = nbytes_of(ckpt, kept)
    out_bytes = 0
    for k in kept:
        t = model_sd[k]
        dt = t.dtype if torch_dtype is None or not t.is_floating_point() else torch_dtype
        out_bytes += t.numel() * (torch.empty((), dtype=dt).element_size())

    desc = f"Loading {cls.__name__}"
    from accel_npu import fsdp_loading, zero3_loading

    def load_whole():  # stock's result from the files: for a model later used outside the engine / FSDP
        return _diffusers_load(cls, plan)

    def read_buffers_only() -> set[str]:
        """Buffers (small; not all in a broadcast) on every rank with stock's casting rules; returns parameter names."""
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        buffers = [k for k in kept if k not in params]
        if buffers:
            load_model_dict_into_meta(model, LazyTensors(ckpt, buffers), dtype=torch_dtype,
                                      model_name_or_path=plan.path, keep_in_fp32_modules=keep_in_fp32,
                                      unexpected_keys=unexpected)
        return params

    zero_cfg = zero3_loading.zero3_config()
    started = time.perf_counter()
    if zero_cfg is not None:  # ZeRO-3 zero.Init: straight into partitions, read once by rank 0
        params = read_buffers_only()
        param_keys = [k for k in kept if k in params]
        import torch.distributed as dist

        bar = progress_bar(nbytes_of(ckpt, param_keys), desc, len(needed_files)) if dist.get_rank() == 0 else None
        done = zero3_loading.load_partitioned(model, LazyTensors(ckpt, param_keys, progress=bar), zero_cfg,
                                              progress=bar)
        seconds = time.perf_counter() - started
        if dist.get_rank() == 0:
            log.warning("accel-npu: %s loaded into ZeRO-3 partitions (zero3_init_flag, %s) over %d ranks: rank 0 "
                        "read %.1f MB once in %.2f s and broadcast it in %d group(s); each rank keeps 1/%d.",
                        cls.__name__, str(done["dtype"]).replace("torch.", ""), dist.get_world_size(),
                        done["bytes_read"] / 2**20, seconds, done["groups"], dist.get_world_size())

        zero3_loading.attach_rebuild(model, load_whole, done["dtype"])
        object.__setattr__(model, "_accel_npu_source", plan.folder)
    elif fsdp_loading.reads_elsewhere():  # FSDP cpu_ram_efficient_loading: rank 0 reads for this rank
        params = read_buffers_only()
        convert = _stock_cast(model_sd, torch_dtype, keep_in_fp32)
        dtypes = {k: convert(k, torch.empty(0, dtype=model_sd[k].dtype)).dtype for k in kept if k in params}
        left_bytes = fsdp_loading.materialize_empty(model, dtypes)
        seconds = time.perf_counter() - started
        log.info("accel-npu: %s: %.1f MB of parameters left for FSDP to fill from rank 0 "
                 "(fsdp_cpu_ram_efficient_loading); this rank read no weights.", cls.__name__, left_bytes / 2**20)

        fsdp_loading.attach_fill(model, load_whole)
    else:
        slots = slot_count(max(nbytes, out_bytes))
        threads = load_threads(min(_local_world_size(), slots or _local_world_size()))
        convert = _stock_cast(model_sd, torch_dtype, keep_in_fp32)
        with load_slot(max(nbytes, out_bytes), what=f"{cls.__name__} from {plan.folder}", slots=slots):
            bar = progress_bar(nbytes, desc, len(needed_files))
            try:
                lazy = LazyTensors(ckpt, kept, progress=bar, convert=convert, threads=threads)
                load_model_dict_into_meta(model, lazy, dtype=torch_dtype, model_name_or_path=plan.path,
                                          keep_in_fp32_modules=keep_in_fp32, unexpected_keys=unexpected)
            finally:
                if bar is not None:
                    bar.close()
            seconds = time.perf_counter() - started
        if fsdp_loading.rank0_reads_for_all():
            log.warning("accel-npu: %s read on rank 0 only (fsdp_cpu_ram_efficient_loading): the other %d rank(s) "
                        "read nothing; accelerator.prepare gives them rank 0's weights (a model used without "
                        "prepare reads its files on its first call).", cls.__name__, fsdp_loading.world_size() - 1)
    malloc_trim()

    left = tensors_on_meta(model)
    if left:
        raise LoadError(f"accel-npu: after loading {plan.folder}, {cls.__name__} still has tensors on the meta "
                        f"device: {_short(left)}. They are neither in the checkpoint nor created by the "
                        "model's __init__; this model class cannot be loaded with low_cpu_mem_usage.")

    if unexpected:
        dropped_layers = _layer_indices(unexpected)
        truncated = requested_depth is not None and ckpt_depth is not None and requested_depth < ckpt_depth
        if truncated:
            log.warning(
                "accel-npu: %s truncated to %s=%d of %d: read %d tensors (%.1f MB in %.2f s) from %d of %d "
                "shard(s); skipped %d checkpoint tensors of layers %s (not read).", cls.__name__, dkey,
                requested_depth, ckpt_depth, len(kept), nbytes / 2**20, seconds, len(needed_files),
                len(ckpt.files), len(unexpected),
                _ranges(dropped_layers) if dropped_layers else "-")
        else:
            log.warning("accel-npu: %d tensor(s) of the checkpoint at %s are not used by %s (not read): %s",
                        len(unexpected), plan.folder, cls.__name__, _short(unexpected, 5))
    model.register_to_config(_name_or_path=plan.original)
    model.eval()
    if plan.output_loading_info:
        return model, {"missing_keys": [k for k in missing if k not in on_meta], "unexpected_keys": unexpected,
                       "mismatched_keys": [], "error_msgs": []}
    return model


def _stock_cast(model_sd: dict, torch_dtype, keep_in_fp32: list[str]):
    """(key, tensor) -> the tensor diffusers' ``load_model_dict_into_meta`` assigns for that key.

    Done ahead (in load threads); ``load_model_dict_into_meta`` then finds nothing left to cast.
    The same rules: with ``torch_dtype`` floating tensors take it (``_keep_in_fp32_modules``: fp32),
    without it every tensor takes the dtype of the model's (meta) tensor; contiguous like it.
    """
    import torch

    def cast(key, tensor):
        old = model_sd.get(key)
        if torch_dtype is not None and torch.is_floating_point(tensor):
            fp32 = any(m in key.split(".") for m in keep_in_fp32)
            tensor = tensor.to(torch.float32 if fp32 else torch_dtype)
        elif torch_dtype is None and old is not None:
            tensor = tensor.to(old.dtype)
        if old is not None and old.is_contiguous():
            tensor = tensor.contiguous()
        return tensor

    return cast


def _ranges(nums: list[int]) -> str:
    if not nums:
        return ""
    out, start, prev = [], nums[0], nums[0]
    for n in nums[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
        if n is not None:
            start = prev = n
    return ",".join(out)


class _Fallback(Exception):
    """Raised before anything is read when the call should go to the stock implementation."""


def _has_deprecated_attention_keys(model, ckpt: Checkpoint) -> bool:
    paths = [name for name, m in model.named_modules() if getattr(m, "_from_deprecated_attn_block", False)]
    if not paths:
        return False
    old = ("query.", "key.", "value.", "proj_attn.")
    return any(k.startswith(f"{p}.{o}") for p in paths for o in old for k in ckpt.weight_map)


def diffusers_from_pretrained(wrapped, cls, args, kwargs):
    """The wrapper body (plugins/loading.py): falls back to stock before anything is read."""
    if cls is None or not isinstance(cls, type):
        return wrapped(*args, **kwargs)
    plan = _diffusers_plan(cls, args, kwargs)
    if plan is None:
        return _stock_with_slot(wrapped, args, kwargs)
    try:
        return _diffusers_load(cls, plan)
    except _Fallback:
        return _stock_with_slot(wrapped, args, kwargs)


def _stock_with_slot(wrapped, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    finally:
        malloc_trim()


# ------------------------------------------------------------------------------------------------
# transformers PreTrainedModel.from_pretrained
# ------------------------------------------------------------------------------------------------
def transformers_from_pretrained(wrapped, cls, args, kwargs):
    """Stock transformers 5 loading (already lazy per key) plus: ACCEL_NPU_TRUNCATE, a clear error
    for a depth the checkpoint lacks, load slots, malloc_trim."""
    if cls is None or not isinstance(cls, type):
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    truncate_to = truncation_for(cls)
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    depth_asked = None
    if truncate_to is not None and kwargs.get("config") is None:
        key = "num_hidden_layers"
        raw = _local_config(path, kwargs.get("subfolder"))
        if raw is not None:
            key = depth_key(raw) or key
        kwargs.setdefault(key, truncate_to)
    for key in DEPTH_KEYS:
        if isinstance(kwargs.get(key), int):
            depth_asked = (key, kwargs[key])
    user_info = bool(kwargs.get("output_loading_info", False))
    if depth_asked is not None:
        kwargs["output_loading_info"] = True
    view = _truncated_view(path, kwargs, depth_asked[1]) if depth_asked is not None else None
    call_args = args
    if view is not None:  # a directory holding only the kept shards and an index of the kept keys
        kwargs.pop("subfolder", None)
        if args:
            call_args = (view.dir, *args[1:])
        else:
            kwargs["pretrained_model_name_or_path"] = view.dir
    nbytes = view.kept_bytes if view is not None else _local_checkpoint_bytes(path, kwargs.get("subfolder"))
    quiet = _quiet("transformers.modeling_utils") if depth_asked is not None else contextlib.nullcontext()
    try:
        with load_slot(nbytes or 0, what=f"{cls.__name__} from {path}") if nbytes else contextlib.nullcontext():
            with quiet:  # its per-key load report; our one line below says what was skipped
                result = wrapped(*call_args, **kwargs)
    finally:
        if view is not None:
            import shutil

            shutil.rmtree(view.dir, ignore_errors=True)  # open mmaps keep the files' data alive
    malloc_trim()
    if depth_asked is None:
        return result
    model, info = result
    if view is not None:
        model.config._name_or_path = path if isinstance(path, str) else os.fspath(path)
        info["unexpected_keys"] = sorted(set(info.get("unexpected_keys") or []) | set(view.dropped))
    missing = list(info.get("missing_keys") or [])
    if missing:
        raise LoadError(
            f"accel-npu: {path} has no tensor for {len(missing)} weight(s) of {cls.__name__} built with "
            f"{depth_asked[0]}={depth_asked[1]}: {_short(missing)}. The checkpoint has fewer layers: ask "
            "for at most as many as its config.json says (transformers would initialize them randomly).")
    unexpected = list(info.get("unexpected_keys") or [])
    if unexpected:
        layers = _layer_indices(unexpected)
        shards = f" from {view.kept_files} of {view.all_files} shard(s)" if view is not None else ""
        log.warning("accel-npu: %s truncated to %s=%d: read%s; skipped %d checkpoint tensors of layers %s "
                    "(not read).", cls.__name__, depth_asked[0], depth_asked[1], shards, len(unexpected),
                    _ranges(layers) or "-")
    return (model, info) if user_info else model


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
TRANSFORMERS_INDEX = "model.safetensors.index.json"


@dataclass
class _View:
    dir: str
    dropped: list[str]
    kept_files: int
    all_files: int
    kept_bytes: int


def _truncated_view(path, kwargs, depth: int) -> _View | None:
    """For a local sharded transformers checkpoint: a temporary directory with the same files but
    only the shards that hold tensors of the first ``depth`` layers, and an index of those keys."""
    if not isinstance(path, (str, os.PathLike)) or any(kwargs.get(k) for k in ("variant", "gguf_file", "from_tf",
                                                                                "from_flax")):
        return None
    if kwargs.get("use_safetensors") is False:
        return None
    folder = os.path.join(os.fspath(path), kwargs.get("subfolder") or "")
    index_path = os.path.join(folder, TRANSFORMERS_INDEX)
    if not os.path.isfile(index_path):
        return None
    try:
        with open(index_path) as f:
            index = json.load(f)
        weight_map = dict(index["weight_map"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # stock reports its own error
    dropped = [k for k in weight_map if (m := _LAYER_RE.search(k)) and int(m.group(1)) >= depth]
    if not dropped:
        return None
    kept_map = {k: v for k, v in weight_map.items() if k not in set(dropped)}
    kept_files = set(kept_map.values())
    import tempfile

    view = tempfile.mkdtemp(prefix="accel-npu-view-")
    try:
        for name in os.listdir(folder):
            if name == TRANSFORMERS_INDEX or (name.endswith(".safetensors") and name not in kept_files):
                continue
            os.symlink(os.path.abspath(os.path.join(folder, name)), os.path.join(view, name))
        with open(os.path.join(view, TRANSFORMERS_INDEX), "w") as f:
            json.dump({**index, "weight_map": kept_map}, f)
    except OSError:
        import shutil

        shutil.rmtree(view, ignore_errors=True)
        return None
    kept_bytes = sum(os.path.getsize(os.path.join(folder, n)) for n in kept_files
                     if os.path.isfile(os.path.join(folder, n)))
    return _View(view, dropped, len(kept_files), len(set(weight_map.values())), kept_bytes)


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _local_config(path, subfolder) -> dict | None:
    if not isinstance(path, (str, os.PathLike)):
        return None
    cfg = os.path.join(os.fspath(path), subfolder or "", "config.json")
    try:
        with open(cfg) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _local_checkpoint_bytes(path, subfolder) -> int | None:
    if not isinstance(path, (str, os.PathLike)):
        return None
    folder = os.path.join(os.fspath(path), subfolder or "")
    if not os.path.isdir(folder):
        return None
    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            try:
                total += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    return total or None


# ------------------------------------------------------------------------------------------------
# DiffusionPipeline.from_pretrained and accelerate's zero3_init_context_manager
# ------------------------------------------------------------------------------------------------
def pipeline_from_pretrained(wrapped, cls, args, kwargs):
    """Pipeline components are inference towers: load them outside zero.Init, keeping their dtype."""
    if not _zero3_weakref_set():
        return wrapped(*args, **kwargs)
    with outside_zero_init():
        return wrapped(*args, **kwargs)


def _zero3_weakref_set() -> bool:
    import sys

    ds = sys.modules.get("transformers.integrations.deepspeed")
    ref = getattr(ds, "_hf_deepspeed_config_weak_ref", None) if ds is not None else None
    return ref is not None and ref() is not None


def zero3_init_context_manager(wrapped, instance, args, kwargs):
    """``zero3_init_context_manager(enable=False)`` really disables zero.Init (accelerate #3170)."""
    enable = kwargs.get("enable", args[0] if args else False)
    inner = wrapped(*args, **kwargs)
    if enable:
        return inner

    @contextlib.contextmanager
    def _disabled():
        with inner:
            with outside_zero_init():
                yield

    return _disabled()

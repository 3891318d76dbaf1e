"""transformers ``PreTrainedModel.from_pretrained``: stock transformers 5 loading (already lazy
per key) plus ACCEL_NPU_TRUNCATE, a clear error for a depth the checkpoint lacks (instead of
random init), only the kept shards opened, load slots and malloc_trim."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass

from accel_npu._torch.memory import malloc_trim
from accel_npu._torch.safetensors_io import TRANSFORMERS_INDEX, read_index
from accel_npu._torch.zero import in_frozen_load, is_zero_partitioned
from accel_npu.errors import LoadError
from accel_npu.patching import argument, with_argument
from accel_npu.plugins.loading import truncation
from accel_npu.plugins.loading.frozen import whole_unless_partitioning
from accel_npu.plugins.loading.placement.zero3 import attach_rebuild
from accel_npu.plugins.loading.slots import load_slot

log = logging.getLogger("accel_npu")


def from_pretrained(wrapped, cls, args, kwargs):
    """Stock transformers 5 loading (already lazy per key) plus: ACCEL_NPU_TRUNCATE, a clear error
    for a depth the checkpoint lacks, load slots, malloc_trim; ``zero3_init_flag: false`` builds
    whole; a model transformers built under zero.Init that is called outside the DeepSpeed engine
    (a frozen text encoder) is rebuilt whole first."""
    if cls is None or not isinstance(cls, type):
        return wrapped(*args, **kwargs)
    with whole_unless_partitioning():
        result = _from_pretrained(wrapped, cls, args, kwargs)
    model = result[0] if isinstance(result, tuple) else result
    if not in_frozen_load() and is_zero_partitioned(model):
        whole_kwargs = {k: v for k, v in kwargs.items() if k != "output_loading_info"}

        def load_whole():  # what from_pretrained returns outside zero.Init (called inside outside_zero_init)
            return from_pretrained(wrapped, cls, args, whole_kwargs)

        attach_rebuild(model, load_whole, what="transformers (outside zero.Init)")
    return result


def _from_pretrained(wrapped, cls, args, kwargs):
    kwargs = dict(kwargs)
    truncate_to = truncation.truncation_for(cls)
    path = argument(args, kwargs, 0, "pretrained_model_name_or_path")
    depth_asked = None
    if truncate_to is not None and kwargs.get("config") is None:
        key = "num_hidden_layers"
        raw = _local_config(path, kwargs.get("subfolder"))
        if raw is not None:
            key = truncation.depth_key(raw) or key
        kwargs.setdefault(key, truncate_to)
    for key in truncation.DEPTH_KEYS:
        if isinstance(kwargs.get(key), int):
            depth_asked = (key, kwargs[key])
    user_info = bool(kwargs.get("output_loading_info", False))
    if depth_asked is not None:
        kwargs["output_loading_info"] = True
    view = _truncated_view(path, kwargs, depth_asked[1]) if depth_asked is not None else None
    call_args = args
    if view is not None:  # a directory holding only the kept shards and an index of the kept keys
        kwargs.pop("subfolder", None)
        call_args, kwargs = with_argument(args, kwargs, 0, "pretrained_model_name_or_path", view.dir)
    nbytes = view.kept_bytes if view is not None else _local_checkpoint_bytes(path, kwargs.get("subfolder"))
    if _under_zero_init():  # a collective (rank 0 reads, zero.Init broadcasts): a per-rank slot would deadlock
        nbytes = None
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
            f"{depth_asked[0]}={depth_asked[1]}: {truncation.short_list(missing)}. The checkpoint has fewer layers: "
            "ask "
            "for at most as many as its config.json says (transformers would initialize them randomly)."
        )
    unexpected = list(info.get("unexpected_keys") or [])
    if unexpected:
        layers = truncation.layer_indices(unexpected)
        shards = f" from {view.kept_files} of {view.all_files} shard(s)" if view is not None else ""
        log.warning(
            "accel-npu: %s truncated to %s=%d: read%s; skipped %d checkpoint tensors of layers %s (not read).",
            cls.__name__,
            depth_asked[0],
            depth_asked[1],
            shards,
            len(unexpected),
            truncation.ranges(layers) or "-",
        )
    return (model, info) if user_info else model


def _under_zero_init() -> bool:
    """transformers will build this load under deepspeed.zero.Init (every rank takes part)."""
    import sys

    ds = sys.modules.get("transformers.integrations.deepspeed")
    try:
        return bool(ds is not None and ds.is_deepspeed_zero3_enabled())
    except Exception:  # noqa: BLE001 - an unknown transformers: load as stock would
        return False


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


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
    if not isinstance(path, (str, os.PathLike)) or any(
        kwargs.get(k) for k in ("variant", "gguf_file", "from_tf", "from_flax")
    ):
        return None
    if kwargs.get("use_safetensors") is False:
        return None
    folder = os.path.join(os.fspath(path), kwargs.get("subfolder") or "")
    index_path = os.path.join(folder, TRANSFORMERS_INDEX)
    if not os.path.isfile(index_path):
        return None
    try:
        index = read_index(index_path)
        weight_map = index["weight_map"]
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
    kept_bytes = sum(
        os.path.getsize(os.path.join(folder, n)) for n in kept_files if os.path.isfile(os.path.join(folder, n))
    )
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

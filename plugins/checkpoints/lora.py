"""peft LoRA adapters in a consolidated checkpoint: written as peft and diffusers write them.

A model given ``add_adapter(LoraConfig(...))`` (diffusers' PeftAdapterMixin, peft's tuners) holds
``<module>.base_layer.weight`` and ``<module>.lora_A.<adapter>.weight`` / ``lora_B``; its
DeepSpeed checkpoint has those names. What loads is what ``get_peft_model_state_dict`` gives and
a pipeline's ``save_lora_weights`` writes: ``<pipeline attribute>.<module>.lora_A.weight`` (the
adapter name dropped), the LoraConfig in the safetensors metadata under ``lora_adapter_metadata``
(keys prefixed the same way; diffusers' ``load_lora_weights`` reads rank, alpha and targets from
it), and peft's ``adapter_config.json`` beside it. The merged weights are peft's ``merge``:
``W + scaling * B @ A`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rslora).

The LoraConfig is not in DeepSpeed's files: it is read from the LoRA file the script's save hook
wrote into the checkpoint (diffusers' ``save_lora_weights``: ``lora_adapter_metadata``) or from
an ``adapter_config.json`` there (peft's ``save_pretrained``).

Loading (``adapter_keys``): diffusers' ``load_lora_adapter`` converts a state dict from its old LoRA
naming (``to_k.lora.down``) to peft's only when the FIRST key lacks ``lora_A``; a UNet LoRA saved the
way diffusers' own ``convert_state_dict_to_diffusers`` writes it (attention in the old naming, every
other layer ``lora_A``) loads only the layers named like its first key.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accel_npu._torch.once import FirstTime
from accel_npu.errors import CheckpointError
from accel_npu.patching import argument, with_argument
from accel_npu.plugins.checkpoints.files import write_json

log = logging.getLogger("accel_npu")
_first = FirstTime()

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: diffusers' LORA_ADAPTER_METADATA_KEY (diffusers/loaders/lora_base.py)
METADATA_KEY = "lora_adapter_metadata"
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B|"
    r"lora_magnitude_vector)\.(?P<adapter>[^.]+)(?P<rest>(\.[^.]+)?)$"
)


def is_lora(keys: list[str]) -> bool:
    """The keys are a peft-wrapped model's: some ``.lora_A.<adapter>.`` and a ``.base_layer.``."""
    return any(_LORA_KEY.match(k) for k in keys) and any(".base_layer." in k for k in keys)


@dataclass
class LoraPlan:
    component: str
    prefix: str  # the component's key prefix in the checkpoint ("" for the root)
    pipe_prefix: str  # "transformer" / "unet" / "text_encoder"
    adapter: str  # peft adapter name ("default")
    config: dict  # LoraConfig.to_dict(), unprefixed
    source: str  # where the config came from
    lora_keys: dict[str, str] = field(default_factory=dict)  # output key -> checkpoint key
    modules: dict[str, dict[str, str]] = field(default_factory=dict)  # module -> {"A": key, "B": key}


def _default_pipe_prefix(comp: dict) -> str:
    cls = comp.get("class", "")
    if comp.get("library") == "transformers":
        return "text_encoder"
    return "unet" if "UNet" in cls.rsplit(".", 1)[-1] else "transformer"


def _configs_in(ckpt_dir: str) -> list[tuple[str, str | None, dict]]:
    """[(file, pipeline prefix or None, unprefixed LoraConfig dict)] found at the checkpoint's top level."""
    found = []
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name.endswith(".safetensors") and os.path.isfile(path):
            from safetensors import safe_open

            try:
                with safe_open(path, framework="pt") as f:
                    meta = (f.metadata() or {}).get(METADATA_KEY)
            except Exception:  # noqa: BLE001 - an unreadable file is not one of ours: the next candidate
                continue
            if not meta:
                continue
            try:
                flat = json.loads(meta)
            except ValueError:
                continue
            by_prefix: dict[str, dict] = {}
            for key, value in flat.items():
                pre, _, rest = key.partition(".")
                if rest:
                    by_prefix.setdefault(pre, {})[rest] = value
            for pre, cfg in by_prefix.items():
                found.append((path, pre, cfg))
        elif name == ADAPTER_CONFIG and os.path.isfile(path):
            with open(path) as f:
                found.append((path, None, json.load(f)))
    return found


def plan(
    ckpt_dir: str, keys: list[str], prefix: str, component: str, comp: dict, lora_prefix: str | None, merge: bool
) -> LoraPlan:
    """Everything needed to write the adapter (and the merged weights), checked before writing."""
    adapters = set()
    plan_ = None
    configs = _configs_in(ckpt_dir)
    pipe_prefix = lora_prefix
    if pipe_prefix is None:
        prefixes = {p for _f, p, _c in configs if p}
        default = _default_pipe_prefix(comp)
        pipe_prefix = default if default in prefixes or len(prefixes) != 1 else prefixes.pop()
    chosen = [(f, c) for f, p, c in configs if p == pipe_prefix] or [(f, c) for f, p, c in configs if p is None]
    if not chosen:
        raise CheckpointError(
            f"cannot consolidate the LoRA adapter of {component or 'the model'} in {ckpt_dir}: its LoraConfig "
            f"(rank, alpha, target modules) is not in DeepSpeed's files, and the checkpoint holds neither a "
            f"LoRA file with diffusers' '{METADATA_KEY}' for '{pipe_prefix}' (what save_lora_weights writes "
            f"from a save hook) nor an {ADAPTER_CONFIG}. Pass --lora-prefix if the adapter's keys start with "
            "another pipeline attribute. Nothing was written."
        )
    source, config = chosen[0]
    for key in keys:
        m = _LORA_KEY.match(key)
        if m:
            adapters.add(m.group("adapter"))
    if len(adapters) != 1:
        raise CheckpointError(
            f"{ckpt_dir}: {component or 'the model'} holds {len(adapters)} LoRA adapters "
            f"({', '.join(sorted(adapters))}); consolidate writes one. Nothing was written."
        )
    adapter = adapters.pop()
    plan_ = LoraPlan(component, prefix, pipe_prefix, adapter, config, source)
    for key in keys:
        m = _LORA_KEY.match(key)
        if not m or m.group("adapter") != adapter:
            continue
        module = m.group("module")
        local = module[len(prefix) :] if prefix and module.startswith(prefix) else module
        out = f"{pipe_prefix}.{local}.{m.group('kind')}{m.group('rest')}"
        plan_.lora_keys[out] = key
        if m.group("kind") in ("lora_A", "lora_B") and m.group("rest") == ".weight":
            plan_.modules.setdefault(module, {})[m.group("kind")[-1]] = key
    if merge:
        if config.get("use_dora") or any(".lora_magnitude_vector." in k for k in keys):
            raise CheckpointError(
                f"--merge-lora: {component or 'the model'} is a DoRA adapter; merging DoRA is "
                "not supported here (load the adapter with load_lora_weights). Nothing was written."
            )
        if config.get("fan_in_fan_out"):
            raise CheckpointError("--merge-lora: fan_in_fan_out adapters are not supported. Nothing was written.")
    return plan_


def scaling(plan_: LoraPlan, module: str) -> float:
    """peft's ``scaling`` of ``module``: lora_alpha / r (or / sqrt(r)), per-module patterns applied."""
    from peft.utils.other import get_pattern_key

    cfg = plan_.config
    local = module[len(plan_.prefix) :] if plan_.prefix and module.startswith(plan_.prefix) else module
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), local), cfg["r"])
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), local), cfg["lora_alpha"])
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def write_adapter(state, plan_: LoraPlan, directory: str, torch_dtype) -> list[str]:
    """``adapter_model.safetensors`` + ``adapter_config.json`` in ``directory``."""
    from safetensors.torch import save_file

    tensors = {}
    for out, key in plan_.lora_keys.items():
        t = state[key].contiguous()
        tensors[out] = t.to(torch_dtype) if t.is_floating_point() else t
    flat = {f"{plan_.pipe_prefix}.{k}": v for k, v in plan_.config.items()}
    metadata = {"format": "pt", METADATA_KEY: json.dumps(flat, indent=2, sort_keys=True)}
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS), metadata=metadata)
    write_json(os.path.join(directory, ADAPTER_CONFIG), plan_.config)
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


class _Merged:
    """A base weight with its LoRA merged in, computed when written (fp32)."""

    def __init__(self, base, a, b, scale: float):
        self.base, self.a, self.b, self.scale = base, a, b, scale
        self.shape = tuple(base.shape)
        self.dtype = base.dtype

    def contiguous(self):
        import torch

        w = self.base.contiguous().to(torch.float32)
        a = self.a.contiguous().to(torch.float32)
        b = self.b.contiguous().to(torch.float32)
        if w.dim() != 2 or a.dim() != 2 or b.dim() != 2:
            raise CheckpointError(
                f"--merge-lora: only Linear LoRA layers can be merged here (got a weight of shape "
                f"{tuple(w.shape)}); load the adapter with load_lora_weights instead."
            )
        return w + self.scale * (b @ a)


def merged_view(state, plan_: LoraPlan) -> dict[str, Any]:
    """{key without the peft wrapping: tensor} of the component with the adapter merged in."""
    out: dict[str, Any] = {}
    lora_state_keys = set(plan_.lora_keys.values())
    for key in state:
        if plan_.prefix and not key.startswith(plan_.prefix):
            continue
        if key in lora_state_keys:
            continue
        if ".base_layer." in key:
            module, _, rest = key.partition(".base_layer.")
            name = f"{module}.{rest}"
            ab = plan_.modules.get(module)
            if ab and rest == "weight":
                if "A" not in ab or "B" not in ab:
                    raise CheckpointError(
                        f"--merge-lora: {module} has lora_A or lora_B but not both. Nothing was written."
                    )
                out[name] = _Merged(state[key], state[ab["A"]], state[ab["B"]], scaling(plan_, module))
            else:
                out[name] = state[key]
        else:
            out[key] = state[key]
    return out


def peft_state_dict(wrapped, instance, args, kwargs):
    """peft's ``get_peft_model_state_dict`` of a ZeRO-3 partitioned model hands back the adapter's
    partitioned parameters themselves (not their empty ``state_dict()`` copies), so the
    ``save_file`` that follows (diffusers' ``save_lora_weights``) gathers them whole
    (plugins/checkpoints/partitioned.py) instead of writing shape-[0] tensors. peft's own
    ``PeftModel.save_pretrained`` clones entries that share a storage (all partitions are empty) before
    its save_file: the answer is remembered, so those clones are written gathered too."""
    model = argument(args, kwargs, 0, "model")
    if model is None or argument(args, kwargs, 1, "state_dict") is not None:
        return wrapped(*args, **kwargs)
    try:
        from accel_npu.plugins.checkpoints import serving

        if not any(serving.is_partitioned(p) for p in model.parameters()):
            return wrapped(*args, **kwargs)
        full = model.state_dict()
        for key, value in model.state_dict(keep_vars=True).items():
            if serving.is_partitioned(value):
                full[key] = value  # the Parameter itself: gathered when written
    except Exception:  # noqa: BLE001 - not decidable: stock behaviour
        return wrapped(*args, **kwargs)
    # peft's own PeftModel.save_pretrained passes state_dict=None by keyword (peft/peft_model.py)
    args, kwargs = with_argument(args, kwargs, 1, "state_dict", full)
    answer = wrapped(*args, **kwargs)
    if isinstance(answer, dict):
        from accel_npu.plugins.checkpoints.partitioned import remember_sources

        remember_sources(answer, {k: v for k, v in answer.items() if serving.is_partitioned(v)})
    return answer


def adapter_keys(state_dict: Mapping, prefix: str | None) -> dict | None:
    """``state_dict`` with the keys under ``prefix`` all in peft's naming, or None when stock
    ``load_lora_adapter`` already reads every one of them (or they are not a mix it half-reads).

    diffusers/loaders/peft.py ``load_lora_adapter`` (v0.35 to v0.42) runs ``convert_unet_state_dict_to_peft``
    only when the first key lacks ``lora_A`` (diffusers #14548). ``convert_state_dict_to_diffusers`` of a
    UNet's peft state dict renames only to_q/to_k/to_v/to_out.0 (utils/state_dict_utils.py
    PEFT_TO_DIFFUSERS), so the saved file's first key, a resnet's or a downsampler's, is ``lora_A``: the
    attention keys then match no module, and diffusers' unexpected-key warning (utils/peft_utils.py
    ``_maybe_warn_for_unhandled_keys``) looks only for ``.lora_``. The same conversion stock applies to a
    file whose first key is old-style is applied here to every key; keys already in peft's naming match
    none of its patterns and stay as they are."""
    from diffusers.utils.state_dict_utils import UNET_TO_DIFFUSERS, convert_unet_state_dict_to_peft

    mine = [k for k in state_dict if prefix is None or k.startswith(f"{prefix}.")]
    if not mine or "lora_A" not in mine[0]:
        return None  # nothing to load, or stock converts every key itself
    if not any(pattern in k for k in mine for pattern in UNET_TO_DIFFUSERS):
        return None
    converted = convert_unet_state_dict_to_peft({k: state_dict[k] for k in mine})
    if len(converted) != len(mine):
        return None  # one layer saved under both namings: which one loads stays stock's choice
    out = {k: v for k, v in state_dict.items() if not (prefix is None or k.startswith(f"{prefix}."))}
    out.update(converted)
    return out


def load_lora_adapter(wrapped, instance, args, kwargs):
    """diffusers' ``PeftAdapterMixin.load_lora_adapter``: a state dict (what every pipeline's
    ``load_lora_weights`` passes) whose keys mix diffusers' old LoRA naming with peft's loads all of them
    (``adapter_keys``); then, on resume under DeepSpeed, one matching an adapter the model already has
    goes into it in place (adapter_reload.py). A path given to the model's method directly is read by
    stock as before."""
    from accel_npu.plugins.checkpoints import adapter_reload

    args, kwargs = _every_key_read(instance, args, kwargs)
    return adapter_reload.diffusers_load_lora_adapter(wrapped, instance, args, kwargs)


def _every_key_read(instance, args, kwargs):
    state_dict = argument(args, kwargs, 0, "pretrained_model_name_or_path_or_dict")
    if not isinstance(state_dict, Mapping):
        return args, kwargs
    prefix = argument(args, kwargs, 1, "prefix", "transformer")
    try:
        converted = adapter_keys(state_dict, prefix)
    except Exception:  # noqa: BLE001 - keys we cannot convert go to peft as given (stock behaviour)
        converted = None
    if converted is None:
        return args, kwargs
    if _first((type(instance).__name__, prefix)):
        log.info(
            "accel-npu: the %s LoRA of %s mixes diffusers' old key naming (to_k.lora.down) with peft's "
            "(lora_A); every key is read, not only those named like the first (diffusers #14548)",
            prefix or "",
            type(instance).__name__,
        )
    return with_argument(args, kwargs, 0, "pretrained_model_name_or_path_or_dict", converted)

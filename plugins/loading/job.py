"""One diffusers model load after its checks: what the placements (zero3, fsdp, local) work from.

A :class:`LoadJob` holds the model built on meta and the checkpoint keys it keeps; each
placement module fills the model's parameters its own way from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from accel_npu._torch.safetensors_io import Checkpoint, nbytes_of
from accel_npu.plugins.loading.lazy import LazyTensors


@dataclass
class LoadJob:
    cls: type
    model: Any                      # built on meta (buffers and plain tensor attributes real)
    model_sd: dict                  # the meta model's state dict (shapes, dtypes)
    ckpt: Checkpoint
    kept: list[str]                 # checkpoint keys the model uses, in model order
    needed_files: list[str]         # shards holding them (validated)
    nbytes: int                     # bytes of ``kept`` in the files
    out_bytes: int                  # bytes of ``kept`` once cast
    torch_dtype: Any
    keep_in_fp32: list[str]
    unexpected: list[str]
    path: str                       # what from_pretrained was given (diffusers' model_name_or_path)
    folder: str                     # the directory holding the weights
    load_whole: Callable[[], Any]   # stock's result from the files (for a model used outside the engine)

    @property
    def desc(self) -> str:
        return f"Loading {self.cls.__name__}"

    def ckpt_bytes(self, keys) -> int:
        """Bytes of these keys in the checkpoint files."""
        return nbytes_of(self.ckpt, keys)

    def parameter_names(self) -> set[str]:
        return {n for n, _ in self.model.named_parameters(remove_duplicate=False)}

    def load_into_meta(self, lazy) -> None:
        """diffusers' own ``load_model_dict_into_meta`` (its casting and keep_in_fp32 rules)."""
        from diffusers.models.model_loading_utils import load_model_dict_into_meta

        load_model_dict_into_meta(self.model, lazy, dtype=self.torch_dtype, model_name_or_path=self.path,
                                  keep_in_fp32_modules=self.keep_in_fp32, unexpected_keys=self.unexpected)

    def read_buffers_only(self) -> set[str]:
        """Buffers (small; not all in a broadcast) on every rank with stock's casting rules;
        returns the parameter names, which the placement fills."""
        params = self.parameter_names()
        buffers = [k for k in self.kept if k not in params]
        if buffers:
            self.load_into_meta(LazyTensors(self.ckpt, buffers))
        return params

    def cast(self):
        """(key, tensor) -> the tensor diffusers' ``load_model_dict_into_meta`` assigns for that key.

        Done ahead (in load threads); ``load_model_dict_into_meta`` then finds nothing left to cast.
        The same rules: with ``torch_dtype`` floating tensors take it (``_keep_in_fp32_modules``:
        fp32), without it every tensor takes the dtype of the model's (meta) tensor; contiguous like it.
        """
        import torch

        model_sd, torch_dtype, keep_in_fp32 = self.model_sd, self.torch_dtype, self.keep_in_fp32

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

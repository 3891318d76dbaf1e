"""One diffusers model load after its checks: what the placements (zero3, fsdp, local) work from.

A :class:`LoadJob` holds the model built on meta and the checkpoint keys it keeps; each
placement module fills the model's parameters its own way from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from accel_npu._torch.memory import to_fresh
from accel_npu._torch.safetensors_io import Checkpoint, nbytes_of
from accel_npu.plugins.loading.lazy import LazyTensors


@dataclass
class LoadJob:
    cls: type
    model: Any  # built on meta (buffers and plain tensor attributes real)
    model_sd: dict  # the meta model's state dict (shapes, dtypes)
    ckpt: Checkpoint
    kept: list[str]  # checkpoint keys the model uses, in model order
    needed_files: list[str]  # shards holding them (validated)
    nbytes: int  # bytes of ``kept`` in the files
    out_bytes: int  # bytes of ``kept`` once cast
    torch_dtype: Any
    keep_in_fp32: list[str]
    unexpected: list[str]
    path: str  # what from_pretrained was given (diffusers' model_name_or_path)
    folder: str  # the directory holding the weights
    load_whole: Callable[[], Any]  # stock's result from the files (for a model used outside the engine)
    _cast: Any = field(default=None, init=False, repr=False)

    @property
    def desc(self) -> str:
        return f"Loading {self.cls.__name__}"

    def ckpt_bytes(self, keys) -> int:
        """Bytes of these keys in the checkpoint files."""
        return nbytes_of(self.ckpt, keys)

    def parameter_names(self) -> set[str]:
        return {n for n, _ in self.model.named_parameters(remove_duplicate=False)}

    def load_into_meta(self, lazy) -> None:
        """diffusers' own ``load_model_dict_into_meta`` (its casting and keep_in_fp32 rules), with its
        per-key work skipped where it would change nothing.

        A tensor that arrives in its final dtype and shape (``cast``) for a plain ``nn.Parameter`` or
        buffer is set as accelerate's ``set_module_tensor_to_device`` sets it (a new Parameter with
        the meta one's ``requires_grad``; the buffer itself); that call's version checks, device
        moves and quantizer branches cost ~0.2 ms a key, as long as a small model's read. Anything
        else goes to diffusers' function, unchanged.
        """
        import torch
        from diffusers.models.model_loading_utils import load_model_dict_into_meta

        cast = self.cast()
        cast_already = lazy.convert is cast  # the reader returns every tensor as this cast leaves it
        modules = dict(self.model.named_modules())
        rest = {}
        for key, tensor in lazy.items():
            old = self.model_sd.get(key)
            if old is None:
                continue  # diffusers skips keys the model does not have
            owner, _, name = key.rpartition(".")
            module = modules.get(owner)
            final = tensor if cast_already else cast(key, tensor)
            if module is not None and final is tensor and tensor.shape == old.shape and tensor.device.type == "cpu":
                param = module._parameters.get(name)
                if name in module._buffers and module._buffers[name] is not None:
                    module._buffers[name] = tensor
                    continue
                if type(param) is torch.nn.Parameter and param.is_meta:
                    new = torch.nn.Parameter(tensor, requires_grad=param.requires_grad)
                    if getattr(param, "_is_hf_initialized", None) is not None:
                        new._is_hf_initialized = param._is_hf_initialized
                    module._parameters[name] = new
                    continue
            rest[key] = tensor
        if rest:
            load_model_dict_into_meta(
                self.model,
                rest,
                dtype=self.torch_dtype,
                model_name_or_path=self.path,
                keep_in_fp32_modules=self.keep_in_fp32,
                unexpected_keys=self.unexpected,
            )

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
        The same function on every call (the readers are told whether a tensor was cast with it).
        """
        import torch

        if self._cast is not None:
            return self._cast

        model_sd, torch_dtype, keep_in_fp32 = self.model_sd, self.torch_dtype, self.keep_in_fp32

        def cast(key, tensor):
            old = model_sd.get(key)
            if torch_dtype is not None and torch.is_floating_point(tensor):
                fp32 = any(m in key.split(".") for m in keep_in_fp32)
                tensor = to_fresh(tensor, torch.float32 if fp32 else torch_dtype)
            elif torch_dtype is None and old is not None:
                tensor = to_fresh(tensor, old.dtype)
            if old is not None and old.is_contiguous():
                tensor = tensor.contiguous()
            return tensor

        self._cast = cast
        return cast

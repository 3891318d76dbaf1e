"""STAND-IN for torch_npu.contrib.transfer_to_npu: the two effects accel-npu must live with.

Mirrors torch_npu/contrib/transfer_to_npu.py (Ascend/pytorch master 9e73e708a):
- ``_patch_cuda``: ``torch.cuda.*`` is replaced with ``torch_npu.npu.*`` (``_apply_patches([['cuda',
  torch_npu.npu], ...])``), so ``torch.cuda.is_available()`` and ``torch.cuda.device_count()``
  answer for the NPUs;
- ``torch.amp.autocast_mode.autocast.__init__ = _wrapper_cuda(...)``: a "cuda" device argument
  becomes "npu".
The rest (tensor/module ``.cuda()``, distributed backend names, profiler) is not modelled.
"""

import functools

import torch

import torch_npu  # noqa: F401  (registers torch.npu)

torch.cuda.is_available = torch.npu.is_available
torch.cuda.device_count = torch.npu.device_count
_init = torch.amp.autocast_mode.autocast.__init__


@functools.wraps(_init)
def _autocast_init(self, device_type, *args, **kwargs):
    return _init(self, "npu" if device_type == "cuda" else device_type, *args, **kwargs)


torch.amp.autocast_mode.autocast.__init__ = _autocast_init

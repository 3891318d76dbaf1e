"""Attention on NPU / CPU: CUDA-only flags (diffusers' xformers switch, transformers' flash_attention_2) and
the backward of diffusers' NPU and native attention backends under context parallelism.

- ``--enable_xformers_memory_efficient_attention`` (diffusers' official scripts) /
  ``model.enable_xformers_memory_efficient_attention()``: xformers needs CUDA, and stock diffusers
  raises. The script's ``is_xformers_available()`` answers True (installed libraries get the truth),
  and the attention layers get what this machine has: diffusers' ``AttnProcessorNPU`` (torch_npu's
  fused attention) on npu, the SDPA processor diffusers already set on cpu (``diffusers.py``).
- ``attn_implementation="flash_attention_2"``: transformers runs it on npu itself; on cpu it becomes
  SDPA instead of an ImportError (``transformers.py``).
- diffusers' NPU attention backend under context parallelism (Ulysses / ring): its backward op raises
  NotImplementedError; it gets one from torch_npu's ``npu_fusion_attention_grad`` (``npu_fusion.py``).
- diffusers' native (SDPA) backend under Ulysses: its backward op runs the attention forward again; the forward
  op keeps SDPA's autograd graph for it instead (``native_sdpa.py``).

For the flags one log line per process says what ran; on a machine with CUDA their wrappers pass straight
through (docs/cuda-compat.md, "Attention flags"). The NPU backend's ops pass through wherever diffusers found
no usable torch_npu (docs/npu-contract.md).
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch
from accel_npu.scopes import CUDA_FACADE

_DIFFUSERS = "diffusers>=0.35.2,<0.43"
_REMOVE_WHEN = "never for CUDA-written scripts on NPU/CPU (xformers runs on CUDA only)"

XFORMERS_AVAILABLE = Patch(
    target="diffusers.utils.import_utils:is_xformers_available",
    supports=_DIFFUSERS,
    # e.g. examples/text_to_image/train_text_to_image.py checks it before calling the method
    reason="diffusers' scripts raise 'xformers is not available' under --enable_xformers_memory_efficient_attention "
    "without xformers: True to the script only.",
    remove_when=_REMOVE_WHEN,
    wrapper=".diffusers:is_xformers_available",
    scope=CUDA_FACADE,
)

ATTENTION_XFORMERS = Patch(
    target="diffusers.models.attention_processor:Attention.set_use_memory_efficient_attention_xformers",
    supports=_DIFFUSERS,
    reason="diffusers/models/attention_processor.py raises without xformers or CUDA; AttnProcessorNPU (npu) or "
    "SDPA (cpu) runs instead.",
    remove_when=_REMOVE_WHEN,
    wrapper=".diffusers:attention_set_xformers",
    scope=CUDA_FACADE,
)

ATTENTION_MODULE_XFORMERS = Patch(
    target="diffusers.models.attention:AttentionModuleMixin.set_use_memory_efficient_attention_xformers",
    supports=_DIFFUSERS,
    reason="diffusers/models/attention.py raises without xformers or CUDA; the native backend (SDPA, which torch_npu "
    "runs on npu) is kept.",
    remove_when=_REMOVE_WHEN,
    wrapper=".diffusers:attention_module_set_xformers",
    scope=CUDA_FACADE,
)

FLASH_ATTENTION_2 = Patch(
    target="transformers.modeling_utils:PreTrainedModel._check_and_adjust_attn_implementation",
    supports="transformers>=4.57.6,<5.26",
    reason="transformers/modeling_utils.py raises ImportError for attn_implementation='flash_attention_2' without "
    "flash_attn: SDPA on cpu (npu: transformers' own path).",
    remove_when="never for CUDA-written scripts on CPU (flash_attn runs on CUDA only)",
    wrapper=".transformers:check_and_adjust_attn_implementation",
    scope=CUDA_FACADE,
)


# diffusers 0.35.2 and 0.36.0 have neither op: their NPU backend has no context-parallel path to fix
_NPU_CONTEXT_PARALLEL = "diffusers>=0.37.0,<0.43"
_NPU_NO_CONTEXT_PARALLEL = "diffusers<0.37.0"
_NPU_REMOVE_WHEN = "diffusers' _npu_attention_backward_op calls npu_fusion_attention_grad (not as of 0.42.1)"

NPU_ATTENTION_FORWARD_OP = Patch(
    target="diffusers.models.attention_dispatch:_npu_attention_forward_op",
    supports=_NPU_CONTEXT_PARALLEL,
    stock_correct=_NPU_NO_CONTEXT_PARALLEL,
    reason="The NPU attention backend's forward op keeps only npu_fusion_attention(...)[0] (attention_dispatch.py):"
    " the same call, saving what its grad needs.",
    remove_when=_NPU_REMOVE_WHEN,
    wrapper=".npu_fusion:forward_op",
)

NPU_ATTENTION_BACKWARD_OP = Patch(
    target="diffusers.models.attention_dispatch:_npu_attention_backward_op",
    supports=_NPU_CONTEXT_PARALLEL,
    stock_correct=_NPU_NO_CONTEXT_PARALLEL,
    reason="Context-parallel training on the NPU attention backend raises 'Backward pass is not implemented "
    "for Npu Fusion Attention'; npu_fusion_attention_grad runs it.",
    remove_when=_NPU_REMOVE_WHEN,
    wrapper=".npu_fusion:backward_op",
)


# 0.35.2 has no context-parallel attention; from 0.36.0 the native forward op is 0.42.1's, and so is its backward
# op's recomputation from 0.38.0 (0.36.0 and 0.37.x differentiate outside enable_grad, which fails)
_NATIVE_CONTEXT_PARALLEL = "diffusers>=0.36.0,<0.43"
_NATIVE_NO_CONTEXT_PARALLEL = "diffusers<0.36.0"
_NATIVE_REMOVE_WHEN = (
    "diffusers' _native_attention_backward_op reuses the forward's attention instead of recomputing it"
)

NATIVE_ATTENTION_FORWARD_OP = Patch(
    target="diffusers.models.attention_dispatch:_native_attention_forward_op",
    supports=_NATIVE_CONTEXT_PARALLEL,
    stock_correct=_NATIVE_NO_CONTEXT_PARALLEL,
    reason="Under Ulysses the native (SDPA) backend keeps only q, k, v for its backward (attention_dispatch.py): "
    "the same call, its autograd graph kept.",
    remove_when=_NATIVE_REMOVE_WHEN,
    wrapper=".native_sdpa:forward_op",
)

NATIVE_ATTENTION_BACKWARD_OP = Patch(
    target="diffusers.models.attention_dispatch:_native_attention_backward_op",
    supports=_NATIVE_CONTEXT_PARALLEL,
    stock_correct=_NATIVE_NO_CONTEXT_PARALLEL,
    reason="Under Ulysses the native (SDPA) backend's backward runs every attention forward a second time: the "
    "forward's kept graph is differentiated instead.",
    remove_when=_NATIVE_REMOVE_WHEN,
    wrapper=".native_sdpa:backward_op",
)


@hookimpl
def accel_npu_register_patches():
    return [
        XFORMERS_AVAILABLE,
        ATTENTION_XFORMERS,
        ATTENTION_MODULE_XFORMERS,
        FLASH_ATTENTION_2,
        NPU_ATTENTION_FORWARD_OP,
        NPU_ATTENTION_BACKWARD_OP,
        NATIVE_ATTENTION_FORWARD_OP,
        NATIVE_ATTENTION_BACKWARD_OP,
    ]

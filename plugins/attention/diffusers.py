"""diffusers' ``enable_xformers_memory_efficient_attention()`` where xformers cannot run (no CUDA).

Stock, the official scripts stop before training: ``is_xformers_available()`` is False, so
``--enable_xformers_memory_efficient_attention`` raises "xformers is not available"; with xformers
installed, ``Attention.set_use_memory_efficient_attention_xformers`` raises "torch.cuda.is_available()
should be True" (diffusers/models/attention_processor.py, attention.py). Here the request means
"memory-efficient attention": on npu diffusers' own ``AttnProcessorNPU`` (torch_npu's
``npu_fusion_attention``), on cpu the SDPA processor diffusers already set.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

from accel_npu._torch import callsite
from accel_npu.patching import argument

from .target import attention_device, log_once

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")

#: what the stand-in ``xformers`` module reports: the scripts parse it (``version.parse(xformers.__version__)``)
#: and warn only for 0.0.16
STUB_VERSION = "0.0.0+accel.npu"


# -- is_xformers_available(): True to the user's script ----------------------------------------------
def is_xformers_available(wrapped, instance, args, kwargs):
    """True to the user's script where xformers cannot run, so its ``if is_xformers_available():``
    reaches ``enable_xformers_memory_efficient_attention()``; installed libraries (diffusers itself)
    get the truth and keep their non-xformers processors."""
    answer = wrapped(*args, **kwargs)
    if answer or attention_device() is None or callsite.caller_is_library(skip=(_HERE,)):
        return answer
    _provide_xformers_module()
    return True


def _missing(name):
    raise AttributeError(
        f"module 'xformers' has no attribute {name!r}: xformers is not installed (it needs CUDA). This module "
        "is accel-npu's stand-in, which only lets a script's `import xformers` / `xformers.__version__` "
        "check pass; diffusers' enable_xformers_memory_efficient_attention() runs torch_npu's fused "
        "attention (npu) or torch's scaled_dot_product_attention (cpu) instead (docs/cuda-compat.md)."
    )


def _provide_xformers_module() -> None:
    """The scripts go on with ``import xformers`` and ``version.parse(xformers.__version__)`` after
    ``is_xformers_available()`` (e.g. examples/text_to_image/train_text_to_image.py): where xformers is
    not installed, that import finds a module with a version and nothing else. It has no
    distribution metadata, so availability checks that read it (diffusers' and transformers'
    ``_is_package_available``) still answer False, and ``import xformers.ops`` still raises
    ModuleNotFoundError."""
    if "xformers" in sys.modules or importlib.util.find_spec("xformers") is not None:
        return
    module = types.ModuleType("xformers", "accel-npu's stand-in: xformers is not installed (it needs CUDA).")
    module.__version__ = STUB_VERSION
    module.__spec__ = importlib.machinery.ModuleSpec("xformers", None)
    module.__getattr__ = _missing
    sys.modules["xformers"] = module


# -- the attention layers ---------------------------------------------------------------------------
def attention_set_xformers(wrapped, instance, args, kwargs):
    """``Attention.set_use_memory_efficient_attention_xformers(True)`` (diffusers/models/attention_processor.py,
    the UNets', VAEs' and ControlNets' attention) without CUDA: on npu diffusers' ``AttnProcessorNPU``
    where diffusers' default ``AttnProcessor2_0`` is set (what xformers' plain ``XFormersAttnProcessor``
    would replace); other processors (LoRA, IP-Adapter, custom diffusion, added-KV, joint) are kept,
    as SDPA. On cpu the SDPA processor stays."""
    valid = argument(args, kwargs, 0, "use_memory_efficient_attention_xformers", False)
    device = attention_device()
    if not valid or device is None:
        return wrapped(*args, **kwargs)
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.utils.import_utils import is_torch_npu_available

    if device == "npu" and type(getattr(instance, "processor", None)) is AttnProcessor2_0 and is_torch_npu_available():
        instance.set_use_npu_flash_attention(True)
        log_once(
            ("diffusers", "npu"),
            "accel-npu: enable_xformers_memory_efficient_attention(): xformers needs CUDA; "
            "attention runs diffusers' AttnProcessorNPU (torch_npu.npu_fusion_attention for fp16/bf16, "
            "scaled_dot_product_attention for fp32) on npu",
        )
    else:
        log_once(
            ("diffusers", device),
            "accel-npu: enable_xformers_memory_efficient_attention(): xformers needs CUDA; "
            "attention keeps the processors diffusers set (AttnProcessor2_0: "
            "torch.nn.functional.scaled_dot_product_attention) on %s",
            device,
        )
    return None


def attention_module_set_xformers(wrapped, instance, args, kwargs):
    """``AttentionModuleMixin.set_use_memory_efficient_attention_xformers(True)`` (diffusers/models/attention.py,
    the transformer models' attention: Flux, Wan, ...) without CUDA: the attention backend stays
    diffusers' native one, torch's scaled_dot_product_attention, which torch_npu runs on npu
    (Ascend/pytorch docs/zh/api/native_api/pytorch_2-13-0/torch-nn-functional.md). diffusers' own
    "_native_npu" backend takes fp16/bf16 inputs only (attention_dispatch.py
    ``_check_qkv_dtype_bf16_or_fp16``), which an fp32 forward would not meet."""
    valid = argument(args, kwargs, 0, "use_memory_efficient_attention_xformers", False)
    device = attention_device()
    if not valid or device is None:
        return wrapped(*args, **kwargs)
    log_once(
        ("diffusers-dispatch", device),
        "accel-npu: enable_xformers_memory_efficient_attention(): xformers needs "
        "CUDA; diffusers' attention backend stays native (torch.nn.functional.scaled_dot_product_attention) on %s",
        device,
    )
    return None

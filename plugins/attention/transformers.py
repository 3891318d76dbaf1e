"""transformers' ``attn_implementation="flash_attention_2"`` where flash_attn cannot run.

Stock on a machine without CUDA, ``from_pretrained(..., attn_implementation="flash_attention_2")``
raises ImportError ("the package for FlashAttention2 doesn't seem to be installed" /
"FlashAttention2 is not available on CPU": transformers/modeling_utils.py ``_flash_attn_import_error``).
On npu transformers runs it itself (``custom_supported_devices``: ``is_torch_npu_available`` in
transformers/modeling_flash_attention_utils.py, kernels in integrations/npu_flash_attention.py):
we leave it to transformers. On cpu the model gets SDPA (eager where the model has no SDPA path).
"""

from __future__ import annotations

from accel_npu.patching import argument, with_argument

from .target import attention_device, log_once

FLASH_ATTENTION_2 = "flash_attention_2"


def check_and_adjust_attn_implementation(wrapped, instance, args, kwargs):
    requested = argument(args, kwargs, 0, "attn_implementation")
    if requested != FLASH_ATTENTION_2 or not getattr(instance, "_supports_flash_attn", False):
        return wrapped(*args, **kwargs)  # other requests, and models without FA2 support: stock's answer
    device = attention_device()
    if device is None:
        return wrapped(*args, **kwargs)
    from transformers.utils.import_utils import is_flash_attn_2_available, is_torch_npu_available

    if device == "npu":
        if is_torch_npu_available():
            log_once(
                ("transformers", "npu"),
                "accel-npu: attn_implementation='flash_attention_2' runs transformers' "
                "Ascend path (torch_npu.npu_fusion_attention, transformers/integrations/npu_flash_attention.py)",
            )
        return wrapped(*args, **kwargs)
    if is_flash_attn_2_available():
        return wrapped(*args, **kwargs)
    replacement = "sdpa" if getattr(instance, "_supports_sdpa", False) else "eager"
    log_once(
        ("transformers", replacement),
        "accel-npu: attn_implementation='flash_attention_2' runs as %r (%s) on cpu: flash_attn needs CUDA",
        replacement,
        "torch.nn.functional.scaled_dot_product_attention"
        if replacement == "sdpa"
        else "transformers' eager attention",
    )
    args, kwargs = with_argument(args, kwargs, 0, "attn_implementation", replacement)
    return wrapped(*args, **kwargs)

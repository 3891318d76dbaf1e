"""CUDA-written precision code on NPU / CPU: autocast("cuda"), bf16 ``.numpy()``, fused AdamW.

- ``torch.autocast("cuda")`` / ``torch.amp.autocast(device_type="cuda")`` / ``torch.cuda.amp.autocast``
  without CUDA: stock torch *disables* autocast with a warning, so the script silently runs fp32.
  We run autocast on the active backend's device (npu, or cpu) with the requested dtype and log
  the remap once. On a machine where CUDA is available nothing changes. On cpu, where CPU's autocast
  op lists differ from CUDA's and torch_npu's in ways that stop a half model (layer/group norm with half
  weights and fp32 activations; cat/stack of another half dtype), those calls run as CUDA runs them.
- ``torch.amp.GradScaler("cuda")`` / ``torch.GradScaler("cuda")`` / ``torch.cuda.amp.GradScaler()``
  without CUDA: stock torch disables the scaler (torch/amp/grad_scaler.py, "CUDA is not
  available.  Disabling."). Once autocast("cuda") really runs fp16 on npu/cpu, that would be fp16
  training without loss scaling, so a "cuda" scaler scales on the device autocast goes to.
- accelerate's ``mixed_precision: fp16`` on the cpu backend: stock accelerate runs fp32 there (no
  autocast, no scaler); the cpu backend debugs an npu fp16 config, so it runs fp16 with a scaler.
- ``tensor.numpy()`` on bfloat16: stock raises ``TypeError: Got unsupported
  ScalarType BFloat16``; we return a float32 array (one warning). Other dtypes are untouched.
- ``AdamW(fused=True)``: where the installed torch / torch_npu
  rejects the fused kernel for a device or dtype, fall back to the foreach implementation with one
  warning instead of raising. On the npu backend AdamW defaults to the fused kernel and never
  hands a GradScaler's ``grad_scale``/``found_inf`` to it (torch_npu's fused mode does not take
  them); the scaler unscales the gradients itself instead.
- float64 on the npu backend (docs/float64.md): many NPU kernels reject float64/complex128
  (diffusers #10428); diffusers downcasts its RoPE tables on "npu" devices
  (``maybe_adjust_dtype_for_device``) except where a model guards only "mps". ``float64.py`` covers
  those paths in the models the official training scripts train.
- a frozen bf16/fp16 model (``.to(half)``; no parameter requires grad, or none that a prepared optimizer or
  DeepSpeed engine holds) given fp32 activations outside any engine: stock stops at the first matmul
  ("expected m1 and m2 to have the same dtype"); its forward runs under ``torch.autocast`` of its dtype, as
  accelerate runs a prepared model (``frozen_half.py``).

This module declares the patches; the wrappers sit beside it: ``autocast.py``, ``loss_scaling.py``
(GradScaler, accelerate's fp16 on cpu), ``bf16_numpy.py``, ``fused_adamw.py``, ``float64.py``,
``frozen_half.py``.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch
from accel_npu.scopes import CUDA_FACADE

# -- autocast("cuda") on the active device (autocast.py) -------------------------------------------
AUTOCAST = Patch(
    target="torch.amp.autocast_mode:autocast.__init__",
    supports="torch>=2.5.1,<2.16",
    reason="autocast('cuda') without CUDA: torch/amp/autocast_mode.py disables autocast with a warning "
    "and the script silently trains in fp32; it runs on the active device.",
    remove_when="never for CUDA-written scripts on NPU/CPU (torch will keep treating 'cuda' literally)",
    wrapper=".autocast:autocast_init",
    scope=CUDA_FACADE,
)


# -- CPU autocast as CUDA runs it: norms and cat/stack of half tensors (autocast.py) ---------------
# autocast("cuda") remapped to cpu (above) meets CPU's op lists, where layer and group norm are in none:
# a bf16 model's norm given fp32 activations (a bf16 residual plus an fp16 matmul output) stops there.
def _norm_patch(name: str) -> Patch:
    return Patch(
        target=f"torch.nn.functional:{name}",
        supports="torch>=2.5.1,<2.16",
        reason=f"{name} under CPU autocast, half weights, other activations: 'mixed dtype (CPU)'; fp32 as on CUDA/NPU.",
        remove_when=f"torch's CPU autocast lists {name} among its fp32 ops, as its CUDA autocast does",
        wrapper=".autocast:norm_in_fp32",
        scope=CUDA_FACADE,
    )


LAYER_NORM_FP32, GROUP_NORM_FP32 = _norm_patch("layer_norm"), _norm_patch("group_norm")


# the same bf16 model's outputs meet autocast("cuda")'s fp16 in torch.cat / torch.stack (diffusers' pipelines
# concatenate the two prompt embeddings for classifier-free guidance; UNet up blocks their skip connections)
def _concat_patch(name: str) -> Patch:
    return Patch(
        target=f"torch:{name}",
        supports="torch>=2.5.1,<2.16",
        reason=f"torch.{name} under CPU autocast of another half dtype fails in autocast::prioritize; "
        "promotes as on CUDA.",
        remove_when=f"torch's CPU autocast stops promoting {name} (CUDA's does not)",
        wrapper=".autocast:concat_as_on_cuda",
        scope=CUDA_FACADE,
    )


CAT_AS_ON_CUDA, STACK_AS_ON_CUDA = _concat_patch("cat"), _concat_patch("stack")


# -- loss scaling: GradScaler("cuda") (loss_scaling.py) --------------------------------------------
GRAD_SCALER = Patch(
    target="torch.amp.grad_scaler:GradScaler.__init__",
    supports="torch>=2.5.1,<2.16",
    # torch_npu implements _amp_foreach_non_finite_check_and_unscale_ / _amp_update_scale_ for npu
    # (Ascend/pytorch test/custom_ops/test_amp_foreach_non_finite_check_and_unscale.py).
    reason="torch/amp/grad_scaler.py disables a 'cuda' GradScaler without CUDA, so fp16 autocast on "
    "npu/cpu trains unscaled; it scales on the autocast device.",
    remove_when="never for CUDA-written scripts on NPU/CPU (torch will keep treating 'cuda' literally)",
    wrapper=".loss_scaling:grad_scaler_init",
    scope=CUDA_FACADE,
)


# -- loss scaling: accelerate's fp16 on the cpu backend (loss_scaling.py) --------------------------
ACCELERATOR_FP16_CPU = Patch(
    target="accelerate.accelerator:Accelerator.__init__",
    supports="accelerate>=1.10.1,<1.17",
    reason="accelerate ignores mixed_precision fp16 on a cpu device (fp32, no scaler): the cpu backend "
    "debugs an npu fp16 config, so it runs fp16 with loss scaling.",
    remove_when="accelerate runs fp16 autocast with a GradScaler on cpu",
    wrapper=".loss_scaling:accelerator_init",
    scope=CUDA_FACADE,
)


# -- bf16 .numpy() (bf16_numpy.py) -----------------------------------------------------------------
BF16_NUMPY = Patch(
    target="torch._tensor:Tensor.numpy",
    supports="torch>=2.5.1,<2.16",
    reason="tensor.numpy() on bfloat16 raises 'TypeError: Got unsupported ScalarType BFloat16' "
    "(numpy has no bfloat16); returns a float32 array.",
    remove_when="numpy gains a bfloat16 dtype that torch converts to",
    wrapper=".bf16_numpy:tensor_numpy",
)


# -- fused AdamW (fused_adamw.py) ------------------------------------------------------------------
ADAMW_INIT = Patch(
    target="torch.optim.adamw:AdamW.__init__",
    supports="torch>=2.5.1,<2.16",
    # On npu AdamW defaults to torch_npu's fused kernel, but never with an fp16 GradScaler's
    # grad_scale/found_inf, which torch_npu's fused mode does not take.
    reason="AdamW(fused=True) raises where torch/torch_npu has no fused kernel for a parameter's device "
    "or dtype (torch/optim/optimizer.py); falls back to foreach.",
    remove_when="torch_npu's fused AdamW covers every dtype and accepts grad_scale/found_inf",
    wrapper=".fused_adamw:adamw_init",
)


# -- float64 on the npu backend (float64.py, imported when diffusers' module is) -------------------
LUMINA2_FREQS_CIS = Patch(
    target="diffusers.models.transformers.transformer_lumina2:Lumina2RotaryPosEmbed._precompute_freqs_cis",
    supports="diffusers>=0.35.2,<0.43",
    # transformer_lumina2.py:245 (v0.40.0) guards only mps; the tables go to the device on every forward
    reason="Lumina2's RoPE tables are complex128 except on mps and NPU kernels reject float64 (diffusers #10428): "
    "complex64 on npu, as on mps.",
    remove_when="diffusers' Lumina2RotaryPosEmbed downcasts for npu (maybe_adjust_dtype_for_device), "
    "not as of main 58eb52c080 (2026-08)",
    wrapper=".float64:lumina2_freqs_cis",
)


# -- frozen bf16/fp16 models given fp32 activations (frozen_half.py) -------------------------------
# diffusers v0.40.0 controlnet/train_controlnet_sdxl.py hands the frozen bf16 UNet prompt embeddings its
# collate_fn rebuilt as fp32 ('expected m1 and m2 to have the same dtype').
FROZEN_HALF_DIFFUSERS = Patch(
    target="diffusers.models.modeling_utils:ModelMixin.to",
    supports="diffusers>=0.35.2,<0.43",
    reason="A frozen bf16/fp16 model given fp32 activations outside any engine stops at its first matmul "
    "(no autocast there); it runs under torch.autocast.",
    remove_when="never while scripts call frozen half models outside accelerate's autocast with fp32 inputs",
    wrapper=".frozen_half:cast_to",
)

FROZEN_HALF_TRANSFORMERS = Patch(
    target="transformers.modeling_utils:PreTrainedModel.to",
    supports="transformers>=4.57.6,<5.26",
    reason="A frozen bf16/fp16 model given fp32 activations outside any engine stops at its first matmul "
    "(no autocast there); it runs under torch.autocast.",
    remove_when="never while scripts call frozen half models outside accelerate's autocast with fp32 inputs",
    wrapper=".frozen_half:cast_to",
)


# t2i_adapter/train_t2i_adapter_sdxl.py (v0.40.0) never freezes the bf16 UNet it hands fp32 prompt embeddings,
# but gives only the adapter to the optimizer: a half model no prepared optimizer holds is as good as frozen.
FROZEN_HALF_PREPARED_OPTIMIZERS = Patch(
    target="accelerate.optimizer:AcceleratedOptimizer.__init__",
    supports="accelerate>=1.10.1,<1.17",
    reason="Which parameters the prepared optimizers hold: a half model given fp32 activations whose gradients "
    "no optimizer applies runs under autocast as a frozen one.",
    remove_when="with the frozen half models' autocast",
    wrapper=".frozen_half:note_prepared_optimizer",
)


@hookimpl
def accel_npu_register_patches():
    return [
        AUTOCAST,
        LAYER_NORM_FP32,
        GROUP_NORM_FP32,
        CAT_AS_ON_CUDA,
        STACK_AS_ON_CUDA,
        GRAD_SCALER,
        ACCELERATOR_FP16_CPU,
        BF16_NUMPY,
        ADAMW_INIT,
        LUMINA2_FREQS_CIS,
        FROZEN_HALF_DIFFUSERS,
        FROZEN_HALF_TRANSFORMERS,
        FROZEN_HALF_PREPARED_OPTIMIZERS,
    ]

"""float64 / complex128 that diffusers would put on an Ascend NPU (docs/float64.md).

Many NPU kernels reject float64 and complex128 (diffusers #10428), so diffusers computes its
RoPE / sinusoidal tables in float32 on "npu" devices (``maybe_adjust_dtype_for_device`` in
``diffusers/utils/torch_utils.py``; ``get_1d_rotary_pos_embed``'s ``is_npu`` branch, #10429).
The wrappers here cover the paths that guard only "mps": each hands the device the float32 /
complex64 tensor diffusers gives an mps device, computed from the float64 table on the host.
"""

from __future__ import annotations

from accel_npu.backend import current_backend


def lumina2_freqs_cis(wrapped, instance, args, kwargs):
    """``Lumina2RotaryPosEmbed._precompute_freqs_cis`` on the npu backend: complex64 tables.

    diffusers v0.40.0 ``transformer_lumina2.py:245`` picks float64 unless mps is available, so the
    tables are complex128 (``torch.polar`` of float64 in ``get_1d_rotary_pos_embed``, called with an
    int: on the CPU, where ``is_npu`` is False); ``_get_freqs_cis`` moves them to the NPU every
    forward and ``apply_rotary_emb`` multiplies the queries and keys by them there. The table is
    still computed in float64 on the CPU (at ``__init__``, before the model has a device); only its
    dtype on the way to the device changes, to the complex64 mps gets.
    """
    freqs_cis = wrapped(*args, **kwargs)
    if current_backend().name != "npu":
        return freqs_cis
    import torch

    return [f.to(torch.complex64) if f.dtype == torch.complex128 else f for f in freqs_cis]

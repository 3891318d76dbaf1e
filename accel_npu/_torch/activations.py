"""Which arguments of a forward call are float32 *activations*: the rule both the DeepSpeed engine's
autocast (plugins/deepspeed) and the frozen half-precision models' autocast (plugins/precision) apply.

A floating fp32 tensor of two or more dimensions passed directly as an argument is an activation the
script made in fp32 (prompt embeddings rebuilt with ``torch.tensor``, latents normalised by fp32
statistics). 1-D fp32 tensors (timesteps, sigmas) and tensors nested in tuples, lists or dicts are left
out: models take those in fp32 by design and cast them themselves (diffusers' timestep embeddings,
rotary embeddings passed as (cos, sin) in diffusers' CogVideoX scripts), and so are masks passed by a
keyword naming them (``attention_mask``, ``encoder_attention_mask``: transformers and diffusers cast a
float mask to the activations' dtype themselves).
"""

from __future__ import annotations


def fp32_activations(args: tuple, kwargs: dict) -> list[str]:
    """Names ("argument <i>" or the keyword) of the fp32 activations among ``args`` / ``kwargs``."""
    import torch

    f32, tensor = torch.float32, torch.Tensor
    found = [f"argument {i}" for i, v in enumerate(args) if isinstance(v, tensor) and v.dtype == f32 and v.dim() >= 2]
    found += [
        k for k, v in kwargs.items() if isinstance(v, tensor) and v.dtype == f32 and v.dim() >= 2 and "mask" not in k
    ]
    return found

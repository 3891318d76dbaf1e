"""ZeRO-3 parameter fetches run outside ``torch.inference_mode``: parameters gathered under it become
inference tensors and the next training forward fails ("Inference tensors cannot be saved for backward")."""

from __future__ import annotations


def fetch_sub_module(wrapped, instance, args, kwargs):
    import torch

    if not torch.is_inference_mode_enabled():
        return wrapped(*args, **kwargs)
    with torch.inference_mode(False):
        return wrapped(*args, **kwargs)

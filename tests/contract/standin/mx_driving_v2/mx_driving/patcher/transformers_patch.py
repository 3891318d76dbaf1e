"""STAND-IN for mx_driving/patcher/transformers_patch.py (Ascend/DrivingSDK 7b10704e).

Mirrored: ``TransformersNPU`` (name "transformers_npu") is a composite patch whose ``patches()``
imports ``transformers.models.qwen3.modeling_qwen3`` (``_is_qwen3_available``) and, where it
exists, replaces ``Qwen3RMSNorm.forward`` and ``apply_rotary_pos_emb`` (upstream: with
``torch_npu.npu_rms_norm`` / ``npu_rotary_mul``; the stand-in torch_npu has no kernels, so the
replacements compute the same thing in torch and are told apart by their module). Qwen3-VL and
flash-attention parts (transformers >= 4.57 / 4.51-4.52 only) are not modelled.
"""

import importlib


def qwen3_rms_norm_forward(self, hidden_states):
    import torch

    dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


def qwen3_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    def rotate_half(x):
        import torch

        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class TransformersNPU:
    name = "transformers_npu"
    legacy_name = "transformers_npu"
    target_module = "transformers"

    @classmethod
    def patches(cls, options=None):
        try:
            qwen3 = importlib.import_module("transformers.models.qwen3.modeling_qwen3")
        except ImportError:
            return []
        return [
            (qwen3.Qwen3RMSNorm, "forward", qwen3_rms_norm_forward),
            (qwen3, "apply_rotary_pos_emb", qwen3_apply_rotary_pos_emb),
        ]

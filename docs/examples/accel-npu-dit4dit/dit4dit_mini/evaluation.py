"""Evaluation of the action head, shaped like DiT4DiT's ``eval_action_model`` (commit 1ae6efd).

The training path truncates ``actions`` / ``action_mask`` to ``action_horizon`` (8) in the
dataloader; this evaluation path receives the raw observation-horizon (16) tensors and fails
with ``RuntimeError: The size of tensor a (16) must match the size of tensor b (8) at
non-singleton dimension 1`` (field report 001, pitfall 7.6). The code here is left exactly as
the repo has it: the fix lives in the plugin (accel_npu_dit4dit.plugin).
"""

from __future__ import annotations

import torch


def eval_action_model(pred_actions: torch.Tensor, actions: torch.Tensor, action_mask: torch.Tensor) -> float:
    """Masked mean squared error of predicted action chunks.

    pred_actions: (B, action_horizon, action_dim), the model's output.
    actions, action_mask: (B, horizon, action_dim) and (B, horizon) from the dataset.
    """
    err = (actions.float() - pred_actions.float()) ** 2 * action_mask.float().unsqueeze(-1)
    return float(err.sum() / action_mask.float().sum().clamp(min=1) / pred_actions.shape[-1])

"""``python -m dit4dit_mini``: one evaluation step on a seeded batch, as the repo's eval loop runs it.

The dataset yields obs_horizon=16 steps, the action head predicts action_horizon=8.
"""

import torch

from dit4dit_mini.evaluation import eval_action_model

OBS_HORIZON, ACTION_HORIZON, ACTION_DIM = 16, 8, 14

g = torch.Generator().manual_seed(0)
actions = torch.randn(2, OBS_HORIZON, ACTION_DIM, generator=g)
action_mask = torch.ones(2, OBS_HORIZON)
pred_actions = actions[:, :ACTION_HORIZON] + 0.1 * torch.randn(2, ACTION_HORIZON, ACTION_DIM, generator=g)
print(f"eval action mse: {eval_action_model(pred_actions.to(torch.bfloat16), actions, action_mask):.4f}")

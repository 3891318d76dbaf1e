"""accel-npu plugin ``dit4dit``: repo-specific fixes, declared through accel-npu's public hooks.

Top level: stdlib and accel_npu only (this module is imported inside ``import torch``).
"""

from __future__ import annotations

import logging

from accel_npu import hookimpl
from accel_npu.patching import Patch

log = logging.getLogger("accel_npu_dit4dit")
_told = False


def _truncate_to_action_horizon(wrapped, instance, args, kwargs):
    """Pitfall 7.6: cut ``actions`` / ``action_mask`` to the predicted horizon, as training does."""
    global _told
    names = ("pred_actions", "actions", "action_mask")
    bound = dict(zip(names, args), **kwargs)
    pred, actions, mask = (bound.get(n) for n in names)
    if pred is None or actions is None or mask is None or pred.dim() < 2 or actions.dim() < 2:
        return wrapped(*args, **kwargs)
    horizon = pred.shape[1]
    if actions.shape[1] <= horizon and mask.shape[1] <= horizon:
        return wrapped(*args, **kwargs)  # already aligned: pass straight through
    if not _told:
        _told = True
        log.warning(
            "accel-npu-dit4dit: eval_action_model got %d-step actions/action_mask for a %d-step "
            "prediction; truncating to action_horizon=%d as the training path does (pitfall 7.6)",
            actions.shape[1],
            horizon,
            horizon,
        )
    bound.update(actions=actions[:, :horizon], action_mask=mask[:, :horizon])
    return wrapped(**bound)


EVAL_ACTION_HORIZON = Patch(
    target="dit4dit_mini.evaluation:eval_action_model",
    supports="accel-npu-dit4dit>=0.1,<0.2",
    reason="DiT4DiT pitfall 7.6: eval feeds obs_horizon (16) actions/action_mask against "
    "action_horizon (8) predictions -> 'The size of tensor a (16) must match the size of tensor b (8)'",
    remove_when="the repo truncates to action_horizon in eval_action_model itself",
    wrapper=_truncate_to_action_horizon,
)


@hookimpl
def accel_npu_register_patches():
    return [EVAL_ACTION_HORIZON]


@hookimpl
def accel_npu_launch_env(backend, env):
    """Field report 001, 5.1: the repo's train_8p.sh exported WANDB_MODE=offline because Ascend training
    nodes have no internet (wandb.init then hangs). As a launch default the script is not needed;
    a value in the user's shell still wins (accel-npu applies defaults only where unset)."""
    if backend.name != "npu":
        return None
    return {"WANDB_MODE": "offline"}


@hookimpl
def accel_npu_env_report(backend):
    from importlib.metadata import version

    return (
        "DiT4DiT (accel-npu-dit4dit)",
        {
            "version": version("accel-npu-dit4dit"),
            "eval_action_model": EVAL_ACTION_HORIZON.status,
        },
    )

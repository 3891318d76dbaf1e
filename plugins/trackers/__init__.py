"""Experiment trackers as diffusers' scripts start them.

``accelerator.init_trackers(name, config=vars(args))`` under ``--report_to tensorboard`` hands the
whole argument namespace to accelerate's TensorBoardTracker, which passes it straight to torch's
``SummaryWriter.add_hparams`` (accelerate/tracking.py ``store_init_configuration``). torch's hparams take
int, float, str, bool, None or a tensor and raise ``ValueError: value should be one of int, float, str,
bool, or torch.Tensor`` for anything else (torch/utils/tensorboard/summary.py ``hparams``; pytorch #49076,
accelerate #3727, diffusers #12107, all open): an argument parsed as a list or a dict (``nargs``,
``type=json.loads``) stops the script before its first step, on GPUs too. Many diffusers scripts pop such
keys by hand before the call; v0.40.0's cosmos/train_cosmos_predict25_lora.py does not
(``--conditional_frames_probs``, a dict). Here TensorBoard's hparams record those values as their ``str()``,
with one warning naming the keys; accelerate's hparams.yml beside them keeps the real values, and every
other value is passed as it was.

This module declares the patch; ``hparams.py`` holds the wrapper.
"""

from __future__ import annotations

from accel_npu.hookspecs import hookimpl
from accel_npu.patching import Patch

TENSORBOARD_HPARAMS = Patch(
    target="accelerate.tracking:TensorBoardTracker.store_init_configuration",
    supports="accelerate>=1.10.1,<1.17",
    reason="init_trackers(config=vars(args)) with a list/dict value raises in torch's add_hparams "
    "(accelerate #3727); TensorBoard records its str(), hparams.yml the value.",
    remove_when="accelerate's TensorBoardTracker or torch's hparams accept (or stringify) non-scalar values",
    wrapper=".hparams:store_init_configuration",
)


@hookimpl
def accel_npu_register_patches():
    return [TENSORBOARD_HPARAMS]

"""Stand-in for torch_npu's import-order effect: sets TORCH_DEVICE_BACKEND_AUTOLOAD=0, then imports torch.

torch_npu does exactly this while importing itself, so a script that imports torch_npu before
torch runs with every torch.backends entry point (accel-npu's included) switched off.
"""

import os

os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
import torch  # noqa: F401 - imported for its effect, with autoload off

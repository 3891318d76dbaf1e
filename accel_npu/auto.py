"""``import accel_npu.auto``: explicit activation where the torch entry point does not run.

(e.g. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``). Safe to import before or after torch.
"""

from accel_npu.activation import activate as _activate

_activate(strict=False)

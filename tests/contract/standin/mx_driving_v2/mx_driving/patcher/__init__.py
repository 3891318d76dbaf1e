"""STAND-IN for mx_driving/patcher/__init__.py (Ascend/DrivingSDK master e667017e).

Mirrored: importing the package imports torch, torch_npu and ``torch_npu.contrib.transfer_to_npu``
(best effort, "Built-in Dependencies" block); ``default_patcher`` is a ``Patcher`` holding
``_DEFAULT_PATCH_CLASSES`` (mmcv/mmdet/numpy/torch patches, not modelled here) and **not**
TransformersNPU, which users add (docs/zh/features/patcher.md, table of predefined patches:
TransformersNPU ❌ in default_patcher); ``default_patcher_builder`` is the 1.0 API kept in
``legacy.py``.
"""

try:
    import torch  # noqa: F401 - imported for its effect, as upstream
except ImportError:
    pass
try:
    import torch_npu  # noqa: F401 - imported for its effect: registers the npu device
except ImportError:
    pass
else:
    try:
        from torch_npu.contrib import transfer_to_npu  # noqa: F401 - imported for its effect: the monkey-patches
    except ImportError:
        pass

from mx_driving.patcher.patcher import Patcher
from mx_driving.patcher.transformers_patch import TransformersNPU

default_patcher = Patcher()

from mx_driving.patcher.legacy import default_patcher_builder  # noqa: E402 - after default_patcher exists, which it reads (upstream order)

__all__ = ["Patcher", "default_patcher", "TransformersNPU", "default_patcher_builder"]

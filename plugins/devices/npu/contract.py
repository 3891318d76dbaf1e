"""The complete list of torch_npu and mx_driving calls accel-npu makes (docs/npu-contract.md).

Tests exercise it against stand-ins that only the tests install (tests/contract/).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util


class TorchNpu:
    """The complete list of torch_npu calls accel-npu makes (docs/npu-contract.md)."""

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("torch_npu") is not None

    @staticmethod
    def module():
        import torch_npu  # registers the "npu" device with torch

        return torch_npu

    @staticmethod
    def version() -> str:
        return getattr(TorchNpu.module(), "__version__", "unknown")

    @staticmethod
    def is_available() -> bool:
        import torch

        TorchNpu.module()
        return bool(torch.npu.is_available())

    @staticmethod
    def device_count() -> int:
        import torch

        TorchNpu.module()
        return int(torch.npu.device_count())

    @staticmethod
    def raw_device_count() -> int:
        """The driver's NPU count before ASCEND_RT_VISIBLE_DEVICES (torch_npu/npu/__init__.py
        ``_raw_device_count_ascend_hal``, v7.1.0.2-pytorch2.6.0 .. master: drvGetDevNum; -1 on failure)."""
        return int(TorchNpu.module().npu._raw_device_count_ascend_hal())

    @staticmethod
    def soc_name() -> str:
        """``torch.npu.get_device_name()``: the SoC, e.g. Ascend910B1 (torch_npu/npu/__init__.py)."""
        import torch

        TorchNpu.module()
        return str(torch.npu.get_device_name())

    @staticmethod
    def is_bf16_supported() -> bool:
        """``torch.npu.is_bf16_supported()`` (torch_npu/npu/utils.py: the SoC decides; 910A has none)."""
        import torch

        TorchNpu.module()
        return bool(torch.npu.is_bf16_supported())

    @staticmethod
    def cann_version() -> str | None:
        """``torch_npu.npu.utils.get_cann_version()`` (v7.1.0.2 and later; None where absent)."""
        TorchNpu.module()
        utils = importlib.import_module("torch_npu.npu.utils")
        probe = getattr(utils, "get_cann_version", None)
        return str(probe()) if probe else None

    @staticmethod
    def dist_version() -> str | None:
        """The installed torch_npu distribution's version, from its metadata (no import)."""
        try:
            return importlib.metadata.version("torch_npu")
        except importlib.metadata.PackageNotFoundError:
            return None

    @staticmethod
    def package_dir() -> str | None:
        """torch_npu's package directory, found without importing it."""
        spec = importlib.util.find_spec("torch_npu")
        if spec is None or not spec.submodule_search_locations:
            return None
        return list(spec.submodule_search_locations)[0]


class MxDriving:
    """The complete list of mx_driving calls accel-npu makes (docs/npu-contract.md).

    DrivingSDK's patcher lives in ``mx_driving.patcher`` in every release (Ascend/DrivingSDK
    branch_v7.1.RC1 .. branch_v26.0.0, master); there is no ``mx_driving.tools.patch``. Two APIs:

    - patcher 2.0 (master e667017e and later): ``default_patcher`` (a ``Patcher``), ``.add(...)``,
      ``.apply()``. ``TransformersNPU`` (``mx_driving/patcher/transformers_patch.py``: Qwen3
      RMSNorm/RoPE on torch_npu kernels, npu flash attention for transformers 4.51/4.52) is **not**
      in ``default_patcher`` (``_DEFAULT_PATCH_CLASSES``): it must be added. Importing
      ``mx_driving.patcher`` imports ``torch_npu.contrib.transfer_to_npu`` (its ``__init__.py``).
    - patcher 1.0 (branch_v7.2.RC1 .. branch_v26.0.0; still on master as ``legacy.py``):
      ``default_patcher_builder.build().__enter__()``; ``Patcher.__enter__`` imports
      ``torch_npu.contrib.transfer_to_npu`` (``patcher.py`` ``transfer_to_npu``). No TransformersNPU.
    """

    MODULE = "mx_driving.patcher"

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("mx_driving") is not None

    @staticmethod
    def transformers_npu(module):
        """mx_driving's TransformersNPU patch class, or None where this release has none."""
        found = getattr(module, "TransformersNPU", None)
        if found is None and importlib.util.find_spec(f"{MxDriving.MODULE}.transformers_patch") is not None:
            found = getattr(importlib.import_module(f"{MxDriving.MODULE}.transformers_patch"), "TransformersNPU", None)
        return found

    @staticmethod
    def apply_patcher():
        """Apply mx_driving's default patcher, with TransformersNPU where the release has it.

        Returns (api description, patcher object). Must run before transformers is imported
        (DrivingSDK docs/zh/features/patcher.md: ``apply()`` before any other import).
        """
        module = importlib.import_module(MxDriving.MODULE)
        patcher = getattr(module, "default_patcher", None)
        if patcher is not None:
            transformers_npu = MxDriving.transformers_npu(module)
            if transformers_npu is not None:
                patcher.add(transformers_npu)
            patcher.apply()
            return (
                "mx_driving.patcher.default_patcher"
                + (".add(TransformersNPU)" if transformers_npu else "")
                + ".apply()"
                + ("" if transformers_npu else " (this mx_driving has no TransformersNPU)"),
                patcher,
            )
        builder = getattr(module, "default_patcher_builder", None)
        if builder is None:
            raise ImportError(
                "mx_driving.patcher has neither default_patcher (patcher 2.0) nor default_patcher_builder (patcher 1.0)"
            )
        patcher = builder.build()
        patcher.__enter__()
        return (
            "mx_driving.patcher.default_patcher_builder.build().__enter__() (patcher 1.0: no TransformersNPU)",
            patcher,
        )

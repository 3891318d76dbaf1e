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
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

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
    """The complete list of mx_driving calls accel-npu makes (docs/npu-contract.md)."""

    #: module holding ``default_patcher_builder`` (>= 1.0.20260421; DrivingSDK layout), in order
    BUILDER_MODULES = ("mx_driving.tools.patch.patcher", "mx_driving.patcher")

    @staticmethod
    def installed() -> bool:
        return importlib.util.find_spec("mx_driving") is not None

    @staticmethod
    def apply_patcher():
        """Enter mx_driving's default patcher; returns (api description, patcher object).

        New API: ``default_patcher_builder.build().__enter__()``; pre-1.0 fallback:
        ``Patcher().add(TransformersNPU).apply()`` from ``mx_driving.tools.patch``.
        """
        errors = []
        for module_name in MxDriving.BUILDER_MODULES:
            try:
                module = importlib.import_module(module_name)
                builder = module.default_patcher_builder
            except (ImportError, AttributeError) as exc:
                errors.append(f"{module_name}.default_patcher_builder: {type(exc).__name__}: {exc}")
                continue
            patcher = builder.build()
            patcher.__enter__()
            return f"{module_name}.default_patcher_builder.build().__enter__()", patcher
        try:
            legacy = importlib.import_module("mx_driving.tools.patch")
            patcher = legacy.Patcher().add(legacy.TransformersNPU)
            patcher.apply()
            return "mx_driving.tools.patch.Patcher().add(TransformersNPU).apply()", patcher
        except (ImportError, AttributeError) as exc:
            errors.append(f"mx_driving.tools.patch.Patcher/TransformersNPU: {type(exc).__name__}: {exc}")
        raise ImportError("no known mx_driving patcher API: " + "; ".join(errors))

"""STAND-IN for mx_driving/patcher/__init__.py (Ascend/DrivingSDK branch_v26.0.0): the module
patches and ``default_patcher_builder = PatcherBuilder().add_module_patch(...)`` (only the torch
entries are modelled: ``index``, ``batch_matmul`` record their call)."""

import mx_driving
from mx_driving.patcher.patcher import Patch, Patcher, PatcherBuilder


def index(module, options):
    mx_driving.CALLS.append("patch index -> torch")


def batch_matmul(module, options):
    mx_driving.CALLS.append("patch batch_matmul -> torch")


default_patcher_builder = PatcherBuilder().add_module_patch("torch", Patch(index), Patch(batch_matmul))

__all__ = ["default_patcher_builder", "Patch", "Patcher", "PatcherBuilder"]

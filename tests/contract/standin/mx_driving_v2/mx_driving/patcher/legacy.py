"""STAND-IN for mx_driving/patcher/legacy.py (Ascend/DrivingSDK master e667017e): the 1.0
``default_patcher_builder.build()`` returns a ``_LegacyPatcher`` whose ``__enter__`` applies a
new-API Patcher holding the default patch classes."""

import mx_driving
from mx_driving.patcher.patcher import Patcher


class _LegacyPatcher:
    def __init__(self, patcher):
        self._patcher = patcher

    def __enter__(self):
        mx_driving.CALLS.append("default_patcher_builder.build().__enter__()")
        self._patcher.apply()
        return self

    def __exit__(self, *args):
        pass


class _DefaultPatcherBuilderProxy:
    def build(self, allow_internal_format=False):
        return _LegacyPatcher(Patcher())


default_patcher_builder = _DefaultPatcherBuilderProxy()

"""Modules that are still importing: a patch target reached half-way through its own import.

``import accelerate`` before torch runs ``accelerate/accelerator.py`` up to its ``import torch``,
which activates accel-npu before ``Accelerator`` exists. The ledger waits for such a module to
finish (:func:`call_when_imported`) instead of declaring its patches skipped.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("accel_npu")


def still_importing(module) -> bool:
    """True while the module's body is still running (it is in sys.modules half-initialised)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _SpecThatReportsImported(importlib.machinery.ModuleSpec):
    """A ModuleSpec that calls back when importlib marks the module initialised.

    importlib's ``_load_unlocked`` (CPython 3.4 to 3.14) sets ``spec._initializing = True``, runs
    the module body, puts the module back in sys.modules and sets ``spec._initializing = False``
    in a ``finally``: that assignment is the one moment "this module finished importing" exists.
    """

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "_initializing" and not value:
            callbacks = self.__dict__.pop("_accel_npu_when_imported", ())
            self.__class__ = importlib.machinery.ModuleSpec  # back to a plain spec
            module = sys.modules.get(self.name)
            if module is None:  # the module body raised: nothing to patch
                return
            for callback in callbacks:
                try:
                    callback(module)
                except Exception as exc:  # noqa: BLE001 - never break someone's import
                    log.warning("accel-npu: post-import callback for %s failed: %r", self.name, exc)


def call_when_imported(module, callback: Callable[[Any], None]) -> bool:
    """Call ``callback(module)`` once the half-initialised ``module`` finishes importing.

    Returns False when that cannot be arranged (not a standard ModuleSpec), and the caller then
    goes on at once.
    """
    spec = getattr(module, "__spec__", None)
    if type(spec) is importlib.machinery.ModuleSpec:
        try:
            spec.__class__ = _SpecThatReportsImported
        except TypeError:
            return False
    elif not isinstance(spec, _SpecThatReportsImported):
        return False
    pending = spec.__dict__.setdefault("_accel_npu_when_imported", [])
    if callback not in pending:
        pending.append(callback)
    return True

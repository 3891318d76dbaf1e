"""STAND-IN for mx_driving/patcher/patcher.py ``Patcher`` (Ascend/DrivingSDK master e667017e).

Mirrored: ``add(*patch_classes)`` returns the patcher; ``apply()`` sets
``torch.npu.config.allow_internal_format`` (``_set_npu_internal_format``, False unless asked), then
collects every added class's ``patches()`` in insertion order and applies each; a second
``apply()`` only warns ("Patches already applied"); ``__enter__`` is ``apply()``.
"""

import sys

import mx_driving


class Patcher:
    def __init__(self):
        self._entries = []
        self._applied = False

    def add(self, *items, options=None):
        self._entries.extend(items)
        mx_driving.CALLS.append("default_patcher.add(" + ", ".join(i.__name__ for i in items) + ")")
        return self

    def apply(self, allow_internal_format=None):
        if self._applied:
            return self
        # stand-in bookkeeping, the witness for "applied before the script imported transformers"
        mx_driving.CALLS.append(
            f"default_patcher.apply() [transformers imported before: {'transformers' in sys.modules}]"
        )
        try:
            import torch
            import torch_npu  # noqa: F401 - imported for its effect: registers the npu device

            torch.npu.config.allow_internal_format = bool(allow_internal_format)
        except (ImportError, AttributeError):
            pass
        for cls in self._entries:
            for owner, attribute, replacement in cls.patches():
                setattr(owner, attribute, replacement)
        self._applied = True
        return self

    def __enter__(self):
        self.apply()
        return self

    def __exit__(self, *args):
        pass

    @property
    def is_applied(self):
        return self._applied

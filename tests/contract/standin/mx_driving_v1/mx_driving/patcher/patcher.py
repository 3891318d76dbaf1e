"""STAND-IN for mx_driving/patcher/patcher.py (Ascend/DrivingSDK branch_v26.0.0).

Mirrored: ``PatcherBuilder.build(allow_internal_format=False)`` returns a ``Patcher`` that imports
each patched module when built; ``Patcher.__enter__`` calls ``transfer_to_npu()`` — which imports
torch, torch_npu and ``torch_npu.contrib.transfer_to_npu`` and sets
``torch.npu.config.allow_internal_format`` — then ``apply()``, which calls each ``Patch.func(module,
options)`` once.
"""

import importlib

import mx_driving


class Patch:
    def __init__(self, func, options=None, priority=0, patch_failure_warning=True):
        self.func, self.name = func, func.__name__
        self.options = {} if options is None else options
        self.priority, self.is_applied = priority, False

    def __lt__(self, other):
        return self.priority < other.priority


class Patcher:
    def __init__(self, module_patches, blacklist, allow_internal_format=False):
        self.modules = [importlib.import_module(name) for name in module_patches]
        self.module_patches, self.blacklist = module_patches, blacklist
        self.allow_internal_format = allow_internal_format

    def apply(self):
        for module in self.modules:
            for patch in self.module_patches[module.__name__]:
                if patch.name in self.blacklist or patch.is_applied:
                    continue
                patch.func(module, patch.options)
                patch.is_applied = True

    def transfer_to_npu(self):
        import torch
        import torch_npu  # noqa: F401 - imported for its effect: registers the npu device
        from torch_npu.contrib import transfer_to_npu  # noqa: F401 - imported for its effect: the monkey-patches

        mx_driving.CALLS.append("transfer_to_npu")
        torch.npu.config.allow_internal_format = self.allow_internal_format

    def __enter__(self):
        mx_driving.CALLS.append("default_patcher_builder.build().__enter__()")
        self.transfer_to_npu()
        self.apply()

    def __exit__(self, exc_type, exc_value, traceback):
        pass


class PatcherBuilder:
    def __init__(self):
        self.module_patches, self.blacklist = {}, set()

    def add_module_patch(self, module_name, *patches):
        self.module_patches.setdefault(module_name, []).extend(patches)
        self.module_patches[module_name].sort()
        return self

    def build(self, allow_internal_format=False):
        return Patcher(self.module_patches, self.blacklist, allow_internal_format)

"""Releases that need a newer torch than they declare: the AttributeError they end in, explained.

diffusers declares no torch requirement at all, so pip pairs diffusers 0.41+ with torch 2.5.1 (torch_npu
2.5.1's pair), and ``import diffusers`` stops at "module 'torch' has no attribute 'accelerator'"
(diffusers/utils/torch_utils.py ``TorchDeviceBackend._detect_device_type``; ``torch.accelerator`` came with
torch 2.6). The version matrix found it (torch_npu_2_5 in benchmarks/results/versions.md).
"""
from __future__ import annotations

import re

# (distribution, first release that needs it, the torch attribute it needs, the first torch that has it)
UNDECLARED_TORCH_NEEDS = (("diffusers", "0.41.0", "accelerator", "2.6"),)

_MISSING = re.compile(r"module 'torch' has no attribute '(\w+)'")


def explain(error: BaseException) -> str | None:
    """One line naming the release that needs a newer torch and the pip command that fixes it, or None."""
    match = _MISSING.search(str(error)) if isinstance(error, AttributeError) else None
    if match is None:
        return None
    from accel_npu.patching import installed_version, version_satisfies

    torch = installed_version("torch")
    for dist, since, attribute, torch_since in UNDECLARED_TORCH_NEEDS:
        installed = installed_version(dist)
        if attribute != match.group(1) or installed is None or torch is None:
            continue
        if version_satisfies(installed, [(">=", since)]) and not version_satisfies(torch, [(">=", torch_since)]):
            return (f"{dist} {installed} needs torch >= {torch_since} (torch.{attribute}; {dist} does not declare "
                    f"it) and torch {torch} is installed: pip install '{dist}<{since}', or use a torch (and "
                    f"torch_npu) pair >= {torch_since}.")
    return None

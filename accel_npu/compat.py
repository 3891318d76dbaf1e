"""Library releases that need a newer torch than their metadata declares.

Neither diffusers nor transformers declares a torch requirement, so pip pairs their newest releases with any
torch, torch_npu 2.5.1's 2.5.1 included, and the failure comes later and far from its cause: diffusers 0.41+
stops at "module 'torch' has no attribute 'accelerator'" (diffusers/utils/torch_utils.py
``TorchDeviceBackend._detect_device_type``; ``torch.accelerator`` came with torch 2.6), transformers 5 logs
"Disabling PyTorch because PyTorch >= 2.6 is required" (transformers/utils/import_utils.py) and its models then
fail in ``object.__init__``. The version matrix found both (torch_npu_2_5 in benchmarks/results/versions.md).
"""

from __future__ import annotations

# (distribution, its first release that needs the newer torch, that torch, what the release does without it)
UNDECLARED_TORCH_NEEDS = (
    ("diffusers", "0.41.0", "2.6", "uses torch.accelerator"),
    ("transformers", "5.0.0", "2.6", "disables PyTorch below it"),
)


def undeclared_torch_mismatches() -> list[str]:
    """One line per installed release that needs a newer torch than the installed one, with the pip fix."""
    from accel_npu.patching import installed_version, version_satisfies

    torch = installed_version("torch")
    lines = []
    for dist, since, torch_since, what in UNDECLARED_TORCH_NEEDS:
        installed = installed_version(dist)
        if torch is None or installed is None:
            continue
        if version_satisfies(installed, [(">=", since)]) and not version_satisfies(torch, [(">=", torch_since)]):
            lines.append(
                f"{dist} {installed} needs torch >= {torch_since} ({what}; {dist} does not declare it) "
                f"and torch {torch} is installed: pip install '{dist}<{since}', or use a torch (and "
                f"torch_npu) pair >= {torch_since}."
            )
    return lines

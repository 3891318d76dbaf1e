"""In-process helpers for tests that compare accel-npu with stock behaviour in one process."""

import contextlib

import accel_npu


def declared_patches() -> list:
    """Every patch the registered plugins declare, as the plugin manager hands them to the ledger."""
    from accel_npu.manager import declared_patches, get_plugin_manager

    pm = get_plugin_manager()
    return [p for impl in pm.hook.accel_npu_register_patches.get_hookimpls() for p in declared_patches(impl)]


@contextlib.contextmanager
def stock():
    """Run the body with every accel-npu patch removed (the exact originals back), then re-arm."""
    accel_npu.unpatch()
    try:
        yield
    finally:
        accel_npu.patch()


@contextlib.contextmanager
def without(*patches):
    """Run the body with these patches removed (the exact originals back), as ACCEL_NPU_DISABLED_PATCHES
    leaves a launch; then re-applied."""
    from accel_npu.patching import get_ledger

    ledger = get_ledger()
    found = [ledger.find(p.target) for p in patches]
    assert all(p is not None and p.applied for p in found), [p.target for p in patches]
    for p in found:
        ledger.unpatch(p)
    try:
        yield
    finally:
        for p in found:
            ledger.apply(p)

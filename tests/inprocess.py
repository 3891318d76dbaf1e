"""In-process helpers for tests that compare accel-npu with stock behaviour in one process."""
import contextlib

import accel_npu


@contextlib.contextmanager
def stock():
    """Run the body with every accel-npu patch removed (the exact originals back), then re-arm."""
    accel_npu.unpatch()
    try:
        yield
    finally:
        accel_npu.patch()

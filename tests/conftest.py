import os

import pytest

# Launched processes inherit this; keeps 2 ranks on 2 cores from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def fresh_pm(monkeypatch):
    """A plugin manager and backend cache rebuilt from the current (monkeypatched) environment."""
    from accel_npu.backend import reset_backend_cache
    from accel_npu.manager import reset_plugin_manager

    reset_plugin_manager()
    reset_backend_cache()
    yield
    reset_plugin_manager()
    reset_backend_cache()

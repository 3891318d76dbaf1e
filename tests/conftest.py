import os

import pytest

# Launched processes inherit this; keeps 2 ranks on 2 cores from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The in-process tests exercise the CUDA façade family (torch.cuda answers, autocast("cuda"), ...) in this
# pytest process, which no launcher started: they opt in, as a user debugging a CUDA script with plain
# `python` does. Set before anything imports torch. Launched processes get tests.launch_utils.base_env(),
# which drops every ACCEL_NPU_* variable, so launches prove the default (launched ranks only).
os.environ.setdefault("ACCEL_NPU_CUDA_FACADE", "1")


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

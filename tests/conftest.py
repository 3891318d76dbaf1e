import os

import pytest

from tests import process_guard

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


@pytest.fixture
def one_rank_zero3(monkeypatch):
    """A 1-rank gloo group and accelerate's ZeRO-3 plugin (zero3_init_flag true) selected, as
    ``accelerate launch`` + ``Accelerator()`` leave them before a script loads its models. Yields (config, plugin),
    the plugin held until the test ends (transformers keeps a weak reference); torch's F.linear is put back after."""
    from tests.launch_utils import one_rank_deepspeed_group, restore_torch_linear, select_zero3_plugin

    with one_rank_deepspeed_group(monkeypatch):
        config_and_plugin = select_zero3_plugin()
        try:
            yield config_and_plugin
        finally:
            restore_torch_linear()
            del config_and_plugin


# -- the fast loop: a plain `pytest` runs the in-process tests; tests that start processes are marked slow ----
def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        default=False,
        help="also run the tests marked slow: those that start processes (launches, pip, "
        "subprocesses). README's test command passes it; so does CI",
    )


def pytest_configure(config):
    process_guard.install(config.rootpath / "tests")
    config.add_cleanup(process_guard.uninstall)


def pytest_report_header(config):
    if not _runs_slow(config):
        return "slow tests (they start processes) deselected: --runslow runs them too"
    return None


def _runs_slow(config) -> bool:
    return config.getoption("--runslow") or bool(config.option.markexpr)  # an -m expression decides itself


def pytest_collection_modifyitems(config, items):
    if _runs_slow(config):
        return
    kept, slow = [], []
    for item in items:
        (slow if item.get_closest_marker("slow") else kept).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    process_guard.started = None if item.get_closest_marker("slow") else []
    try:
        return (yield)
    finally:
        process_guard.started = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call" and process_guard.started and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = process_guard.failure_message(process_guard.started)
    return report

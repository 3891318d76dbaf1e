"""When a stuck collective ends on its own: one reading of HCCL_EXEC_TIMEOUT, the live watch's and
`accel-npu env`'s alike. Fast: no process group of more than one rank."""
from __future__ import annotations

import pytest

from accel_npu._torch import dist
from accel_npu.backend import Backend
from accel_npu.plugins import hang_watch
from accel_npu.plugins.hang_watch import watch

NPU = Backend(name="npu", device_type="npu", dist_backend="hccl", device_count=8, ds_accelerator="npu",
              plugin="npu")


@pytest.mark.parametrize("raw,seconds", [
    (None, 1836), ("-5", 1836), ("0", None), ("600", 600), (" 90.5", 90), ("abc", None), ("+120s", 120)])
def test_hccl_exec_timeout_is_read_as_torch_npu_reads_it(raw, seconds):
    # torch_npu OptionsManager::GetHCCLExecTimeout: strtol; negative or unset: CANN's default; 0 never
    env = {} if raw is None else {"HCCL_EXEC_TIMEOUT": raw}
    assert dist.hccl_exec_timeout(env) == seconds


def test_first_timeout_ignores_none_zero_and_no_timeout():
    assert dist.first_timeout([600.0, None, 0, 1e12, 90]) == 90.0
    assert dist.first_timeout([None, 0]) is None


@pytest.mark.parametrize("raw,group", [("-5", 600), ("90.5", 90), ("0", 600), ("300", 300)])
def test_the_env_report_uses_the_same_reading(monkeypatch, raw, group):
    monkeypatch.delenv("ACCEL_NPU_HANG_TIMEOUT", raising=False)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "10")
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", raw)
    _, info = hang_watch.accel_npu_env_report(backend=NPU)
    shown = info["hang report after (DeepSpeed launch)"]
    assert shown.startswith(f"{watch.default_timeout(group):g} s ({group:g} s - "), shown


def test_a_deepspeed_timeout_deepspeed_cannot_read_is_a_problem(monkeypatch):
    monkeypatch.delenv("ACCEL_NPU_HANG_TIMEOUT", raising=False)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "1.5")
    _, info = hang_watch.accel_npu_env_report(backend=NPU)
    assert info["DEEPSPEED_TIMEOUT"].startswith("PROBLEM")


@pytest.mark.parametrize("group_s,exec_s,status", [(5400.0, 1800, "ok"), (600.0, 1800, "failed"), (1800.0, 1800, "failed"),
                                                   (600.0, None, "ok"), (None, 1836, "ok")])
def test_the_selftest_orders_the_live_group_timeout_against_hccl_exec_timeout(group_s, exec_s, status):
    from accel_npu.cli._selftest_dist import timeout_ordering

    assert timeout_ordering("hccl", group_s, exec_s)[0] == status
    assert timeout_ordering("gloo", group_s, exec_s)[0] == "skipped"

"""When a stuck collective ends on its own: one reading of HCCL_EXEC_TIMEOUT, the live watch's and
`accel-npu env`'s alike. Fast: no process group of more than one rank."""

from __future__ import annotations

import pytest

from accel_npu._torch import dist
from accel_npu.backend import Backend
from accel_npu.plugins import hang_watch
from accel_npu.plugins.hang_watch import watch

NPU = Backend(
    name="npu", device_type="npu", dist_backend="hccl", device_count=8, ds_accelerator="npu", plugin="devices.npu"
)


@pytest.mark.parametrize(
    "raw,seconds", [(None, 1836), ("-5", 1836), ("0", None), ("600", 600), (" 90.5", 90), ("abc", None), ("+120s", 120)]
)
def test_hccl_exec_timeout_is_read_as_torch_npu_reads_it(raw, seconds):
    # torch_npu OptionsManager::GetHCCLExecTimeout: strtol; negative or unset: CANN's default; 0 never
    env = {} if raw is None else {"HCCL_EXEC_TIMEOUT": raw}
    assert dist.hccl_exec_timeout(env) == seconds


@pytest.mark.parametrize(
    "soc,raw,mode,seconds",
    [
        # Atlas training / inference series: HCCL takes value // 68 * 68, at least 68 (CANN environment
        # variable reference, HCCL_EXEC_TIMEOUT: 600 -> 544)
        ("Ascend910A", "600", None, 544),
        ("Ascend910ProB", "1800", None, 1768),
        ("Ascend910A", None, None, 1836),
        ("Ascend910A", "30", None, 68),
        ("Ascend910A", "0", None, 68),
        ("Ascend310P3", "137", None, 136),
        ("Ascend910A", "600", "AIV", 544),
        # A2 / A3: as read, unless HCCL_OP_EXPANSION_MODE=AIV caps it at 1091 (also for unset and 0)
        ("Ascend910B1", "600", None, 600),
        ("Ascend910B3", "0", None, None),
        ("Ascend910_9392", "1800", "HOST", 1800),
        ("Ascend910B1", "1800", "AIV", 1091),
        ("Ascend910B4-1", "600", "AIV", 600),
        ("Ascend910_9391", None, "AIV", 1091),
        ("Ascend910B2", "0", "aiv", 1091),
        # the SoC not known (no device asked): as read
        (None, "600", "AIV", 600),
        ("Ascend950PR", "600", None, 600),
    ],
)
def test_hccl_exec_timeout_as_hccl_applies_it_on_each_soc(soc, raw, mode, seconds):
    env = {k: v for k, v in (("HCCL_EXEC_TIMEOUT", raw), ("HCCL_OP_EXPANSION_MODE", mode)) if v is not None}
    assert dist.hccl_exec_timeout(env, soc=soc) == seconds


def test_the_live_watch_asks_the_npu_backend_for_its_soc(monkeypatch):
    """On HCCL the watch's deadline is the SoC's effective HCCL_EXEC_TIMEOUT (910A: 1800 -> 1768 s)."""
    import dataclasses

    import torch.distributed as torch_dist

    from accel_npu import backend as backend_module

    monkeypatch.setattr(backend_module, "_cached", dataclasses.replace(NPU, device_name=lambda: "Ascend910A"))
    monkeypatch.setattr(torch_dist, "get_backend", lambda group=None: "hccl")
    monkeypatch.setattr(watch, "default_group_timeout", lambda: 3600.0)
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1800")
    assert watch._group_timeout_seconds() == 1768.0
    monkeypatch.setattr(backend_module, "_cached", dataclasses.replace(NPU, device_name=lambda: "Ascend910B1"))
    assert watch._group_timeout_seconds() == 1800.0


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


@pytest.mark.parametrize(
    "group_s,exec_s,status",
    [(5400.0, 1800, "ok"), (600.0, 1800, "failed"), (1800.0, 1800, "failed"), (600.0, None, "ok"), (None, 1836, "ok")],
)
def test_the_selftest_orders_the_live_group_timeout_against_hccl_exec_timeout(group_s, exec_s, status):
    from accel_npu.cli._selftest_dist import timeout_ordering

    assert timeout_ordering("hccl", group_s, exec_s)[0] == status
    assert timeout_ordering("gloo", group_s, exec_s)[0] == "skipped"

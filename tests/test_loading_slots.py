"""Staggered materialization: node-local load slots held with OS file locks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from accel_npu.errors import ConfigError
from accel_npu.plugins.loading.slots import LoadSlotTimeout, load_slot, slot_count

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def test_slot_count_default_and_override(monkeypatch):
    monkeypatch.delenv("ACCEL_NPU_LOAD_SLOTS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert slot_count(1 << 30) is None  # a single rank per node: no staggering
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert slot_count(1) == 4  # tiny loads: everyone at once
    assert slot_count(1 << 50) == 1  # more than the node has: one at a time
    monkeypatch.setenv("ACCEL_NPU_LOAD_SLOTS", "2")
    assert slot_count(1 << 50) == 2
    monkeypatch.setenv("ACCEL_NPU_LOAD_SLOTS", "zero")
    with pytest.raises(ConfigError, match="ACCEL_NPU_LOAD_SLOTS"):
        slot_count(1)


@pytest.mark.slow
def test_malloc_trim_gives_freed_heap_back_to_the_os(tmp_path):
    """Witnessed by the kernel (RssAnon of a fresh process), not by malloc_trim's own answer:
    200 MB of small heap blocks freed stay resident until the trim returns them."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc-only")
    code = (
        "import gc\n"
        "from accel_npu._torch.memory import malloc_trim\n"
        "def rss():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1]) // 1024\n"
        "blocks = [bytearray(4096) for _ in range(50_000)]\n"  # 200 MB of heap (below the mmap threshold)
        "keep = bytearray(4096)\n"  # a live heap block above them
        "full = rss(); del blocks; gc.collect(); freed = rss()\n"
        "trimmed = malloc_trim(); after = rss()\n"
        "print('RESULT', full, freed, after, trimmed)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    full, freed, after, trimmed = proc.stdout.split("RESULT ")[1].split()
    assert int(full) - int(freed) < 50, "glibc kept the freed blocks (the reason for malloc_trim)"
    assert trimmed == "True" and int(freed) - int(after) > 150, proc.stdout


@pytest.mark.slow
def test_slots_serialize_within_a_process(monkeypatch, tmp_path):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", uuid.uuid4().hex)
    with load_slot(1, slots=1) as held:
        assert held == 0
        with load_slot(1, slots=1, timeout=0.3) as nested:  # a nested load does not deadlock
            assert nested is None
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], env={**os.environ, "RANK": "0"}, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        with pytest.raises(LoadSlotTimeout, match=rf"rank 0 \(pid {holder.pid} .*holding for"):
            with load_slot(1, slots=1, timeout=0.3):
                pass
    finally:
        holder.kill()
        holder.wait()
    with load_slot(1, slots=1, timeout=0.3) as again:  # released on exit
        assert again == 0


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    import torch

    sys.path.insert(0, str(SCRIPTS))
    import tiny_models as tm

    path = tmp_path_factory.mktemp("slots") / "qwen"
    tm.randomize(tm.qwen()).to(torch.bfloat16).save_pretrained(str(path), max_shard_size="60KB")
    return path


HOLDER = (
    "import time\n"
    "from accel_npu.plugins.loading.slots import load_slot\n"
    "cm = load_slot(1, what='a stuck load', slots=1)\n"
    "cm.__enter__()\n"
    "print('HOLDING', flush=True)\n"
    "time.sleep(300)\n"
)


@pytest.mark.slow
def test_sigkilled_holder_releases_its_slot(tmp_path, qwen_ckpt):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_NPU_")}
    env.update(
        OMP_NUM_THREADS="1",
        TMPDIR=str(tmp_path),
        TORCHELASTIC_RUN_ID=uuid.uuid4().hex,
        ACCEL_NPU_LOAD_SLOTS="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        env={**env, "RANK": "0", "LOCAL_RANK": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert holder.stdout.readline().strip() == "HOLDING"
        # two more ranks start loading: one gives up after 2 s, one waits up to 120 s
        waiter = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "load_qwen.py"), str(qwen_ckpt)],
            env={**env, "RANK": "2", "LOCAL_RANK": "2", "ACCEL_NPU_LOAD_TIMEOUT": "120"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        short = subprocess.run(
            [sys.executable, str(SCRIPTS / "load_qwen.py"), str(qwen_ckpt)],
            env={**env, "RANK": "1", "LOCAL_RANK": "1", "ACCEL_NPU_LOAD_TIMEOUT": "2"},
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        # a rank that waits longer than the timeout fails, naming the holder
        assert short.returncode != 0
        assert f"rank 0 (pid {holder.pid}" in short.stderr and "LoadSlotTimeout" in short.stderr, short.stderr[-3000:]
        time.sleep(2)
        assert waiter.poll() is None, "the waiter started with the other one and must still be waiting"
        os.kill(holder.pid, signal.SIGKILL)
        out, err = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, err[-3000:]
        assert '"blocks": 4' in out
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def test_env_report_section(monkeypatch):
    from accel_npu.plugins.loading.report import loading_report

    monkeypatch.setenv("ACCEL_NPU_TRUNCATE", "QwenImageTransformer2DModel:2")
    monkeypatch.setenv("ACCEL_NPU_LOAD_SLOTS", "1")
    info = loading_report()
    assert info["truncate (ACCEL_NPU_TRUNCATE)"] == "QwenImageTransformer2DModel -> 2 layers"
    assert info["load slots (ACCEL_NPU_LOAD_SLOTS)"] == "1"
    monkeypatch.setenv("ACCEL_NPU_TRUNCATE", "nonsense")
    assert loading_report()["truncate (ACCEL_NPU_TRUNCATE)"].startswith("INVALID")

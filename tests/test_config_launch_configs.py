"""launch_configs/: up to date with the generator, shipped as package data, NPU variants accepted
by accelerate's and DeepSpeed's own parsers, every CPU variant trains on 2 CPU ranks — from the
repository root and from any other directory (deepspeed_config_file resolved next to the YAML)."""

from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch_utils import BIN, REPO, SCRIPTS, accelerate_launch, base_env, explain, free_port, results, source_tree

CONFIGS = REPO / "launch_configs"
SIDECAR = ".accel-npu.yaml"


def accelerate_yamls(prefix: str) -> list[Path]:
    return sorted(p for p in CONFIGS.glob(f"{prefix}*.yaml") if not p.name.endswith(SIDECAR))


def test_shipped_files_are_generated_by_the_wizard_code(tmp_path):
    from accel_npu.cli.config.settings import template_files

    expected = {p.name: text for p, text in template_files(tmp_path).items()}
    shipped = {p.name: p.read_text() for p in CONFIGS.iterdir() if p.suffix in (".yaml", ".json")}
    assert sorted(shipped) == sorted(expected)
    stale = [name for name in expected if shipped[name] != expected[name]]
    assert not stale, (
        f"launch_configs/ is out of date: {stale}; regenerate with python -c "
        "\"from accel_npu.cli.config.settings import write_templates; write_templates('launch_configs')\""
    )
    names = {p.stem for p in accelerate_yamls("")}
    assert names == {"npu_zero2", "npu_zero3", "npu_multinode_zero3", "cpu_zero2", "cpu_zero3", "cpu_multinode_zero3"}


def test_templates_are_package_data_of_accel_npu_launch_configs():
    root = importlib.resources.files("accel_npu.launch_configs")
    present = {entry.name for entry in root.iterdir()}
    for p in CONFIGS.iterdir():
        if p.suffix in (".yaml", ".json", ".md"):
            assert p.name in present
    setup_cfg = (REPO / "setup.cfg").read_text()
    assert "accel_npu.launch_configs = *.yaml, *.json, *.md" in setup_cfg


@pytest.mark.slow
def test_a_built_wheel_ships_every_template(tmp_path):
    """What `pip install accel-npu` gets: a wheel built from a copy of the source tree."""
    import zipfile

    src = tmp_path / "src"
    source_tree(src)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("accel_npu-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for p in CONFIGS.iterdir():
        if p.suffix in (".yaml", ".json", ".md"):
            assert f"accel_npu/launch_configs/{p.name}" in names, p.name


@pytest.mark.slow
def test_every_variant_passes_accelerates_and_deepspeeds_own_parsers():
    """Stock accelerate (accel-npu off) run from launch_configs/ so it finds the relative JSON."""
    yamls = [p.name for p in accelerate_yamls("")]
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "config_checks.py"), *yamls],
        env=base_env(ACCEL_NPU_DISABLE="1"),
        cwd=CONFIGS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {
        json.loads(line.split("CHECKED ", 1)[1])["file"].removesuffix(".yaml"): json.loads(line.split("CHECKED ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("CHECKED ")
    }
    assert sorted(got) == sorted(p.removesuffix(".yaml") for p in yamls)
    for name, r in got.items():
        assert r["distributed_type"] == "DEEPSPEED" and r["bf16"] and not r["fp16"], r
        assert r["accelerate_mixed_precision"] == "no" and "mixed_precision" not in r["ds_fields"], r  # 7.10
        assert r["ds_file"] == f"{name}.deepspeed.json"
        bucket = 500_000_000 if name.startswith("npu") else 50_000_000
        assert r["reduce_bucket_size"] == bucket, r  # 5e8 on Ascend: the bucket size NPU DeepSpeed users run
        if "zero3" in name:
            assert r["zero_stage"] == 3 and r["persistence_threshold"] == 1_000_000 and r["gather_16bit_on_save"], r
        else:
            assert r["zero_stage"] == 2, r
    assert got["npu_zero3"]["num_processes"] == 8 and got["npu_zero2"]["num_processes"] == 8
    assert (got["npu_multinode_zero3"]["num_machines"], got["npu_multinode_zero3"]["num_processes"]) == (2, 16)
    assert got["npu_multinode_zero3"]["multinode_launcher"] == "standard"
    assert got["cpu_zero3"]["num_processes"] == 2


def _trained(proc, n=2):
    assert proc.returncode == 0, explain(proc)
    res = results(proc)
    assert [r["rank"] for r in res] == list(range(n)), explain(proc)
    assert all(r["num_processes"] == n and "DEEPSPEED" in r["distributed_type"] for r in res), res
    assert res[0]["first_inputs"] != res[1]["first_inputs"]  # ranks see different data
    return res


@pytest.mark.slow
def test_cpu_zero2_trains_from_the_repository_root():
    proc = accelerate_launch(
        ["--config_file", "launch_configs/cpu_zero2.yaml", str(SCRIPTS / "train_tiny.py"), "--steps", "2"], cwd=REPO
    )
    _trained(proc)


@pytest.mark.slow
def test_cpu_zero3_trains_from_another_directory_where_stock_cannot_find_its_json(tmp_path):
    args = ["--config_file", str(CONFIGS / "cpu_zero3.yaml"), str(SCRIPTS / "train_tiny.py"), "--steps", "2"]
    # stock: the relative deepspeed_config_file is looked up in the workers' cwd
    stock = accelerate_launch(args, env=base_env(ACCEL_NPU_DISABLED_PLUGINS="launch.settings"), cwd=tmp_path)
    assert stock.returncode != 0, explain(stock)
    assert "cpu_zero3.deepspeed.json" in stock.stderr and not results(stock), explain(stock)
    # with accel-npu: resolved next to the YAML
    _trained(accelerate_launch(args, cwd=tmp_path))


@pytest.mark.slow
def test_cpu_multinode_twin_trains_as_two_machines_on_one(tmp_path):
    """Two 'machines' on this one train together. First, with the main machine's port taken (another
    job), machine rank 0 refuses before any worker starts, naming the port and the flag. accelerate
    checks that port itself (accelerate/utils/launch.py, a connect to localhost); torchrun started on
    each machine does not, and stock fails in torch's TCPStore with a traceback."""
    import socket

    port = str(free_port())
    common = ["--config_file", str(CONFIGS / "cpu_multinode_zero3.yaml"), "--main_process_port", port]
    script = [str(SCRIPTS / "train_tiny.py"), "--steps", "2"]
    torchrun = [
        str(BIN / "torchrun"),
        "--nnodes",
        "2",
        "--node_rank",
        "0",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        port,
        *script,
    ]
    held = socket.socket()
    held.bind(("", int(port)))
    held.listen()
    try:
        refused, stock = (
            subprocess.run(torchrun, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            for env in (base_env(), base_env(ACCEL_NPU_DISABLE="1"))
        )
    finally:
        held.close()
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and not results(refused) and "Traceback" not in out, explain(refused)
    assert (
        f"this is machine rank 0, which hosts the rendezvous on port {port} (--main_process_port, torchrun "
        "--master_port), and that port is already in use on this machine"
    ) in out, explain(refused)
    assert stock.returncode != 0 and not results(stock) and "Traceback" in stock.stderr, explain(stock)
    assert "EADDRINUSE" in stock.stderr and "--master_port" not in stock.stdout + stock.stderr, explain(stock)
    other = subprocess.Popen(
        [str(BIN / "accelerate"), "launch", *common, "--machine_rank", "1", *script],
        env=base_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        main = accelerate_launch([*common, "--machine_rank", "0", *script], cwd=tmp_path)
        out, err = other.communicate(timeout=300)
    finally:
        if other.poll() is None:
            other.kill()
    assert other.returncode == 0, err[-4000:]
    merged = subprocess.CompletedProcess(main.args, main.returncode, main.stdout + out, main.stderr + err)
    _trained(merged)

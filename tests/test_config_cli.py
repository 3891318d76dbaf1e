"""`accel-npu config --non-interactive`: files written, dry run, refusal to overwrite, invalid
combinations, --from templates; written files checked by accelerate's and DeepSpeed's parsers."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.launch_utils import BIN, REPO, base_env

ACCEL_NPU = str(BIN / "accel-npu")


def config_process(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Run the `accel-npu config ARGS` command as a user would (a fresh process)."""
    return subprocess.run(
        [ACCEL_NPU, "config", *args], env=base_env(**env), capture_output=True, text=True, timeout=120
    )


def config(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process (what the console script calls): exit code, stdout, stderr."""
    from accel_npu.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["config", *args])
        except SystemExit as exc:  # argparse errors
            code = exc.code
    return subprocess.CompletedProcess(["accel-npu", "config", *args], code, out.getvalue(), err.getvalue())


def checked(yaml_files: list[Path], cwd: Path) -> list[dict]:
    """Run tests/config_checks.py (stock accelerate + DeepSpeed parsers, accel-npu off)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "config_checks.py"), *map(str, yaml_files)],
        env=base_env(ACCEL_NPU_DISABLE="1"),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [
        json.loads(line.split("CHECKED ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("CHECKED ")
    ]


def files_in(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir())} if directory.exists() else {}


@pytest.mark.slow
def test_non_interactive_writes_files_that_accelerate_and_deepspeed_accept(tmp_path):
    zero3 = tmp_path / "z3" / "accelerate.yaml"
    proc = config_process(
        "--non-interactive",
        "--backend",
        "cpu",
        "--num-processes",
        "2",
        "--strategy",
        "zero3",
        "--mixed-precision",
        "bf16",
        "--micro-batch-size",
        "4",
        "--gradient-accumulation-steps",
        "8",
        "--load-slots",
        "2",
        "--truncate",
        "QwenImageTransformer2DModel:2",
        "--frozen-modules",
        "vae,text_encoder",
        "--config_file",
        str(zero3),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"Wrote {zero3}" in proc.stdout
    assert sorted(files_in(zero3.parent)) == [
        "accelerate.accel-npu.yaml",
        "accelerate.deepspeed.json",
        "accelerate.yaml",
    ]
    cfg = yaml.safe_load(zero3.read_text())
    assert cfg["distributed_type"] == "DEEPSPEED" and cfg["num_processes"] == 2
    assert (
        "mixed_precision" not in cfg
    )  # declared once: in the DeepSpeed JSON, so accelerate does not warn it is ignored
    ds = json.loads((zero3.parent / "accelerate.deepspeed.json").read_text())
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 8
    side = yaml.safe_load((zero3.parent / "accelerate.accel-npu.yaml").read_text())
    assert side == {
        "backend": "cpu",
        "env": {
            "ACCEL_NPU_FROZEN_MODULES": "vae,text_encoder",
            "ACCEL_NPU_LOAD_SLOTS": "2",
            "ACCEL_NPU_TRUNCATE": "QwenImageTransformer2DModel:2",
        },
    }

    npu = tmp_path / "npu" / "ds.yaml"
    proc = config(
        "--non-interactive",
        "--backend",
        "npu",
        "--num-processes",
        "8",
        "--strategy",
        "zero3",
        "--offload",
        "all",
        "--mixed-precision",
        "fp16",
        "--task-queue-enable",
        "1",
        "--config_file",
        str(npu),
    )
    assert proc.returncode == 0, proc.stderr
    side = yaml.safe_load((npu.parent / "ds.accel-npu.yaml").read_text())
    assert side["env"] == {
        "TASK_QUEUE_ENABLE": "1",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "CPU_AFFINITY_CONF": "1",
        "HCCL_CONNECT_TIMEOUT": "1200",
        "HCCL_EXEC_TIMEOUT": "1800",
    }

    ddp = tmp_path / "ddp" / "accelerate.yaml"
    proc = config(
        "--non-interactive", "--backend", "npu", "--num-processes", "4", "--strategy", "ddp", "--config_file", str(ddp)
    )
    assert proc.returncode == 0, proc.stderr
    assert not (ddp.parent / "accelerate.deepspeed.json").exists()  # no DeepSpeed JSON without ZeRO

    multi = tmp_path / "multi" / "accelerate.yaml"
    proc = config(
        "--non-interactive",
        "--backend",
        "npu",
        "--num-machines",
        "2",
        "--machine-rank",
        "1",
        "--main-process-ip",
        "10.1.2.3",
        "--main-process-port",
        "29555",
        "--num-processes",
        "8",
        "--strategy",
        "zero2",
        "--config_file",
        str(multi),
    )
    assert proc.returncode == 0, proc.stderr

    video = tmp_path / "video" / "accelerate.yaml"
    proc = config(
        "--non-interactive", "--backend", "npu", "--num-processes", "8", "--sp-size", "4", "--config_file", str(video)
    )
    assert proc.returncode == 0, proc.stderr

    by_file = {Path(r["file"]).parent.name: r for r in checked([zero3, npu, ddp, multi, video], cwd=tmp_path)}
    assert (by_file["video"]["use_parallelism_config"], by_file["video"]["sp_size"]) == (True, 4)
    assert (by_file["z3"]["use_parallelism_config"], by_file["z3"]["sp_size"]) == (False, 1)
    assert by_file["z3"]["zero_stage"] == 3 and by_file["z3"]["bf16"] and not by_file["z3"]["fp16"]
    assert by_file["z3"]["accelerate_mixed_precision"] == "no"  # nothing beside the DeepSpeed file
    assert "mixed_precision" not in by_file["z3"]["ds_fields"]
    assert by_file["npu"]["fp16"] and by_file["npu"]["offload_optimizer"] == "cpu"
    assert by_file["npu"]["offload_param"] == "cpu"
    assert by_file["ddp"] == {
        "file": str(ddp),
        "distributed_type": "MULTI_NPU",
        "num_processes": 4,
        "num_machines": 1,
        "mixed_precision": "bf16",
    }  # bf16 by default on NPU
    assert by_file["multi"]["num_processes"] == 16 and by_file["multi"]["num_machines"] == 2
    assert by_file["multi"]["multinode_launcher"] == "standard"
    multi_cfg = yaml.safe_load(multi.read_text())
    assert (multi_cfg["machine_rank"], multi_cfg["main_process_ip"], multi_cfg["main_process_port"]) == (
        1,
        "10.1.2.3",
        29555,
    )


@pytest.mark.slow
def test_default_location_is_accelerates_default_config_file(tmp_path):
    hf_home = tmp_path / "hf"
    proc = config_process(
        "--non-interactive", "--backend", "cpu", "--num-processes", "2", "--strategy", "zero2", HF_HOME=str(hf_home)
    )
    assert proc.returncode == 0, proc.stderr
    expected = hf_home / "accelerate" / "default_config.yaml"
    assert f"Wrote {expected}" in proc.stdout
    assert "a plain `accelerate launch` uses it" in proc.stdout
    assert (hf_home / "accelerate" / "default_config.deepspeed.json").is_file()


def test_dry_run_prints_everything_and_writes_nothing(tmp_path):
    target = tmp_path / "out" / "accelerate.yaml"
    proc = config(
        "--non-interactive",
        "--backend",
        "cpu",
        "--num-processes",
        "2",
        "--strategy",
        "zero3",
        "--mixed-precision",
        "bf16",
        "--config_file",
        str(target),
        "--dry-run",
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "out").exists()
    assert f"--- {target}\n" in proc.stdout
    assert '"stage": 3' in proc.stdout and "distributed_type: DEEPSPEED" in proc.stdout
    assert proc.stdout.rstrip().endswith("Dry run: nothing was written.")


def test_refuses_to_overwrite_without_yes_and_keeps_a_backup_with_yes(tmp_path):
    target = tmp_path / "accelerate.yaml"
    target.write_text("# my own config\ndistributed_type: NO\n")
    before = files_in(tmp_path)
    args = ["--non-interactive", "--backend", "cpu", "--num-processes", "2", "--config_file", str(target)]
    proc = config(*args)
    assert proc.returncode == 1
    assert str(target) in proc.stderr and "--yes" in proc.stderr and "Nothing was written" in proc.stderr
    assert files_in(tmp_path) == before

    proc = config(*args, "--yes")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "accelerate.yaml.bak").read_text() == "# my own config\ndistributed_type: NO\n"
    assert "previous version kept as accelerate.yaml.bak" in proc.stdout
    assert yaml.safe_load(target.read_text())["distributed_type"] == "DEEPSPEED"
    # the same config again: nothing differs, nothing to confirm, no new backup
    proc = config(*args)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if ".bak" in p.name) == ["accelerate.yaml.bak"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "cpu", "--mixed-precision", "fp16"], "--mixed-precision fp16 on cpu"),
        (
            ["--backend", "cpu", "--num-processes", "1", "--strategy", "zero3"],
            "--strategy zero3 needs at least 2 processes in total (got 1)",
        ),
        (["--backend", "npu", "--num-processes", "1", "--strategy", "zero2"], "needs at least 2 processes"),
        (["--backend", "cpu", "--strategy", "zero2", "--offload", "optimizer"], "on the cpu backend"),
        (["--backend", "npu", "--strategy", "zero2", "--offload", "all"], "needs --strategy zero3"),
        (["--backend", "npu", "--strategy", "ddp", "--offload", "optimizer"], "needs --strategy zero2 or zero3"),
        (["--backend", "npu", "--num-machines", "2"], "--main-process-ip is required"),
        (
            ["--backend", "npu", "--num-machines", "2", "--main-process-ip", "10.0.0.1", "--machine-rank", "2"],
            "--machine-rank 2 must be between 0 and 1",
        ),
        (["--backend", "cpu", "--micro-batch-size", "0"], "--micro-batch-size must be 'auto' or a whole number"),
        (["--backend", "cpu", "--truncate", "QwenImage:two"], "not a comma-separated list of Class:layers pairs"),
        (["--backend", "cpu", "--strategy", "ddp", "--frozen-modules", "vae"], "only applies to ZeRO"),
        (["--backend", "npu", "--task-queue-enable", "3"], "TASK_QUEUE_ENABLE must be 0, 1 or 2 (got '3')"),
        (["--backend", "npu", "--hccl-exec-timeout", "soon"], "HCCL_EXEC_TIMEOUT must be a number of seconds"),
        (
            ["--backend", "cpu", "--num-processes", "3", "--strategy", "zero2", "--sp-size", "2"],
            "--sp-size 2 does not divide the 3 processes in total",
        ),
        (
            ["--backend", "cpu", "--strategy", "ddp", "--sp-size", "2"],
            "runs under --strategy zero2 or zero3 for now (got ddp)",
        ),
        (["--backend", "cpu", "--sp-size", "0"], "--sp-size must be >= 1 (got 0)"),
    ],
)
def test_invalid_combination_is_one_clear_error_and_nothing_written(tmp_path, args, message):
    target = tmp_path / "out" / "accelerate.yaml"
    proc = config("--non-interactive", *args, "--config_file", str(target))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert proc.stderr.strip().endswith("Nothing was written.")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_more_processes_than_visible_devices_is_refused():
    # The device count comes from the backend plugin (tests/contract exercises torch_npu's side);
    # here the rule itself, on a machine with 8 visible NPUs: more processes than devices are refused.
    from accel_npu.cli.config import settings as wizard

    machine = wizard.Machine(backend="npu", device_count=8, visible_devices_note="ASCEND_RT_VISIBLE_DEVICES=<unset>")
    s = wizard.default_settings(machine)
    assert s.processes_per_machine == 8 and s.mixed_precision == "bf16"
    assert wizard.problems(s, machine) == []
    s.processes_per_machine = 16
    with pytest.raises(
        wizard.ConfigError,
        match=r"--num-processes 16 but only 8 NPU\(s\) are visible .*"
        r"--num-processes 8 or fewer.*assigned to same device",
    ):
        wizard.validate(s, machine)
    # preparing an NPU config on a machine without NPUs: nothing to check against
    assert wizard.problems(s, wizard.Machine(backend="cpu", device_count=0)) == []


def test_from_template_starts_from_its_tuned_values(tmp_path):
    target = tmp_path / "mine.yaml"
    proc = config("--non-interactive", "--from", "npu_zero3", "--mixed-precision", "fp16", "--config_file", str(target))
    assert proc.returncode == 0, proc.stderr
    ds = json.loads((tmp_path / "mine.deepspeed.json").read_text())
    shipped = json.loads((REPO / "launch_configs" / "npu_zero3.deepspeed.json").read_text())
    assert ds["zero_optimization"] == shipped["zero_optimization"]
    assert "bf16" not in ds and ds["fp16"]["enabled"] is True  # the answer replaces the template's
    cfg = yaml.safe_load(target.read_text())
    assert cfg["num_processes"] == 8
    assert cfg["deepspeed_config"]["deepspeed_config_file"] == str(tmp_path / "mine.deepspeed.json")
    side = yaml.safe_load((tmp_path / "mine.accel-npu.yaml").read_text())
    assert side["backend"] == "npu" and side["env"]["TASK_QUEUE_ENABLE"] == "2"

    # short names pick the template of the backend: zero3 on cpu -> cpu_zero3
    proc = config("--non-interactive", "--backend", "cpu", "--from", "zero3", "--config_file", str(tmp_path / "c.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "c.deepspeed.json").read_text()) == json.loads(
        (REPO / "launch_configs" / "cpu_zero3.deepspeed.json").read_text()
    )

    proc = config("--non-interactive", "--from", "zero9", "--config_file", str(tmp_path / "x.yaml"))
    assert proc.returncode == 1 and "--from 'zero9': no such template" in proc.stderr
    assert "cpu_zero3" in proc.stderr


def test_no_async_checkpoint_writes_the_sidecar_variable_and_the_default_writes_nothing(tmp_path):
    """Background checkpoints are accel-npu's default: --no-async-checkpoint writes ACCEL_NPU_ASYNC_CHECKPOINT '0'
    into the sidecar's env (applied at accelerate launch), read back by --from; --async-checkpoint and no flag
    write nothing about it; under DDP (no background save there) nothing either way."""
    from accel_npu.cli.config import settings as wizard

    sidecars = {}
    for name, strategy, flag in (
        ("on", "zero2", ["--async-checkpoint"]),
        ("off", "zero2", ["--no-async-checkpoint"]),
        ("default", "zero3", []),
        ("ddp", "ddp", ["--no-async-checkpoint"]),
    ):
        target = tmp_path / f"{name}.yaml"
        proc = config(
            "--non-interactive", "--backend", "cpu", "--strategy", strategy, *flag, "--config_file", str(target)
        )
        assert proc.returncode == 0, proc.stderr
        sidecars[name] = yaml.safe_load((tmp_path / f"{name}.accel-npu.yaml").read_text())
    assert sidecars["off"]["env"] == {"ACCEL_NPU_ASYNC_CHECKPOINT": "0"}
    assert sidecars["on"] == sidecars["default"] == sidecars["ddp"] == {"backend": "cpu", "env": {}}
    text = (tmp_path / "off.accel-npu.yaml").read_text()
    assert "ACCEL_NPU_ASYNC_CHECKPOINT: '0'" in text and "# 0: save_state writes its files before it returns" in text
    machine = wizard.Machine(backend="cpu", device_count=0)
    assert wizard.settings_from_files(tmp_path / "on.yaml", machine).async_checkpoint is True
    assert wizard.settings_from_files(tmp_path / "off.yaml", machine).async_checkpoint is False


def test_a_json_config_name_is_refused_before_any_question(tmp_path):
    proc = config("--config_file", str(tmp_path / "accelerate.json"))  # interactive: refused before asking
    assert proc.returncode == 1 and "use a name ending in .yaml" in proc.stderr
    assert "Which device backend" not in proc.stdout and list(tmp_path.iterdir()) == []


def test_multinode_npu_writes_hccl_settings_for_the_job(tmp_path):
    """npu across machines: HCCL_SOCKET_IFNAME in the sidecar (given, or the letters of this machine's
    interface towards the main machine), refused when it matches no interface here; HCCL_CONNECT_TIMEOUT
    written for the job's size (a sidecar value wins over the launcher's default, so it must be)."""
    from accel_npu._torch.nodes import interface_names, route_interface, usable_interfaces

    def sidecar(name):
        return yaml.safe_load((tmp_path / f"{name}.accel-npu.yaml").read_text())["env"]

    common = ["--non-interactive", "--backend", "npu", "--num-processes", "8", "--main-process-ip", "127.0.0.1"]
    given = config(
        *common, "--num-machines", "2", "--hccl-socket-ifname", "lo", "--config_file", str(tmp_path / "given.yaml")
    )
    assert given.returncode == 0, given.stderr
    assert sidecar("given")["HCCL_SOCKET_IFNAME"] == "lo" and sidecar("given")["HCCL_CONNECT_TIMEOUT"] == "1200"

    derived = config(*common, "--num-machines", "2", "--config_file", str(tmp_path / "derived.yaml"))
    assert derived.returncode == 0, derived.stderr
    value = sidecar("derived")["HCCL_SOCKET_IFNAME"]
    assert value == "lo" == route_interface("127.0.0.1")  # the interface towards the main machine, as a prefix
    assert usable_interfaces(value, interface_names()) == [n for n in interface_names() if n.startswith("lo")]

    huge = config(*common, "--num-machines", "2000", "--config_file", str(tmp_path / "huge.yaml"))
    assert huge.returncode == 0, huge.stderr
    assert sidecar("huge")["HCCL_CONNECT_TIMEOUT"] == "2580"  # 16000 ranks: the HCCL test guide's line

    bad = config(
        *common,
        "--num-machines",
        "2",
        "--hccl-socket-ifname",
        "=enp61s0f0",
        "--config_file",
        str(tmp_path / "bad.yaml"),
    )
    assert bad.returncode != 0 and not (tmp_path / "bad.yaml").exists()
    assert "--hccl-socket-ifname =enp61s0f0 matches no interface of this machine (it has: lo" in bad.stderr, bad.stderr
    single = config(*common, "--hccl-socket-ifname", "lo", "--config_file", str(tmp_path / "single.yaml"))
    assert single.returncode == 0 and "HCCL_SOCKET_IFNAME" not in sidecar("single")  # one machine: not written


def _resolved_launch(config_file: Path):
    """accelerate's own reading of ``config_file`` with accel-npu's patches off: the launch arguments
    ``_validate_launch_command`` resolves, the environment ``prepare_deepspeed_cmd_env`` gives the workers, and the
    ParallelismConfig a worker builds from it."""
    import os

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    from tests.inprocess import stock

    with stock():
        args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
        args, defaults, _ = _validate_launch_command(args)
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _cmd, env = prepare_deepspeed_cmd_env(args)
        saved = dict(os.environ)
        os.environ.update(env)
        try:
            worker = ParallelismConfig()
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return args, env, worker


def test_sp_size_writes_accelerates_parallelism_config_which_its_launcher_resolves_to_sp(tmp_path):
    """``--sp-size 2`` on 4 processes writes accelerate's own ``parallelism_config`` section; accelerate's launcher
    (stock) reads it as --use_parallelism_config with sp 2, hands PARALLELISM_CONFIG_SP_SIZE to the workers, and a
    worker's ParallelismConfig has sp_size 2 and 2 data-parallel groups' worth of ranks; accel-npu's launch check
    passes it. Without --sp-size nothing of it is written, and the launch has no parallelism config."""
    from accel_npu.plugins.sequence_parallel.launch import launch_problem

    flags = ["--non-interactive", "--backend", "cpu", "--num-processes", "4", "--strategy", "zero2"]
    sp = tmp_path / "sp.yaml"
    proc = config(*flags, "--mixed-precision", "no", "--sp-size", "2", "--config_file", str(sp))
    assert proc.returncode == 0, proc.stderr
    assert "sequence parallel over 2" in proc.stdout
    written = yaml.safe_load(sp.read_text())
    assert written["parallelism_config"] == {
        "parallelism_config_sp_size": 2,
        "parallelism_config_sp_backend": "deepspeed",
    }
    args, env, worker = _resolved_launch(sp)
    assert args.use_deepspeed and args.use_parallelism_config and args.parallelism_config_sp_size == 2
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true" and env["PARALLELISM_CONFIG_SP_SIZE"] == "2"
    assert (worker.sp_size, worker.sp_backend, worker.sp_enabled) == (2, "deepspeed", True)
    assert launch_problem(args) is None
    # --from reads it back
    proc = config("--non-interactive", "--from", str(sp), "--config_file", str(tmp_path / "again.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((tmp_path / "again.yaml").read_text())["parallelism_config"] == written["parallelism_config"]

    plain = tmp_path / "plain.yaml"
    proc = config(*flags, "--config_file", str(plain))
    assert proc.returncode == 0, proc.stderr
    assert "parallelism_config" not in yaml.safe_load(plain.read_text())
    args, env, worker = _resolved_launch(plain)
    assert not args.use_parallelism_config and "PARALLELISM_CONFIG_SP_SIZE" not in env and worker.sp_size == 1


def test_the_wizard_offers_sequence_parallelism_only_where_it_runs():
    """The strategies the wizard offers it under are those the sequence_parallel plugin runs under: every ZeRO
    stage the wizard writes (DeepSpeed), not DDP (refused when the Accelerator is built)."""
    from accel_npu.cli.config import settings as wizard

    deepspeed = {strategy for strategy in wizard.STRATEGIES if wizard.Settings(strategy=strategy).uses_deepspeed}
    assert set(wizard.SEQUENCE_PARALLEL_STRATEGIES) == deepspeed == {"zero2", "zero3"}
    assert wizard.sp_size_problem(2, 4, "ddp")
    assert all(wizard.sp_size_problem(2, 4, strategy) is None for strategy in deepspeed)
    assert wizard.sp_size_problem(1, 3, "ddp") is None

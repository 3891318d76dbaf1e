"""The `accel-npu config` wizard in a real pseudo-terminal: answers typed, files written, and the
unchanged `accelerate launch` trains tests/scripts/train_tiny.py with them on 2 CPU ranks."""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path

import pexpect
import pytest
import yaml

from tests.launch_utils import BIN, SCRIPTS, accelerate_launch, base_env, explain, hccl_default_ports_busy, results

PROMPT_END = r"\]: "


def _terminal_signals() -> None:
    # A shell starting the test run in the background (`cmd &`, no job control) leaves SIGINT
    # ignored, and exec keeps it ignored: Ctrl-C would do nothing. A user's terminal has it default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(args: list[str], env: dict[str, str], cwd: Path) -> pexpect.spawn:
    child = pexpect.spawn(
        str(BIN / "accel-npu"),
        ["config", *args],
        env=env,
        cwd=str(cwd),
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 200),
        preexec_fn=_terminal_signals,
    )
    child.logfile_read = sys.stdout  # shown by pytest on failure
    return child


def answer(child: pexpect.spawn, question: str, text: str) -> None:
    """Wait for ``question`` (a regex) and the prompt after it, then type ``text`` and Enter."""
    child.expect(question + r".*?" + PROMPT_END)
    child.sendline(text)


def printed(proc) -> list[str]:
    """What printenv printed (DeepSpeed logs to stdout too)."""
    return [line.strip() for line in proc.stdout.splitlines() if line.strip().isdigit() or line.startswith("Tiny")]


def finish(child: pexpect.spawn) -> str:
    child.expect(pexpect.EOF)
    child.close()
    return child.before


@pytest.mark.slow
def test_wizard_zero2_then_accelerate_launch_trains_on_two_cpu_ranks(tmp_path):
    target = tmp_path / "cfg" / "accelerate.yaml"
    env = base_env()
    child = spawn(["--config_file", str(target)], env, tmp_path)
    child.expect(r"This machine: backend cpu \(no accelerator found\)")
    answer(child, r"Which device backend will you train on\?.*3\) cpu .*<- detected.*Your choice \[3", "")
    answer(child, r"How many machines \(nodes\) will train together\? \[1", "")
    answer(child, r"How many training processes on each machine\?.*\[2", "2")
    answer(child, r"How should the processes share the training state\?.*2\) zero2.*Your choice \[2", "2")
    answer(child, r"Is the model you train a video DiT with long token sequences .*\? \[no", "")
    answer(child, r"Mixed precision\? \(declared once, in the DeepSpeed JSON\).*1\) bf16.*2\) no.*Your choice \[1", "")
    answer(child, r"Micro batch size per device.*\[auto", "")
    answer(child, r"Gradient accumulation steps.*\[auto", "")
    answer(child, r"Frozen sub-models.*\[auto", "")
    answer(child, r"How many ranks per machine may load model weights.*\[auto", "zero")  # invalid: asked again
    child.expect(r"! load slots must be 'auto' or a whole number >= 1 \(got 'zero'\)")
    answer(child, r"How many ranks per machine may load model weights.*\[auto", "1")
    answer(child, r"Truncate models while loading.*\[none", "TinyNet:1")
    answer(child, r"Write checkpoints in the background.*\[yes", "")
    out = finish(child)
    assert child.exitstatus == 0, out
    assert "Configuration: DeepSpeed ZeRO-2, bf16, 2 cpu process(es)." in out
    assert f"Wrote {target}" in out and f"Launch with: accelerate launch --config_file {target} train.py" in out

    ds = json.loads((target.parent / "accelerate.deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True}
    assert "mixed_precision" not in yaml.safe_load(target.read_text())

    # The files are proven by running them: unchanged accelerate launch, unchanged script.
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    proc = accelerate_launch(
        ["--config_file", str(target), str(SCRIPTS / "train_tiny.py"), "--steps", "3"], env=base_env(), cwd=run_dir
    )
    assert proc.returncode == 0, explain(proc)
    res = results(proc)
    assert [r["rank"] for r in res] == [0, 1], explain(proc)
    assert all(r["num_processes"] == 2 and "DEEPSPEED" in r["distributed_type"] for r in res), res
    assert res[0]["first_inputs"] != res[1]["first_inputs"]  # each rank got its own data shard
    assert "launch settings from" in proc.stderr and "ACCEL_NPU_LOAD_SLOTS=1" in proc.stderr

    # The sidecar reaches every training process; a value set in the shell wins over it.
    proc = accelerate_launch(
        ["--config_file", str(target), "--no_python", "printenv", "ACCEL_NPU_LOAD_SLOTS", "ACCEL_NPU_TRUNCATE"],
        env=base_env(ACCEL_NPU_LOAD_SLOTS="3"),
        cwd=run_dir,
    )
    assert proc.returncode == 0, explain(proc)
    assert sorted(printed(proc)) == ["3", "3", "TinyNet:1", "TinyNet:1"], explain(proc)
    assert "ACCEL_NPU_TRUNCATE=TinyNet:1; kept from your environment: ACCEL_NPU_LOAD_SLOTS=3" in proc.stderr


@pytest.mark.slow
def test_wizard_zero3_into_accelerates_default_file_then_plain_accelerate_launch_trains(tmp_path):
    hf_home = tmp_path / "hf"
    env = base_env(HF_HOME=str(hf_home))
    child = spawn([], env, tmp_path)
    answer(child, r"Which device backend.*Your choice \[3", "cpu")
    answer(child, r"How many machines.*\[1", "1")
    answer(child, r"How many training processes on each machine\?.*\[2", "")
    answer(child, r"share the training state\?.*Your choice \[2", "zero3")
    answer(child, r"ZeRO-3: build models under deepspeed.zero.Init.*\[yes", "no")
    answer(child, r"video DiT.*\? \[no", "")
    answer(child, r"Mixed precision\?.*Your choice \[1", "1")
    answer(child, r"Micro batch size per device.*\[auto", "4")
    answer(child, r"Gradient accumulation steps.*\[auto", "2")
    answer(child, r"Frozen sub-models.*\[auto", "")
    answer(child, r"load model weights.*\[auto", "")
    answer(child, r"Truncate models while loading.*\[none", "")
    answer(child, r"Write checkpoints in the background.*\[yes", "")
    out = finish(child)
    assert child.exitstatus == 0, out
    default_file = hf_home / "accelerate" / "default_config.yaml"
    assert f"Wrote {default_file}" in out
    assert "This is accelerate's default config file: a plain `accelerate launch` uses it." in out
    cfg = yaml.safe_load(default_file.read_text())
    assert cfg["deepspeed_config"]["zero3_init_flag"] is False and "mixed_precision" not in cfg
    ds = json.loads((hf_home / "accelerate" / "default_config.deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 2)

    proc = accelerate_launch([str(SCRIPTS / "train_tiny.py"), "--steps", "4"], env=env, cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    res = results(proc)
    assert [r["rank"] for r in res] == [0, 1] and all(r["num_processes"] == 2 for r in res), explain(proc)
    assert "DEEPSPEED" in res[0]["distributed_type"]


def test_wizard_asks_before_replacing_a_file_and_keeps_a_backup(tmp_path):
    target = tmp_path / "accelerate.yaml"
    mine = "# hand-written\ndistributed_type: NO\n"
    target.write_text(mine)
    flags = [
        "--backend",
        "cpu",
        "--num-machines",
        "1",
        "--num-processes",
        "2",
        "--strategy",
        "zero2",
        "--mixed-precision",
        "bf16",
        "--micro-batch-size",
        "auto",
        "--gradient-accumulation-steps",
        "auto",
        "--frozen-modules",
        "auto",
        "--load-slots",
        "auto",
        "--truncate",
        "none",
        "--no-async-checkpoint",
        "--sp-size",
        "1",
        "--config_file",
        str(target),
    ]
    child = spawn(flags, base_env(), tmp_path)  # every question answered by a flag: only the overwrite one
    child.expect(r"These files exist:\r\n  " + str(target).replace(".", r"\."))
    answer(child, r"Replace them \(each is first copied to <file>\.bak\)\? \[no", "")
    out = finish(child)
    assert child.exitstatus == 1 and "Nothing was written." in out
    assert target.read_text() == mine and sorted(p.name for p in tmp_path.iterdir()) == ["accelerate.yaml"]

    child = spawn(flags, base_env(), tmp_path)
    answer(child, r"Replace them .*\[no", "y")
    out = finish(child)
    assert child.exitstatus == 0, out
    assert (tmp_path / "accelerate.yaml.bak").read_text() == mine
    assert yaml.safe_load(target.read_text())["distributed_type"] == "DEEPSPEED"


@pytest.mark.parametrize(("typed", "written"), [("", None), ("n", "0")])
def test_wizard_asks_whether_to_write_checkpoints_in_the_background(tmp_path, typed, written):
    """Under ZeRO the wizard asks (default yes, accel-npu's default); no writes ACCEL_NPU_ASYNC_CHECKPOINT '0' into
    the sidecar's env, yes writes nothing about it. Under DDP it is not asked."""
    flags = ["--backend", "cpu", "--num-machines", "1", "--num-processes", "2", "--mixed-precision", "bf16"]
    flags += ["--micro-batch-size", "auto", "--gradient-accumulation-steps", "auto", "--frozen-modules", "auto"]
    flags += ["--load-slots", "auto", "--truncate", "none", "--sp-size", "1"]
    target = tmp_path / "zero.yaml"
    child = spawn([*flags, "--strategy", "zero2", "--config_file", str(target)], base_env(), tmp_path)
    answer(child, r"Write checkpoints in the background \(save_state returns .*\? \[yes", typed)
    out = finish(child)
    assert child.exitstatus == 0, out
    env = yaml.safe_load((tmp_path / "zero.accel-npu.yaml").read_text())["env"]
    assert env.get("ACCEL_NPU_ASYNC_CHECKPOINT") == written, env

    child = spawn([*flags, "--strategy", "ddp", "--config_file", str(tmp_path / "ddp.yaml")], base_env(), tmp_path)
    out = finish(child)  # every question answered by a flag, and the background one not asked under DDP
    assert child.exitstatus == 0 and "Write checkpoints in the background" not in out, out


def test_wizard_asks_for_sequence_parallelism_when_the_model_is_a_video_dit(tmp_path):
    """Under ZeRO-2 the wizard asks whether the model is a video DiT; yes asks the sequence-parallel size, re-asks
    one that does not divide the processes, and writes accelerate's parallelism_config section. Under ZeRO-3 too;
    under DDP (where sequence parallelism is refused) neither is asked."""
    flags = ["--backend", "cpu", "--num-machines", "1", "--num-processes", "4", "--mixed-precision", "no"]
    flags += ["--micro-batch-size", "auto", "--gradient-accumulation-steps", "auto", "--frozen-modules", "auto"]
    flags += ["--load-slots", "auto", "--truncate", "none", "--no-async-checkpoint"]
    target = tmp_path / "video.yaml"
    child = spawn([*flags, "--strategy", "zero2", "--config_file", str(target)], base_env(), tmp_path)
    answer(child, r"Is the model you train a video DiT with long token sequences \(CogVideoX, .*\? \[no", "yes")
    answer(child, r"Sequence-parallel size: ranks splitting one sample's tokens .*4 processes.*\? \[2", "3")
    child.expect(r"! --sp-size 3 does not divide the 4 processes in total")
    answer(child, r"Sequence-parallel size: .*\? \[2", "4")
    out = finish(child)
    assert child.exitstatus == 0, out
    assert "Configuration: DeepSpeed ZeRO-2, no, 4 cpu process(es), sequence parallel over 4." in out
    written = yaml.safe_load(target.read_text())["parallelism_config"]
    assert written == {"parallelism_config_sp_size": 4, "parallelism_config_sp_backend": "deepspeed"}

    child = spawn([*flags, "--strategy", "zero2", "--config_file", str(tmp_path / "image.yaml")], base_env(), tmp_path)
    answer(child, r"video DiT.*\? \[no", "")
    out = finish(child)  # no: no size asked, no section written
    assert child.exitstatus == 0 and "Sequence-parallel size" not in out, out
    assert "parallelism_config" not in yaml.safe_load((tmp_path / "image.yaml").read_text())

    child = spawn(
        [*flags, "--strategy", "zero3", "--zero3-init", "--config_file", str(tmp_path / "z3.yaml")],
        base_env(),
        tmp_path,
    )
    answer(child, r"video DiT.*\? \[no", "yes")
    answer(child, r"Sequence-parallel size: .*\? \[2", "")
    out = finish(child)
    assert child.exitstatus == 0 and "DeepSpeed ZeRO-3" in out and "sequence parallel over 2." in out, out
    assert yaml.safe_load((tmp_path / "z3.yaml").read_text())["parallelism_config"]["parallelism_config_sp_size"] == 2

    child = spawn([*flags, "--strategy", "ddp", "--config_file", str(tmp_path / "ddp.yaml")], base_env(), tmp_path)
    out = finish(child)  # every question answered by a flag; the video one not asked under DDP
    assert child.exitstatus == 0 and "video DiT" not in out, out


def test_wizard_ctrl_c_writes_nothing(tmp_path):
    child = spawn(["--config_file", str(tmp_path / "a.yaml")], base_env(), tmp_path)
    child.expect(r"Which device backend.*Your choice \[3" + PROMPT_END)
    child.sendintr()
    out = finish(child)
    assert child.exitstatus == 130 and "nothing was written" in out
    assert list(tmp_path.iterdir()) == []


def test_the_session_in_docs_config_md_is_what_the_wizard_prints(tmp_path):
    """Replays the answers of the session shown in docs/config.md; the terminal must show the same,
    with HCCL's default port range busy too (another job's listener): a launch picks a free range,
    the wizard neither probes ports nor says anything about them."""
    from accel_npu.backend import current_backend

    if current_backend().name != "cpu":
        pytest.skip("the documented session was captured on a machine without an accelerator")
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    block = doc.split("```text\n$ accel-npu config\n", 1)[1].split("\n```", 1)[0]
    answers = [line.rsplit("]: ", 1)[1] for line in block.splitlines() if "]: " in line]
    env = base_env(HF_HOME=str(tmp_path / "hf"))
    with hccl_default_ports_busy():
        child = spawn([], env, tmp_path)
        child.logfile_read = None
        seen = []
        for text in answers:
            child.expect(PROMPT_END)
            seen.append(child.before + child.after)
            child.sendline(text)
        child.expect(pexpect.EOF)
        seen.append(child.before)
        child.close()
    assert child.exitstatus == 0
    shown = "".join(seen).replace("\r\n", "\n").replace(str(tmp_path / "hf"), "/tmp/demo/hf")
    assert [line.rstrip() for line in shown.strip("\n").splitlines()] == [line.rstrip() for line in block.splitlines()]


def test_wizard_multinode_npu_branches(tmp_path):
    """Questions that only appear for NPU / several machines / ZeRO offload; invalid answers re-asked."""
    target = tmp_path / "multi.yaml"
    child = spawn(["--config_file", str(target)], base_env(), tmp_path)
    answer(child, r"Which device backend.*Your choice \[3", "npu")
    answer(child, r"How many machines.*\[1", "2")
    answer(child, r"Rank of THIS machine \(0 = the main machine, up to 1\)\? \[0", "1")
    child.expect(r"IP address of the main machine \(rank 0\)\?: ")
    child.sendline("")
    child.expect(r"! an answer is needed here")
    child.expect(r"IP address of the main machine \(rank 0\)\?: ")
    child.sendline("10.0.0.7")
    answer(child, r"Port on the main machine\? \[29500", "")
    # the default: the letters of this machine's interface towards 10.0.0.7 (a prefix, CANN's syntax)
    from accel_npu.plugins.devices.npu.worker_tuning import suggested_socket_ifname

    answer(
        child,
        r"HCCL_SOCKET_IFNAME \(host interface.*\[" + re.escape(suggested_socket_ifname("10.0.0.7") or "none"),
        "=nosuch0",
    )
    child.expect(r"! --hccl-socket-ifname =nosuch0 matches no interface of this machine \(it has: lo")
    answer(child, r"HCCL_SOCKET_IFNAME \(host interface", "lo")
    answer(
        child,
        r"How many training processes on each machine\? \(one per device; no NPU here to check "
        r"against\) \[8",
        "",
    )
    answer(child, r"share the training state\?.*Your choice \[2", "")
    answer(child, r"Offload to host \(CPU\) memory\?.*2\) optimizer.*Your choice \[1", "optimizer")
    answer(child, r"video DiT.*\? \[no", "")
    answer(child, r"Mixed precision\?.*1\) bf16.*2\) fp16.*3\) no.*Your choice \[1", "")
    answer(child, r"Micro batch size.*\[auto", "")
    answer(child, r"Gradient accumulation steps.*\[auto", "")
    answer(child, r"Use these Ascend runtime settings\? TASK_QUEUE_ENABLE=2, .*\[yes", "no")
    answer(child, r"TASK_QUEUE_ENABLE \(task queue.*\[2", "5")
    child.expect(r"! TASK_QUEUE_ENABLE must be 0, 1 or 2 \(got '5'\)")
    answer(child, r"TASK_QUEUE_ENABLE \(task queue.*\[2", "1")
    answer(child, r"PYTORCH_NPU_ALLOC_CONF.*\[expandable_segments:True", "")
    answer(child, r"CPU_AFFINITY_CONF.*\[1", "2")
    answer(child, r"HCCL_CONNECT_TIMEOUT.*\[1200", "")
    answer(child, r"HCCL_EXEC_TIMEOUT.*\[1800", "3600")
    answer(child, r"Frozen sub-models.*\[auto", "vae,text_encoder")
    answer(child, r"load model weights.*\[auto", "")
    answer(child, r"Truncate models.*\[none", "")
    answer(child, r"Write checkpoints in the background.*\[yes", "")
    out = finish(child)
    assert child.exitstatus == 0, out
    assert "Configuration: DeepSpeed ZeRO-2, bf16, 2 machines x 8 npu process(es), optimizer offloaded to CPU." in out
    assert "On the other machines: the same files, with --machine_rank N (N = 1..1)." in out
    cfg = yaml.safe_load(target.read_text())
    assert (cfg["num_machines"], cfg["num_processes"], cfg["machine_rank"]) == (2, 16, 1)
    assert (cfg["main_process_ip"], cfg["main_process_port"]) == ("10.0.0.7", 29500)
    assert cfg["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    ds = json.loads((tmp_path / "multi.deepspeed.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_force_ds_cpu_optimizer"] is False
    side = yaml.safe_load((tmp_path / "multi.accel-npu.yaml").read_text())
    assert side["env"] == {
        "TASK_QUEUE_ENABLE": "1",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "CPU_AFFINITY_CONF": "2",
        "HCCL_CONNECT_TIMEOUT": "1200",
        "HCCL_EXEC_TIMEOUT": "3600",
        "HCCL_SOCKET_IFNAME": "lo",
        "ACCEL_NPU_FROZEN_MODULES": "vae,text_encoder",
    }

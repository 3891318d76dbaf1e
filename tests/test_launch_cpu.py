"""An unchanged script under `accelerate launch` on 2 CPU ranks: stock is wrong, accel-npu is right.

Real processes throughout: accelerate's launcher, torchrun, gloo, DeepSpeed's CPU accelerator.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.launch_utils import (
    FSDP2_CPU_CONFIG,
    REPO,
    SCRIPTS,
    accelerate_launch,
    base_env,
    explain,
    results,
    run_concurrently,
    torchrun_launch,
    write_deepspeed_config,
    zero_config,
)

pytestmark = pytest.mark.slow

TRAIN = str(SCRIPTS / "train_tiny.py")


def _assert_two_distinct_ranks(res, proc, distributed_type):
    assert [r["rank"] for r in res] == [0, 1], explain(proc)
    assert all(r["num_processes"] == 2 for r in res)
    assert all(r["distributed_type"] == distributed_type for r in res)
    # Each rank trained on its own shard of the data, not the same batches.
    assert res[0]["first_inputs"] != res[1]["first_inputs"]


def _train_then_resume(directory, stage, bf16):
    """Train 3 steps saving after step 0, then resume from that checkpoint for 1 step: (ckpt, first, resumed)."""
    cfg = write_deepspeed_config(directory, zero_config(stage, bf16=bf16))
    ckpt = directory / "ckpt"
    proc = accelerate_launch(
        ["--config_file", str(cfg), TRAIN, "--steps", "3", "--save_at", "0", "--save_dir", str(ckpt)]
    )
    resumed = accelerate_launch(
        ["--config_file", str(cfg), TRAIN, "--steps", "1", "--resume", str(ckpt), "--start", "1"]
    )
    return ckpt, proc, resumed


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """Both stages' train-then-resume pairs, started together when the first of them is asked for
    (the two pairs are independent; each pair is sequential)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            stage: pool.submit(_train_then_resume, tmp_path_factory.mktemp(f"zero{stage}"), stage, bf16)
            for stage, bf16 in ((2, False), (3, True))
        }


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3-bf16"])
def test_deepspeed_two_cpu_ranks_train_save_and_resume(deepspeed_runs, stage):
    ckpt, proc, resumed = deepspeed_runs[stage].result()
    res = results(proc)
    assert proc.returncode == 0 and len(res) == 2, explain(proc)
    _assert_two_distinct_ranks(res, proc, "DEEPSPEED")
    assert (ckpt / "pytorch_model" / "latest").exists() or (ckpt / "latest").exists() or any(ckpt.rglob("latest")), (
        explain(proc)
    )

    res2 = results(resumed)
    assert resumed.returncode == 0 and len(res2) == 2, explain(resumed)
    for before, after in zip(res, res2):
        # The first step after load_state reproduces the unbroken run's step 1 exactly.
        assert after["losses"]["1"] == before["losses"]["1"]


def test_deepspeed_without_accel_npu_every_rank_thinks_it_is_alone(tmp_path):
    cfg = write_deepspeed_config(tmp_path, zero_config(2))
    proc = accelerate_launch(["--config_file", str(cfg), TRAIN, "--steps", "1"], env=base_env(ACCEL_NPU_DISABLE="1"))
    # Stock accelerate 1.15: num_processes == 1 on each rank while DeepSpeed's gloo group has 2,
    # so DeepSpeed's batch check fails: train_batch_size 4 != 4 * 1 * 2.
    assert proc.returncode != 0, explain(proc)
    assert (
        "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size"
        in proc.stderr + proc.stdout
    ), explain(proc)


def test_plain_launch_without_config_starts_two_gloo_ranks(tmp_path):
    proc = accelerate_launch(["--num_processes", "2", TRAIN, "--steps", "2"], cwd=tmp_path)
    res = results(proc)
    assert proc.returncode == 0 and len(res) == 2, explain(proc)
    _assert_two_distinct_ranks(res, proc, "MULTI_CPU")
    # DDP averaged the gradients: both replicas hold identical parameters after the steps.
    assert res[0]["checksum"] == res[1]["checksum"]


def test_plain_launch_without_accel_npu_starts_one_process(tmp_path):
    proc = accelerate_launch(
        ["--num_processes", "2", TRAIN, "--steps", "1"], cwd=tmp_path, env=base_env(ACCEL_NPU_DISABLE="1")
    )
    res = results(proc)
    assert proc.returncode == 0, explain(proc)
    assert len(res) == 1 and res[0]["num_processes"] == 1 and res[0]["distributed_type"] == "NO"


def test_workers_activate_when_script_imports_autoload_disabler_before_torch(tmp_path):
    # torch_npu sets TORCH_DEVICE_BACKEND_AUTOLOAD=0 before importing torch; the workers must
    # still be patched (through the bootstrap the launcher puts on PYTHONPATH).
    script = str(SCRIPTS / "train_tiny_npu_import_first.py")
    proc = accelerate_launch(["--num_processes", "2", script, "--steps", "1"], cwd=tmp_path)
    res = results(proc)
    assert proc.returncode == 0 and len(res) == 2, explain(proc)
    _assert_two_distinct_ranks(res, proc, "MULTI_CPU")


def _teardown_lines(proc) -> dict[str, tuple[str, int]]:
    """rank -> (default group still open, gloo worker threads alive) in the last atexit handler."""
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("GROUP_AT_TEARDOWN"):
            fields = dict(kv.split("=") for kv in line.split()[1:])
            out[fields["rank"]] = (fields["open"], int(fields["gloo_threads"]))
    return out


def test_gloo_group_is_closed_before_interpreter_teardown(tmp_path):
    """Scripts rarely call destroy_process_group(); gloo left to interpreter teardown can abort
    a finished run ('terminate called without an active exception', exit -6: a gloo worker
    dropping its last work needs the GIL while Python finalizes). accel-npu closes the group at
    exit, unless the script did (no-op) or failed (a peer may be mid-collective). Closed means
    freed: gloo's worker threads are gone before teardown, also with a DeepSpeed config and with
    the hang watch armed (it once held the group, so its threads outlived end_training())."""
    script = str(SCRIPTS / "group_at_teardown.py")
    zero2 = str(REPO / "launch_configs" / "cpu_zero2.yaml")
    plain, deepspeed, failed = run_concurrently(
        lambda: accelerate_launch(["--num_processes", "2", script, "plain,end_training"], cwd=tmp_path),
        lambda: accelerate_launch(["--config_file", zero2, script, "end_training,plain"], cwd=tmp_path),
        lambda: accelerate_launch(["--num_processes", "2", script, "raise,plain"], cwd=tmp_path),
    )
    for proc in (plain, deepspeed):
        assert proc.returncode == 0, explain(proc)
        assert "REDUCED rank=0 3.0" in proc.stdout and "REDUCED rank=1 3.0" in proc.stdout, explain(proc)
        assert _teardown_lines(proc) == {"0": ("False", 0), "1": ("False", 0)}, explain(proc)

    assert failed.returncode != 0, explain(failed)
    assert "the script failed after training" in failed.stderr, explain(failed)
    # The failing rank leaves its group to teardown; the clean one still closes its own.
    assert _teardown_lines(failed).get("1") == ("False", 0), explain(failed)
    # The failing rank runs its atexit handlers before it exits (the agent sees the exit after them):
    # accel-npu's handler left its group open for the traceback, as intended.
    assert _teardown_lines(failed).get("0", ("?",))[0] == "True", explain(failed)


def test_gloo_worker_still_finishing_a_work_at_exit_does_not_abort_the_finished_run(tmp_path):
    """A gloo worker drops each work after the caller's wait() returned; if a busy machine
    deschedules it until Python finalizes, its GIL request ends the thread inside a noexcept frame
    and a finished run exits -6 (CI saw it three times). Freeing the group joins its workers, but
    DeepSpeed holds its groups to the end. The script makes the worker late and finalization long
    on purpose (see its docstring): stock aborts every time, and so did accel-npu before its exit
    handler waited for idle workers. Both halves launch with torchrun, stock's 2-rank CPU launcher."""
    script = [str(SCRIPTS / "gloo_work_late_at_exit.py")]
    stock, ours = run_concurrently(
        lambda: torchrun_launch(script, env=base_env(ACCEL_NPU_DISABLE="1"), cwd=tmp_path),
        lambda: torchrun_launch(script, cwd=tmp_path),
    )
    for proc in (stock, ours):  # both ranks finished the script body
        assert "RESULT rank=0" in proc.stdout and "RESULT rank=1" in proc.stdout, explain(proc)
    # torchrun's agent reports a rank killed by SIGABRT ("terminate called without an active
    # exception" is printed too, unless the agent stops the process group first).
    assert stock.returncode != 0 and "(exitcode: -6)" in stock.stderr, explain(stock)
    assert "CALLBACK_DONE" not in stock.stderr, explain(stock)  # its worker died waiting for the GIL

    assert ours.returncode == 0, explain(ours)
    assert "exitcode: -6" not in ours.stderr and "terminate called" not in ours.stderr, explain(ours)
    # accel-npu's exit handler waited for the late workers: their callbacks ran to the end.
    assert "CALLBACK_DONE rank=0" in ours.stderr and "CALLBACK_DONE rank=1" in ours.stderr, explain(ours)


def test_fsdp2_config_shards_on_cpu_ranks_instead_of_falling_back_to_ddp(tmp_path):
    """accelerate turns FSDP on only for MULTI_GPU/NPU/XPU/... ranks. Stock on CPU: every rank is
    rank 0 of 1 (no FSDP, the same batches); with the cpu backend but without FSDP_ON_CPU it is
    DDP (MULTI_CPU, whole replicas). accel-npu makes it FSDP, as on devices. All three shown."""
    import yaml

    cfg = tmp_path / "fsdp2.yaml"
    cfg.write_text(yaml.safe_dump(FSDP2_CPU_CONFIG))
    args = ["--config_file", str(cfg), TRAIN, "--steps", "2"]
    # the three launches are independent: run side by side
    cpu_backend_only = base_env(ACCEL_NPU_DISABLED_PATCHES="accelerate.state:AcceleratorState.__init__")
    stock, ddp, proc = run_concurrently(
        lambda: accelerate_launch(args, cwd=tmp_path, env=base_env(ACCEL_NPU_DISABLE="1")),
        lambda: accelerate_launch(args, cwd=tmp_path, env=cpu_backend_only),  # FSDP_ON_CPU switched off
        lambda: accelerate_launch(args, cwd=tmp_path),
    )
    assert stock.returncode == 0, explain(stock)
    assert [(r["rank"], r["num_processes"], r["distributed_type"]) for r in results(stock)] == [(0, 1, "NO")] * 2

    # the cpu backend alone (FSDP_ON_CPU switched off): two real ranks, but plain DDP, whole replicas
    res = results(ddp)
    assert ddp.returncode == 0 and len(res) == 2, explain(ddp)
    _assert_two_distinct_ranks(res, ddp, "MULTI_CPU")
    assert all(r["param_type"] == "Parameter" for r in res), res  # whole replicas, not DTensor shards

    res = results(proc)
    assert proc.returncode == 0 and len(res) == 2, explain(proc)
    _assert_two_distinct_ranks(res, proc, "FSDP")
    assert all(r["param_type"] == "DTensor" for r in res), res  # sharded, not whole replicas
    assert res[0]["losses"]["1"] != res[1]["losses"]["1"]  # each rank's own batches

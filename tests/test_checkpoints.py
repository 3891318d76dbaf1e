"""Checkpoint helpers in-process: the bounded rendezvous over a real 2-process gloo group, load-dir
resolution after interrupted saves, consolidate's refusal of incomplete checkpoints, the CLI.

The end-to-end DeepSpeed runs are in tests/test_checkpoints_dit4dit.py."""

import json
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from accel_npu import environment
from accel_npu.plugins.checkpoints import state as checkpointing
from accel_npu.plugins.checkpoints.consolidate import consolidate
from accel_npu.plugins.checkpoints.state import CheckpointError, CollectiveMisuseError
from tests.launch_utils import FSDP2_CPU_CONFIG, ended_by_launcher

#: the rendezvous timeout the workers run with: rank 1 waits up to this long for rank 0, which comes
#: one second late in rounds 3 and 4, so it leaves three seconds of slack for a loaded CI machine
TIMEOUT = 4


def _worker(rank, port, queue):
    os.environ["ACCEL_NPU_COLLECTIVE_TIMEOUT"] = str(TIMEOUT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # round 1: every rank calls (twice: the rounds pair up by count)
        t0 = time.monotonic()
        checkpointing.rendezvous("get_state_dict")
        checkpointing.rendezvous("get_state_dict")
        queue.put((rank, 1, "ok", time.monotonic() - t0))
        # round 2: only rank 0 calls; rank 1 is busy elsewhere (training on) and never enters
        if rank == 0:
            t0 = time.monotonic()
            try:
                checkpointing.rendezvous("get_state_dict")
                queue.put((rank, 2, "ok", time.monotonic() - t0))
            except CollectiveMisuseError as exc:
                queue.put((rank, 2, str(exc), time.monotonic() - t0))
        else:
            time.sleep(TIMEOUT + 1)
        dist.barrier()
        # rounds 3 and 4: every rank calls again, rank 0 one second late. The caught misuse must not
        # shift the pairing: rank 1 waits for rank 0 (it does not pair with rank 0's failed call),
        # and nobody raises.
        # Each puts when it entered and left too (CLOCK_MONOTONIC is one clock for every process on Linux).
        for n in (3, 4):
            if rank == 0:
                time.sleep(1)
            t0 = time.monotonic()
            try:
                checkpointing.rendezvous("get_state_dict")
                queue.put((rank, n, "ok", time.monotonic() - t0, t0, time.monotonic()))
            except CollectiveMisuseError as exc:
                queue.put((rank, n, str(exc), time.monotonic() - t0, t0, time.monotonic()))
        # Rank 0 hosts the store and finishes round 4 last: without this it could exit while rank 1,
        # woken but descheduled (CI load), still reads round 4's outcome from the store. In use a
        # collective always follows the rendezvous, so the store's host never leaves that early.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rendezvous_pairs_up_all_ranks_and_fails_bounded_on_one_rank_saying_what_to_do():
    from tests.launch_utils import free_port

    ctx = mp.get_context("fork")  # no re-import of torch per worker
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    out = sorted((queue.get(timeout=5) for _ in range(7)), key=lambda x: (x[1], x[0]))
    assert [(r, n, s) for r, n, s, _ in out[:2]] == [(0, 1, "ok"), (1, 1, "ok")]
    assert all(t < TIMEOUT for *_, t in out[:2])
    rank, n, message, seconds = out[2]
    assert (rank, n) == (0, 2)
    assert TIMEOUT <= seconds < 2 * TIMEOUT
    assert f"only rank(s) [0] entered it; rank(s) [1] did not within {TIMEOUT} s" in message
    later = out[3:]
    assert [(r, n, s) for r, n, s, *_ in later] == [(0, 3, "ok"), (1, 3, "ok"), (0, 4, "ok"), (1, 4, "ok")], later
    # rank 1 really waited for rank 0: it left each round after rank 0 entered it, within the timeout
    for (_, _, _, _, rank0_entered, _), (_, _, _, waited, _, rank1_left) in (later[:2], later[2:]):
        assert rank1_left >= rank0_entered and waited < TIMEOUT, later
    assert "ACCEL_NPU_COLLECTIVE_TIMEOUT" in message and "accelerator.save_state(output_dir)" in message


def test_default_timeout_is_30s(monkeypatch):
    monkeypatch.delenv("ACCEL_NPU_COLLECTIVE_TIMEOUT", raising=False)
    assert checkpointing.collective_timeout() == 30.0
    assert environment.get("ACCEL_NPU_COLLECTIVE_TIMEOUT") == "30"


class _Cfg:
    automatic_checkpoint_naming = False


class _Acc:
    project_configuration = _Cfg()
    project_dir = "."


def _complete(d, files=("pytorch_model/mp_rank_00_model_states.pt", "latest")):
    d.mkdir(parents=True)
    sizes = {}
    for rel in files:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("x" * 5)
        sizes[rel] = 5
    (d / checkpointing.MANIFEST).write_text(json.dumps({"files": sizes, "world_size": 2}))


def test_load_dir_recovers_checkpoint_set_aside_by_an_interrupted_swap(tmp_path):
    final = tmp_path / "ckpt"
    _complete(tmp_path / ".ckpt.accel-npu-old")
    assert checkpointing.resolve_load_dir(str(final), _Acc()) == str(tmp_path / ".ckpt.accel-npu-old")


def test_load_dir_refuses_incomplete_checkpoint(tmp_path):
    final = tmp_path / "ckpt"
    _complete(final)
    (final / "pytorch_model" / "mp_rank_00_model_states.pt").write_text("xx")
    (final / "latest").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"incomplete; missing: pytorch_model/mp_rank_00_model_states.pt "
        r"\(truncated: 2 of 5 bytes\), latest",
    ):
        checkpointing.resolve_load_dir(str(final), _Acc())


def test_automatic_naming_skips_interrupted_saves(tmp_path):
    class Cfg:
        automatic_checkpoint_naming = True

    class Acc:
        project_configuration = Cfg()
        project_dir = str(tmp_path)

    base = tmp_path / "checkpoints"
    _complete(base / "checkpoint_1")
    (base / ".checkpoint_2.accel-npu-partial").mkdir()
    assert checkpointing.resolve_load_dir(None, Acc()) == str(base / "checkpoint_1")


def test_consolidate_refuses_a_save_that_never_finished(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "pytorch_model").mkdir(parents=True)
    (tmp_path / ".ckpt.accel-npu-partial").mkdir()
    with pytest.raises(CheckpointError) as info:
        consolidate(str(ckpt), str(tmp_path / "out"))
    msg = str(info.value)
    assert "latest (the save did not finish" in msg and ".ckpt.accel-npu-partial" in msg
    assert "Nothing was written" in msg and not (tmp_path / "out").exists()


def test_consolidate_refuses_non_empty_output(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        consolidate(str(tmp_path), str(tmp_path / "out"))
    assert (tmp_path / "out" / "x").read_text() == "keep me"


def test_consolidate_command_is_registered(capsys):
    from accel_npu.cli import main

    with pytest.raises(SystemExit) as info:
        main(["consolidate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "CKPT_DIR" in out and "--max-shard-size" in out and "--dtype" in out


def test_streamed_safetensors_load_back_identically(tmp_path):
    from safetensors.torch import load_file

    from accel_npu._torch.safetensors_io import SafetensorsStream

    tensors = {
        "w": torch.randn(3, 4).bfloat16(),
        "s": torch.tensor(5.0),
        "empty": torch.zeros(0, 2),
        "idx": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "h": torch.randn(2).half(),
    }
    stream = SafetensorsStream(
        str(tmp_path / "x.safetensors"), [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    )
    for k, v in tensors.items():
        stream.write(k, v)
    stream.close()
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())


def test_swap_keeps_the_users_other_files_and_replaces_the_checkpoint(tmp_path):
    final = tmp_path / "out"
    (final / "pytorch_model").mkdir(parents=True)
    (final / "pytorch_model" / "old_shard.pt").write_text("old")
    (final / "logs").mkdir()
    (final / "logs" / "events.out").write_text("tensorboard")
    (final / "notes.txt").write_text("mine")
    tmp = tmp_path / ".out.accel-npu-partial"
    (tmp / "pytorch_model").mkdir(parents=True)
    (tmp / "pytorch_model" / "new_shard.pt").write_text("new")
    (tmp / "latest").write_text("pytorch_model")
    checkpointing._swap_into_place(str(tmp), str(final))
    assert sorted(os.listdir(final / "pytorch_model")) == ["new_shard.pt"]
    assert (final / "latest").read_text() == "pytorch_model"
    assert (final / "logs" / "events.out").read_text() == "tensorboard"
    assert (final / "notes.txt").read_text() == "mine"
    assert not tmp.exists() and not (tmp_path / ".out.accel-npu-old").exists()


@pytest.mark.slow
def test_rank0_only_save_model_under_zero3_fails_in_time_saying_what_to_do(tmp_path):
    """save_model inside `if accelerator.is_main_process:` under ZeRO-3 on 2 ranks while the other
    rank is not idle: the main process gets CollectiveMisuseError within ACCEL_NPU_COLLECTIVE_TIMEOUT
    naming the script line, nothing is written.
    (No ACCEL_NPU_DISABLE stock half on CPU: without accel-npu every CPU rank believes it is rank 0 of 1.)"""
    from tests.launch_utils import (
        SCRIPTS,
        accelerate_launch,
        base_env,
        explain,
        results,
        write_deepspeed_config,
        zero_config,
    )

    cfg = write_deepspeed_config(tmp_path, zero_config(3))
    out = tmp_path / "out"
    proc = accelerate_launch(
        ["--config_file", str(cfg), str(SCRIPTS / "rank0_only_save.py"), "save_model_busy", str(out)],
        env=base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT="5"),
        timeout=240,
    )
    assert proc.returncode != 0, explain(proc)
    rec = results(proc)
    assert len(rec) == 1 and rec[0]["error"] == "CollectiveMisuseError", explain(proc)
    assert 5 <= rec[0]["seconds"] < 20, rec
    line = next(
        i
        for i, text in enumerate((SCRIPTS / "rank0_only_save.py").read_text().splitlines(), 1)
        if "save_model(model, out_dir)" in text
    )
    assert f"rank0_only_save.py:{line}" in rec[0]["message"], rec[0]["message"]
    assert "rank(s) [1] did not reach an idle point (wait_for_everyone, end_training) within 5 s" in rec[0]["message"]
    assert not out.exists() and not list(tmp_path.glob(".out*")), "nothing may be written"


def test_a_failed_collective_becomes_the_error_another_rank_published(monkeypatch):
    """A rank whose collective fails (gloo: "Connection closed by peer") after another rank published an
    accel-npu error raises that error and acknowledges it in the store; with nothing published, or for
    accel-npu's own error, the failure stands. Witness: a real torch.distributed HashStore."""
    from accel_npu._torch import dist as accel_dist
    from accel_npu.plugins.checkpoints import boundary

    store = dist.HashStore()
    monkeypatch.setattr(accel_dist, "_store_and_world", lambda: (store, 2, 1))
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6349")
    assert boundary.collective_failed(gloo) is None and not store.check([f"{boundary._ABORT_KEY}/ack/1"])
    store.set(boundary._ABORT_KEY, "train.py:12 enters save_state ...")
    clearer = boundary.collective_failed(gloo)
    assert isinstance(clearer, CollectiveMisuseError)
    assert str(clearer) == "another rank stopped with: train.py:12 enters save_state ..."
    assert store.get(f"{boundary._ABORT_KEY}/ack/1") == b"1"
    assert boundary.collective_failed(CollectiveMisuseError("ours")) is None


@pytest.mark.slow
def test_rank0_only_save_state_at_a_step_boundary_completes_and_mid_step_fails_on_every_rank(tmp_path):
    """save_state inside `if accelerator.is_main_process:` under ZeRO-3 on 2 ranks:
    - right after the optimizer step (rank 1 goes on to wait_for_everyone): rank 1 serves it, calling
      save_state itself: a complete checkpoint with both ranks' shards and RNG states;
    - mid-step (between forward and backward; rank 1 goes on into backward's collectives): the main
      process gets CollectiveMisuseError within ACCEL_NPU_COLLECTIVE_TIMEOUT naming the script line,
      and rank 1 stops with that same error instead of gloo's "Connection closed by peer"; nothing
      written. Stock half: the same mid-step launch with the step-boundary patch switched off (it
      also makes a failed collective raise the other rank's error): rank 1 reports gloo's error.
    (No ACCEL_NPU_DISABLE stock half on CPU: without accel-npu every CPU rank believes it is rank 0 of 1.)"""
    from tests.launch_utils import (
        SCRIPTS,
        accelerate_launch,
        base_env,
        explain,
        results,
        run_concurrently,
        write_deepspeed_config,
        zero_config,
    )

    cfg = write_deepspeed_config(tmp_path, zero_config(3, stage3_param_persistence_threshold=0))
    script = SCRIPTS / "rank0_only_save.py"
    env = base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT="5")
    stock_env = dict(env, ACCEL_NPU_DISABLED_PATCHES="accelerate.accelerator:Accelerator.backward")

    def launch(mode, out, environment):
        return lambda: accelerate_launch(
            ["--config_file", str(cfg), str(script), mode, str(tmp_path / out)], env=environment, timeout=240
        )

    boundary, stock = run_concurrently(
        launch("save_state", "boundary", env), launch("save_state_midstep", "stock", stock_env)
    )
    # alone: its assertions time it (the error within the timeout), and rank 1 must raise its error in the
    # moments between rank 0's exit and the launcher's SIGTERM, which a loaded machine can use up
    mid = launch("save_state_midstep", "mid", env)()
    # at the step boundary: saved, by both ranks
    assert boundary.returncode == 0, explain(boundary)
    assert [r.get("result") for r in results(boundary)] == ["saved"], explain(boundary)
    ckpt = tmp_path / "boundary"
    assert (ckpt / "random_states_0.pkl").is_file() and (ckpt / "random_states_1.pkl").is_file()
    shards = sorted(p.name for p in (ckpt / "pytorch_model").iterdir())
    assert any("rank_0" in n for n in shards) and any("rank_1" in n for n in shards), shards
    import json as _json

    manifest = _json.loads((ckpt / "accel_npu_checkpoint.json").read_text())
    assert all((ckpt / rel).stat().st_size == size for rel, size in manifest["files"].items())
    # mid-step: the clear error on every rank
    assert mid.returncode != 0, explain(mid)
    rec = results(mid)
    assert len(rec) == 1 and rec[0]["error"] == "CollectiveMisuseError", explain(mid)
    assert 5 <= rec[0]["seconds"] < 20, rec
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "save_state(out_dir)" in text)
    assert f"rank0_only_save.py:{line}" in rec[0]["message"], rec[0]["message"]
    assert (
        "accelerator.save_state() under DeepSpeed ZeRO is a collective, but only rank(s) [0] entered it; "
        "rank(s) [1] did not within 5 s" in rec[0]["message"]
    )
    text = mid.stdout + mid.stderr
    # rank 1 is inside backward's collectives: it reads rank 0's error once rank 0's exit closes gloo's
    # connections, and the launcher's SIGTERM (torchrun's agent stops every worker once one has failed)
    # can end it first; it never stops with another error. The conversion itself, without the race:
    # test_a_failed_collective_becomes_the_error_another_rank_published
    assert (
        f"[rank1]: accel_npu._torch.dist.CollectiveMisuseError: another rank stopped with: {rec[0]['message'][:200]}"
        in text
        or ended_by_launcher(text, 1)
    ), explain(mid)
    assert "Connection closed by peer" not in text, explain(mid)
    assert set(re.findall(r"\[rank1\]: (\w[\w.]*):", text)) <= {"accel_npu._torch.dist.CollectiveMisuseError"}, explain(
        mid
    )
    assert not (tmp_path / "mid").exists() and not list(tmp_path.glob(".mid*")), "nothing may be written"
    # stock half: rank 1 never learns why: it dies of gloo's transport error, or, when the launcher's
    # SIGTERM (sent once rank 0 exits) arrives before gloo notices, of the signal
    assert stock.returncode != 0, explain(stock)
    stock_text = stock.stdout + stock.stderr
    assert "[rank1]: accel_npu" not in stock_text and "another rank stopped with" not in stock_text, explain(stock)
    assert "Connection closed by peer" in stock_text or ended_by_launcher(stock_text, 1), explain(stock)


@pytest.mark.slow
def test_rank0_only_save_model_under_zero3_completes_while_the_others_wait(tmp_path):
    """The same save_model with the other rank idle in wait_for_everyone: it joins rank 0's gathers
    (each parameter a ZeRO-3 partition: threshold 0) and the file holds the whole model, equal to
    get_state_dict gathered on every rank afterwards.

    The same launch then saves as diffusers' train_llada2.py does: transformers' save_pretrained inside
    `if accelerator.is_main_process:` right after wait_for_everyone while the other rank trains on (served
    at its next batch), and again at the end while the other rank simply finishes (served at its exit).
    Both load with from_pretrained, tensor for tensor equal to the weights gathered on every rank before
    each save (the tied lm_head included). The stock half is test_transformers_save_pretrained_of_zero3_
    partitions_loads_and_stock_writes_empty_tensors (in-process: on CPU, ACCEL_NPU_DISABLE=1 makes every
    rank rank 0 of 1)."""
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    from tests.launch_utils import (
        SCRIPTS,
        accelerate_launch,
        base_env,
        explain,
        results,
        write_deepspeed_config,
        zero_config,
    )

    cfg = write_deepspeed_config(tmp_path, zero_config(3))
    out = tmp_path / "out"
    proc = accelerate_launch(
        ["--config_file", str(cfg), str(SCRIPTS / "rank0_only_save.py"), "save_model", str(out)],
        env=base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT="5"),
        timeout=240,
    )
    assert proc.returncode == 0, explain(proc)
    rec = results(proc)
    assert len(rec) == 1 and rec[0]["result"] == "saved", explain(proc)
    saved = load_file(str(out / "model.safetensors"))
    reference = dict(rec[0]["reference"])
    # save_model writes a tied weight once (lm_head is embed_tokens), as stock does
    assert reference.pop("lm_head.weight") == reference["model.embed_tokens.weight"]
    assert {k: v.float().sum().item() for k, v in saved.items()} == reference
    assert saved["model.layers.0.mlp.up_proj.weight"].shape == (32, 16)
    assert (out / "ckpt" / "model.safetensors").is_file()
    assert len(list((out / "final").glob("model-*-of-*.safetensors"))) >= 2  # max_shard_size="20KB"
    for name in ("ckpt", "final"):
        reference = torch.load(out / f"reference_{name}.pt")
        loaded = Qwen2ForCausalLM.from_pretrained(out / name).state_dict()
        assert set(loaded) == set(reference), name
        for key, value in reference.items():
            assert loaded[key].dtype == value.dtype == torch.float32 and torch.equal(loaded[key], value), (name, key)
    assert not torch.equal(
        torch.load(out / "reference_ckpt.pt")["lm_head.weight"],
        torch.load(out / "reference_final.pt")["lm_head.weight"],
    )  # the second step trained


def test_transformers_save_pretrained_of_zero3_partitions_loads_and_stock_writes_empty_tensors(tmp_path, monkeypatch):
    """transformers' save_pretrained of a model built under zero.Init (every parameter a ZeRO-3 partition,
    bf16; a 1-rank group in-process): with accel-npu the sharded safetensors checkpoint loads with
    from_pretrained equal to the gathered weights, tied lm_head included; stock (every patch removed) writes
    shape-[0] tensors that from_pretrained refuses."""
    import deepspeed
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from accel_npu.plugins.checkpoints import serving
    from tests.inprocess import stock
    from tests.launch_utils import ZERO3_BF16_T0, one_rank_deepspeed_group

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    with one_rank_deepspeed_group(monkeypatch):
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=ZERO3_BF16_T0):
            model = Qwen2ForCausalLM(config)
        params = list(model.parameters())
        assert params and all(serving.is_partitioned(p) for p in params)
        model.save_pretrained(tmp_path / "ours", save_function=torch.save, max_shard_size="2KB")
        with stock():
            model.save_pretrained(tmp_path / "stock")
        with deepspeed.zero.GatheredParameters(params):
            gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    loaded = Qwen2ForCausalLM.from_pretrained(tmp_path / "ours").state_dict()
    assert set(loaded) == set(gathered)
    for key, value in gathered.items():
        assert loaded[key].dtype == value.dtype == torch.bfloat16 and torch.equal(loaded[key], value), key
    # stock: exit 0, every tensor of shape [0], and from_pretrained refuses the file
    assert {tuple(v.shape) for v in load_file(tmp_path / "stock" / "model.safetensors").values()} == {(0,)}
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        Qwen2ForCausalLM.from_pretrained(tmp_path / "stock")


def _dcp_tensors(directory):
    """A torch.distributed.checkpoint folder read back whole, offline (torch's own converter)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent / f"{directory.parent.name}_{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(target))
    return torch.load(target, weights_only=False)


@pytest.mark.slow
def test_rank0_only_save_state_under_fsdp2_equals_the_fixed_copy_and_mid_step_fails_on_every_rank(tmp_path):
    """FSDP's save_state is collective (accelerate's save_fsdp_model / save_fsdp_optimizer write every
    rank's shards). Rank 0 alone right after the optimizer step: the other rank serves it, and the
    checkpoint equals the one every rank writes with the one-line fix (model and optimizer tensors, both
    ranks' RNG states). Mid-step: CollectiveMisuseError within the timeout on both ranks. Stock half
    (the save_state, backward and optimizer-step patches off): the rank-0-only save hangs."""
    import torch
    import yaml

    from tests.launch_utils import (
        BIN,
        SCRIPTS,
        accelerate_launch,
        base_env,
        explain,
        free_port,
        results,
        run_concurrently,
    )
    from tests.official_scripts import StreamedLaunch

    cfg = tmp_path / "fsdp2.yaml"
    cfg.write_text(yaml.safe_dump(FSDP2_CPU_CONFIG))
    script = SCRIPTS / "rank0_only_save.py"
    env = base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT="5")
    stock_env = dict(
        env,
        ACCEL_NPU_DISABLED_PATCHES=",".join(
            f"accelerate.{t}"
            for t in (
                "accelerator:Accelerator.save_state",
                "accelerator:Accelerator.backward",
                "optimizer:AcceleratedOptimizer.step",
            )
        ),
    )
    stock = StreamedLaunch(
        [
            str(BIN / "accelerate"),
            "launch",
            "--main_process_port",
            str(free_port()),
            "--config_file",
            str(cfg),
            str(script),
            "save_state",
            str(tmp_path / "stock"),
        ],
        stock_env,
        tmp_path,
    )

    def launch(mode, out):
        return lambda: accelerate_launch(
            ["--config_file", str(cfg), str(script), mode, str(tmp_path / out)], env=env, timeout=240
        )

    boundary, fixed, mid = run_concurrently(
        launch("save_state", "boundary"), launch("save_state_every_rank", "fixed"), launch("save_state_midstep", "mid")
    )
    for proc in (boundary, fixed):
        assert proc.returncode == 0 and [r.get("result") for r in results(proc)] == ["saved"], explain(proc)
    names = sorted(p.relative_to(tmp_path / "fixed").as_posix() for p in (tmp_path / "fixed").rglob("*"))
    assert names == sorted(p.relative_to(tmp_path / "boundary").as_posix() for p in (tmp_path / "boundary").rglob("*"))
    assert "random_states_1.pkl" in names and "pytorch_model_fsdp_0/__1_0.distcp" in names, names
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        ours, reference = _dcp_tensors(tmp_path / "boundary" / part), _dcp_tensors(tmp_path / "fixed" / part)
        flat_ours, flat_ref = torch.utils._pytree.tree_flatten(ours)[0], torch.utils._pytree.tree_flatten(reference)[0]
        assert len(flat_ours) == len(flat_ref) > 0
        for a, b in zip(flat_ours, flat_ref):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, part
    for rank in (0, 1):  # accelerate writes them with torch.save: python, numpy and torch generator states
        name = f"random_states_{rank}.pkl"
        ours, reference = (torch.load(tmp_path / d / name, weights_only=False) for d in ("boundary", "fixed"))
        assert ours.keys() == reference.keys() and "torch_manual_seed" in ours, name
        assert torch.equal(ours["torch_manual_seed"], reference["torch_manual_seed"]), name
        assert repr(ours["random_state"]) == repr(reference["random_state"]), name
        assert all(
            (a == b).all() if hasattr(a, "all") else a == b
            for a, b in zip(ours["numpy_random_seed"], reference["numpy_random_seed"])
        ), name
    # mid-step: the clear error on every rank, within the timeout
    rec = results(mid)
    assert mid.returncode != 0 and len(rec) == 1 and rec[0]["error"] == "CollectiveMisuseError", explain(mid)
    assert 5 <= rec[0]["seconds"] < 20 and "under FSDP is a collective" in rec[0]["message"], rec
    assert "DistributedType.FSDP" in rec[0]["message"], rec
    text = mid.stdout + mid.stderr
    # rank 1 is inside backward's collectives: it reads rank 0's error once rank 0's exit closes gloo's
    # connections, and on a loaded machine the launcher's SIGTERM (torchrun's agent stops every worker once
    # one has failed) can end it first; it never stops with another error
    assert (
        "[rank1]: accel_npu._torch.dist.CollectiveMisuseError: another rank stopped with" in text
        or ended_by_launcher(text, 1)
    ), explain(mid)
    assert "Connection closed by peer" not in text, explain(mid)
    assert set(re.findall(r"\[rank1\]: (\w[\w.]*):", text)) <= {"accel_npu._torch.dist.CollectiveMisuseError"}, explain(
        mid
    )
    assert not (tmp_path / "mid").exists()
    # stock: rank 0's save never completes (no RESULT line) while the launch is still running a minute in
    try:
        stock.proc.wait(max(1.0, 60 - (__import__("time").monotonic() - stock.started)))
    except Exception:  # noqa: BLE001 - still running: the hang
        pass
    still_running = stock.proc.poll() is None
    stock.kill() if still_running else None
    stock.wait(30)
    assert still_running and "RESULT" not in stock.output, stock.explain()


@pytest.mark.slow
def test_rank0_only_zero3_forward_after_wait_for_everyone_is_served_and_training_goes_on(tmp_path):
    """train_unconditional.py's pattern: after an epoch's wait_for_everyone, rank 0 alone runs no-grad forwards of
    the ZeRO-3 model (threshold 0: every parameter a partition; prefetching on) while rank 1 goes on to its next
    epoch. Ours: rank 1 pauses at its next batch and joins each parameter fetch; rank 0's outputs equal the same
    forward computed with plain torch from the weights gathered on every rank just before (the independent
    witness), and the final weights equal, to the bit, those of the same run without rank 0's forwards.
    Stock half: the same launch with the forward-fetch patch switched off: rank 0's first parameter gather has no
    partner (a hang on GPUs too; accel-npu's collective hook stops it with its error). (No ACCEL_NPU_DISABLE stock
    half on CPU: without accel-npu every CPU rank believes it is rank 0 of 1.)"""
    import torch

    from tests.launch_utils import (
        SCRIPTS,
        accelerate_launch,
        base_env,
        explain,
        results,
        run_concurrently,
        write_deepspeed_config,
        zero_config,
    )

    cfg = write_deepspeed_config(tmp_path, zero_config(3, stage3_prefetch_bucket_size=10**6))
    script = SCRIPTS / "rank0_only_forward.py"
    env = base_env(ACCEL_NPU_COLLECTIVE_TIMEOUT="10")
    stock_env = dict(
        env,
        ACCEL_NPU_DISABLED_PATCHES="deepspeed.runtime.zero.parameter_offload:"
        "DeepSpeedZeRoOffload.pre_sub_module_forward_function",
    )

    def launch(mode, environment):
        return lambda: accelerate_launch(["--config_file", str(cfg), str(script), mode], env=environment, timeout=240)

    ours, reference, stock = run_concurrently(launch("forward", env), launch("none", env), launch("forward", stock_env))
    assert ours.returncode == 0, explain(ours)
    assert reference.returncode == 0, explain(reference)
    rec, ref = results(ours), results(reference)
    assert len(rec) == 1 and len(ref) == 1 and ref[0]["forwards"] == [], explain(ours)
    forwards = rec[0]["forwards"]
    assert [f["epoch"] for f in forwards] == [0, 1, 2], rec[0]
    for f in forwards:
        for out, expected in zip(f["outputs"], f["expected"]):
            assert torch.allclose(torch.tensor(out), torch.tensor(expected), atol=1e-6), f
    assert forwards[0]["outputs"] != forwards[1]["outputs"], "the weights must change between epochs"
    # training went on as if rank 0 had not run them: the final weights equal those of the run without them
    assert rec[0]["final"] == ref[0]["final"], "final weights differ"
    # stock half: the first gather of rank 0's forward has no partner
    assert stock.returncode != 0, explain(stock)
    assert results(stock) == [], explain(stock)
    assert (
        "enters all_gather_into_tensor, a collective, inside `if accelerator.is_main_process"
        in stock.stdout + stock.stderr
    ), explain(stock)

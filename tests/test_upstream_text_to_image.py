"""diffusers' train_text_to_image.py (v0.40.0, byte for byte, vendored in tests/upstream/ and run
unchanged) on 2 CPU ranks, under the shipped cpu_zero2 config and a cpu_zero3 variant with real
partitioning (stage3_param_persistence_threshold 0, as any real-size UNet is). Issue 16, items 1-3;
docs/compatibility.md's rows for this script are asserted here.

Eight launches, in two waves (the first three spend most of their time waiting, so they share the CPUs
with the fixed script's first run; its resume runs beside the final saves):
- misuse (ZeRO-3 and ZeRO-2, checkpoint every 2 steps): the script calls ``accelerator.save_state`` inside
  ``if accelerator.is_main_process:``; every rank ends within 60 s with one error naming that line
  (computed here from the upstream file) and the one-line fix; no ``checkpoint-*`` directory;
- stock save_state (ZeRO-2, same arguments, the save_state patch disabled): hangs at the first
  checkpoint, leaving an empty ``checkpoint-2`` that ``--resume_from_checkpoint latest`` would pick;
  load_state's check on that very directory says it is incomplete;
- final save (ZeRO-3 threshold 0 / ZeRO-2, checkpointing off): exit 0, ``from_pretrained`` loads the
  UNet, and the ZeRO-3 one equals the ZeRO-2 one (an independent witness: no partitioning there,
  stock saving) far closer than either is to the initial weights;
- stock final save (ZeRO-3 threshold 0, this plugin's save/gather patches disabled): exit 0 and a
  UNet that ``from_pretrained`` refuses (shape [0]);
- item 1 with the one-line fix the error gives (written to a temporary copy, never into the repo):
  checkpoints at steps 2 and 4, then ``--resume_from_checkpoint latest`` to step 6; DeepSpeed's own
  zero_to_fp32 of each checkpoint equals the UNet saved at that step.

Stock halves use ACCEL_NPU_DISABLED_PATCHES: with ACCEL_NPU_DISABLE=1 on CPU every rank is rank 0
of 1 (stock accelerate starts no gloo group without an accelerator), so neither failure can happen.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.launch_utils import BIN, REPO, SCRIPTS, UPSTREAM_EXAMPLES, base_env, free_port, shipped_zero_configs
from tests.torchvision_site import with_torchvision

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

UPSTREAM = UPSTREAM_EXAMPLES / "text_to_image" / "train_text_to_image.py"
DOC = REPO / "docs" / "compatibility.md"
STEPS = 4
MISUSE_TIMEOUT_S = 15
# the patches whose absence is "stock" for each half
STOCK_SAVE_STATE = "accelerate.accelerator:Accelerator.save_state"
STOCK_FINAL_SAVE = ",".join([
    "diffusers.models.modeling_utils:ModelMixin.save_pretrained", "safetensors.torch:save_file",
    "accelerate.state:PartialState.wait_for_everyone", "accelerate.accelerator:Accelerator.end_training",
    "deepspeed.runtime.zero.partition_parameters:GatheredParameters.__enter__"])


def _line_of(text: str) -> int:
    lines = UPSTREAM.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)


class Run:
    """One `accelerate launch` of the upstream script, output collected, the time each step showed."""

    def __init__(self, cfg: Path, out: Path, extra: list[str], env: dict, workdir: Path, script: Path = UPSTREAM,
                 steps: int = STEPS):
        self.out = out
        self.steps = steps
        args = [str(BIN / "accelerate"), "launch", "--main_process_port", str(free_port()), "--config_file",
                str(cfg), str(script), "--pretrained_model_name_or_path", str(workdir / "model"),
                "--train_data_dir", str(workdir / "data"), "--caption_column", "text", "--resolution", "16",
                "--train_batch_size", "2", "--max_train_steps", str(steps), "--learning_rate", "1e-3",
                "--seed", "0", "--output_dir", str(out), "--dataloader_num_workers", "0", *extra]
        self.text = []
        self.step_seen: dict[int, float] = {}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=workdir)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        buf = ""
        while True:
            chunk = self.proc.stdout.read1(4096).decode(errors="replace") if self.proc.stdout else ""
            if not chunk:
                self.exited = time.monotonic()  # the launcher and its workers closed their output: they ended
                break
            buf += chunk
            self.text.append(chunk)
            if "CollectiveMisuseError: " in buf and not hasattr(self, "error_seen"):
                self.error_seen = time.monotonic()
            for n in map(int, re.findall(rf"\| (\d+)/{self.steps} \[", buf[-2000:])):
                self.step_seen.setdefault(n, time.monotonic())
            buf = buf[-4000:]

    def wait(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(10)
        self.ended = time.monotonic()
        return self.proc.returncode

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher and its workers (a session of their own)
        self.proc.wait(30)

    @property
    def output(self) -> str:
        return "".join(self.text)

    def explain(self) -> str:
        return f"exit {self.proc.returncode}\n{self.output[-8000:]}"


def _fixed_script(directory: Path) -> Path:
    """The upstream script with the one-line fix the error gives (and its import), written to a
    temporary directory: what a user does after reading the error. Item 1's flow needs it."""
    lines = UPSTREAM.read_text().splitlines(keepends=True)
    guard = _line_of("if global_step % args.checkpointing_steps == 0:")  # the next line is the `if` to fix
    assert lines[guard].strip() == "if accelerator.is_main_process:"
    indent = lines[guard][:len(lines[guard]) - len(lines[guard].lstrip())]
    lines[guard] = indent + "if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:\n"
    imports = _line_of("from accelerate.utils import ProjectConfiguration, set_seed") - 1
    lines[imports] = "from accelerate.utils import DistributedType, ProjectConfiguration, set_seed\n"
    path = directory / "train_text_to_image_fixed.py"
    path.write_text("".join(lines))
    return path


def _unet_state(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "unet" / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("t2i")
    subprocess.run([sys.executable, str(SCRIPTS / "tiny_sd.py"), str(work / "model"), str(work / "data")],
                   check=True, capture_output=True, timeout=300, env=base_env())
    cfg = shipped_zero_configs(work)
    env = with_torchvision(base_env(HF_DATASETS_CACHE=str(work / "datasets-cache")))
    stock = {"save_state": dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_SAVE_STATE),
             "final": dict(env, ACCEL_NPU_DISABLED_PATCHES=STOCK_FINAL_SAVE)}
    results = {}
    t0 = time.monotonic()
    # wave 1: the misuse (ours) and the stock hang
    # the misuse bound at 15 s instead of the default 30 s: rank teardown on a loaded 2-core CI machine
    # takes tens of seconds, and the claim is "every rank ended within 60 s of the checkpoint"
    quick = dict(env, ACCEL_NPU_COLLECTIVE_TIMEOUT=str(MISUSE_TIMEOUT_S))
    # item 1 with the fixed script (checkpoints at 2 and 4) starts now too: it has no timing to keep,
    # and its steps fill the cores the three runs below leave idle while they wait
    fixed = _fixed_script(work)
    fixed_run = Run(cfg["zero3_t0"], work / "fixed_z3", ["--checkpointing_steps", "2"], env, work, script=fixed)
    misuse = Run(cfg["zero3_t0"], work / "misuse", ["--checkpointing_steps", "2"], quick, work)
    misuse_z2 = Run(cfg["zero2"], work / "misuse_z2", ["--checkpointing_steps", "2"], quick, work)
    hang = Run(cfg["zero2"], work / "stock_hang", ["--checkpointing_steps", "2"], stock["save_state"], work)
    deadline = time.monotonic() + 600
    leftover = work / "stock_hang" / "checkpoint-2"
    while not leftover.exists() and hang.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    seen = time.monotonic()
    hang_alive = False
    if leftover.exists():
        time.sleep(20)  # a hang, not a slow save: still there 20 s after the checkpoint began
        hang_alive = hang.proc.poll() is None
    hang.kill() if hang.proc.poll() is None else None
    hang.wait(30)
    results["hang"] = dict(run=hang, alive_20s_after_checkpoint=hang_alive, seen=seen, leftover=leftover)
    misuse.wait(600)
    misuse_z2.wait(600)
    results["misuse"] = dict(run=misuse)
    results["misuse_z2"] = dict(run=misuse_z2)
    # wave 2: the final saves; beside them, as soon as the fixed run has ended, its resume from `latest`
    # (checkpoint-4) to step 6
    final = {
        "zero3_t0": Run(cfg["zero3_t0"], work / "final_z3", ["--checkpointing_steps", "100",
                                                              "--resume_from_checkpoint", "latest"], env, work),
        "zero2": Run(cfg["zero2"], work / "final_z2", ["--checkpointing_steps", "100"], env, work),
        "stock_zero3_t0": Run(cfg["zero3_t0"], work / "stock_final_z3", ["--checkpointing_steps", "100"],
                              stock["final"], work),
    }
    fixed_run.wait(600)
    results["fixed_zero3_t0"] = dict(run=fixed_run)
    resumed = Run(cfg["zero3_t0"], work / "fixed_z3", ["--checkpointing_steps", "2", "--resume_from_checkpoint",
                                                       "latest"], env, work, script=fixed, steps=STEPS + 2)
    for label, run in final.items():
        run.wait(600)
        results[label] = dict(run=run)
    resumed.wait(600)
    results["resumed_zero3_t0"] = dict(run=resumed)
    results["seconds"] = time.monotonic() - t0
    results["work"] = work
    print(f"upstream text_to_image launches: {results['seconds']:.0f} s")
    return results


@pytest.mark.parametrize("label", ["misuse", "misuse_z2"])
def test_rank0_only_save_state_fails_in_time_naming_the_line_and_the_fix(runs, label):
    run = runs[label]["run"]
    assert run.proc.returncode not in (0, None), run.explain()
    assert 2 in run.step_seen, run.explain()
    error_after, ended_after = run.error_seen - run.step_seen[2], run.exited - run.step_seen[2]
    print(f"{label}: error {error_after:.0f} s, every rank ended {ended_after:.0f} s after step 2")
    assert MISUSE_TIMEOUT_S <= error_after < MISUSE_TIMEOUT_S + 20, (error_after, run.explain())
    assert ended_after < 60, (ended_after, run.explain())
    line, guard = _line_of("accelerator.save_state(save_path)"), _line_of("if global_step % args.checkpointing_steps == 0:") + 1
    text = run.output
    assert f"did not within {MISUSE_TIMEOUT_S} s (ACCEL_NPU_COLLECTIVE_TIMEOUT)" in text, run.explain()
    assert f"{UPSTREAM}:{line} calls accelerator.save_state() inside `if accelerator.is_main_process:` " \
           f"(line {guard})" in text, run.explain()
    assert "`if accelerator.is_main_process or accelerator.distributed_type == DistributedType.DEEPSPEED:`" in text
    assert text.count("CollectiveMisuseError: ") == 1, run.explain()
    assert not [d for d in os.listdir(run.out) if d.startswith("checkpoint")], os.listdir(run.out)
    assert not list(run.out.glob(".checkpoint-*"))


def test_stock_rank0_only_save_state_hangs_and_leaves_what_latest_picks(runs):
    from accel_npu.plugins.checkpoints import state as checkpointing

    hang = runs["hang"]
    assert hang["alive_20s_after_checkpoint"], hang["run"].explain()
    out = hang["run"].out
    # the script's own choice for --resume_from_checkpoint latest
    dirs = sorted((d for d in os.listdir(out) if d.startswith("checkpoint")), key=lambda x: int(x.split("-")[1]))
    assert dirs == ["checkpoint-2"] and not list((out / "checkpoint-2").rglob("*model_states.pt"))

    class Acc:
        class project_configuration:
            automatic_checkpoint_naming = False

    with pytest.raises(checkpointing.CheckpointError) as info:
        checkpointing.resolve_load_dir(str(out / "checkpoint-2"), Acc())
    message = str(info.value)
    assert f"checkpoint {out / 'checkpoint-2'} is incomplete; missing: pytorch_model/" in message
    assert f"There is no complete checkpoint beside it in {out}" in message


def test_final_save_of_a_partitioned_unet_loads_and_equals_the_trained_weights(runs):
    import torch
    from diffusers import UNet2DConditionModel

    z3, z2 = runs["zero3_t0"]["run"], runs["zero2"]["run"]
    assert z3.proc.returncode == 0, z3.explain()
    assert z2.proc.returncode == 0, z2.explain()
    assert "does not exist. Starting a new training run" in z3.output  # --resume_from_checkpoint latest, none yet
    unet = UNet2DConditionModel.from_pretrained(z3.out, subfolder="unet")
    initial = UNet2DConditionModel.from_pretrained(runs["work"] / "model", subfolder="unet").state_dict()
    got, witness = _unet_state(z3.out), _unet_state(z2.out)
    assert set(got) == set(witness) == set(unet.state_dict())
    def diff(a, b):
        return torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in got])

    moved, apart = diff(witness, initial), diff(got, witness)
    assert (moved > 0).float().mean() > 0.9, "training changed nearly every weight"
    # ZeRO-3's saved UNet is ZeRO-2's up to bf16 rounding of differently reduced gradients: most
    # elements identical, the mean difference a small fraction of what training moved them
    assert (apart == 0).float().mean() > 0.5 and apart.mean() < moved.mean() / 10, (apart.mean(), moved.mean())
    assert all(torch.equal(got[k], v) for k, v in unet.state_dict().items() if v.dtype == got[k].dtype)


def test_fixed_script_checkpoints_resumes_from_latest_and_saves_what_deepspeed_holds(runs):
    """Item 1 with the one-line fix: train -> checkpoint every 2 steps -> final save; then
    --resume_from_checkpoint latest -> 2 more steps -> final save. Witness: DeepSpeed's own
    zero_to_fp32 of each checkpoint (the optimizer's fp32 master weights) cast to the model's bf16
    equals the UNet saved at that step: by the script's save hook inside the checkpoint
    (rank 0 alone, its ZeRO-3 gathers joined by rank 1 waiting in save_state) and by the final
    save_pretrained."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from diffusers import UNet2DConditionModel

    first, resumed = runs["fixed_zero3_t0"]["run"], runs["resumed_zero3_t0"]["run"]
    assert first.proc.returncode == 0, first.explain()
    assert resumed.proc.returncode == 0, resumed.explain()
    assert "Resuming from checkpoint checkpoint-4" in resumed.output, resumed.explain()
    out = first.out
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == \
        ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not [d for d in os.listdir(out) if d.startswith(".")]
    for step in (2, 4, 6):
        ckpt = out / f"checkpoint-{step}"
        master = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="pytorch_model")
        hooked = _unet_state(ckpt)  # written by the script's save_model_hook (rank 0 only)
        assert set(hooked) == set(master), step
        assert all(torch.equal(hooked[k], v.to(hooked[k].dtype)) for k, v in master.items()), step
        UNet2DConditionModel.from_pretrained(ckpt, subfolder="unet")
    final = _unet_state(out)  # the final pipeline.save_pretrained, after step 6
    master6 = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoint-6"), tag="pytorch_model")
    assert all(torch.equal(final[k], v.to(final[k].dtype)) for k, v in master6.items())
    master4 = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoint-4"), tag="pytorch_model")
    assert any(not torch.equal(master4[k], master6[k]) for k in master6)  # steps 5-6 trained on


def test_stock_final_save_of_a_partitioned_unet_exits_0_and_cannot_be_loaded(runs):
    from diffusers import UNet2DConditionModel

    run = runs["stock_zero3_t0"]["run"]
    assert run.proc.returncode == 0, run.explain()
    assert _unet_state(run.out)["conv_in.weight"].shape == (0,)
    with pytest.raises(Exception, match=r"conv_in.weight.*\[0\]|size mismatch|shape"):
        UNet2DConditionModel.from_pretrained(run.out, subfolder="unet")


def test_compatibility_doc_rows_for_this_script_are_true(runs):
    """docs/compatibility.md states, for this script, what the runs above show."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `train_text_to_image.py`")]
    table = {tuple(c.strip() for c in row.strip("|").split("|")[1:3]): row for row in rows}
    assert set(table) == {("cpu_zero2 / npu_zero2", "`--checkpointing_steps` < steps"),
                          ("ZeRO-3, threshold 0", "`--checkpointing_steps` < steps"),
                          ("cpu_zero2 / npu_zero2", "checkpointing off"),
                          ("ZeRO-3, threshold 0", "checkpointing off")}, table
    assert runs["misuse"]["run"].proc.returncode not in (0, None)
    assert runs["misuse_z2"]["run"].proc.returncode not in (0, None)
    assert "error within 60 s" in table[("ZeRO-3, threshold 0", "`--checkpointing_steps` < steps")]
    assert "error within 60 s" in table[("cpu_zero2 / npu_zero2", "`--checkpointing_steps` < steps")]
    assert runs["hang"]["alive_20s_after_checkpoint"]
    assert "hangs" in table[("cpu_zero2 / npu_zero2", "`--checkpointing_steps` < steps")]
    assert runs["zero3_t0"]["run"].proc.returncode == 0 and runs["stock_zero3_t0"]["run"].proc.returncode == 0
    assert "loads" in table[("ZeRO-3, threshold 0", "checkpointing off")]
    assert "shape-[0]" in table[("ZeRO-3, threshold 0", "checkpointing off")]
    assert runs["zero2"]["run"].proc.returncode == 0 and "loads" in table[("cpu_zero2 / npu_zero2", "checkpointing off")]

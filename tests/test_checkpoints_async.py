"""Asynchronous ``save_state`` under DeepSpeed ZeRO-2 / ZeRO-3 (``ACCEL_NPU_ASYNC_CHECKPOINT=1``,
plugins/checkpoints/background.py; docs/checkpoints.md § 2c).

In-process, one rank: the host snapshot (independent of the originals, written as torch.save writes them);
an asynchronous checkpoint equal to the synchronous one, file for file and tensor for tensor; save_state
returning before its files are written (the writer held) and the next checkpoint call waiting; a failed write
raised at the next call with the previous checkpoint intact.

Slow, 2 CPU ranks (tests/scripts/async_save.py): the same under ZeRO-2 and ZeRO-3 with the store protocol
(rank 0 publishes once both ranks' files are durable), a background write failing on rank 1 raised on both
ranks, a resume from the asynchronous checkpoint training on as a resume from the synchronous one, and rank 1
killed (SIGKILL) in the middle of its background write: the previous checkpoint intact and a resume from it equal.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

# --------------------------------------------------------------------------------------------
# comparing checkpoints


def _load(path: Path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def differences(a, b, where: str = "") -> list[str]:
    """Where two loaded checkpoint objects differ: tensors by dtype, shape and value (torch.equal, NaNs
    equal), containers by keys, anything else by ==."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or a.requires_grad != b.requires_grad:
            return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        same = torch.equal(a, b) or (
            a.is_floating_point() and torch.equal(torch.nan_to_num(a, nan=0.5), torch.nan_to_num(b, nan=0.5))
        )
        return [] if same else [f"{where}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            return [f"{where}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [f"{where}: arrays differ"]
    if type(a) is type(b) and type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return differences(vars(a), vars(b), f"{where}.{type(a).__name__}")  # e.g. DeepSpeed's loss scaler
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


_OURS = {"accel_npu_checkpoint.json", "latest"}


def checkpoint_differences(a: Path, b: Path, sizes: bool = True) -> list[str]:
    """Every file of two save_state directories compared: the same relative paths and sizes (the manifest's;
    ``sizes=False`` leaves them out, for archives laid out differently), each .pt / .pkl / .bin file loaded and
    compared object for object, other files byte for byte."""

    def files(root: Path) -> dict:
        return {
            str(p.relative_to(root)): p
            for p in root.rglob("*")
            if p.is_file() and "accel_npu_components" not in p.parts
        }

    fa, fb = files(a), files(b)
    out = []
    if set(fa) != set(fb):
        out.append(f"files: {sorted(set(fa) ^ set(fb))}")
    for rel in sorted(set(fa) & set(fb)):
        if rel == "accel_npu_checkpoint.json":
            ma, mb = json.loads(fa[rel].read_text()), json.loads(fb[rel].read_text())
            sa, sb = ma.pop("files"), mb.pop("files")
            if ma != mb:
                out.append(f"{rel}: {ma} != {mb}")
            out.extend(
                f"{rel}: {k}: {sa.get(k)} vs {sb.get(k)} bytes"
                for k in sorted(set(sa) | set(sb))
                if (sa.get(k) != sb.get(k) if sizes else (k in sa) != (k in sb))
            )
        elif rel.endswith((".pt", ".pkl", ".bin")):
            out.extend(differences(_load(fa[rel]), _load(fb[rel]), rel))
        elif fa[rel].read_bytes() != fb[rel].read_bytes():
            out.append(f"{rel}: bytes differ")
    return out


def _tamper_one_tensor(directory: Path) -> str:
    """Change one element of one tensor in the optimizer-states file (re-saved): what the checker must catch.
    Returns the tensor's place in the file."""
    import torch

    path = next(directory.rglob("*optim_states.pt"))
    state = _load(path)

    def first(obj, where):
        if isinstance(obj, torch.Tensor) and obj.numel() and obj.is_floating_point():
            return obj, where
        children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        for key, value in children:
            found = first(value, f"{where}/{key}" if isinstance(obj, dict) else f"{where}[{key}]")
            if found:
                return found
        return None

    tensor, where = first(state, "")
    with torch.no_grad():
        tensor.view(-1)[0] += 1
    torch.save(state, path)
    return where


# --------------------------------------------------------------------------------------------
# the snapshot


def test_snapshot_is_a_host_copy_the_originals_no_longer_reach_and_saves_as_they_do(tmp_path):
    import torch

    from accel_npu.plugins.checkpoints import background

    flat = torch.arange(12, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(3))
    state = {
        "views": [flat[:4].view(2, 2), flat[4:]],  # two views of one storage, as ZeRO's flat buffers
        "param": param,
        "grad_leaf": torch.zeros(2, requires_grad=True),
        "ints": torch.tensor([1, 2], dtype=torch.int64),
        "lists": {"lr": [0.1, 0.2]},
        "shapes": {"w": torch.Size([3, 4])},  # ZeRO-3's param_shapes: one torch.Size per parameter
    }
    state["views"][0].__dict__["note"] = "kept"  # torch.save writes a tensor's Python attributes too
    assert background.snapshot_bytes(state) == 12 * 4 + 3 * 4 + 2 * 4 + 2 * 8
    host = background.snapshot(state)
    host.fill()
    copy = host.state_dict
    torch.save(state, tmp_path / "original.pt")
    # training goes on: the originals change
    with torch.no_grad():
        flat.add_(100)
        param.add_(100)
    state["lists"]["lr"].append(0.3)
    torch.save(copy, tmp_path / "copy.pt")
    assert differences(_load(tmp_path / "original.pt"), _load(tmp_path / "copy.pt")) == []
    loaded = _load(tmp_path / "copy.pt")
    # the views still share one storage, as in the original file, and keep their kind and attributes
    assert loaded["views"][0].untyped_storage().data_ptr() == loaded["views"][1].untyped_storage().data_ptr()
    assert isinstance(loaded["param"], torch.nn.Parameter) and loaded["grad_leaf"].requires_grad
    assert loaded["views"][0].note == "kept"
    # an immutable torch.Size is shared, not rebuilt; the mutable list is a copy
    assert copy["shapes"]["w"] is state["shapes"]["w"] and copy["lists"]["lr"] is not state["lists"]["lr"]
    # negative: the checker sees the change made to the originals
    torch.save(state, tmp_path / "changed.pt")
    found = differences(_load(tmp_path / "changed.pt"), _load(tmp_path / "copy.pt"))
    assert any("views[0]" in d for d in found) and any("lists/lr" in d for d in found), found


def test_snapshot_copies_the_storages_left_for_later_when_filled_and_the_others_at_once(tmp_path):
    """``later`` storages (those only an optimizer step changes) are copied by fill(), in the background: what
    they hold then is what is written; every other storage (buffers) is copied by snapshot() itself."""
    import torch

    from accel_npu.plugins.checkpoints import background

    partition = torch.arange(6, dtype=torch.float32)  # an fp32 partition: changed only by the step
    buffer = torch.zeros(3)  # a buffer: a forward changes it in place (BatchNorm's running statistics)
    state = {"partition": partition[1:], "buffer": buffer}
    host = background.snapshot(state, later={background.storage_key(partition.untyped_storage())})
    with torch.no_grad():
        buffer.add_(1)  # the next forward, before the copy is filled
    assert torch.equal(host.state_dict["buffer"], torch.zeros(3))  # copied at once
    host.fill()
    assert torch.equal(host.state_dict["partition"], torch.arange(1, 6, dtype=torch.float32))
    with torch.no_grad():
        partition.add_(100)  # the step, after the fill
    assert torch.equal(host.state_dict["partition"], torch.arange(1, 6, dtype=torch.float32))
    # negative: a change made to a later storage before the fill reaches the copy (what the step's wait prevents)
    host = background.snapshot(state, later={background.storage_key(partition.untyped_storage())})
    with torch.no_grad():
        partition.add_(1)
    host.fill()
    assert torch.equal(host.state_dict["partition"], partition[1:])
    assert host.state_dict["partition"].untyped_storage().data_ptr() != partition.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------------
# in-process, one rank


def _nice(tid: int) -> int:
    """A thread's nice value as the kernel reports it (/proc/self/task/TID/stat, field 19)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def test_nice_reads_the_kernels_value_of_one_thread():
    """The reader of _nice, against os.getpriority on a thread whose nice value was changed alone."""
    seen = {}

    def lowered():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 7)
        seen["lowered"] = (_nice(tid), os.getpriority(os.PRIO_PROCESS, tid))

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen["lowered"] == (7, 7)
    assert _nice(threading.get_native_id()) == os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 7


@pytest.fixture()
def trained(monkeypatch, request):
    """An Accelerator over a tiny MLP under DeepSpeed ZeRO-``request.param`` (one rank), one step taken."""
    from tests.launch_utils import accelerator_deepspeed_session

    with accelerator_deepspeed_session(monkeypatch):
        import torch
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, set_seed

        config = {
            "zero_optimization": {"stage": request.param, "stage3_param_persistence_threshold": 0},
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 1,
        }
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=False))
        set_seed(0)
        # BatchNorm: buffers a forward changes in place (its running statistics)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 2))
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

        def step():
            x, y = next(iter(loader))
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

        step()
        yield accelerator, step
        from accel_npu.plugins.checkpoints import background

        background.wait_for_pending(raise_failure=False)


@pytest.mark.parametrize("trained", [2, 3], indirect=True, ids=["zero2", "zero3"])
def test_async_save_state_equals_the_synchronous_one_and_returns_before_its_files_are_written(
    trained, tmp_path, monkeypatch
):
    from accel_npu.plugins.checkpoints import background

    accelerator, step = trained
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "0")
    accelerator.save_state(tmp_path / "sync")
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "1")
    release = threading.Event()
    written = []
    original = background.write_file

    def held_write(obj, path, zipfile):
        assert release.wait(60), "the test never released the writer"
        original(obj, path, zipfile)
        written.append(os.path.basename(path))

    monkeypatch.setattr(background, "write_file", held_write)
    accelerator.save_state(tmp_path / "async")
    # returned with the writer held: nothing of DeepSpeed's written, nothing published
    assert not (tmp_path / "async").exists() and written == []
    partial = tmp_path / ".async.accel-npu-partial"
    assert partial.is_dir() and (partial / "random_states_0.pkl").is_file()  # accelerate's own: synchronous
    # training goes on while the files are pending: the snapshot holds the state as saved
    step()
    writer = background._writer.native_id
    assert _nice(writer) == background._WRITER_NICE == 19, "the writer yields the CPU to training while it runs"
    waiter = threading.Thread(target=background.wait_for_pending)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive(), "the next checkpoint call must wait for the pending write"
    if os.geteuid() == 0:  # raising a nice value back needs root or CAP_SYS_NICE
        assert _nice(writer) == 0, "training waits for the writer: its priority is restored"
    release.set()
    waiter.join(60)
    assert (tmp_path / "async").is_dir() and not partial.exists() and written
    assert checkpoint_differences(tmp_path / "sync", tmp_path / "async") == []
    # negative: one tensor changed in a copy of the synchronous checkpoint is reported
    import shutil

    shutil.copytree(tmp_path / "sync", tmp_path / "tampered")
    key = _tamper_one_tensor(tmp_path / "tampered")
    found = checkpoint_differences(tmp_path / "sync", tmp_path / "tampered")
    assert len(found) == 1 and key in found[0] and "values differ" in found[0], found


@pytest.mark.parametrize("trained", [2, 3], indirect=True, ids=["zero2", "zero3"])
def test_an_async_checkpoint_written_past_the_page_cache_loads_as_the_synchronous_one(trained, tmp_path, monkeypatch):
    """Every DeepSpeed file written with O_DIRECT (direct_io.py; the tiny model's files are below the size
    where it is chosen, so the choice is forced): the checkpoint loads tensor for tensor as the synchronous one,
    its manifest gives the files' real sizes, and its archives are the page-aligned ones."""
    from accel_npu.plugins.checkpoints import background, direct_io
    from tests.test_checkpoints_direct_io import data_offsets

    if not direct_io.supported():
        pytest.skip("no O_DIRECT, or a torch before 2.6")
    accelerator, _ = trained
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "0")
    accelerator.save_state(tmp_path / "sync")
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "1")
    monkeypatch.setattr(direct_io, "worth_it", lambda nbytes, storages: True)
    accelerator.save_state(tmp_path / "async")
    background.wait_for_pending()
    assert checkpoint_differences(tmp_path / "sync", tmp_path / "async", sizes=False) == []
    manifest = json.loads((tmp_path / "async" / "accel_npu_checkpoint.json").read_text())["files"]
    assert manifest and all((tmp_path / "async" / rel).stat().st_size == size for rel, size in manifest.items())
    archives = sorted((tmp_path / "async").rglob("*_states.pt"))
    assert archives, "no DeepSpeed archive found"
    for path in archives:
        offsets = data_offsets(path)
        assert offsets and all(o % direct_io.ALIGN == 0 for o in offsets), f"{path.name}: {offsets}"
    # the witness can fail: the synchronous archives (torch.save's 64-byte alignment) are not on pages
    synced = sorted((tmp_path / "sync").rglob("*_states.pt"))
    assert any(o % direct_io.ALIGN for p in synced for o in data_offsets(p))


def _blocked(call, seconds: float = 0.5):
    """Run ``call`` on a thread; (whether it was still running after ``seconds``, the thread, its result box)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(call()))
    thread.start()
    thread.join(seconds)
    return thread.is_alive(), thread, box


def _assert_a_forked_child_does_not_wait(folder: Path) -> None:
    """A process forked while a save is pending (a DataLoader worker) has no writer thread: its read of the
    checkpoint's folder and its exit (which runs the exit hook) return at once instead of waiting forever."""
    import signal

    pid = os.fork()
    if pid == 0:  # the child: a listing the parent would wait on, then the exit hook a normal exit runs
        from accel_npu.plugins.checkpoints import background

        code = 3
        try:
            code = 0 if "elsewhere" in os.listdir(folder) else 4
            background.at_exit()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, status
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("a forked child waited for its parent's pending checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("trained", [2], indirect=True, ids=["zero2"])
def test_a_process_forked_while_a_save_is_pending_never_waits_for_it(trained, tmp_path, monkeypatch):
    from accel_npu.plugins.checkpoints import background

    accelerator, _ = trained
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "1")
    (tmp_path / "elsewhere").mkdir()
    release = threading.Event()
    original = background.write_file

    def held_write(obj, path, zipfile):
        assert release.wait(60), "the test never released the writer"
        original(obj, path, zipfile)

    monkeypatch.setattr(background, "write_file", held_write)
    accelerator.save_state(tmp_path / "ckpt")
    try:
        waiting, thread, _ = _blocked(lambda: os.listdir(tmp_path))
        assert waiting, "the parent's own listing waits (the witness that the child's would, unguarded)"
        _assert_a_forked_child_does_not_wait(tmp_path)
    finally:
        release.set()
    thread.join(60)
    assert (tmp_path / "ckpt").is_dir()


@pytest.mark.parametrize("trained", [2], indirect=True, ids=["zero2"])
def test_reading_a_pending_checkpoint_or_waiting_for_everyone_waits_for_its_publication(trained, tmp_path, monkeypatch):
    """A launched rank saves in the background by default (the fixture stands in for one: LOCAL_RANK is set). A
    script reading what it just saved (a file inside, a listing of it or of the folder holding it, as diffusers'
    checkpoints_total_limit pruning lists output_dir) or calling wait_for_everyone waits for the publication and
    finds what a synchronous save_state leaves; reads elsewhere do not wait (the negative)."""
    from accel_npu.plugins.checkpoints import background

    accelerator, _ = trained
    monkeypatch.delenv("ACCEL_NPU_ASYNC_CHECKPOINT", raising=False)
    assert background.enabled(), "a launched rank's default"
    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    assert not background.enabled(), "a plain process (a notebook, a test) saves synchronously by default"
    monkeypatch.setenv("LOCAL_RANK", "0")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "note.txt").write_text("x")
    original = background.write_file
    states = tmp_path / "ckpt" / "pytorch_model" / "mp_rank_00_model_states.pt"
    reads = {  # what each read finds once it returns: what a synchronous save_state would have left
        "listing the folder holding it": (lambda: os.listdir(tmp_path), lambda found: "ckpt" in found),
        "listing it": (lambda: os.listdir(tmp_path / "ckpt"), lambda found: "pytorch_model" in found),
        "opening a file in it": (lambda: states.open("rb").read(2), lambda found: found == b"PK"),
        "wait_for_everyone": (lambda: accelerator.wait_for_everyone(), lambda found: states.is_file()),
    }
    for what, (read, check) in reads.items():
        release = threading.Event()

        def held_write(obj, path, zipfile, release=release):
            assert release.wait(60), "the test never released the writer"
            original(obj, path, zipfile)

        monkeypatch.setattr(background, "write_file", held_write)
        if (tmp_path / "ckpt").exists():
            import shutil

            shutil.rmtree(tmp_path / "ckpt")
        accelerator.save_state(tmp_path / "ckpt")
        assert not (tmp_path / "ckpt").exists(), "returned before its files are written"
        # negative: reading anything else does not wait
        assert os.listdir(tmp_path / "elsewhere") == ["note.txt"]
        assert (tmp_path / "elsewhere" / "note.txt").read_text() == "x"
        waiting, thread, box = _blocked(read)
        assert waiting, f"{what}: must wait for the pending checkpoint's publication"
        release.set()
        thread.join(60)
        assert box and check(box[0]), (what, box)


@pytest.mark.parametrize("trained", [2, 3], indirect=True, ids=["zero2", "zero3"])
def test_the_step_after_an_async_save_state_waits_for_its_copy_and_the_checkpoint_holds_the_state_as_saved(
    trained, tmp_path, monkeypatch
):
    """The host copy of the parameters and optimizer states is made by the writer thread after save_state
    returns; the next step (DeepSpeedEngine.step, which updates them in place) waits for it, and the forward
    before it (which changes BatchNorm's running statistics in place) finds the buffers copied already. The
    checkpoint equals a synchronous one saved at the same state, bit for bit. Negative: without the step's wait,
    or with the buffers left for later, the checkpoint holds the state after the step, and differs."""
    from accel_npu.plugins.checkpoints import background

    accelerator, step = trained
    release = threading.Event()
    fill = background.HostCopy.fill

    def held_fill(self):
        assert release.wait(60), "the test never released the copy"
        fill(self)

    monkeypatch.setattr(background.HostCopy, "fill", held_fill)

    def save_async_then_step(name: str, step_waits: bool) -> None:
        accelerator.save_state(tmp_path / f"{name}_sync")
        monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "1")
        release.clear()
        accelerator.save_state(tmp_path / name)
        monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "0")
        stepping = threading.Thread(target=step)
        stepping.start()
        stepping.join(1.0)
        assert stepping.is_alive() == step_waits, "the step must wait for the copy, and only for it"
        release.set()
        stepping.join(60)
        assert not stepping.is_alive()
        background.wait_for_pending()

    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "0")
    save_async_then_step("async", step_waits=True)
    assert checkpoint_differences(tmp_path / "async_sync", tmp_path / "async") == []
    accelerator.save_state(tmp_path / "after_step")
    stepped = checkpoint_differences(tmp_path / "async", tmp_path / "after_step")
    assert any("optim_states" in d for d in stepped), "the step must have changed the optimizer states"
    assert any("running_mean" in d for d in stepped), "the forward must have changed the running statistics"

    # negative: the step does not wait; the copy is filled after it changed the state
    wait_for_snapshot = background.wait_for_snapshot
    monkeypatch.setattr(background, "wait_for_snapshot", lambda: None)
    save_async_then_step("unwaited", step_waits=False)
    found = checkpoint_differences(tmp_path / "unwaited_sync", tmp_path / "unwaited")
    assert any("optim_states" in d and "values differ" in d for d in found), found
    monkeypatch.setattr(background, "wait_for_snapshot", wait_for_snapshot)

    # negative: the buffers left for the writer too; the forward's change reaches the checkpoint
    changed_only_by_step = background.changed_only_by_step

    def with_buffers(module, optimizer):
        buffers = {background.storage_key(b.untyped_storage()) for b in module.buffers()}
        return changed_only_by_step(module, optimizer) | buffers

    monkeypatch.setattr(background, "changed_only_by_step", with_buffers)
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "0")
    save_async_then_step("buffers_later", step_waits=True)
    found = checkpoint_differences(tmp_path / "buffers_later_sync", tmp_path / "buffers_later")
    assert found and all("running_mean" in d or "running_var" in d or "num_batches" in d for d in found), found


@pytest.mark.parametrize("trained", [2], indirect=True, ids=["zero2"])
def test_a_failed_background_write_is_raised_at_the_next_checkpoint_call_and_the_previous_checkpoint_is_intact(
    trained, tmp_path, monkeypatch
):
    from accel_npu.errors import CheckpointError
    from accel_npu.plugins.checkpoints import background

    accelerator, step = trained
    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT", "1")
    target = tmp_path / "ckpt"
    accelerator.save_state(target)
    background.wait_for_pending()
    before = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    original = background.write_file

    def failing_write(obj, path, zipfile):
        if "optim_states" in path:
            raise OSError(28, "No space left on device (injected)")
        original(obj, path, zipfile)

    monkeypatch.setattr(background, "write_file", failing_write)
    step()
    accelerator.save_state(target)  # returns: the failure comes from the writer thread
    with pytest.raises(CheckpointError, match=r"No space left on device \(injected\).*checkpoint that was there"):
        accelerator.save_state(tmp_path / "next")
    monkeypatch.setattr(background, "write_file", original)
    after = {str(p.relative_to(target)): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert after == before
    assert not (tmp_path / "next").exists()
    # raised once: the call after it saves
    accelerator.save_state(tmp_path / "next")
    background.wait_for_pending()
    assert (tmp_path / "next" / "accel_npu_checkpoint.json").is_file()


# --------------------------------------------------------------------------------------------
# 2 CPU ranks


def _launch(tmp_path: Path, stage: int, mode: str, out: Path):
    from tests.launch_utils import SCRIPTS, accelerate_launch, base_env, write_deepspeed_config, zero_config

    cfg = write_deepspeed_config(tmp_path / f"zero{stage}", zero_config(stage))
    return lambda: accelerate_launch(
        ["--config_file", str(cfg), str(SCRIPTS / "async_save.py"), mode, str(out)], env=base_env(), timeout=300
    )


@pytest.mark.slow
def test_two_ranks_async_save_state_equals_sync_resumes_alike_and_a_failed_write_is_raised_on_every_rank(tmp_path):
    """ZeRO-2 and ZeRO-3, one launch each (tests/scripts/async_save.py main): the asynchronous checkpoint
    equals the synchronous one file for file and tensor for tensor (both ranks' shards and RNG states), although
    the step after save_state ran before the copy was made (a second late: the step waited for it); with the
    writer slowed it is not published when save_state returns and is when the next save_state returns;
    resuming from either trains on with the same losses; a background write failing on rank 1 is raised at the
    next save_state on both ranks, and the checkpoint it was overwriting is intact (still equal to the
    synchronous one); wait_for_everyone after a last save returns with it published, without a stall.
    Negatives: one changed tensor is reported; without the step's wait the checkpoint holds the state after the
    step."""
    import shutil

    from tests.launch_utils import explain, results, run_concurrently

    outs = {stage: tmp_path / f"out{stage}" for stage in (2, 3)}
    procs = run_concurrently(*(_launch(tmp_path, stage, "main", out) for stage, out in outs.items()))
    for (stage, out), proc in zip(outs.items(), procs):
        assert proc.returncode == 0, explain(proc)
        ranks = results(proc)
        assert [r["rank"] for r in ranks] == [0, 1], explain(proc)
        for r in ranks:
            assert r["published_at_return"] is False and r["published_when_next_returned"] is True, (stage, r)
            assert r["step_after_save_s"] >= 0.9 > r["unwaited_step_s"], (stage, r)  # the step waited for the copy
            assert r["losses_sync"] == r["losses_async"], (stage, r)
            assert r["error"] == "CheckpointError", (stage, r)
            assert "rank 1" in r["message"] and "injected by the test" in r["message"], r["message"]
            assert "checkpoint that was there before is intact" in r["message"]
            # a barrier after the last save: published once it returns, in about the write's time (the main
            # thread's store waits held the writer's "done" up to 60 s at a time when both shared one client)
            assert r["published_after_barrier"] is True and r["barrier_s"] < 20, (stage, r)
        shards = {p.name for p in (out / "async" / "pytorch_model").iterdir()}
        assert any("rank_1" in n for n in shards) and (out / "async" / "random_states_1.pkl").is_file(), shards
        assert checkpoint_differences(out / "sync", out / "async") == [], stage
        # negative: without the step's wait the late copy holds the state after the step
        unwaited = checkpoint_differences(out / "unwaited_sync", out / "unwaited")
        assert any("optim_states" in d and "values differ" in d for d in unwaited), (stage, unwaited)
        assert not (out / "after_failure").exists()
        assert "host copy of its state" in proc.stdout + proc.stderr  # the snapshot's size, said once per rank
    shutil.copytree(outs[3] / "sync", tmp_path / "tampered")
    where = _tamper_one_tensor(tmp_path / "tampered")
    found = checkpoint_differences(outs[3] / "sync", tmp_path / "tampered")
    assert len(found) == 1 and where in found[0] and "values differ" in found[0], found


@pytest.mark.slow
def test_a_rank_killed_during_its_background_write_leaves_the_previous_checkpoint_which_resumes_equal(tmp_path):
    """ZeRO-2 (tests/scripts/async_save.py kill): rank 1 truncates its first file and SIGKILLs itself in
    the background write of the second save_state into the same directory. The directory still holds the
    first (published) checkpoint, equal to the synchronous reference saved at the same step; a new launch
    resuming from it trains on with the reference's losses."""
    from tests.launch_utils import explain, results

    out = tmp_path / "out"
    killed = _launch(tmp_path, 2, "kill", out)()
    assert killed.returncode != 0, explain(killed)
    # rank 1 died after its save_state returned (rank 0's line may lose the race with the launcher's SIGTERM)
    assert 1 in [r["rank"] for r in results(killed) if r.get("returned")], explain(killed)
    assert "exitcode  : -9" in killed.stdout + killed.stderr, explain(killed)
    assert (out / ".ckpt.accel-npu-partial").is_dir(), "the killed save stays hidden"
    assert checkpoint_differences(out / "reference", out / "ckpt") == []
    resumed = _launch(tmp_path, 2, "resume", out)()
    assert resumed.returncode == 0, explain(resumed)
    for r in results(resumed):
        assert r["losses_ckpt"] == r["losses_reference"], r


# --------------------------------------------------------------------------------------------
# FSDP2, 2 CPU ranks


def _dcp_tensors(directory: Path):
    """A torch.distributed.checkpoint folder read back whole, offline (torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent.parent / f"{directory.parent.name}_{directory.name}.pt"
    dcp_to_torch_save(str(directory), str(target))
    return _load(target)


def fsdp_checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Two FSDP2 save_state directories compared: the same files (our manifest aside); each DCP folder
    (``pytorch_model_fsdp_<i>``, ``optimizer_<i>``) read whole and compared tensor for tensor, each .pkl/.bin/.pt
    file object for object, other files byte for byte."""

    def files(root: Path) -> dict:
        return {str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file() and p.name not in _OURS}

    fa, fb = files(a), files(b)
    out = [f"files: {sorted(set(fa) ^ set(fb))}"] if set(fa) != set(fb) else []
    folders = {Path(rel).parts[0] for rel in fa if rel.endswith(".distcp")}
    for folder in sorted(folders):
        out.extend(differences(_dcp_tensors(a / folder), _dcp_tensors(b / folder), folder))
    for rel in sorted(set(fa) & set(fb)):
        if Path(rel).parts[0] in folders:
            continue
        if rel.endswith((".pt", ".pkl", ".bin")):
            out.extend(differences(_load(fa[rel]), _load(fb[rel]), rel))
        elif fa[rel].read_bytes() != fb[rel].read_bytes():
            out.append(f"{rel}: bytes differ")
    return out


@pytest.mark.slow
def test_fsdp2_async_save_state_equals_sync_resumes_alike_and_a_failed_write_is_raised_on_every_rank(tmp_path):
    """FSDP2, SHARDED_STATE_DICT, one launch (tests/scripts/async_save.py main): the shards copied after
    save_state returned and written by the background writer's dcp.save (its files past the page cache) equal the
    synchronous checkpoint tensor for tensor (model and optimizer, read whole from the DCP files), and the other
    files object for object, although training stepped on while they were written (its optimizer step before the
    copy was made, a second late: the step waited for it); with the writer slowed the checkpoint is not published
    when save_state returns and is when the next save_state returns; resuming from either trains on with the same
    losses; a write failing on rank 1 is raised at the next save_state on both ranks. Negatives: one changed
    tensor is reported; without the optimizer step's wait the checkpoint holds the state after the step."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp
    import yaml

    from tests.launch_utils import FSDP2_CPU_CONFIG, SCRIPTS, accelerate_launch, base_env, explain, results

    cfg = tmp_path / "fsdp2.yaml"
    cfg.write_text(yaml.safe_dump(FSDP2_CPU_CONFIG))
    out = tmp_path / "out"
    proc = accelerate_launch(
        ["--config_file", str(cfg), str(SCRIPTS / "async_save.py"), "main", str(out)], env=base_env(), timeout=300
    )
    assert proc.returncode == 0, explain(proc)
    ranks = results(proc)
    assert [r["rank"] for r in ranks] == [0, 1], explain(proc)
    for r in ranks:
        assert r["published_at_return"] is False and r["published_when_next_returned"] is True, r
        assert r["step_after_save_s"] >= 0.9 > r["unwaited_step_s"], r  # the optimizer step waited for the copy
        assert r["losses_sync"] == r["losses_async"], r
        assert r["error"] == "CheckpointError", r
        assert "rank 1" in r["message"] and "injected by the test" in r["message"], r["message"]
        assert "checkpoint that was there before is intact" in r["message"]
        # the writer's shard files never went through the page cache (direct_io.dcp_writer; the script lowers
        # its size bound for the tiny model); the synchronous save's did, which is what makes the check able to fail
        assert len(r["resident_async"]) == 2 and all(cached <= 1 for cached, _ in r["resident_async"]), r
        assert all(cached == pages for cached, pages in r["resident_sync"]), r
    names = {p.relative_to(out / "async").as_posix() for p in (out / "async").rglob("*")}
    assert {"pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata", "random_states_1.pkl"} <= names, names
    assert fsdp_checkpoint_differences(out / "sync", out / "async") == []
    # negative: without the optimizer step's wait the late copy holds the state after the step
    unwaited = fsdp_checkpoint_differences(out / "unwaited_sync", out / "unwaited")
    assert any(d.startswith("optimizer_0") and "values differ" in d for d in unwaited), unwaited
    assert not (out / "after_failure").exists()
    assert "host copy of its state" in proc.stdout + proc.stderr
    # negative: one element of one optimizer tensor changed, written back as a DCP checkpoint (by one process:
    # one .distcp file where the ranks wrote two, which the file comparison reports too)
    shutil.copytree(out / "sync", tmp_path / "tampered")
    folder = tmp_path / "tampered" / "optimizer_0"
    state = _dcp_tensors(folder)
    tensor = next(t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor) and t.numel() > 1)
    with torch.no_grad():
        tensor.view(-1)[0] += 1
    shutil.rmtree(folder)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    found = [f for f in fsdp_checkpoint_differences(out / "sync", tmp_path / "tampered") if not f.startswith("files")]
    assert len(found) == 1 and found[0].startswith("optimizer_0/") and "values differ" in found[0], found


@pytest.mark.slow
def test_fsdp2_rank_killed_during_its_background_write_leaves_the_previous_checkpoint_which_resumes_equal(tmp_path):
    """FSDP2 (tests/scripts/async_save.py kill): rank 1 SIGKILLs itself in the background write of the second
    save_state into the same directory, after writing its shard. The directory still holds the first (published)
    checkpoint, equal to the synchronous reference saved at the same step; a new launch resuming from it trains
    on with the reference's losses."""
    import yaml

    from tests.launch_utils import FSDP2_CPU_CONFIG, SCRIPTS, accelerate_launch, base_env, explain, results

    cfg = tmp_path / "fsdp2.yaml"
    cfg.write_text(yaml.safe_dump(FSDP2_CPU_CONFIG))
    out = tmp_path / "out"

    def launch(mode):
        args = ["--config_file", str(cfg), str(SCRIPTS / "async_save.py"), mode, str(out)]
        return accelerate_launch(args, env=base_env(), timeout=300)

    killed = launch("kill")
    assert killed.returncode != 0, explain(killed)
    assert 1 in [r["rank"] for r in results(killed) if r.get("returned")], explain(killed)
    assert "exitcode  : -9" in killed.stdout + killed.stderr, explain(killed)
    assert (out / ".ckpt.accel-npu-partial").is_dir(), "the killed save stays hidden"
    assert fsdp_checkpoint_differences(out / "reference", out / "ckpt") == []
    resumed = launch("resume")
    assert resumed.returncode == 0, explain(resumed)
    for r in results(resumed):
        assert r["losses_ckpt"] == r["losses_reference"], r


def test_a_rank_that_never_finishes_its_background_write_is_named_and_nothing_is_published(tmp_path, monkeypatch):
    """Rank 0 waits for the other ranks' word at most ACCEL_NPU_ASYNC_CHECKPOINT_TIMEOUT: rank 1 of a HashStore
    never says its files are durable; the checkpoint is not published and the outcome names rank 1. Every rank's
    wait for that outcome is bounded too."""
    from torch.distributed import HashStore

    from accel_npu.plugins.checkpoints import background

    monkeypatch.setenv("ACCEL_NPU_ASYNC_CHECKPOINT_TIMEOUT", "1")
    store = HashStore()
    staging = tmp_path / "checkpoint-2.tmp"
    staging.mkdir()
    save = background.PendingSave(7, str(staging), str(tmp_path / "checkpoint-2"), store, rank=0, world=2)
    published = []
    start = time.monotonic()
    background._finish(save, lambda: published.append(True))
    assert time.monotonic() - start < 10
    assert not published
    assert save.outcome.startswith("rank 1: its files were not durable after 1 s")
    assert store.get(save.key("outcome")).decode() == save.outcome

    assert background._wait_keys(store, [save.key("outcome")], 1) == []  # there: nothing missing
    assert background._wait_keys(store, ["never-set"], 1) == ["never-set"]


@pytest.mark.parametrize("clone", [True, False], ids=["Store.clone", "a new TCPStore connection"])
def test_the_saves_own_store_client_is_not_held_by_another_threads_wait(clone, monkeypatch):
    """accel_npu._torch.dist.own_client: a request on it completes while another thread waits on the default
    store's client, and sees the same keys as every rank's own client; with the shared client the same request
    waits the other thread's wait out (the witness's negative). Without ``Store.clone`` (torch 2.5), a new
    connection under a prefix rank 0 draws."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from accel_npu._torch import dist as _dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    default = dist.PrefixStore("default_pg", dist.PrefixStore("/worker/attempt_0", server))
    if not clone:
        monkeypatch.delattr(dist.Store, "clone", raising=False)
        assert getattr(default, "clone", None) is None
    own = _dist.own_client(default, rank=0)
    other = _dist.own_client(default, rank=1)  # another rank's, made from the same default store
    assert own is not default

    def set_while_waiting(store) -> float:
        waiting = threading.Thread(target=_dist.store_wait, args=(default, ["never"], 3.0))
        waiting.start()
        time.sleep(0.3)
        started = time.monotonic()
        store.set("done/0", "ok")
        took = time.monotonic() - started
        waiting.join()
        return took

    assert set_while_waiting(own) < 1.0
    assert _dist.store_get(other, "done/0") == "ok"
    assert set_while_waiting(default) > 2.0, "the shared client's request did not wait: the witness cannot fail"

"""Background checkpoint files written past the page cache (plugins/checkpoints/direct_io.py; docs/checkpoints.md
§ 2c): the same torch.save archive (tensors, objects, CRC-32) and the same torch.distributed.checkpoint files
whoever reads them, their pages never cached on the way (read back with mincore(2), the kernel's own account), and
a filesystem refusing O_DIRECT written through the page cache from where it refused, the file whole."""

from __future__ import annotations

import errno
import os
import zipfile

import pytest

torch = pytest.importorskip("torch")

from accel_npu.plugins.checkpoints import background, direct_io  # noqa: E402 - after torch's importorskip
from tests.page_cache import drop_from_cache, resident_pages  # noqa: E402 - after torch's importorskip

pytestmark = pytest.mark.skipif(not direct_io.supported(), reason="no O_DIRECT, or a torch before 2.6")


def data_offsets(path) -> list[int]:
    """Where each storage record's bytes begin: after its local header (30 bytes, then the name and the extra
    field, whose lengths the local header gives at bytes 26 and 28)."""
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        out = []
        for info in archive.infolist():
            if "/data/" in info.filename:
                f.seek(info.header_offset)
                header = f.read(30)
                out.append(
                    info.header_offset
                    + 30
                    + int.from_bytes(header[26:28], "little")
                    + int.from_bytes(header[28:30], "little")
                )
        return out


def _state():
    """A state dict as DeepSpeed saves one: page-aligned host copies (flat partitions, odd sizes), a view at an
    offset, a shared storage, small and ordinary tensors, plain objects."""
    flat = torch.empty(0).set_(direct_io.host_storage(4 * 1_000_003), 0, (1_000_003,), (1,)).normal_()
    exp_avg = torch.empty(0).set_(direct_io.host_storage(4 * 262_144), 0, (262_144,), (1,)).uniform_()
    return {
        "flat": flat,
        "view": flat[17:5017].view(50, 100),  # the same storage: written once
        "exp_avg": exp_avg,
        "ordinary": torch.randn(3000, 7),  # an allocator's address: through the staging buffer
        "small": torch.arange(5, dtype=torch.int64),
        "bf16": torch.randn(4097, dtype=torch.bfloat16),
        "objects": {"step": 7, "lr": [1e-4, 2e-4], "name": "zero_pp_rank_0"},
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def test_a_direct_archive_loads_as_torch_save_wrote_it_keeps_its_crc_and_never_fills_the_page_cache(tmp_path):
    state = _state()
    direct, buffered = tmp_path / "direct.pt", tmp_path / "buffered.pt"
    assert direct_io.save(state, str(direct))
    torch.save(state, buffered)
    # the kernel's account: the direct file's pages never went through the page cache (at most its tail did);
    # the buffered one's did, which is what makes this check able to fail
    cached, pages = resident_pages(direct)
    assert cached <= 2, f"{cached} of {pages} pages of the O_DIRECT archive are in the page cache"
    cached, pages = resident_pages(buffered)
    assert cached > pages // 2, f"the witness sees no cached pages after a buffered write ({cached} of {pages})"
    for path in (direct, buffered):
        back = torch.load(path, weights_only=False)
        assert _equal(back, state), path
        assert back["view"].untyped_storage().data_ptr() == back["flat"].untyped_storage().data_ptr()
        assert zipfile.ZipFile(path).testzip() is None, f"{path}: a record's CRC-32 does not match its bytes"
    # mmap loads (consolidation, resume) read it by the offsets it records, every storage on a page
    back = torch.load(direct, mmap=True, weights_only=False)
    assert _equal(back, state)
    offsets = data_offsets(direct)
    assert offsets and all(offset % direct_io.ALIGN == 0 for offset in offsets), offsets
    drop_from_cache(buffered)


def test_writes_go_from_the_host_copy_itself_where_it_is_on_a_page(tmp_path):
    state = _state()
    out = direct_io.DirectFile(str(tmp_path / "f.pt"))
    direct_io._torch_save(state, out)
    out.close()
    # the host copies are on pages; an allocator's tensor may land on one by chance, and is then written so too
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in background.tensors_of(state)}
    assert state["flat"].data_ptr() % direct_io.ALIGN == 0 and state["exp_avg"].data_ptr() % direct_io.ALIGN == 0
    aligned = sum(n - n % direct_io.ALIGN for ptr, n in storages.items() if ptr % direct_io.ALIGN == 0)
    assert out.direct_bytes == aligned, "the page-aligned copies should reach the file without a staging copy"
    assert _equal(torch.load(tmp_path / "f.pt", weights_only=False), state)


def test_a_filesystem_refusing_o_direct_gets_the_whole_file_through_the_page_cache(tmp_path, monkeypatch):
    state = _state()
    real_open, real_pwrite = os.open, os.pwrite

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            real_open(path, flags & ~os.O_DIRECT, *args)  # some kernels create the file before refusing
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io, "_refused", False)
    monkeypatch.setattr(os, "open", refusing_open)
    assert direct_io.save(state, str(tmp_path / "refused.pt")) is False, "said to be past the cache"
    assert _equal(torch.load(tmp_path / "refused.pt", weights_only=False), state)
    assert direct_io.refused(), "the process's later files go buffered at once"
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(direct_io, "MIN_BYTES", 0)  # this small state is written past the cache where it can be
    background.write_file(state, str(tmp_path / "later.pt"), True)
    assert _equal(torch.load(tmp_path / "later.pt", weights_only=False), state)
    cached, pages = resident_pages(tmp_path / "later.pt")
    assert cached > pages // 2, "a later file was written with O_DIRECT after the filesystem refused it"

    # refused at a write instead (a filesystem that takes the flag but not the alignment): the bytes written so
    # far stay, the rest follows through the page cache
    monkeypatch.setattr(direct_io, "_refused", False)
    writes = []

    def refusing_second_pwrite(fd, data, offset):
        writes.append(offset)
        if len(writes) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing_second_pwrite)
    assert direct_io.save(state, str(tmp_path / "midway.pt")) is False
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert writes[0] == 0 and len(writes) > 3, writes
    assert _equal(torch.load(tmp_path / "midway.pt", weights_only=False), state)
    assert zipfile.ZipFile(tmp_path / "midway.pt").testzip() is None

    # any other error is the save's: raised, the file left for the caller's partial directory
    monkeypatch.setattr(direct_io, "_refused", False)

    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space"):
        direct_io.save(state, str(tmp_path / "full.pt"))


def test_dcp_shards_written_past_the_page_cache_load_as_dcp_wrote_them(tmp_path):
    """FSDP2's files: torch.distributed.checkpoint's own FileSystemWriter and dcp_writer's save the same state;
    dcp.load reads both alike, and only the latter's data file stayed out of the page cache."""
    import torch.distributed.checkpoint as dcp

    state = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor) and k != "view"}
    state["step"] = torch.tensor(7)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock"), sync_files=True))
    dcp.save(state, storage_writer=direct_io.dcp_writer(str(tmp_path / "direct"), direct_io.MIN_BYTES))
    (stock,) = (tmp_path / "stock").glob("*.distcp")
    (direct,) = (tmp_path / "direct").glob("*.distcp")
    assert direct.stat().st_size == stock.stat().st_size
    # before anything reads them back (a read fills the cache)
    cached, pages = resident_pages(direct)
    assert cached <= 2, f"{cached} of {pages} pages of the O_DIRECT shard file are in the page cache"
    cached, pages = resident_pages(stock)
    assert cached > pages // 2, f"the witness sees no cached pages after DCP's buffered write ({cached} of {pages})"
    for name in ("stock", "direct"):
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, checkpoint_id=str(tmp_path / name))
        assert _equal(back, state), name
    drop_from_cache(stock)
    drop_from_cache(direct)
    # below the size, or once a filesystem refused O_DIRECT: DCP's own writer
    assert type(direct_io.dcp_writer(str(tmp_path / "small"), direct_io.MIN_BYTES - 1).fs).__name__ == "FileSystem"


def test_only_archives_large_enough_and_of_large_records_are_written_past_the_page_cache():
    assert direct_io.worth_it(2 << 30, 3)  # a ZeRO partition and its two moments
    assert not direct_io.worth_it(direct_io.MIN_BYTES - 1, 1)  # small: its page-cache copy costs milliseconds
    # a model-states file of many small tensors: a page of padding per record would grow it past 1 %
    assert not direct_io.worth_it(64 << 20, 1000)
    assert direct_io.worth_it(64 << 20, 100)

"""Table files on a real disk (the storage under the disk placement): the layout, exact rows back through whole
pages (O_DIRECT where the filesystem allows it), a cold open that reads no data, and every way a file can be
wrong named."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import bits

from uvaple.uva import HostTable
from uvaple.uva import table_file as tf
from uvaple.uva.loading import locate_tensor
from uvaple.uva.table_file import PAGE, FileLayout, TableFile, TableFileError, write_table_file


def rand_rows(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and dtype.itemsize > 1:
        return (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    return torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("rows,cols,dtype,per,pages", [
    (1000, 160, torch.bfloat16, 12, 0),  # a Qwen4Exp n-gram row: 320 bytes, 12 a page
    (999, 164, torch.float8_e4m3fn, 23, 0),  # fp8_row: 160 codes and the 4-byte scale, 176-byte stride
    (37, 37, torch.float32, 25, 0),  # 148 bytes at a 160-byte stride
    (5, 1024, torch.float32, 1, 0),  # exactly a page
    (7, 2240, torch.bfloat16, 0, 2),  # 4,480 bytes: two pages a row
    (3, 8960, torch.bfloat16, 0, 5),  # a Gemma 3n E4B PLE row, 17,920 bytes: five pages
    (1, 1, torch.uint8, 256, 0),
])
@pytest.mark.parametrize("block_pages", [256, 3])
def test_rows_come_back_bit_for_bit(tmp_path, monkeypatch, rows, cols, dtype, per, pages, block_pages):
    """Each layout, written in one block or in blocks of 3 pages (several threads at once), read back."""
    monkeypatch.setattr(tf, "_WRITE_PAGES", block_pages)
    data = rand_rows(rows, cols, dtype, seed=rows)
    path = tmp_path / "t.uvt"
    seen = []
    lay = write_table_file(path, data, threads=3, progress=lambda done, total: seen.append((done, total)))
    assert (lay.rows_per_page, lay.pages_per_row) == (per, pages)
    assert os.path.getsize(path) == lay.file_bytes and lay.file_bytes % PAGE == 0
    assert not list(tmp_path.glob("*.partial*"))
    assert seen[-1] == (rows, rows) and all(b[0] > a[0] for a, b in zip(seen, seen[1:], strict=False))
    with TableFile.open(path) as f:
        assert f.layout == lay
        g = torch.Generator().manual_seed(1)
        ids = torch.cat([torch.tensor([0, rows - 1, 0]), torch.randint(0, rows, (50,), generator=g)])
        out = torch.full((len(ids), cols), 7, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else \
            torch.full((len(ids), cols), -7.0, dtype=dtype)  # poisoned
        assert f.read_rows(ids, out) is out
        assert torch.equal(bits(out), bits(data[ids]))
        assert torch.equal(bits(f.read_rows(torch.arange(rows))), bits(data))
        assert f.read_rows([]).shape == (0, cols)
        f.verify()


def test_a_host_table_and_a_safetensors_tensor_write_the_same_file(tmp_path):
    from safetensors.torch import save_file

    data = rand_rows(300, 160, torch.bfloat16, seed=3)
    h = HostTable.from_tensor(data)
    try:
        write_table_file(tmp_path / "a.uvt", h, encoding="raw")
    finally:
        h.close()
    save_file({"w": data}, str(tmp_path / "w.safetensors"))
    write_table_file(tmp_path / "b.uvt", locate_tensor(tmp_path / "w.safetensors", "w"), threads=2)
    write_table_file(tmp_path / "c.uvt", data, threads=1)
    a, b, c = ((tmp_path / n).read_bytes() for n in ("a.uvt", "b.uvt", "c.uvt"))
    assert a == b == c
    (tmp_path / "disk").mkdir()
    (tmp_path / "link.uvt").symlink_to(tmp_path / "disk" / "d.uvt")  # dangling until written through
    write_table_file(tmp_path / "link.uvt", data)
    write_table_file(tmp_path / "link.uvt", data, overwrite=True)
    assert (tmp_path / "link.uvt").is_symlink() and (tmp_path / "disk" / "d.uvt").read_bytes() == a
    assert sorted(os.listdir(tmp_path / "disk")) == ["d.uvt"]
    # a writer killed part way leaves its partial file: the next writer of the path removes it, not a live one's
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for pid in (int(dead.stdout), os.getppid()):
        (tmp_path / f"e.uvt.partial.{pid}").write_bytes(b"left by a writer")
    (tmp_path / "e.uvt.partial.x").write_bytes(b"not a writer's")
    write_table_file(tmp_path / "e.uvt", data)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("e.uvt")) == \
        ["e.uvt", f"e.uvt.partial.{os.getppid()}", "e.uvt.partial.x"]


def test_a_page_holds_host_table_rows_as_they_are(tmp_path):
    """The rows of a page lie at the host table's stride: a page copies into a host table's rows verbatim."""
    data = rand_rows(30, 37, torch.float32, seed=4)
    write_table_file(tmp_path / "t.uvt", data)
    h = HostTable.from_tensor(data)
    try:
        raw = torch.empty(0, dtype=torch.uint8).set_(h.tensor.untyped_storage())[h.tensor.storage_offset() * 4:]
        with TableFile.open(tmp_path / "t.uvt") as f:
            per, stride = f.layout.rows_per_page, f.layout.stride
            assert (per, stride) == (25, h.stride_bytes)
            pages = f.read_pages([0, 1], tf.page_buffer(2))
            assert torch.equal(pages[0, : per * stride], raw[: per * stride])  # rows 0 .. 24
            assert torch.equal(pages[1, : 5 * stride], raw[per * stride: 30 * stride])  # rows 25 .. 29
            assert not pages[1, 5 * stride:].any()  # the rest of the last page is zero
    finally:
        h.close()


def test_open_reads_the_header_and_the_sums_only(tmp_path, monkeypatch):
    data = rand_rows(4000, 160, torch.bfloat16, seed=5)
    lay = write_table_file(tmp_path / "t.uvt", data)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append((off, sum(len(b) for b in bufs))) or
                        real(fd, bufs, off))
    f = TableFile.open(tmp_path / "t.uvt")
    data_lo, data_hi = PAGE, (1 + lay.data_pages) * PAGE
    assert sum(n for _, n in calls) == PAGE + lay.sums_pages * PAGE
    assert not [c for c in calls if data_lo <= c[0] < data_hi]
    calls.clear()
    f.read_rows([0, 11, 12, 3999])  # rows 0 and 11 share page 0; 12 is on page 1: three pages, two reads
    assert calls == [(PAGE, 2 * PAGE), ((1 + 3999 // 12) * PAGE, PAGE)]
    f.close()
    with pytest.raises(TableFileError, match="was closed"):
        f.read_rows([0])


def test_a_damaged_page_is_named_when_read_and_by_verify(tmp_path):
    data = rand_rows(500, 160, torch.bfloat16, seed=6)
    path = tmp_path / "t.uvt"
    write_table_file(path, data)
    with open(path, "r+b") as fh:  # one byte of data page 7 flipped after the file was written
        fh.seek((1 + 7) * PAGE + 100)
        b = fh.read(1)
        fh.seek((1 + 7) * PAGE + 100)
        fh.write(bytes([b[0] ^ 0x10]))
    with TableFile.open(path) as f:  # open does not read the data
        assert torch.equal(bits(f.read_rows([0, 83])), bits(data[[0, 83]]))
        with pytest.raises(TableFileError, match="data page 7 does not match its sum"):
            f.read_rows([7 * 12 + 3])
        with pytest.raises(TableFileError, match="data page 7 does not match its sum"):
            f.verify()


def test_files_that_cannot_be_read_as_written_are_refused_at_open(tmp_path):
    data = rand_rows(100, 160, torch.bfloat16)
    path = tmp_path / "t.uvt"
    write_table_file(path, data)
    whole = path.read_bytes()
    cases = {
        "short.uvt": whole[:-PAGE],
        "long.uvt": whole + bytes(PAGE),
        "magic.uvt": b"X" + whole[1:],
        "json.uvt": whole[:16] + b"{not json" + whole[25:],
        "version.uvt": whole.replace(b'"version": 1', b'"version": 9'),
        "incomplete.uvt": whole.replace(b'"complete": true', b'"complete": false'),
        "layout.uvt": whole.replace(b'"stride": 320', b'"stride": 336'),
        "dtype.uvt": whole.replace(b'"dtype": "BF16"', b'"dtype": "Q16"'),
        "list.uvt": whole[:16] + b"[1]" + bytes(PAGE - 19) + whole[PAGE:],
        "empty.uvt": b"",
    }
    want = {"short.uvt": "holds 40,960 bytes; its layout needs 45,056", "long.uvt": "truncated or appended",
            "magic.uvt": "not a uvaple table file", "json.uvt": "header is damaged",
            "version.uvt": "version 9; this uvaple reads version 1", "incomplete.uvt": "not written to the end",
            "layout.uvt": "header's layout", "dtype.uvt": "header is damaged", "empty.uvt": "ended at byte 0",
            "list.uvt": "header is damaged .*holds a list, not an object"}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(TableFileError, match=want[name]):
            TableFile.open(tmp_path / name)
    with pytest.raises(TableFileError, match="cannot open the table file .*missing.uvt"):
        TableFile.open(tmp_path / "missing.uvt")


def test_a_file_truncated_under_an_open_table_is_a_named_error(tmp_path):
    data = rand_rows(1000, 160, torch.bfloat16, seed=8)
    path = tmp_path / "t.uvt"
    write_table_file(path, data)
    with TableFile.open(path, direct=False) as f:
        os.truncate(path, 20 * PAGE)
        assert torch.equal(bits(f.read_rows([5])), bits(data[[5]]))  # page 0 is still there
        with pytest.raises(TableFileError, match="ended at byte .*truncated after it was written"):
            f.read_rows([999])


def test_a_file_renamed_over_an_open_table_is_not_seen(tmp_path):
    a, b = rand_rows(50, 160, torch.bfloat16, seed=1), rand_rows(50, 160, torch.bfloat16, seed=2)
    write_table_file(tmp_path / "t.uvt", a)
    with TableFile.open(tmp_path / "t.uvt") as f:
        write_table_file(tmp_path / "new.uvt", b)
        os.replace(tmp_path / "new.uvt", tmp_path / "t.uvt")
        assert torch.equal(bits(f.read_rows(torch.arange(50))), bits(a))  # the bytes it opened and checked


def test_bad_requests_are_named_and_read_nothing(tmp_path, monkeypatch):
    data = rand_rows(100, 160, torch.bfloat16)
    write_table_file(tmp_path / "t.uvt", data)
    with TableFile.open(tmp_path / "t.uvt") as f:
        monkeypatch.setattr(os, "preadv", lambda *a: pytest.fail("read before the request was checked"))
        for rows in ([100], [-1], [0, 2**40]):
            with pytest.raises(TableFileError, match="has rows 0 .. 99; asked for"):
                f.read_rows(rows)
        with pytest.raises(TableFileError, match="has data pages 0 .. 8; asked for 9 .. 9"):
            f.read_pages([9], tf.page_buffer(1))
        with pytest.raises(TableFileError, match="out must be a contiguous torch.bfloat16 \\[2, 160\\]"):
            f.read_rows([1, 2], torch.empty(2, 160))
        with pytest.raises(TableFileError, match="out must be a contiguous uint8 \\[1, 4096\\]"):
            f.read_pages([0], torch.empty(1, 100, dtype=torch.uint8))
        if f.direct:
            with pytest.raises(TableFileError, match="page-aligned"):
                f.read_pages([0], tf.page_buffer(2).reshape(-1)[16: 16 + PAGE].view(1, PAGE))


def test_writing_refuses_what_it_cannot_write_and_leaves_nothing(tmp_path, monkeypatch):
    data = rand_rows(100, 160, torch.bfloat16)
    path = tmp_path / "t.uvt"
    write_table_file(path, data)
    with pytest.raises(TableFileError, match="exists: pass overwrite=True"):
        write_table_file(path, data)
    write_table_file(path, rand_rows(100, 160, torch.bfloat16, seed=9), overwrite=True)
    for bad, match in [(torch.zeros(3), "2-D CPU tensor"), (np.zeros((2, 2)), "not ndarray"),
                       (torch.zeros(2, 3, dtype=torch.int64), "holds rows of"),
                       (torch.zeros(0, 3), "rows >= 1"), (torch.zeros(4, 6)[:, ::2], "unit column stride")]:
        with pytest.raises(TableFileError, match=match):
            write_table_file(tmp_path / "bad.uvt", bad)
    with pytest.raises(TableFileError, match="encoding must be the name"):
        write_table_file(tmp_path / "bad.uvt", data, encoding="")
    assert not (tmp_path / "bad.uvt").exists() and not list(tmp_path.glob("*.partial*"))
    (tmp_path / "dir.uvt").mkdir()  # a directory is no table file's path, overwrite or not: refused before writing
    with pytest.raises(TableFileError, match="dir.uvt is a directory: give the table file's own path"):
        write_table_file(tmp_path / "dir.uvt", data, overwrite=True)
    assert not list(tmp_path.glob("*.partial*"))
    (tmp_path / "dir.uvt").rmdir()
    from safetensors.torch import save_file

    save_file({"w": data}, str(tmp_path / "w.safetensors"))
    info = locate_tensor(tmp_path / "w.safetensors", "w")
    os.unlink(tmp_path / "w.safetensors")  # the source goes away before its rows are read
    with pytest.raises(TableFileError, match="reading rows 0 .. 99 of the source failed: No such file"):
        write_table_file(tmp_path / "gone.uvt", info)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.uvt"]

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)  # the disk fills while the data is written
    with pytest.raises(TableFileError, match=r"no space left on the disk of .*full.uvt.partial.\d+ for a table file "
                                             "of 44.00 KiB: free that much"):
        write_table_file(tmp_path / "full.uvt", data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.uvt"]
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(TableFileError, match="writing .*eio.uvt failed: Input/output error"):
        write_table_file(tmp_path / "eio.uvt", data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.uvt"]


def test_a_layout_is_what_its_shape_makes_it():
    lay = FileLayout.of(5_033_165 * 16, 160, torch.bfloat16, "raw")  # the served Qwen4Exp table
    assert lay.rows_per_page == 12 and lay.data_pages == -(-5_033_165 * 16 // 12)
    assert lay.file_bytes == (1 + lay.data_pages + lay.sums_pages) * PAGE
    assert lay.file_bytes < 5_033_165 * 16 * 320 * 1.07  # 256 bytes a page left over: 6.25%
    assert lay.pages_of(11, 13) == (0, 2) and lay.rows_of(1, 3) == (12, 36)
    big = FileLayout.of(3, 8960, torch.bfloat16)
    assert big.pages_of(1, 2) == (5, 10) and big.rows_of(5, 15) == (1, 3)
    assert big.rows_of(1, 6) == (0, 2) and big.rows_of(6, 7) == (1, 2)  # a page inside a row: that row
    assert lay.pages_of(13, 13) == (13, 13) and big.pages_of(2, 1) == (2, 2)  # no rows: no pages


def test_a_failed_range_stops_the_ranges_not_started_and_waits_for_the_started_ones():
    """``uva.workers.parallel``: the first failure (an interrupt too) is raised once every range started has
    finished, and the ranges not started by then never start."""
    import threading
    import time

    from uvaple.uva.workers import parallel

    for error in (OSError(5, "Input/output error"), KeyboardInterrupt()):
        ran, lock = [], threading.Lock()

        def fn(i, error=error, ran=ran, lock=lock):
            if i == 0:
                raise error
            time.sleep(0.05)
            with lock:
                ran.append(i)

        with pytest.raises(type(error)):
            parallel(fn, [(i,) for i in range(40)], threads=2)
        done = len(ran)
        time.sleep(0.2)
        assert len(ran) == done < 10  # none ran after the raise, and most never started


def test_the_first_source_that_fits_the_header_is_written_and_read_back(tmp_path):
    """A writer's source names, longest first: the first that fits the header's field (non-ASCII characters count
    six as JSON), none where none fits; the one chosen is the file's ``source``."""
    long_path = "/data/" + "x" * tf.MAX_SOURCE
    non_ascii = "é" * (tf.MAX_SOURCE // 6 + 1)  # fits as characters, not as the header's JSON
    assert tf.fitting_source(f"emb of {long_path}", non_ascii, None, "emb as stored") == "emb as stored"
    assert tf.fitting_source(long_path, non_ascii) is None
    name = tf.fitting_source(long_path, "emb of w.safetensors")
    write_table_file(tmp_path / "t.uvt", torch.arange(12, dtype=torch.float32).view(3, 4), source_id=name)
    with TableFile.open(tmp_path / "t.uvt") as f:
        assert f.source == "emb of w.safetensors"

"""``uvaple table``: a table file written from a checkpoint's tensor (raw, or quantised to fp8_row on the way) holds
the rows a disk lookup serves exactly; ``info`` and ``verify`` read it; every bad request is refused by name
before any work, with no file left behind."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from helpers import bits, rand
from safetensors.torch import save_file

from uvaple.commands import cli
from uvaple.commands import table as table_cmd
from uvaple.integration import TableSpec, make_lookup
from uvaple.kernels import reference_gather
from uvaple.kernels.encodings import quantize_fp8_rows
from uvaple.uva import RowSource, TableFile, TableFileError
from uvaple.uva.table_file import PAGE


@pytest.fixture
def checkpoint(tmp_path):
    """A sharded checkpoint: the table in the second file (bf16, 3,001 rows of 40), beside other tensors."""
    emb = rand(3001, 40, torch.bfloat16, seed=31)
    save_file({"a": torch.randn(4, 4), "ids": torch.arange(10)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"model.emb.weight": emb, "flat": torch.randn(7)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "ids": "model-00001-of-00002.safetensors",
                            "model.emb.weight": "model-00002-of-00002.safetensors",
                            "flat": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, emb


def run(capsys, *args):
    code = cli.main(["table", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_raw_table_file_holds_the_tensors_rows_and_a_disk_lookup_serves_them(tmp_path, checkpoint, capsys):
    ckpt, emb = checkpoint
    path = tmp_path / "emb.uvt"
    code, out, err = run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", path, "--threads", 3)
    assert code == 0 and f"wrote {path}" in out and "3,001 rows of 40 bfloat16 values, as stored" in err
    with TableFile.open(path) as f:
        assert f.encoding == "raw" and torch.equal(bits(f.read_rows(range(3001))), bits(emb))
    code, out, _ = run(capsys, "info", path, "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["rows"], doc["cols"], doc["dtype"], doc["encoding"]) == (3001, 40, "bfloat16", "raw")
    assert doc["file_bytes"] == os.path.getsize(path)
    assert doc["source"] == f"model.emb.weight of {os.path.realpath(ckpt)} as stored"
    code, out, _ = run(capsys, "info", path)  # in words: the packing, not a count of 0
    assert code == 0 and "pages_per_row" not in out and "packing: 51 rows a page" in out
    assert f"source: model.emb.weight of {os.path.realpath(ckpt)} as stored" in out
    code, out, _ = run(capsys, "verify", path, "--quiet")
    assert code == 0 and f"every one of its {doc['data_pages']:,} data pages matches its sum" in out
    ids = torch.tensor([[0, 3000, 17], [5, -1, 3001]])
    with make_lookup("disk", str(path), max_rows=8, slots=4) as lk:
        assert torch.equal(bits(lk.lookup(ids)), bits(reference_gather(emb, ids)))


@pytest.mark.parametrize("fp8", ["e4m3fn", "e5m2"])
def test_an_fp8_row_table_file_holds_the_quantisers_rows(tmp_path, checkpoint, capsys, fp8):
    """``--encoding fp8_row``: each row the torch definition's codes and scale; a disk lookup dequantises them as
    the reference does."""
    ckpt, emb = checkpoint
    fmt = table_cmd.FP8[fp8]
    path = tmp_path / "emb8.uvt"
    code, _, err = run(capsys, "write", ckpt / "model-00002-of-00002.safetensors", "--tensor", "model.emb.weight",
                       "--out", path, "--encoding", "fp8_row", "--fp8", fp8)
    assert code == 0 and f"as fp8_row ({fp8} codes and a float32 scale a row)" in err
    want = quantize_fp8_rows(emb, fmt)
    with TableFile.open(path) as f:
        assert f.encoding == "fp8_row" and f.dtype == fmt and torch.equal(bits(f.read_rows(range(3001))), bits(want))
        spec = TableSpec.of(f, encoding="fp8_row", out_dtype=torch.bfloat16)
    ids = torch.tensor([2999, 0, 1234, 7, 7])
    with make_lookup("disk", str(path), spec=spec, max_rows=8, slots=4) as lk:
        ref = reference_gather(want, ids, encoding="fp8_row", out_dtype=torch.bfloat16)
        assert torch.equal(bits(lk.lookup(ids)), bits(ref))


def test_verify_names_a_damaged_page(tmp_path, checkpoint, capsys):
    ckpt, _ = checkpoint
    path = tmp_path / "emb.uvt"
    assert run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", path, "--quiet")[0] == 0
    with open(path, "r+b") as fh:
        fh.seek(3 * PAGE + 100)  # data page 2
        byte = fh.read(1)
        fh.seek(3 * PAGE + 100)
        fh.write(bytes([byte[0] ^ 0x40]))
    code, out, err = run(capsys, "verify", path, "--quiet")
    assert code == table_cmd.EXIT_DAMAGED and "page 2" in err and out == ""


@pytest.mark.parametrize("args,says", [
    (["--tensor", "model.emb.weigth"], "tensor 'model.emb.weigth' is not in the checkpoint"),
    (["--tensor", "flat"], "has shape [7]; a table is 2-D"),
    (["--tensor", "ids"], "has shape [10]; a table is 2-D"),
    (["--tensor", "model.emb.weight", "--tensor", "model.*.weight"], "names model.emb.weight more than once"),
    (["--tensor", "model.emb.weight", "--out", "{tmp}"], "is not a file's path"),
    (["--tensor", "model.emb.weight", "--out", "{tmp}/new/"], "is not a file's path"),
    (["--tensor", "model.emb.weight", "--out", ""], "is not a file's path"),
    (["--tensor", "model.emb.weight", "--out", "{ckpt}/model-00002-of-00002.safetensors", "--overwrite"],
     "is a file the rows are read from"),
    (["--tensor", "a", "--encoding", "fp8_row", "--fp8", "e5m2", "--out", "{tmp}/sub/none.uvt"],
     "its folder {tmp}/sub is not a writable directory"),
])
def test_bad_requests_are_refused_before_any_work(tmp_path, checkpoint, capsys, args, says):
    ckpt, _ = checkpoint
    args = [x.replace("{tmp}", str(tmp_path)).replace("{ckpt}", str(ckpt)) for x in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "t.uvt")]
    code, out, err = run(capsys, "write", ckpt, *args)
    assert code == table_cmd.EXIT_REFUSED and says.replace("{tmp}", str(tmp_path)) in err and out == ""
    assert not (tmp_path / "t.uvt").exists() and not list(tmp_path.rglob("*.partial*"))
    assert sorted(p.name for p in ckpt.iterdir() if p.suffix == ".safetensors") == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_refusals_of_the_destination_the_source_and_the_options(tmp_path, checkpoint, capsys, monkeypatch):
    ckpt, _ = checkpoint
    out = tmp_path / "t.uvt"
    ints = rand(50, 8, torch.int8)
    save_file({"codes": ints}, tmp_path / "codes.safetensors")
    code, _, err = run(capsys, "write", tmp_path / "codes.safetensors", "--tensor", "codes", "--out", out,
                       "--encoding", "fp8_row")
    assert code == 2 and "holds torch.int8 values; fp8_row quantises float rows" in err
    code, _, err = run(capsys, "write", tmp_path / "missing", "--tensor", "x", "--out", out)
    assert code == 2 and "missing does not exist" in err
    monkeypatch.setattr(table_cmd, "_free_bytes", lambda path: 4096)
    code, _, err = run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out)
    assert code == 2 and "and its disk has 4.00 KiB free" in err and not out.exists()
    monkeypatch.undo()
    assert run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out, "--quiet")[0] == 0
    code, _, err = run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out)
    assert code == 2 and "exists: pass --overwrite" in err
    assert run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out, "--overwrite", "--quiet")[0] == 0
    code, _, err = run(capsys, "write", ckpt, "--tensor", "ids", "--tensor", "a", "--out", tmp_path / "u.uvt")
    assert code == 2 and "ids: " not in err and "has shape [10]" in err
    save_file({"f64": torch.randn(6, 3, dtype=torch.float64)}, tmp_path / "f64.safetensors")
    code, _, err = run(capsys, "write", tmp_path / "f64.safetensors", "--tensor", "f64", "--out", tmp_path / "u.uvt")
    assert code == 2 and "f64: a table file holds rows of" in err and "save the tensor as one of those" in err
    nan = torch.randn(40, 8)
    nan[33, 2] = float("nan")
    save_file({"nan": nan}, tmp_path / "nan.safetensors")
    code, _, err = run(capsys, "write", tmp_path / "nan.safetensors", "--tensor", "nan", "--out", tmp_path / "u.uvt",
                       "--encoding", "fp8_row", "--quiet")
    assert code == 3 and "row 33 holds inf or NaN" in err and err.count("\n") == 1  # named, not a traceback
    assert not (tmp_path / "u.uvt").exists() and not list(tmp_path.glob("*.partial*"))
    for argv, says in [(["write", ckpt, "--tensor", "x", "--out", out, "--fp8", "e5m2"], "add --encoding fp8_row"),
                       (["write", ckpt, "--tensor", "x", "--out", out, "--fp8=e4m3fn"], "add --encoding fp8_row"),
                       (["write", ckpt, "--tensor", "x", "--out", out, "--threads", "0"], "--threads 0"),
                       (["write", ckpt, "--tensor", "x", "--out", out, "--threads", "100000"], "from 1 to 256"),
                       ([], "say what to do: write, info, verify or prune")]:
        with pytest.raises(SystemExit) as e:
            cli.main(["table", *map(str, argv)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    (tmp_path / "not_a_table").write_bytes(b"x" * 5000)
    for sub in ("info", "verify"):
        code, _, err = run(capsys, sub, tmp_path / "not_a_table")
        assert code == 2 and f"uvaple table {sub}: " in err


def test_a_source_that_fails_part_way_leaves_no_file(tmp_path, checkpoint, capsys, monkeypatch):
    """A shard shorter than its header says is refused before any work; a source whose read fails part way
    (an I/O error on a later block) is the failed status, named, and neither the file nor its partial copy is
    left."""
    ckpt, emb = checkpoint
    shard = ckpt / "model-00002-of-00002.safetensors"
    out = tmp_path / "t.uvt"
    real = table_cmd._source

    def failing(a):
        given, src = real(a)

        def block(lo, hi):
            if hi > 2000:
                raise OSError(5, "Input/output error")
            return src.block(lo, hi)
        return given, table_cmd.RowSource(src.rows, src.cols, src.dtype, block)

    monkeypatch.setattr(table_cmd, "_source", failing)
    code, _, err = run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out, "--quiet", "--threads", 2)
    assert code == table_cmd.EXIT_FAILED and "failed: Input/output error" in err
    assert not out.exists() and not list(tmp_path.glob("*.partial*"))
    monkeypatch.undo()
    os.truncate(shard, os.path.getsize(shard) - 2000)
    code, _, err = run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out, "--quiet")
    assert code == table_cmd.EXIT_REFUSED and "model-00002-of-00002.safetensors" in err and not out.exists()


def test_row_shards_are_stacked_in_natural_order(tmp_path, capsys):
    """A table saved as row shards (Qwen4Exp's n-gram tables: ``...shard_{k}.weight``) over two files: a pattern
    stacks them in natural order (shard_2 before shard_10), as does the flag given again; a shard of another
    width, or a pattern no tensor matches, is refused by name."""
    g = torch.Generator().manual_seed(41)
    shards = {f"ple.shard_{k}.weight": (torch.randn(17 + k, 12, generator=g) * 3).to(torch.bfloat16) for k in range(12)}
    names = list(shards)
    save_file({n: shards[n] for n in names[:5]}, tmp_path / "a.safetensors")
    save_file({n: shards[n] for n in names[5:]} | {"odd.weight": torch.randn(4, 13).to(torch.bfloat16)},
              tmp_path / "b.safetensors")
    want = torch.cat([shards[f"ple.shard_{k}.weight"] for k in range(12)])
    out = tmp_path / "t.uvt"
    code, _, err = run(capsys, "write", tmp_path, "--tensor", "ple.shard_*.weight", "--out", out)
    assert code == 0 and "12 tensors (ple.shard_0.weight .. ple.shard_11.weight, stacked)" in err
    with TableFile.open(out) as f:
        assert torch.equal(bits(f.read_rows(range(want.shape[0]))), bits(want))
    code, _, _ = run(capsys, "write", tmp_path, "--tensor", "ple.shard_3.weight", "--tensor", "ple.shard_1.weight",
                     "--out", out, "--overwrite", "--quiet")
    with TableFile.open(out) as f:
        two = torch.cat([shards["ple.shard_3.weight"], shards["ple.shard_1.weight"]])
        assert code == 0 and torch.equal(bits(f.read_rows(range(two.shape[0]))), bits(two))
    code, _, err = run(capsys, "write", tmp_path, "--tensor", "ple.shard_1.weight", "--tensor", "odd.weight",
                       "--out", tmp_path / "u.uvt")
    assert code == 2 and "odd.weight holds rows of 13 torch.bfloat16 values and ple.shard_1.weight rows of 12" in err
    code, _, err = run(capsys, "write", tmp_path, "--tensor", "ple.part_*", "--out", tmp_path / "u.uvt")
    assert code == 2 and "no tensor of the checkpoint matches --tensor 'ple.part_*'" in err
    assert not (tmp_path / "u.uvt").exists()


def test_a_stacked_source_gives_every_block_across_its_parts():
    """Every block ``a .. b`` of stacked parts (an empty one among them) is those rows of their concatenation."""
    parts = [rand(n, 5, torch.float32, seed=n) for n in (3, 0, 5, 1, 7)]
    whole = torch.cat(parts)
    src = RowSource.stacked(parts)
    assert (src.rows, src.cols, src.dtype) == (16, 5, torch.float32)
    for a in range(16):
        for b in range(a + 1, 17):
            assert torch.equal(src.block(a, b), whole[a:b]), (a, b)
    with pytest.raises(TableFileError, match="no sources to stack"):
        RowSource.stacked([])


def test_an_interrupt_leaves_no_file_and_says_so(tmp_path, checkpoint, capsys, monkeypatch):
    """Ctrl-C while the rows are written (several threads): the failed status, one line that says nothing is left,
    and nothing left; --quiet prints nothing on stderr but that line."""
    ckpt, _ = checkpoint
    real = table_cmd._source

    def interrupted(a):
        given, src = real(a)

        def block(lo, hi):
            if lo > 0:
                raise KeyboardInterrupt
            return src.block(lo, hi)
        return given, RowSource(src.rows, src.cols, src.dtype, block)

    monkeypatch.setattr(table_cmd, "_source", interrupted)
    monkeypatch.setattr("uvaple.uva.table_file._WRITE_PAGES", 3)  # many blocks
    out = tmp_path / "t.uvt"
    code, stdout, err = run(capsys, "write", ckpt, "--tensor", "model.emb.weight", "--out", out, "--quiet",
                            "--threads", 3)
    assert code == table_cmd.EXIT_FAILED and err == "uvaple table write: interrupted (no file is left at --out)\n"
    assert stdout == "" and not out.exists() and not list(tmp_path.glob("*.partial*"))


# ------------------------------------------------------------------ prune: the files no load uses any more
def _table(path, seed, source="a checkpoint"):
    from uvaple.uva import write_table_file

    write_table_file(path, rand(64, 40, torch.bfloat16, seed=seed), source_id=source)
    return path


def _age(path, days):
    t = os.path.getmtime(path) - days * 86400
    os.utime(path, (t, t))


def _dead_pid() -> int:
    """The pid of a process that has ended (and whose pid no process has taken since)."""
    import subprocess
    import sys

    for _ in range(100):
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            return child.pid
    raise AssertionError("every ended child's pid was taken again at once")


@contextlib.contextmanager
def _holder(*paths):
    """Another process that holds ``paths`` open (and runs) until the block ends; yields its pid."""
    import subprocess
    import sys

    code = "import sys; fs = [open(p, 'rb') for p in sys.argv[1:]]; print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code, *map(str, paths)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        yield child.pid
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_prune_removes_the_table_files_unused_for_days_that_no_process_holds(tmp_path, capsys):
    from uvaple.uva.table_file import MAGIC

    old = _table(tmp_path / "old.r0of1.uvt", 1, "an earlier revision")
    held = _table(tmp_path / "held.r0of1.uvt", 2)
    recent = _table(tmp_path / "recent.uvtable", 3)
    for p in (old, held):
        _age(p, 10)
    notes = tmp_path / "notes.uvt"  # not a table file, however old: left alone
    notes.write_text("mine")
    garbage = tmp_path / "garbage.uvt"  # the magic, then a header no JSON parser survives: not a table file either
    garbage.write_bytes(MAGIC + b"[" * 100_000)
    for p in (notes, garbage):
        _age(p, 30)
    dead = tmp_path / f"old.r0of1.uvt.loading.{_dead_pid()}"  # a staging file of an engine that was killed
    dead.write_bytes(os.urandom(4096))
    other = tmp_path / f"mine.txt.partial.{_dead_pid()}"  # not beside a table file's name: not this command's
    other.write_text("x")
    with _holder(held) as writer:  # a writer at work: its pid runs
        live = tmp_path / f"recent.uvtable.partial.{writer}"
        live.write_bytes(os.urandom(100))
        everything = sorted(p.name for p in tmp_path.iterdir())
        code, out, err = run(capsys, "prune", tmp_path, "--unused-days", 7, "--dry-run")
        assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == everything, err  # nothing removed
        assert "would remove old.r0of1.uvt (" in out and "an earlier revision" in out
        assert f"would remove {dead.name} (4.00 KiB): left by a writer that no longer runs" in out
        assert f"kept held.r0of1.uvt: in use (process {writer})" in out  # held by another process, by its inode
        assert "kept recent.uvtable: last written or reused" in out
        assert "would remove 2 files" in out and "kept 2" in out
        assert "notes.uvt" not in out and "garbage" not in out and live.name not in out and other.name not in out
        code, out, err = run(capsys, "prune", tmp_path, "--unused-days", 7)
        assert code == 0, err
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted(set(everything) - {old.name, dead.name}), out
        assert "removed 2 files" in out and "removed old.r0of1.uvt (" in out
    code, out, _ = run(capsys, "prune", tmp_path, "--unused-days", 0)  # 0 days: every file no process holds
    assert code == 0 and not held.exists() and not recent.exists() and notes.exists() and garbage.exists()
    assert other.exists()


def test_prune_keeps_a_file_written_again_while_it_checked_and_waits_for_no_loader(tmp_path, capsys, monkeypatch):
    from uvaple.integration import file_embedding

    old = _table(tmp_path / "t.r0of1.uvt", 6, "the first")
    _age(old, 10)
    real = table_cmd._open_files

    def written_again():  # between the candidate's opening and its removal a loader writes the file again
        fresh = tmp_path / "fresh"
        _table(fresh, 7, "the second")
        _age(fresh, 10)  # (as old as the first: only the file's identity tells them apart)
        os.replace(fresh, old)
        return real()

    monkeypatch.setattr(table_cmd, "_open_files", written_again)
    code, out, _ = run(capsys, "prune", tmp_path, "--unused-days", 1)
    assert code == 0 and "kept t.r0of1.uvt: written again just now" in out
    with TableFile.open(old) as f:
        assert f.source == "the second"
    monkeypatch.setattr(table_cmd, "_open_files", real)
    with file_embedding.folder_lock(str(tmp_path)):  # a loader at work in the folder: refused, nothing removed
        code, out, err = run(capsys, "prune", tmp_path, "--unused-days", 1)
    assert code == 2 and "holds the folder's lock): run prune again when it is done" in err and old.exists()


def test_prune_names_a_file_it_cannot_remove_and_goes_on(tmp_path, capsys, monkeypatch):
    a, b = _table(tmp_path / "a.uvt", 8), _table(tmp_path / "b.uvt", 9)
    for p in (a, b):
        _age(p, 10)
    unlink = os.unlink

    def refused(path, *args, **kw):
        if str(path).endswith("a.uvt"):
            raise PermissionError(13, "Permission denied")
        return unlink(path, *args, **kw)

    monkeypatch.setattr(table_cmd.os, "unlink", refused)
    code, out, _ = run(capsys, "prune", tmp_path, "--unused-days", 1)
    assert code == table_cmd.EXIT_FAILED and "could not remove a.uvt: Permission denied" in out
    assert "removed 1 file" in out and "could not remove 1" in out and a.exists() and not b.exists()


def test_a_reused_table_file_is_stamped_as_used_now(tmp_path):
    from uvaple.integration.file_embedding import reusable

    path = _table(tmp_path / "emb.uvt", 4, "the checkpoint")
    _age(path, 30)
    before = os.path.getmtime(path)
    assert reusable(path, RowSource.of(rand(64, 40, torch.bfloat16, seed=4)), "raw", "another checkpoint") is None
    assert os.path.getmtime(path) == before  # not reused: not stamped
    f = reusable(path, RowSource.of(rand(64, 40, torch.bfloat16, seed=4)), "raw", "the checkpoint")
    assert f is not None
    f.close()
    assert os.path.getmtime(path) > before + 29 * 86400


@pytest.mark.parametrize("args,says", [
    (["prune", "MISSING", "--unused-days", "1"], "MISSING: no such folder; give the folder of the table files"),
    (["prune", "HERE", "--unused-days", "-1"], "--unused-days -1: give a number of days, 0 or more"),
    (["prune", "HERE", "--unused-days", "nan"], "--unused-days nan: give a number of days"),
    (["prune", "HERE"], "the following arguments are required: --unused-days"),
])
def test_prune_refuses_a_missing_folder_and_a_bad_count_of_days(tmp_path, capsys, args, says):
    args = [str(tmp_path / "missing") if a == "MISSING" else str(tmp_path) if a == "HERE" else a for a in args]
    kept = _table(tmp_path / "t.uvt", 5)
    _age(kept, 10)
    try:
        code = cli.main(["table", *args])
    except SystemExit as e:
        code = e.code
    _, err = capsys.readouterr()
    assert code == 2 and says.replace("MISSING", str(tmp_path / "missing")) in err, err
    assert kept.exists()


def test_prune_says_when_another_users_open_files_could_not_be_read(tmp_path, capsys, monkeypatch):
    t = _table(tmp_path / "t.uvt", 10)
    _age(t, 10)
    listdir = os.listdir

    def guarded(path="."):
        if str(path).startswith("/proc/") and str(path).endswith("/fd") and str(path) != f"/proc/{os.getpid()}/fd":
            raise PermissionError(13, "Permission denied")
        return listdir(path)

    monkeypatch.setattr(table_cmd.os, "listdir", guarded)
    code, out, _ = run(capsys, "prune", tmp_path, "--unused-days", 1, "--dry-run")
    assert code == 0 and "would remove t.uvt" in out and t.exists()
    assert "could not be read (another user's): a file only they hold counts as unused; run as root" in out

"""An embedding over a table file (the disk placement in a model layer): the same bits as the host-memory module
for every encoding it serves, a file reused only when its header names the same source, a weight assigned written
to the module's file, and every misuse a named error. Real files; the gather interpreted on CPU, compiled over UVA
on CUDA."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import bits, rand

from uvaple.integration.embedding import HostScaledEmbedding
from uvaple.integration.encoded_embedding import HostEncodedEmbedding
from uvaple.integration.file_embedding import FileEmbedding, table_file_for
from uvaple.integration.quantize import fp8_row_source
from uvaple.kernels.encodings import quantize_fp8_rows
from uvaple.uva import HostTable, RowSource, TableFile, TableFileError, write_table_file
from uvaple.uva.table_file import MAX_SOURCE, PAGE

ROWS, DIM = 333, 24
DISK = {"slots": 200}  # fewer slots than the table's rows: calls evict


def ids_of(n: int, seed: int, device) -> torch.Tensor:
    """Ids of every kind: repeats, the first and last rows, and ids outside the table."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (n,), generator=g)
    edges = torch.tensor([ROWS + 5, 0, ROWS - 1, -3])
    ids[:4] = edges[:n]
    return ids.to(device)


def poison(module) -> None:
    """The module's static output filled with NaN before a call (the call must write every value)."""
    for _, static in module._backends.values():
        if static is not None:
            static.fill_(float("nan"))


def served(module, ids: torch.Tensor) -> torch.Tensor:
    module(ids[:1])  # builds the lookup
    poison(module)
    return module(ids).clone()


@pytest.mark.parametrize("oob", ["zero", "row0"])
def test_a_raw_file_serves_the_host_modules_bits_with_its_scale(tmp_path, device, oob):
    rows = rand(ROWS, DIM, torch.bfloat16, seed=1)
    write_table_file(tmp_path / "t.uvtable", rows)
    host = HostScaledEmbedding(ROWS, DIM, None, 16.0, table=HostTable.from_tensor(rows), oob=oob, own_table=True)
    disk = FileEmbedding(ROWS, DIM, TableFile.open(tmp_path / "t.uvtable"), out_dtype=torch.bfloat16,
                         embed_scale=16.0, oob=oob, backend_options=DISK, max_tokens=200)
    try:
        # odd shapes; the one id of the first call is outside the table
        for seed, shape in enumerate([(1,), (7, 5), (3, 1, 61), (150,), (2, 90)]):
            ids = ids_of(int(torch.Size(shape).numel()), seed, device).view(shape)
            want = host(ids)
            assert want.shape == (*shape, DIM) and want.isfinite().all()
            assert torch.equal(bits(served(disk, ids)), bits(want))
        assert disk.lookups[0].stats()["cache"]["evictions"] > 0  # the calls went through a cache too small to hold all
        assert disk.encoding == "raw" and disk.weight.device.type == "meta"
    finally:
        host.close()
        disk.close()


def test_an_fp8_row_file_written_by_the_kernel_is_the_definitions_bytes_and_the_encoded_modules_rows(tmp_path,
                                                                                                  device):
    src = rand(ROWS, DIM, torch.bfloat16, seed=2)
    src[5] = 0.0  # an all-zero row
    with table_file_for(tmp_path / "q.uvtable", fp8_row_source(RowSource.of(src)), encoding="fp8_row") as f:
        assert torch.equal(f.read_rows(torch.arange(ROWS)).view(torch.uint8), quantize_fp8_rows(src).view(torch.uint8))
    table = HostTable.from_tensor(quantize_fp8_rows(src))
    host = HostEncodedEmbedding(ROWS, DIM, table, encoding="fp8_row", out_dtype=torch.bfloat16)
    disk = FileEmbedding(ROWS, DIM, TableFile.open(tmp_path / "q.uvtable"), out_dtype=torch.bfloat16,
                         backend_options=DISK, max_tokens=100)
    try:
        ids = ids_of(97, 3, device)
        assert torch.equal(bits(served(disk, ids)), bits(host(ids)))
        back = disk.read_table()  # the rows as served: the entry's reference
        assert torch.equal(bits(back), bits(host(torch.arange(ROWS, device=device)).cpu()))
    finally:
        host.close()
        disk.close()


def test_an_fp8_global_file_takes_the_modules_scale_through_its_state_dict(tmp_path, device):
    codes = rand(ROWS, DIM, torch.float32, seed=4).to(torch.float8_e4m3fn)
    write_table_file(tmp_path / "g.uvtable", codes, encoding="fp8_global")
    scale = torch.tensor([0.375])
    disk = FileEmbedding(ROWS, DIM, TableFile.open(tmp_path / "g.uvtable"), out_dtype=torch.bfloat16,
                         weight_scale=scale, backend_options=DISK, max_tokens=64)
    try:
        ids = ids_of(50, 5, device).clamp(0, ROWS - 1)
        want = codes[ids.cpu()].to(torch.bfloat16) * scale.to(torch.bfloat16)
        assert torch.equal(bits(served(disk, ids).cpu()), bits(want))
        assert set(disk.state_dict()) == {"weight_scale"}  # a serving copy: the rows are the file's
        disk.load_state_dict({"weight_scale": torch.tensor([0.5])})  # the lookup is rebuilt with the new scale
        assert torch.equal(bits(disk(ids).cpu()), bits(codes[ids.cpu()].to(torch.bfloat16) * 0.5))
    finally:
        disk.close()


def test_a_file_is_reused_only_when_its_header_names_the_same_source(tmp_path):
    a, b = rand(ROWS, DIM, torch.bfloat16, seed=6), rand(ROWS, DIM, torch.bfloat16, seed=7)
    path = tmp_path / "dir" / "t.uvtable"
    with table_file_for(path, RowSource.of(a), source_id="ckpt A") as f:
        assert f.source == "ckpt A" and torch.equal(f.read_rows([0, ROWS - 1]), a[[0, ROWS - 1]])
    first = os.stat(path).st_ino
    with table_file_for(path, RowSource.of(b), source_id="ckpt A") as f:  # the same source: opened, never written
        assert os.stat(path).st_ino == first and torch.equal(f.read_rows([3]), a[[3]])
    with table_file_for(path, RowSource.of(b), source_id="ckpt B") as f:  # another source: written again
        assert f.source == "ckpt B" and torch.equal(f.read_rows(torch.arange(ROWS)), b)
    with table_file_for(path, RowSource.of(a), source_id=None) as f:  # nothing names the rows: always written
        assert f.source is None and torch.equal(f.read_rows(torch.arange(ROWS)), a)
    with table_file_for(path, RowSource.of(b[:, :8].contiguous()), source_id=None) as f:  # another shape
        assert f.shape == (ROWS, 8)
    os.truncate(path, os.path.getsize(path) - PAGE)  # damaged: written again whatever its header says
    with table_file_for(path, RowSource.of(a), source_id="ckpt A") as f:
        assert f.source == "ckpt A" and torch.equal(f.read_rows(torch.arange(ROWS)), a)
    assert sorted(os.listdir(path.parent)) == ["t.uvtable"]  # no partial file left behind


def test_a_long_write_says_how_far_it_is(tmp_path, monkeypatch, caplog):
    from uvaple.integration import file_embedding

    monkeypatch.setattr(file_embedding._progress, "__defaults__", (0.0,))  # say it at every block
    rows = rand(200_000, 8, torch.bfloat16, seed=18)  # 782 data pages: four of the writer's blocks
    with caplog.at_level("INFO", logger="uvaple.integration.file_embedding"):
        table_file_for(tmp_path / "p.uvtable", RowSource.of(rows), what="a long table").close()
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("uvaple: writing a long table to ") and said[-1].startswith("uvaple: wrote ")
    assert any(" of 200000 rows (" in m for m in said[1:-1])


def test_the_header_keeps_a_bounded_source(tmp_path):
    t = rand(10, 4, torch.float32, seed=8)
    write_table_file(tmp_path / "s.uvtable", t, source_id="x" * MAX_SOURCE)
    with TableFile.open(tmp_path / "s.uvtable") as f:
        assert f.source == "x" * MAX_SOURCE
    write_table_file(tmp_path / "n.uvtable", t)
    with TableFile.open(tmp_path / "n.uvtable") as f:
        assert f.source is None
    for bad in ("x" * (MAX_SOURCE + 1), 7):
        with pytest.raises(TableFileError, match="source_id must be a string of at most"):
            write_table_file(tmp_path / "bad.uvtable", t, source_id=bad)
    assert not (tmp_path / "bad.uvtable").exists()


def test_a_weight_assigned_is_written_to_the_modules_file_quantised_when_asked(tmp_path, device):
    w = rand(ROWS, DIM, torch.float32, seed=9)
    raw = FileEmbedding(ROWS, DIM, out_dtype=torch.float32, table_path=tmp_path / "w.uvtable",
                        backend_options=DISK, max_tokens=64)
    q = FileEmbedding(ROWS, DIM, out_dtype=torch.bfloat16, table_path=tmp_path / "wq.uvtable",
                      backend_options={**DISK, "quantize": "fp8_row_e5m2"}, max_tokens=64)
    try:
        raw.weight = torch.nn.Parameter(w.to(device))  # how transformers' loader assigns it
        q.load_state_dict({"weight": w})
        assert raw.encoding == "raw" and q.encoding == "fp8_row"
        ids = ids_of(60, 10, device).clamp(0, ROWS - 1)
        assert torch.equal(bits(served(raw, ids).cpu()), bits(w[ids.cpu()]))
        want = quantize_fp8_rows(w, torch.float8_e5m2)
        with TableFile.open(tmp_path / "wq.uvtable") as f:
            assert torch.equal(f.read_rows(torch.arange(ROWS)).view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(raw.read_table(), w)
        raw.weight = w * 2  # written again: the lookups serve the new rows
        assert torch.equal(bits(raw(ids).cpu()), bits(w[ids.cpu()] * 2))
    finally:
        raw.close()
        q.close()


def test_a_copy_reads_the_same_file_through_its_own_descriptor(tmp_path, device):
    rows = rand(ROWS, DIM, torch.bfloat16, seed=11)
    write_table_file(tmp_path / "c.uvtable", rows)
    disk = FileEmbedding(ROWS, DIM, TableFile.open(tmp_path / "c.uvtable"), out_dtype=torch.bfloat16,
                         backend_options=DISK, max_tokens=64)
    twin = copy.deepcopy(disk)
    assert twin.table.path == disk.table.path and twin.table.fileno() != disk.table.fileno()
    ids = ids_of(40, 12, device)
    want = served(disk, ids)
    disk.close()
    assert torch.equal(bits(served(twin, ids)), bits(want))
    twin.close()


def test_every_misuse_is_named(tmp_path):
    rows = rand(ROWS, DIM, torch.bfloat16, seed=13)
    write_table_file(tmp_path / "t.uvtable", rows)
    write_table_file(tmp_path / "i.uvtable", torch.arange(ROWS * DIM, dtype=torch.uint8).view(ROWS, DIM))
    f = TableFile.open(tmp_path / "t.uvtable")
    kw = dict(out_dtype=torch.bfloat16, backend_options=DISK, max_tokens=8, own_file=False)
    try:
        for bad, match in [(dict(max_tokens=None), "build the embedding with max_tokens"),
                           (dict(backend="uva"), "served by \\['disk'\\], not 'uva'"),
                           (dict(backend_options={}), "needs exactly one of budget_bytes .* got neither"),
                           (dict(backend_options={"slots": 9, "budget_bytes": 4096}), "got budget_bytes and slots"),
                           (dict(backend_options={"slots": 7}), "holds 7 rows of 48 B, and a call may bring 8 "
                                                                "distinct rows: give budget_bytes >= 384"),
                           (dict(backend_options={**DISK, "budget_byte": 1}), "takes no option \\['budget_byte'\\]"),
                           (dict(backend_options={**DISK, "quantize": "fp8_row"}, embed_scale=16.0),
                            "quantises its rows as they are, not times embed_scale=16.0"),
                           (dict(weight_scale=torch.ones(2)), "weight_scale must be a float tensor of one value"),
                           (dict(weight_scale=torch.ones(1)), "an fp8_global file needs the embedding's weight_scale")]:
            with pytest.raises(ValueError, match=match):
                FileEmbedding(ROWS, DIM, f, **{**kw, **bad})
        with pytest.raises(ValueError, match="is 333x24 \\(raw\\); this embedding's rows are 334x24"):
            FileEmbedding(ROWS + 1, DIM, f, **kw)
        with TableFile.open(tmp_path / "i.uvtable") as ints:
            with pytest.raises(ValueError, match="holds raw torch.uint8 rows; a file embedding serves raw rows of"):
                FileEmbedding(ROWS, DIM, ints, **kw)
        with pytest.raises(TypeError, match="serves a table file \\(uvaple.uva.TableFile\\), not HostTable"):
            FileEmbedding(ROWS, DIM, HostTable.from_tensor(rows), **{**kw, "own_file": True})
        with pytest.raises(ValueError, match="the disk placement serves a table file, and this embedding's table is"):
            HostScaledEmbedding(ROWS, DIM, backend="disk")
        with pytest.raises(ValueError, match="backend must be one of \\('uva', 'device', 'copy', 'disk'\\), got 'tpu'"):
            HostScaledEmbedding(ROWS, DIM, backend="tpu")
        host = HostScaledEmbedding(ROWS, DIM, table=HostTable.from_tensor(rows), own_table=True)
        with pytest.raises(ValueError, match="the disk placement serves a table file"):
            host.set_backend("disk", DISK)
        host.close()
        emb = FileEmbedding(ROWS, DIM, f, **kw)
        with pytest.raises(TypeError, match="has no table_path to write a weight to"):
            emb.load_weight_(rows)
        with pytest.raises(ValueError, match="served by \\['disk'\\], not 'uva'"):
            emb.set_backend("uva")
        with pytest.raises(ValueError, match="9 ids in one forward, but this embedding was built with max_tokens=8"):
            emb(torch.zeros(9, dtype=torch.long))
        assert torch.equal(bits(emb(torch.tensor([2, 3]))), bits(rows[[2, 3]]))  # still serving
        with pytest.raises(ValueError, match="'fp8_row' applies when a table file is written; .* holds raw rows"):
            emb.set_backend("disk", {**DISK, "quantize": "fp8_row"})
        assert torch.equal(bits(emb(torch.tensor([4]))), bits(rows[[4]]))  # left as it was
        emb.close()
        with pytest.raises(RuntimeError, match="no table"):
            FileEmbedding(ROWS, DIM, **kw).read_table()
    finally:
        f.close()
    inf = rand(ROWS, DIM, torch.bfloat16, seed=14)
    inf[200, 3] = float("inf")
    with pytest.raises(TableFileError, match="row 200 holds inf or NaN"):
        table_file_for(tmp_path / "inf.uvtable", fp8_row_source(RowSource.of(inf)), encoding="fp8_row")
    assert not (tmp_path / "inf.uvtable").exists()
    with pytest.raises(TypeError, match="fp8_row quantises bf16, fp16 or fp32 rows, not torch.int32"):
        fp8_row_source(RowSource.of(torch.zeros(4, 4, dtype=torch.int32)))


def test_a_weight_is_not_written_over_a_checkpoints_fp8_codes(tmp_path):
    codes = rand(ROWS, DIM, torch.float32, seed=15).to(torch.float8_e4m3fn)
    path = tmp_path / "g.uvtable"
    write_table_file(path, codes, encoding="fp8_global", source_id="ckpt")
    before = path.read_bytes()
    emb = FileEmbedding(ROWS, DIM, TableFile.open(path), out_dtype=torch.bfloat16, weight_scale=torch.ones(1),
                        table_path=path, backend_options=DISK, max_tokens=8)
    with pytest.raises(TypeError, match="serves an fp8_global file .* a weight is not written into it"):
        emb.load_weight_(torch.ones(ROWS, DIM))
    with pytest.raises(RuntimeError, match="a weight is not written into it"):
        emb.load_state_dict({"weight": torch.ones(ROWS, DIM), "weight_scale": torch.ones(1)})
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["g.uvtable"]
    assert torch.equal(emb(torch.tensor([1])), codes[[1]].to(torch.bfloat16))
    raw = FileEmbedding(ROWS, DIM, out_dtype=torch.bfloat16, table_path=tmp_path / "r.uvtable", backend_options=DISK,
                        max_tokens=8)
    with pytest.raises(ValueError, match="writes a bf16, fp16 or fp32 weight, got torch.int64"):
        raw.load_weight_(torch.ones(ROWS, DIM, dtype=torch.long))
    assert not (tmp_path / "r.uvtable").exists()
    emb.close()
    raw.close()


def test_a_copy_keeps_the_bytes_it_was_made_from_when_the_path_is_written_again(tmp_path, device):
    a, b = rand(ROWS, DIM, torch.bfloat16, seed=16), rand(ROWS, DIM, torch.bfloat16, seed=17)
    path = tmp_path / "t.uvtable"
    write_table_file(path, a)
    emb = FileEmbedding(ROWS, DIM, TableFile.open(path), out_dtype=torch.bfloat16, backend_options={"slots": ROWS},
                        max_tokens=ROWS)
    write_table_file(path, b, overwrite=True)  # another table renamed over the path
    twin = copy.deepcopy(emb)
    every = torch.arange(ROWS, device=device)
    assert torch.equal(bits(twin(every).cpu()), bits(a)) and torch.equal(bits(emb(every).cpu()), bits(a))
    write_table_file(path, b[:, :8].contiguous(), overwrite=True)  # and one of another shape: still a's bytes
    assert torch.equal(bits(copy.deepcopy(twin)(every).cpu()), bits(a))
    emb.close()
    twin.close()


def test_compiled_code_calls_the_disk_lookup_eagerly_and_fullgraph_names_why(tmp_path, device):
    """torch.compile never traces a disk call (host planning, a lock, file reads): with graph breaks allowed it runs
    eagerly between the compiled parts, with the same bits; fullgraph=True refuses it, saying why."""
    rows = rand(ROWS, DIM, torch.bfloat16, seed=19)
    write_table_file(tmp_path / "t.uvtable", rows)
    emb = FileEmbedding(ROWS, DIM, TableFile.open(tmp_path / "t.uvtable"), out_dtype=torch.bfloat16,
                        embed_scale=2.0, backend_options=DISK, max_tokens=64)

    def step(ids):
        return emb(ids * 3 % ROWS) + 1.0  # work before and after the lookup

    ids = ids_of(48, 20, device).clamp(0, ROWS - 1)
    want = step(ids).clone()
    torch._dynamo.reset()
    try:
        assert torch.equal(bits(torch.compile(step, backend="eager")(ids)), bits(want))
        torch._dynamo.reset()
        with pytest.raises(Exception, match="disk placement plans each call on the host"):
            torch.compile(step, backend="eager", fullgraph=True)(ids)
    finally:
        torch._dynamo.reset()
        emb.close()


def test_a_second_writer_of_a_folder_waits_for_the_first_then_reuses_its_file(tmp_path):
    """Two processes loading the same tables into one folder: the folder's lock has the second wait while the first
    writes, then open the file the first wrote (never write it twice, nor both run out of space)."""
    import fcntl
    import threading

    rows = rand(ROWS, DIM, torch.bfloat16, seed=21)
    path = tmp_path / "t.uvtable"
    got = {}
    fd = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the first writer holds the folder (its own open: another lock owner)
    second = threading.Thread(target=lambda: got.update(file=table_file_for(path, RowSource.of(rows),
                                                                            source_id="ckpt")))
    second.start()
    second.join(0.5)
    assert second.is_alive() and not path.exists()  # waiting
    write_table_file(path, rows, source_id="ckpt")  # the first writes it
    inode = os.stat(path).st_ino
    os.close(fd)  # and lets go
    second.join(30)
    assert not second.is_alive() and os.stat(path).st_ino == inode  # reused, not written again
    with got["file"] as f:
        assert torch.equal(f.read_rows(torch.arange(ROWS)), rows)

"""The disk placement: a table file read through a host row cache, each call planned on the host, the gather over the
cache in the caller's stream. Bits against the reference for every encoding and row policy over many steps with
evictions; slots of a step in flight never taken before the completion word passes it, the wait bounded and named;
a full cache, a damaged or truncated file, bad options and calls each a named error that serves nothing stale.
Real files, real reads; the gather interpreted on CPU, compiled over UVA on CUDA."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from helpers import bits, in_forked_child, rand

from uvaple.integration import DiskLookup, DiskStepTimeout, TableSpec, make_lookup
from uvaple.integration.errors import BackendClosed
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable, PageReader, RowCacheFull, TableFile, TableFileError, uring, write_table_file
from uvaple.uva.errors import TableClosedError
from uvaple.uva.table_file import PAGE

POISON = -31.0


def fp8_row_rows(rows: int, values: int, fmt, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, values), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x21  # no NaN codes (e4m3fn): their payloads are the device's
    scales = (torch.rand(rows, generator=g) + 0.05).view(-1, 1)
    return torch.cat([codes, scales.view(torch.uint8).reshape(-1, 4)], dim=1).view(fmt)


# (rows of the file, its encoding, spec options, a global scale)
KINDS = {
    "bf16 scaled row0": (lambda: rand(900, 40, torch.bfloat16, seed=1), "raw",
                         dict(scale=16.0, oob="row0", row_window=(30, 870)), None),
    "fp32 to bf16 window": (lambda: rand(700, 13, torch.float32, seed=2), "raw",
                            dict(out_dtype=torch.bfloat16, row_window=(50, 650), id_offset=7), None),
    "fp8_row neg_zero": (lambda: fp8_row_rows(800, 24, torch.float8_e4m3fn, 3), "fp8_row",
                         dict(oob="neg_zero", out_dtype=torch.bfloat16), None),
    "fp8_global e5m2 fp16": (lambda: rand(600, 32, torch.float32, seed=4).to(torch.float8_e5m2), "fp8_global",
                             dict(out_dtype=torch.float16), 0.0625),
}


def table_file(tmp_path, kind: str):
    make, encoding, opts, scale = KINDS[kind]
    t = make()
    path = tmp_path / f"{kind.replace(' ', '_')}.uvt"
    write_table_file(path, t, encoding=encoding)
    return t, path, encoding, opts, scale


def reference(t, ids, spec: TableSpec, scale):
    return reference_gather(t, ids, scale=spec.scale, oob=spec.oob, out_dtype=spec.output_dtype,
                            dequant_scale=None if scale is None else torch.tensor([scale]), rows=spec.window,
                            id_base=spec.id_offset, encoding=spec.encoding)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_call_is_the_references_bits_over_steps_that_evict(tmp_path, device, kind):
    """Twelve calls of random shapes and id dtypes (ids below, inside and past the window) through a cache of 90
    slots: hits, misses and evictions; each call's rows are the reference's, every output row written."""
    t, path, encoding, opts, scale = table_file(tmp_path, kind)
    with TableFile.open(path) as f:
        spec = TableSpec.of(f, **opts)
    dq = None if scale is None else torch.tensor([scale], device=device)
    g = torch.Generator().manual_seed(5)
    with make_lookup("disk", str(path), device=device, spec=spec, max_rows=70, slots=90, dequant_scale=dq) as lk:
        assert isinstance(lk, DiskLookup) and lk.spec.encoding == encoding
        outside = 0
        for step in range(12):
            shape = [(1,), (7,), (3, 11), (2, 5, 7)][step % 4]
            ids = torch.randint(-20, t.shape[0] + 20, shape, generator=g, dtype=torch.int32 if step % 2 else
                                torch.int64)
            out = torch.full((*shape, spec.value_cols), POISON, dtype=spec.output_dtype, device=device)
            assert lk.lookup(ids, out) is out
            assert torch.equal(bits(out), bits(reference(t, ids, spec, scale))), step
            rows = ids.long() - spec.id_offset
            outside += int(((rows < spec.window[0]) | (rows >= spec.window[1])).sum())
        st = lk.stats()
        assert st["lookups"] == 12 and st["out_of_range_ids"] == outside and st["completed_step"] == 12
        assert st["cache"]["evictions"] > 0 and st["cache"]["hits"] > 0
    assert lk.file.closed  # opened from its path by make_lookup: closed with the lookup


def test_each_staging_row_serves_calls_of_any_shape(tmp_path, device, monkeypatch):
    """Three staging rows and calls of four shapes in turn, so that each row serves every shape; the gather's views
    of them kept for at most two (row, shape) pairs, so that they are dropped and made again: every call's rows
    are the table's."""
    from uvaple.integration.placements import disk

    monkeypatch.setattr(disk, "_VIEWS_KEPT", 2)
    t = rand(500, 24, torch.float32, seed=9)
    write_table_file(tmp_path / "t.uvt", t)
    g = torch.Generator().manual_seed(3)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=40, slots=120,
                     steps_in_flight=3) as lk:
        for step in range(14):
            shape = [(5,), (2, 3), (40,), (1, 1, 4)][step % 4]
            ids = torch.randint(0, 500, shape, generator=g)
            out = torch.full((*shape, 24), POISON, device=device)
            lk.lookup(ids, out)
            assert torch.equal(out.cpu(), t[ids]), step
            assert len(lk._call[3]) <= 2  # (the views by staging row and shape)


def test_closing_releases_the_host_tables_and_a_close_during_a_call_is_named(tmp_path, device):
    """Closing the lookup releases its host tables (the cache's rows, map and word, the staging) at once, not when
    the object is dropped, and its stats stay. A close() landing inside a call, as its reads begin (where another
    thread's would), is a named error on that call, whose views keep the memory until it returns; the next call
    is the closed lookup's named error."""
    t = rand(500, 24, torch.float32, seed=12)
    write_table_file(tmp_path / "t.uvt", t)
    ids = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(4))

    def opened():
        lk = make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=40, slots=120)
        assert torch.equal(lk.lookup(ids).cpu(), t[ids])
        return lk, (lk.cache.rows, lk.cache._map, lk.cache._word, lk._staging)

    def interpreted():
        if device.type == "cpu":  # the Triton interpreter's run of a gather holds its arguments in a reference
            gc.collect()  # cycle until a gc pass (a compiled launch does not)

    opened()[0].close()  # (a first lookup of the process: whatever compiles at its first call has compiled)
    gc.collect()
    lk, tables = opened()
    lk.close()
    interpreted()
    assert all(h.released for h in tables)
    st = lk.stats()
    assert st["closed"] and st["lookups"] == 1 and st["completed_step"] is None

    lk, tables = opened()
    read_in = lk.cache.read_in

    def closed_meanwhile(*args):
        lk.close()
        assert not any(h.released for h in tables[2:])  # the call's own views of the word and the staging hold them
        return read_in(*args)

    lk.cache.read_in = closed_meanwhile
    with pytest.raises(TableClosedError, match="row cache is closed"):
        lk.lookup(ids)
    interpreted()
    assert all(h.released for h in tables)
    with pytest.raises(BackendClosed, match="lookup was closed"):
        lk.lookup(ids)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hot_rows_come_from_device_memory_and_the_others_through_the_cache(tmp_path, device, kind):
    """Every fifth row of the window held in device memory: calls of random ids (hot, cached, missing, outside
    the window) through a cache that evicts are the reference's bits; a call of hot ids only reads no page and
    plans nothing in the cache; every id a hot row serves is a hot hit (under row0, an id outside the window
    too: it reads the window's first row)."""
    t, path, encoding, opts, scale = table_file(tmp_path, kind)
    with TableFile.open(path) as f:
        spec = TableSpec.of(f, **opts)
    lo, hi = spec.window
    hot = torch.arange(lo, hi, 5)
    dq = None if scale is None else torch.tensor([scale], device=device)
    g = torch.Generator().manual_seed(6)
    with make_lookup("disk", str(path), device=device, spec=spec, max_rows=70, slots=60, dequant_scale=dq,
                     hot_rows=hot.flip(0).to(device)) as lk:  # a profile's rows may come on the GPU
        hot_ids = 0
        for step in range(10):
            shape = [(1,), (7,), (3, 11), (2, 5, 7)][step % 4]
            ids = torch.randint(-20, t.shape[0] + 20, shape, generator=g)
            ids.view(-1)[0] = int(hot[step]) + spec.id_offset  # a hot id in every call
            out = torch.full((*shape, spec.value_cols), POISON, dtype=spec.output_dtype, device=device)
            assert lk.lookup(ids, out) is out
            assert torch.equal(bits(out), bits(reference(t, ids, spec, scale))), step
            rows = ids - spec.id_offset
            inside = (rows >= lo) & (rows < hi)
            if spec.oob == "row0":  # an id outside the window reads the window's first row, itself hot
                rows, inside = torch.where(inside, rows, lo), torch.ones_like(inside)
            hot_ids += int((torch.isin(rows, hot) & inside).sum())
        st = lk.stats()
        assert st["hot_hits"] == hot_ids and st["hot_rows"] == hot.numel() and st["cache"]["evictions"] > 0
        ids = hot[[4, 0, 9, 4]] + spec.id_offset
        before = lk.stats()
        out = lk.lookup(ids)
        assert torch.equal(bits(out), bits(reference(t, ids, spec, scale)))
        after = lk.stats()
        rows_of = {k: v for k, v in before["cache"].items() if k != "steps"}  # a step is still numbered
        assert after["pages_read"] == before["pages_read"] and {k: after["cache"][k] for k in rows_of} == rows_of
        assert after["hot_hits"] == before["hot_hits"] + 4 and lk.progress().hot_hits == after["hot_hits"]
        assert lk.device_bytes() == (hot.numel() * f_stride(path) + (60 + hot.numel()) * 4 if device.type == "cuda"
                                     else 0)


def f_stride(path) -> int:
    """Bytes of a row at the table file's (and its cache's) row stride."""
    with TableFile.open(path) as f:
        return f.layout.stride


def test_bad_hot_rows_are_named(tmp_path, device):
    t = rand(100, 8, torch.bfloat16, seed=16)
    write_table_file(tmp_path / "t.uvt", t)
    with TableFile.open(tmp_path / "t.uvt") as f:
        spec = TableSpec.of(f, row_window=(10, 90))
        for hot, match in [([], "non-empty 1-D sequence"), ([[1, 2]], "non-empty 1-D sequence"),
                           ([1.5], "non-empty 1-D sequence"), ([10, 90], "rows of the table's window 10 .. 89"),
                           ([9], "rows of the table's window")]:
            with pytest.raises(ValueError, match=match):
                make_lookup("disk", f, device=device, spec=spec, max_rows=4, slots=4, hot_rows=hot)
        with make_lookup("disk", f, device=device, spec=spec, max_rows=4, slots=4, hot_rows=[10, 89, 10]) as lk:
            assert lk.stats()["hot_rows"] == 2  # once each
            assert torch.equal(bits(lk.lookup(torch.tensor([89, 10, 11]))), bits(t[[89, 10, 11]]))


def set_completed(lk, step: int) -> None:
    """Set the lookup's completion word by hand, once the GPU's own writes of it (in stream order, after each
    step's gathers) have all landed: otherwise a step's late write overtakes the hand-set value."""
    if lk.device.type == "cuda":
        torch.cuda.synchronize(lk.device)
    lk.cache.completed.fill_(step)


def test_a_step_never_takes_the_slots_of_a_step_in_flight(tmp_path, device):
    """Seed 004's race, driven by hand: with the completion word held back, the previous step's slots and bytes stay
    as they are while the next step, which needs them, waits; the word advanced, it evicts them and is exact."""
    t = rand(400, 16, torch.bfloat16, seed=6)
    write_table_file(tmp_path / "t.uvt", t)
    lk = make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=40, slots=40, wait_s=5.0)
    first = torch.arange(0, 40)
    lk.lookup(first)
    set_completed(lk, 0)  # step 1 is "still on the GPU"
    held = lk.cache.slots_of(first.numpy())
    before = lk.cache.rows.tensor[torch.from_numpy(held)].clone()
    seen = {}

    def complete_later():
        deadline = time.monotonic() + 10
        while lk.cache.planned < 2 and time.monotonic() < deadline:  # until step 2 met the full cache
            time.sleep(0.01)
        time.sleep(0.3)  # ... and has waited a while
        seen["planned"] = lk.cache.planned
        seen["slots"] = lk.cache.slots_of(first.numpy())
        seen["rows"] = lk.cache.rows.tensor[torch.from_numpy(held)].clone()
        lk.cache.completed.fill_(1)

    later = threading.Thread(target=complete_later)
    t0 = time.monotonic()
    later.start()
    second = torch.arange(100, 140)
    got = lk.lookup(second)  # needs all 40 slots: waits for step 1
    waited = time.monotonic() - t0
    later.join()
    assert seen["planned"] == 2 and waited >= 0.3  # step 2 met the full cache and waited for step 1
    assert (seen["slots"] == held).all() and torch.equal(bits(seen["rows"]), bits(before))  # step 1's, untouched
    assert torch.equal(bits(got), bits(reference_gather(t, second)))
    assert (lk.cache.slots_of(first.numpy()) == -1).all()  # evicted once step 1 was complete
    lk.close()


def test_the_wait_for_steps_in_flight_is_bounded_and_named(tmp_path, device):
    """A step waits for the steps in flight whose slots, or whose staging row, it needs; never longer than
    ``wait_s``, then a named error; served once they complete."""
    t = rand(300, 8, torch.float32, seed=7)
    write_table_file(tmp_path / "t.uvt", t)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=30, slots=30, wait_s=0.2) as lk:
        lk.lookup(torch.arange(30))
        set_completed(lk, 0)  # step 1 still reads every slot
        t0 = time.monotonic()
        with pytest.raises(DiskStepTimeout, match="step 2 of this disk lookup waited 0.2 s for slots of the steps "
                                                  "in flight: step 1 has not completed"):
            lk.lookup(torch.arange(30, 60))
        assert time.monotonic() - t0 < 5.0
        set_completed(lk, 1)
        assert torch.equal(bits(lk.lookup(torch.arange(30, 60))), bits(t[30:60]))  # then served, exactly
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=30, slots=100, wait_s=0.2,
                     steps_in_flight=2) as lk:
        lk.lookup(torch.tensor([1]))
        lk.lookup(torch.tensor([2]))
        set_completed(lk, 1)  # step 2 in flight: step 3 takes step 1's staging row, which is free
        assert torch.equal(bits(lk.lookup(torch.tensor([3]))), bits(t[[3]]))
        set_completed(lk, 1)
        with pytest.raises(DiskStepTimeout, match="step 4 of this disk lookup waited 0.2 s for its staging row "
                                                  "\\(step 2's\\)"):
            lk.lookup(torch.tensor([4]))  # step 4 takes step 2's


def test_a_step_larger_than_the_cache_is_named_and_the_next_one_served(tmp_path, device):
    t = rand(300, 8, torch.bfloat16, seed=8)
    write_table_file(tmp_path / "t.uvt", t)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=100, slots=20) as lk:
        with pytest.raises(RowCacheFull, match="needs 50 rows read in, but only 20 of the cache's 20 slots"):
            lk.lookup(torch.arange(50))
        assert (lk.cache.slots_of(np.arange(50)) == -1).all()  # nothing half-mapped
        ids = torch.tensor([3, 250, 3, 7])
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))


def test_a_call_that_fails_after_its_plan_completes_its_step_and_maps_nothing_it_placed(tmp_path, device,
                                                                                        monkeypatch):
    """An interrupt while a step's misses are read: none of them stays mapped, the step completes in stream order
    (its hits are not held for a step that never runs), and a next call needing every slot is served at once."""
    t = rand(300, 8, torch.bfloat16, seed=14)
    write_table_file(tmp_path / "t.uvt", t)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=40, slots=20, wait_s=0.5) as lk:
        lk.lookup(torch.arange(20))
        # met by the reader's ring on this thread, or by its threads and raised on this one
        where = "_read_uring" if lk._reader.engine == "uring" else "_read_share"
        monkeypatch.setattr(PageReader, where, lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            lk.lookup(torch.cat([torch.arange(10), torch.arange(100, 110)]))  # 10 hits, 10 misses
        monkeypatch.undo()
        if device.type == "cuda":
            torch.cuda.synchronize()  # the completion word, written in stream order
        assert (lk.cache.slots_of(np.arange(100, 110)) == -1).all()
        assert lk.stats()["planned_step"] == 2 and lk.cache.done() == 2
        ids = torch.arange(200, 220)  # every slot, the failed step's hits' too: a wait for step 2 would time out
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))


@pytest.mark.parametrize("fault", ["a page changed", "truncated"])
def test_a_damaged_file_is_named_and_no_stale_row_is_served(tmp_path, device, fault):
    t = rand(2000, 16, torch.bfloat16, seed=9)
    path = tmp_path / "t.uvt"
    write_table_file(path, t)
    with make_lookup("disk", str(path), device=device, max_rows=64, slots=12, steps_in_flight=1) as lk:
        assert torch.equal(bits(lk.lookup(torch.arange(10))), bits(t[:10]))
        rows_per_page = PAGE // 32
        page = 1500 // rows_per_page
        with open(path, "r+b") as f:
            if fault == "a page changed":
                f.seek((1 + page) * PAGE + 100)
                f.write(b"\xff\x00\xff")
            else:
                f.truncate((1 + page) * PAGE + 10)
        out = torch.full((3, 16), POISON, dtype=torch.bfloat16, device=device)
        match = f"data page {page} does not match its sum" if fault == "a page changed" else "ended at byte"
        with pytest.raises(TableFileError, match=match):
            lk.lookup(torch.tensor([2, 1500, 4]), out)
        assert bool((out == POISON).all())  # nothing written
        assert (lk.cache.slots_of(np.array([1500])) == -1).all()  # the row that failed is not mapped
        assert torch.equal(bits(lk.lookup(torch.tensor([2, 4, 9]))), bits(t[[2, 4, 9]]))  # cached rows still served
        ids = torch.arange(20, 32)  # every slot, those the failed call kept too; its staging row (steps_in_flight 1)
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))


def test_threads_calling_one_lookup_get_their_own_rows(tmp_path, device):
    """Four threads share one lookup whose cache holds a fraction of the rows they ask for: each call is planned,
    read and gathered whole before the next (the lookup's lock), so every thread gets its own ids' rows."""
    t = rand(3000, 24, torch.bfloat16, seed=15)
    write_table_file(tmp_path / "t.uvt", t)
    failures = []
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=50, slots=200) as lk:
        def run(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            for _ in range(15):
                ids = torch.randint(0, 3000, (50,), generator=g)
                got = lk.lookup(ids)
                if device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
                if not torch.equal(bits(got), bits(t[ids])):
                    failures.append(seed)

        if device.type == "cuda":
            lk.lookup(torch.tensor([0]))  # the default stream is every thread's: the lookup's
        threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads) and failures == []
        assert lk.stats()["lookups"] == 60 + (device.type == "cuda")


def test_bad_options_and_calls_are_named(tmp_path, device):
    t = rand(100, 8, torch.bfloat16, seed=10)
    path = tmp_path / "t.uvt"
    write_table_file(path, t)
    with HostTable.from_tensor(t) as h:
        with pytest.raises(TypeError, match="the disk placement reads a table file: pass its path or a "
                                            "uvaple.uva.TableFile .* got HostTable"):
            make_lookup("disk", h, device=device, max_rows=4, slots=4)
    with TableFile.open(path) as f:
        with pytest.raises(TypeError, match="a table file is read by the \\['disk'\\] placement, not 'uva'"):
            make_lookup("uva", f, device=device)
        cases = [
            (dict(slots=4), ValueError, "the disk placement needs max_rows"),
            (dict(max_rows=4), ValueError, "needs exactly one of budget_bytes .* or slots .* got neither"),
            (dict(max_rows=4, slots=4, budget_bytes=1 << 20), ValueError, "got budget_bytes and slots"),
            (dict(max_rows=4, budget_bytes=3), ValueError, "budget must hold at least one row"),
            (dict(max_rows=4, budget_bytes="4G"), ValueError, "budget_bytes must be a positive int, got '4G'"),
            (dict(max_rows=4, slots=64.0), ValueError, "slots must be a positive int, got 64.0"),
            (dict(max_rows=4, slots=4, steps_in_flight=0), ValueError, "steps_in_flight must be a positive int"),
            (dict(max_rows=4, slots=4, read_depth=0), ValueError, "read_depth must be a positive int, got 0"),
            (dict(max_rows=4, slots=4, wait_s=-1), ValueError, "wait_s must be a number of seconds > 0"),
            (dict(max_rows=4, slots=4, read_engine="aio"), ValueError,
             "read_engine must be one of 'auto', 'uring', 'threads', got 'aio'"),
            (dict(max_rows=4, slots=4, dedup=True), ValueError, "takes no option \\['dedup'\\] \\(its options: "
                                                                "\\['budget_bytes', 'dequant_scale', 'hot_rows'"),
            (dict(max_rows=4, slots=4, dequant_scale=torch.ones(1)), ValueError, "dequant_scale is for fp8_global"),
        ]
        for kw, error, match in cases:
            with pytest.raises(error, match=match):
                make_lookup("disk", f, device=device, **kw)
        for engine in ("threads", "auto"):  # each reader serves the same rows
            with make_lookup("disk", f, device=device, max_rows=4, slots=4, read_engine=engine) as lk:
                assert lk._reader.engine == ("threads" if engine == "threads" or uring.unavailable() else "uring")
                assert torch.equal(bits(lk.lookup(torch.tensor([7, 2, 9]))), bits(t[torch.tensor([7, 2, 9])]))
        lk = make_lookup("disk", f, device=device, max_rows=4, slots=4)
        with pytest.raises(ValueError, match="5 ids in one call, but this lookup was built for max_rows=4"):
            lk.lookup(torch.arange(5))
        with pytest.raises(TypeError, match="ids must be an int32 or int64 tensor"):
            lk.lookup(torch.arange(3).float())
        if device.type == "cuda":  # ids on the device are copied to the host: the same rows
            assert torch.equal(bits(lk.lookup(torch.arange(3, device=device))), bits(t[:3]))
        assert torch.equal(bits(lk.lookup(torch.tensor([[1, 2]]))), bits(t[torch.tensor([[1, 2]])]))
        lk.close()
        with pytest.raises(BackendClosed):
            lk.lookup(torch.tensor([1]))
        assert not f.closed  # a TableFile passed in is the caller's
    write_table_file(tmp_path / "codes.uvt", t.float().to(torch.float8_e4m3fn))  # fp8 codes stored raw
    with TableFile.open(tmp_path / "codes.uvt") as f, pytest.raises(ValueError, match="codes.uvt holds raw rows; "
                                                                                    "the spec says 'fp8_row'"):
        make_lookup("disk", f, device=device, spec=TableSpec.of(f, encoding="fp8_row"), max_rows=4, slots=4)
    with pytest.raises(TableFileError, match="cannot open the table file"):
        make_lookup("disk", str(tmp_path / "missing.uvt"), device=device, max_rows=4, slots=4)


def test_a_row_cache_larger_than_host_memory_is_named_by_its_own_option(tmp_path, device, monkeypatch):
    from uvaple.uva import HostMemoryError, system

    write_table_file(tmp_path / "t.uvt", rand(900, 40, torch.bfloat16, seed=11))
    monkeypatch.setattr(system, "mem_available_bytes", lambda: 8 << 10)  # less than the 900 rows' 72 KiB
    with pytest.raises(HostMemoryError, match="the disk placement's row cache \\(budget_bytes=1099511627776, "
                                              "slots=None\\) does not fit in host memory: give it a smaller"):
        make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=4, budget_bytes=1 << 40)


def test_a_forked_child_is_refused_by_name(tmp_path, device):
    if device.type == "cuda":
        pytest.skip("a CUDA parent does not fork (its tests use spawn)")
    t = rand(100, 8, torch.bfloat16, seed=11)
    write_table_file(tmp_path / "t.uvt", t)
    lk = make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=4, slots=4)
    assert in_forked_child(lambda: lk.lookup(torch.tensor([1]))) == "LookupForkedError"
    lk.close()


@pytest.mark.gpu
def test_gpu_ids_on_the_device_are_read_after_the_work_that_writes_them(tmp_path):
    """Ids on the GPU, written by a copy queued behind a sleeping stream: each call copies them to the host after
    that work (its one synchronisation), so its rows are those ids' rows, the bits of the same ids passed on the
    host; int32 and int64 ids, shaped; the poison the ids held before (-1, a zero row) is never what is read."""
    device = torch.device("cuda")
    t = rand(3000, 96, torch.bfloat16, seed=14)
    write_table_file(tmp_path / "t.uvt", t)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=64, slots=100) as lk, \
            make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=64, slots=100) as host_lk:
        lk.lookup(torch.arange(8), torch.empty(8, 96, dtype=torch.bfloat16, device=device))  # the gather's JIT
        torch.cuda.synchronize()
        g = torch.Generator().manual_seed(15)
        for step in range(6):
            shape = [(5,), (4, 16), (64,)][step % 3]
            want = torch.randint(0, 3000, shape, generator=g, dtype=torch.int32 if step % 2 else torch.int64)
            src = want.to(device)
            ids = torch.full(shape, -1, dtype=want.dtype, device=device)
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # ~50 ms: the ids are written well after the call is made
            ids.copy_(src)
            out = torch.full((*shape, 96), POISON, dtype=torch.bfloat16, device=device)
            lk.lookup(ids, out)
            on_host = host_lk.lookup(want)
            torch.cuda.synchronize()
            assert torch.equal(bits(out), bits(t[want.long()])), step
            assert torch.equal(bits(out), bits(on_host)), step
        assert lk.stats()["lookups"] == 7 and lk.stats()["out_of_range_ids"] == 0


@pytest.mark.gpu
def test_gpu_hot_rows_outlive_a_close_while_their_gathers_are_queued_on_another_stream(tmp_path):
    """The hot rows and their slot map are made on the stream current when the lookup is built; its gathers run on
    another. Closed while gathers are queued there, their blocks are not handed to the building stream's next
    allocations before those gathers have run: the rows come out exact though that stream fills new blocks at
    once."""
    device = torch.device("cuda")
    t = rand(2000, 64, torch.bfloat16, seed=17)
    write_table_file(tmp_path / "t.uvt", t)
    lk = make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=32, slots=64,
                     hot_rows=torch.arange(0, 2000, 2))
    ids = torch.arange(0, 64, 2)  # 32 hot rows
    out = torch.full((32, 64), POISON, dtype=torch.bfloat16, device=device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        lk.lookup(torch.arange(4), torch.empty(4, 64, dtype=torch.bfloat16, device=device))  # the JIT, this stream
        side.synchronize()
        torch.cuda._sleep(200_000_000)  # ~100 ms
        lk.lookup(ids, out)
        lk.close()
    junk = [torch.full((n,), -1, dtype=torch.int32, device=device) for n in (1066, 32_768, 1066, 32_768) * 8]
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(t[ids])) and len(junk) == 32


@pytest.mark.gpu
def test_gpu_steps_queued_behind_a_busy_stream_wait_for_their_slots_and_stay_exact(tmp_path):
    """Many steps queued while the stream sleeps, through a cache that only holds two steps' rows: each call waits on
    the completion word (no synchronisation) for the slots it evicts; every output exact. A capture is refused by
    name."""
    device = torch.device("cuda")
    t = rand(5000, 160, torch.bfloat16, seed=12)
    write_table_file(tmp_path / "t.uvt", t)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=64, slots=128,
                     steps_in_flight=3) as lk:
        g = torch.Generator().manual_seed(13)
        calls = [torch.randint(0, 5000, (64,), generator=g) for _ in range(20)]
        outs = [torch.full((64, 160), POISON, dtype=torch.bfloat16, device=device) for _ in calls]
        lk.lookup(torch.arange(64), torch.empty(64, 160, dtype=torch.bfloat16, device=device))  # the gather's JIT
        torch.cuda.synchronize()  # compile (seconds) done before the sleep, or the stream is idle again by then
        torch.cuda._sleep(2_000_000_000)  # ~1 s: the host plans far ahead of the stream
        for ids, out in zip(calls, outs, strict=True):
            lk.lookup(ids, out)
        assert lk.stats()["waits"] > 0  # some call found its slots or its staging row still read, and waited
        torch.cuda.synchronize()
        for ids, out in zip(calls, outs, strict=True):
            assert torch.equal(bits(out), bits(t[ids]))
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graphs cannot capture it"):
            with torch.cuda.graph(graph):
                lk.lookup(calls[0], outs[0])


@pytest.mark.gpu
def test_gpu_a_call_on_another_stream_completes_after_the_last_calls_step(tmp_path):
    """Steps queued on one stream behind a sleep, then calls on an idle stream through a cache that holds four
    steps' rows (the third call fits beside the two queued and the JIT's, the fifth waits for a slot): the new
    stream's completion word waits for the old stream's (the host sees no step completed while the old stream
    sleeps), so no slot a queued gather reads is handed to another row, and every output is exact. Without the
    wait the idle stream writes its word at once and the next plan evicts rows the sleeping gathers read."""
    device = torch.device("cuda")
    t = rand(4000, 160, torch.bfloat16, seed=21)
    write_table_file(tmp_path / "t.uvt", t)
    with make_lookup("disk", str(tmp_path / "t.uvt"), device=device, max_rows=64, slots=256,
                     steps_in_flight=8, wait_s=30) as lk:
        g = torch.Generator().manual_seed(22)
        calls = [torch.randperm(4000, generator=g)[:64] for _ in range(6)]  # 64 distinct rows a call
        outs = [torch.full((64, 160), POISON, dtype=torch.bfloat16, device=device) for _ in calls]
        lk.lookup(torch.arange(64), torch.empty(64, 160, dtype=torch.bfloat16, device=device))  # the gather's JIT
        torch.cuda.synchronize()
        first, second = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(first):
            torch.cuda._sleep(2_000_000_000)  # ~1 s
            lk.lookup(calls[0], outs[0])
            lk.lookup(calls[1], outs[1])
        done = lk.cache.done()
        with torch.cuda.stream(second):  # idle: without the wait its words would be written at once
            lk.lookup(calls[2], outs[2])
            time.sleep(0.05)
            assert lk.cache.done() == done  # the first stream still sleeps: no later step completed
            for ids, out in zip(calls[3:], outs[3:], strict=True):  # each evicts what an earlier step read
                lk.lookup(ids, out)
        assert lk.stats()["waits"] > 0
        torch.cuda.synchronize()
        assert lk.cache.done() == lk.stats()["planned_step"]
        for ids, out in zip(calls, outs, strict=True):
            assert torch.equal(bits(out), bits(t[ids]))
        with torch.cuda.stream(first):  # and back: the first stream now waits for the second's word
            assert torch.equal(bits(lk.lookup(calls[0])), bits(t[calls[0]]))

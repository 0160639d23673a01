"""The disk table's host row cache: rows served by slot are the table's rows, a step in flight keeps its slots,
CLOCK keeps rows read again, and a step that does not fit or a read that fails leaves no row mapped to a slot
that does not hold it. Real host tables and a real table file; the completion word written by the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import in_forked_child, rand

import uvaple.kernels  # noqa: F401 - registers uvaple::gather_rows
from uvaple.uva import TableClosedError, row_cache
from uvaple.uva.row_cache import RowCache, RowCacheFull
from uvaple.uva.table_file import TableFile, TableFileError, write_table_file

ROWS, COLS = 5_000, 40  # bf16: 80-byte rows, 51 to a page


@pytest.fixture(scope="module")
def source() -> torch.Tensor:
    return rand(ROWS, COLS, seed=12)


@pytest.fixture(scope="module")
def table_file(source, tmp_path_factory):
    path = tmp_path_factory.mktemp("row_cache") / "table.uvt"
    write_table_file(path, source)
    with TableFile.open(path) as f:
        yield f


def consistent(cache: RowCache, source: torch.Tensor) -> None:
    """The map and its reverse agree, and every mapped row's slot holds that row's bits."""
    slot_of = cache.slots_of(np.arange(cache.table_rows))
    mapped = np.flatnonzero(slot_of >= 0)
    slots = slot_of[mapped]
    assert len(np.unique(slots)) == len(slots)  # no two rows in one slot
    assert (cache._state()[1][slots] == mapped).all()
    assert torch.equal(cache.rows.tensor[torch.from_numpy(slots)].view(torch.int16),
                       source[torch.from_numpy(mapped)].view(torch.int16))


def step(cache: RowCache, file: TableFile, rows, n: int):
    misses = cache.plan(rows, n)
    cache.fill(misses, file)
    return misses


def test_rows_served_by_slot_are_the_tables_over_random_steps_in_flight(source, table_file):
    """Random steps (repeats, hot rows and one-off rows), up to three in flight; after each, every row of
    every step in flight still has its slot and its bits, and the map is one-to-one."""
    g = np.random.default_rng(3)
    hot = g.choice(ROWS, 300, replace=False)
    with RowCache.for_file(table_file, slots=1_200, register=False) as cache:
        cache.rows.tensor.view(torch.int16).fill_(-21846)  # poison (0xAAAA): a slot read unfilled shows
        held: dict[int, np.ndarray] = {}
        for n in range(1, 120):
            rows = np.concatenate([g.choice(hot, g.integers(1, 120)), g.integers(0, ROWS, g.integers(0, 120))])
            step(cache, table_file, rows, n)
            held[n] = rows
            lag = int(g.integers(0, 4))
            if n - lag > cache.done():
                cache.complete(n - lag)
            for k in [k for k in held if k <= cache.done()]:
                del held[k]
            for k, kept in held.items():  # a step in flight: its rows are where it will read them
                slots = cache.slots_of(kept)
                assert (slots >= 0).all(), k
                got = cache.rows.tensor[torch.from_numpy(slots)]
                assert torch.equal(got.view(torch.int16), source[torch.from_numpy(kept)].view(torch.int16))
            consistent(cache, source)
        st = cache.stats
        assert st["steps"] == 119 and st["hits"] > 0 and st["misses"] > 1_200 and st["evictions"] > 0


def test_a_step_reads_each_row_once_whatever_its_repeats(source, table_file):
    with RowCache.for_file(table_file, slots=10, register=False) as cache:
        misses = step(cache, table_file, [7, 7, 3, 7, 3, 4999], 1)
        assert sorted(misses.rows.tolist()) == [3, 7, 4999] and len(set(misses.slots.tolist())) == 3
        assert len(step(cache, table_file, [3, 7, 7], 2)) == 0  # hits: nothing to read
        consistent(cache, source)


def test_rows_read_again_outlive_rows_read_once():
    """CLOCK: a hit sets the row's bit, a row read in does not; the sweep takes unreferenced rows first."""
    with RowCache(100, 8, torch.float32, slots=4, register=False) as cache:
        cache.plan([10, 11, 12, 13], 1)
        cache.complete(1)
        misses = cache.plan([10, 12, 50, 51], 2)  # 10 and 12 hit; 50 and 51 take 11's and 13's slots
        assert misses.rows.tolist() == [50, 51]
        assert (cache.slots_of([10, 12, 50, 51]) >= 0).all() and (cache.slots_of([11, 13]) == -1).all()
        assert cache.stats["evictions"] == 2


def test_a_step_in_flight_keeps_its_slots_and_one_that_does_not_fit_is_named(source, table_file):
    with RowCache.for_file(table_file, slots=8, register=False) as cache:
        first = step(cache, table_file, range(0, 5), 1)  # 5 slots held by step 1 while it is in flight
        before = cache.rows.tensor.clone()
        with pytest.raises(RowCacheFull, match=r"step 2 needs 4 rows read in, but only 3 of the cache's 8 slots "
                                               r"are free of the steps in flight \(steps 1 \.\. 2 hold 5\)"):
            cache.plan([100, 101, 102, 103, 0], 2)
        assert torch.equal(cache.rows.tensor, before)  # nothing written
        assert (cache.slots_of(first.rows) == first.slots).all()  # step 1's rows where they were
        assert (cache.slots_of([100, 101, 102, 103]) == -1).all()  # none half-mapped
        consistent(cache, source)
        cache.complete(1)  # step 1's gathers are done: its slots may go
        misses = step(cache, table_file, [100, 101, 102, 103, 0], 2)
        assert sorted(misses.rows.tolist()) == [100, 101, 102, 103]
        consistent(cache, source)


def test_a_read_that_fails_leaves_its_rows_unmapped(source, table_file, tmp_path):
    path = tmp_path / "short.uvt"
    write_table_file(path, source)
    with TableFile.open(path) as f, RowCache.for_file(f, slots=50, register=False) as cache:
        step(cache, f, [1, 2, 3], 1)
        with open(path, "r+b") as raw:  # the file truncated under the table: its last pages are gone
            raw.truncate(8 * 4096)
        misses = cache.plan([4, 4_900], 2)
        with pytest.raises(TableFileError, match=r"ended at byte .* \(truncated after it was written\?\)"):
            cache.fill(misses, f)
        assert (cache.slots_of([4, 4_900]) == -1).all()
        consistent(cache, source)
        assert len(step(cache, table_file, [4, 4_900], 3)) == 2  # read again, from a whole file, when asked


@pytest.mark.parametrize("where", ["as the sweep returns", "after the sweep", "in the read"])
def test_an_interrupt_after_the_plan_leaves_no_row_it_placed_mapped(source, table_file, monkeypatch, where):
    """``read_in`` (plan and fill as one): an interrupt as the sweep returns (the signal is raised right after the
    compiled call, before its results are assigned), after it placed its misses, or during their read, unmaps them;
    the rows it kept stay, and the step is planned again and served."""
    with RowCache.for_file(table_file, slots=30, register=False) as cache:
        cache.read_in([1, 2, 3], 1, table_file)
        cache.complete(1)
        if where == "as the sweep returns":
            sweep = row_cache._sweep()

            def swept_then_interrupted(*a):
                sweep(*a)
                raise KeyboardInterrupt
            monkeypatch.setattr(row_cache, "_sweep", lambda: swept_then_interrupted)
        elif where == "after the sweep":
            # the sweep placed the misses; the interrupt comes as their record is made
            monkeypatch.setattr(row_cache, "Misses", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        else:
            monkeypatch.setattr(TableFile, "read_rows", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            cache.read_in([2, 400, 401, 402], 2, table_file)
        monkeypatch.undo()
        assert (cache.slots_of([400, 401, 402]) == -1).all() and (cache.slots_of([1, 2, 3]) >= 0).all()
        consistent(cache, source)
        assert len(cache.read_in([2, 400, 401, 402], 2, table_file)) == 3
        consistent(cache, source)


def test_an_interrupt_in_the_rollback_of_a_step_that_does_not_fit_leaves_none_of_its_rows_mapped(source, table_file,
                                                                                              monkeypatch):
    """The interrupt raised as the rollback of a step too big for the free slots begins: the handler rolls it back
    instead, and a later plan reads the rows in (no hit on a slot never filled)."""
    with RowCache.for_file(table_file, slots=20, register=False) as cache:
        cache.read_in(np.arange(0, 10), 1, table_file)  # 10 slots held by step 1 (in flight)
        real, calls = RowCache._unmap, []

        def interrupted_once(self, rows, slots, arrays):
            calls.append(len(rows))
            if len(calls) == 1:
                raise KeyboardInterrupt
            real(self, rows, slots, arrays)
        monkeypatch.setattr(RowCache, "_unmap", interrupted_once)
        with pytest.raises(KeyboardInterrupt):
            cache.plan(np.arange(1000, 1015), 2)  # 15 misses, 10 free slots
        monkeypatch.undo()
        assert calls == [10, 10] and (cache.slots_of(np.arange(1000, 1015)) == -1).all()
        cache.complete(1)
        assert len(cache.read_in(np.arange(1000, 1015), 2, table_file)) == 15
        consistent(cache, source)


def test_bad_settings_and_calls_are_named(table_file):
    with pytest.raises(ValueError, match="slots= or as budget_bytes="):
        RowCache(10, 4, torch.float32, register=False)
    with pytest.raises(ValueError, match="at least one row"):
        RowCache(10, 4, torch.float32, budget_bytes=8, register=False)
    with pytest.raises(ValueError, match="slots >= 1"):
        RowCache(10, 4, torch.float32, slots=0, register=False)
    with pytest.raises(ValueError, match="rows >= 1"):
        RowCache(0, 4, torch.float32, slots=1, register=False)
    with pytest.raises(ValueError, match="holds rows of"):
        RowCache(10, 4, torch.complex64, slots=1, register=False)
    with RowCache(10, 4, torch.float32, budget_bytes=10 * 1024, register=False) as whole:
        assert whole.slots == 10  # never more slots than rows
    cache = RowCache.for_file(table_file, budget_bytes=3 * 80 + 79, register=False)  # 80-byte stride: 3 slots
    assert cache.slots == 3
    with pytest.raises(ValueError, match=r"asked for rows -1 \.\. 3"):
        cache.plan([3, -1], 1)
    with pytest.raises(ValueError, match=rf"a {ROWS}-row table was asked for rows 5 \.\. {ROWS}"):
        cache.plan([5, ROWS], 1)
    # refused before any row is looked up: nothing mapped, the step not taken
    assert cache.planned == 0 and (cache.slots_of([3, 5]) == -1).all() and cache.stats["steps"] == 0
    cache.plan([1], 2)
    with pytest.raises(ValueError, match="never go back"):
        cache.plan([1], 1)
    cache.complete(4)
    with pytest.raises(ValueError, match="step 3 is already completed"):
        cache.plan([1], 3)
    other = RowCache(ROWS, COLS + 1, torch.bfloat16, slots=2, register=False)
    with pytest.raises(ValueError, match="this cache is of"):
        other.fill(other.plan([1], 1), table_file)
    assert (other.slots_of([1]) == -1).all()  # refused: the row placed for it is not left mapped, unread
    other.close()
    cache.close()
    cache.close()  # twice is nothing
    with pytest.raises(TableClosedError):
        cache.plan([1], 5)


def test_the_gather_kernel_reads_rows_through_the_map_as_it_is(source, table_file):
    """The map's layout: gathered by a step's ids it gives ids of the cache's rows with ``id_base`` 1; a row
    not cached and an id outside the table both end as the policy's zero row, read from nowhere."""
    with RowCache.for_file(table_file, slots=64, register=False) as cache:
        cached = np.random.default_rng(4).choice(ROWS, 40, replace=False)
        step(cache, table_file, cached, 1)
        not_cached = int(np.setdiff1d(np.arange(ROWS), cached)[0])
        ids = torch.tensor([*cached[:9].tolist(), not_cached, -5, ROWS + 3, int(cached[3])])
        found = torch.full((len(ids), 1), float("nan"))  # the map's int32 values, moved as 4-byte words
        torch.ops.uvaple.gather_rows(cache.row_map.view(torch.float32).view(-1, 1), ids, found, None, None, 0, False,
                                     0, 0, 0, 0, 0)
        slot_ids = found.view(torch.int32).reshape(-1)
        assert slot_ids.tolist() == [*(cache.slots_of(cached[:9]) + 1).tolist(), 0, 0, 0,
                                     int(cache.slots_of([cached[3]])[0]) + 1]
        out = torch.full((len(ids), COLS), float("nan"), dtype=torch.bfloat16)
        torch.ops.uvaple.gather_rows(cache.rows.tensor, slot_ids, out, None, None, 0, False, 0, 1, 0, 0, 0)
        want = torch.zeros_like(out)
        hit = torch.tensor([True] * 9 + [False] * 3 + [True])
        want[hit] = source[ids[hit]]
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("buffer_pages", [1, 3])
def test_read_in_through_a_reader_in_rounds_puts_each_row_in_its_slot(source, table_file, buffer_pages):
    """Through the batched reader, its rounds one or three pages, over steps in flight: each step's rows in their
    slots, each page a step needs read once."""
    from uvaple.uva import PageReader

    g = np.random.default_rng(buffer_pages)
    with RowCache.for_file(table_file, slots=600, register=False) as cache, \
            PageReader(table_file, depth=4, buffer_pages=buffer_pages, engine="threads") as reader:
        cache.rows.tensor.view(torch.int16).fill_(-21846)
        for n in range(1, 6):
            rows = g.choice(ROWS, 40, replace=False)
            before = reader.pages_read
            misses = cache.read_in(rows, n, table_file, reader)
            assert reader.pages_read - before == len(np.unique(misses.rows // 51))
            consistent(cache, source)
            cache.complete(n - 1)


def test_closing_a_cache_read_through_a_reader_releases_its_rows_at_once(table_file):
    """The cache keeps one view of its rows for the readers to copy into; closing it lets go of that view, so the
    rows' memory is released then, not when the cache object is dropped."""
    from uvaple.uva import PageReader

    with PageReader(table_file, depth=2, engine="threads") as reader:
        with RowCache.for_file(table_file, slots=64, register=False) as first:
            first.read_in([3], 1, table_file, reader)  # (numba's first compile keeps its arguments until a gc pass)
        cache = RowCache.for_file(table_file, slots=64, register=False)
        cache.read_in([3, 700, 4_999], 1, table_file, reader)
    cache.close()
    assert cache.rows.released


def test_closing_a_cache_releases_its_map_and_word_and_every_call_after_is_named(table_file):
    """The map (4 bytes a row of the table) and the completion word are released when the cache is closed, not when
    the object is dropped; every call after it is the closed cache's named error."""
    cache = RowCache.for_file(table_file, slots=64, register=False)
    misses = cache.read_in([3, 700, 4_999], 1, table_file)
    cache.complete(1)
    cache.close()
    assert cache.rows.released and cache._map.released and cache._word.released
    out = np.empty(2, dtype=np.int32)
    for call in (lambda: cache.slots_of([3]), lambda: cache.cache_ids(np.array([3, 4]), out), cache.done,
                 lambda: cache.complete(2), lambda: cache.plan([5], 2), lambda: cache.abandon(misses),
                 lambda: cache.read_in([5], 2, table_file), lambda: cache.views(torch.device("cpu")),
                 lambda: cache.row_map, lambda: cache.completed):
        with pytest.raises(TableClosedError, match="row cache is closed"):
            call()
    cache.close()  # again: nothing
    assert cache.planned == 1 and cache.stats["steps"] == 1


@pytest.mark.parametrize("fits", [True, False])
def test_a_close_during_a_sweep_lets_the_step_finish_then_releases(table_file, monkeypatch, fits):
    """A close() landing as a step's sweep runs (where another thread's would): the sweep and what follows it work
    on the state the call took, so a step that fits is planned whole and one that does not is the named
    RowCacheFull, its rows unmapped; the tables are released as the call returns, and the next call is named."""
    cache = RowCache.for_file(table_file, slots=64, register=False)
    if not fits:
        cache.plan(np.arange(60), 1)  # step 1 in flight holds 60 of the 64 slots
    sweep = row_cache._sweep()

    def closing_sweep(*args):
        cache.close()
        return sweep(*args)

    monkeypatch.setattr(row_cache, "_sweep", lambda: closing_sweep)
    step = 1 if fits else 2
    if fits:
        misses = cache.plan([3, 700, 3], step)
        assert sorted(misses.rows.tolist()) == [3, 700] and len(set(misses.slots.tolist()) & set(range(64))) == 2
        del misses
    else:
        with pytest.raises(RowCacheFull, match="needs 10 rows read in, but only 4"):
            cache.plan(np.arange(1000, 1010), step)
    assert cache._map.released and cache._word.released and cache.rows.released
    with pytest.raises(TableClosedError, match="row cache is closed"):
        cache.plan([4], step + 1)


def test_a_close_as_a_fill_reads_in_is_named_and_leaves_none_of_its_rows_mapped(table_file, monkeypatch):
    """A close() landing after a step's plan, as its fill reads in (where another thread's would): the closed
    cache's named error when the fill finds the rows' view gone, and the step's rows unmapped in the state the
    call took, when the read itself fails after the close."""
    from uvaple.uva import PageReader

    with PageReader(table_file, depth=2, engine="threads") as reader, \
            RowCache.for_file(table_file, slots=64, register=False) as cache:
        live = cache._live

        def closed_meanwhile():
            live()
            cache._bytes = None  # what close() drops first

        monkeypatch.setattr(cache, "_live", closed_meanwhile)
        with pytest.raises(TableClosedError, match="row cache is closed"):
            cache.read_in([3, 700], 1, table_file, reader)
        monkeypatch.undo()
        assert (cache.slots_of([3, 700]) == -1).all()

    reader = PageReader(table_file, depth=2, engine="threads")
    cache = RowCache.for_file(table_file, slots=64, register=False)
    arrays = cache._state()

    def read_fails_after_a_close(*args):
        cache.close()
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(reader, "read_rows_into", read_fails_after_a_close)
    with pytest.raises(OSError):
        cache.read_in([3, 700], 1, table_file, reader)
    row_map, row_of_slot = arrays[0], arrays[1]
    assert (row_map[[3, 700]] == 0).all() and not np.isin(row_of_slot, [3, 700]).any()
    reader.close()


def test_a_forked_child_is_refused_by_name(table_file):
    """A private cache's rows are the parent's mapping (a child reads zeros there): in a forked child, planning or
    reading a step is the named error, whatever views the cache keeps."""
    from uvaple.uva import PageReader

    with RowCache.for_file(table_file, slots=64, register=False) as cache, \
            PageReader(table_file, depth=2, engine="threads") as reader:
        cache.read_in([3], 1, table_file, reader)
        cache.complete(1)
        assert in_forked_child(lambda: cache.read_in([4, 900], 2, table_file, reader)) == "TableForkedError"
        assert len(cache.read_in([4, 900], 2, table_file, reader)) == 2  # the parent's cache as it was


def test_an_interrupt_while_the_sweep_compiles_leaves_no_table_open(monkeypatch):
    """The sweep is compiled before the cache maps anything: a Ctrl-C during that compile (the first cache of a
    process: about half a second) leaves no pinned table behind."""
    made = []
    monkeypatch.setattr(row_cache.HostTable, "empty", lambda *a, **k: made.append(a) or pytest.fail("mapped"))
    monkeypatch.setattr(row_cache, "_compile_sweep", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        RowCache(100, 8, torch.float32, slots=10, register=False)
    assert not made

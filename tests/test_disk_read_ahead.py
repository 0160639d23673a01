"""Reading ahead through the disk placement: ``DiskLookup.prefetch`` plans the next call's step and reads its misses
before the call, which then reads nothing and gives the same bits and counters; a read-ahead whose call never came
is let go on the host (``RowCache.release``), never waiting on the GPU; a failed one holds nothing; ``ReadRound``
runs several lookups' read-aheads together, waits for all of them through an interrupt, and names the first error.
Real files, real reads; the gather interpreted on CPU, compiled over UVA on CUDA."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import numpy as np
import pytest
import torch
from helpers import bits, rand

from uvaple.integration import DiskStepTimeout, make_lookup
from uvaple.integration.errors import BackendClosed, LookupForkedError
from uvaple.integration.placements.read_round import ReadRound
from uvaple.uva import PageReader, RowCache, RowCacheFull, write_table_file


def table(tmp_path, rows=600, cols=24, seed=1, name="t"):
    t = rand(rows, cols, torch.bfloat16, seed=seed)
    path = tmp_path / f"{name}.uvt"
    write_table_file(path, t)
    return t, str(path)


def id_steps(n_steps: int, rows: int, seed: int, hot: int = 40) -> list[torch.Tensor]:
    """Steps of ids that repeat a hot range and bring new ones: hits, misses and evictions in a small cache."""
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.randint(0, hot, (9,), generator=g), torch.randint(0, rows, (17,), generator=g)])
            for _ in range(n_steps)]


def test_a_read_ahead_call_reads_nothing_and_gives_the_same_bits_and_counts(tmp_path, device):
    """Each step read ahead, then called (the ids of the call, then a call with a few ids beyond them): the calls
    read no page that the read-ahead read, every call's rows are the table's, and the cache counts the same hits,
    misses and evictions as a lookup that reads in its calls."""
    t, path = table(tmp_path)
    steps = id_steps(14, t.shape[0], seed=2)
    kw = dict(device=device, max_rows=40, slots=60)
    reads = []
    with make_lookup("disk", path, **kw) as plain, make_lookup("disk", path, **kw) as ahead:
        for i, ids in enumerate(steps):
            out = torch.full((ids.numel(), t.shape[1]), -3.0, dtype=torch.bfloat16, device=device)
            assert torch.equal(bits(plain.lookup(ids)), bits(t[ids])), i
            read = ahead.prefetch(ids)
            pages = ahead.stats()["pages_read"]
            assert ahead.lookup(ids, out) is out
            assert ahead.stats()["pages_read"] == pages, i  # the call read nothing
            assert torch.equal(bits(out), bits(t[ids])), i
            reads.append(read)
        a, p = ahead.stats(), plain.stats()
        assert a["cache"] == p["cache"] and a["cache"]["evictions"] > 0 and a["cache"]["hits"] > 0
        assert a["read_ahead"] == 14 and a["lookups"] == 14
        assert sum(reads) == a["rows_ahead"] == p["cache"]["misses"]  # every miss read ahead
        # a call with ids beyond its read-ahead reads just those
        ids = torch.tensor([500, 501, 502, 3, 502])
        ahead.prefetch(ids[:2])
        left = int((ahead.cache.slots_of(np.unique(ids.numpy())) == -1).sum())
        assert left >= 1  # 502, and 3 where it was evicted
        misses = ahead.stats()["cache"]["misses"]
        assert torch.equal(bits(ahead.lookup(ids)), bits(t[ids]))
        assert ahead.stats()["cache"]["misses"] == misses + left


def test_a_read_ahead_whose_call_never_came_is_let_go_on_the_host(tmp_path, device):
    """Two read-aheads of one step, each of all the cache's slots, with no call between: the second hands the
    first's slots to the last launched step (complete), so it fits without any word from the GPU, and its call
    reads nothing. A third read-ahead while step 1's gather is still "in flight" (its word held back) keeps step
    1's slots: it waits for them as its call would, is named after ``wait_s``, and holds nothing."""
    t, path = table(tmp_path, rows=400, cols=16, seed=3)
    with make_lookup("disk", path, device=device, max_rows=20, slots=20, wait_s=0.2) as lk:
        lk.prefetch(torch.arange(0, 20))  # step 1 ahead: every slot
        lk.prefetch(torch.arange(100, 120))  # its call never came: the same step, read ahead again
        assert (lk.cache.slots_of(np.arange(100, 120)) >= 0).all()
        pages = lk.stats()["pages_read"]
        assert torch.equal(bits(lk.lookup(torch.arange(100, 120))), bits(t[100:120]))
        assert lk.stats()["pages_read"] == pages and lk.stats()["planned_step"] == 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        lk.cache.completed.fill_(0)  # step 1 "still on the GPU": its slots are its own
        with pytest.raises(DiskStepTimeout, match="step 1 has not completed"):  # 5 hits of step 1's, 15 misses:
            lk.prefetch(torch.cat([torch.arange(100, 105), torch.arange(200, 215)]))  # waits as its call would
        assert (lk.cache.slots_of(np.arange(100, 120)) >= 0).all()  # step 1's rows, untouched
        last_step = lk.cache._state()[2]
        assert (last_step == 1).all()  # the failed read-ahead's hits handed back to step 1: it holds no slot
        lk.cache.completed.fill_(1)
        ids = torch.arange(200, 220)
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))


def test_a_failed_read_ahead_holds_nothing_and_its_call_reads_the_rows(tmp_path, device, monkeypatch):
    """A read error during a read-ahead: named, none of its misses mapped, its hits handed back; the call then
    reads the rows itself and every slot is free to it."""
    t, path = table(tmp_path, rows=300, cols=8, seed=4)
    with make_lookup("disk", path, device=device, max_rows=20, slots=20, wait_s=0.2) as lk:
        lk.lookup(torch.arange(10))
        if device.type == "cuda":
            torch.cuda.synchronize()
        where = "_read_uring" if lk._reader.engine == "uring" else "_read_share"
        monkeypatch.setattr(PageReader, where, lambda *a, **k: (_ for _ in ()).throw(OSError(5, "EIO")))
        with pytest.raises(OSError, match="EIO"):
            lk.prefetch(torch.cat([torch.arange(5), torch.arange(100, 110)]))  # 5 hits, 10 misses
        monkeypatch.undo()
        assert (lk.cache.slots_of(np.arange(100, 110)) == -1).all()
        assert not (lk.cache._state()[2] == 2).any() and lk.stats()["read_ahead"] == 0
        ids = torch.arange(200, 220)  # every slot
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))


def test_a_call_whose_ids_are_not_its_read_aheads_lets_those_go_when_it_needs_their_slots(tmp_path, device):
    """A read-ahead of every slot, then a call of other ids that needs every slot: the call lets the read-ahead's
    rows go and is served, as it would be with no read-ahead; the rows read ahead stay cached until evicted."""
    t, path = table(tmp_path, rows=300, cols=8, seed=6)
    with make_lookup("disk", path, device=device, max_rows=20, slots=20, wait_s=0.2) as lk:
        lk.prefetch(torch.arange(20))
        ids = torch.arange(100, 120)
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))
        assert lk.stats()["planned_step"] == 1 and (lk.cache.slots_of(np.arange(20)) == -1).all()
        lk.prefetch(torch.arange(50, 55))  # room beside the call's own rows: both kept
        ids = torch.tensor([50, 51, 200, 201])
        assert torch.equal(bits(lk.lookup(ids)), bits(t[ids]))
        assert (lk.cache.slots_of(np.arange(50, 55)) >= 0).all()


def test_bad_read_aheads_are_named(tmp_path, device):
    t, path = table(tmp_path, rows=200, cols=8, seed=5)
    lk = make_lookup("disk", path, device=device, max_rows=10, slots=20)
    with pytest.raises(ValueError, match="max_rows|10"):
        lk.prefetch(torch.arange(11))
    with pytest.raises((TypeError, ValueError)):
        lk.prefetch(torch.arange(3, dtype=torch.float32))
    if device.type == "cuda":
        with pytest.raises(ValueError, match="this call takes host ids"):
            lk.prefetch(torch.arange(3, device=device))
    assert lk.prefetch(torch.empty(0, dtype=torch.int64)) == 0
    ids = torch.tensor([-5, 3, 250, 7, 3])  # outside the table: read as the policy says, as a call alone does
    assert lk.prefetch(ids) == 2
    with make_lookup("disk", path, device=device, max_rows=10, slots=20) as plain:
        assert torch.equal(bits(lk.lookup(ids)), bits(plain.lookup(ids)))
    assert torch.equal(bits(lk.lookup(ids[1:4:2])), bits(t[[3, 7]]))
    lk.close()
    with pytest.raises(BackendClosed):
        lk.prefetch(torch.arange(3))


def test_the_cache_counts_and_references_a_step_planned_again_once(tmp_path):
    """A step planned twice (ahead, then by its call, with repeats and one row more): its rows counted once, the
    step counted once, and a row read once is still the first to go (its reference bit not set by the second
    plan)."""
    cache = RowCache(100, 4, torch.float32, slots=4, register=False)
    try:
        cache.plan([1, 2, 2], 1)
        cache.complete(1)
        cache.plan([1, 3], 2)  # row 1 a hit (referenced), row 3 a miss
        again = cache.plan([1, 3, 3, 4], 2)  # row 4 new: a miss; rows 1 and 3 this step's already
        assert list(again.rows) == [4]
        assert cache.stats == {"steps": 2, "hits": 1, "misses": 4, "evictions": 0}
        cache.complete(2)
        cache.plan([5, 6], 3)  # two slots to take: row 2 (no hit since) and row 3 (read once), not row 1
        assert (cache.slots_of([1, 4]) >= 0).all() and (cache.slots_of([2, 3]) == -1).all()
    finally:
        cache.close()


def test_release_hands_a_steps_slots_to_an_earlier_one(tmp_path):
    cache = RowCache(100, 4, torch.float32, slots=3, register=False)
    try:
        cache.plan([1, 2], 1)
        cache.plan([3], 2)
        cache.plan([3], 2)  # planned again: a hit of its own step, not referenced
        assert cache._state()[3][cache.slots_of([3])[0]] == 0
        cache.plan([1], 2)  # a hit of step 1's row: referenced
        assert cache._state()[3][cache.slots_of([1])[0]] == 1
        with pytest.raises(RowCacheFull):
            cache.plan([4], 3)  # step 1 is not complete: no slot is free
        assert cache.release(2, 1) == 2  # step 2's gather never runs: its slots go to step 1, unreferenced
        assert (cache._state()[3] == 0).all() and (cache._state()[2] <= 1).all()
        with pytest.raises(RowCacheFull):
            cache.plan([4], 3)  # still held, by step 1 now
        cache.complete(1)
        assert len(cache.plan([4], 3)) == 1  # step 1 complete: the released slot with it
        assert (cache.slots_of([1, 2, 3, 4]) >= 0).sum() == 3
        for step, to in ((3, 3), (3, -1), (True, 0), (3, 1.0)):
            with pytest.raises(ValueError, match="release"):
                cache.release(step, to)
    finally:
        cache.close()


def lookups(tmp_path, device, n=3, **kw):
    made = []
    for i in range(n):
        t, path = table(tmp_path, rows=300 + 50 * i, cols=8 + 8 * i, seed=10 + i, name=f"t{i}")
        made.append((t, make_lookup("disk", path, device=device, max_rows=30, slots=30, **kw)))
    return made


def test_a_round_reads_every_lookups_misses_together_and_the_calls_read_nothing(tmp_path, device):
    made = lookups(tmp_path, device)
    try:
        with ReadRound([lk for _, lk in made]) as rnd:
            for step in range(4):
                ids = [torch.randint(0, t.shape[0], (3, 7), generator=torch.Generator().manual_seed(step * 7 + i))
                       for i, (t, _) in enumerate(made)]
                read = rnd.prefetch(ids)
                assert all(r >= 0 for r in read) and sum(read) > 0
                for (t, lk), i in zip(made, ids, strict=True):
                    pages = lk.stats()["pages_read"]
                    assert torch.equal(bits(lk.lookup(i)), bits(t[i]))
                    assert lk.stats()["pages_read"] == pages
            assert rnd._pool is not None
        assert rnd._pool is None
        with pytest.raises(BackendClosed):
            rnd.prefetch(ids)
    finally:
        for _, lk in made:
            lk.close()


def test_a_round_names_the_first_failure_after_every_read_ahead_ended(tmp_path, device, monkeypatch):
    """Two of three read-aheads fail (the second, then the third): the second's error is raised once all three
    ended; the first holds its rows (its call reads nothing), the failed ones hold none."""
    made = lookups(tmp_path, device)
    ended = []
    real = type(made[0][1]).prefetch

    def prefetch(self, ids):
        if self is made[1][1]:
            ended.append(1)
            raise RowCacheFull("second")
        if self is made[2][1]:
            threading.Event().wait(0.3)
            ended.append(2)
            raise OSError("third")
        ended.append(0)
        return real(self, ids)

    monkeypatch.setattr(type(made[0][1]), "prefetch", prefetch)
    try:
        rnd = ReadRound([lk for _, lk in made])
        ids = [torch.arange(5) for _ in made]
        with pytest.raises(RowCacheFull, match="second"):
            rnd.prefetch(ids)
        assert sorted(ended) == [0, 1, 2]
        monkeypatch.undo()
        t, lk = made[0]
        pages = lk.stats()["pages_read"]
        assert torch.equal(bits(lk.lookup(ids[0])), bits(t[ids[0]])) and lk.stats()["pages_read"] == pages
        rnd.close()
    finally:
        for _, lk in made:
            lk.close()


def slow_read_aheads(monkeypatch, made) -> list:
    """Every read-ahead of ``made``'s lookups takes 0.2 s more; returns the list each one's end is appended to."""
    done, real = [], type(made[0][1]).prefetch

    def slow(self, ids):
        threading.Event().wait(0.2)
        done.append(real(self, ids))
        return done[-1]

    monkeypatch.setattr(type(made[0][1]), "prefetch", slow)
    return done


def test_a_round_waits_for_every_read_ahead_before_an_interrupt(tmp_path, device, monkeypatch):
    made = lookups(tmp_path, device, n=2)
    done = slow_read_aheads(monkeypatch, made)
    calls = []
    real_wait = cf.wait

    def wait(fs, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(fs, *a, **k)

    monkeypatch.setattr(cf, "wait", wait)
    try:
        with ReadRound([lk for _, lk in made]) as rnd, pytest.raises(KeyboardInterrupt):
            rnd.prefetch([torch.arange(4), torch.arange(4)])
        assert len(done) == 2 and len(calls) == 2  # both ended before the interrupt was raised
    finally:
        for _, lk in made:
            lk.close()


def test_a_round_interrupted_while_it_hands_out_work_waits_for_what_it_handed_out(tmp_path, device, monkeypatch):
    made = lookups(tmp_path, device, n=3)
    done = slow_read_aheads(monkeypatch, made)
    real_submit, submitted = cf.ThreadPoolExecutor.submit, []

    def submit(pool, *a, **k):
        if len(submitted) == 1:
            raise KeyboardInterrupt
        submitted.append(1)
        return real_submit(pool, *a, **k)

    monkeypatch.setattr(cf.ThreadPoolExecutor, "submit", submit)
    try:
        with ReadRound([lk for _, lk in made]) as rnd, pytest.raises(KeyboardInterrupt):
            rnd.prefetch([torch.arange(4)] * 3)
        assert len(done) == 1  # the one handed out ended before the interrupt was raised
    finally:
        for _, lk in made:
            lk.close()


def test_bad_rounds_are_named(tmp_path, device):
    made = lookups(tmp_path, device, n=2)
    try:
        with pytest.raises(ValueError, match="at least one"):
            ReadRound([])
        with pytest.raises(TypeError, match="reads ahead through lookups that can.*not object"):
            ReadRound([made[0][1], object()])
        with pytest.raises(ValueError, match="each lookup once"):
            ReadRound([made[0][1], made[1][1], made[0][1]])
        rnd = ReadRound([lk for _, lk in made])
        with pytest.raises(ValueError, match="2 lookups was given 1"):
            rnd.prefetch([torch.arange(3)])
        rnd._pid = -1  # as in a forked child: the threads are the parent's
        with pytest.raises(LookupForkedError, match="forked child"):
            rnd.prefetch([torch.arange(3), torch.arange(3)])
        rnd._pid = __import__("os").getpid()
        rnd.close()
        rnd.close()
    finally:
        for _, lk in made:
            lk.close()

"""The hot set: rows resident in device memory, read in the same launch as the misses, same bits.

Every test compares with the uncached lookup of the same table (the definition), on poisoned outputs,
and proves the hits were read from the hot rows (spoiling them changes exactly the hit rows). CPU here
(interpreter), CUDA on the GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import EXTENDED, bits, cover, rand

from uvaple.integration import GatherLookup, HotSet, SplitLookup, TableSpec, counts_of_ids, rank_rows
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable

ROWS = 700


def poisoned(n: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(n, cols, dtype=dtype, device=device)
    out.view(torch.uint8).fill_(0xA7)
    return out


def ids_of(pattern: str, hot_rows: torch.Tensor, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hot = hot_rows.cpu()
    cold = torch.tensor(sorted(set(range(ROWS)) - set(hot.tolist())))
    if pattern == "all_hits":
        ids = hot[torch.randint(0, len(hot), (133,), generator=g)]
    elif pattern == "all_misses":
        ids = cold[torch.randint(0, len(cold), (133,), generator=g)]
    elif pattern == "mixed":
        ids = torch.randint(0, ROWS, (133,), generator=g)
    elif pattern == "out_of_range":
        ids = torch.tensor([-1, ROWS, ROWS + 5, 2**31 - 1, -2**31, 2**62, -2**63, 2**63 - 1, int(hot[0]), 0])
    elif pattern == "duplicates":
        ids = torch.cat([hot[:3].repeat(40), cold[:2].repeat(30)])[torch.randperm(180, generator=g)]
    else:
        raise AssertionError(pattern)
    return ids.to(device)


def fp8_row_table(seed: int) -> torch.Tensor:
    """36 codes and a float32 scale: the scale is a 4-byte aligned word, read with one load (the fuzz's and
    test_encodings' odd widths take the four-byte path)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (ROWS, 36), generator=g, dtype=torch.uint8)
    scales = (torch.randn(ROWS, generator=g) * 0.1).to(torch.float32).view(-1, 1)
    return torch.cat([codes, scales.view(torch.uint8).reshape(-1, 4)], dim=1).view(torch.float8_e4m3fn)


ENCODINGS = {
    "bf16": lambda: (rand(ROWS, 40, torch.bfloat16, seed=1), {}),
    "bf16_scaled_to_fp32": lambda: (rand(ROWS, 40, torch.bfloat16, seed=2), {"scale": -3.5,
                                                                              "out_dtype": torch.float32}),
    "fp32_odd": lambda: (rand(ROWS, 13, torch.float32, seed=3), {}),
    "fp8_global": lambda: (torch.randint(0, 256, (ROWS, 24), dtype=torch.uint8,
                                         generator=torch.Generator().manual_seed(4)).view(torch.float8_e4m3fn),
                           {"encoding": "fp8_global", "out_dtype": torch.bfloat16}),
    "fp8_row": lambda: (fp8_row_table(5), {"encoding": "fp8_row", "out_dtype": torch.bfloat16}),
}


ORDERS = {"direct": {"order": "direct"}, "sorted": {"order": "sorted", "max_rows": 400},
          "sorted_dedup": {"order": "sorted", "max_rows": 400, "dedup": True}}


PATTERNS = ["all_hits", "all_misses", "mixed", "out_of_range", "duplicates"]
# every encoding, policy and pattern in id order; the sorted orders (the same kernel body) on the
# patterns that differ there (repeats, out-of-range ids in the sort, a mix), two policies
CASES = [(e, o, p, "direct") for e in ENCODINGS for o in ("zero", "row0", "neg_zero") for p in PATTERNS] + \
    [(e, o, p, order) for order in ("sorted", "sorted_dedup") for e in ENCODINGS for o in ("zero", "row0")
     for p in ("mixed", "out_of_range", "duplicates")]
# seconds a case takes interpreted (2 CPU cores) by pattern: the default set takes the cheaper among equals
PATTERN_COST = {"out_of_range": 0.1, "duplicates": 1.0}


# by default each encoding, policy, pattern and order once (each hot path with each encoding: test_fuzz.py's
# test_fuzz_lookup); -m extended: the rest
@pytest.mark.parametrize("encoding,oob,pattern,order", cover(CASES, (0,), (1,), (2,), (3,),
                                                            cost=lambda c: PATTERN_COST.get(c[2], 2.5)))
def test_hits_and_misses_are_the_uncached_bits(device, encoding, oob, pattern, order):
    data, kw = ENCODINGS[encoding]()
    if oob == "neg_zero" and kw.get("out_dtype", data.dtype) not in (torch.bfloat16, torch.float16, torch.float32):
        pytest.skip("neg_zero needs a float output")
    with HostTable.from_tensor(data) as h:
        spec = TableSpec.of(h, oob=oob, **kw)
        scale = torch.tensor([0.75], device=device) if kw.get("encoding") == "fp8_global" else None
        hot_rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(6))[:70]
        hs = HotSet(h, 80, device, rows=hot_rows)
        with GatherLookup(h, spec, device, dequant_scale=scale, hot=hs, **ORDERS[order]) as cached, \
                GatherLookup(h, spec, device, dequant_scale=scale, order="direct") as plain:
            ids = ids_of(pattern, hot_rows, device)
            c0, c1 = spec.columns(None)
            width = c1 - c0
            got = cached.lookup(ids, poisoned(len(ids), width, spec.output_dtype, device))
            want = plain.lookup(ids, poisoned(len(ids), width, spec.output_dtype, device))
            assert torch.equal(bits(got), bits(want)), (encoding, oob, pattern, order)
            # the hits were read from the hot rows: spoiling them changes exactly the rows of hit ids
            hs._raw.view(torch.uint8).fill_(0x3C)
            spoiled = cached.lookup(ids, poisoned(len(ids), width, spec.output_dtype, device))
            in_hot = torch.isin(ids.cpu(), hot_rows) & (ids.cpu() >= 0) & (ids.cpu() < ROWS)
            changed = (bits(spoiled).view(len(ids), -1) != bits(want).view(len(ids), -1)).any(dim=1)
            assert torch.equal(changed, in_hot), (encoding, oob, pattern, order)
            st = cached.stats()
            valid = ((ids.cpu() >= 0) & (ids.cpu() < ROWS)).sum().item()
            assert st["hot_hits"] == 2 * in_hot.sum().item()
            assert st["hot_misses"] == 2 * (valid - in_hot.sum().item())
            assert st["hot_bytes_saved"] == st["hot_hits"] * spec.cols * h.itemsize


def test_refresh_swaps_the_set_in_place_and_stays_exact(device):
    data = rand(ROWS, 64, torch.bfloat16, seed=7)
    with HostTable.from_tensor(data) as h:
        spec = TableSpec.of(h)
        hs = HotSet(h, 50, device)
        buffers = (hs.rows.data_ptr(), hs.slot_map.data_ptr())
        with GatherLookup(h, spec, device, hot=hs) as lk:
            ids = torch.randint(0, ROWS, (200,), generator=torch.Generator().manual_seed(8)).to(device)
            want = bits(data[ids.cpu()])
            outs = []
            for rows in [torch.arange(50), torch.arange(600, 650), torch.arange(0, 700, 14)[:50],
                         torch.tensor([3, 1, 2], dtype=torch.int32), torch.empty(0, dtype=torch.int64)]:
                hs.set_rows(rows.to(device))
                outs.append(lk.lookup(ids, poisoned(200, 64, torch.bfloat16, device)))
                assert hs.size == len(rows)
                held = set(rows.tolist())
                assert torch.equal((hs.slot_map.cpu() >= 0).nonzero().view(-1).sort().values,
                                   torch.tensor(sorted(held), dtype=torch.int64))  # the rows that left are misses
            for out in outs:  # each pass was exact, whatever set it ran against
                assert torch.equal(bits(out), want)
        assert (hs.rows.data_ptr(), hs.slot_map.data_ptr()) == buffers  # fixed buffers: graphs stay valid


def test_a_map_holding_garbage_reads_nothing_outside(device):
    """The map is a device tensor anyone could write: a slot outside the hot set is a miss."""
    data = rand(ROWS, 32, torch.bfloat16, seed=9)
    with HostTable.from_tensor(data) as h:
        hs = HotSet(h, 10, device, rows=torch.arange(10))
        hs.slot_map[:] = torch.tensor([10, 11, -2, 2**31 - 1, -2**31] * (ROWS // 5), dtype=torch.int32)
        with GatherLookup(h, TableSpec.of(h), device, hot=hs) as lk:
            ids = torch.arange(ROWS, device=device)
            assert torch.equal(bits(lk.lookup(ids)), bits(data))
            assert lk.stats()["hot_hits"] == 0


def test_bad_hot_sets_are_named(device):
    data = rand(ROWS, 16, torch.bfloat16, seed=10)
    with HostTable.from_tensor(data) as h, HostTable.from_tensor(data) as other:
        with pytest.raises(ValueError, match="capacity"):
            HotSet(h, 0, device)
        with pytest.raises(ValueError, match="capacity"):
            HotSet(h, ROWS + 1, device)
        hs = HotSet(h, 8, device)
        with pytest.raises(ValueError, match="table rows"):
            hs.set_rows(torch.tensor([0, ROWS]))
        with pytest.raises(ValueError, match="table rows"):
            hs.set_rows(torch.tensor([-1]))
        with pytest.raises(ValueError, match="distinct"):
            hs.set_rows(torch.tensor([4, 4]))
        with pytest.raises(TypeError, match="1-D int32/int64"):
            hs.set_rows(torch.tensor([1.0]))
        with pytest.raises(ValueError, match="HotSet of this table"):
            GatherLookup(other, TableSpec.of(other), device, hot=hs)
        if device.type == "cuda":
            with pytest.raises(TypeError, match="hot"):  # a split lookup takes no hot set
                SplitLookup(h, TableSpec.of(h), device, hot=hs, max_rows=16)
        ids = torch.arange(4, device=device)
        out = torch.empty(4, 16, dtype=torch.bfloat16, device=device)
        table = h.cuda_view() if device.type == "cuda" else h.tensor
        with pytest.raises(ValueError, match="slot map"):
            torch.ops.uvaple.gather_rows_hot(table, ids, out, None, None, hs.rows, hs.slot_map[:5], None, None, 0,
                                             False, 0, 0, 0, 0, 0, False)
        with pytest.raises(ValueError, match="hot rows"):
            wide = torch.empty(8, 2 * h.stride, dtype=torch.bfloat16, device=device)[:, :16]  # another stride
            torch.ops.uvaple.gather_rows_hot(table, ids, out, None, None, wide, hs.slot_map, None, None, 0, False, 0,
                                             0, 0, 0, 0, False)
        with pytest.raises(ValueError, match="id counts"):
            torch.ops.uvaple.gather_rows_hot(table, ids, out, None, None, hs.rows, hs.slot_map, None,
                                             torch.zeros(ROWS, dtype=torch.int32, device=device), 0, False, 0, 0, 0,
                                             0, 0, False)
        with pytest.raises(ValueError, match="count_ids=True"):
            hs.refresh()
        with pytest.raises(ValueError, match="decay"):
            HotSet(h, 8, device, count_ids=True).refresh(decay=-1)
        with pytest.raises(ValueError, match="counters"):
            torch.ops.uvaple.gather_rows_hot(table, ids, out, torch.zeros(3, dtype=torch.int64, device=device),
                                             None, hs.rows, hs.slot_map, None, None, 0, False, 0, 0, 0, 0, 0, False)


def test_profiles_rank_rows_by_count(tmp_path):
    text = tmp_path / "ids.txt"
    text.write_text("5 3 5 9 5 3 1000 -1\n3 7")
    counts = counts_of_ids(str(text), 10)
    assert counts.tolist() == [0, 0, 0, 3, 0, 3, 0, 1, 0, 1]  # ids outside 0..10 are not counted
    np.save(tmp_path / "ids.npy", np.array([2, 2, 8]))
    assert counts_of_ids(str(tmp_path / "ids.npy"), 10).tolist() == [0, 0, 2, 0, 0, 0, 0, 0, 1, 0]
    assert rank_rows(counts, 3).tolist() == [3, 5, 7]  # a tie: the lower row first
    assert rank_rows(counts, 10).tolist() == [3, 5, 7, 9]  # rows never seen are not held
    data = rand(1000, 8, torch.bfloat16, seed=11)
    with HostTable.from_tensor(data) as h:
        assert HotSet.capacity_for(h, fraction=0.05) == 50
        per_slot, fixed = h.stride_bytes + 12, h.rows * 4  # a row, its held entry and slot; the map
        assert HotSet.capacity_for(h, cache_gb=(fixed + per_slot * 20) / 1e9) == 20
        assert HotSet.capacity_for(h, cache_gb=(fixed + per_slot * 21 - 1) / 1e9) == 20
        counted = (fixed + h.rows * 8 + per_slot * 20) / 1e9
        assert HotSet.capacity_for(h, cache_gb=counted, count_ids=True) == 20
        for count_ids in (False, True):  # cache_gb bounds everything the hot set holds on the device
            k = HotSet.capacity_for(h, cache_gb=counted, count_ids=count_ids)
            assert HotSet(h, k, "cpu", count_ids=count_ids).nbytes <= counted * 1e9
        with pytest.raises(ValueError, match="holds no row: the map"):
            HotSet.capacity_for(h, cache_gb=fixed / 1e9)
        assert HotSet.capacity_for(h, fraction=1e-9) == 1
        with pytest.raises(ValueError, match="exactly one"):
            HotSet.capacity_for(h)
        with pytest.raises(ValueError, match="fraction"):
            HotSet.capacity_for(h, fraction=1.5)


@pytest.mark.parametrize("order", list(ORDERS))
def test_served_ids_are_counted_on_the_device_and_refresh_holds_the_most_served(device, order):
    """count_ids: each valid id of every lookup is counted in the kernel (repeats too, out-of-range ids
    not); refresh() then holds the most-served rows, ranked on the device, and lookups stay exact."""
    data = rand(ROWS, 48, torch.bfloat16, seed=15)
    with HostTable.from_tensor(data) as h:
        hs = HotSet(h, 20, device, count_ids=True)
        with GatherLookup(h, TableSpec.of(h), device, hot=hs, **ORDERS[order]) as lk:
            g = torch.Generator().manual_seed(16)
            favourites = torch.randperm(ROWS, generator=g)[:20]
            served = []
            for _ in range(3):
                ids = torch.cat([favourites.repeat(5), torch.randint(0, ROWS, (60,), generator=g),
                                 torch.tensor([-1, ROWS, 2**40])])[torch.randperm(163, generator=g)]
                lk.lookup(ids.to(device))
                served.append(ids)
            ids = torch.cat(served)
            valid = ids[(ids >= 0) & (ids < ROWS)]
            assert torch.equal(hs.id_counts.cpu(), torch.bincount(valid, minlength=ROWS))
            hs.refresh(decay=1)
            assert set(hs.held.cpu().tolist()) == set(favourites.tolist())  # 15 lookups each: the top 20
            assert torch.equal(hs.id_counts.cpu(), torch.bincount(valid, minlength=ROWS) // 2)
            probe = torch.randint(0, ROWS, (300,), generator=g).to(device)
            assert torch.equal(bits(lk.lookup(probe)), bits(data[probe.cpu()]))
            assert lk.stats()["hot_hits"] == torch.isin(probe.cpu(), favourites).sum().item()


def test_a_profile_prior_and_the_served_ids_are_ranked_together(device):
    """add_counts: a profile's counts seed the served-id counts; refresh() ranks both (a row the profile
    barely knows enters once it is served often, the profile's favourites stay); decay fades the prior.
    Bad counts are named errors and change nothing."""
    data = rand(ROWS, 40, torch.bfloat16, seed=21)
    with HostTable.from_tensor(data) as h:
        hs = HotSet(h, 4, device, count_ids=True)
        prior = torch.zeros(ROWS, dtype=torch.int64)
        prior[[10, 11, 12, 13, 14]] = torch.tensor([50, 40, 30, 20, 10])
        hs.add_counts(prior)
        with GatherLookup(h, TableSpec.of(h), device, hot=hs) as lk:
            ids = torch.tensor([77] * 35 + [14] * 3 + [-1, ROWS], device=device)
            for _ in range(2):  # out-of-range ids are not counted
                assert torch.equal(bits(lk.lookup(ids)), bits(reference_gather(data, ids.cpu())))
            hs.refresh(decay=1)
            assert set(hs.held.cpu().tolist()) == {10, 11, 77, 12}  # 77 served 70 times (two calls) beats 13, 14
            want = prior.clone()
            want[77] += 70
            want[14] += 6
            assert torch.equal(hs.id_counts.cpu(), want // 2)
            probe = torch.randint(0, ROWS, (200,), generator=torch.Generator().manual_seed(22)).to(device)
            assert torch.equal(bits(lk.lookup(probe)), bits(data[probe.cpu()]))
        before = hs.id_counts.clone()
        for bad, err in ((prior[:-1], TypeError), (prior.float(), TypeError), (prior.view(1, -1), TypeError),
                         (prior.bool(), TypeError), ([1] * ROWS, TypeError), (prior.to(torch.uint32), TypeError),
                         (prior.to(torch.uint64), TypeError), (prior - 100, ValueError)):
            with pytest.raises(err, match="counts"):
                hs.add_counts(bad)
        assert torch.equal(hs.id_counts, before)
        hs.add_counts(prior.to(torch.int16))  # narrower integers widen exactly
        assert torch.equal(hs.id_counts, before + prior.to(hs.id_counts.device))
        with pytest.raises(ValueError, match="count_ids=True"):
            HotSet(h, 4, device).add_counts(prior)


def test_the_hf_module_serves_through_a_hot_set(device, tmp_path):
    """HostScaledEmbedding (the Gemma 3n swap-in) with hot-set options: same bits as without, the rows of
    the profile held, hits counted; misused options named."""
    from uvaple.integration.embedding import HostScaledEmbedding

    data = rand(ROWS, 64, torch.bfloat16, seed=18)
    profile = tmp_path / "ids.txt"
    profile.write_text("3 3 3 5 5 9 -4 100000")
    with HostTable.from_tensor(data) as h:
        plain = HostScaledEmbedding(ROWS, 64, embed_scale=8.0, table=h)
        cached = HostScaledEmbedding(ROWS, 64, embed_scale=8.0, table=h, backend_options={
            "hot_fraction": 0.01, "hot_profile": str(profile), "count_ids": True})
        ids = torch.tensor([[3, 5, 9, 100, -1, ROWS, 3]], device=device)
        assert torch.equal(bits(cached(ids)), bits(plain(ids)))
        (hs,) = cached.hot_sets
        assert hs.capacity == 7 and set(hs.held[: hs.size].tolist()) == {3, 5, 9}
        # the profile's counts are the prior the served ids add to (3 in the profile, 2 served)
        assert cached.lookups[0].stats()["hot_hits"] == 4 and hs.id_counts[3].item() == 3 + 2
        assert hs.id_counts[100].item() == 1 and int(hs.id_counts.sum()) == 6 + 5
        counts = torch.zeros(ROWS, dtype=torch.int64)
        counts[[7, 8]] = 5
        by_counts = HostScaledEmbedding(ROWS, 64, embed_scale=8.0, table=h, backend_options={
            "hot_fraction": 0.01, "hot_profile": counts})
        assert torch.equal(bits(by_counts(ids)), bits(plain(ids)))
        assert set(by_counts.hot_sets[0].held[:2].tolist()) == {7, 8}
        with pytest.raises(ValueError, match="a hot set stands in front of a table the GPU .*, not of the 'device'"):
            HostScaledEmbedding(ROWS, 64, table=h, backend="device", backend_options={"cache_gb": 0.1})(ids)
        with pytest.raises(ValueError, match="give its size"):
            HostScaledEmbedding(ROWS, 64, table=h, backend_options={"hot_profile": counts})(ids)
        for m in (plain, cached, by_counts):
            m.close()


# each case launches the 143 ids' row tiles one program each, twice (4-11 s interpreted): one by default
@pytest.mark.parametrize("oob,encoding", [(o, e) if (o, e) == ("zero", "bf16") else pytest.param(o, e, marks=EXTENDED)
                                          for o in ("zero", "row0")
                                          for e in ("bf16", "bf16_scaled_to_fp32", "fp8_row")])
def test_the_row_tile_launch_order_gives_the_same_bits_and_counts(device, oob, encoding):
    """``LaunchConfig.row_tiles`` (a 1-D grid, the tiles of a row side by side) against the 2-D grid: the same
    bits and counters, through a hot set, with tiles that do not divide the row (a ragged last tile)."""
    from uvaple.kernels.gather import DirectGather
    from uvaple.kernels.tuning import LaunchConfig

    data, kw = ENCODINGS[encoding]()
    with HostTable.from_tensor(data) as h:
        spec = TableSpec.of(h, oob=oob, **kw)
        hot_rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(8))[:90]
        hs = HotSet(h, 100, device, rows=hot_rows)
        ids = torch.cat([ids_of("mixed", hot_rows, device, seed=3), ids_of("out_of_range", hot_rows, device)])
        width = spec.columns(None)[1] - spec.columns(None)[0]
        outs, counts = [], []
        for row_tiles in (False, True):
            with GatherLookup(h, spec, device, hot=hs, order="direct") as lk:
                o = poisoned(len(ids), width, spec.output_dtype, device)
                DirectGather(lk._arg, device, spec.output_dtype, counters=lk._counters, dq_scale=lk._dq_scale,
                             bits=spec.scale_arg, has_scale=spec.has_scale, id_base=spec.id_offset, row_lo=lk._row_lo,
                             oob_mode=spec.oob_mode, dequant=spec.dequant, hot_rows=hs.rows, slot_map=hs.slot_map,
                             config=LaunchConfig(16, 1, row_tiles))(ids, o, 0, len(ids))
                outs.append(bits(o))
                counts.append(lk._counters.cpu().clone())
                want = lk.lookup(ids, poisoned(len(ids), width, spec.output_dtype, device))
        assert torch.equal(outs[1], outs[0]) and torch.equal(outs[1], bits(want)), (encoding, oob)
        assert torch.equal(counts[1], counts[0]) and counts[0][2] == 8, (encoding, oob)  # 8 out-of-range ids


@pytest.mark.parametrize("encoding", ["bf16", "fp8_row"])
def test_auto_order_with_a_hot_set_dedups_from_its_own_bound(encoding, monkeypatch):
    """order="auto" with a hot set and dedup sorts from ``tuning.dedup_min_ids(hot=True, dequant=...)``
    ids (lowered here to fit the table), not from the bound without a hot set; bit-exact on either side of
    the bound. (These rows are narrow enough for the order alone to be considered: a workspace either way.)"""
    from uvaple.kernels import tuning

    monkeypatch.setattr(tuning, "DEDUP_MIN_IDS", 20)
    monkeypatch.setattr(tuning, "DEDUP_MIN_IDS_HOT", 40)
    monkeypatch.setattr(tuning, "DEDUP_MIN_IDS_HOT_DEQUANT", 60)
    bound = 60 if encoding == "fp8_row" else 40
    data, kw = ENCODINGS[encoding]()
    with HostTable.from_tensor(data) as h:
        spec = TableSpec.of(h, **kw)
        hot_rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(2))[:50]
        hs = HotSet(h, 60, "cpu", rows=hot_rows)
        with GatherLookup(h, spec, "cpu", hot=hs, order="auto", dedup=True, max_rows=bound - 1) as short:
            assert not short.uses_sorted(bound - 1)
        with GatherLookup(h, spec, "cpu", hot=hs, order="auto", dedup=True, max_rows=80) as lk, \
                GatherLookup(h, spec, "cpu", order="direct") as plain:
            assert not lk.uses_sorted(bound - 1) and lk.uses_sorted(bound) and lk._workspace.shape == (2, 80)
            width = spec.columns(None)[1] - spec.columns(None)[0]
            for n in (bound - 1, bound):
                ids = ids_of("duplicates", hot_rows, "cpu")[:n]
                got = lk.lookup(ids, poisoned(n, width, spec.output_dtype, "cpu"))
                assert torch.equal(bits(got), bits(plain.lookup(ids))), n

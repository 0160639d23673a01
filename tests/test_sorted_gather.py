"""The sorted (locality-ordered, de-duplicated) gather: bit-exact against the reference for every id
pattern and policy, its workspace and path choice, its bad inputs. CPU (interpreted); the GPU run of the
same checks is tests/test_gpu_lookup.py and the speed is `uvaple bench --workload ngram`."""

from __future__ import annotations

import pytest
import torch
from helpers import bits, cover, grid, rand
from hypothesis import given, settings
from hypothesis import strategies as st

from uvaple.integration import GatherLookup, SplitLookup, TableSpec
from uvaple.integration.placements import split as split_plan
from uvaple.kernels import reference_gather, tuning
from uvaple.uva import HostTable

ROWS = 517


def patterns(n: int, rows: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randint(0, rows, (n,), generator=g)
    mostly = torch.full((n,), 7)
    mostly[torch.randint(0, n, (max(1, n // 10),), generator=g)] = torch.randint(0, rows, (max(1, n // 10),),
                                                                                  generator=g)
    edge = torch.tensor([-1, rows, rows - 1, 0, -(2**31), 2**31 - 1, 2**31, -(2**63), 2**63 - 1, 2**62, 3, 3])
    oob = torch.cat([edge, rnd[: max(0, n - edge.numel())]])[:n]
    return {"random": rnd, "sorted": rnd.sort().values, "reversed": rnd.sort(descending=True).values,
            "all_equal": torch.full((n,), rows // 2), "mostly_equal": mostly,
            "out_of_range": oob[torch.randperm(n, generator=g)], "runs": rnd.sort().values.repeat_interleave(3)[:n]}


@pytest.fixture(scope="module")
def table():
    with HostTable.from_tensor(rand(ROWS, 80, torch.bfloat16, seed=5)) as t:  # 160-byte rows
        yield t


def sorted_lookup(table, spec=None, dedup=True, max_rows=4096, **kw):
    return GatherLookup(table, spec or TableSpec.of(table), "cpu", order="sorted", max_rows=max_rows, dedup=dedup,
                        **kw)


# each size, id dtype and order by default, the cheaper first (300 ids sorted without de-duplication: 4-5 s
# interpreted); -m extended: every combination
@pytest.mark.parametrize("n,id_dtype,dedup", cover(grid(n=[1, 2, 17, 300], id_dtype=[torch.int32, torch.int64],
                                                        dedup=[True, False]), (0,), (1,), (2,),
                                                   cost=lambda c: c[0] * (1 if c[2] else 4)))
def test_every_pattern_bit_exact(table, dedup, id_dtype, n):
    with sorted_lookup(table, dedup=dedup) as lk:
        for name, ids in patterns(n, ROWS, seed=n).items():
            if id_dtype == torch.int32:
                ids = ids.clamp(-(2**31), 2**31 - 1)
            ids = ids.to(id_dtype)
            out = torch.full((n, 80), float("nan"), dtype=torch.bfloat16)
            lk.lookup(ids, out)
            assert torch.equal(bits(out), bits(reference_gather(table.tensor, ids))), name


def test_empty_call_and_shapes(table):
    with sorted_lookup(table) as lk:
        assert lk.lookup(torch.empty(0, dtype=torch.int64)).shape == (0, 80)
        ids = torch.randint(0, ROWS, (3, 5, 7))
        out = lk.lookup(ids)
        assert out.shape == (3, 5, 7, 80) and torch.equal(bits(out), bits(reference_gather(table.tensor, ids)))


@pytest.mark.parametrize("oob", ["zero", "row0", "neg_zero"])
def test_policies_scale_conversion_columns_window(oob):
    t = rand(300, 96, torch.float16, seed=2)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, scale=3.5, oob=oob, out_dtype=torch.float32, id_offset=1000, row_window=(40, 250),
                            column_block=32)
        ids = patterns(200, 1300, seed=3)["out_of_range"] + torch.randint(0, 2, (200,)) * 1000
        ids[::4] = 1100  # repeats of a valid id
        with sorted_lookup(h, spec) as lk, GatherLookup(h, spec, "cpu") as direct:
            for cols in [None, (32, 64)]:
                want = direct.lookup(ids, columns=cols)
                got = torch.full_like(want, float("nan"))
                lk.lookup(ids, got, columns=cols)
                assert torch.equal(bits(got), bits(want))
            ref = reference_gather(t, ids, scale=3.5, oob=oob, out_dtype=torch.float32, rows=(40, 250), id_base=1000)
            assert torch.equal(bits(lk.lookup(ids)), bits(ref))


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_dequant_every_code(fmt):
    codes = (torch.arange(256).view(256, 1) + torch.arange(48).view(1, 48)) % 256  # each code at each column
    with HostTable.from_tensor(codes.to(torch.uint8).view(fmt)) as h:
        spec = TableSpec.of(h, encoding="fp8_global", out_dtype=torch.bfloat16, oob="neg_zero")
        for s in (0.0173, -2.5, 1e-30, float("inf")):
            scale = torch.tensor([s], dtype=torch.float32)
            ids = torch.cat([torch.arange(256), torch.tensor([-1, 256, 5, 5, 5])])[torch.randperm(261)]
            with sorted_lookup(h, spec, dequant_scale=scale) as lk:
                got = lk.lookup(ids)
            want = reference_gather(h.tensor, ids, dequant_scale=scale, oob="neg_zero")
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan)
            assert torch.equal(bits(torch.where(nan, 0, got)), bits(torch.where(nan, 0, want))), s


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.one_of(st.integers(-3, ROWS + 3), st.integers(-(2**63), 2**63 - 1), st.just(11)),
                    min_size=1, max_size=200), dedup=st.booleans())
def test_fuzz_against_reference(table, ids, dedup):
    ids = torch.tensor(ids, dtype=torch.int64)
    with sorted_lookup(table, dedup=dedup, count=True) as lk:
        out = torch.full((ids.numel(), 80), float("nan"), dtype=torch.bfloat16)
        lk.lookup(ids, out)
        assert torch.equal(bits(out), bits(reference_gather(table.tensor, ids)))
        st_ = lk.stats()
        assert st_["rows"] == ids.numel() and st_["out_of_range_ids"] == int(((ids < 0) | (ids >= ROWS)).sum())


def test_sorted_needs_max_rows_and_respects_it(table):
    with pytest.raises(ValueError, match="needs max_rows"):
        GatherLookup(table, None, "cpu", order="sorted")
    with pytest.raises(ValueError, match="order must be"):
        GatherLookup(table, None, "cpu", order="fast")
    with sorted_lookup(table, max_rows=8) as lk:
        with pytest.raises(ValueError, match="max_rows=8"):
            lk.lookup(torch.zeros(9, dtype=torch.int64))
    with GatherLookup(table, None, "cpu") as lk:  # no max_rows: direct, no workspace
        assert lk.order == "direct" and lk._workspace is None and not lk.uses_sorted(10**6)


def test_auto_choice_follows_the_heuristic(table, monkeypatch):
    """A lookup's plan takes its size classes from the heuristic when it is built (it never re-plans)."""
    with GatherLookup(table, None, "cpu", max_rows=100_000) as lk:
        span = table.rows * table.stride_bytes
        for n in (1, 4096, 16384, 100_000):
            assert lk.uses_sorted(n) == tuning.use_sorted(n, 160, span)
    monkeypatch.setattr(tuning, "SORT_MIN_SPAN_BYTES", {256: 0, 512: 0})
    monkeypatch.setattr(tuning, "SORT_MIN_IDS", 50)
    monkeypatch.setattr(tuning, "SORT_MIN_IDS_SMALL_SPAN", 50)
    with GatherLookup(table, None, "cpu", max_rows=100_000) as lk:
        assert lk._workspace.shape == (2, 100_000)
        assert lk.uses_sorted(60) and not lk.uses_sorted(49)
        ids = torch.randint(0, ROWS, (333,))
        assert torch.equal(bits(lk.lookup(ids)), bits(reference_gather(table.tensor, ids)))
    lk.close()
    assert lk._workspace is None


def test_auto_with_dedup_sorts_prefill_sized_calls_of_any_rows(monkeypatch):
    """Rows too wide for the order alone to pay (E4B's): with dedup, auto sorts and de-duplicates calls of
    DEDUP_MIN_IDS ids or more, bit-exact, and keeps smaller calls direct; no workspace where no call can
    be that big."""
    monkeypatch.setattr(tuning, "DEDUP_MIN_IDS", 40)
    src = rand(61, 1200, torch.bfloat16, seed=9)  # 2,400-byte rows: above SORT_MAX_ROW_BYTES
    with HostTable.from_tensor(src) as t:
        with GatherLookup(t, None, "cpu", max_rows=39, dedup=True) as small:
            assert small._workspace is None and not small.uses_sorted(39)
        with GatherLookup(t, None, "cpu", max_rows=64) as plain:
            assert plain._workspace is None and not plain.uses_sorted(64)  # no dedup: never sorted
        with GatherLookup(t, None, "cpu", max_rows=64, dedup=True) as lk:
            assert lk._workspace.shape == (2, 64) and lk.uses_sorted(40) and not lk.uses_sorted(39)
            g = torch.Generator().manual_seed(3)
            for n in (39, 40, 64):
                ids = torch.randint(0, 12, (n,), generator=g)  # mostly repeats, as a prefill chunk's
                ids[0] = 60
                out = torch.full((n, 1200), float("nan"), dtype=torch.bfloat16)
                assert lk.lookup(ids, out) is out
                assert torch.equal(bits(out), bits(reference_gather(src, ids)))


def test_heuristic_thresholds():
    gib = 1 << 30
    use = tuning.use_sorted
    # the measured crossovers of the default shape (kernels/tuning.py)
    assert use(16384, 160, 24 * gib) and use(65536, 160, 24 * gib) and use(1 << 20, 160, 24 * gib)
    assert not use(16383, 160, 24 * gib) and not use(4096, 160, 24 * gib)  # the sort's fixed cost
    assert not use(16384, 512, 24 * gib) and use(65536, 512, 24 * gib)  # wider rows: the ids' density too
    assert use(16384, 160, 4 * gib) and not use(4096, 160, 4 * gib)
    assert not use(16384, 160, 1 * gib) and use(65536, 160, 1 * gib)  # a 1 GiB span is read fast directly
    assert not use(1 << 20, 160, gib // 4)  # ... and a 0.25 GiB one faster still
    assert not use(262144, 512, 1 * gib) and use(16384, 512, 4 * gib) and use(65536, 512, 24 * gib)
    assert not use(1 << 20, 2048, 24 * gib) and not use(1 << 20, 17920, 24 * gib)
    assert use(tuning.SORT_MIN_IDS, 32, 4 * gib) and not use(tuning.SORT_MIN_IDS - 1, 32, 4 * gib)
    # de-duplicated calls: from dedup_min_ids ids whatever the rows and span (E4B rows, prefill chunks), later
    # with a hot set (only the misses' repeats are saved), later still for fp8 rows through a hot set
    assert use(2048, 17920, 4 * gib, dedup=True) and not use(2047, 17920, 4 * gib, dedup=True)
    assert use(2048, 160, gib // 4, dedup=True) and not use(8192, 17920, 4 * gib)
    assert use(2048, 17920, 4 * gib, dedup=True, dequant=True)  # no hot set: the first bound
    assert use(4096, 17920, 4 * gib, dedup=True, hot=True) and not use(4095, 17920, 4 * gib, dedup=True, hot=True)
    assert use(16384, 8964, 2 * gib, dedup=True, hot=True, dequant=True)
    assert not use(16383, 8964, 2 * gib, dedup=True, hot=True, dequant=True)
    assert not use(1 << 20, 17920, 4 * gib, hot=True, dequant=True)  # no dedup: E4B rows never sorted


def test_operator_refuses_a_bad_workspace(table):
    ids = torch.randint(0, ROWS, (10,))
    out = torch.empty(10, 80, dtype=torch.bfloat16)
    op = torch.ops.uvaple.gather_rows_sorted
    for ws in (torch.empty(2, 9, dtype=torch.int64), torch.empty(2, 10, dtype=torch.int32),
               torch.empty(3, 10, dtype=torch.int64), torch.empty(10, 2, dtype=torch.int64).t()):
        with pytest.raises(ValueError, match="workspace must be"):
            op(table.tensor, ids, out, None, None, ws, 0, False, 0, 0, 0, 0, 0, True)
    with pytest.raises(ValueError, match="columns"):
        op(table.tensor, ids, torch.empty(10, 81, dtype=torch.bfloat16), None, None,
           torch.empty(2, 10, dtype=torch.int64), 0, False, 0, 0, 0, 0, 0, True)


def test_sorted_config_shapes():
    c = tuning.sorted_config(160, 1)
    assert (c.block_rows, c.block_cols) == (16, 256)
    plain = tuning.sorted_config(160, 1, dedup=False)  # no repeats to find: one row per program
    assert (plain.block_rows, plain.block_cols, plain.num_warps) == (1, 256, tuning.SORTED_NUM_WARPS)
    assert tuning.sorted_config(160, 1, dedup=False, num_warps=16).num_warps == 16
    assert c.num_warps == tuning.SORTED_NUM_WARPS
    big = tuning.sorted_config(17920, 2)
    assert big.block_rows == tuning.SORTED_MIN_ROWS and big.block_cols * 2 == tuning.SORTED_TILE_BYTES
    tiny = tuning.sorted_config(16, 4)
    assert tiny.block_rows == tuning.SORTED_MAX_ROWS and tiny.block_cols == 4


def test_sorted_launch_config_takes_warps_by_gap_for_one_tile_rows_only():
    """The launch's shape: one-row programs of rows within a tile take warps by the ids' gap (the window),
    de-duplicating programs and rows of several tiles the default warps, whatever the gap."""
    from uvaple.kernels.gather_sorted import sorted_launch_config

    cpu = torch.device("cpu")
    small = torch.empty(1000, 160, dtype=torch.uint8)
    wide = torch.empty(1000, 8960, dtype=torch.bfloat16)
    assert sorted_launch_config(small, cpu, 8, 160, 0, False).num_warps == tuning.sorted_warps(8, 160_000, 132)
    big = torch.empty(150_000_000, 160, dtype=torch.uint8, device="meta")  # 24 GB of rows: shape and strides only
    wide_big = torch.empty(1_500_000, 8960, dtype=torch.bfloat16, device="meta")
    assert sorted_launch_config(big, cpu, 16384, 160, 0, False).num_warps == tuning.SORTED_ONE_ROW_WARPS[-1]
    assert sorted_launch_config(big, cpu, 1 << 20, 160, 0, False).num_warps == tuning.SORTED_ONE_ROW_WARPS[0]
    assert sorted_launch_config(big, cpu, 16384, 160, 0, True).num_warps == tuning.SORTED_NUM_WARPS
    assert sorted_launch_config(wide_big, cpu, 16384, 8960, 0, False).num_warps == tuning.SORTED_NUM_WARPS
    assert sorted_launch_config(wide, cpu, 8, 8960, 0, False).num_warps == tuning.SORTED_NUM_WARPS
    # the span is the window's: rows below row_lo are not read
    assert sorted_launch_config(big, cpu, 16384, 160, 149_990_000, False).num_warps == tuning.SORTED_NUM_WARPS


def test_sorted_warps_keep_the_rows_in_flight_within_the_window():
    """One-row programs: the fewest warps whose rows in flight (132 SMs x programs an SM) span at most the
    window, from the measured cases (24 GiB: 32 warps at 16,384 ids, 8 at 65,536, 4 from 262,144) to the
    bounds (every choice too wide: the most warps; no ids or one: no error)."""
    gib = 1 << 30
    assert [tuning.sorted_warps(n, 24 * gib, 132) for n in (16384, 65536, 262144, 1 << 20)] == [32, 8, 4, 4]
    assert tuning.sorted_warps(65536, gib, 132) == 4  # dense in a small table: the most rows in flight
    assert tuning.sorted_warps(10, 24 * gib, 132) == tuning.SORTED_ONE_ROW_WARPS[-1]
    assert tuning.sorted_warps(0, 24 * gib, 132) == tuning.SORTED_ONE_ROW_WARPS[-1]
    for n in (1000, 16384, 65536, 300_000):
        w = tuning.sorted_warps(n, 24 * gib, 132)
        rows_in_flight = 132 * min(tuning.SM_BLOCKS, tuning.SM_WARPS // w)
        fits = rows_in_flight * 24 * gib / n <= tuning.SORTED_WINDOW_BYTES
        assert fits or w == tuning.SORTED_ONE_ROW_WARPS[-1]
        fewer = [v for v in tuning.SORTED_ONE_ROW_WARPS if v < w]  # none of the wider choices fits
        assert all(132 * min(tuning.SM_BLOCKS, tuning.SM_WARPS // v) * 24 * gib / n
                   > tuning.SORTED_WINDOW_BYTES for v in fewer)


def test_split_needs_a_gpu_and_max_rows(table):
    with pytest.raises(ValueError, match="split lookup needs max_rows and a CUDA device"):
        SplitLookup(table, None, "cpu", max_rows=10)
    with GatherLookup(table, None, "cpu") as lk:  # host ids are the split lookup's alone
        assert not hasattr(lk, "lookup_split")


def test_split_share_table():
    first = split_plan.SPLIT_GPU_SHARE[0][0]
    assert split_plan.split_gpu_share(1, 160, 0) == split_plan.split_gpu_share(first - 1, 160, 0) == 1.0
    assert split_plan.split_chunk_rows(first - 1) == first - 1  # the GPU's alone: nothing staged in chunks
    for at, share, chunk in split_plan.SPLIT_PLAN:
        assert split_plan.split_gpu_share(at, 160, 0) == share and 0 < share < 1
        assert split_plan.split_chunk_rows(at) == (chunk or at)
        assert split_plan.split_chunk_rows(at + 1) == (chunk or at + 1)
    assert split_plan.SPLIT_CPU_PATH in ("torch", "parallel")


def test_split_graph_ladder():
    """The GPU-share sizes a split lookup captures: from SPLIT_GRAPH_MIN_ROWS, multiples of 256, each step at
    most 2^(1/STEPS) (+ rounding) above the last, below max_rows and within the row and byte caps; a share
    maps to the size at or below it, none below the ladder or past its top by a step."""
    h = split_plan
    sizes = h.split_graph_sizes(1 << 20, 320)
    assert sizes[0] == h.SPLIT_GRAPH_MIN_ROWS and sizes[-1] == h.SPLIT_GRAPH_MAX_ROWS
    assert all(s % 256 == 0 for s in sizes) and list(sizes) == sorted(set(sizes))
    assert all(b <= a * 2 ** (1 / h.SPLIT_GRAPH_STEPS) + 256 for a, b in zip(sizes, sizes[1:], strict=False))
    assert h.split_graph_sizes(h.SPLIT_GRAPH_MIN_ROWS, 320) == ()  # a share is below max_rows
    assert h.split_graph_sizes(h.SPLIT_GRAPH_MIN_ROWS + 1, 320) == (h.SPLIT_GRAPH_MIN_ROWS,)
    assert max(h.split_graph_sizes(1 << 20, 17_920)) * 17_920 <= h.SPLIT_GRAPH_MAX_BYTES
    assert h.split_graph_sizes(1 << 20, h.SPLIT_GRAPH_MAX_BYTES) == ()
    assert h.split_graph_rows(h.SPLIT_GRAPH_MIN_ROWS - 1, sizes) == 0
    for a, b in zip(sizes, sizes[1:], strict=False):
        assert h.split_graph_rows(a, sizes) == a and h.split_graph_rows(b - 1, sizes) == a
    top = sizes[-1]
    assert h.split_graph_rows(top + 1, sizes) == top
    assert h.split_graph_rows(int(top * 2 ** (1 / h.SPLIT_GRAPH_STEPS)) + 1, sizes) == 0
    assert h.split_graph_rows(5000, ()) == 0


@pytest.mark.parametrize("oob", ["zero", "row0", "neg_zero"])
@pytest.mark.parametrize("dedup", [True, False])
def test_row_keys_and_ids_as_given_sort_to_the_same_bits(monkeypatch, oob, dedup):
    """The sort keys: 4-byte row keys (every table below ``ROW_KEY_MAX`` rows) and, for bigger tables, the
    ids as given (forced here by lowering the bound): the same bits and counters, with a row window, an id
    offset, many out-of-range ids (one run of key 0: one leader under dedup) and runs crossing programs."""
    from uvaple.kernels import gather_sorted as kgather

    t = rand(300, 24, torch.bfloat16, seed=9)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, oob=oob, id_offset=50, row_window=(20, 260))
        g = torch.Generator().manual_seed(4)
        ids = torch.cat([torch.randint(40, 330, (150,), generator=g), torch.full((40,), 77),
                         patterns(60, 400, seed=6)["out_of_range"]])[torch.randperm(250, generator=g)]
        got = {}
        for bound in (kgather.ROW_KEY_MAX, 5):
            monkeypatch.setattr(kgather, "ROW_KEY_MAX", bound)
            with sorted_lookup(h, spec, dedup=dedup, max_rows=256) as lk:
                out = torch.full((250, 24), float("nan"), dtype=torch.bfloat16)
                lk.lookup(ids, out)
                got[bound] = (bits(out), lk.stats())
        ref = reference_gather(t, ids, oob=oob, rows=(20, 260), id_base=50)
        (a, sa), (b, sb) = got.values()
        assert torch.equal(a, bits(ref)) and torch.equal(b, bits(ref))
        assert sa == sb and sa["out_of_range_ids"] == int(((ids - 50 < 20) | (ids - 50 >= 260)).sum())

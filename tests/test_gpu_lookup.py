"""The lookup object on a real GPU: compiled full graphs inside captured CUDA graphs, counters under replay.

Skipped where there is no CUDA (CI); run on the GPU machine (perf/gpu_check.sh), log committed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import bits, capture, on_cuda_1_behind_a_busy_stream, rand

from uvaple.integration import make_lookup
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def table():
    t = rand(3001, 35 * 256, seed=7)  # Gemma 3n E4B rows (17,920 B)
    with HostTable.from_tensor(t, register=True) as h:
        yield t, h


@pytest.mark.parametrize("kind", ["uva", "device"])
def test_compiled_full_graph_inside_a_captured_cuda_graph_replays_new_ids(table, kind):
    t, h = table
    with make_lookup(kind, h, scale=16.0, oob="row0", column_block=256) as lk:
        def step(ids, out):
            lk.lookup(ids, out, columns=(256, 35 * 256))
            return out

        compiled = torch.compile(step, fullgraph=True)
        ids = torch.randint(0, h.rows, (8, 16), device=DEV)
        out = torch.empty(8, 16, 34 * 256, dtype=torch.bfloat16, device=DEV)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                compiled(ids, out)  # compile and warm outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled(ids, out)
        before = lk.stats()["lookups"]
        for seed in range(5):
            new = torch.randint(-5, h.rows + 5, (8, 16), generator=torch.Generator().manual_seed(seed))
            ids.copy_(new)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = reference_gather(t, new, scale=16.0, oob="row0", columns=(256, 35 * 256))
            assert torch.equal(bits(out), bits(want)), seed
        st = lk.stats()
        assert st["lookups"] - before == 5 and st["rows"] >= 5 * 128  # the device counters count replays


def test_reduce_overhead_compile_keeps_cuda_graphs_over_a_host_table(table):
    from torch._dynamo.utils import counters

    t, h = table
    with make_lookup("uva", h, scale=16.0) as lk:
        def step(ids):
            return lk.lookup(ids).float().sum(-1)

        counters.clear()
        compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
        for seed in range(4):
            ids = torch.randint(0, h.rows, (32,), generator=torch.Generator().manual_seed(seed)).to(DEV)
            got = compiled(ids).clone()
            want = reference_gather(t, ids, scale=16.0).float().sum(-1)
            assert torch.allclose(got.cpu(), want, rtol=1e-5, atol=1e-2)
        skips = sum(v for k, v in counters["inductor"].items() if "cudagraph_skip" in k)
        assert skips == 0, dict(counters["inductor"])


def test_counters_are_right_after_concurrent_streams(table):
    _, h = table
    with make_lookup("uva", h) as lk:
        streams = [torch.cuda.Stream() for _ in range(3)]
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                for _ in range(10):
                    lk.lookup(torch.tensor([i, -1, h.rows + i], device=DEV))
        torch.cuda.synchronize()
        st = lk.stats()
        assert (st["lookups"], st["rows"], st["out_of_range_ids"]) == (30, 90, 60), st


@pytest.fixture(scope="module")
def fp8_table():
    codes = torch.randint(0, 256, (40_000, 160), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x11  # no NaN codes: outputs compare by bits
    with HostTable.from_tensor(codes.view(torch.float8_e4m3fn), register=True) as h:
        yield h


@pytest.mark.parametrize("dedup", [True, False])
def test_sorted_gather_in_a_cuda_graph_replays_new_ids(fp8_table, dedup):
    """The n-gram path on the GPU: fp8 rows dequantised in the kernel, ids sorted on the device, repeats
    read once; captured once, replayed with new ids (random, all equal, runs, out of range, mostly out of
    range)."""
    from uvaple.integration import GatherLookup, TableSpec

    h = fp8_table
    scale = torch.tensor([0.0173], device=DEV)
    spec = TableSpec.of(h, encoding="fp8_global", out_dtype=torch.bfloat16, oob="neg_zero")
    n = 20_000
    with GatherLookup(h, spec, DEV, dequant_scale=scale, max_rows=n, order="sorted", dedup=dedup) as lk:
        ids = torch.randint(0, h.rows, (n,), device=DEV)
        out = torch.empty(n, 160, dtype=torch.bfloat16, device=DEV)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lk.lookup(ids, out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lk.lookup(ids, out)
        g = torch.Generator().manual_seed(9)
        shard = torch.randint(h.rows, 8 * h.rows, (n,), generator=g)  # mostly out of range, as a shard's ids
        shard[::8] = torch.randint(0, h.rows, (shard[::8].numel(),), generator=g)
        cases = [torch.randint(-3, h.rows + 3, (n,), generator=g), torch.full((n,), 123),
                 torch.randint(0, 500, (n,), generator=g).sort().values,
                 torch.cat([torch.tensor([-(2**63), 2**63 - 1, -1, h.rows]), torch.randint(0, h.rows, (n - 4,))]),
                 shard]
        for k, new in enumerate(cases):
            ids.copy_(new)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            want = reference_gather(h.tensor, new, dequant_scale=scale, oob="neg_zero")
            assert torch.equal(bits(out), bits(want)), k
        before = torch.cuda.memory_stats()["allocated_bytes.all.current"]
        lk.lookup(ids, out)  # eager: the sort's scratch comes from the caching allocator and goes back
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocated_bytes.all.current"] == before


def test_auto_order_on_the_gpu_matches_direct(fp8_table):
    from uvaple.integration import GatherLookup, TableSpec
    from uvaple.kernels import tuning

    h = fp8_table
    scale = torch.tensor([2.5], device=DEV)
    spec = TableSpec.of(h, encoding="fp8_global", out_dtype=torch.bfloat16)
    n = tuning.SORT_MIN_IDS * 2
    with GatherLookup(h, spec, DEV, dequant_scale=scale, max_rows=n) as auto, \
            GatherLookup(h, spec, DEV, dequant_scale=scale, order="direct") as direct:
        ids = torch.randint(0, h.rows, (n,), device=DEV)
        assert torch.equal(bits(auto.lookup(ids)), bits(direct.lookup(ids)))


@pytest.mark.parametrize("oob", ["zero", "row0", "neg_zero"])
def test_split_lookup_matches_lookup(fp8_table, oob):
    """Host ids, a share gathered by this thread into pinned staging, the rest by the GPU: same bits,
    call after call over the same staging, whatever the share."""
    from uvaple.integration import SplitLookup, TableSpec

    h = fp8_table
    scale = torch.tensor([0.25], device=DEV)
    spec = TableSpec.of(h, encoding="fp8_global", out_dtype=torch.bfloat16, oob=oob, id_offset=100,
                        row_window=(5, h.rows - 7))
    n = 30_000
    with SplitLookup(h, spec, DEV, dequant_scale=scale, max_rows=n) as lk:
        outs = []
        for share, id_dtype, chunk in ((0.0, torch.int64, 4096), (0.3, torch.int32, 7), (0.5, torch.int64, None),
                                       (1.0, torch.int64, 1), (None, torch.int32, 29_999), (0.2, torch.int64, 1 << 20)):
            ids = torch.randint(-3, h.rows + 110, (n,))
            ids[:50] = 2**31 - 1
            ids[50:60] = -2**31
            ids = ids.to(id_dtype)
            out = torch.full((n, 160), float("nan"), dtype=torch.bfloat16, device=DEV)
            lk.lookup_split(ids, out, gpu_share=share, chunk_rows=chunk)
            outs.append((ids, out))  # the next call reuses the staging while this one may still copy
        for ids, out in outs:
            assert torch.equal(bits(out), bits(lk.lookup(ids.to(DEV))))
        with pytest.raises(ValueError, match="host ids"):
            lk.lookup_split(ids.to(DEV), out)
        with pytest.raises(ValueError, match="gpu_share"):
            lk.lookup_split(ids, out, gpu_share=1.5)
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="chunk_rows"):
                lk.lookup_split(ids, out, chunk_rows=bad)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cannot be captured"):
            with torch.cuda.graph(graph):
                lk.lookup_split(ids, out)


@pytest.mark.parametrize("offset,window", [(0, None), (100, (5, -7))])
def test_split_lookup_in_range_ids(fp8_table, offset, window, monkeypatch):
    """Every id of the CPU's share inside the window: the ids are staged as they are (less the offset, no
    serial pass, staged ids a device arange). Same bits as lookup, int32 and int64, the window's edges
    included, call after call over the same staging; one id outside falls back to the serial pass (and
    only then is that pass run)."""
    import uvaple.integration.placements.split as lookup_mod
    from uvaple.integration import SplitLookup, TableSpec

    passes = []
    serial = lookup_mod.split_rows
    monkeypatch.setattr(lookup_mod, "split_rows", lambda *a: passes.append(1) or serial(*a))

    h = fp8_table
    scale = torch.tensor([0.75], device=DEV)
    lo, hi = (0, h.rows) if window is None else (window[0], h.rows + window[1])
    spec = TableSpec.of(h, encoding="fp8_global", out_dtype=torch.bfloat16, oob="row0", id_offset=offset,
                        row_window=None if window is None else (lo, hi))
    n = 20_000
    g = torch.Generator().manual_seed(offset + 3)
    with SplitLookup(h, spec, DEV, dequant_scale=scale, max_rows=n) as lk:
        outs = []
        for share, id_dtype, edge_out in ((0.0, torch.int64, False), (0.4, torch.int32, False),
                                          (0.25, torch.int64, True), (0.0, torch.int32, True)):
            ids = torch.randint(lo + offset, hi + offset, (n,), generator=g)
            ids[-1], ids[-2] = lo + offset, hi - 1 + offset  # both edges, in the CPU's share
            if edge_out:
                ids[-3] = hi + offset  # one past the window: the serial pass
            ids = ids.to(id_dtype)
            out = torch.full((n, 160), float("nan"), dtype=torch.bfloat16, device=DEV)
            before = len(passes)
            lk.lookup_split(ids, out, gpu_share=share)
            assert len(passes) - before == (1 if edge_out else 0), (share, id_dtype, edge_out)
            outs.append((ids, out))
        st = lk.stats()
        for ids, out in outs:
            assert torch.equal(bits(out), bits(lk.lookup(ids.to(DEV))))
        assert st["out_of_range_ids"] == 2 and st["rows"] == 4 * n and st["lookups"] == 4


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_split_lookup_reads_the_scale_as_it_is_at_each_call(fp8_table, out_dtype):
    """The CPU share's rows get the dequantisation scale of the moment (a scale written in place between
    calls, on the stream, is the one used), in every output dtype: lookup's bits, whatever the share."""
    from uvaple.integration import SplitLookup, TableSpec

    h = fp8_table
    scale = torch.tensor([0.5], device=DEV)
    spec = TableSpec.of(h, encoding="fp8_global", out_dtype=out_dtype)
    n = 5000
    g = torch.Generator().manual_seed(21)
    with SplitLookup(h, spec, DEV, dequant_scale=scale, max_rows=n) as lk:
        for value, share in ((0.5, 0.0), (-3.25, 0.0), (1e-3, 0.4), (7.0, 0.4)):
            scale.fill_(value)
            ids = torch.randint(0, h.rows, (n,), generator=g)
            out = torch.full((n, 160), float("nan"), dtype=out_dtype, device=DEV)
            lk.lookup_split(ids, out, gpu_share=share)
            want = reference_gather(h.tensor, ids, dequant_scale=scale, out_dtype=out_dtype)
            assert torch.equal(bits(out), bits(want)), (value, share)


def test_split_lookup_replays_the_gpu_share_graph(fp8_table, monkeypatch):
    """A GPU share on the ladder replays the graph captured at construction (no eager lookup; a share
    between two sizes rounds down, one outside the ladder launches eagerly); the graphs' warm-up leaves the
    counters at zero; same bits as lookup; a lookup dropped with a call in flight waits for it first."""
    import gc

    from uvaple.integration import GatherLookup, SplitLookup, TableSpec
    from uvaple.integration.placements import split as split_plan

    h = fp8_table
    scale = torch.tensor([1.5], device=DEV)
    spec = TableSpec.of(h, encoding="fp8_global", out_dtype=torch.bfloat16, oob="neg_zero")
    n = 20_000
    lk = SplitLookup(h, spec, DEV, dequant_scale=scale, max_rows=n)
    sizes = split_plan.split_graph_sizes(n, 320)
    assert sizes and sizes[0] == split_plan.SPLIT_GRAPH_MIN_ROWS and sizes[-1] < n
    assert sorted(lk._split.graphs) == list(sizes)
    st = lk.stats()
    assert st["lookups"] == 0 and st["rows"] == 0
    eager = []
    real = GatherLookup.lookup
    monkeypatch.setattr(GatherLookup, "lookup",
                        lambda self, *a, **kw: eager.append(a[0].numel()) or real(self, *a, **kw))
    g = torch.Generator().manual_seed(11)
    outs = []
    for share, want_eager in ((0.3, []), (0.41, []), (0.1, [2000]), (1.0, [n]), (0.0, [])):
        ids = torch.randint(-5, h.rows + 5, (n,), generator=g)
        ids[::97] = 7  # repeats
        out = torch.full((n, 160), float("nan"), dtype=torch.bfloat16, device=DEV)
        eager.clear()
        lk.lookup_split(ids, out, gpu_share=share)
        assert eager == want_eager, (share, eager)
        outs.append((ids, out))
    assert split_plan.split_graph_rows(round(n * 0.41), sizes) < round(n * 0.41)  # rounded down
    st = lk.stats()
    assert st["lookups"] == len(outs) and st["rows"] == len(outs) * n
    for ids, out in outs:
        assert torch.equal(bits(out), bits(lk.lookup(ids.to(DEV))))
    # dropped without close() while the GPU still waits to run the call: the finaliser waits for it
    ids = torch.randint(0, h.rows, (n,), generator=g)
    out = torch.full((n, 160), float("nan"), dtype=torch.bfloat16, device=DEV)
    torch.cuda._sleep(200_000_000)
    lk.lookup_split(ids, out, gpu_share=0.3)
    del lk
    gc.collect()
    scribble = [torch.randn(n, 160, device=DEV) for _ in range(4)]  # reuses what the lookup gave back
    with GatherLookup(h, spec, DEV, dequant_scale=scale, order="direct") as ref:
        assert torch.equal(bits(out), bits(ref.lookup(ids.to(DEV))))
    del scribble


def test_split_lookup_dropped_or_closed_during_a_graph_capture_leaves_the_capture_intact():
    """A split lookup's last words wait for its last call: when the collector runs them in the middle of a
    CUDA graph capture in the default (global) mode, on the capturing thread or on another one, and when
    close() is called there, the capture still succeeds and replays the right bits (a wait in global mode
    would fail and invalidate the capture)."""
    code = textwrap.dedent("""
        import gc, threading
        import torch
        from uvaple.uva import HostTable
        from uvaple.integration import SplitLookup, TableSpec
        g = torch.Generator().manual_seed(9)
        t = torch.randn(20000, 64, generator=g).to(torch.bfloat16)
        h = HostTable.from_tensor(t, register=True)
        def split_lookup():
            lk = SplitLookup(h, TableSpec.of(h), "cuda", max_rows=20000)
            ids = torch.randint(0, 20000, (20000,), generator=g)
            out = torch.empty(20000, 64, dtype=torch.bfloat16, device="cuda")
            torch.cuda._sleep(100_000_000)  # the call still in flight when the lookup goes
            lk.lookup_split(ids, out, gpu_share=0.5)
            return lk, bool(torch.equal(out.cpu(), t[ids]))
        x = torch.randn(4096, device="cuda")
        def capture(during):
            y = torch.empty_like(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # capture_error_mode="global"
                y.copy_(x * 2)
                during()
                y.add_(1)
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            return bool(torch.equal(y, x * 2 + 1))
        results = []
        lk, ok = split_lookup()
        def drop_here():
            global lk
            del lk
            gc.collect()
        results.append(("dropped on the capturing thread", ok and capture(drop_here)))
        lk, ok = split_lookup()
        results.append(("closed on the capturing thread", ok and capture(lk.close) and lk.closed))
        lk, ok = split_lookup()
        def drop_elsewhere():
            def run():
                global lk
                del lk
                gc.collect()
            th = threading.Thread(target=run)
            th.start()
            th.join()
        results.append(("dropped on another thread", ok and capture(drop_elsewhere)))
        for what, good in results:
            print(what, int(good), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for what in ("dropped on the capturing thread", "closed on the capturing thread", "dropped on another thread"):
        assert f"{what} 1" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert "Exception ignored" not in r.stderr, r.stderr[-3000:]


def test_split_lookup_first_call_on_another_stream_waits_for_the_capture():
    """The graphs' warm-up (eager calls on a side stream, the counters restored after them) is done before a
    first call on any stream touches the same buffers: the warm-up slowed by a GPU sleep, streams on their
    own hardware queues, a call on a new stream right after construction keeps its counts and bits."""
    code = textwrap.dedent("""
        import os
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"  # streams on their own queues: no false ordering
        import torch
        from uvaple.uva import HostTable
        from uvaple.integration import GatherLookup, SplitLookup, TableSpec
        g = torch.Generator().manual_seed(5)
        t = torch.randn(20000, 64, generator=g).to(torch.bfloat16)
        h = HostTable.from_tensor(t, register=True)
        real, slowed = GatherLookup.lookup, []
        def slow(self, *a, **kw):
            if not slowed:  # the first warm-up call: its stream sleeps first
                slowed.append(1)
                torch.cuda._sleep(1_000_000_000)
            return real(self, *a, **kw)
        GatherLookup.lookup = slow
        lk = SplitLookup(h, TableSpec.of(h), "cuda", max_rows=20000)
        GatherLookup.lookup = real
        ids = torch.randint(0, 20000, (20000,), generator=g)
        out = torch.full((20000, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            lk.lookup_split(ids, out, gpu_share=0.5)
        st = lk.stats()
        print("slowed", len(slowed), "lookups", st["lookups"], "rows", st["rows"],
              "exact", int(torch.equal(out.cpu(), t[ids])), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "slowed 1 lookups 1 rows 20000 exact 1" in r.stdout, (r.stdout, r.stderr[-3000:])


def test_hot_set_lookups_counting_and_refresh_never_synchronise():
    """The hot path of a counting hot set, and its refresh, under torch's sync debug mode set to error: no
    host synchronisation anywhere (the served ids are counted and ranked on the device)."""
    from uvaple.integration import GatherLookup, HotSet, TableSpec

    g = torch.Generator().manual_seed(17)
    data = (torch.randn(5000, 8960, generator=g) * 0.1).to(torch.bfloat16)  # E4B-wide rows
    with HostTable.from_tensor(data, register=True) as h:
        hs = HotSet(h, 250, DEV, count_ids=True)
        with GatherLookup(h, TableSpec.of(h), DEV, hot=hs, max_rows=8192, order="sorted", dedup=True) as lk:
            ids = torch.randint(0, 5000, (4, 8192), device=DEV)
            out = torch.empty(8192, 8960, dtype=torch.bfloat16, device=DEV)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for step in range(4):
                    lk.lookup(ids[step, : 64 if step % 2 else 8192], out[: 64 if step % 2 else 8192])
                    hs.refresh()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
            check = ids[0, :2000]
            assert torch.equal(bits(lk.lookup(check)), bits(data[check.cpu()]))
            assert lk.stats()["hot_hits"] > 0


def test_many_live_graphs_in_one_shared_pool_replay_in_any_order(table):
    """vLLM's capture pattern: one graph per batch size, largest first, every graph alive at once in one
    shared memory pool, replayed one at a time in any order. Every lookup kind of a PLE table (direct, hot
    set, sorted+dedup, hot set + dedup, fp8 rows) at 1/8/64/200 ids, outputs preallocated or allocated in
    the pool, every graph replayed three times in shuffled order, each replay checked bit for bit against
    the reference (fresh ids each time, out-of-range ones and hot rows among them)."""
    from uvaple.integration import GatherLookup, HotSet, TableSpec
    from uvaple.integration.quantize import fp8_row_table

    t, h = table
    fp8, _ = fp8_row_table(t, out_dtype=torch.bfloat16)
    sizes = (200, 64, 8, 1)
    hot_rows = torch.randperm(h.rows, generator=torch.Generator().manual_seed(4))[:300]
    kinds = {
        "direct": (h, TableSpec.of(h), {"order": "direct"}),
        "hot": (h, TableSpec.of(h), {"order": "direct", "hot": HotSet(h, 320, DEV, rows=hot_rows)}),
        "dedup": (h, TableSpec.of(h), {"order": "sorted", "dedup": True, "max_rows": max(sizes)}),
        "hot_dedup": (h, TableSpec.of(h), {"order": "sorted", "dedup": True, "max_rows": max(sizes),
                                           "hot": HotSet(h, 320, DEV, rows=hot_rows)}),
        "fp8_row": (fp8, TableSpec.of(fp8, encoding="fp8_row", out_dtype=torch.bfloat16), {"order": "direct"}),
    }
    refs = {name: (lambda ids: reference_gather(t, ids)) for name in kinds}
    refs["fp8_row"] = lambda ids: reference_gather(fp8.tensor, ids, row_scale=True, out_dtype=torch.bfloat16)
    lookups, graphs = [], []
    try:
        pool = torch.cuda.graph_pool_handle()
        for name, (tab, spec, kw) in kinds.items():
            lk = GatherLookup(tab, spec, DEV, **kw)
            lookups.append(lk)
            cols = spec.columns(None)[1] - spec.columns(None)[0]
            for n in sizes:
                for inside in (False, True):  # the output preallocated, or allocated in the capture's pool
                    ids = torch.randint(0, h.rows, (n,), device=DEV)
                    out = None if inside else torch.empty(n, cols, dtype=spec.output_dtype, device=DEV)
                    g, res = capture(lambda lk=lk, ids=ids, out=out: lk.lookup(ids, out), pool=pool)
                    graphs.append((name, n, g, ids, res))
        gen = torch.Generator().manual_seed(11)
        order = torch.cat([torch.randperm(len(graphs), generator=gen) for _ in range(3)])  # each graph 3 times
        for step, k in enumerate(order.tolist()):
            name, n, g, ids, res = graphs[k]
            new = torch.randint(-2, h.rows + 2, (n,), generator=gen)
            if step % 2 == 0:
                new[: n // 2] = hot_rows[torch.randint(0, len(hot_rows), (n // 2,), generator=gen)]
            ids.copy_(new)
            res.view(torch.int16).fill_(0x7FA5)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(res.cpu()), bits(refs[name](new))), (step, name, n)
    finally:
        graphs.clear()
        for lk in lookups:
            lk.close()
        fp8.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (device kind nvidia-h200-x2)")
@pytest.mark.parametrize("kind", ["uva", "device"])
def test_a_lookup_of_the_second_gpu_runs_there_in_its_stream_order_whatever_device_is_current(table, kind):
    """Triton launches on the current device; a lookup launches on its tensors' device, on that device's
    current stream, as a torch operator does."""
    t, h = table
    dev1 = torch.device("cuda:1")
    want_ids = torch.randint(0, h.rows, (257,), generator=torch.Generator().manual_seed(5))
    with make_lookup(kind, h, device=dev1, scale=16.0) as lk:
        lk.lookup(want_ids.to(dev1))  # planned and compiled for cuda:1 before the timed order matters
        torch.cuda.synchronize(dev1)
        ids = torch.full((257,), -1, dtype=torch.long, device=dev1)  # out-of-range: zero rows if read early
        out = torch.full((257, t.shape[1]), float("nan"), dtype=t.dtype, device=dev1)
        src = want_ids.to(dev1)
        torch.cuda.synchronize(dev1)
        busy = on_cuda_1_behind_a_busy_stream(lambda: lk.lookup(ids, out), ids, src)
        busy.synchronize()
        assert bits(out.cpu()) == bits(reference_gather(t, want_ids, scale=16.0))


def test_the_bare_launch_of_a_call_writes_that_calls_rows(table):
    """``DirectGather.bare`` (the host-cost workload's floor): the compiled kernel launched with the call's
    arguments bound, replayed after the ids change in place, gives the lookup's rows each time."""
    t, h = table
    with make_lookup("uva", h, device="cuda") as lk:
        ids = torch.randint(0, h.rows, (37,), device="cuda")
        out = torch.empty(37, h.cols, dtype=h.dtype, device="cuda")
        lk.lookup(ids, out)
        launch = lk.plan.direct.bare(ids, out)
        for seed in range(3):
            ids.copy_(torch.randint(0, h.rows, (37,), generator=torch.Generator().manual_seed(seed)))
            out.fill_(float("nan"))
            launch()
            torch.cuda.synchronize()
            assert torch.equal(bits(out), bits(reference_gather(t, ids)))

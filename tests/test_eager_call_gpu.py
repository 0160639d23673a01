"""The eager C call on a real GPU: the calls it serves give the Python path's bits, and what it declines is the
Python path's (its named errors, a capture, a profiler's hooks, a call on another stream).

Skipped where there is no CUDA (CI); run on the GPU machine (perf/gpu_check.sh), log committed.
"""

from __future__ import annotations

import pytest
import torch
from helpers import bits, rand

from uvaple.integration import GatherLookup, HotSet, TableSpec, make_lookup
from uvaple.integration.errors import BackendClosed
from uvaple.kernels import eager_call, reference_gather
from uvaple.uva import HostTable

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def served(lk) -> int:
    return lk._eager.stats()["calls"]


@pytest.fixture(scope="module")
def table():
    t = rand(2003, 136, seed=3)  # odd rows; 272-byte rows (an n-gram table's are 320)
    with HostTable.from_tensor(t, register=True) as h:
        yield t, h


def test_the_c_call_is_built_on_the_gpu_machine():
    assert eager_call.unavailable() is None


@pytest.mark.parametrize("kind", ["uva", "device"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (64,), (2, 3, 41)])
def test_every_variant_it_serves_gives_the_python_paths_bits(table, kind, dtype, shape):
    t, h = table
    with make_lookup(kind, h, oob="zero") as lk:
        gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
        for aligned_ids in (True, False):
            for aligned_out in (True, False):
                for alloc in (False, True):
                    n = torch.Size(shape).numel()
                    host = torch.randint(-3, h.rows + 3, shape, generator=gen)
                    ids_buf = torch.empty(n + 4, dtype=dtype, device=DEV)
                    off = 0 if aligned_ids else 1  # one id in: 4 or 8 bytes off a 16-byte address
                    ids = ids_buf[off:off + n].view(shape)
                    ids.copy_(host)
                    out_buf = torch.full((n * 136 + 136,), float("nan"), dtype=torch.bfloat16, device=DEV)
                    out = None if alloc else out_buf[0 if aligned_out else 1:][: n * 136].view(*shape, 136)
                    lk.lookup(ids, out)  # a variant's first call teaches it (or is the C call's, taught before)
                    before = served(lk)
                    got = lk.lookup(ids, out)
                    assert served(lk) == before + 1, (aligned_ids, aligned_out, alloc, lk._plan.direct.eager_refused)
                    assert got.shape == (*shape, 136) and got.dtype == torch.bfloat16
                    if out is not None:
                        assert got is out
                    torch.cuda.synchronize()
                    assert torch.equal(bits(got.cpu()), bits(reference_gather(t, host))), (aligned_ids, aligned_out)
        # ids aligned or not x out aligned or not: four variants of the dtype (an allocated out is aligned)
        assert lk._eager.taught() == 4
        st = lk.stats()
        assert st["lookups"] == 2 * 8 and st["rows"] == 2 * 8 * torch.Size(shape).numel()  # the C calls count too


def test_fp8_rows_a_hot_set_a_window_and_a_scale_through_the_c_call(table):
    from uvaple.integration.quantize import fp8_row_table

    t, h = table
    fp8, _ = fp8_row_table(t, out_dtype=torch.bfloat16)
    hot_rows = torch.randperm(h.rows, generator=torch.Generator().manual_seed(2))[:300]
    cases = {
        "fp8_row": (GatherLookup(fp8, TableSpec.of(fp8, encoding="fp8_row", out_dtype=torch.bfloat16), DEV),
                    lambda ids: reference_gather(fp8.tensor, ids, row_scale=True, out_dtype=torch.bfloat16)),
        "hot": (GatherLookup(h, TableSpec.of(h), DEV, hot=HotSet(h, 320, DEV, rows=hot_rows)),
                lambda ids: reference_gather(t, ids)),
        "scaled_row0_f32": (make_lookup("uva", h, scale=16.0, oob="row0", out_dtype=torch.float32),
                            lambda ids: reference_gather(t, ids, scale=16.0, oob="row0", out_dtype=torch.float32)),
        "window": (GatherLookup(h, TableSpec.of(h, column_block=8, row_window=(100, 1800), id_offset=5), DEV),
                   lambda ids: reference_gather(t, ids, rows=(100, 1800), id_base=5)),
    }
    gen = torch.Generator().manual_seed(5)
    try:
        for name, (lk, ref) in cases.items():
            for n in (1, 9, 200):
                host = torch.randint(-2, h.rows + 2, (n,), generator=gen)
                host[: n // 2] = hot_rows[: n // 2]
                ids = host.to(DEV)
                first = lk.lookup(ids).clone()
                before = served(lk)
                got = lk.lookup(ids)
                assert served(lk) == before + 1, (name, lk._plan.direct.eager_refused)
                torch.cuda.synchronize()
                assert torch.equal(bits(got.cpu()), bits(ref(host))), (name, n)
                assert torch.equal(bits(first.cpu()), bits(got.cpu()))
    finally:
        for lk, _ in cases.values():
            lk.close()


def test_what_it_declines_gets_the_python_paths_named_errors(table):
    t, h = table
    with make_lookup("uva", h, max_rows=64) as lk:
        ids = torch.randint(0, h.rows, (8,), device=DEV)
        lk.lookup(ids)
        lk.lookup(ids)
        calls = served(lk)
        assert calls == 1  # taught, then served: what follows is declined, not merely never taught
        with pytest.raises(ValueError, match="ids are on cpu"):
            lk.lookup(ids.cpu())
        with pytest.raises(TypeError, match="int32 or int64"):
            lk.lookup(ids.to(torch.int16))
        with pytest.raises(ValueError, match="max_rows=64"):
            lk.lookup(torch.zeros(65, dtype=torch.int64, device=DEV))
        with pytest.raises(ValueError, match="out has shape"):
            lk.lookup(ids, torch.empty(8, 135, dtype=torch.bfloat16, device=DEV))
        with pytest.raises(TypeError, match="out has dtype torch.float16"):
            lk.lookup(ids, torch.empty(8, 136, dtype=torch.float16, device=DEV))
        strided = torch.randint(0, h.rows, (8, 2), device=DEV)[:, 0]  # not contiguous: copied by the Python path
        assert torch.equal(bits(lk.lookup(strided).cpu()), bits(reference_gather(t, strided.cpu())))
        assert lk.lookup(ids[:0]).shape == (0, 136)
        assert served(lk) == calls  # none of these was the C call's
    with pytest.raises(BackendClosed):
        lk.lookup(ids)


def test_out_is_versioned_for_autograd_as_on_the_python_path(table):
    _, h = table
    with make_lookup("uva", h) as lk:
        ids = torch.randint(0, h.rows, (4,), device=DEV)
        out = torch.empty(4, 136, dtype=torch.bfloat16, device=DEV)
        lk.lookup(ids, out)
        v = out._version
        lk.lookup(ids, out)
        assert served(lk) == 1 and out._version == v + 1


def test_a_call_under_capture_is_the_python_paths_and_the_graph_replays_new_ids():
    from uvaple.kernels import capture as capture_mod

    t = rand(501, 136, seed=8)
    with HostTable.from_tensor(t, register=True) as h, make_lookup("uva", h) as lk:
        ids = torch.randint(0, h.rows, (16,), device=DEV)
        out = torch.empty(16, 136, dtype=torch.bfloat16, device=DEV)
        lk.lookup(ids, out)  # taught
        lk.lookup(ids, out)
        served_before, kept_before = served(lk), capture_mod.kept()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lk.lookup(ids, out)
        assert served(lk) == served_before  # the captured call was the Python path's: declined by the C call
        assert capture_mod.kept() == kept_before + 1  # which kept this table for the graph
        for seed in range(3):
            new = torch.randint(0, h.rows, (16,), generator=torch.Generator().manual_seed(seed))
            ids.copy_(new)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(out.cpu()), bits(reference_gather(t, new)))
        lk.lookup(ids, out)
        assert served(lk) == served_before + 1  # outside the capture: the C call's again


def test_a_call_on_a_side_stream_runs_in_that_streams_order(table):
    t, h = table
    with make_lookup("uva", h) as lk:
        ids = torch.randint(0, h.rows, (256,), device=DEV)
        lk.lookup(ids)  # taught
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        host = torch.randint(0, h.rows, (256,), generator=torch.Generator().manual_seed(9)).pin_memory()
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # the ids land late on the side stream
            ids.copy_(host, non_blocking=True)
            before = served(lk)
            got = lk.lookup(ids)
            assert served(lk) == before + 1
        side.synchronize()
        assert torch.equal(bits(got.cpu()), bits(reference_gather(t, host)))


def test_a_launch_hook_sees_every_launch_while_it_is_set(table):
    knobs = pytest.importorskip("triton.knobs")
    _, h = table
    seen = []
    with make_lookup("uva", h) as lk:
        ids = torch.randint(0, h.rows, (4,), device=DEV)
        lk.lookup(ids)
        lk.lookup(ids)
        calls = served(lk)
        hook = knobs.runtime.launch_enter_hook
        if hasattr(hook, "add"):
            hook.add(seen.append)
            try:
                lk.lookup(ids)
                lk.lookup(ids)
            finally:
                hook.remove(seen.append)
        else:
            knobs.runtime.launch_enter_hook = seen.append
            try:
                lk.lookup(ids)
                lk.lookup(ids)
            finally:
                knobs.runtime.launch_enter_hook = hook
        assert len(seen) == 2 and served(lk) == calls
        lk.lookup(ids)
        assert served(lk) == calls + 1  # the hook gone: the C call again


def test_a_sorted_size_call_is_the_sorted_gathers(table):
    t, h = table
    with make_lookup("uva", h, max_rows=4096, order="sorted", dedup=True) as lk:
        assert lk._eager is None  # every call sorted: nothing for the direct C call
    with make_lookup("uva", h, max_rows=4096, order="auto", dedup=True) as lk:
        big = torch.randint(0, h.rows, (4096,), device=DEV)
        assert lk.uses_sorted(4096) and not lk.uses_sorted(8)
        lk.lookup(big[:8])
        lk.lookup(big[:8])
        assert served(lk) == 1  # the direct variant taught and served
        for _ in range(2):
            got = lk.lookup(big)
        torch.cuda.synchronize()
        assert torch.equal(bits(got.cpu()), bits(reference_gather(t, big.cpu())))
        assert served(lk) == 1  # past the direct bound: declined both times, the sorted gather's


def test_a_lookup_over_the_tables_host_view_is_served_by_the_python_path(table):
    t, h = table
    with make_lookup("uva", h, view="host") as lk:
        ids = torch.randint(0, h.rows, (9,), device=DEV)
        for _ in range(2):
            got = lk.lookup(ids)
        assert served(lk) == 0 and any("host tensor" in why for why in lk._plan.direct.eager_refused.values())
        torch.cuda.synchronize()
        assert torch.equal(bits(got.cpu()), bits(reference_gather(t, ids.cpu())))

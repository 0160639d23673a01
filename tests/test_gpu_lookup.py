"""The lookup object on a real GPU: compiled full graphs inside captured CUDA graphs, counters under replay.

Skipped where there is no CUDA (CI); run on the GPU machine (perf/gpu_check.sh), log committed.
"""

from __future__ import annotations

import pytest
import torch
from helpers import bits, rand

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

"""The lookup object: spec validated once, placements behind one interface, counters, compile, no allocation.

On CPU the gather runs under Triton's interpreter; on CUDA the same tests run compiled.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from uvaple.integration import GatherLookup, TableSpec, make_lookup
from uvaple.integration.errors import BackendClosed
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable

HAS_CUDA = torch.cuda.is_available()


def rand(rows, cols, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    t[t == 0] = 1.25
    return t


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(scope="module")
def table():
    t = rand(257, 48, seed=1)
    with HostTable.from_tensor(t) as h:
        yield t, h


# ------------------------------------------------------------------ the spec
@pytest.mark.parametrize("kw,err,match", [
    (dict(rows=0), ValueError, "rows must be a positive int"),
    (dict(cols=-3), ValueError, "cols must be a positive int"),
    (dict(rows=True), ValueError, "rows must be a positive int"),
    (dict(stride=10), ValueError, "stride must be an int >= cols"),
    (dict(encoding="fp4"), ValueError, "encoding must be one of"),
    (dict(oob="clamp"), ValueError, "oob must be one of"),
    (dict(scale="2"), TypeError, "scale must be a Python number"),
    (dict(scale=True), TypeError, "scale must be a Python number"),
    (dict(out_dtype=torch.int8), TypeError, "cannot convert"),
    (dict(dtype=torch.float64), TypeError, "not supported"),
    (dict(dtype=torch.int8, scale=2.0), TypeError, "scale needs a float table"),
    (dict(column_block=0), ValueError, "column_block must be an int in 1..48"),
    (dict(column_block=49), ValueError, "column_block must be an int in 1..48"),
])
def test_spec_refuses_a_bad_field_by_name(kw, err, match):
    args = dict(rows=10, cols=48, dtype=torch.bfloat16)
    args.update(kw)
    with pytest.raises(err, match=match):
        TableSpec(**args)


def test_spec_derives_what_the_kernel_needs():
    spec = TableSpec(10, 48, torch.bfloat16, scale=16.0, out_dtype=torch.float32, column_block=16)
    assert spec.output_dtype == torch.float32 and spec.has_scale and spec.stride == 48
    assert spec.scale_arg == torch.tensor(16.0).view(torch.int32).item()
    assert spec.columns(None) == (0, 48) and spec.columns((16, 32)) == (16, 32) and spec.columns(slice(32, 48))
    for bad in [(1, 16), (16, 20), (0, 49), (5, 5)]:
        with pytest.raises(ValueError):
            spec.columns(bad)
    whole = TableSpec(10, 48, torch.bfloat16)
    with pytest.raises(ValueError, match="whole rows only"):
        whole.columns((0, 16))
    assert whole.columns((0, 48)) == (0, 48)
    assert spec.with_policy(oob="row0").oob == "row0" and spec.oob == "zero"
    neg = TableSpec(4, 4, torch.float32, scale=-0.0)
    assert neg.scale_arg == torch.tensor(-0.0).view(torch.int32).item()  # -0.0 keeps its sign bit


def test_spec_of_a_host_table_and_a_tensor(table):
    t, h = table
    s = TableSpec.of(h, oob="row0")
    assert (s.rows, s.cols, s.dtype, s.stride, s.oob) == (257, 48, torch.bfloat16, h.stride, "row0")
    assert TableSpec.of(t).stride == 48


# ------------------------------------------------------------------ one interface, every placement
@pytest.mark.parametrize("kind", ["uva", "device", "copy"])
@pytest.mark.parametrize("policy", [dict(), dict(scale=16.0, oob="row0"), dict(scale=-0.75, out_dtype=torch.float32)])
def test_every_placement_gives_the_reference_bits(table, device, kind, policy):
    t, h = table
    with make_lookup(kind, h, device=device, column_block=16, **policy) as lk:
        ids = torch.tensor([[3, -1, 256], [257, 0, 2**40]], device=device)
        for columns in (None, (16, 48), (0, 16)):
            want = reference_gather(t, ids, columns=columns, **policy)
            out = torch.full(want.shape, float("nan"), dtype=want.dtype, device=device)
            assert lk.lookup(ids, out, columns=columns) is out
            assert torch.equal(bits(out), bits(want)), (kind, policy, columns)
        assert torch.equal(bits(lk.lookup(ids)), bits(reference_gather(t, ids, **policy)))


def test_counters_count_calls_rows_and_out_of_range_ids(table, device):
    _, h = table
    with make_lookup("uva", h, device=device) as lk:
        assert lk.stats()["lookups"] == 0
        lk.lookup(torch.tensor([1, 2, 3], device=device))
        lk.lookup(torch.tensor([[-1, 300], [4, 2**33]], device=device))
        lk.lookup(torch.empty(0, dtype=torch.int64, device=device))  # an empty call launches nothing
        st = lk.stats()
        assert (st["lookups"], st["rows"], st["out_of_range_ids"]) == (2, 7, 3), st
        assert st["kind"] == "uva" and not st["closed"]
    with make_lookup("uva", h, device=device, count=False) as quiet:
        quiet.lookup(torch.tensor([1], device=device))
        assert "lookups" not in quiet.stats()


def test_per_call_inputs_are_checked_by_name(table, device):
    _, h = table
    with make_lookup("uva", h, device=device, max_rows=8) as lk:
        ids = torch.tensor([1, 2], device=device)
        with pytest.raises(TypeError, match="int32 or int64"):
            lk.lookup(ids.float())
        with pytest.raises(TypeError, match="int32 or int64"):
            lk.lookup([1, 2])
        with pytest.raises(ValueError, match="expected"):
            lk.lookup(ids, torch.empty(2, 47, dtype=torch.bfloat16, device=device))
        with pytest.raises(TypeError, match="dtype"):
            lk.lookup(ids, torch.empty(2, 48, dtype=torch.float32, device=device))
        with pytest.raises(ValueError, match="contiguous"):
            lk.lookup(ids, torch.empty(48, 2, dtype=torch.bfloat16, device=device).t())
        with pytest.raises(ValueError, match="whole rows only"):
            lk.lookup(ids, columns=(0, 16))
        with pytest.raises(ValueError, match="max_rows=8"):
            lk.lookup(torch.zeros(9, dtype=torch.int64, device=device))
        if device.type == "cpu" and HAS_CUDA:
            with pytest.raises(ValueError, match="this lookup serves"):
                lk.lookup(ids.cuda())
        # a non-contiguous ids tensor is gathered right (copied first)
        wide = torch.tensor([[1, 9], [2, 9]], device=device)[:, 0]
        assert torch.equal(bits(lk.lookup(wide)), bits(reference_gather(h.tensor, torch.tensor([1, 2]))))
    with pytest.raises(BackendClosed, match="closed"):
        lk.lookup(ids)
    lk.close()  # idempotent


def test_what_each_placement_serves_is_read_from_its_entry_alone(device, monkeypatch):
    """The seam for a new placement: its entry in the factory. make_lookup builds it, and the consumers ask the
    entry what it serves (the encodings, the hot set) instead of knowing names; the lists the model layers and
    the vLLM plugin offer are the entries'."""
    from uvaple.integration.embedding import BACKENDS, quantize_format
    from uvaple.integration.factory import PLACEMENTS, Placement, model_placements, placement
    from uvaple.integration.models.vllm import config as vllm_config
    from uvaple.integration.placements.hot import hot_set_from_options

    toy = Placement("toy", PLACEMENTS["uva"].build, encodings=frozenset({"raw"}), mapped=True)
    monkeypatch.setitem(PLACEMENTS, "toy", toy)
    h = HostTable.from_tensor(torch.randn(40, 12))
    try:
        ids = torch.tensor([3, 0, 39, 41], device=device)
        with make_lookup("toy", h, device=device) as lk:
            assert torch.equal(lk.lookup(ids).cpu(), reference_gather(h.tensor, ids.cpu()))
        with pytest.raises(ValueError, match="a hot set stands in front of .* not of the 'toy' placement"):
            hot_set_from_options(h, device, {"cache_gb": 0.001}, placement("toy"))
        with pytest.raises(ValueError, match="'fp8_row' serves the \\('uva', 'device', 'disk'\\) placements, not 'toy"):
            quantize_format("toy", {"quantize": "fp8_row"})
        assert "toy" in model_placements() and not placement("toy").reads("fp8_row")
        assert placement("uva").reads("fp8_row") and placement("split").reads("fp8_global")
    finally:
        h.close()
    with pytest.raises(ValueError, match="unknown placement 'tpu'; choose one of \\['uva', 'device', 'split', 'copy'"):
        placement("tpu")
    # what the consumers offer, from the entries: split is refused to model layers (its ids are on the host), the
    # copy placement is the fallback where the GPU cannot map host memory (its rows are read by the CPU)
    assert BACKENDS == ("uva", "device", "copy", "disk")
    assert vllm_config.PLACEMENTS == ("uva", "device", "copy", "disk")
    assert vllm_config.FALLBACKS == ("none", "copy") and list(vllm_config.REFUSED_PLACEMENTS) == ["split"]
    # an entry checks the options its lookups would refuse, before work that a bad one would waste
    PLACEMENTS["disk"].check_options({"slots": 8, "read_depth": 4, "hot_rows": [1]}, max_rows=8, row_bytes=16)
    with pytest.raises(ValueError, match="holds 7 rows of 16 B, and a call may bring 8 distinct rows: give "
                                         "budget_bytes >= 128 \\(128 B\\) or slots >= 8"):
        PLACEMENTS["disk"].check_options({"budget_bytes": 127}, max_rows=8, row_bytes=10)
    PLACEMENTS["uva"].check_options({"anything": 1})  # its lookups check their own options when built
    assert PLACEMENTS["split"].model_refusal and PLACEMENTS["split"].engine_refusal is None
    assert [n for n, p in PLACEMENTS.items() if p.graph_refusal] == ["split", "copy", "disk"]


def test_make_lookup_owns_a_tensor_it_copied_and_refuses_unknown_kinds(device):
    t = rand(20, 8, torch.float32, seed=2)
    lk = make_lookup("device", t, device=device, oob="row0")
    assert lk.table.rows == 20
    ids = torch.tensor([19, 20], device=device)
    assert torch.equal(bits(lk.lookup(ids)), bits(reference_gather(t, ids, oob="row0")))
    lk.close()
    assert lk.table.closed
    with pytest.raises(ValueError, match="unknown lookup kind"):
        make_lookup("tpu", t)
    with pytest.raises(TypeError, match="HostTable"):
        GatherLookup(t)


def test_a_table_closed_under_its_lookup_keeps_serving(device):
    t = rand(64, 16, seed=3)
    h = HostTable.from_tensor(t)
    lk = make_lookup("uva", h, device=device)
    h.close()
    assert not h.released  # the lookup's view holds the memory
    ids = torch.tensor([5, 63], device=device)
    assert torch.equal(bits(lk.lookup(ids)), bits(t[[5, 63]]))
    lk.close()
    gc.collect()  # Triton's interpreter (CPU runs) leaves its launch arguments in a reference cycle
    assert h.released


# ------------------------------------------------------------------ hot path: no allocation, compile
def cpu_allocations(fn) -> int:
    """Bytes the torch CPU allocator handed out while ``fn`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_lookup_with_out_allocates_nothing_on_cpu(table):
    _, h = table
    with make_lookup("uva", h, device="cpu", scale=16.0, column_block=16) as lk:
        ids = torch.randint(0, 257, (64,))
        out = torch.empty(64, 16, dtype=torch.bfloat16)
        lk.lookup(ids, out, columns=(16, 32))  # warm: the interpreter's first rewrite
        assert cpu_allocations(lambda: lk.lookup(ids, out, columns=(16, 32))) == 0
        assert cpu_allocations(lambda: lk.lookup(ids)) > 0  # the check can see an allocation


@pytest.mark.gpu
def test_lookup_with_out_allocates_nothing_on_gpu():
    h = HostTable.from_tensor(rand(257, 48, seed=1), register=True)
    with make_lookup("uva", h, scale=16.0) as lk:
        ids = torch.randint(0, 257, (64,), device="cuda")
        out = torch.empty(64, 48, dtype=torch.bfloat16, device="cuda")
        lk.lookup(ids, out)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(10):
            lk.lookup(ids, out)
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    h.close()


@pytest.mark.parametrize("kind", ["uva", "device"])
def test_fullgraph_compile_over_a_lookup_equals_eager(table, device, kind):
    t, h = table
    with make_lookup(kind, h, device=device, scale=16.0, oob="row0", column_block=16) as lk:
        def step(ids, out):
            lk.lookup(ids, out, columns=(16, 48))
            return out.float().sum(-1)

        compiled = torch.compile(step, fullgraph=True)
        for seed in range(3):  # new ids each call, same compiled graph
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(-2, 260, (5, 7), generator=g).to(device)
            out_c = torch.empty(5, 7, 32, dtype=torch.bfloat16, device=device)
            out_e = torch.empty_like(out_c)
            got = compiled(ids, out_c)
            want = step(ids, out_e)
            assert torch.equal(bits(out_c), bits(out_e)) and torch.equal(got, want)
            assert torch.equal(bits(out_c), bits(reference_gather(t, ids, scale=16.0, oob="row0", columns=(16, 48))))


# ------------------------------------------------------------------ edges found in review
def test_every_placement_counts_the_same_calls(table, device):
    _, h = table
    counts = []
    for kind in ("uva", "device", "copy"):
        with make_lookup(kind, h, device=device) as lk:
            lk.lookup(torch.empty(0, dtype=torch.int64, device=device))  # an empty call is not a lookup
            lk.lookup(torch.tensor([1, -1, 999], device=device))
            st = lk.stats()
            counts.append((st["lookups"], st["rows"], st["out_of_range_ids"]))
    assert counts == [(1, 3, 2)] * 3, counts


def test_a_lookup_bumps_the_version_of_out(table, device):
    """autograd must see that ``out`` was overwritten (a saved tensor reused by a later lookup)."""
    _, h = table
    with make_lookup("uva", h, device=device) as lk:
        out = torch.empty(2, 48, dtype=torch.bfloat16, device=device)
        v0 = out._version
        lk.lookup(torch.tensor([1, 2], device=device), out)
        assert out._version > v0
        w = torch.ones(48, dtype=torch.bfloat16, device=device, requires_grad=True)
        y = out * w  # saves `out` for the backward pass
        lk.lookup(torch.tensor([3, 4], device=device), out)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_the_public_op_stays_inside_the_table_and_out(table, device):
    t, _ = table
    wide = t.to(device)
    ids = torch.tensor([1], device=device)
    with pytest.raises(ValueError, match="not inside the table"):
        torch.ops.uvaple.gather_rows(wide[:, :40], ids, torch.empty(1, 16, dtype=t.dtype, device=device), None,
                                     None, 0, False, 32, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="contiguous"):
        torch.ops.uvaple.gather_rows(wide, ids, torch.empty(2, 48, dtype=t.dtype, device=device), None,
                                     None, 0, False, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="row_lo"):
        torch.ops.uvaple.gather_rows(wide, ids, torch.empty(1, 48, dtype=t.dtype, device=device), None,
                                     None, 0, False, 0, 0, 10_000, 0, 0)
    for id_base in (-1, 1 << 62):
        with pytest.raises(ValueError, match="id_base"):
            torch.ops.uvaple.gather_rows(wide, ids, torch.empty(1, 48, dtype=t.dtype, device=device), None,
                                         None, 0, False, 0, id_base, 0, 0, 0)
    with pytest.raises(ValueError, match="fp8_global rows of torch.float8_e4m3fn need a table of 1-byte elements"):
        torch.ops.uvaple.gather_rows(wide, ids, torch.empty(1, 48, dtype=t.dtype, device=device), None,
                                     None, 0, False, 0, 0, 0, 0, 1)
    codes = torch.zeros(4, 8, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="fp8_global dequantisation needs a float32 scale of one element"):
        torch.ops.uvaple.gather_rows(codes, ids, torch.empty(1, 8, dtype=torch.bfloat16, device=device), None,
                                     None, 0, False, 0, 0, 0, 0, 1)


def test_spec_and_policy_together_are_refused(table):
    _, h = table
    spec = TableSpec.of(h)
    with pytest.raises(TypeError, match="spec or policy"):
        make_lookup("uva", h, device="cpu", spec=spec, scale=2.0)
    from uvaple.integration import CopyBackend

    with pytest.raises(TypeError, match="spec or policy"):
        CopyBackend(h, device="cpu", spec=spec, oob="row0")
    with pytest.raises(ValueError, match="stride"):
        GatherLookup(h, TableSpec(h.rows, h.cols, h.dtype, stride=h.stride + 8), "cpu")

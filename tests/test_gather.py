"""The gather kernel (Triton interpreter on CPU here, compiled on CUDA): exactness, policies, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import cover, grid
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uvaple.kernels import gather_rows, launch_config, reference_gather
from uvaple.kernels.checks import scale_bits
from uvaple.uva import HostTable, TableClosedError

FLOATS = [torch.bfloat16, torch.float16, torch.float32]


def rand(rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int8, torch.uint8):
        return torch.randint(0, 127, (rows, cols), generator=g, dtype=torch.int32).to(dtype)
    return (torch.randn(rows, cols, generator=g) * 4).to(dtype)


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def poisoned(shape, dtype, device):
    out = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        out.fill_(float("nan"))
    else:
        out.fill_(0x5A)
    return out


def same_bits(got, ref) -> bool:
    """Bit for bit; NaN results only need to be NaN (their sign and payload are the device's)."""
    got, ref = got.detach().cpu(), ref.detach().cpu()
    if not got.dtype.is_floating_point:
        return torch.equal(bits(got), bits(ref))
    nan = torch.isnan(ref)
    if not torch.equal(torch.isnan(got), nan):
        return False
    return torch.equal(bits(torch.where(nan, 0, got)), bits(torch.where(nan, 0, ref)))


def check(table_t, host, ids, device, **kw):
    ids = ids.to(device)
    out_dtype = kw.get("out_dtype") or table_t.dtype
    from uvaple.kernels.checks import column_range

    c0, c1 = column_range(kw.get("columns"), table_t.shape[1])
    out = poisoned((*ids.shape, c1 - c0), out_dtype, device)
    got = gather_rows(host.tensor, ids, out, **kw)
    assert got is out
    ref = reference_gather(table_t, ids, **kw)
    assert same_bits(got, ref), (got, ref)


@pytest.fixture(scope="module")
def tables():
    cache = {}

    def get(rows, cols, dtype):
        key = (rows, cols, dtype)
        if key not in cache:
            t = rand(rows, cols, dtype, seed=rows * 31 + cols)
            cache[key] = (t, HostTable.from_tensor(t))
        return cache[key]

    yield get
    for _, h in cache.values():
        h.close()


@pytest.mark.parametrize("dtype", FLOATS + [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("cols", [1, 7, 255, 8960, 65537])
def test_dtypes_and_odd_columns(tables, device, dtype, cols):
    rows = 37 if cols < 60000 else 5
    t, h = tables(rows, cols, dtype)
    ids = torch.tensor([rows - 1, 0, 3 % rows, rows // 2], dtype=torch.int64)
    check(t, h, ids, device)


@pytest.mark.parametrize("shape", [(), (1,), (5,), (2, 3), (2, 1, 4)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_id_shapes_and_widths(tables, device, shape, id_dtype):
    t, h = tables(101, 33, torch.bfloat16)
    g = torch.Generator().manual_seed(len(shape))
    ids = torch.randint(0, 101, shape, generator=g).to(id_dtype)
    check(t, h, ids, device)


BAD_IDS = [-1, -2**31, 101, 2**31 - 1, 2**40, 2**63 - 1, -2**63]


@pytest.mark.parametrize("oob", ["zero", "row0"])
@pytest.mark.parametrize("scale", [None, 16.0, -3.3])
def test_out_of_range_policies(tables, device, oob, scale):
    t, h = tables(101, 48, torch.bfloat16)
    ids = torch.tensor([5] + BAD_IDS + [100, 0], dtype=torch.int64)
    check(t, h, ids, device, oob=oob, scale=scale)
    out = gather_rows(h.tensor, ids.to(device), oob=oob, scale=scale).cpu()
    if oob == "zero":
        # +0.0 exactly (bits), even with a negative scale.
        assert not bits(out[1:1 + len(BAD_IDS)]).any()
    else:
        ref0 = reference_gather(t, torch.tensor([0]), scale=scale)[0]
        assert torch.equal(bits(out[1:1 + len(BAD_IDS)]), bits(ref0.expand(len(BAD_IDS), -1)))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_out_of_range_int32(tables, device, id_dtype):
    t, h = tables(64, 16, torch.float32)
    ids = torch.tensor([-1, 64, 2**31 - 1, -2**31, 7], dtype=id_dtype)
    check(t, h, ids, device, oob="zero")
    check(t, h, ids, device, oob="row0")


@pytest.mark.parametrize("columns", [(0, 256), (256, 512), (1792, 1920), (3, 10), (1919, 1920)])
def test_column_ranges(tables, device, columns):
    t, h = tables(70, 7 * 256 + 128, torch.bfloat16)  # one row: 7 layers x 256 (+ odd tail)
    ids = torch.tensor([[1, 69], [35, -4]])
    check(t, h, ids, device, columns=columns)
    check(t, h, ids, device, columns=slice(*columns), scale=16.0)


# each dtype and each scale by default (-m extended: every pair)
@pytest.mark.parametrize("scale,dtype", cover(grid(scale=[16.0, math.sqrt(256), 1.7, -0.3, 1e-3, 3.0e4, 1.0 / 3.0],
                                                   dtype=FLOATS), (0,), (1,)))
def test_scale_matches_model_rounding(tables, device, dtype, scale):
    """Bit-identical to HF Gemma 3n: ``emb * embed_scale.to(weight.dtype)``."""
    t, h = tables(128, 96, dtype)
    ids = torch.arange(128).flip(0)
    check(t, h, ids, device, scale=scale)
    # The reference really is the HF expression.
    emb = torch.nn.functional.embedding(ids, t)
    hf = emb * torch.tensor(scale).to(t.dtype)
    assert torch.equal(bits(reference_gather(t, ids, scale=scale)), bits(hf))


# Every kind of float a scale can be: signed zeros, double and float subnormals, the fp16/bf16/fp32
# edges, values that overflow to inf on the way to fp32, infinities and NaNs, rounding ties.
EDGE_SCALES = [0.0, -0.0, 5e-324, -5e-324, 1e-45, -1e-45, 2.0**-149, 2.0**-133, 1e-40, 1.1754942e-38,
               1.17549435e-38, -1.17549435e-38, 6e-8, 6.1e-5, 2.0**-24, 65504.0, 65520.0, -65520.0,
               3.3895314e38, 3.4028235e38, 3.5e38, -3.5e38, 1e300, -1e300, math.inf, -math.inf, math.nan,
               -math.nan, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 16.0, -1.0]


def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Random rows, and rows of edge values: +-0, the dtype's smallest subnormal and largest finite, inf, NaN."""
    info = torch.finfo(dtype)
    edges = torch.tensor([0.0, -0.0, info.smallest_normal * 2.0**-3, -info.smallest_normal, info.max, -info.max,
                          math.inf, -math.inf, math.nan, 1.0, -1.5, info.tiny], dtype=torch.float32).to(dtype)
    t = rand(24, 12, dtype, seed=99)
    t[:12] = edges.view(1, 12).expand(12, 12)
    t[12:] = edges.view(12, 1).expand(12, 12) * t[12:]
    return t


# 33 scales a case, 2-5 s interpreted: each dtype and each policy by default (-m extended: every pair)
@pytest.mark.parametrize("oob,dtype", cover(grid(oob=["zero", "row0"], dtype=FLOATS), (0,), (1,)))
def test_scale_edges_are_exact(device, dtype, oob):
    """``rows * torch.tensor(scale).to(dtype)`` bit for bit for every edge scale, rows with edge values."""
    t = edge_rows(dtype)
    ids = torch.tensor([*range(24), -1, 24, 2**40])
    with HostTable.from_tensor(t) as h:
        for scale in EDGE_SCALES:
            check(t, h, ids, device, scale=scale, oob=oob)
            emb = torch.nn.functional.embedding(ids.clamp(0, 23), t)
            hf = emb * torch.tensor(scale).to(dtype)
            ref = reference_gather(t, ids, scale=scale, oob=oob)
            assert same_bits(ref[:24], hf[:24]), scale  # the reference is HF's expression
        # -0.0 and +0.0 are different scales (an lru_cache on the float once mixed them up)
        for first, second in [(0.0, -0.0), (-0.0, 0.0)]:
            a = gather_rows(h.tensor, ids.to(device), scale=first).cpu()
            b = gather_rows(h.tensor, ids.to(device), scale=second).cpu()
            assert same_bits(a, reference_gather(t, ids, scale=first))
            assert same_bits(b, reference_gather(t, ids, scale=second))


@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                     (torch.float16, torch.bfloat16), (torch.float32, torch.float16),
                                     (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("scale", [None, 1.7])
def test_output_dtype(tables, device, src, dst, scale):
    t, h = tables(50, 40, src)
    check(t, h, torch.tensor([0, 49, 7, -1]), device, out_dtype=dst, scale=scale)


def test_tie_rounding_is_to_even(device):
    """Products that land exactly halfway between two bf16 values round to the even one."""
    vals = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 2**-130 + 2**-138],
                        dtype=torch.float32)
    t = vals.reshape(1, 4).to(torch.float32)
    with HostTable.from_tensor(t) as h:
        out = gather_rows(h.tensor, torch.zeros(1, dtype=torch.int64, device=device), out_dtype=torch.bfloat16)
        assert torch.equal(bits(out), bits(t.to(torch.bfloat16)))


def test_empty_ids_write_nothing(tables, device):
    _, h = tables(10, 8, torch.float32)
    ids = torch.empty(0, dtype=torch.int64, device=device)
    out = gather_rows(h.tensor, ids)
    assert out.shape == (0, 8)


def test_plain_tensor_table_and_allocation(device):
    t = rand(20, 9, torch.float16, 5).to(device)
    ids = torch.tensor([3, 19, 0], device=device)
    out = gather_rows(t, ids)
    assert out.shape == (3, 9) and out.dtype == torch.float16
    assert torch.equal(bits(out), bits(reference_gather(t, ids)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), cols=st.integers(1, 300), n=st.integers(0, 12),
       dtype=st.sampled_from(FLOATS), oob=st.sampled_from(["zero", "row0"]),
       scale=st.one_of(st.none(), st.floats(-100, 100, allow_nan=False, width=32),
                       st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)),
       data=st.data())
def test_property_random(device, rows, cols, n, dtype, oob, scale, data):
    t = rand(rows, cols, dtype, seed=rows * 7 + cols)
    ids = torch.tensor(data.draw(st.lists(st.integers(-5, rows + 5), min_size=n, max_size=n)),
                       dtype=torch.int64)
    c0 = data.draw(st.integers(0, cols - 1))
    c1 = data.draw(st.integers(c0 + 1, cols))
    with HostTable.from_tensor(t) as h:
        check(t, h, ids, device, oob=oob, scale=scale, columns=(c0, c1))


# ------------------------------------------------------------------ bad inputs
def test_bad_inputs_are_named(tables, device):
    t, h = tables(10, 8, torch.float32)
    ids = torch.tensor([1, 2], device=device)
    with pytest.raises(TypeError, match="int32 or int64"):
        gather_rows(h.tensor, ids.float())
    with pytest.raises(TypeError, match="int32 or int64"):
        gather_rows(h.tensor, [1, 2])
    with pytest.raises(ValueError, match="expected"):
        gather_rows(h.tensor, ids, torch.empty(2, 9, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(h.tensor, ids, torch.empty(8, 2, device=device).t())
    with pytest.raises(TypeError, match="out_dtype"):
        gather_rows(h.tensor, ids, torch.empty(2, 8, device=device), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="range"):
        gather_rows(h.tensor, ids, columns=(4, 9))
    with pytest.raises(ValueError, match="range"):
        gather_rows(h.tensor, ids, columns=(5, 5))
    with pytest.raises(ValueError, match="contiguous range"):
        gather_rows(h.tensor, ids, columns=slice(0, 8, 2))
    with pytest.raises(ValueError, match="oob"):
        gather_rows(h.tensor, ids, oob="clamp")
    with pytest.raises(TypeError, match="scale must be"):
        gather_rows(h.tensor, ids, scale=True)
    with pytest.raises(TypeError, match="scale must be"):
        gather_rows(h.tensor, ids, scale=torch.tensor(2.0))
    with pytest.raises(TypeError, match="table must be a 2-D torch.Tensor"):
        gather_rows("table", ids)
    with pytest.raises(ValueError, match="2-D"):
        gather_rows(torch.zeros(10), ids)
    with pytest.raises(ValueError, match="unit column stride"):
        gather_rows(torch.zeros(8, 10).t(), ids)
    _, hi = tables(10, 8, torch.int8)
    with pytest.raises(TypeError, match="float table"):
        gather_rows(hi.tensor, ids, scale=2.0)
    with pytest.raises(TypeError, match="cannot convert"):
        gather_rows(hi.tensor, ids, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="not supported"):
        gather_rows(torch.zeros(4, 4, dtype=torch.float64), ids)


def test_closed_table_refused(device):
    h = HostTable.from_tensor(torch.randn(4, 4))
    h.close()
    with pytest.raises(TableClosedError):
        gather_rows(h.tensor, torch.tensor([0], device=device))


# ------------------------------------------------------------------ op, compile, heuristics
def test_custom_op_schema_and_fake(tables, device):
    t, h = tables(30, 24, torch.bfloat16)
    tensor = h.tensor if device.type == "cpu" else t.to(device)
    ids = torch.tensor([0, 29, -1], device=device)
    out = poisoned((3, 24), torch.bfloat16, device)
    counters = torch.zeros(3, dtype=torch.int64, device=device)
    bits16 = scale_bits(16.0, torch.bfloat16)
    torch.library.opcheck(torch.ops.uvaple.gather_rows.default,
                          (tensor, ids, out, counters, None, bits16, True, 0, 0, 0, 0, 0),
                          test_utils=("test_schema", "test_faketensor"))
    counters.zero_()
    torch.ops.uvaple.gather_rows(tensor, ids, out, counters, None, bits16, True, 0, 0, 0, 0, 0)
    assert torch.equal(bits(out), bits(reference_gather(t, ids, scale=16.0)))
    assert counters.tolist() == [1, 3, 1]  # one call, three rows, one id out of range
    torch.ops.uvaple.gather_rows(tensor, ids[:2], out[:2], None, None, 0, False, 0, 0, 0, 1, 0)  # no counters
    assert torch.equal(bits(out[:2]), bits(reference_gather(t, ids[:2])))


def test_torch_compile_treats_gather_as_opaque(tables, device):
    t, h = tables(30, 24, torch.bfloat16)

    def f(ids):
        return gather_rows(h.tensor, ids, scale=16.0, columns=(8, 24)) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    ids = torch.tensor([[1, 2], [29, 40]], device=device)
    got = compiled(ids)
    assert torch.equal(bits(got), bits(reference_gather(t, ids, scale=16.0, columns=(8, 24)) * 2))


@pytest.mark.parametrize("row_bytes,itemsize,block", [(2, 2, 1), (14, 2, 8), (15360, 2, 2048),
                                                      (17920, 2, 2048), (131072, 2, 2048), (64, 4, 16),
                                                      (8960, 1, 4096)])
def test_launch_config(row_bytes, itemsize, block):
    cfg = launch_config(row_bytes, itemsize, 1024)
    assert cfg.block == block
    assert cfg.block & (cfg.block - 1) == 0 and 1 <= cfg.num_warps <= 8


def test_table_without_rows_is_refused(device):
    ids = torch.tensor([0, -1, 5], device=device)
    for oob in ("zero", "row0"):
        with pytest.raises(ValueError, match="no rows"):
            gather_rows(torch.randn(64, 8)[64:].to(device), ids, oob=oob)


# (table dtype, out dtype, scale, fp8 format) for a plan against the operator (fp8 rows under zero / row0)
_PLANNED = [
    (torch.bfloat16, torch.bfloat16, None, 0),  # a plain copy (integer views)
    (torch.float16, torch.float32, None, 0),
    (torch.bfloat16, torch.bfloat16, -0.37, 0),
    (torch.float8_e4m3fn, torch.bfloat16, None, 1),  # fp8 codes x a global scale
    (torch.float8_e5m2, torch.float16, None, 2),
    (torch.float8_e4m3fn, torch.bfloat16, None, 3),  # fp8 codes x the row's own scale (4 bytes after them)
]


# by default each planned case under one policy, each policy once (-m extended: every pair)
@pytest.mark.parametrize("table_dtype,out_dtype,scale,dequant,oob", cover([
    (*case, oob) for case in _PLANNED for oob in ("zero", "row0", "neg_zero") if not (case[3] and oob == "neg_zero")],
    (0, 1, 2, 3), (4,)))
def test_a_plan_launches_what_the_operator_launches(device, table_dtype, out_dtype, scale, dequant, oob):
    """A :class:`GatherPlan` (a lookup's, or a split lookup's policy over its staged rows) writes the bits and
    counts the operator writes for the same ids, out-of-range ones among them, and nothing for no ids; the
    operator given the plan's handle runs that plan, the same bits and counts again; calls after the first
    (the compiled kernel kept, on a GPU) too."""
    from uvaple.kernels.checks import OOB_MODES
    from uvaple.kernels.encodings import FP8_FORMATS, ROW_SCALE_BYTES
    from uvaple.kernels.plan import GatherPlan

    rows, cols = 37, 19
    g = torch.Generator().manual_seed(rows * 7 + dequant)
    if dequant:
        width = cols + (ROW_SCALE_BYTES if dequant >= 3 else 0)
        raw = torch.randint(0, 256, (rows, width), generator=g, dtype=torch.int32).to(torch.uint8)
        if dequant >= 3:  # finite row scales, stored as float32 bytes after the codes
            raw[:, cols:] = (torch.rand(rows, 1, generator=g) * 3 - 1.5).view(torch.uint8)
        table = raw.view(table_dtype).to(device)
        fmt = FP8_FORMATS[table_dtype] + (2 if dequant >= 3 else 0)
        dq = torch.tensor([0.625], dtype=torch.float32, device=device) if dequant < 3 else None
    else:
        table, fmt, dq = rand(rows, cols, table_dtype, seed=3).to(device), 0, None
    bits_arg = 0 if scale is None else scale_bits(scale, table_dtype)
    ids = torch.randint(-3, rows + 4, (53,), generator=g).to(device)
    ids[5], ids[6] = -1, rows  # out of range on both sides, whatever the draw
    want_counts = torch.zeros(4, dtype=torch.int64, device=device)
    want = poisoned((53, cols), out_dtype, device)
    policy = (bits_arg, scale is not None, 0, 0, 0, OOB_MODES[oob], fmt)
    torch.ops.uvaple.gather_rows(table, ids, want, want_counts, dq, *policy)
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    plan = GatherPlan(table, ids.device, out_dtype, bits=bits_arg, has_scale=scale is not None, oob_mode=OOB_MODES[oob],
                      dequant=fmt, counters=counts, dq_scale=dq)
    for _ in range(2):
        got = poisoned((53, cols), out_dtype, device)
        plan.run(ids, got)
        assert same_bits(got, want)
    assert counts.tolist() == [2 * c for c in want_counts.tolist()] and counts[2].item() >= 4
    untouched = poisoned((0, cols), out_dtype, device)
    plan.run(ids[:0], untouched)
    assert counts.tolist() == [2 * c for c in want_counts.tolist()]  # no ids: no launch, nothing counted
    counts.zero_()
    got = poisoned((53, cols), out_dtype, device)
    torch.ops.uvaple.gather_rows(table, ids, got, counts, dq, *policy, plan.handle)
    assert same_bits(got, want) and counts.tolist() == want_counts.tolist()


def test_a_plan_refuses_what_the_operator_refuses(device):
    """A plan checks what it fixes when made (fp8 rows without their scale are named); the operator given a
    plan's handle still checks what the call brings (columns past the table are named); a handle whose plan
    is gone, or that names another table, takes the operator's full path."""
    from uvaple.kernels.plan import GatherPlan

    table = rand(8, 4, torch.bfloat16).to(device)
    fp8 = torch.zeros(8, 4, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_global dequantisation needs a float32 scale"):
        GatherPlan(fp8, torch.device(device), torch.bfloat16, dequant=1)
    plan = GatherPlan(table, torch.device(device), torch.bfloat16)
    ids = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="columns 0..5 are not inside"):
        torch.ops.uvaple.gather_rows(table, ids, torch.empty(2, 5, dtype=torch.bfloat16, device=device), None, None,
                                     0, False, 0, 0, 0, 0, 0, plan.handle)
    other = rand(8, 4, torch.bfloat16, seed=5).to(device)
    out = poisoned((2, 4), torch.bfloat16, device)
    torch.ops.uvaple.gather_rows(other, ids, out, None, None, 0, False, 0, 0, 0, 0, 0, plan.handle)
    assert same_bits(out, other[ids.cpu()].to(device))  # another table: not this plan's
    handle = plan.handle
    del plan
    out = poisoned((2, 4), torch.bfloat16, device)
    torch.ops.uvaple.gather_rows(table, ids, out, None, None, 0, False, 0, 0, 0, 0, 0, handle)
    assert same_bits(out, table[ids.cpu()].to(device))


def test_an_operator_given_a_plans_handle_with_another_out_dtype_takes_the_full_path(device):
    """A plan's kernels write its output dtype: given an ``out`` of another dtype, the operator does not run the
    plan (an ``out`` of narrower items would be written past its end) but its full path, which converts to a
    wider float ``out`` exactly and names a dtype the table's rows are never written as, writing nothing; the
    sorted operator the same."""
    from uvaple.kernels.plan import GatherPlan

    table = rand(40, 24, torch.bfloat16, seed=9).to(device)
    ids = torch.tensor([3, 39, 0, 17, 3], device=device)
    for order in ("direct", "sorted"):
        plan = GatherPlan(table, torch.device(device), torch.bfloat16, order=order, max_rows=8)

        def op(out, order=order, plan=plan):
            if order == "direct":
                torch.ops.uvaple.gather_rows(table, ids, out, None, None, 0, False, 0, 0, 0, 0, 0, plan.handle)
            else:
                torch.ops.uvaple.gather_rows_sorted(table, ids, out, None, None, plan.workspace, 0, False, 0, 0, 0,
                                                    0, 0, False, plan.handle)

        wide = poisoned((5, 24), torch.float32, device)
        op(wide)
        assert same_bits(wide, table[ids].float())
        # out is the first half of a buffer whose second half holds random bytes: they must stay as they are
        store = torch.randint(-128, 128, (2, 5, 24), dtype=torch.int8, device=device)
        guard = store[1].clone()
        with pytest.raises(TypeError, match=r"uvaple::gather_rows(_sorted)?: out has dtype torch.int8; rows of this "
                                            r"torch.bfloat16 table are written as one of"):
            op(store[0])
        assert torch.equal(store[1], guard)


def test_the_operators_full_path_names_a_table_and_an_output_no_policy_reads(device):
    """What the functional gather refuses by its own checks, the operator refuses too when called directly (its
    full path): a table of an unsupported dtype, a scale on an integer table, -0.0 rows into an integer output;
    each named, nothing written."""
    ids = torch.tensor([1, 2], device=device)
    f64 = torch.randn(4, 3, dtype=torch.float64, device=device)
    out = poisoned((2, 3), torch.float64, device)
    with pytest.raises(TypeError, match=r"uvaple::gather_rows: table dtype torch.float64 is not supported"):
        torch.ops.uvaple.gather_rows(f64, ids, out, None, None, 0, False, 0, 0, 0, 0, 0)
    i8 = rand(4, 3, torch.int8).to(device)
    out = poisoned((2, 3), torch.int8, device)
    with pytest.raises(TypeError, match=r"uvaple::gather_rows: a scale needs a float table"):
        torch.ops.uvaple.gather_rows(i8, ids, out, None, None, 0, True, 0, 0, 0, 0, 0)
    with pytest.raises(TypeError, match=r"uvaple::gather_rows: oob_mode 2 writes -0.0 rows"):
        torch.ops.uvaple.gather_rows(i8, ids, out, None, None, 0, False, 0, 0, 0, 2, 0)
    assert same_bits(out, poisoned((2, 3), torch.int8, device))
    fp8 = rand(4, 3, torch.float32).to(torch.float8_e4m3fn).to(device)
    out = poisoned((2, 3), torch.bfloat16, device)
    with pytest.raises(TypeError, match=r"uvaple::gather_rows: fp8 rows are scaled by their dequantisation scale"):
        torch.ops.uvaple.gather_rows(fp8, ids, out, None, torch.ones(1, device=device), scale_bits(4.0, torch.bfloat16),
                                     True, 0, 0, 0, 0, 1)
    assert same_bits(out, poisoned((2, 3), torch.bfloat16, device))


@pytest.mark.gpu
def test_an_operator_given_a_cuda_plans_handle_with_host_ids_is_refused_by_name():
    """A plan launches on its device: host ids given with a CUDA plan's handle take the full path, which names the
    table's device (a launch would otherwise read host addresses from the GPU); a plan made for ``cuda`` serves
    calls on the current device's index."""
    from uvaple.kernels import registry
    from uvaple.kernels.plan import GatherPlan

    table = rand(16, 8, torch.bfloat16).cuda()
    plan = GatherPlan(table, torch.device("cuda"), torch.bfloat16)
    ids, out = torch.tensor([1, 2], device="cuda"), poisoned((2, 8), torch.bfloat16, "cuda")
    assert plan.device == torch.device("cuda", torch.cuda.current_device())
    assert registry.find(plan.handle, table, ids, out) is plan
    host_out = poisoned((2, 8), torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="uvaple::gather_rows: ids are on cpu but the table is on cuda"):
        torch.ops.uvaple.gather_rows(table, ids.cpu(), host_out, None, None, 0, False, 0, 0, 0, 0, 0, plan.handle)
    assert same_bits(host_out, poisoned((2, 8), torch.bfloat16, "cpu"))


def test_rows_past_the_table_are_read_from_the_hot_set_that_alone_holds_them(device):
    """A plan with ``hot_only_rows``: ids of the rows past the table's read the hot slots the map names for them,
    ids past those are out of range (the policy's row); the plan refuses such rows without a hot set, with a map
    entry that names no hot slot, and with a sorted order."""
    from uvaple.kernels.plan import GatherPlan

    table = rand(30, 12, torch.bfloat16, seed=21).to(device)
    hot = rand(5, 12, torch.bfloat16, seed=22).to(device)
    slot_map = torch.full((33,), -1, dtype=torch.int32, device=device)
    slot_map[30:] = torch.tensor([4, 0, 2], dtype=torch.int32)
    plan = GatherPlan(table, torch.device(device), torch.bfloat16, hot_rows=hot, slot_map=slot_map, hot_only_rows=3)
    ids = torch.tensor([31, 0, 30, 29, 32, 33, -1, 7], device=device)
    out = poisoned((8, 12), torch.bfloat16, device)
    plan.run(ids, out)
    zero = torch.zeros(12, device=device)
    want = torch.stack([hot[0], table[0], hot[4], table[29], hot[2], zero, zero, table[7]])
    assert same_bits(out, want.to(torch.bfloat16))
    with pytest.raises(ValueError, match="need a hot set holding them"):
        GatherPlan(table, torch.device(device), torch.bfloat16, hot_only_rows=3)
    bad = slot_map.clone()
    bad[31] = 5  # past the hot set's 5 slots
    with pytest.raises(ValueError, match="each of the 3 rows past the table's 30 must have a hot slot"):
        GatherPlan(table, torch.device(device), torch.bfloat16, hot_rows=hot, slot_map=bad, hot_only_rows=3)
    with pytest.raises(ValueError, match=r"slot map must be a contiguous int32 \[>= 34\]"):
        GatherPlan(table, torch.device(device), torch.bfloat16, hot_rows=hot, slot_map=slot_map, hot_only_rows=4)
    with pytest.raises(ValueError, match="read by the direct gather only"):
        GatherPlan(table, torch.device(device), torch.bfloat16, hot_rows=hot, slot_map=slot_map, hot_only_rows=3,
                   order="sorted", max_rows=8)


def test_a_kept_launch_gives_way_to_triton_while_a_launch_hook_is_set(monkeypatch):
    """A profiler's launch hooks (Triton's knobs, read at every launch) see every launch: while a hook is in a
    chain, or one hook is assigned in its place, a call of a kept key goes through Triton; once none is set, the
    kept launcher runs again."""
    from triton import knobs

    from uvaple.kernels import launch as launch_mod

    launched = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            launched.append("kept")

    class Kernel:
        params = ()

        def __getitem__(self, grid):
            def call(*args, **constants):
                launched.append("triton")
                return Compiled()
            return call

    monkeypatch.setattr(launch_mod._Driver, "device", lambda: 0)
    monkeypatch.setattr(launch_mod._Driver, "stream", lambda d: 0)
    k = launch_mod.KernelLaunch(Kernel(), {}, interpret=False)
    k((1,), (), "key", 0)
    k((1,), (), "key", 0)

    def hook(*args):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        k((1,), (), "key", 0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    k((1,), (), "key", 0)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", hook)  # one hook in the chain's place
    k((1,), (), "key", 0)
    assert launched == ["triton", "kept", "triton", "kept", "triton"]


def test_a_kept_launch_holds_its_compiled_kernel(monkeypatch):
    """The compiled kernel a key's launches use is held by the launch, not only its launcher and function handle:
    Triton 3.8 unloads a kernel's module when its CompiledKernel is collected (``__del__``), which would leave the
    kept handle pointing at unloaded code if Triton's own cache let the kernel go."""
    import gc
    import weakref

    from uvaple.kernels import launch as launch_mod

    made = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        @property
        def run(self):  # as Triton's: the launcher object, which holds no reference to its kernel
            return lambda *a: None

    class Kernel:
        params = ()

        def __getitem__(self, grid):
            def call(*args, **constants):
                c = Compiled()
                made.append(weakref.ref(c))
                return c  # Triton's caller drops it; only the launch may hold it now
            return call

    monkeypatch.setattr(launch_mod._Driver, "device", lambda: 0)
    monkeypatch.setattr(launch_mod._Driver, "stream", lambda d: 0)
    k = launch_mod.KernelLaunch(Kernel(), {}, interpret=False)
    k((1,), (), "key", 0)
    gc.collect()
    assert len(made) == 1 and made[0]() is not None and k.compiled() == 1
    del k
    gc.collect()
    assert made[0]() is None  # and let go with the launch


def test_a_compiled_launch_enters_its_tensors_device_when_another_is_current(monkeypatch):
    """The device guard of :class:`KernelLaunch`, with Triton's driver and kernel stood in for (the launch on
    two real GPUs: ``test_gpu_lookup.py``): the first call of a key goes through Triton on the tensors'
    device, later calls go to the kept launcher with that device's stream, and the current device is entered
    only when it is another one."""
    from uvaple.kernels import launch as launch_mod

    current, entered, launched = [0], [], []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            launched.append(("kept", current[0], a[3]))

    class Kernel:
        params = ()

        def __getitem__(self, grid):
            def call(*args, **constants):
                launched.append(("triton", current[0]))
                return Compiled()
            return call

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(launch_mod._Driver, "device", lambda: current[0])
    monkeypatch.setattr(launch_mod._Driver, "stream", lambda d: f"stream of {d}")
    monkeypatch.setattr(launch_mod._Hooks, "set", classmethod(lambda cls: False))
    monkeypatch.setattr(launch_mod.torch.cuda, "device", Device)
    k = launch_mod.KernelLaunch(Kernel(), {}, interpret=False)
    k((1,), (), "key", 1)  # cuda:1's tensors, cuda:0 current
    k((1,), (), "key", 1)
    k((1,), (), "key", 0)  # cuda:0's: a key of its own device, compiled there
    assert launched == [("triton", 1), ("kept", 1, "stream of 1"), ("triton", 0)]
    assert entered == [1, 1] and current == [0] and k.compiled() == 2

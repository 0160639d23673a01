"""fp8 rows dequantised in the kernel (one global scale, or each row's own), row windows (a rank's shard
of a full table), -0.0 zero rows.

The definitions: vLLM's fp8 PLE formula ``rows.to(out_dtype) * scale.to(out_dtype)`` (one global float32
scale), and :func:`uvaple.kernels.reference_gather`. NaN results only need to be NaN (their payload is the
device's). On CPU the kernel runs under Triton's interpreter; on CUDA the same tests run compiled.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import bits, cover, grid, rand

from uvaple.integration import TableSpec, make_lookup
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
OUTS = [torch.bfloat16, torch.float16, torch.float32]
SCALES = [1.0, 0.0123, -2.5, 3.0e-3, 448.0, 1e-30, 3.0e38, -0.0, 0.0, math.inf, math.nan]


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.cpu(), want.cpu()
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(bits(torch.where(nan, 0, got)),
                                                              bits(torch.where(nan, 0, want)))


@pytest.fixture(scope="module")
def all_codes():
    """Every fp8 code in each row position: a [256, 16] table of codes (row r holds codes r, r+1, ...)."""
    codes = (torch.arange(256).view(256, 1) + torch.arange(16).view(1, 16)) % 256
    return codes.to(torch.uint8)


# 256 ids at the first scale, then 16 ids (each code once) at each of the 10 others, interpreted. By default e4m3fn
# codes to bf16 (e5m2 codes times one scale: test_gather.py::test_a_plan_launches_what_the_operator_launches; every
# format to every output dtype with a row scale: test_every_fp8_code_with_a_row_scale); -m extended: every pair
@pytest.mark.parametrize("out_dtype,fp8", cover(grid(out_dtype=OUTS, fp8=FP8)))
def test_every_fp8_code_dequantises_as_vllm_does(all_codes, device, fp8, out_dtype):
    t = all_codes.view(fp8)
    with HostTable.from_tensor(t) as h:
        scale = torch.empty(1, dtype=torch.float32, device=device)
        spec = TableSpec.of(h, encoding="fp8_global", out_dtype=out_dtype)
        with make_lookup("uva", h, device=device, spec=spec, dequant_scale=scale) as lk:
            every_position = torch.arange(256, device=device)  # each code in each of a row's 16 positions
            every_code = torch.arange(0, 256, 16, device=device)  # each code once: rows 0, 16, ... hold 0..255
            for s in SCALES:
                scale.fill_(s)  # loaded in place, as vLLM's weight loader does: every call reads it
                ids = every_position if s == SCALES[0] else every_code
                got = lk.lookup(ids)
                want = t[ids.cpu()].to(out_dtype) * torch.tensor([s], dtype=torch.float32).to(out_dtype)  # vLLM's
                assert same(got, want), (fp8, out_dtype, s)
                assert same(got, reference_gather(t, ids, dequant_scale=scale, out_dtype=out_dtype))


def test_fp8_rows_with_a_window_and_out_of_range_ids(device):
    t = rand(300, 40, torch.float32, seed=3).to(torch.float8_e4m3fn)
    with HostTable.from_tensor(t) as h:
        scale = torch.tensor([0.37], device=device)
        ids = torch.tensor([[0, 99, 100, 199], [200, 299, -1, 2**40]], device=device)
        for oob in ("zero", "neg_zero", "row0"):
            spec = TableSpec.of(h, encoding="fp8_global", oob=oob, row_window=(100, 200), column_block=8)
            with make_lookup("uva", h, device=device, spec=spec, dequant_scale=scale) as lk:
                for columns in (None, (8, 32)):
                    got = lk.lookup(ids, columns=columns)
                    want = reference_gather(t, ids, dequant_scale=scale, oob=oob, rows=(100, 200), columns=columns)
                    assert same(got, want), (oob, columns)
                assert lk.stats()["out_of_range_ids"] == 2 * 6  # 6 of 8 ids outside [100, 200), twice


@pytest.mark.parametrize("kind", ["uva", "device", "copy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_windows_split_a_table_exactly(device, kind, dtype):
    """Each rank reads its window of the full table, -0.0 elsewhere: the sum over ranks is the full lookup
    bit for bit, -0.0 entries included (what an all-reduce or reduce-scatter over ranks computes)."""
    t = rand(1000, 24, dtype, seed=4)
    t[7] = -0.0  # a row of -0.0 must survive the sum
    with HostTable.from_tensor(t) as h:
        ids = torch.tensor([7, 0, 999, 250, 500, 749, 750, -3, 1000], device=device)
        full = reference_gather(t, ids)
        total = None
        for lo, hi in [(0, 250), (250, 500), (500, 750), (750, 1000)]:
            spec = TableSpec.of(h, oob="neg_zero", row_window=(lo, hi))
            with make_lookup(kind, h, device=device, spec=spec) as lk:
                part = lk.lookup(ids)
            assert same(part, reference_gather(t, ids, oob="neg_zero", rows=(lo, hi)))
            total = part if total is None else total + part
        in_table = (ids >= 0) & (ids < 1000)
        want = torch.where(in_table.cpu().view(-1, 1), full, torch.tensor(-0.0, dtype=dtype))
        assert same(total, want)  # out-of-table ids: -0.0 from every rank


@pytest.mark.parametrize("kind", ["uva", "device", "copy"])
@pytest.mark.parametrize("oob", ["zero", "neg_zero", "row0"])
def test_shards_stored_alone_are_read_with_global_ids(device, kind, oob):
    """A rank's vocabulary shard as a table of its own (``id_offset`` = its first id, padding rows after its
    last): global ids read their rows, everything else (other shards, the padding, extremes) follows oob."""
    t = rand(1000, 24, torch.bfloat16, seed=5)
    ids = torch.tensor([[0, 333, 334, 667], [668, 999, -1, 2**62], [-(2**63), 2**63 - 1, 1000, 334]],
                       device=device)
    total = None
    for start in (0, 334, 668):
        end = min(start + 334, 1000)
        shard = torch.cat([t[start:end], rand(340 - (end - start), 24, torch.bfloat16, seed=start)])  # + padding
        with HostTable.from_tensor(shard) as h:
            spec = TableSpec.of(h, oob=oob, id_offset=start, row_window=(0, end - start))
            with make_lookup(kind, h, device=device, spec=spec, **({"max_rows": 64} if kind == "copy" else {})) as lk:
                part = lk.lookup(ids)
                assert lk.stats()["out_of_range_ids"] == int(((ids < start) | (ids >= end)).sum())
            assert same(part, reference_gather(shard, ids, oob=oob, rows=(0, end - start), id_base=start)), start
            total = part.float() if total is None else total + part.float()
    if oob == "neg_zero":  # the ranks' sum: the whole table's rows, -0.0 entries included
        want = reference_gather(t, ids, oob="neg_zero")
        assert same(total.to(torch.bfloat16), want)


@pytest.mark.parametrize("kw,err,match", [
    (dict(encoding="fp8_global", dtype=torch.bfloat16), TypeError, "needs an fp8 table"),
    (dict(encoding="fp8_global", dtype=torch.float8_e4m3fn, scale=2.0), TypeError, "second scale"),
    (dict(encoding="fp8_global", dtype=torch.float8_e4m3fn, out_dtype=torch.int8), TypeError, "dequantise to"),
    (dict(oob="neg_zero", dtype=torch.int8), TypeError, "needs a float output"),
    (dict(row_window=(5, 5)), ValueError, "row_window"),
    (dict(row_window=(-1, 5)), ValueError, "row_window"),
    (dict(row_window=(0, 11)), ValueError, "row_window"),
    (dict(row_window="ab"), ValueError, "row_window"),
    (dict(id_offset=-1), ValueError, "id_offset"),
    (dict(id_offset=2**62), ValueError, "id_offset"),
    (dict(id_offset=1.0), ValueError, "id_offset"),
])
def test_bad_encodings_and_windows_are_named(kw, err, match):
    args = dict(rows=10, cols=8, dtype=torch.float32)
    args.update(kw)
    with pytest.raises(err, match=match):
        TableSpec(**args)


def test_fp8_lookup_needs_its_scale_and_the_copy_placement_refuses(device):
    t = torch.zeros(10, 8, dtype=torch.float8_e4m3fn)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, encoding="fp8_global")
        with pytest.raises(ValueError, match="dequant_scale"):
            make_lookup("uva", h, device=device, spec=spec)
        with pytest.raises(ValueError, match="dequant_scale"):
            make_lookup("uva", h, device=device, spec=spec, dequant_scale=torch.ones(2, device=device))
        with pytest.raises(TypeError, match="copy placement serves rows as stored"):
            make_lookup("copy", h, device=device, spec=spec)
        with pytest.raises(ValueError, match="for fp8_global tables"):
            make_lookup("uva", h, device=device, dequant_scale=torch.ones(1, device=device))



def row_scaled(codes: torch.Tensor, scales) -> torch.Tensor:
    """An fp8_row table: each row's codes (uint8) then its float32 scale's 4 bytes."""
    s = torch.tensor(scales, dtype=torch.float32).view(-1, 1)
    return torch.cat([codes, s.view(torch.uint8).reshape(-1, 4)], dim=1)


@pytest.mark.parametrize("order,out_dtype,fp8", cover(grid(order=["direct", "sorted"], out_dtype=OUTS, fp8=FP8),
                                                      (0,), (1,), (2,)))
def test_every_fp8_code_with_a_row_scale(all_codes, device, fp8, out_dtype, order):
    """Every code at every position, each row with its own scale (signs, zeros, subnormals, inf, NaN):
    ``codes.to(out) * row_scale.to(out)``, bit for bit, through both gather paths."""
    scales = [SCALES[r % len(SCALES)] * (1 + r / 512) if math.isfinite(SCALES[r % len(SCALES)]) else
              SCALES[r % len(SCALES)] for r in range(256)]
    scales[5], scales[6] = 1.0e-40, -1.0e-40  # float32 subnormals
    t = row_scaled(all_codes, scales).view(fp8)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, encoding="fp8_row", out_dtype=out_dtype)
        assert spec.value_cols == 16
        with make_lookup("uva", h, device=device, spec=spec, max_rows=512, order=order) as lk:
            ids = torch.randperm(256, device=device).repeat(2)
            got = lk.lookup(ids)
            codes = all_codes.view(fp8)[ids.cpu()]
            want = codes.to(out_dtype) * torch.tensor(scales, dtype=torch.float32)[ids.cpu()].view(-1, 1).to(out_dtype)
            assert got.shape == (512, 16) and same(got, want), (fp8, out_dtype)
            assert same(got, reference_gather(t, ids, row_scale=True, out_dtype=out_dtype))


@pytest.mark.parametrize("oob", ["zero", "neg_zero", "row0"])
def test_row_scaled_columns_window_and_out_of_range(device, oob):
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 256, (300, 37), generator=g, dtype=torch.uint8)  # odd width: the scale unaligned
    t = row_scaled(codes, (torch.randn(300, generator=g) * 0.1).tolist()).view(torch.float8_e4m3fn)
    with HostTable.from_tensor(t) as h:
        assert h.cols == 41
        spec = TableSpec.of(h, encoding="fp8_row", oob=oob, row_window=(10, 250), column_block=8, id_offset=7)
        ids = torch.tensor([[17, 7, 256, 257], [0, -1, 2**62, 2**63 - 1], [100, 100, 100, 30]], device=device)
        with make_lookup("uva", h, device=device, spec=spec) as lk:
            for columns in (None, (8, 32), (32, 37)):
                got = lk.lookup(ids, columns=columns)
                want = reference_gather(t, ids, row_scale=True, oob=oob, rows=(10, 250), id_base=7,
                                        columns=columns)
                assert same(got, want), (oob, columns)
            with pytest.raises(ValueError, match="inside 0..37"):
                lk.lookup(ids, columns=(32, 41))  # the scale bytes are not values


def test_row_scaled_specs_and_operator_refuse_misuse(device):
    with pytest.raises(ValueError, match="more than 4 columns"):
        TableSpec(rows=4, cols=4, dtype=torch.float8_e4m3fn, encoding="fp8_row")
    with pytest.raises(TypeError, match="needs an fp8 table"):
        TableSpec(rows=4, cols=8, dtype=torch.bfloat16, encoding="fp8_row")
    with pytest.raises(ValueError, match="column_block"):
        TableSpec(rows=4, cols=8, dtype=torch.float8_e4m3fn, encoding="fp8_row", column_block=5)
    t = row_scaled(torch.zeros(10, 8, dtype=torch.uint8), [1.0] * 10).view(torch.float8_e4m3fn)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, encoding="fp8_row")
        with pytest.raises(ValueError, match="for fp8_global tables"):
            make_lookup("uva", h, device=device, spec=spec, dequant_scale=torch.ones(1, device=device))
        with pytest.raises(TypeError, match="copy placement serves rows as stored"):
            make_lookup("copy", h, device=device, spec=spec)
        out = torch.empty(3, 12, dtype=torch.bfloat16, device=device)
        ids = torch.zeros(3, dtype=torch.int64, device=device)
        with pytest.raises(ValueError, match="reach into them"):  # a direct call may not read the scale as codes
            torch.ops.uvaple.gather_rows(h.tensor, ids, out, None, None, 0, False, 0, 0, 0, 0, 3)


def test_a_row_scale_is_read_as_one_word_only_where_it_is_aligned():
    """The kernels read a row's own scale with one 32-bit load where the scale column, the row stride and the
    buffer are 4-byte aligned (in the table and the hot set alike), else byte by byte."""
    from uvaple.kernels.gather import scale_word

    for codes, word in ((16, True), (36, True), (37, False), (33, False)):
        t = row_scaled(torch.zeros(4, codes, dtype=torch.uint8), [1.0] * 4).view(torch.float8_e4m3fn)
        with HostTable.from_tensor(t) as h:
            assert scale_word(h.tensor, None, 3) is word and scale_word(h.tensor, None, 1) is False
            assert scale_word(h.tensor, h.tensor[1:], 4) is word  # a hot set's buffer, aligned like the table
    base = torch.zeros(8, 20, dtype=torch.uint8)
    assert scale_word(base[:, :20], None, 3) is True
    assert scale_word(base.view(-1)[1:].view(-1)[:140].view(7, 20), None, 3) is False  # the buffer is misaligned


# ---------------------------------------------------------------------- the registry
def _padded_dequant(rows: torch.Tensor, out_dtype, scale=None) -> torch.Tensor:
    """The toy encoding's reference: codes, then a float32 scale, then 4 bytes of padding."""
    dtype = out_dtype or torch.bfloat16
    cols = rows.shape[1] - 8
    s = rows[:, cols:cols + 4].clone().view(torch.uint8).view(torch.float32)
    return rows[:, :cols].to(dtype) * s.to(dtype)


@pytest.fixture
def toy():
    """A toy encoding in the registry: fp8 rows whose scale is followed by 4 bytes of padding (an 8-byte trailer),
    code 9; removed again after the test."""
    from uvaple.kernels import encodings

    enc = encodings.register(encodings.Encoding("fp8_row_pad8", "row", (torch.float8_e4m3fn,), _padded_dequant,
                                                codes=((torch.float8_e4m3fn, 9),), trailer=8))
    yield enc
    encodings.unregister("fp8_row_pad8")


@pytest.mark.parametrize("order", ["direct", "sorted"])
def test_a_new_encoding_is_one_registry_entry_that_every_check_and_path_reads(device, toy, order):
    """Registered, the toy is a TableSpec encoding, its code reaches the kernels through the plan, both gather paths
    read each row's scale where the entry says (8 bytes before the end: the padding after it is never read), and the
    operators' checks keep calls out of its 8-byte trailer, by the entry, not by literal codes."""
    g = torch.Generator().manual_seed(21)
    codes = torch.randint(0, 256, (50, 13), generator=g, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x10  # no NaN codes: compared with torch.equal below
    codes[codes == 0xFF] = 0x90
    scales = (torch.rand(50, generator=g) + 0.5).view(-1, 1)
    pad = torch.randint(0, 256, (50, 4), generator=g, dtype=torch.uint8)  # garbage: a read of it would show
    t = torch.cat([codes, scales.view(torch.uint8).reshape(-1, 4), pad], dim=1).view(torch.float8_e4m3fn)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, encoding="fp8_row_pad8")
        assert spec.dequant == 9 and spec.value_cols == 13
        ids = torch.tensor([[3, 49, 0, 3], [17, 60, -2, 8]], device=device)
        with make_lookup("uva", h, device=device, spec=spec, max_rows=8, order=order) as lk:
            got = lk.lookup(ids)
            rows = torch.where((ids >= 0) & (ids < 50), ids, 0).cpu()
            want = _padded_dequant(t[rows.reshape(-1)], torch.bfloat16).view(2, 4, 13)
            want[((ids < 0) | (ids >= 50)).cpu()] = 0
            assert got.shape == (2, 4, 13) and torch.equal(bits(got.cpu()), bits(want))
            assert torch.equal(bits(reference_gather(t, ids, encoding="fp8_row_pad8")), bits(want))
            assert torch.equal(bits(reference_gather(t, ids, encoding="fp8_row_pad8", columns=(2, 11))),
                               bits(want[..., 2:11]))
        out = torch.empty(2, 14, dtype=torch.bfloat16, device=device)
        flat = torch.tensor([1, 2], device=device)
        with pytest.raises(ValueError, match="last 8 columns of these rows are their scale"):
            torch.ops.uvaple.gather_rows(h.tensor, flat, out, None, None, 0, False, 0, 0, 0, 0, 9)
    short = torch.zeros(4, 8, dtype=torch.uint8).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="end in 8 bytes of scale"):
        torch.ops.uvaple.gather_rows(short, flat.cpu(), torch.empty(2, 1, dtype=torch.bfloat16), None, None, 0, False,
                                     0, 0, 0, 0, 9)


def test_a_code_no_encoding_lists_is_refused_when_the_plan_is_made(device):
    from uvaple.kernels import encodings
    from uvaple.kernels.plan import GatherPlan

    table = torch.zeros(8, 12, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    for code in (5, 9, -1, True):
        with pytest.raises(ValueError, match=f"dequant {code!r} names no encoding .the registry's codes: "
                                             r"\[0, 1, 2, 3, 4\]"):
            GatherPlan(table, torch.device(device), torch.bfloat16, dequant=code)
    ids = torch.tensor([1], device=device)
    with pytest.raises(ValueError, match="dequant 7 names no encoding"):
        torch.ops.uvaple.gather_rows(table, ids, torch.empty(1, 4, dtype=torch.bfloat16, device=device), None, None,
                                     0, False, 0, 0, 0, 0, 7)
    raw = encodings.ENCODINGS["raw"]
    with pytest.raises(ValueError, match="the name or the codes \\[0\\] are taken"):
        encodings.register(encodings.Encoding("raw2", "none", None, raw.dequantise))
    with pytest.raises(ValueError, match="a row scale is a trailer of whole 4-byte words"):
        encodings.Encoding("bad", "row", (torch.float8_e4m3fn,), raw.dequantise,
                           codes=((torch.float8_e4m3fn, 11),), trailer=6)
    with pytest.raises(ValueError, match="one code per table dtype"):
        encodings.Encoding("bad", "global", (torch.float8_e4m3fn, torch.float8_e5m2), raw.dequantise,
                           codes=((torch.float8_e4m3fn, 11),))
    with pytest.raises(ValueError, match="code 0 is rows as stored"):  # a raw entry under another code: read as fp8
        encodings.Encoding("bad", "none", None, raw.dequantise, codes=((None, 7),))
    with pytest.raises(ValueError, match="code 0 is rows as stored"):
        encodings.Encoding("bad", "global", (torch.float8_e4m3fn, torch.float8_e5m2), raw.dequantise,
                           codes=((torch.float8_e4m3fn, 11), (torch.float8_e5m2, 11)))
    with pytest.raises(ValueError, match="dequantise fp8 codes only"):
        encodings.Encoding("bad", "global", (torch.int8,), raw.dequantise, codes=((torch.int8, 11),))
    with pytest.raises(ValueError, match="built in"):
        encodings.unregister("fp8_row")
    with pytest.raises(ValueError, match="encoding must be one of"):
        reference_gather(table, ids.cpu(), encoding="fp8_row_pad8")  # gone with its test
    assert sorted(encodings.ENCODINGS) == ["fp8_global", "fp8_row", "raw"]

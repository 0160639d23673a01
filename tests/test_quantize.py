"""Compressed rows: float tables quantised on load to fp8 codes with a per-row scale (``fp8_row``).

The lookup of a quantised table is checked bit for bit against vLLM's formula on the stored bytes; the
round trip against the format's bound, for random rows with zeros, subnormals and the extremes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import bits

from uvaple.integration import GatherLookup, TableSpec
from uvaple.integration.quantize import fp8_row_table
from uvaple.kernels.encodings import FP8_MAX, quantize_fp8_rows

FORMATS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}  # mantissa bits, exponent bias
BF16_MAX = torch.finfo(torch.bfloat16).max


def hard_rows(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(12)
    rows = torch.randn(64, 300, generator=g) * torch.logspace(-6, 6, 64)[:, None]
    rows[3] = 0.0  # an all-zero row
    rows[4] = 1e-40  # subnormal in bf16 and fp32
    rows[5, ::2] = -1e-39
    rows[6, 0], rows[6, 1] = BF16_MAX, -BF16_MAX  # the extremes, beside ordinary values
    rows[7] = -0.0
    rows[8, :10] = 0.0  # zeros inside a row with a large scale
    return rows.to(dtype)


def scales_of(q: torch.Tensor, cols: int) -> torch.Tensor:
    return q.view(torch.uint8)[:, cols:].contiguous().view(torch.float32).view(-1)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_round_trip_is_within_the_formats_bound(fmt):
    src = hard_rows()
    x = src.to(torch.float32)
    q = quantize_fp8_rows(src, fmt)
    assert q.shape == (64, 304) and q.dtype == fmt
    s = scales_of(q, 300)
    assert torch.equal(s.to(torch.bfloat16).to(torch.float32), s)  # bf16 values: the formula's cast is exact
    amax = x.abs().amax(dim=1)
    assert bool((s >= amax / FP8_MAX[fmt]).all()) and s[3] == 1.0 and s[7] == 1.0
    codes = q[:, :300].to(torch.float32)
    assert bool((codes.abs() <= FP8_MAX[fmt]).all()) and not bool(codes.isnan().any())  # nothing saturated
    m, bias = FORMATS[fmt]
    deq = codes * s[:, None]  # exact in fp32 here: the code times a bf16 scale
    bound = x.abs() * 2.0 ** -(m + 1) + s[:, None] * 2.0 ** -(m + bias)
    assert bool(((deq - x).abs() <= bound).all())
    assert torch.equal(deq[3], x[3]) and torch.equal(deq[8, :10], x[8, :10])  # zeros stay zero


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_lookup_of_a_quantised_table_is_vllms_formula_bit_for_bit(device, out_dtype):
    src = hard_rows()
    if out_dtype == torch.float16:
        src = src.clamp(-60000, 60000)  # fp16's range: the formula's product overflows above it either way
    table, err = fp8_row_table(src, out_dtype=out_dtype)
    with table:
        spec = TableSpec.of(table, encoding="fp8_row", out_dtype=out_dtype)
        assert spec.value_cols == 300
        with GatherLookup(table, spec, device) as lk:
            ids = torch.randint(-2, 66, (500,), generator=torch.Generator().manual_seed(13)).to(device)
            out = torch.empty(500, 300, dtype=out_dtype, device=device)
            out.view(torch.uint8).fill_(0xA5)
            got = lk.lookup(ids, out)
            stored = table.tensor
            codes = stored[:, :300]
            scale = scales_of(stored, 300)
            want = codes.to(out_dtype) * scale.to(out_dtype)[:, None]
            valid = (ids.cpu() >= 0) & (ids.cpu() < 64)
            expect = torch.zeros(500, 300, dtype=out_dtype)
            expect[valid] = want[ids.cpu()[valid]]
            assert torch.equal(bits(got), bits(expect))
    assert err.rows == 64 and err.max_abs.shape == (2,)  # 300 values: a slice of 256 and one of 44


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_rows_wider_than_a_program_are_dequantised_whole(device, out_dtype):
    """fp8 rows span several programs (the tile is sized by the bytes written: 2,048 codes for bf16,
    1,024 for fp32): 4,500 codes are 3 or 5 tiles, the last one partial; every tile reads the row's own
    scale. Bit-exact to the formula, a column range too."""
    g = torch.Generator().manual_seed(31)
    src = torch.randn(9, 4500, generator=g) * torch.logspace(-3, 2, 9)[:, None]
    table, _ = fp8_row_table(src.to(torch.bfloat16), out_dtype=out_dtype)
    with table:
        spec = TableSpec.of(table, encoding="fp8_row", out_dtype=out_dtype, column_block=250)
        stored = table.tensor
        want = stored[:, :4500].to(out_dtype) * scales_of(stored, 4500).to(out_dtype)[:, None]
        with GatherLookup(table, spec, device) as lk:
            ids = torch.tensor([8, 0, 3, 3, 7, 1], device=device)
            out = torch.empty(6, 4500, dtype=out_dtype, device=device)
            out.view(torch.uint8).fill_(0xA5)
            assert torch.equal(bits(lk.lookup(ids, out)), bits(want[ids.cpu()]))
            part = lk.lookup(ids, columns=(1000, 3250))
            assert torch.equal(bits(part), bits(want[ids.cpu(), 1000:3250]))


def test_the_error_report_is_measured_per_slice():
    g = torch.Generator().manual_seed(14)
    src = (torch.randn(40, 512, generator=g) * torch.tensor([1e-3] * 256 + [1e3] * 256)).to(torch.bfloat16)
    table, err = fp8_row_table(src, slice_cols=256)
    with table:
        stored = table.tensor
        deq = stored[:, :512].to(torch.bfloat16) * scales_of(stored, 512).to(torch.bfloat16)[:, None]
        diff = (deq.double() - src.double()).abs().view(40, 2, 256)
        mag = src.double().abs().view(40, 2, 256)
        assert torch.equal(err.max_abs, diff.amax(dim=2).amax(dim=0))
        assert torch.allclose(err.max_rel, (diff.amax(dim=2) / mag.amax(dim=2)).amax(dim=0), rtol=0, atol=1e-15)
        # one row scale for both layers: the small layer is crushed, its relative error large; the big one fine
        assert err.max_rel[1] <= 2.0 ** -4 and err.max_rel[0] > err.max_rel[1]
        s = err.summary()
        assert s["worst_slice"] == 0 and s["rows"] == 40 and s["slice_cols"] == 256


def test_bad_inputs_are_named():
    src = torch.randn(10, 8)
    src[6, 3] = float("inf")
    with pytest.raises(ValueError, match="row 6 holds inf or NaN"):
        quantize_fp8_rows(src)
    src[6, 3] = float("nan")
    with pytest.raises(ValueError, match="row 1006 holds inf or NaN"):
        quantize_fp8_rows(src, row_start=1000)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        quantize_fp8_rows(torch.randn(2, 2), torch.int8)
    with pytest.raises(TypeError, match="2-D float"):
        quantize_fp8_rows(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="non-empty 2-D"):
        fp8_row_table(torch.randn(0, 4))
    with pytest.raises(ValueError, match="slice_cols"):
        fp8_row_table(torch.randn(3, 4), slice_cols=0)
    bad = torch.randn(5, 4)
    bad[4, 0] = float("nan")
    with pytest.raises(ValueError, match="row 4"):
        fp8_row_table(bad)  # the table made for it is released


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_scale_quantises_the_scaled_rows(dtype):
    """scale=: the rows quantised are src * scale rounded to src's dtype (HF's scaled embedding), and the
    error is measured against those."""
    g = torch.Generator().manual_seed(15)
    src = torch.randn(30, 100, generator=g).to(dtype)
    scale = 2048 ** 0.5  # not a power of two: one rounding to the dtype, in the product's dtype
    scaled = src * torch.tensor(scale).to(dtype)
    got, got_err = fp8_row_table(src, scale=scale)
    want, want_err = fp8_row_table(scaled)
    with got, want:
        assert torch.equal(bits(got.tensor), bits(want.tensor))
    assert got_err.summary() == want_err.summary()
    with pytest.raises(TypeError, match="scale must be a Python number"):
        fp8_row_table(src, scale=torch.tensor(2.0))

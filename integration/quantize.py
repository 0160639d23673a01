"""Compressed rows: a float table quantised on load to fp8 codes with a scale per row (``fp8_row``).

Each row becomes its ``cols`` fp8 codes followed by its float32 scale (4 bytes, little-endian): one
contiguous read, ``cols + 4`` bytes instead of ``2 * cols`` for bf16 (0.5x the bytes across PCIe, plus the
scale). The kernels dequantise with vLLM's formula, ``codes.to(out) * scale.to(out)``
(:class:`~uvaple.integration.TableSpec` ``encoding="fp8_row"``), so the caller gets the model dtype.

The scale. ``s = amax / fmax`` (``fmax``: 448 for e4m3fn, 57344 for e5m2), rounded *up* to a bf16 value:
then ``s.to(bfloat16)`` in the formula is exact (no second rounding of the scale) and ``|x / s| <= fmax``, so
no code saturates. An all-zero row gets scale 1. A row holding inf or NaN cannot be scaled and is an
error naming the row.

Error. Per element, ``|x - deq| <= |x| * 2^-(m+1) + s * 2^-(m+bias)`` for an m-bit mantissa (e4m3: 2^-4
relative, the subnormal step 2^-9 of the scale), plus the output dtype's rounding of the product. The
report (:class:`QuantError`) gives, per slice of ``slice_cols`` values (Gemma 3n: one layer's 256), the
largest absolute error and the largest error relative to that slice's largest magnitude, over all rows,
measured against the lookup's own formula in the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uvaple.uva import HostTable

__all__ = ["quantize_fp8_rows", "fp8_row_table", "QuantError", "FP8_MAX"]

#: the largest finite value of each fp8 format
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_BLOCK_BYTES = 64 << 20


@dataclass
class QuantError:
    """Quantisation error against the source, per slice of ``slice_cols`` values (see the module docstring)."""

    slice_cols: int
    max_abs: torch.Tensor  # float64 [slices]
    max_rel: torch.Tensor  # float64 [slices]: max |error| / max |source| of the slice, over rows
    rows: int = 0

    def summary(self) -> dict:
        return {"rows": self.rows, "slice_cols": self.slice_cols, "max_abs": float(self.max_abs.max()),
                "max_rel": float(self.max_rel.max()), "worst_slice": int(self.max_rel.argmax())}


def _bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= each positive finite fp32 ``x`` (as fp32)."""
    b = x.to(torch.bfloat16).to(torch.float32)  # nearest
    up = (b.view(torch.int32) + (1 << 16)).view(torch.float32)  # the next bf16 above a positive b
    return torch.where(b < x, up, b)


def quantize_fp8_rows(src: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn, *, row_start: int = 0
                      ) -> torch.Tensor:
    """``src`` (``[rows, cols]`` float) as an ``fp8_row`` table: ``[rows, cols + 4]`` of ``fmt``, each row its
    codes then its float32 scale's bytes. ``row_start`` only names rows in errors."""
    if fmt not in FP8_MAX:
        raise TypeError(f"fp8_row codes are float8_e4m3fn or float8_e5m2, not {fmt}")
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or not src.is_floating_point() or src.shape[1] == 0:
        raise TypeError(f"quantize_fp8_rows expects a 2-D float tensor [rows, cols], got {src!r:.80}")
    x = src.detach().to(device="cpu", dtype=torch.float32)
    finite = torch.isfinite(x).all(dim=1)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0]) + row_start
        raise ValueError(f"row {bad} holds inf or NaN: an fp8 row scale cannot represent it; fix the weights or "
                         "keep this table unquantised")
    amax = x.abs().amax(dim=1)
    scale = _bf16_ceil(amax / FP8_MAX[fmt])
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    codes = (x / scale[:, None]).clamp_(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt)
    out = torch.empty(x.shape[0], x.shape[1] + 4, dtype=torch.uint8)
    out[:, : x.shape[1]] = codes.view(torch.uint8)
    out[:, x.shape[1]:] = scale.contiguous().view(torch.uint8).view(-1, 4)
    return out.view(fmt)


def _dequant(q: torch.Tensor, cols: int, out_dtype: torch.dtype) -> torch.Tensor:
    """vLLM's formula on an fp8_row block, as the kernels compute it."""
    codes = q[:, :cols]
    scale = q.view(torch.uint8)[:, cols:].contiguous().view(torch.float32)
    return codes.to(out_dtype) * scale.to(out_dtype)


def fp8_row_table(src: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn, *, out_dtype: torch.dtype | None = None,
                  slice_cols: int = 256, scale: float | None = None, **table_kw) -> tuple[HostTable, QuantError]:
    """A new ``fp8_row`` :class:`HostTable` holding ``src`` quantised, written block by block (no full
    quantised copy in RAM), and its error report against ``src`` in ``out_dtype`` (default ``src``'s).

    ``scale``: quantise ``src * torch.tensor(scale).to(src.dtype)`` (rounded to ``src``'s dtype, as HF's
    scaled embedding computes its output) instead, and measure the error against those values: the table
    then serves what the scaled embedding returns, with no second scale at lookup time. ``table_kw`` go
    to :meth:`HostTable.empty` (``name=``, ``register=``, ...)."""
    rows, cols = src.shape if isinstance(src, torch.Tensor) and src.dim() == 2 else (0, 0)
    if not rows or not cols:
        raise TypeError(f"fp8_row_table expects a non-empty 2-D float tensor, got {src!r:.80}")
    if isinstance(slice_cols, bool) or not isinstance(slice_cols, int) or slice_cols <= 0:
        raise ValueError(f"slice_cols must be a positive int, got {slice_cols!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    factor = None if scale is None else torch.tensor(float(scale), dtype=torch.float32).to(src.dtype)
    out_dtype = out_dtype or src.dtype
    slices = -(-cols // slice_cols)
    err = QuantError(slice_cols, torch.zeros(slices, dtype=torch.float64), torch.zeros(slices, dtype=torch.float64),
                     rows)
    table = HostTable.empty(rows, cols + 4, fmt, **table_kw)
    try:
        block = max(1, _BLOCK_BYTES // (cols * 4))
        for r0 in range(0, rows, block):
            x = src[r0: r0 + block].detach().cpu()
            if factor is not None:
                x = x * factor  # in src's dtype: one rounding, HF's
            q = quantize_fp8_rows(x, fmt, row_start=r0)
            table.write_rows(q, r0)
            diff = (_dequant(q, cols, out_dtype).to(torch.float64) - x.to(torch.float64)).abs()
            mag = x.to(torch.float64).abs()
            pad = slices * slice_cols - cols
            if pad:
                diff = torch.nn.functional.pad(diff, (0, pad))
                mag = torch.nn.functional.pad(mag, (0, pad))
            d = diff.view(-1, slices, slice_cols).amax(dim=2)
            m = mag.view(-1, slices, slice_cols).amax(dim=2)
            rel = torch.where(m > 0, d / m, d)
            err.max_abs = torch.maximum(err.max_abs, d.amax(dim=0))
            err.max_rel = torch.maximum(err.max_rel, rel.amax(dim=0))
    except BaseException:
        table.close()
        raise
    return table, err

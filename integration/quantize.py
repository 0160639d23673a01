"""Quantise on load: a float table written block by block as a new host table of an encoded kind, with its
error report.

The encoding itself (its row layout, its quantiser and its torch reference) is an entry of
:data:`uvaple.kernels.encodings.ENCODINGS`; this module drives the ``fp8_row`` quantiser over a table in
blocks (no full quantised copy in RAM) into a :class:`~uvaple.uva.HostTable`, and measures the error of the
lookup's own formula against the source.

Error report (:class:`QuantError`): per slice of ``slice_cols`` values (Gemma 3n: one layer's 256), the
largest absolute error and the largest error relative to that slice's largest magnitude, over all rows,
in the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uvaple.kernels.encodings import ENCODINGS, quantize_fp8_rows
from uvaple.uva import HostTable

__all__ = ["fp8_row_table", "QuantError"]

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
            diff = (ENCODINGS["fp8_row"].dequantise(q, out_dtype).to(torch.float64) - x.to(torch.float64)).abs()
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

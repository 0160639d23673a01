"""Row encodings: how a table's rows are stored and turned into the values a lookup returns.

An encoding is one entry of :data:`ENCODINGS` (an :class:`Encoding`): the table dtypes it stores rows in,
its row layout (values, then any bytes of scale that trail them), the constant that selects its branch in
the kernels (``DEQUANT``, :mod:`uvaple.kernels.rows`), its quantiser (float rows to stored rows) and its
torch reference (stored rows to values), which every kernel path is compared against bit for bit.

* ``raw``: rows as stored, any supported dtype (the model's scale and output dtype are the lookup's
  policy, not an encoding).
* ``fp8_global``: fp8 codes (e4m3fn or e5m2) times one global float32 scale the lookup holds, with vLLM's
  formula ``codes.to(out) * scale.to(out)`` (``out`` default bf16).
* ``fp8_row``: each row is its fp8 codes followed by its own float32 scale (``ROW_SCALE_BYTES``,
  little-endian: one contiguous read, ``cols + 4`` bytes instead of ``2 * cols`` for bf16), dequantised
  with the same formula and the row's scale; a lookup returns ``cols - 4`` values per row.

The scale of a quantiser (per row, or global) is ``amax / fmax`` (``fmax``: 448 for e4m3fn, 57344 for
e5m2) rounded *up* to a bf16 value: then ``scale.to(bfloat16)`` in the formula is exact and ``|x / s| <=
fmax``, so no code saturates (never below the smallest bf16, 2^-133: a row whose largest magnitude is
under ``fmax * 2^-150`` would otherwise get scale 0); an all-zero row (table) gets scale 1; a row holding
inf or NaN cannot be scaled and is an error naming the row. Per element, ``|x - deq| <= |x| * 2^-(m+1) +
s * 2^-(m+bias)`` for an m-bit mantissa, plus the output dtype's rounding of the product.

A new encoding (int8 rows with a per-row scale, say) is one more entry here and one more ``DEQUANT``
branch in ``rows.convert_rows``; ``TableSpec`` (:mod:`uvaple.integration.spec`) accepts every name here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Encoding", "ENCODINGS", "FP8_FORMATS", "FP8_MAX", "ROW_SCALE_BYTES", "DEQUANT_CODES",
           "quantize_fp8_rows", "quantize_fp8_global", "encoding_of_code"]

#: fp8 dtype -> the kernels' ``DEQUANT`` code for codes times a global scale (+ 2: times the row's own scale)
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
#: the largest finite value of each fp8 format
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: bytes of the float32 scale an ``fp8_row`` row carries after its codes
ROW_SCALE_BYTES = 4
#: every ``DEQUANT`` code the kernels know: 0 rows as stored, 1/2 fp8 x global scale, 3/4 fp8 x row scale
DEQUANT_CODES = (0, 1, 2, 3, 4)


def _bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= each positive finite fp32 ``x`` (as fp32)."""
    b = x.to(torch.bfloat16).to(torch.float32)  # nearest
    up = (b.view(torch.int32) + (1 << 16)).view(torch.float32)  # the next bf16 above a positive b
    return torch.where(b < x, up, b)


def _check_float_rows(src, fmt: torch.dtype, what: str, row_start: int) -> torch.Tensor:
    if fmt not in FP8_MAX:
        raise TypeError(f"{what} codes are float8_e4m3fn or float8_e5m2, not {fmt}")
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or not src.is_floating_point() or src.shape[1] == 0:
        raise TypeError(f"{what} quantisation expects a 2-D float tensor [rows, cols], got {src!r:.80}")
    x = src.detach().to(device="cpu", dtype=torch.float32)
    finite = torch.isfinite(x).all(dim=1)
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0]) + row_start
        raise ValueError(f"row {bad} holds inf or NaN: an fp8 scale cannot represent it; fix the weights or "
                         "keep this table unquantised")
    return x


# The smallest positive bf16 (a subnormal, 2^-133): the least scale. Below amax = 448 * 2^-150 the fp32
# quotient amax / fmax is 0, and a zero scale would turn the row's zeros into NaN codes (0 / 0).
_BF16_TINY = 2.0 ** -133


def _scale_of(amax: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    scale = _bf16_ceil(amax / FP8_MAX[fmt]).clamp_min(_BF16_TINY)
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_fp8_rows(src: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn, *, row_start: int = 0
                      ) -> torch.Tensor:
    """``src`` (``[rows, cols]`` float) as ``fp8_row`` rows: ``[rows, cols + 4]`` of ``fmt``, each row its codes
    then its float32 scale's bytes. ``row_start`` only names rows in errors."""
    x = _check_float_rows(src, fmt, "fp8_row", row_start)
    scale = _scale_of(x.abs().amax(dim=1), fmt)
    codes = (x / scale[:, None]).clamp_(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt)
    out = torch.empty(x.shape[0], x.shape[1] + ROW_SCALE_BYTES, dtype=torch.uint8)
    out[:, : x.shape[1]] = codes.view(torch.uint8)
    out[:, x.shape[1]:] = scale.contiguous().view(torch.uint8).view(-1, ROW_SCALE_BYTES)
    return out.view(fmt)


def quantize_fp8_global(src: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``src`` (``[rows, cols]`` float) as ``fp8_global`` rows: (codes ``[rows, cols]`` of ``fmt``, the float32
    scale ``[1]`` of the whole table)."""
    x = _check_float_rows(src, fmt, "fp8_global", 0)
    scale = _scale_of(x.abs().amax().reshape(1), fmt)
    return (x / scale).clamp_(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt), scale


def _dequant_raw(rows: torch.Tensor, out_dtype: torch.dtype | None, scale=None) -> torch.Tensor:
    return rows.to(out_dtype or rows.dtype)


def _dequant_global(rows: torch.Tensor, out_dtype: torch.dtype | None, scale=None) -> torch.Tensor:
    dtype = out_dtype or torch.bfloat16
    return rows.to(dtype) * scale.detach().cpu().to(dtype)


def _dequant_row(rows: torch.Tensor, out_dtype: torch.dtype | None, scale=None) -> torch.Tensor:
    dtype = out_dtype or torch.bfloat16
    cols = rows.shape[1] - ROW_SCALE_BYTES
    s = rows[:, cols:].clone(memory_format=torch.contiguous_format).view(torch.uint8).view(torch.float32)  # [n, 1]
    return rows[:, :cols].to(dtype) * s.to(dtype)


@dataclass(frozen=True)
class Encoding:
    """One way of storing rows (see the module docstring)."""

    name: str
    #: where the dequantisation scale comes from: "none", "global" (held by the lookup) or "row" (trails the row)
    scale: str
    #: the table dtypes it stores rows in (None: every supported dtype)
    dtypes: tuple[torch.dtype, ...] | None
    #: float rows -> (stored rows, the global scale or None); None where rows are stored as given
    quantise: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None
    #: the torch reference: (stored rows [n, cols], out dtype or None, global scale or None) -> values
    dequantise: Callable[..., torch.Tensor]

    @property
    def trailer_bytes(self) -> int:
        """Bytes after a row's values (its own scale)."""
        return ROW_SCALE_BYTES if self.scale == "row" else 0

    def value_cols(self, cols: int) -> int:
        """Values a whole stored row of ``cols`` columns gives."""
        return cols - self.trailer_bytes

    def kernel_code(self, dtype: torch.dtype) -> int:
        """The kernels' ``DEQUANT`` constant for a table of ``dtype`` in this encoding."""
        if self.scale == "none":
            return 0
        return FP8_FORMATS[dtype] + (2 if self.scale == "row" else 0)

    def check(self, dtype: torch.dtype, cols: int) -> None:
        """A ``[*, cols]`` table of ``dtype`` can hold rows of this encoding (a named error if not)."""
        if self.dtypes is not None and dtype not in self.dtypes:
            raise TypeError(f"the {self.name} encoding stores rows as {[str(d) for d in self.dtypes]}, not {dtype}")
        if cols <= self.trailer_bytes:
            raise ValueError(f"an {self.name} row is its codes then a {self.trailer_bytes}-byte float32 scale: it "
                             f"needs more than {self.trailer_bytes} columns, this table has {cols}")


ENCODINGS: dict[str, Encoding] = {
    "raw": Encoding("raw", "none", None, None, _dequant_raw),
    "fp8_global": Encoding("fp8_global", "global", tuple(FP8_FORMATS), quantize_fp8_global, _dequant_global),
    "fp8_row": Encoding("fp8_row", "row", tuple(FP8_FORMATS),
                        lambda src, fmt=torch.float8_e4m3fn, **kw: (quantize_fp8_rows(src, fmt, **kw), None),
                        _dequant_row),
}


def encoding_of_code(dequant: int) -> Encoding:
    """The encoding a kernels' ``DEQUANT`` code reads."""
    return ENCODINGS["raw" if dequant == 0 else "fp8_global" if dequant in (1, 2) else "fp8_row"]

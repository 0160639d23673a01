"""Row encodings: how a table's rows are stored and turned into the values a lookup returns.

An encoding is one entry of :data:`ENCODINGS` (an :class:`Encoding`): the table dtypes it stores rows in,
its row layout (values, then any bytes of scale that trail them), its operators' codes and the kernels'
constants (``FP8``, ``SCALE``: :mod:`uvaple.kernels.rows`) and its torch reference (stored rows to values),
which every kernel path is compared against bit for bit. Writing rows in an encoding is a bulk writer's job
(``fp8_row``: :mod:`uvaple.integration.quantize`, a kernel on every core), checked byte for byte against the
encoding's torch definition here (:func:`quantize_fp8_rows`).

* ``raw``: rows as stored, any supported dtype (the model's scale and output dtype are the lookup's
  policy, not an encoding).
* ``fp8_global``: fp8 codes (e4m3fn or e5m2) times one global float32 scale the lookup holds, with vLLM's
  formula ``codes.to(out) * scale.to(out)`` (``out`` default bf16).
* ``fp8_row``: each row is its fp8 codes followed by its own float32 scale (``ROW_SCALE_BYTES``,
  little-endian: one contiguous read, ``cols + 4`` bytes instead of ``2 * cols`` for bf16), dequantised
  with the same formula and the row's scale; a lookup returns ``cols - 4`` values per row.

The scale of the ``fp8_row`` quantiser is ``amax / fmax`` (``fmax``: 448 for e4m3fn, 57344 for
e5m2) rounded *up* to a bf16 value: then ``scale.to(bfloat16)`` in the formula is exact and ``|x / s| <=
fmax``, so no code saturates (never below the smallest bf16, 2^-133: a row whose largest magnitude is
under ``fmax * 2^-150`` would otherwise get scale 0); an all-zero row gets scale 1; a row holding
inf or NaN cannot be scaled and is an error naming the row. Per element, ``|x - deq| <= |x| * 2^-(m+1) +
s * 2^-(m+bias)`` for an m-bit mantissa, plus the output dtype's rounding of the product.

What the kernels are told. An operator call names its table's encoding and format by one integer, the
``dequant`` code: each entry lists its codes (one per table dtype it stores rows in), and
:func:`encoding_of_code` is the only reading of them; a code no entry lists is refused when a plan is made
(:func:`uvaple.kernels.checks.check_fixed`). The kernels' branches are chosen by two constants the entry
gives (:meth:`Encoding.kernel_constants`): ``FP8`` (the code format, :data:`FP8_FORMATS`, or 0) and ``SCALE``
(:data:`SCALE_KINDS`: none, one global scale, or the row's own float32 scale, read ``trailer`` bytes before
the row's end). The operators' checks read the entry too: the bytes a row's values may not reach
(``trailer``), the element size of its formats, whether it needs a global scale.

A new encoding is one entry here (:func:`register`): its codes, its scale kind and trailer, its torch
reference (and, for a table quantised on load, its bulk writer beside ``fp8_row``'s). A layout the kernels
already read (fp8 codes with a global or a trailing row scale, any trailer of whole 4-byte words) needs nothing
else; a new way of decoding values (int8 codes, say) is one more branch of ``rows.convert_rows`` and one more
``FP8``-like constant. ``TableSpec``
(:mod:`uvaple.integration.spec`) accepts every name here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Encoding", "ENCODINGS", "FP8_FORMATS", "FP8_MAX", "ROW_SCALE_BYTES", "SCALE_KINDS", "register",
           "unregister", "quantize_fp8_rows", "encoding_of_code"]

#: fp8 dtype -> the kernels' ``FP8`` constant (how a code byte widens to fp32)
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
#: the largest finite value of each fp8 format
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: bytes of the float32 scale a row-scaled row carries (the first bytes of its trailer)
ROW_SCALE_BYTES = 4
#: ``Encoding.scale`` -> the kernels' ``SCALE`` constant
SCALE_KINDS = {"none": 0, "global": 1, "row": 2}


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
    #: the torch reference: (stored rows [n, cols], out dtype or None, global scale or None) -> values
    dequantise: Callable[..., torch.Tensor]
    #: the operators' ``dequant`` code of each table dtype it stores rows in ((None, code) where ``dtypes`` is None)
    codes: tuple[tuple[torch.dtype | None, int], ...] = ((None, 0),)
    #: bytes after a row's values: the row's float32 scale first (``scale == "row"``), then any padding; whole
    #: 4-byte words (the kernels read the scale as one word where the row stride allows)
    trailer: int = 0

    def __post_init__(self) -> None:
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"encoding {self.name!r}: scale must be one of {sorted(SCALE_KINDS)}, got {self.scale!r}")
        if (self.scale == "row") != (self.trailer > 0) or self.trailer % ROW_SCALE_BYTES:
            raise ValueError(f"encoding {self.name!r}: a row scale is a trailer of whole {ROW_SCALE_BYTES}-byte words "
                             f"(and only a row scale has one), got scale {self.scale!r} and trailer {self.trailer}")
        dtypes = [d for d, _ in self.codes]
        if (self.dtypes is None and dtypes != [None]) or (self.dtypes is not None and sorted(map(str, dtypes)) !=
                                                          sorted(map(str, self.dtypes))):
            raise ValueError(f"encoding {self.name!r}: one code per table dtype it stores rows in, got {self.codes}")
        if self.scale != "none" and any(d not in FP8_FORMATS for d in dtypes):
            raise ValueError(f"encoding {self.name!r}: the kernels dequantise fp8 codes only ({list(FP8_FORMATS)})")
        codes = [c for _, c in self.codes]
        if (self.scale == "none") != (codes == [0]) or len(set(codes)) != len(codes) or \
                any(isinstance(c, bool) or not isinstance(c, int) for c in codes):
            raise ValueError(f"encoding {self.name!r}: code 0 is rows as stored (scale 'none', any dtype) and only "
                             f"they have it; each other code is a distinct int, got {self.codes}")

    @property
    def trailer_bytes(self) -> int:
        """Bytes after a row's values (its own scale, then any padding)."""
        return self.trailer

    def value_cols(self, cols: int) -> int:
        """Values a whole stored row of ``cols`` columns gives."""
        return cols - self.trailer_bytes

    def kernel_code(self, dtype: torch.dtype) -> int:
        """The operators' ``dequant`` code for a table of ``dtype`` in this encoding."""
        key = None if self.dtypes is None else dtype
        for d, code in self.codes:
            if d == key:
                return code
        raise TypeError(f"the {self.name} encoding stores rows as {[str(d) for d in self.dtypes]}, not {dtype}")

    def kernel_constants(self, dtype: torch.dtype | None) -> dict[str, int]:
        """The kernels' ``FP8`` and ``SCALE`` constants for a table of ``dtype`` in this encoding."""
        fp8 = FP8_FORMATS[dtype] if self.scale != "none" else 0
        return {"FP8": fp8, "SCALE": SCALE_KINDS[self.scale]}

    def check(self, dtype: torch.dtype, cols: int) -> None:
        """A ``[*, cols]`` table of ``dtype`` can hold rows of this encoding (a named error if not)."""
        if self.dtypes is not None and dtype not in self.dtypes:
            raise TypeError(f"the {self.name} encoding stores rows as {[str(d) for d in self.dtypes]}, not {dtype}")
        if cols <= self.trailer_bytes:
            raise ValueError(f"an {self.name} row is its codes then a {self.trailer_bytes}-byte float32 scale: it "
                             f"needs more than {self.trailer_bytes} columns, this table has {cols}")


ENCODINGS: dict[str, Encoding] = {}


def register(encoding: Encoding) -> Encoding:
    """Add ``encoding`` to :data:`ENCODINGS` (its name and its codes new to the registry)."""
    if not isinstance(encoding, Encoding):
        raise TypeError(f"register takes an Encoding, got {type(encoding).__name__}")
    taken = {code: e.name for e in ENCODINGS.values() for _, code in e.codes}
    clash = [code for _, code in encoding.codes if code in taken]
    if encoding.name in ENCODINGS or clash:
        raise ValueError(f"encoding {encoding.name!r}: the name or the codes {clash} are taken "
                         f"({sorted(ENCODINGS)}; codes {taken})")
    ENCODINGS[encoding.name] = encoding
    _index()
    return encoding


def unregister(name: str) -> None:
    """Remove the encoding ``name`` (a test's toy); the three built in stay."""
    if name in ("raw", "fp8_global", "fp8_row"):
        raise ValueError(f"the {name} encoding is built in")
    ENCODINGS.pop(name, None)
    _index()


def encoding_of_code(dequant) -> tuple[Encoding, torch.dtype | None]:
    """The encoding and table format an operator's ``dequant`` code names; a code no entry lists is a
    ``ValueError``. (Every operator call asks: a dictionary read, rebuilt when the registry changes.)"""
    found = _CODES.get(dequant) if type(dequant) is int else None
    if found is None:
        raise ValueError(f"dequant {dequant!r} names no encoding (the registry's codes: {sorted(_CODES)})")
    return found


_CODES: dict[int, tuple[Encoding, torch.dtype | None]] = {}


def _index() -> None:
    global _CODES
    _CODES = {code: (e, dtype) for e in ENCODINGS.values() for dtype, code in e.codes}  # one rebinding: readers see
    # the old index or the new one, never a half-built one


register(Encoding("raw", "none", None, _dequant_raw))
register(Encoding("fp8_global", "global", tuple(FP8_FORMATS), _dequant_global,
                  codes=((torch.float8_e4m3fn, 1), (torch.float8_e5m2, 2))))
register(Encoding("fp8_row", "row", tuple(FP8_FORMATS), _dequant_row,
                  codes=((torch.float8_e4m3fn, 3), (torch.float8_e5m2, 4)), trailer=ROW_SCALE_BYTES))

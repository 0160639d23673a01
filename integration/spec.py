"""``TableSpec``: what a table is and what a lookup of it returns, validated once at construction.

A lookup (:mod:`uvaple.integration.lookup`) is built from a spec and a placement; at call time it only
checks what changes per call (the ids, ``out``, the column range). Each later feature — a hot-row cache,
sorted and de-duplicated gathers, fp8/int8 rows with scales — is a field here and a branch in the kernel,
not a keyword threaded through every backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from uvaple.kernels.checks import ID_BASE_LIMIT, OOB_MODES, check_policy, column_range, scale_bits
from uvaple.kernels.encodings import ENCODINGS as _REGISTRY

__all__ = ["TableSpec", "ENCODINGS", "spec_for"]

#: The encodings a spec accepts: the names of :data:`uvaple.kernels.encodings.ENCODINGS` (each one entry there:
#: its row layout, kernel constant, quantiser and torch reference).
ENCODINGS = tuple(_REGISTRY)


@dataclass(frozen=True)
class TableSpec:
    """A table and the rows a lookup of it returns.

    Parameters
    ----------
    rows, cols : int
        Table shape ``[rows, cols]``.
    dtype : torch.dtype
        What the table stores (bf16, fp16, fp32, int8, uint8, fp8).
    stride : int, optional
        Elements between row starts in the host table (default ``cols``; a ``HostTable`` pads rows).
    encoding : str
        How rows are stored: ``"raw"``, ``"fp8_global"`` or ``"fp8_row"`` (see ``ENCODINGS``).
    oob : {"zero", "row0", "neg_zero"}
        What ids outside the valid range give: a zero row, row 0 of the range (Gemma 3n), or a -0.0 row
        (for a lookup whose result is summed over ranks: ``x + (-0.0) == x`` for every ``x``, so the sum
        keeps the owner's bits, -0.0 included).
    scale : float, optional
        Output scale, bit-identical to ``rows * torch.tensor(scale).to(dtype)`` (HF's ``embed_scale``).
    out_dtype : torch.dtype, optional
        Output dtype (default ``dtype``); bf16/fp16/fp32 from a float table.
    column_block : int, optional
        Callers may ask for column ranges whose bounds are multiples of this (the last may be ``cols``),
        e.g. 256 for one Gemma 3n layer's slice of a per-layer-embedding row. Default: whole rows only.
    row_window : (lo, hi), optional
        Only ids in ``[lo, hi)`` are valid (read from the full table); the rest follow ``oob``. A
        tensor-parallel rank reading its vocabulary shard of a table shared by the node. Default: all rows.
    id_offset : int
        The id of row 0: id ``i`` reads row ``i - id_offset`` (valid when that row is in the window). A
        rank's vocabulary shard stored as a table of its own, looked up with global ids. Default 0.
    """

    rows: int
    cols: int
    dtype: torch.dtype
    stride: int | None = None
    encoding: str = "raw"
    oob: str = "zero"
    scale: float | None = None
    out_dtype: torch.dtype | None = None
    column_block: int | None = None
    row_window: tuple[int, int] | None = None
    id_offset: int = 0
    _scale_bits: int = field(default=0, init=False, repr=False, compare=False)
    _out: torch.dtype = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("rows", "cols"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TableSpec.{name} must be a positive int, got {v!r}")
        stride = self.cols if self.stride is None else self.stride
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < self.cols:
            raise ValueError(f"TableSpec.stride must be an int >= cols ({self.cols}), got {self.stride!r}")
        object.__setattr__(self, "stride", stride)
        if self.encoding not in _REGISTRY:
            raise ValueError(f"TableSpec.encoding must be one of {tuple(_REGISTRY)}, got {self.encoding!r}")
        enc = _REGISTRY[self.encoding]
        out = check_policy(self.dtype, scale=self.scale, oob=self.oob, out_dtype=self.out_dtype,
                           dequant=enc.scale != "none")
        enc.check(self.dtype, self.cols)
        object.__setattr__(self, "_out", out)
        if self.row_window is not None:
            try:
                lo, hi = (int(v) for v in self.row_window)
            except (TypeError, ValueError):
                raise ValueError(f"TableSpec.row_window must be (lo, hi), got {self.row_window!r}") from None
            if not 0 <= lo < hi <= self.rows:
                raise ValueError(f"TableSpec.row_window {self.row_window!r} is not a non-empty range inside "
                                 f"0..{self.rows}")
            object.__setattr__(self, "row_window", (lo, hi))
        o = self.id_offset
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < ID_BASE_LIMIT:
            raise ValueError(f"TableSpec.id_offset must be an int in 0..2**62-1, got {o!r}")
        if self.scale is not None:
            object.__setattr__(self, "scale", float(self.scale))
            object.__setattr__(self, "_scale_bits", scale_bits(self.scale, self.dtype))
        if self.column_block is not None:
            b = self.column_block
            if isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= self.value_cols:
                raise ValueError(f"TableSpec.column_block must be an int in 1..{self.value_cols}, got {b!r}")

    # ------------------------------------------------------------------ derived
    @classmethod
    def of(cls, table, **policy) -> TableSpec:
        """The spec of ``table`` (a ``HostTable``, a ``TableFile`` or a 2-D tensor) with the given policy fields;
        a table that names its rows' encoding (a table file's header does) gives it unless ``policy`` does."""
        stride = getattr(table, "stride", None)
        if callable(stride):  # a tensor: stride() is a method
            stride = table.stride(0)
        encoding = getattr(table, "encoding", None)
        if isinstance(encoding, str) and "encoding" not in policy:
            policy["encoding"] = encoding
        return cls(int(table.shape[0]), int(table.shape[1]), table.dtype, stride=stride, **policy)

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of what a lookup returns."""
        return self._out

    @property
    def has_scale(self) -> bool:
        return self.scale is not None

    @property
    def scale_arg(self) -> int:
        """The scale as the kernel takes it (fp32 bits of the dtype-rounded scale)."""
        return self._scale_bits

    @property
    def dequant(self) -> int:
        """The operators' ``dequant`` code of this table's encoding and dtype (the registry's entry lists it)."""
        return _REGISTRY[self.encoding].kernel_code(self.dtype)

    @property
    def value_cols(self) -> int:
        """Values a whole-row lookup returns: ``cols``, less the scale's bytes of an ``fp8_row`` row."""
        return _REGISTRY[self.encoding].value_cols(self.cols)

    @property
    def oob_mode(self) -> int:
        return OOB_MODES[self.oob]

    @property
    def window(self) -> tuple[int, int]:
        """The valid row range ``[lo, hi)`` (ids ``id_offset + lo`` to ``id_offset + hi``)."""
        return self.row_window or (0, self.rows)

    @property
    def row_bytes(self) -> int:
        return self.cols * self.dtype.itemsize

    def columns(self, columns) -> tuple[int, int]:
        """``(start, stop)`` of a request's column range (``None``: the whole row), checked against the spec."""
        cols = self.value_cols
        if columns is None:
            return 0, cols
        c0, c1 = column_range(columns, cols)
        b = self.column_block
        if (c0, c1) != (0, cols) and (b is None or c0 % b or (c1 % b and c1 != cols)):
            allowed = "whole rows only" if b is None else f"ranges on multiples of {b}"
            raise ValueError(f"columns {columns!r}: this lookup serves {allowed} (TableSpec.column_block)")
        return c0, c1

    def with_policy(self, **changes) -> TableSpec:
        """This spec with some policy fields changed (validated again)."""
        fields = dict(rows=self.rows, cols=self.cols, dtype=self.dtype, stride=self.stride, encoding=self.encoding,
                      oob=self.oob, scale=self.scale, out_dtype=self.out_dtype, column_block=self.column_block,
                      row_window=self.row_window, id_offset=self.id_offset)
        fields.update(changes)
        return TableSpec(**fields)

    def describe(self) -> str:
        parts = [f"{self.rows}x{self.cols} {str(self.dtype).replace('torch.', '')}", f"oob={self.oob}"]
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}" if math.isfinite(self.scale) else f"scale={self.scale}")
        if self._out != self.dtype:
            parts.append(f"out={str(self._out).replace('torch.', '')}")
        if self.column_block:
            parts.append(f"column_block={self.column_block}")
        if self.encoding != "raw":
            parts.append(f"encoding={self.encoding}")
        if self.row_window:
            parts.append(f"rows={self.row_window[0]}..{self.row_window[1]}")
        if self.id_offset:
            parts.append(f"id_offset={self.id_offset}")
        return ", ".join(parts)


def spec_for(table, spec: TableSpec | None, *, scale=None, oob: str = "zero", out_dtype=None,
             column_block=None) -> TableSpec:
    """``spec`` as given, or the spec of ``table`` with this policy; both at once is an error (the other
    fields, an encoding or a row window, are set on a spec)."""
    policy = scale is not None or oob != "zero" or out_dtype is not None or column_block is not None
    if spec is not None:
        if policy:
            raise TypeError("give a spec or policy arguments (scale, oob, out_dtype, column_block), not both: "
                            "put the policy in the spec")
        return spec
    return TableSpec.of(table, scale=scale, oob=oob, out_dtype=out_dtype, column_block=column_block)

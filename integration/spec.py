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

from uvaple.kernels.gather import check_policy, column_range, scale_bits

__all__ = ["TableSpec", "ENCODINGS", "spec_for"]

#: How rows are stored. ``raw``: the table dtype as is.
ENCODINGS = ("raw",)


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
        How rows are stored (``"raw"``).
    oob : {"zero", "row0"}
        What ids outside ``[0, rows)`` give: a zero row, or row 0 (Gemma 3n).
    scale : float, optional
        Output scale, bit-identical to ``rows * torch.tensor(scale).to(dtype)`` (HF's ``embed_scale``).
    out_dtype : torch.dtype, optional
        Output dtype (default ``dtype``); bf16/fp16/fp32 from a float table.
    column_block : int, optional
        Callers may ask for column ranges whose bounds are multiples of this (the last may be ``cols``),
        e.g. 256 for one Gemma 3n layer's slice of a per-layer-embedding row. Default: whole rows only.
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
        if self.encoding not in ENCODINGS:
            raise ValueError(f"TableSpec.encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        out = check_policy(self.dtype, scale=self.scale, oob=self.oob, out_dtype=self.out_dtype)
        object.__setattr__(self, "_out", out)
        if self.scale is not None:
            object.__setattr__(self, "scale", float(self.scale))
            object.__setattr__(self, "_scale_bits", scale_bits(self.scale, self.dtype))
        if self.column_block is not None:
            b = self.column_block
            if isinstance(b, bool) or not isinstance(b, int) or not 0 < b <= self.cols:
                raise ValueError(f"TableSpec.column_block must be an int in 1..{self.cols}, got {b!r}")

    # ------------------------------------------------------------------ derived
    @classmethod
    def of(cls, table, **policy) -> TableSpec:
        """The spec of ``table`` (a ``HostTable`` or a 2-D tensor) with the given policy fields."""
        stride = getattr(table, "stride", None)
        if callable(stride):  # a tensor: stride() is a method
            stride = table.stride(0)
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
    def row_bytes(self) -> int:
        return self.cols * torch.empty((), dtype=self.dtype).element_size()

    def columns(self, columns) -> tuple[int, int]:
        """``(start, stop)`` of a request's column range (``None``: the whole row), checked against the spec."""
        if columns is None:
            return 0, self.cols
        c0, c1 = column_range(columns, self.cols)
        b = self.column_block
        if (c0, c1) != (0, self.cols) and (b is None or c0 % b or (c1 % b and c1 != self.cols)):
            allowed = "whole rows only" if b is None else f"ranges on multiples of {b}"
            raise ValueError(f"columns {columns!r}: this lookup serves {allowed} (TableSpec.column_block)")
        return c0, c1

    def with_policy(self, **changes) -> TableSpec:
        """This spec with some policy fields changed (validated again)."""
        fields = dict(rows=self.rows, cols=self.cols, dtype=self.dtype, stride=self.stride, encoding=self.encoding,
                      oob=self.oob, scale=self.scale, out_dtype=self.out_dtype, column_block=self.column_block)
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
        return ", ".join(parts)


def spec_for(table, spec: TableSpec | None, *, scale=None, oob: str = "zero", out_dtype=None,
             column_block=None) -> TableSpec:
    """``spec`` as given, or the spec of ``table`` with this policy; both at once is an error."""
    policy = scale is not None or oob != "zero" or out_dtype is not None or column_block is not None
    if spec is not None:
        if policy:
            raise TypeError("give a spec or policy arguments (scale, oob, out_dtype, column_block), not both: "
                            "put the policy in the spec")
        return spec
    return TableSpec.of(table, scale=scale, oob=oob, out_dtype=out_dtype, column_block=column_block)

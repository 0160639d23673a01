"""Pure-torch reference gather: the definition every placement and kernel path is compared against."""

from __future__ import annotations

import torch

from .checks import column_range
from .encodings import ENCODINGS


def reference_gather(table: torch.Tensor, ids: torch.Tensor, *, scale: float | None = None, columns=None,
                     oob: str = "zero", out_dtype: torch.dtype | None = None,
                     dequant_scale: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
                     id_base: int = 0, row_scale: bool = False, encoding: str | None = None) -> torch.Tensor:
    """``table[ids, columns] * scale.to(table.dtype)`` with the out-of-range policy, on the CPU.

    An id reads row ``id - id_base``; valid rows are ``rows[0] <= row < rows[1]`` (default: the whole
    table). ``oob="zero"`` gives +0.0 rows for the others, ``"neg_zero"`` -0.0 rows, ``"row0"`` reads row
    ``rows[0]`` for them. ``dequant_scale``: the table holds ``fp8_global`` codes, ``row_scale``: ``fp8_row``
    rows (codes, then their own float32 scale; columns index the codes); either is dequantised by its
    encoding's reference (:mod:`uvaple.kernels.encodings`: vLLM's ``codes.to(out) * scale.to(out)``, ``out``
    default bf16). ``encoding``: any entry of the registry by name (its own reference dequantises; the two
    flags above name the built-in ones).
    """
    if encoding is not None and encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {sorted(ENCODINGS)}, got {encoding!r}")
    enc = ENCODINGS[encoding or ("fp8_row" if row_scale else "fp8_global" if dequant_scale is not None else "raw")]
    t = table.detach().cpu()
    c0, c1 = column_range(columns, enc.value_cols(t.shape[1]))
    lo, hi = rows if rows is not None else (0, t.shape[0])
    i = ids.detach().cpu().to(torch.int64) - int(id_base)
    valid = (i >= lo) & (i < hi)
    safe = torch.where(valid, i, torch.full_like(i, lo))
    picked = t[safe.reshape(-1)]
    if enc.name == "raw":
        out = picked[:, c0:c1]
        if scale is not None:
            out = out * torch.tensor(float(scale), dtype=torch.float32).to(t.dtype)
        out = out.to(out_dtype or t.dtype)
    else:
        out = enc.dequantise(picked, out_dtype, dequant_scale)[:, c0:c1]
    if oob in ("zero", "neg_zero"):
        zero = torch.tensor(-0.0 if oob == "neg_zero" else 0.0).to(out.dtype)
        out = torch.where(valid.reshape(-1, 1), out, zero)
    elif oob != "row0":
        raise ValueError(f"oob must be 'zero', 'row0' or 'neg_zero', got {oob!r}")
    return out.reshape(*ids.shape, c1 - c0)

"""Pure-torch reference gather: the definition every backend and kernel is compared against."""

from __future__ import annotations

import torch


def reference_gather(table: torch.Tensor, ids: torch.Tensor, *, scale: float | None = None, columns=None,
                     oob: str = "zero", out_dtype: torch.dtype | None = None,
                     dequant_scale: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
                     id_base: int = 0, row_scale: bool = False) -> torch.Tensor:
    """``table[ids, columns] * scale.to(table.dtype)`` with the out-of-range policy, on the CPU.

    An id reads row ``id - id_base``; valid rows are ``rows[0] <= row < rows[1]`` (default: the whole
    table). ``oob="zero"`` gives +0.0 rows
    for the others, ``"neg_zero"`` -0.0 rows, ``"row0"`` reads row ``rows[0]`` for them.
    ``dequant_scale``: the table holds fp8 codes and a row is ``codes.to(out) * dequant_scale.to(out)``
    (vLLM's fp8 PLE formula; ``out`` defaults to bf16). ``row_scale``: each fp8 row ends in its own
    float32 scale (4 bytes, little-endian) and is ``codes.to(out) * row_scale.to(out)``; columns index
    the codes.
    """
    from .checks import column_range

    t = table.detach().cpu()
    c0, c1 = column_range(columns, t.shape[1] - 4 if row_scale else t.shape[1])
    lo, hi = rows if rows is not None else (0, t.shape[0])
    i = ids.detach().cpu().to(torch.int64) - int(id_base)
    valid = (i >= lo) & (i < hi)
    safe = torch.where(valid, i, torch.full_like(i, lo))
    out = t[safe.reshape(-1), c0:c1]
    if row_scale:
        dtype = out_dtype or torch.bfloat16
        s = t[safe.reshape(-1), -4:].contiguous().view(torch.uint8).view(torch.float32)  # [n, 1]
        out = out.to(dtype) * s.to(dtype)
    elif dequant_scale is not None:
        dtype = out_dtype or torch.bfloat16
        out = out.to(dtype) * dequant_scale.detach().cpu().to(dtype)
    else:
        if scale is not None:
            out = out * torch.tensor(float(scale), dtype=torch.float32).to(t.dtype)
        out = out.to(out_dtype or t.dtype)
    if oob in ("zero", "neg_zero"):
        zero = torch.tensor(-0.0 if oob == "neg_zero" else 0.0).to(out.dtype)
        out = torch.where(valid.reshape(-1, 1), out, zero)
    elif oob != "row0":
        raise ValueError(f"oob must be 'zero', 'row0' or 'neg_zero', got {oob!r}")
    return out.reshape(*ids.shape, c1 - c0)

"""Pure-torch reference gather: the definition every backend and kernel is compared against."""

from __future__ import annotations

import torch


def reference_gather(table: torch.Tensor, ids: torch.Tensor, *, scale: float | None = None, columns=None,
                     oob: str = "zero", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``table[ids, columns] * scale.to(table.dtype)`` with the out-of-range policy, on the CPU.

    ``oob="zero"`` gives +0.0 rows for ids outside ``[0, rows)``; ``"row0"`` reads row 0 for them.
    """
    from .gather import column_range

    t = table.detach().cpu()
    c0, c1 = column_range(columns, t.shape[1])
    i = ids.detach().cpu().to(torch.int64)
    valid = (i >= 0) & (i < t.shape[0])
    safe = torch.where(valid, i, torch.zeros_like(i))
    rows = t[safe.reshape(-1), c0:c1]
    if scale is not None:
        rows = rows * torch.tensor(float(scale), dtype=torch.float32).to(t.dtype)
    rows = rows.to(out_dtype or t.dtype)
    if oob == "zero":
        rows = torch.where(valid.reshape(-1, 1), rows, torch.zeros((), dtype=rows.dtype))
    elif oob != "row0":
        raise ValueError(f"oob must be 'zero' or 'row0', got {oob!r}")
    return rows.reshape(*ids.shape, c1 - c0)

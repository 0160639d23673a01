"""Helpers the test modules share: random tables (never zeros) and exact bit views."""

from __future__ import annotations

import torch


def rand(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Random normal rows x 4 in ``dtype``; exact zeros replaced (they hide unwritten outputs)."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, cols, generator=g) * 4).to(dtype)
    t[t == 0] = 1.25
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` on the CPU, for bit-exact comparison (-0.0 != +0.0, NaN == same NaN)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

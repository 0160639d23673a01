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


def capture(fn, pool=None):
    """``(graph, result)``: ``fn()`` run once on a side stream (compiles, warms the allocator), then
    captured in a CUDA graph (in ``pool`` when given), as torch's capture recipe says."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = fn()
    return graph, result

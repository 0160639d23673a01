"""Helpers the test modules share: random tables (never zeros), exact bit views, the studies' scripts."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import torch

STUDIES = Path(__file__).resolve().parents[1] / "perf" / "studies"


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


def study(name: str) -> ModuleType:
    """The script ``perf/studies/<name>.py`` (not installed) imported as the module ``name``. Its folder goes
    on ``sys.path`` as when it runs as a script, so the studies it imports are the same module objects."""
    if str(STUDIES) not in sys.path:
        sys.path.insert(0, str(STUDIES))
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().parent == STUDIES, f"{name} imported from {module.__file__}"
    return module

"""Helpers the test modules share: random tables (never zeros), exact bit views, the studies' scripts, the
default set's representatives of a parametrisation (``cover``), a call made in a forked child."""

from __future__ import annotations

import faulthandler
import importlib
import itertools
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

STUDIES = Path(__file__).resolve().parents[1] / "perf" / "studies"

# the tests `python3 -m pytest` leaves out without CUDA (tests/conftest.py); `-m extended` runs them
EXTENDED = pytest.mark.extended
_PARAM = type(pytest.param())


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


def on_cuda_1_behind_a_busy_stream(call, fill: torch.Tensor, src: torch.Tensor) -> torch.cuda.Stream:
    """``call()`` with ``cuda:0`` current while ``cuda:1``'s current stream is still writing ``fill`` (its
    inputs) from ``src``: a launch that went to ``cuda:0``, or to another stream, reads them unwritten."""
    busy = torch.cuda.Stream(device="cuda:1")
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the stream before the inputs are written
        fill.copy_(src)
        torch.cuda.set_device(0)
        try:
            assert torch.cuda.current_device() == 0
            call()
        finally:
            torch.cuda.set_device(1)
    return busy


CHILD_LIMIT_S = 20  # a forked child still running after this is killed: the test fails, never hangs


def fork_and_wait(child: Callable[[], int]) -> int:
    """Fork; the child runs ``child()`` (its int result is the exit status) under a hang guard; return it
    (``-SIGKILL`` for a child still running after :data:`CHILD_LIMIT_S`)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            faulthandler.dump_traceback_later(CHILD_LIMIT_S / 2, exit=True)
            code = int(child())
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_LIMIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -signal.SIGKILL


def in_forked_child(call: Callable[[], object]) -> str:
    """``call()`` in a forked child (:func:`fork_and_wait`): ``"served"`` where it returned, else the name of the
    exception's type, or the child's exit status where it said neither."""
    r, w = os.pipe()

    def child() -> int:
        try:
            call()
            os.write(w, b"served")
        except Exception as e:  # noqa: BLE001 - the child reports what it met
            os.write(w, type(e).__name__.encode())
        return 0

    try:
        code = fork_and_wait(child)
    finally:
        os.close(w)
    got = os.read(r, 100).decode()
    os.close(r)
    return got or f"the child ended with status {code}"


def study(name: str) -> ModuleType:
    """The script ``perf/studies/<name>.py`` (not installed) imported as the module ``name``. Its folder goes
    on ``sys.path`` as when it runs as a script, so the studies it imports are the same module objects."""
    if str(STUDIES) not in sys.path:
        sys.path.insert(0, str(STUDIES))
    module = importlib.import_module(name)
    assert Path(module.__file__).resolve().parent == STUDIES, f"{name} imported from {module.__file__}"
    return module


def grid(**axes: Sequence) -> list:
    """Every combination of ``axes`` (``name=values``, in the order the test's argnames give them) as
    ``pytest.param`` with the id stacked ``parametrize`` decorators give it (``"out_dtype0-fp81"``), for
    ``cover`` to pick from."""
    def ids(name: str, values: Sequence) -> list[str]:
        got = [str(v) if v is None or isinstance(v, (str, int, float, bool)) else f"{name}{i}"
               for i, v in enumerate(values)]
        count, seen = Counter(got), Counter()
        for i, v in enumerate(got):  # equal ids numbered in turn, as pytest numbers them
            if count[v] > 1:
                got[i] = f"{v}{'_' if v[-1].isdigit() else ''}{seen[v]}"
                seen[v] += 1
        return got

    named = [list(zip(values, ids(name, values), strict=True)) for name, values in axes.items()]
    return [pytest.param(*(v for v, _ in c), id="-".join(i for _, i in c)) for c in itertools.product(*named)]


def cover(cases: Iterable, *groups: Sequence[int], cost: Callable[[tuple], float] | None = None) -> list:
    """``cases`` (tuples of parameters, or ``pytest.param``) as ``pytest.param``, all but a few marked
    ``extended``: the default set keeps cases until every value at each position in ``groups`` (every
    combination, for a group of several positions) has run; the case bringing the most not yet run comes
    first, the cheaper by ``cost`` (then the earlier) among equals. GPU-only cases stay as they are (skipped
    without CUDA, run whole with it). Without ``groups``: the cheapest case alone."""
    params = [c if isinstance(c, _PARAM) else pytest.param(*(c if isinstance(c, tuple) else (c,)))
              for c in cases]
    cpu = [i for i, p in enumerate(params) if not any(m.name == "gpu" for m in p.marks)]

    def brings(i: int) -> set:
        return {(g, tuple(params[i].values[k] for k in g)) for g in groups}

    def price(i: int) -> float:
        return cost(params[i].values) if cost else 0.0

    todo = set().union(*(brings(i) for i in cpu)) if cpu else set()
    keep = {min(cpu, key=price)} if cpu and not groups else set()
    while todo:
        best = min((i for i in cpu if i not in keep), key=lambda i: (-len(brings(i) & todo), price(i), i))
        keep.add(best)
        todo -= brings(best)
    return [p if i in keep or i not in cpu else pytest.param(*p.values, marks=[*p.marks, EXTENDED], id=p.id)
            for i, p in enumerate(params)]

"""How the benchmark times a call: device events around eager calls, CUDA-graph replays, quantiles.

Method (``.library/device/METHOD.md``): each eager call is bracketed by CUDA events from an idle stream
(so a call's own CPU cost is inside its time); the host waits on a blocking-sync event between calls, so
``time.process_time`` over the loop counts the provider's CPU work, not a spin-wait. Graph timings replay
``graph_calls`` captured calls per replay over fresh random ids.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .config import GRAPH_REPLAY_BYTES, BenchConfig


# ------------------------------------------------------------------------------------------------ timing
def cuda_missing(prog: str) -> bool:
    """True, having said so on stderr, where ``prog`` (a GPU-only measurement) finds no CUDA device."""
    if torch.cuda.is_available():
        return False
    print(f"{prog} needs a CUDA GPU", file=sys.stderr)
    return True


def quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p20, median, p80) of ``values``."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10, method="inclusive")  # deciles: q[1] = p20, q[7] = p80
    return q[1], statistics.median(xs), q[7]


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def drain(cuda: bool) -> None:
    """Wait for the current stream without spinning (a blocking-sync event), so CPU time stays honest."""
    if cuda:
        ev = torch.cuda.Event(blocking=True)
        ev.record()
        ev.synchronize()


def time_eager(call: Callable[[int], Any], n_sets: int, reps: int, cuda: bool) -> dict[str, float]:
    """Time ``call(i)`` (id set ``i % n_sets``) from an idle stream, ``reps`` times.

    Returns µs quantiles (device events around each call; on CPU, ``perf_counter``), host CPU seconds
    per call (``time.process_time``: every thread of the process) and wall µs per call.
    """
    times: list[float] = []
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        # blocking=True: the host sleeps in synchronize() instead of spinning, so process_time counts work.
        ends = [torch.cuda.Event(enable_timing=True, blocking=True) for _ in range(reps)]
        torch.cuda.synchronize()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for r in range(reps):
            starts[r].record()
            call(r % n_sets)
            ends[r].record()
            ends[r].synchronize()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
    else:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for r in range(reps):
            t0 = time.perf_counter()
            call(r % n_sets)
            times.append((time.perf_counter() - t0) * 1e6)
        cpu1, wall1 = time.process_time(), time.perf_counter()
    p20, med, p80 = quantiles(times)
    return {"us_p20": p20, "us_median": med, "us_p80": p80,
            "cpu_s_per_lookup": (cpu1 - cpu0) / reps, "wall_us_per_lookup": (wall1 - wall0) / reps * 1e6}


def time_graph(call_on: Callable[[torch.Tensor, torch.Tensor], Any], out: torch.Tensor, rows: int,
                n: int, device: torch.device, cfg: BenchConfig) -> dict[str, float]:
    """Per-lookup µs of ``call_on(ids, out)`` replayed from a CUDA graph of ``cfg.graph_calls`` lookups.

    Fresh random ids are written into the captured id buffers before every replay (outside the timed
    region), so replays read new rows, not L2-resident ones.
    """
    calls = max(2, min(cfg.graph_calls, GRAPH_REPLAY_BYTES // max(1, out.numel() * out.element_size())))
    replays = cfg.graph_replays if calls >= cfg.graph_calls else max(5, cfg.graph_replays // 2)
    gids = torch.randint(0, rows, (calls, n), device=device, dtype=torch.int64)
    t = graph_replay_us(lambda ids: call_on(ids, out), gids, lambda b: b.random_(0, rows), replays)
    return {"graph_us_p20": t["p20"], "graph_us_median": t["median"], "graph_us_p80": t["p80"]}


def graph_replay_us(call: Callable[[torch.Tensor], Any], ids_buf: torch.Tensor,
                    refresh: Callable[[torch.Tensor], Any], replays: int) -> dict[str, float]:
    """Per-call µs (p20, median, p80) of ``call(ids_buf[j])`` for every ``j``, captured in one CUDA graph and
    replayed ``replays`` times; ``refresh(ids_buf)`` writes new ids in place before each replay (outside the
    timed region). Warm-up runs on a side stream, as ``torch.cuda.graphs`` asks."""
    device, calls = ids_buf.device, ids_buf.shape[0]
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for j in range(2):
            call(ids_buf[j % calls])
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            call(ids_buf[j])
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        refresh(ids_buf)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    p20, med, p80 = quantiles(times)
    return {"p20": p20, "median": med, "p80": p80}


def reps_for(cfg: BenchConfig, est_us: float) -> int:
    if cfg.point_time_s <= 0 or not math.isfinite(est_us) or est_us <= 0:
        return cfg.min_reps
    return int(min(cfg.max_reps, max(cfg.min_reps, cfg.point_time_s * 1e6 / est_us)))


class EventTimer:
    """Per-call times in ms of whole callables: CUDA events on ``device`` when it is a GPU, else
    ``perf_counter``; ``median(skip=warm)`` synchronises once, at the end."""

    def __init__(self, device):
        self.device, self.pairs, self.cpu = torch.device(device), [], []

    def __call__(self, fn):
        if self.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            r = fn()
            b.record()
            self.pairs.append((a, b))
        else:
            t = time.perf_counter()
            r = fn()
            self.cpu.append((time.perf_counter() - t) * 1e3)
        return r

    def median(self, skip: int = 0) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ts = [a.elapsed_time(b) for a, b in self.pairs] if self.pairs else self.cpu
        ts = ts[skip:]
        return statistics.median(ts) if ts else float("nan")

"""Work split over the host's cores: how many threads, the pieces of a range, and running them.

The host table's fills and page commits, the safetensors loader, the bulk quantiser and the vLLM plugin's
dummy rows each cut their work into ranges and run them on :func:`default_threads` threads; ctypes calls and
numba kernels drop the GIL, so the threads run at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["default_threads", "chunks", "parallel"]


def default_threads() -> int:
    """Threads for populate/load: 16, measured best for 32 GiB on the H200 host (16 threads populate 4 GiB
    in 0.37 s, one in 0.95 s: ``perf/results/h200_2026-11-29/table_ready_64gib.log``)."""
    return max(1, min(16, os.cpu_count() or 1))


def chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of ``chunk`` (the last shorter) covering ``0 .. total``."""
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


def parallel(fn: Callable[..., None], ranges: list[tuple], threads: int, name: str = "uvaple-populate") -> None:
    """Run ``fn(*r)`` (mostly ``fn(start, length)``) for each ``r`` of ``ranges`` on ``threads`` threads;
    re-raise the first failure (an interrupt of the waiting thread included). After a failure the ranges not
    started are not started; every range started has finished when this returns or raises."""
    if threads <= 1 or len(ranges) <= 1:
        for r in ranges:
            fn(*r)
        return
    with ThreadPoolExecutor(max_workers=min(threads, len(ranges)), thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, *r) for r in ranges]
        first = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - collect, then raise the first
                if first is None:
                    first = e
                    for g in futures:  # what has not started never will
                        g.cancel()
        if first is not None:
            raise first

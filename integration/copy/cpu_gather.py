"""The copy backend's CPU gather: a numba byte copy of rows into pinned staging.

Rows are copied as bytes (columns as a byte range), so every dtype is exact. Out-of-range ids write the
zero element given (the backend passes -0.0 when a negative scale follows on the device) or row 0. The
kernel returns how many ids were out of range (the backend's counter).

Two compiled variants: serial, and parallel (``numba.prange`` over all cores) above
``PARALLEL_MIN_BYTES`` of output. Concurrent calls of a parallel numba function from several threads
abort under numba's default "workqueue" threading layer, so one process-wide lock serialises gathers of
several backends (each parallel gather already uses every core).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np

__all__ = ["cpu_gather", "warm_up", "PARALLEL_MIN_BYTES"]

# Below this many gathered bytes the serial gather is used. Swept on the H200 host (16 cores) by
# perf/tune_copy.py (perf/results/h200_2026-12-01/tune_copy.log): the parallel gather is faster from 8 KiB
# (160-byte rows) and 4 KiB (17,920-byte rows) at every larger size, and 8-150x faster above 64 KiB.
PARALLEL_MIN_BYTES = 8 << 10

_GATHER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _gather_kernels() -> tuple[Callable, Callable]:
    """(serial, parallel) numba byte-gather kernels, compiled lazily (numba imports slowly)."""
    import numba

    def gather(table, ids, out, byte_start, oob_row0, zero, id_base):
        # table: uint8 [rows, stride_bytes]; ids: int32/int64 [n]; out: uint8 [n, nbytes];
        # zero: uint8 [itemsize], the element written for out-of-range ids under oob="zero";
        # id_base: the id of table row 0 (0 <= id_base < 2**62, so a wrapped difference stays out of range)
        rows = table.shape[0]
        nbytes = out.shape[1]
        isz = zero.shape[0]
        bad = 0
        for i in numba.prange(ids.shape[0]):
            r = np.int64(ids[i]) - id_base
            if r < 0 or r >= rows:
                bad += 1
                if oob_row0:
                    out[i, :] = table[0, byte_start:byte_start + nbytes]
                else:
                    for j in range(nbytes):
                        out[i, j] = zero[j % isz]
            else:
                out[i, :] = table[r, byte_start:byte_start + nbytes]
        return bad

    serial = numba.njit(parallel=False, nogil=True, cache=False)(gather)
    parallel = numba.njit(parallel=True, nogil=True, cache=False)(gather)
    return serial, parallel


def cpu_gather(table: np.ndarray, ids: np.ndarray, out: np.ndarray, byte_start: int, oob_row0: bool,
               zero: np.ndarray, *, id_base: int = 0, parallel_min_bytes: int | None = None) -> int:
    """Gather ``table[ids - id_base, byte_start:byte_start+out.shape[1]]`` into ``out``; returns the count
    of out-of-range ids."""
    serial, parallel = _gather_kernels()
    threshold = PARALLEL_MIN_BYTES if parallel_min_bytes is None else parallel_min_bytes
    fn = parallel if out.size >= threshold else serial
    with _GATHER_LOCK:
        return int(fn(table, ids, out, byte_start, oob_row0, zero, np.int64(id_base)))


def warm_up(table: np.ndarray, zero: np.ndarray) -> None:
    """Compile both variants for int32 and int64 ids now, not in the first lookup."""
    out = np.empty((1, min(8, table.shape[1])), dtype=np.uint8)
    serial, parallel = _gather_kernels()
    for dt in (np.int32, np.int64):
        ids = np.zeros(1, dtype=dt)
        with _GATHER_LOCK:
            serial(table, ids, out, 0, False, zero, np.int64(0))
            parallel(table, ids, out, 0, False, zero, np.int64(0))

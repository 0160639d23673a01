"""Random 4 KiB reads through io_uring from one thread: the disk's rate without threads.

The disk placement's batched reader (:class:`~uvaple.uva.PageReader`) keeps its reads in flight from the calling
thread's io_uring where the kernel allows it, else with a thread a read. ``rate`` measures the first the way the
thread probe (:func:`uvaple.perf.disk.probe`) measures the second: reads per second with ``depth`` reads in flight
from one thread, each completion replaced at once by the next read, each read's latency; so the disk's limit is
the best of both, and the reader is judged against it (``uvaple bench --workload disk`` times the reader with
each engine, a call of n rows).

The ring is the disk placement's own (:class:`uvaple.uva.uring.Ring`); this loop, unlike the reader's, keeps
its depth for as long as it is asked to and times each read. It is compiled (numba, ``nogil``), with
``io_uring_enter`` and ``clock_gettime`` called through ctypes; it waits for
completions by reading the completion ring's tail between clock reads (a busy wait, bounded by a deadline: a read
that never completes is an error, not a hang). Where io_uring is not allowed (an old kernel,
``kernel.io_uring_disabled``, a container's seccomp filter), :func:`unavailable` says why and nothing runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

import numpy as np

from uvaple.uva import uring as _uring
from uvaple.uva.uring import _ENTER, _OP_READ, PAGE, Ring


@functools.lru_cache(maxsize=1)
def _loop():
    """The compiled submit-and-reap loop (numba imports slowly: made on first use)."""
    import numba

    libc = _uring._libc()
    enter = libc.syscall
    enter.restype = ctypes.c_long
    enter.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                      ctypes.c_long]
    acquire, release = _uring.fences()
    clock = libc.clock_gettime
    clock.restype, clock.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]

    @numba.njit(nogil=True, cache=False)
    def run(ring_fd, sq, sq_at, cq, cq_at, sqes, file_fd, buf, offsets, total, depth, timeout_ns, ts, lat):
        """``total`` reads of the 4 KiB pages at ``offsets`` (cycled) into ``buf``'s pages (cycled: read k into page
        k % len(buf); with fewer pages than reads, two reads in flight may share a page, whose bytes a rate does
        not read), at most ``depth`` in flight, each completion followed at once by the next submission. Each
        read's ns from its submission to its completion into ``lat``. Returns the reads completed; -1 - k where
        read k was short or failed; -2**40 where nothing completed for ``timeout_ns``."""
        sq_mask = np.int64(sq[sq_at[2]])  # every ring index in int64 (numba makes uint32 and int64 a float)
        cq_mask = np.int64(cq[cq_at[2]])
        nbuf = buf.shape[0]
        started = np.empty(total, dtype=np.int64)
        submitted = 0
        completed = 0
        clock(1, ts.ctypes.data)
        now = ts[0] * 1_000_000_000 + ts[1]
        last = now
        while completed < total:
            to_submit = 0
            tail = np.int64(sq[sq_at[1]])
            while submitted < total and submitted - completed < depth:
                slot = tail & sq_mask
                e = sqes[slot]
                e[0] = np.uint64(_OP_READ) | (np.uint64(file_fd & 0xFFFFFFFF) << np.uint64(32))
                e[1] = np.uint64(offsets[submitted % offsets.shape[0]])
                e[2] = np.uint64(buf[submitted % nbuf].ctypes.data)
                e[3] = np.uint64(PAGE)  # len; rw_flags 0
                e[4] = np.uint64(submitted)  # user_data
                e[5] = 0
                e[6] = 0
                e[7] = 0
                sq[sq_at[3] + slot] = np.uint32(slot)
                tail = (tail + 1) & 0xFFFFFFFF
                started[submitted] = now
                submitted += 1
                to_submit += 1
            release()
            sq[sq_at[1]] = np.uint32(tail & 0xFFFFFFFF)
            if to_submit:
                if enter(_ENTER, ring_fd, to_submit, 0, 0, 0, 0) < 0:
                    return -1 - completed
            # reap what completed; the clock call between two reads of the tail makes each read a fresh load
            clock(1, ts.ctypes.data)
            now = ts[0] * 1_000_000_000 + ts[1]
            head = np.int64(cq[cq_at[0]])
            tail_c = np.int64(cq[cq_at[1]])
            acquire()
            if head == tail_c:
                if now - last > timeout_ns:
                    return -(1 << 40)
                continue
            while head != tail_c:
                at = cq_at[3] + (head & cq_mask) * 4
                k = np.int64(cq[at]) | (np.int64(cq[at + 1]) << 32)
                res = np.int32(cq[at + 2])
                if res != PAGE:
                    return -1 - k
                lat[k] = now - started[k]
                head = (head + 1) & 0xFFFFFFFF
                completed += 1
            release()
            cq[cq_at[0]] = np.uint32(head)
            last = now
        return completed

    return run


def unavailable() -> str | None:
    """Why io_uring cannot be used here, or None (the disk placement's own answer: :mod:`uvaple.uva.uring`)."""
    return _uring.unavailable()


class _Reader:
    """``path`` opened (``O_DIRECT`` where the filesystem allows it), a ring of ``entries`` and a page buffer."""

    def __init__(self, path: str, entries: int):
        from uvaple.uva.table_file import _open_direct, page_buffer

        self.path = path
        fd = _open_direct(path)  # as the thread probe opens it: O_DIRECT, or None where the filesystem refuses it
        self.fd, self.direct = (fd, True) if fd is not None else (os.open(path, os.O_RDONLY | os.O_CLOEXEC), False)
        try:
            self.ring = Ring(max(8, entries))
        except BaseException:
            os.close(self.fd)
            raise
        self.buf = page_buffer(entries).numpy()
        self.loop = _loop()

    def reads(self, offsets: np.ndarray, total: int, depth: int, timeout_s: float) -> tuple[np.ndarray, float]:
        """``total`` reads of ``offsets`` at ``depth``: each read's ns, and the wall seconds of the loop."""
        r = self.ring
        lat = np.zeros(total, dtype=np.int64)
        t0 = time.perf_counter()
        n = self.loop(r.fd, r.sq, r.sq_at, r.cq, r.cq_at, r.sqes, self.fd, self.buf, offsets, total, depth,
                      int(timeout_s * 1e9), np.zeros(2, dtype=np.int64), lat)
        wall = time.perf_counter() - t0
        if n == -(1 << 40):
            raise TimeoutError(f"io_uring reads of {self.path}: none completed for {timeout_s:g} s")
        if n < 0:
            raise OSError(f"io_uring read {-1 - n} of {self.path} (4 KiB at byte "
                          f"{int(offsets[(-1 - n) % len(offsets)])}) was short or failed")
        return lat, wall

    def close(self) -> None:
        self.ring.close()
        os.close(self.fd)


def rate(path: str, first_page: int, pages: int, depth: int, seconds: float, timeout_s: float = 10.0) -> dict:
    """Random pages of ``path`` (``pages`` from ``first_page``) at ``depth`` from one thread for about ``seconds``
    (a short first run sizes the long one): reads/s, MB/s, latency median and p99 (us)."""
    offs = (first_page + np.random.default_rng(depth).integers(0, pages, 1 << 16)) * PAGE
    r = _Reader(path, depth)
    try:
        r.reads(offs, 1, 1, timeout_s)  # the loop compiled before anything is timed
        lat, wall = r.reads(offs, max(depth * 4, 256), depth, timeout_s)
        total = max(depth, int(len(lat) / max(wall, 1e-6) * seconds))
        lat, wall = r.reads(offs, total, depth, timeout_s)
    finally:
        r.close()
    every = np.sort(lat) / 1e3
    return {"depth": depth, "reads": total, "seconds": round(wall, 3), "reads_per_s": round(total / wall),
            "MB_per_s": round(total * PAGE / wall / 1e6, 1), "direct": r.direct,
            "latency_us_median": round(float(np.median(every)), 1),
            "latency_us_p99": round(float(every[min(total - 1, int(total * 0.99))]), 1)}

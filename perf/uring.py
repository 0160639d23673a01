"""Random 4 KiB reads through io_uring from one thread: does the kernel's queue replace the page reader's threads?

The disk placement's batched reader (:class:`~uvaple.uva.PageReader`) keeps ``depth`` reads in flight with a
thread each; a decode step hands its pages to the threads and waits for them. Where a step misses a few pages
(batch 1: about 15), the hand-over costs more than the reads: on a GPU server's host an idle thread takes long to
wake. io_uring keeps the same depth from the calling thread: one system call submits every read of a call, the
completions arrive in a ring that thread reads, no other thread runs. This probe measures both halves of that
choice on the disk given, before the reader is changed:

* ``rate``: reads per second with ``depth`` reads in flight from one thread, each completion replaced at once by
  the next read (against the thread probe's rate at the same depth: what the threads add or lose);
* ``call``: one call's time to read ``pages`` random pages and have every one back, one submission and the
  completions awaited on the calling thread (against :class:`PageReader`'s call of the same pages).

Rings, submissions and completions are the kernel's ABI (``linux/io_uring.h``): the three rings mapped with
``mmap``, submission queue entries of 64 bytes (``IORING_OP_READ``), completion entries of 16 bytes. The loop is
compiled (numba, ``nogil``), with ``io_uring_enter`` and ``clock_gettime`` called through ctypes; it waits for
completions by reading the completion ring's tail between clock reads (a busy wait, bounded by a deadline: a read
that never completes is an error, not a hang). Where io_uring is not allowed (an old kernel,
``kernel.io_uring_disabled``, a container's seccomp filter), :func:`unavailable` says why and nothing else runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import statistics
import time

import numpy as np

PAGE = 4096
_SETUP, _ENTER = 425, 426  # x86_64 and aarch64 share io_uring's system call numbers
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_READ = 22
_ENTER_GETEVENTS = 1


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class Ring:
    """One io_uring of ``entries`` submission slots, its rings mapped as numpy views (closed by :meth:`close`)."""

    def __init__(self, entries: int):
        params = (ctypes.c_uint32 * 30)()  # struct io_uring_params: 120 bytes
        fd = _libc().syscall(_SETUP, entries, ctypes.byref(params))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup({entries}): {os.strerror(err)}")
        self.fd = fd
        p = np.frombuffer(params, dtype=np.uint32)
        sq_entries, cq_entries = int(p[0]), int(p[1])
        sq_off, cq_off = p[10:20], p[20:30]  # io_sqring_offsets, io_cqring_offsets (u32 fields, then a u64)
        self._maps = []

        def mapped(size: int, offset: int) -> mmap.mmap:
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                          prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
            self._maps.append(m)
            return m

        try:
            sq = np.frombuffer(mapped(int(sq_off[6]) + sq_entries * 4, _OFF_SQ_RING), dtype=np.uint32)
            cq = np.frombuffer(mapped(int(cq_off[5]) + cq_entries * 16, _OFF_CQ_RING), dtype=np.uint32)
            sqes = np.frombuffer(mapped(sq_entries * 64, _OFF_SQES), dtype=np.uint64).reshape(sq_entries, 8)
        except BaseException:
            self.close()
            raise
        # [head, tail, mask] of each ring, as indices into its u32 view; the SQ's index array; the CQEs as u32 x 4
        self.sq, self.cq, self.sqes = sq, cq, sqes
        self.sq_idx = np.array([sq_off[0] // 4, sq_off[1] // 4, sq_off[2] // 4, sq_off[6] // 4], dtype=np.int64)
        self.cq_idx = np.array([cq_off[0] // 4, cq_off[1] // 4, cq_off[2] // 4, cq_off[5] // 4], dtype=np.int64)
        self.entries = sq_entries

    def close(self) -> None:
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still held: the mapping goes with the process
                pass
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@functools.lru_cache(maxsize=1)
def _loop():
    """The compiled submit-and-reap loop (numba imports slowly: made on first use)."""
    import numba

    libc = _libc()
    enter = libc.syscall
    enter.restype = ctypes.c_long
    enter.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                      ctypes.c_long]
    clock = libc.clock_gettime
    clock.restype, clock.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]

    @numba.njit(nogil=True, cache=False)
    def run(ring_fd, sq, sq_idx, cq, cq_idx, sqes, file_fd, buf, offsets, total, depth, timeout_ns, ts, lat):
        """``total`` reads of the 4 KiB pages at ``offsets`` (cycled) into ``buf``'s pages (cycled: read k into page
        k % len(buf); with fewer pages than reads, two reads in flight may share a page, whose bytes a rate does
        not read), at most ``depth`` in flight, each completion followed at once by the next submission. Each
        read's ns from its submission to its completion into ``lat``. Returns the reads completed; -1 - k where
        read k was short or failed; -2**40 where nothing completed for ``timeout_ns``."""
        sq_mask = np.int64(sq[sq_idx[2]])  # every ring index in int64 (numba makes uint32 and int64 a float)
        cq_mask = np.int64(cq[cq_idx[2]])
        nbuf = buf.shape[0]
        started = np.empty(total, dtype=np.int64)
        submitted = 0
        completed = 0
        clock(1, ts.ctypes.data)
        now = ts[0] * 1_000_000_000 + ts[1]
        last = now
        while completed < total:
            to_submit = 0
            tail = np.int64(sq[sq_idx[1]])
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
                sq[sq_idx[3] + slot] = np.uint32(slot)
                tail = (tail + 1) & 0xFFFFFFFF
                started[submitted] = now
                submitted += 1
                to_submit += 1
            sq[sq_idx[1]] = np.uint32(tail & 0xFFFFFFFF)
            if to_submit:
                if enter(_ENTER, ring_fd, to_submit, 0, 0, 0, 0) < 0:
                    return -1 - completed
            # reap what completed; the clock call between two reads of the tail makes each read a fresh load
            clock(1, ts.ctypes.data)
            now = ts[0] * 1_000_000_000 + ts[1]
            head = np.int64(cq[cq_idx[0]])
            tail_c = np.int64(cq[cq_idx[1]])
            if head == tail_c:
                if now - last > timeout_ns:
                    return -(1 << 40)
                continue
            while head != tail_c:
                at = cq_idx[3] + (head & cq_mask) * 4
                k = np.int64(cq[at]) | (np.int64(cq[at + 1]) << 32)
                res = np.int32(cq[at + 2])
                if res != PAGE:
                    return -1 - k
                lat[k] = now - started[k]
                head = (head + 1) & 0xFFFFFFFF
                completed += 1
            cq[cq_idx[0]] = np.uint32(head)
            last = now
        return completed

    return run


def unavailable() -> str | None:
    """Why io_uring cannot be used here, or None."""
    try:
        Ring(8).close()
    except OSError as e:
        return str(e)
    return None


class _Reader:
    """``path`` opened (``O_DIRECT`` where the filesystem allows it), a ring of ``entries`` and a page buffer."""

    def __init__(self, path: str, entries: int):
        from uvaple.uva.table_file import _open_direct, page_buffer

        self.path = path
        fd = _open_direct(path)  # as the thread probe opens it: O_DIRECT, or None where the filesystem refuses it
        self.fd, self.direct = (fd, True) if fd is not None else (os.open(path, os.O_RDONLY | os.O_CLOEXEC), False)
        try:
            self.ring = Ring(max(8, 1 << (max(1, entries) - 1).bit_length()))
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
        n = self.loop(r.fd, r.sq, r.sq_idx, r.cq, r.cq_idx, r.sqes, self.fd, self.buf, offsets, total, depth,
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


def call(path: str, first_page: int, pages: int, per_call: int, calls: int, timeout_s: float = 10.0) -> dict:
    """``calls`` calls (after 10 not counted), each reading ``per_call`` distinct random pages (at most 64 in flight,
    the first 64 in one submission) and awaiting them all on this thread, one ring for all: the median call's us,
    with p20 and p80."""
    g = np.random.default_rng(per_call)
    depth = min(per_call, 64)
    r = _Reader(path, depth)
    times = []
    try:
        for i in range(calls + 10):
            offs = (first_page + g.choice(pages, size=per_call, replace=False)) * PAGE
            _, wall = r.reads(offs, per_call, depth, timeout_s)
            if i >= 10:
                times.append(wall * 1e6)
    finally:
        r.close()
    q = statistics.quantiles(times, n=5)
    return {"pages_per_call": per_call, "calls": calls, "direct": r.direct,
            "median_us": round(statistics.median(times), 1), "p20_us": round(q[0], 1), "p80_us": round(q[3], 1)}

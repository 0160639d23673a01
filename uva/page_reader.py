"""The batched reader of a table file: a step's missing rows read with ``depth`` reads in flight, each page
checked against its sum, then copied into the rows' slots by the caller's thread.

Why many in flight. A miss costs one 4 KiB page (:mod:`.table_file`); a local NVMe disk serves hundreds of
thousands of random 4 KiB reads a second only with many in flight (queue depth 32 to 64), and
:meth:`~uvaple.uva.table_file.TableFile.read_rows`, the reference, issues them one at a time.

Two engines keep them in flight (``engine``; ``"auto"`` takes the first that can run here):

* ``"uring"``: the calling thread's io_uring (:mod:`.uring`): one submission of a round's reads (``O_DIRECT``
  where the filesystem allows it), the completions reaped and each page checked on the same thread, in a
  compiled loop that waits for them busily, bounded by ``timeout_s`` for the round and handing the interpreter a
  turn every 20 ms (Ctrl-C stops a round at once; its reads in flight are left to it). No other thread runs, so
  nothing waits for one to wake: a decode step's few misses cost the reads. A reader that cannot have a ring,
  or whose ring the kernel stops taking entries from, goes on with threads. On a GPU server's host (an H100's)
  a call of one page through the threads took 298 us where the disk answers one read in 35.5 us, and more
  threads made calls slower; on the development machine io_uring's call of 1 / 64 / 4,096 pages took 53 / 640 /
  44,474 us against the threads' 160 / 1,364 / 49,516 (``uvaple bench --workload disk`` times both against the
  disk's own rate).
* ``"threads"`` (where io_uring is refused: an old kernel, ``kernel.io_uring_disabled``, a container's seccomp
  filter): ``depth`` threads each ``pread`` their share of the round's pages, as kvikio's POSIX reader keeps
  them; a ``pread`` releases the GIL. Where this host's zlib is found, each thread runs one compiled loop (numba,
  ``nogil``) over its pages: ``pread`` and zlib's ``crc32`` through ctypes, no interpreter and no GIL between two
  reads; without zlib's library, the interpreted path (:meth:`TableFile.read_pages`) does it all.

Either way, a page not read whole or unlike its sum is read again by the interpreted path, whose error names the
file, the page and the cause.

What may write where. The reads write only into the reader's page buffer, each into its own page; the caller's
thread copies the rows out into their slots once every read of the round has returned and passed its sum. A read
that has not returned after ``timeout_s`` is a named error (:class:`ReadTimeout`): the round's buffer and its
threads, or its ring, are abandoned to it (its late bytes land in memory nothing reads) and the next call starts
new ones; a failed or damaged read is the file's own named error (:class:`~uvaple.uva.table_file.TableFileError`).
So no slot is written by a read that came too late, and none outside the rows asked for.

Rounds. A step's pages (each page read once, however many of its rows the step misses) are read in rounds of
at most ``buffer_pages`` (a row larger than a page is never split across rounds), so the buffer is bounded
whatever a step asks for.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import ctypes.util
import functools
import os
import threading

import numpy as np
import torch

from . import uring
from .table_file import PAGE, TableFile, TableFileError, page_buffer

__all__ = ["PageReader", "ReadTimeout", "ENGINES"]

#: how a reader keeps its reads in flight: io_uring where it can be used, else threads; or one of them
ENGINES = ("auto", "uring", "threads")
#: how long the io_uring loop waits for completions before it gives the interpreter a turn (a signal's handler:
#: Ctrl-C during a round that a silent disk holds)
_SLICE_NS = 20_000_000


@functools.lru_cache(maxsize=1)
def _compiled_reader():
    """The compiled page loop (see the module docstring), or None where zlib's library is not found. Compiled on
    first use (numba imports slowly)."""
    name = ctypes.util.find_library("z")
    if name is None:
        return None
    import numba

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    pread = libc.pread
    pread.restype, pread.argtypes = ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    crc32 = ctypes.CDLL(name).crc32
    crc32.restype, crc32.argtypes = ctypes.c_ulong, [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_uint]

    @numba.njit(nogil=True, cache=False)
    def read_checked(fd, buf, pages, sums):
        """Data pages ``pages`` into ``buf``'s rows, each checked; -1, or the first page index not read whole or
        not matching its sum."""
        for k in range(pages.shape[0]):
            dst = buf[k].ctypes.data
            at = (1 + pages[k]) * 4096
            got = 0
            while got < 4096:
                n = pread(fd, dst + got, 4096 - got, at + got)
                if n <= 0:
                    return k
                got += n
            if crc32(0, dst, 4096) != sums[pages[k]]:
                return k
        return -1

    return read_checked


@functools.lru_cache(maxsize=1)
def _row_planner():
    """The pages of a call's rows and where each row sits in them, compiled as the first reader is built:
    ``(rows, slots, nslots, rows_per_page, pages_per_row, stride) -> (pages, at, within, bad)``. ``pages``: the
    distinct pages the rows lie in, ascending (a row of several pages brings all of them); ``at[i]``: the index
    in ``pages`` of row ``i``'s first page; ``within[i]``: its first byte inside that page; ``bad``: -1, or the
    first ``i`` whose slot is outside ``0 .. nslots - 1`` (nothing else computed then)."""
    import numba

    @numba.njit(nogil=True, cache=False)
    def plan_rows(rows, slots, nslots, rows_per_page, pages_per_row, stride):
        n = rows.shape[0]
        at = np.empty(n, dtype=np.int64)
        within = np.zeros(n, dtype=np.int64)
        for i in range(n):
            if slots[i] < 0 or slots[i] >= nslots:
                return np.empty(0, dtype=np.int64), at, within, i
        first = np.empty(n, dtype=np.int64)
        for i in range(n):
            if rows_per_page:
                first[i] = rows[i] // rows_per_page
                within[i] = (rows[i] % rows_per_page) * stride
            else:
                first[i] = rows[i] * pages_per_row
        order = np.argsort(first)
        per = max(1, pages_per_row)
        distinct = 0
        for k in range(n):
            if k == 0 or first[order[k]] != first[order[k - 1]]:
                distinct += 1
        pages = np.empty(distinct * per, dtype=np.int64)
        j = -1
        for k in range(n):
            i = order[k]
            if k == 0 or first[i] != first[order[k - 1]]:
                j += 1
                for q in range(per):
                    pages[j * per + q] = first[i] + q
            at[i] = j * per
        return pages, at, within, -1

    return plan_rows


@functools.lru_cache(maxsize=1)
def _row_copier():
    """The copy of a round's rows out of the page buffer into their slots, compiled as the first reader is built:
    one slice copy a row, no index arrays built. The round holds pages ``lo .. hi - 1`` of the call's pages; a
    row whose first page is among them is copied (rows never straddle rounds: a round holds whole rows' pages)."""
    import numba

    @numba.njit(nogil=True, cache=False)
    def copy_rows(buf, at, within, lo, hi, dst, slots, nbytes):
        for i in range(at.shape[0]):
            if lo <= at[i] < hi:
                src = (at[i] - lo) * 4096 + within[i]
                dst[slots[i], :nbytes] = buf[src:src + nbytes]

    return copy_rows


@functools.lru_cache(maxsize=2)
def _compile_loops(threads: bool) -> None:
    """The planner and the copier (and with ``threads``, the threads' page loop where zlib is found) compiled for
    the types a reader's calls bring: numba compiles on a first call, seconds that belong to building a reader,
    not to its first step. (io_uring's loop is compiled when :func:`.uring.unavailable` is first asked.)"""
    rows, idx, dst = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros((1, PAGE), dtype=np.uint8)
    _row_planner()(rows, idx, 1, 1, 0, PAGE)
    _row_copier()(dst.reshape(-1), idx, idx, 0, 1, dst, idx, 1)
    loop = _compiled_reader() if threads else None
    if loop is not None:
        sums = np.zeros(1, dtype=np.uint32)
        sums.flags.writeable = False  # as a table file's sums are
        loop(-1, dst, np.zeros(0, dtype=np.int64), sums)  # no page: nothing read


class ReadTimeout(TableFileError):
    """Page reads of a table file did not complete within the reader's ``timeout_s`` (a disk or a filesystem
    that stopped answering): the message names the file and how many reads were still out."""


class PageReader:
    """Reads rows of ``file`` into slots of a host table with ``depth`` threads (see the module docstring).

    ``buffer_pages``: pages a round reads at most (its buffer: ``buffer_pages`` x 4 KiB, made once);
    ``timeout_s``: how long a round waits for its reads."""

    def __init__(self, file: TableFile, *, depth: int = 32, buffer_pages: int = 4096, timeout_s: float = 30.0,
                 engine: str = "auto"):
        if not isinstance(file, TableFile):
            raise TypeError(f"a page reader reads a TableFile, got {type(file).__name__}")
        for name, value, lo in (("depth", depth, 1), ("buffer_pages", buffer_pages, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
        why = uring.unavailable() if engine != "threads" else None
        if engine == "uring" and why is not None:
            raise ValueError(f"engine 'uring': io_uring cannot be used here ({why}); use engine 'threads' or 'auto'")
        if engine == "uring" and depth > 4096:
            raise ValueError(f"engine 'uring' keeps at most 4096 reads in flight, got depth {depth}")
        #: the engine in use: "uring" (this thread's io_uring) or "threads"
        self.engine = "uring" if engine != "threads" and why is None and depth <= 4096 else "threads"
        lay = file.layout
        self.file, self.depth, self.timeout_s = file, depth, float(timeout_s)
        per = max(1, lay.pages_per_row)
        self.buffer_pages = max(per, buffer_pages // per * per)  # whole rows a round
        self._buf: torch.Tensor | None = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._ring: uring.Ring | None = None
        self._ring_pid = 0
        self._state = threading.Lock()  # _closed and _busy, between a read through the ring and a close()
        self._busy = False
        self.pages_read = 0
        self._closed = False
        _compile_loops(self.engine == "threads")

    def _ready(self) -> tuple[torch.Tensor, cf.ThreadPoolExecutor]:
        if self._closed:
            raise TableFileError(f"the page reader of {self.file.path} was closed")
        if self._buf is None:
            self._buf = page_buffer(self.buffer_pages)
        if self._pool is None:  # (a reader that began with io_uring has its buffer already)
            self._pool = cf.ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="uvaple-read")
        return self._buf, self._pool

    def read_rows_into(self, rows: np.ndarray, dst: torch.Tensor, slots: np.ndarray) -> None:
        """Table rows ``rows`` (int64, distinct, inside the table) into ``dst[slots[i], :row_bytes]`` (``dst``:
        ``uint8 [n, >= row_bytes]`` on the host, a host table's bytes), every page read once and checked."""
        lay = self.file.layout
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if not isinstance(dst, torch.Tensor) or dst.dtype != torch.uint8 or dst.dim() != 2 or dst.device.type != "cpu" \
                or dst.shape[1] < lay.row_bytes:
            what = f"{tuple(dst.shape)} {dst.dtype} on {dst.device}" if isinstance(dst, torch.Tensor) else \
                type(dst).__name__
            raise ValueError(f"rows of {self.file.path} are read into a host uint8 [slots, >= {lay.row_bytes}] "
                             f"tensor (a host table's bytes), got {what}")
        if len(slots) != len(rows):
            raise ValueError(f"{len(rows)} rows were given {len(slots)} slots: one slot a row")
        if not len(rows):
            return
        pages, at, within, bad = _row_planner()(rows, slots, dst.shape[0], lay.rows_per_page, lay.pages_per_row,
                                                lay.stride)
        if bad >= 0:
            raise ValueError(f"slots {int(slots.min())} .. {int(slots.max())} are outside the {dst.shape[0]} rows "
                             "of the tensor read into")
        out = dst.numpy()
        for lo in range(0, len(pages), self.buffer_pages):
            round_pages = pages[lo:lo + self.buffer_pages]
            buf = self._read(round_pages)
            _row_copier()(buf.reshape(-1), at, within, lo, lo + len(round_pages), out, slots, lay.row_bytes)

    def _read(self, pages: np.ndarray) -> np.ndarray:
        """``pages`` (sorted, at most ``buffer_pages``) into the buffer, ``depth`` reads in flight (this thread's
        io_uring, or ``depth`` threads); the buffer's first ``len(pages)`` pages (a numpy view of it)."""
        if self.engine == "uring":
            return self._read_uring(pages)
        buf, pool = self._ready()
        n = len(pages)
        cuts = np.linspace(0, n, min(self.depth, n) + 1).astype(np.int64)
        try:
            futures = [pool.submit(self._read_share, pages[a:b], buf[a:b])
                       for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]
            done, pending = cf.wait(futures, timeout=self.timeout_s)
        except BaseException:  # an interrupt with reads in flight: the buffer and threads are theirs, never reused
            self._abandon()
            raise
        if pending:
            self._abandon()
            raise ReadTimeout(f"{self.file.path}: {len(pending)} of {len(futures)} page reads ({n} pages) had not "
                              f"completed after {self.timeout_s:g} s: the disk or its filesystem stopped answering; "
                              "nothing they read will be used")
        for f in futures:
            f.result()  # the first failure, named by the file (a short read, an I/O error, a sum)
        self.pages_read += n
        return buf.numpy()[:n]

    def _read_uring(self, pages: np.ndarray) -> np.ndarray:
        """``pages`` into the buffer through this thread's ring (see :mod:`.uring`); a page that failed there, and
        those after it, read again by the interpreted path, which names what failed. A ring the kernel stops
        taking entries from is left to its reads, and this round and the reader's later ones go to threads."""
        with self._state:  # a close() from another thread meanwhile leaves the ring to this read, which closes it
            if self._closed:
                raise TableFileError(f"the page reader of {self.file.path} was closed")
            self._busy = True
        try:
            if self._buf is None:
                self._buf = page_buffer(self.buffer_pages)
            if self._ring is not None and self._ring_pid != os.getpid():  # a forked child: the parent's ring is not
                self._ring.close()  # its own (both would submit into it); closing the child's copy leaves the parent's
                self._ring = None
            if self._ring is None:
                try:
                    self._ring, self._ring_pid = uring.Ring(min(self.depth, 4096)), os.getpid()
                except OSError:  # no ring now (a limit on locked memory or on rings): threads from now on
                    self.engine = "threads"
            buf, r, n, state = self._buf, self._ring, len(pages), np.zeros(uring.STATE, dtype=np.int64)
            got = -1
            if r is not None:
                args = (r.fd, r.sq, r.sq_at, r.cq, r.cq_at, r.sqes, self.file.fileno(), buf.numpy(),
                        np.ascontiguousarray(pages, dtype=np.int64), self.file.page_sums, self.depth,
                        int(self.timeout_s * 1e9), _SLICE_NS, state)
                try:
                    got = uring.PENDING
                    while got == uring.PENDING:  # between two slices the interpreter runs signal handlers
                        got = uring.read_loop()(*args)
                except BaseException:  # an interrupt (Ctrl-C): where reads are in flight, ring and buffer are theirs
                    if uring.began_with_reads(state):
                        uring.abandon(r, buf)  # the locals: a close() meanwhile dropped the reader's own references
                        self._ring = self._buf = None
                    raise
            if got in (uring.TIMED_OUT, uring.REFUSED):
                # reads in flight: the ring and the buffer are theirs now; the next round makes new ones
                uring.abandon(r, buf)
                self._ring = self._buf = None
                if got == uring.TIMED_OUT:
                    raise ReadTimeout(f"{self.file.path}: {uring.reads_in_flight(state)} of {n} page reads (up to "
                                      f"{self.depth} in flight through io_uring) had not completed after "
                                      f"{self.timeout_s:g} s: the disk or its filesystem stopped answering; nothing "
                                      "they read will be used")
                self.engine = "threads"  # the kernel stopped taking entries (memory, a limit): threads from now on
        finally:
            with self._state:
                self._busy = False
                if self._closed:
                    self._close_ring()
        if self.engine == "threads":
            return self._read(pages)
        if got >= 0:
            self.file.read_pages(pages[got:], buf[got:n])  # raises the file's named error, or reads them whole
        self.pages_read += n
        return buf.numpy()[:n]

    def _close_ring(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:  # every read of a returned round completed: nothing is in flight
            ring.close()

    def _read_share(self, pages: np.ndarray, buf: torch.Tensor) -> None:
        """One thread's pages into its part of the buffer (compiled where it can be; a page that fails there, and
        those after it, by the interpreted path, which names what failed)."""
        loop = _compiled_reader()
        first = 0
        if loop is not None:
            bad = loop(self.file.fileno(), buf.numpy(), pages, self.file.page_sums)
            if bad < 0:
                return
            first = bad
        self.file.read_pages(pages[first:], buf[first:])

    def _abandon(self) -> None:
        """Leave the round's buffer and threads to reads that did not return: the next call makes new ones."""
        pool, self._pool, self._buf = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the threads (after reads in progress) and drop the buffer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        pool, self._pool, self._buf = self._pool, None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._state:
            if not self._busy:  # else the read in progress closes it when it returns
                self._close_ring()

    def __enter__(self) -> PageReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

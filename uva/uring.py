"""io_uring from the calling thread: a table file's pages read with many in flight, checked, no other thread.

The kernel's ABI (``linux/io_uring.h``), nothing else: :class:`Ring` sets up a ring with ``io_uring_setup`` and
maps its submission ring, completion ring and submission entries as numpy views; :func:`read_loop` is a compiled
loop (numba, ``nogil``; ``io_uring_enter``, ``clock_gettime`` and zlib's ``crc32`` called through ctypes) that
keeps up to ``depth`` page reads (``IORING_OP_READ``, 64-byte entries) in flight, reaps each completion (16-byte
entries) as it arrives, submits the next read at once and checks each page against its sum. It waits for
completions by reading the completion ring's tail between two clock reads: a busy wait, no sleep to wake from
(a sleeping thread takes long to wake on a server's idle cores), bounded by the round's deadline. The loop
returns to its caller every ``slice_ns`` with its state kept (:data:`PENDING`), so the interpreter can run a
signal's handler between two slices: Ctrl-C stops a round that waits on a disk gone silent at once, not at its
deadline (its reads in flight are then left to it like a timed-out round's).

Why this and not threads: see :mod:`.page_reader` (which uses this where it can).

What may write where: the kernel writes each read's page into the buffer page the caller named for it and
nowhere else. A loop that stops early (a read short, failed or unlike its sum) stops submitting and reaps every
read still in flight before it returns, so no read lands after it; a loop that stops at its deadline has reads
in flight, and the caller must leave their buffer and the ring to them (:func:`abandon`: kept, never reused or
freed, until the process ends).

:func:`unavailable` says why io_uring cannot be used here (an old kernel, ``kernel.io_uring_disabled``, a
container's seccomp filter, no zlib library, no numba), once per process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import threading

import numpy as np

__all__ = ["Ring", "read_loop", "unavailable", "abandon", "began_with_reads", "reads_in_flight", "TIMED_OUT", "REFUSED",
           "PENDING", "STATE"]

PAGE = 4096
_SETUP, _ENTER = 425, 426  # io_uring_setup, io_uring_enter: the same numbers on x86_64 and aarch64
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_READ = 22  # IORING_OP_READ (Linux 5.6)
TIMED_OUT = -2  # read_loop: the round's reads had not all completed by its deadline; some are still in flight
REFUSED = -3  # read_loop: io_uring_enter did not take every entry; reads may be in flight, the ring is not reused
PENDING = -4  # read_loop: its slice passed with reads still to complete; call it again with the same state
STATE = 8  # read_loop's state: int64 words, zeros before a round's first call; named below
# the state's words: 0 and 1 the clock's (seconds, nanoseconds); then the reads in flight at the last return,
# the round's submitted and completed counts (equal: the ring is idle), its first failed page, its deadline, and
# whether it began
_S_IN_FLIGHT, _S_SUBMITTED, _S_COMPLETED, _S_BAD, _S_DEADLINE, _S_BEGUN = 2, 3, 4, 5, 6, 7

_ABANDONED: list = []  # rings and buffers left to reads that did not complete (see the module docstring)
_ABANDONED_LOCK = threading.Lock()


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class Ring:
    """One io_uring of at least ``entries`` submission slots (a power of two), its rings mapped as numpy views.
    :meth:`close` unmaps and closes it (a ring whose reads did not all complete goes to :func:`abandon`
    instead)."""

    def __init__(self, entries: int):
        if isinstance(entries, bool) or not isinstance(entries, int) or not 1 <= entries <= 4096:
            raise ValueError(f"a ring holds 1 to 4096 entries, got {entries!r}")
        params = (ctypes.c_uint32 * 30)()  # struct io_uring_params, 120 bytes
        fd = _libc().syscall(_SETUP, 1 << (entries - 1).bit_length(), ctypes.byref(params))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup({entries}): {os.strerror(err)}")
        self.fd = fd
        p = np.frombuffer(params, dtype=np.uint32)
        sq_entries, cq_entries = int(p[0]), int(p[1])
        sq_off, cq_off = p[10:20], p[20:30]  # struct io_sqring_offsets, io_cqring_offsets
        self._maps: list[mmap.mmap] = []
        try:
            sq = np.frombuffer(self._map(int(sq_off[6]) + sq_entries * 4, _OFF_SQ_RING), dtype=np.uint32)
            cq = np.frombuffer(self._map(int(cq_off[5]) + cq_entries * 16, _OFF_CQ_RING), dtype=np.uint32)
            sqes = np.frombuffer(self._map(sq_entries * 64, _OFF_SQES), dtype=np.uint64).reshape(sq_entries, 8)
        except BaseException:
            self.close()
            raise
        self.sq, self.cq, self.sqes, self.entries = sq, cq, sqes, sq_entries
        # head, tail, ring mask and the entries' start, as indices into each ring's u32 view
        self.sq_at = np.array([sq_off[0], sq_off[1], sq_off[2], sq_off[6]], dtype=np.int64) // 4
        self.cq_at = np.array([cq_off[0], cq_off[1], cq_off[2], cq_off[5]], dtype=np.int64) // 4

    def _map(self, size: int, offset: int) -> mmap.mmap:
        m = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    def close(self) -> None:
        """Unmap and close (idempotent). The views made from the maps must be dropped first; a map still
        viewed is left to the process (its memory is the kernel's ring, freed when the last user goes)."""
        self.sq = self.cq = self.sqes = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def abandon(ring: Ring, buf) -> None:
    """Leave ``ring`` and ``buf`` to reads still in flight: kept until the process ends, never reused."""
    with _ABANDONED_LOCK:
        _ABANDONED.append((ring, buf))


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the io_uring reader cannot be used in this process, or None (asked once)."""
    if ctypes.util.find_library("z") is None:
        return "zlib's library is not found (the pages' sums are checked with it)"
    try:
        ring = Ring(8)
    except OSError as e:
        return str(e)
    try:  # compiled here, once: a loop that cannot be made is known before a reader relies on it
        buf, sums = np.zeros((1, PAGE), dtype=np.uint8), np.zeros(1, dtype=np.uint32)
        sums.flags.writeable = False  # as a table file's sums are: the types a reader's call brings, compiled once
        read_loop()(ring.fd, ring.sq, ring.sq_at, ring.cq, ring.cq_at, ring.sqes, 0, buf, np.zeros(0, dtype=np.int64),
                    sums, 1, 1, 1, np.zeros(STATE, dtype=np.int64))
    except ImportError as e:
        return f"numba cannot be imported: {e}"
    except Exception as e:  # noqa: BLE001 - any failure to build the loop means: not here
        return f"the io_uring loop cannot be compiled here ({type(e).__name__}: {e})"
    finally:
        ring.close()
    return None


@functools.lru_cache(maxsize=1)
def fences():
    """``(acquire, release)``: memory fences callable from a numba loop (no code on x86-64 but an order the
    compiler keeps; a barrier on aarch64), the orders a ring's indices are read and written in."""
    from numba.core import types
    from numba.extending import intrinsic

    def fence(order: str):
        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, signature, args):
                builder.fence(order)
                return context.get_dummy_value()
            return types.void(), codegen
        return emit

    return fence("acquire"), fence("release")


def began_with_reads(state: np.ndarray) -> bool:
    """Whether a round whose ``state`` this is may have reads in flight (it began, and as of the loop's last return
    not every submitted read had completed): its ring and buffer are then the reads' (:func:`abandon`)."""
    return bool(state[_S_BEGUN]) and state[_S_SUBMITTED] != state[_S_COMPLETED]


def reads_in_flight(state: np.ndarray) -> int:
    """The reads a round had in flight at the loop's last return (the message of a round that timed out)."""
    return int(state[_S_IN_FLIGHT])


@functools.lru_cache(maxsize=1)
def read_loop():
    """The compiled loop (numba imports and compiles slowly: made on first use):

    ``loop(ring_fd, sq, sq_at, cq, cq_at, sqes, fd, buf, pages, sums, depth, timeout_ns, slice_ns, ts) -> int``:
    data page ``pages[k]`` of the table file open as ``fd`` into ``buf[k]`` (``uint8 [>= len(pages), 4096]``,
    page-aligned), at most ``depth`` reads in flight (and at most the ring's entries), each checked against
    ``sums``. Returns -1 when every page was read whole and matched its sum; else ``k``, the first page (in
    ``pages``' order) that did not, after every read in flight completed; :data:`PENDING` when ``slice_ns`` passed
    in this call with reads still to complete (call again with the same arguments: ``ts`` keeps the round);
    :data:`TIMED_OUT` when the reads had not all completed ``timeout_ns`` after the round's first call, or
    :data:`REFUSED` when ``io_uring_enter`` did not take every entry given (in these three, reads may still be in
    flight: :func:`began_with_reads`, :func:`reads_in_flight`; in the last two, :func:`abandon`). ``ts``: int64
    ``[STATE]``, zeros before the round's first call, its words named by ``_S_*`` above.

    The completion ring is read as liburing reads it: its tail with acquire order (the entries after it are the
    kernel's writes that the tail published), its head stored with release order (the entries read before their
    slots go back); the submission tail with release order after the entries it publishes.
    """
    import numba

    libc = _libc()
    enter = libc.syscall
    enter.restype = ctypes.c_long
    enter.argtypes = [ctypes.c_long] * 7
    clock = libc.clock_gettime
    clock.restype, clock.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]
    crc32 = ctypes.CDLL(ctypes.util.find_library("z")).crc32
    crc32.restype, crc32.argtypes = ctypes.c_ulong, [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_uint]

    acquire, release = fences()

    @numba.njit(nogil=True, cache=False)
    def loop(ring_fd, sq, sq_at, cq, cq_at, sqes, fd, buf, pages, sums, depth, timeout_ns, slice_ns, ts):
        n = pages.shape[0]
        sq_mask = np.int64(sq[sq_at[2]])  # ring indices in int64 (numba would make uint32 and int64 a float)
        cq_mask = np.int64(cq[cq_at[2]])
        depth = min(depth, sq_mask + 1)  # never more in flight than the completion ring holds (twice the entries)
        clock(1, ts.ctypes.data)  # CLOCK_MONOTONIC
        now = ts[0] * 1_000_000_000 + ts[1]
        if ts[_S_BEGUN] == 0:  # the round's first call
            ts[_S_SUBMITTED] = 0
            ts[_S_COMPLETED] = 0
            ts[_S_BAD] = n  # the first page that failed (n: none)
            ts[_S_DEADLINE] = now + timeout_ns
            ts[_S_BEGUN] = 1
        submitted = ts[_S_SUBMITTED]
        completed = ts[_S_COMPLETED]
        bad = ts[_S_BAD]
        deadline = ts[_S_DEADLINE]
        slice_end = now + slice_ns
        while completed < submitted or (submitted < n and bad == n):
            tail = np.int64(sq[sq_at[1]])
            new = 0
            while bad == n and submitted < n and submitted - completed < depth:
                slot = tail & sq_mask
                e = sqes[slot]
                e[0] = np.uint64(_OP_READ) | (np.uint64(fd & 0xFFFFFFFF) << np.uint64(32))  # opcode .. fd
                e[1] = np.uint64((1 + pages[submitted]) * PAGE)  # the file's offset: page 0 is the header
                e[2] = np.uint64(buf[submitted].ctypes.data)
                e[3] = np.uint64(PAGE)  # len; rw_flags 0
                e[4] = np.uint64(submitted)  # user_data: the page's place in ``pages``
                e[5] = 0
                e[6] = 0
                e[7] = 0
                sq[sq_at[3] + slot] = np.uint32(slot)
                tail = (tail + 1) & 0xFFFFFFFF
                submitted += 1
                new += 1
            if new:
                release()
                sq[sq_at[1]] = np.uint32(tail)  # the entries, then the tail that publishes them; then the call
                if enter(_ENTER, ring_fd, new, 0, 0, 0, 0) != new:
                    ts[_S_IN_FLIGHT] = submitted - completed
                    ts[_S_SUBMITTED] = submitted
                    ts[_S_COMPLETED] = completed
                    return REFUSED  # entries not taken: the ring's state is not known, reads may be in flight
            clock(1, ts.ctypes.data)  # also makes each read of the completion tail below a fresh load
            now = ts[0] * 1_000_000_000 + ts[1]
            head = np.int64(cq[cq_at[0]])
            ctail = np.int64(cq[cq_at[1]])
            acquire()
            if head == ctail:
                if now > deadline:
                    ts[_S_IN_FLIGHT] = submitted - completed
                    ts[_S_SUBMITTED] = submitted
                    ts[_S_COMPLETED] = completed
                    return TIMED_OUT
                if now > slice_end:  # back to the interpreter for its signals; the round goes on from ts
                    ts[_S_IN_FLIGHT] = submitted - completed
                    ts[_S_SUBMITTED] = submitted
                    ts[_S_COMPLETED] = completed
                    ts[_S_BAD] = bad
                    return PENDING
                continue
            while head != ctail:
                at = cq_at[3] + (head & cq_mask) * 4
                k = np.int64(cq[at]) | (np.int64(cq[at + 1]) << 32)
                res = np.int32(cq[at + 2])
                if k < bad and (res != PAGE or crc32(0, buf[k].ctypes.data, PAGE) != sums[pages[k]]):
                    bad = k
                head = (head + 1) & 0xFFFFFFFF
                completed += 1
            release()
            cq[cq_at[0]] = np.uint32(head)  # the entries read, then the head that gives their slots back
        ts[_S_IN_FLIGHT] = 0  # every read completed: the ring is idle
        ts[_S_SUBMITTED] = submitted
        ts[_S_COMPLETED] = completed
        return -1 if bad == n else bad

    return loop

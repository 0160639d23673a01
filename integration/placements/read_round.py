"""``ReadRound``: the read-aheads of several disk lookups at once, one thread each, so that their reads are in
flight together.

A model with a disk table a layer (Qwen4Exp's PLE layers: one table file each) reads each layer's misses in that
layer's call, one after the other, and the host waits for each layer's reads before it launches that layer's
gather. Once the host knows every layer's ids of a step (the n-gram hash of the step's tokens, computed for
all layers at once), :meth:`ReadRound.prefetch` hands each lookup its ids
(:meth:`~uvaple.integration.placements.disk.DiskLookup.prefetch`) on a thread of its own: each plans its step and
reads its misses through its own reader, and the readers' loops (io_uring, or ``pread`` threads) and the cache's
sweep run compiled without the interpreter lock, so every table's reads are in flight at once. The layers' calls
then find their rows cached and launch their gathers without reading.

No CUDA work is done here and no stream is touched: the lookups' gathers stay in the caller's stream, in the
calls' order. The threads are made at the first round and kept (``close()`` ends them).

Failures. The round waits for every read-ahead, even through an interrupt, before it raises (a thread still
reading when the caller moved on would race the next round for its lookup); then it raises the interrupt, or
the first error in the lookups' order (a full cache, a failed read: the lookup's own named error). A lookup whose
read-ahead failed holds none of its rows; the others keep theirs, and their calls use them. In a forked child
the threads are the parent's: the round is :class:`~uvaple.integration.errors.LookupForkedError`, never a hang.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

from ..errors import BackendClosed, LookupForkedError

__all__ = ["ReadRound"]


class ReadRound:
    """Read-aheads of ``lookups`` (each with ``prefetch(ids)``, such as
    :class:`~uvaple.integration.placements.disk.DiskLookup`) in one round (see the module docstring)."""

    def __init__(self, lookups) -> None:
        self.lookups = tuple(lookups)
        if not self.lookups:
            raise ValueError("a read round needs at least one lookup")
        if len({id(lk) for lk in self.lookups}) != len(self.lookups):
            raise ValueError("a read round reads ahead through each lookup once: a lookup given twice would let its "
                             "first read-ahead go for the second")
        for lk in self.lookups:
            if not callable(getattr(lk, "prefetch", None)):
                raise TypeError(f"a read round reads ahead through lookups that can (the disk placement's), not "
                                f"{type(lk).__name__}")
        self._pid = os.getpid()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # one round at a time; close() waits for it
        self._closed = False

    def prefetch(self, ids) -> list[int]:
        """Each lookup's read-ahead of its ``ids`` (a sequence, one host id tensor per lookup, in their order),
        together; returns the rows each read. Raises after every one has ended (see the module docstring)."""
        ids = list(ids)
        if len(ids) != len(self.lookups):
            raise ValueError(f"a read round of {len(self.lookups)} lookups was given {len(ids)} id tensors")
        if os.getpid() != self._pid:
            raise LookupForkedError(f"this read round was made in process {self._pid}, and this is a forked child "
                                    f"(pid {os.getpid()}): its threads are the parent's. Build the lookups (and a "
                                    "round of them) in the child")
        with self._lock:
            if self._closed:
                raise BackendClosed("this read round was closed")
            if len(self.lookups) == 1:
                return [self.lookups[0].prefetch(ids[0])]
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(len(self.lookups), thread_name_prefix="uvaple-read-round")
            futures, interrupt = [], None
            try:
                for lk, i in zip(self.lookups, ids, strict=True):
                    futures.append(self._pool.submit(lk.prefetch, i))
            except BaseException as e:  # an interrupt, or a pool that takes no more work: those submitted still end
                interrupt = e
            while True:  # every read-ahead ends (each is bounded by its reader's and its cache's timeouts)
                try:
                    cf.wait(futures)
                    break
                except BaseException as e:  # an interrupt: raised once the threads are done with their lookups
                    interrupt = interrupt or e
            if interrupt is not None:
                raise interrupt
            for f in futures:
                if f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futures]

    def close(self) -> None:
        """End the round's threads (after a round in progress). Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None and os.getpid() == self._pid:
            pool.shutdown(wait=True)

    def __enter__(self) -> ReadRound:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""The non-blocking read of a lookup's device counters: :class:`CounterSnapshots`.

``GatherLookup.progress()`` reads its int64 device counters through it: copies to pinned host memory on
a side stream the lookup owns, the newest completed one returned (``event.query()``, never a
synchronisation) with its age. Stale by at most ``age_s``; never torn. The class docstring states the
race with the kernels' atomics and why a value is never torn. Reads touch only their own stream and
events, so they may run during a CUDA-graph capture on any thread (``RelaxedCaptureMode``, from
:mod:`uvaple.kernels.capture`); a forked child never frees the pinned buffers (``fork.keep_in_child``).
"""

from __future__ import annotations

import time

import torch

from uvaple.kernels.capture import RelaxedCaptureMode

from ..fork import ForkSafeLock, keep_in_child

__all__ = ["CounterSnapshots"]


class CounterSnapshots:
    """Double-buffered, non-blocking snapshots of an int64 counter tensor (a lookup's device counters).

    ``read()`` returns ``(values, age_s)``: the newest snapshot whose copy has completed, and the seconds
    since that copy was enqueued. On CUDA each call first polls the copy in flight (``event.query()``);
    if it has completed it becomes the snapshot returned, and the other buffer receives the next copy
    (``copy_(non_blocking=True)`` into pinned memory on a side stream owned here, then an event record).
    A copy still in flight is left alone: there is only ever one, and the buffer returned is never the
    one being written. Nothing waits: not the host, and not the side stream, which depends on nothing
    of the model's (one wait, at construction, for the counters' own zeroing). Everything is allocated
    here; a read allocates no device or pinned memory. On the CPU a read is a plain copy, current.

    Under CUDA graph capture on this thread's current stream a read enqueues, records and queries nothing:
    it returns the last snapshot. Capture on another thread is unaffected (:class:`RelaxedCaptureMode`).

    The race. Kernels on any stream add to the counters with relaxed atomics while the copy engine reads
    them. A snapshot may miss the adds of kernels still running (stale, by at most ``age_s``), and two
    counters of one snapshot may be from slightly different moments (``rows`` may include a call that
    ``lookups`` does not yet). A single value is never torn: the counters are naturally aligned 8-byte
    words (the caching allocator aligns blocks to 512 B), the copy engine reads each word whole (in
    32-byte sectors, through L2, where the atomics are performed), and each atomic updates its word whole.
    Each counter only grows, and the snapshots of one reader are in stream order, so successive reads
    never go back.
    """

    def __init__(self, counters: torch.Tensor) -> None:
        if counters.dtype != torch.int64 or counters.dim() != 1 or not counters.is_contiguous():
            raise ValueError(f"counters must be a contiguous 1-D int64 tensor, got {counters!r}")
        self._src = counters
        self._device = counters.device
        self._synchronous = not counters.is_cuda
        n = counters.numel()
        # normal tensors even when built under inference mode: a read may come from any thread (a scrape's
        # is not in inference mode), and only a normal tensor may be written in place there
        with torch.inference_mode(False):
            self._bufs = tuple(torch.zeros(n, dtype=torch.int64, device="cpu", pin_memory=counters.is_cuda)
                               for _ in range(2))
        self._views = tuple(b.numpy() for b in self._bufs)  # host reads of the pinned words: no torch op
        now = time.monotonic()
        # buffer 0 starts as the first snapshot: zeros, exact at construction (the counters start at 0)
        self._taken = [now, now]
        self._published = 0
        self._inflight: int | None = None
        self._lock = ForkSafeLock()  # reads from several threads (a scrape and a health check)
        self._stream = None
        self._events: tuple = (None, None)
        if counters.is_cuda:
            keep_in_child(self)  # its pinned buffers, stream and events are never freed in a forked child
            with torch.cuda.device(self._device):
                self._stream = torch.cuda.Stream(self._device)  # a pool stream: non-blocking, never the legacy one
                zeroed = torch.cuda.Event()
                zeroed.record()  # the current stream, after the counters' zeroing
                self._stream.wait_event(zeroed)  # the only wait of the side stream, once
                self._events = (torch.cuda.Event(), torch.cuda.Event())
                for ev in self._events:
                    ev.record(self._stream)  # created now, not during a read
            counters.record_stream(self._stream)  # freed only after the side stream's last copy of them

    def read(self) -> tuple[list[int], float]:
        """``(values, age_s)`` of the newest completed snapshot; polls and enqueues, never waits."""
        with self._lock:
            self._advance()
            i = self._published
            values = self._views[i].tolist()
            age = time.monotonic() - self._taken[i]
        return values, age

    def _advance(self) -> None:
        if self._synchronous:
            k = 1 - self._published
            self._taken[k] = time.monotonic()
            self._start_copy(k)
            self._published = k
            return
        with RelaxedCaptureMode():
            try:
                capturing = torch.cuda.is_current_stream_capturing()
            except RuntimeError:  # the capture status itself could not be read: do nothing this time
                capturing = True
            if capturing:
                return  # this thread's stream is capturing: nothing enqueued; the last snapshot stands
            j = self._inflight
            if j is not None:
                if not self._copy_done(j):
                    return  # the previous snapshot stands; its buffer is not the one being written
                self._published, self._inflight = j, None
            k = 1 - self._published
            self._taken[k] = time.monotonic()  # before the enqueue: the copy runs at or after this time
            self._start_copy(k)
            self._inflight = k

    def _start_copy(self, k: int) -> None:
        """Copy the counters into buffer ``k`` (enqueued on the side stream; at once on the CPU)."""
        if self._synchronous:
            self._bufs[k].copy_(self._src)
            return
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            self._bufs[k].copy_(self._src, non_blocking=True)
            self._events[k].record(self._stream)

    def _copy_done(self, k: int) -> bool:
        return bool(self._events[k].query())

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two preallocated host buffers (for tests: they are reused, never reallocated)."""
        return self._bufs


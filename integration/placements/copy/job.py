"""A copy job: one admitted lookup of the copy placement (:class:`CopyJob`), and its state machine.

Design
------
``CopyBackend.submit`` admits a job into a free slot (:mod:`.slots`), which it holds until every event
recorded for it has completed. Its state moves forward only, each transition stamped with its time in one
store (``_stage = (state, since)``, read without the lock by ``health()``)::

    pending ──(ids ready, taken by the worker or run inline)──> running ──> launching ──> launched
       │                                                          │            │
       └── cancel() / close() / ids timeout / worker death ──> failed <────────┘ (gather, launch fails)

``pending`` is health's stage ``queued`` (``ids`` while its CUDA ids are owed to the host), ``running``
is ``gather``, ``launching`` ``launch``, ``launched`` ``copy`` until its device copy completes. A job
reaches ``launched`` or ``failed`` exactly once (``_host_done``, a ``threading.Event`` of its own).

Seed rules kept here
--------------------
Seed 000, rule 3 (ownership). CPU ids are snapshotted into the slot at submit (the caller may reuse its
ids tensor at once). CUDA ids are copied to the host on the backend's d2h stream after the submit point,
i.e. later than the caller's stream: :meth:`CopyJob._take_ids` therefore makes the caller's current
stream wait on the job's ids-copy event (``wait_event``, no host sync), so work the caller enqueues
after ``submit`` -- the next pass rewriting a persistent ``input_ids`` buffer -- is ordered after the copy
and the job gathers the ids as they were at submit (write-after-read). Chosen over a snapshot into a
per-slot device buffer on the caller's stream: no device memory, no extra kernel; the cost is that the
caller's later work waits for an ``n * 8``-byte device-to-host copy (microseconds). It cannot deadlock:
the ids copy depends only on earlier submit points, never on the worker or on a rows copy. CUDA ids, the
caller's ``out`` and the slot's staging/device buffers are referenced by the job until every event
recorded for it has completed.

Streams (seed 000's circular wait). The ids copy goes on a stream of its own, never on the copy stream:
there pass B's ids copy (waiting for B's submit point) would sit in front of pass A's rows copy, and B's
submit point may come after the model waited for A's rows. The ids stream holds only ids copies, each
behind its own pass's submit point.

Seed 000, rule 4 (failures). Every job has its own result slot and ``threading.Event``; an exception in
job B's gather or launch is stored on B and raised by ``B.wait()``, whatever state A is in.
``wait()`` checks, under the lock, that the copy-done event still belongs to the job (rule 2).

Seed 000, rule 5 (cancellation). ``cancel()`` fails a job whose gather has not started with
:class:`CopyJobCancelled` (True); a job already being gathered, launched or failed is not cancelled
(False).

Seed 004 (WAR), the caller's side: reuse an ``out`` buffer only for a job submitted after the previous
job using it was waited on and its readers were enqueued (the copy into it waits for the submit point:
:mod:`.worker`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ...errors import CopyJobCancelled, CopyTimeout

__all__ = ["CopyJob", "PENDING", "RUNNING", "LAUNCHING", "LAUNCHED", "FAILED", "STAGES"]

PENDING, RUNNING, LAUNCHING, LAUNCHED, FAILED = "pending", "running", "launching", "launched", "failed"
# health()'s name of where a job is (pending: "ids" while its CUDA ids are owed to the host)
STAGES = {PENDING: "queued", RUNNING: "gather", LAUNCHING: "launch", LAUNCHED: "copy", FAILED: "failed"}


class CopyJob:
    """One admitted lookup. ``wait()`` returns its rows; ``cancel()`` abandons it before its copy."""

    def __init__(self, backend, seq: int) -> None:
        self._backend = backend  # the CopyBackend that admitted it
        self.seq = seq
        self._stage: tuple[str, float] = (PENDING, time.monotonic())  # (state, since): read without the lock
        self._exc: BaseException | None = None
        self._host_done = threading.Event()
        self._slot = None  # its slots.Slot, from admission until the backend closes
        self._recorded: list[Any] = []  # events recorded for this job (all must complete before reuse)
        self._copy_complete = False  # set when the slot was reclaimed (all events completed)
        self._submitted_at = time.monotonic()
        # request
        self._n = 0
        self._ids_dtype: torch.dtype = torch.int64
        self._device_ids: tuple | None = None  # CUDA ids (and their flat view), held until copied
        self._ids_deadline = 0.0
        self._out: torch.Tensor | None = None
        self._byte_start = 0
        self._ncols = 0
        self._scale: torch.Tensor | None = None
        self._scale_on_cpu = False
        self._oob_row0 = False
        self._inference = False  # the submitter's inference mode (thread-local): the launch runs in it

    @property
    def done(self) -> bool:
        """True once the job's copy was launched (``wait`` will not block) or it failed."""
        return self._host_done.is_set()

    @property
    def state(self) -> str:
        return self._state

    @property
    def _state(self) -> str:
        return self._stage[0]

    @_state.setter
    def _state(self, state: str) -> None:
        self._stage = (state, time.monotonic())  # one store: health() never sees a state with another's time

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Wait (on the host, bounded) until the job's copy was launched; return ``out`` ``[*ids.shape, ncols]``.

        Makes the *current* stream wait on this job's copy-done event: no host/GPU synchronisation.
        Raises the job's own failure (:class:`CopyJobFailed`, :class:`CopyJobCancelled`,
        :class:`BackendClosed`, :class:`CopyTimeout` for its ids) or :class:`CopyTimeout` when the worker did
        not launch it within ``timeout`` seconds (default: the backend's ``wait_timeout``); the job then
        stays in flight — ``cancel()`` it or wait again.
        """
        b = self._backend
        if b._forked:
            b._check_usable()  # a forked child: nobody here runs the job (its event is the parent's)
        t = b.wait_timeout if timeout is None else timeout
        if not self._host_done.wait(t):
            raise CopyTimeout(
                f"copy job {self.seq} was not launched within {t:.3g} s (state {self._state}); the copy "
                f"worker is stuck or overloaded — check CopyBackend.stats(), cancel() the job or wait again")
        if self._exc is not None:
            raise self._exc
        with b._cond:
            if not self._copy_complete:
                slot = self._slot
                assert slot is not None and slot.job is self
                b._ops.wait_event(b._ops.current_stream(), slot.done_event)
        assert self._out is not None
        return self._out

    def cancel(self) -> bool:
        """Abandon the job if its gather has not started (True); False when it is being gathered, was
        launched or failed (it then completes or fails as it would have).

        A cancelled job's ``wait()`` raises :class:`CopyJobCancelled`; its slot is released once every
        event recorded for it has completed.
        """
        b = self._backend
        if b._forked:
            b._check_usable()
        with b._cond:
            if self._state == PENDING and self in b._pending:
                b._pending.remove(self)
                self._fail_locked(CopyJobCancelled(f"copy job {self.seq} was cancelled"))
                b._counts["cancelled"] += 1
                return True
            return False

    def _fail_locked(self, exc: BaseException) -> None:
        """Fail the job with ``exc`` (under the backend's lock): ``wait()`` raises it from now on."""
        b = self._backend
        self._state = FAILED
        self._exc = exc
        self._host_done.set()
        b._counts["failed"] += 1
        b._cond.notify_all()

    def _take_ids(self, ids: torch.Tensor, device_ids: bool) -> None:
        """Record the submit point on the caller's stream and take the job's own copy of ``ids``: a snapshot
        into the slot (CPU ids), or a copy on the d2h stream that the caller's later work waits for (CUDA
        ids). Called at submit, after admission, with ``_n`` set."""
        b, slot, n = self._backend, self._slot, self._n
        ops = b._ops
        # flatten before the submit event: a non-contiguous ids tensor is copied on the caller's stream
        flat = ids.reshape(-1)
        caller = ops.current_stream()
        ops.record(slot.submit_event, caller)
        self._recorded.append(slot.submit_event)
        isz = ids.element_size()
        ids_dst = slot.ids_buf[: n * isz].view(ids.dtype)
        if device_ids:
            self._device_ids = (ids, flat)  # owned by the job until the ids copy has completed

            def d2h(dst=ids_dst, src=flat) -> None:
                dst.copy_(src, non_blocking=True)

            ops.wait_event(b._d2h_stream, slot.submit_event)
            try:
                ops.enqueue(b._d2h_stream, d2h)
            finally:
                b._record(self, slot, slot.ids_event, b._d2h_stream)
            # WAR on the caller's ids: the copy above runs after the submit point, later than the
            # caller's stream; order the caller's later work (e.g. the next pass rewriting its
            # input_ids buffer) after it. Device-side only; depends on no worker action.
            ops.wait_event(caller, slot.ids_event)
            self._ids_deadline = time.monotonic() + b.ids_timeout
        elif n:
            ids_dst.copy_(flat)  # snapshot: the caller may reuse its ids at once

    def __repr__(self) -> str:
        return f"CopyJob(seq={self.seq}, state={self._state}, n={self._n})"

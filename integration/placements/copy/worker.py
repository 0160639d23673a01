"""The copy placement's worker: the thread that gathers and launches admitted jobs, and its exit hook.

Design
------
One worker thread per backend (``uvaple-copy-worker``, a daemon) runs :func:`worker_loop`: turns of
``CopyBackend._worker_turn``, each taking the first *ready* job (CPU ids, or CUDA ids whose copy to the
host has completed: ``event.query()``, polled with a bounded back-off, never a blocking wait on the GPU),
gathering its rows on the CPU into the job's pinned staging slot (:mod:`.policy`), and launching its
host-to-device copy on the backend's copy stream (``_launch``). ``_dispatch`` hands a submitted job over:
to the worker, or, for small CPU-ids lookups, to the caller's own thread (``lookup`` blocks for them
anyway: same protocol, two thread hand-offs fewer). The methods here are :class:`CopyWorker`'s, a part of
``CopyBackend`` (its state, its one lock ``_cond``).

Seed rules kept here
--------------------
Seed 000, streams. The worker never launches a copy ahead of its job's ids: a job is taken only once its
ids are on the host, and its copy is enqueued on the copy stream after a wait on its own submit point.

Seed 000, rule 4 (failures). Jobs whose ids are not ready yet do not block later jobs (the worker takes
the first ready job). A failure in a job's gather or launch is stored on that job. A crashing worker fails
every pending job and closes the backend; a job whose submit overlaps the worker's death is failed at
once with :class:`BackendClosed` (``__cause__``: the worker's error), not left to time out. A
``KeyboardInterrupt``/``SystemExit`` in a gather the caller's thread runs (inline ``lookup``) fails that
job and propagates as itself. CUDA ids that do not reach the host within ``ids_timeout`` fail their job
with :class:`CopyTimeout`.

Seed 000, rule 5 (shutdown), the worker's part. A backend dropped without ``close()`` is freed: the worker
holds it only weakly between jobs (it looks again at least every ``_IDLE_WAIT_S``), so the backend is
collected, its staging with it, and the worker then stops. ``close()`` called on the worker thread itself
cannot join it: the worker finishes the release when it stops (``_worker_stopped``). At interpreter exit
a hook closes live backends with a short bounded timeout (:data:`live_backends`), so no worker writes
pinned staging torch is freeing.

Seed 004 (WAR). The copy into the caller's ``out`` runs on the copy stream after a wait on an event
recorded on the caller's stream at submit, so it cannot overwrite ``out`` while work enqueued before the
submit (the previous pass's readers) still reads it.

Testing: ``backend._fault_hook = fn`` (private) runs ``fn(job)`` before each gather (the worker's or an
inline one): tests use it to delay or fail a chosen job.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ...errors import BackendClosed, CopyJobFailed, CopyTimeout
from .. import host_gather
from .job import LAUNCHED, LAUNCHING, RUNNING, CopyJob
from .slots import POLL_MAX_S, POLL_MIN_S, Slot

__all__ = ["CopyWorker", "worker_loop", "live_backends", "ExitRegistry"]

log = logging.getLogger("uvaple.integration.placements.copy")

# Interpreter exit: total seconds the exit hook waits for the workers of live backends to stop. Short: a
# worker that does not stop in time is a daemon thread reading memory that stays mapped (no crash).
_EXIT_CLOSE_TIMEOUT_S = 2.0
# The idle worker lets go of its backend this often (seconds), so a backend dropped without close() is
# collected and its worker stops within about this long.
_IDLE_WAIT_S = 0.5
IDLE = object()  # _next_job: nothing to do this turn


class ExitRegistry:
    """A weak set of live objects plus a hook that runs once at interpreter exit.

    The ``atexit`` hook is registered at the first ``add``: hooks run last-in first-out, so a kind whose
    first object is made later (a backend, built over an existing table) is cleaned up first.
    """

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook = hook
        self._items: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered = False

    def add(self, obj) -> None:
        with self._lock:
            if not self._registered:
                atexit.register(self._hook)
                self._registered = True
            self._items.add(obj)

    def discard(self, obj) -> None:
        self._items.discard(obj)

    def items(self) -> list:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _close_backends_at_exit() -> None:
    backends = live_backends.items()
    deadline = time.monotonic() + _EXIT_CLOSE_TIMEOUT_S
    for b in backends:  # stop every worker at once, then wait for them within one budget
        if b._forked:
            continue  # a forked child's copy: close() below lets go of it and waits for nothing
        try:
            with b._cond:
                b._begin_close_locked()
        except Exception as e:  # noqa: BLE001 - never raise from atexit
            log.warning("closing %r at exit failed: %s", b, e)
    for b in backends:
        try:
            b.close(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - never raise from atexit
            log.warning("closing %r at exit failed (its table stays mapped until the process ends): %s", b, e)


#: Copy backends not yet closed (weakly held); the exit hook closes them.
live_backends = ExitRegistry(_close_backends_at_exit)


def worker_loop(ref: weakref.ref, wake: threading.Event) -> None:
    """The worker thread: turns of ``CopyBackend._worker_turn``, holding the backend only during a turn.

    Idle, it waits on ``wake`` (set by submit and close) holding nothing, so a backend dropped without
    close() is collected (reference cycles through its jobs included) and the loop ends.
    """
    while True:
        backend = ref()
        if backend is None:
            return
        wake.clear()
        turn = backend._worker_turn()
        del backend
        if turn is False:
            return
        if turn is IDLE:
            wake.wait(_IDLE_WAIT_S)


class CopyWorker:
    """``CopyBackend``'s hand-off of jobs and the worker's turns (state and lock are the backend's)."""

    def _dispatch(self, job: CopyJob, *, inline: bool, device_ids: bool) -> None:
        """Hand an admitted job whose ids were taken to the worker, or run it on this thread (``inline``)."""
        try:
            with self._cond:
                # the worker may have died or close() begun since _admit: fail now, do not leave the job to
                # time out in a queue nobody serves
                if self._broken is not None:
                    err = BackendClosed(f"copy job {job.seq}: the copy worker died ({self._broken!r}); build a "
                                        "new CopyBackend")
                    err.__cause__ = self._broken
                    job._fail_locked(err)
                    return
                if self._closing:
                    job._fail_locked(BackendClosed("the CopyBackend was closed while this job was submitted"))
                    return
                self._counts["submitted"] += 1
                # inline only for small CPU-ids requests (serial gather): there the two thread hand-offs
                # dominate; large ones stay on the worker, so one thread drives numba's parallel pool
                nbytes = job._n * job._ncols * self._itemsize
                if inline and not device_ids and nbytes < host_gather.PARALLEL_MIN_BYTES:
                    job._state = RUNNING  # never queued: the worker does not see it
                    self._inline_jobs.add(job)  # close() waits for it before releasing the table
                else:
                    self._pending.append(job)
                    self._cond.notify_all()
                    self._wake.set()
                    return
            self._run(job, inline=True)  # the caller's thread gathers and launches, as the worker would
        finally:
            if inline:
                with self._cond:
                    self._inline_jobs.discard(job)
                    self._cond.notify_all()

    def _worker_turn(self) -> bool | object:
        """One turn of the worker: run the next ready job (True), find nothing to do (``IDLE``), or stop
        (False)."""
        job = None
        stop = False
        try:
            job = self._next_job()
            if job is IDLE:
                return IDLE
            if job is None:
                stop = True
                return False
            self._run(job)
            return True
        except BaseException as e:
            stop = True  # a bug in the worker: fail everyone rather than hang them
            log.exception("uvaple copy worker died")
            with self._cond:
                self._broken = e
                if job is not None and not job._host_done.is_set():
                    job._fail_locked(CopyJobFailed(f"copy job {job.seq}: the copy worker died: {e!r}"))
                while self._pending:
                    job = self._pending.popleft()
                    job._fail_locked(CopyJobFailed(f"copy job {job.seq}: the copy worker died: {e!r}"))
            return False
        finally:
            if stop:
                self._worker_stopped()

    def _worker_stopped(self) -> None:
        with self._cond:
            timeout = self._release_on_worker_exit
        if timeout is not None:  # close() ran on this thread: it could not join it, so finish here
            try:
                self._release(time.monotonic() + timeout, timeout, on_worker=True)
            except Exception as e:  # noqa: BLE001 - a later close() retries
                log.warning("CopyBackend close requested on its worker thread did not finish: %s", e)

    def _next_job(self) -> CopyJob | object | None:
        """The next job whose ids are ready; None when closing; ``IDLE`` when there is none."""
        delay = POLL_MIN_S
        with self._cond:
            while True:
                if self._closing:
                    return None
                waiting_for_ids = False
                for job in self._pending:
                    if job._device_ids is not None and not self._ops.query(self._slot_of(job).ids_event):
                        if time.monotonic() > job._ids_deadline:
                            self._pending.remove(job)
                            job._fail_locked(CopyTimeout(
                                f"copy job {job.seq}: CUDA ids did not reach the host within "
                                f"{self.ids_timeout:.3g} s (the caller's stream did not reach the submit "
                                "point); pass CPU ids or check the model stream"))
                            break  # the deque changed; rescan
                        waiting_for_ids = True
                        continue
                    self._pending.remove(job)
                    job._state = RUNNING
                    return job
                else:
                    if waiting_for_ids:
                        self._cond.wait(delay)
                        delay = min(delay * 2, POLL_MAX_S)
                    else:
                        return IDLE  # the loop waits for submit/close without holding the backend

    @staticmethod
    def _slot_of(job: CopyJob) -> Slot:
        assert job._slot is not None
        return job._slot

    def _run(self, job: CopyJob, inline: bool = False) -> None:
        """Gather and launch ``job`` (on the worker, or inline on the caller's thread).

        Failures are stored on the job. Inline, a ``KeyboardInterrupt``/``SystemExit`` (any non-``Exception``)
        also fails the job (its slot is released as usual) and then propagates to the caller as itself.
        """
        slot = self._slot_of(job)
        policy = self._policy
        try:
            if self._fault_hook is not None:
                self._fault_hook(job)
            n, isz = job._n, job._ids_dtype.itemsize
            nbytes = job._ncols * self._itemsize
            ids_np = slot.ids_np[: n * isz].view(np.int32 if isz == 4 else np.int64)
            staged = slot.staging_np[: n * nbytes].reshape(n, nbytes)
            if n:
                bad = policy.stage(self._bytes, ids_np, staged, job._byte_start, id_base=self._id_base,
                                   row_ids=slot.row_ids, scale=job._scale, scale_on_cpu=job._scale_on_cpu,
                                   oob_row0=job._oob_row0)
                with self._cond:
                    self._counts["out_of_range_ids"] += bad
                    self._counts["rows"] += n
                    self._counts["lookups"] += 1  # calls with rows, as the gather's device counters count
            if n and job._scale_on_cpu:  # inf/NaN scale: multiply here, then restore +0.0 zero rows
                rows_t = slot.staging[: n * nbytes].view(self.dtype).view(n, job._ncols)
                policy.scale_on_host(rows_t, ids_np, self._bytes.shape[0], id_base=self._id_base,
                                     scale=job._scale, oob_row0=job._oob_row0)
        except BaseException as e:
            with self._cond:
                job._fail_locked(self._wrap(job, "CPU gather", e))
            if inline and not isinstance(e, Exception):
                raise
            return
        with self._cond:
            if self._closing:
                job._fail_locked(BackendClosed(f"copy job {job.seq}: the CopyBackend was closed"))
                return
            job._state = LAUNCHING
        try:
            self._launch(job, slot, n, nbytes)
        except BaseException as e:
            with self._cond:
                job._fail_locked(self._wrap(job, "copy launch", e))
            if inline and not isinstance(e, Exception):
                raise
            return
        with self._cond:
            job._state = LAUNCHED
            job._host_done.set()
            self._counts["launched"] += 1
            self._cond.notify_all()

    @staticmethod
    def _wrap(job: CopyJob, stage: str, e: BaseException) -> BaseException:
        err = CopyJobFailed(f"copy job {job.seq} failed in its {stage}: {e!r}")
        err.__cause__ = e
        return err

    def _launch(self, job: CopyJob, slot: Slot, n: int, nbytes: int) -> None:
        """Enqueue the job's device work on the copy stream; record its done event (always, once begun)."""
        ops, stream = self._ops, self._copy_stream
        out = job._out
        assert out is not None
        ncols = job._ncols
        src = slot.staging[: n * nbytes].view(self.dtype).view(n, ncols)  # [n, ncols], pinned
        direct = out.dtype == self.dtype and out.is_contiguous()
        if not direct and slot.device_buf is None:
            # first conversion: a table-dtype buffer for every slot at once, so none is allocated later
            # (under the lock: inline lookups of several threads may launch concurrently)
            with self._cond:
                for sl in self._slots:
                    if sl.device_buf is None:
                        sl.device_buf = ops.alloc_device(self.max_rows * self.cols, self.dtype, stream)
        scale = None if job._scale_on_cpu else job._scale
        dev_rows = out.view(n, ncols) if direct else slot.device_buf[: n * ncols].view(n, ncols)
        device_work = self._policy.device_copy(src, dev_rows, out, n, scale, direct)
        ops.wait_event(stream, slot.submit_event)  # WAR: after every reader enqueued before submit
        try:
            # in the submitter's inference mode (an inference-mode `out` may only be written inside it);
            # no autograd: this is a lookup
            with torch.inference_mode(job._inference), torch.no_grad():
                ops.enqueue(stream, device_work)
        finally:
            self._record(job, slot, slot.done_event, stream)

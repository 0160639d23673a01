"""``CopyBackend``: the classic copy-based PLE path, built correctly.

The baseline every UVA claim is compared against, and the fallback where host memory cannot be mapped
into the GPU. It is a :class:`~uvaple.integration.lookup.Lookup`: the policy is its spec's,
``lookup(ids, out)`` gives the bits every placement gives (:func:`uvaple.kernels.reference_gather` is
the definition).

Design
------
One worker thread per backend takes admitted jobs, gathers their rows on the CPU with a numba kernel
(a byte copy over ``HostTable.bytes_view()``, columns as a byte range, out-of-range ids as a zero row or
row 0; ``torch.index_select`` for big calls of short rows, same bytes:
:mod:`~uvaple.integration.placements.host_gather`) into the job's pinned staging slot, and launches the
host-to-device copy on a dedicated copy stream. The consumer's stream waits on that job's own event;
nothing synchronises the host with the GPU on the hot path. Pipelined use: ``job = backend.submit(ids,
out)`` early, ``job.wait()`` when the model needs the rows; ``lookup`` is both at once (small CPU-ids
lookups do the gather and launch on the caller's thread, which blocks for them anyway: same protocol,
two thread hand-offs fewer). Device-to-host copies of CUDA ids get a stream of their own (:mod:`.job`).

    caller stream  ──record S_j─────────────────(CUDA ids) wait I_j──────wait D_j── model reads out
                           │                                ▲            ▲
    (CUDA ids) d2h stream  └─wait S_j─ ids → slot.ids ─record I_j        │
    worker (CPU)                        poll I_j ─ gather → slot.staging
    copy stream                    wait S_j ─ staging → out [× scale, cast] ─record D_j

One concept per module, the rules of seeds 000 and 004 each kept where it is enforced:

* :mod:`.slots`: the preallocated slots, admission and reclaim (seed 000 rules 1 and 2; the leaked slot
  of rule 3; the lock-free scan behind ``health``).
* :mod:`.job`: :class:`CopyJob` and its states (rule 3, the ownership of ids; rule 4, a result of its
  own; rule 5, cancellation; the ids stream; the caller's side of seed 004).
* :mod:`.worker`: the worker thread and its exit hook (rule 4, failure delivery; rule 5, a dropped
  backend and the interpreter's exit; seed 004, the WAR wait).
* :mod:`.policy`: the spec's ``scale`` and ``oob`` as a CPU gather and a device copy give them (exactness).
* :mod:`.device_ops`: the stream and event operations, swappable for tests.
* here: construction, the ``Lookup`` API, progress and health, and closing (rule 5, below).

Seed 000, rule 5 (shutdown). ``close()`` fails pending jobs with :class:`BackendClosed`, joins the worker
and waits for gathers running on callers' threads (inline lookups, counted under the lock; one starting
after closing began fails with :class:`BackendClosed`), all with one bounded timeout, then releases slots
as their events complete (bounded; pinned blocks still read by a copy are protected by torch's caching
host allocator, which records the copy's event). If the worker or an inline gather is still running when
the time is up, ``close`` raises :class:`CopyTimeout` and leaves everything (table, slots) in place;
closing has begun (no new jobs) but the release has not, and a later ``close()`` re-checks and finishes
it. ``close()`` called on the worker thread itself cannot join it: it begins closing and returns; the
worker finishes the release when it stops. Every wait is bounded and raises :class:`CopyTimeout` when it
runs out. Table lifetime: the backend holds views of its table (``tensor``, ``bytes_view()``), and a view
keeps the table's memory mapped (``uvaple.uva.host_table``): a table closed under the backend, or the
interpreter exiting while a gather runs, never unmaps memory the worker reads.
Fork. A forked child has no worker and the parent's streams and slots: there ``submit``/``lookup`` and a
parent's job's ``wait``/``cancel`` raise :class:`~uvaple.integration.errors.LookupForkedError`, and
``close()`` (also at the child's exit) waits for nothing, touches none of the parent's events and lets go
of the child's copy of the table. The backend's lock is a :class:`~uvaple.integration.fork.ForkSafeLock`:
free in the child, whoever held it at the fork.

Progress and health. ``progress()`` and ``health(stall_s)`` take no lock: they must answer while the
worker is stuck, possibly inside a CUDA call made under the backend's lock (the scan: :mod:`.slots`). A
job admitted more than ``stall_s`` seconds ago and not finished makes the backend unhealthy, named with
its stage (seeds 000 and 002: ``/health`` said 200 while nothing progressed; track the oldest outstanding
operation and its stage, not liveness).

Testing. The stream/event operations sit behind ``DeviceOps`` (``CudaOps``; ``CpuOps``, synchronous,
for CPU-only runs); the tests inject a fake whose copies complete only when the test says
(``CopyBackend(..., _ops=fake)``), so ownership, WAR, failure delivery, admission and shutdown are
checked deterministically on CPU (``backend._fault_hook``: :mod:`.worker`).

Costs. CUDA ids cost a device→host dependency: the ids copy waits for the caller's stream to reach the
submit point and the worker polls for it (``ids_timeout``); pass CPU ids (the scheduler has them) when
possible. ``out=None`` allocates the result; pass ``out=`` on the hot path. A request larger than
``max_rows`` raises :class:`CopyRequestTooLarge`. Staging is one pinned block of
``max_in_flight * max_rows * row_bytes`` bytes (``torch.empty(pin_memory=True)``, which rounds up to a
power of two), plus an int64 ``[max_rows]`` buffer per slot for the torch gather's row ids. ``submit``
is not CUDA-graph capturable (it is host work by nature).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from uvaple.uva import HostTable

from ...errors import BackendClosed, CopyJobFailed, CopyRequestTooLarge, CopyTimeout
from ...fork import ForkSafeLock
from ...lookup import Lookup
from ...spec import TableSpec, spec_for
from ...telemetry import Health, Progress
from .. import host_gather
from .device_ops import DeviceOps, ops_for
from .job import CopyJob
from .policy import CopyPolicy
from .slots import (
    DEFAULT_ADMISSION_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_ROWS,
    POLL_MAX_S,
    POLL_MIN_S,
    Slot,
    SlotAdmission,
    allocate_slots,
)
from .worker import CopyWorker, live_backends, worker_loop

log = logging.getLogger("uvaple.integration.placements.copy")

__all__ = ["CopyBackend", "CopyJob"]

# Default bounds of the waits (seconds). They are far above any healthy forward pass (ms); hitting one
# means the GPU or the caller stopped making progress, and the named error says which wait it was.
DEFAULT_WAIT_TIMEOUT_S = 60.0
DEFAULT_IDS_TIMEOUT_S = 60.0
DEFAULT_CLOSE_TIMEOUT_S = 10.0
# health(): a job outstanding this long has stalled (a healthy one takes milliseconds). The admission bound:
# a submit that finds every slot busy for this long is refused.
DEFAULT_STALL_S = DEFAULT_ADMISSION_TIMEOUT_S


class CopyBackend(SlotAdmission, CopyWorker, Lookup):
    """PLE rows through a CPU gather into pinned staging and an async host-to-device copy.

    Parameters
    ----------
    table : HostTable (shared, not closed unless ``owns_table``), or a 2-D CPU tensor ``[rows, cols]``,
        copied into a HostTable the backend owns.
    device : target device of the rows (``cuda``/``cuda:i``, or ``cpu`` for a synchronous CPU run).
        Default: the current CUDA device, else CPU.
    spec : the policy of the rows returned (:class:`~uvaple.integration.spec.TableSpec`; default: the
        table's own, zero rows for out-of-range ids). ``scale``/``oob``/``out_dtype``/``column_block`` make
        one when ``spec`` is not given.
    max_in_flight : jobs admitted and not yet finished on the GPU (one staging slot each).
    max_rows : most ids per request (staging slot size).
    admission_timeout : seconds ``submit`` waits for a slot before :class:`CopyBackendOverloaded`; 0 fails
        at once.
    wait_timeout, ids_timeout, close_timeout : bounds (seconds) of ``CopyJob.wait``, of the wait for
        CUDA ids to reach the host, and of ``close``.
    warmup : compile the numba gather now, not on the first lookup.
    """

    kind = "copy"

    def __init__(self, table, device: torch.device | str | int | None = None, *, spec: TableSpec | None = None,
                 scale: float | None = None, oob: str = "zero", out_dtype: torch.dtype | None = None,
                 column_block: int | None = None, owns_table: bool = False,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, max_rows: int = DEFAULT_MAX_ROWS,
                 admission_timeout: float = DEFAULT_ADMISSION_TIMEOUT_S,
                 wait_timeout: float = DEFAULT_WAIT_TIMEOUT_S, ids_timeout: float = DEFAULT_IDS_TIMEOUT_S,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT_S, warmup: bool = True,
                 _ops: DeviceOps | None = None) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if _ops is not None:
            device = _ops.device
        if not isinstance(table, (torch.Tensor, HostTable)):
            raise TypeError(f"table must be a HostTable or a 2-D tensor, got {type(table).__name__}")
        spec = spec_for(table, spec, scale=scale, oob=oob, out_dtype=out_dtype, column_block=column_block)
        if isinstance(table, torch.Tensor):  # checked before the copy
            table, owns_table = HostTable.from_tensor(table), True
        try:
            if spec.encoding != "raw":
                raise TypeError(f"the copy placement serves rows as stored (encoding 'raw'); this spec asks for "
                                f"{spec.describe()}: use the uva or device placement, or dequantise after it")
            super().__init__(table, spec, device, owns_table=owns_table, max_rows=int(max_rows))
        except BaseException:
            if owns_table:
                table.close()
            raise
        lo, hi = spec.window
        # uint8 [hi - lo, stride_bytes] (it holds the table's memory); id i reads its row i - _id_base
        self._bytes = table.bytes_view()[lo:hi]
        self._id_base = spec.id_offset + lo
        try:
            self._itemsize = table.itemsize
            self._ops = _ops if _ops is not None else ops_for(self.device)
            self.max_in_flight = int(max_in_flight)
            self.max_rows = int(max_rows)
            self.admission_timeout = float(admission_timeout)
            self.wait_timeout = float(wait_timeout)
            self.ids_timeout = float(ids_timeout)
            self.close_timeout = float(close_timeout)
            self._fault_hook: Callable[[CopyJob], None] | None = None  # tests: delay/raise before a gather

            self._host_block, self._slots = allocate_slots(self._ops, self.max_in_flight, self.max_rows,
                                                           self.cols * self._itemsize)
            self._free: list[Slot] = list(reversed(self._slots))
            self._copy_stream = self._ops.new_stream()
            self._d2h_stream = self._ops.new_stream()
            self._policy = CopyPolicy(spec, self.dtype, self._itemsize)  # scale and oob, as gather_rows
            self._cond = threading.Condition(ForkSafeLock())  # free in a forked child, whoever held it
            self._pending: collections.deque[CopyJob] = collections.deque()
            self._seq = 0
            # Shutdown states: _closing (close() began: no new jobs, the worker stops), _releasing (one
            # thread is releasing slots and an owned table), Lookup._closed (released). A close() that timed out
            # leaves _closing set and nothing released; a later close() re-checks and finishes.
            self._closing = False
            self._releasing = False
            self._release_on_worker_exit: float | None = None  # close() ran on the worker thread: timeout
            # jobs gathered/launched on callers' threads (inline lookups) right now; a set, so that its
            # removal in a `finally` is idempotent (an interrupt anywhere cannot leave a stale count)
            self._inline_jobs: set[CopyJob] = set()
            self._broken: BaseException | None = None
            self._counts = collections.Counter()
            self._abandoned = 0  # slots whose copy had not completed when close() gave up waiting
            if warmup:
                host_gather.warm_up(self._bytes, self._policy.zero_pos)
            # the worker holds the backend weakly between jobs: dropping the backend frees it (.worker)
            self._wake = threading.Event()  # set by submit and close: the idle worker waits on it, not on us
            self._worker = threading.Thread(target=worker_loop, args=(weakref.ref(self), self._wake),
                                            name="uvaple-copy-worker", daemon=True)
            self._worker.start()
        except BaseException:
            if owns_table:
                table.close()
            raise
        live_backends.add(self)

    # ------------------------------------------------------------------ public API
    def submit(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> CopyJob:
        """Admit a lookup of ``ids`` (int32/int64, any shape, CPU or on the backend's device).

        Returns at once with a :class:`CopyJob`; rows land in ``out`` ``[*ids.shape, ncols]`` (allocated
        when None) in stream order. Raises :class:`CopyBackendOverloaded` (no slot within
        ``admission_timeout``), :class:`CopyRequestTooLarge`, :class:`BackendClosed`, or
        ``ValueError``/``TypeError`` for bad arguments — in every case before anything was mutated.
        """
        return self._submit(ids, out, columns, inline=False)

    def _submit(self, ids, out, columns, *, inline: bool) -> CopyJob:
        # ---- checks (nothing mutated): every placement's (Lookup._prepare), ids on the CPU or the device; a
        # closed or forked backend is refused there (a forked child: the worker, streams and slots are the parent's)
        ids, out, c0, c1 = self._prepare(ids, out, columns, ids_on="either", allocate=False)
        device_ids = self._ops.needs_d2h(ids)
        ncols = c1 - c0
        dtype = self.spec.output_dtype
        shape = (*ids.shape, ncols)
        n = ids.numel()
        # ---- admission
        _, job = self._admit()  # the job holds its slot
        # ---- from here the job owns the slot; failures release it through the normal path
        try:
            job._n = n
            job._ids_dtype = ids.dtype
            job._byte_start = c0 * self._itemsize
            job._ncols = ncols
            job._scale = self._policy.scale
            job._scale_on_cpu = self._policy.scale_on_cpu
            job._oob_row0 = self._policy.oob_row0
            job._inference = torch.is_inference_mode_enabled()
            if out is None:
                out = torch.empty(shape, dtype=dtype, device=self.device)
            job._out = out
            job._take_ids(ids, device_ids)  # the submit point, and the job's own copy of the ids
        except BaseException as e:
            with self._cond:
                job._fail_locked(CopyJobFailed(f"copy job {job.seq} failed at submit: {e}"))
            raise
        self._dispatch(job, inline=inline, device_ids=device_ids)
        return job

    def _too_many(self, n: int) -> Exception:
        return CopyRequestTooLarge(f"{n} ids in one request, but staging slots hold max_rows={self.max_rows}; "
                                   f"construct the CopyBackend with max_rows >= {n} or split the request")

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> torch.Tensor:
        """``submit(...).wait()``: rows ``[*ids.shape, ncols]`` ready in the current stream's order.

        For small requests with CPU ids the caller's thread does the job's gather and launch itself (it
        blocks for them anyway), saving two thread hand-offs; the job protocol (slot, events, WAR wait)
        is the same.
        """
        return self._submit(ids, out, columns, inline=True).wait()

    def stats(self) -> dict:
        """Progress counters for health checks: a growing ``oldest_pending_s`` means no progress."""
        with self._cond:
            self._reclaim_locked()
            now = time.monotonic()
            oldest = min((j._submitted_at for j in self._pending), default=None)
            busy = self._abandoned if self._closed else self.max_in_flight - len(self._free)
            return dict(self._counts, kind=self.kind, lookups=self._counts["lookups"], rows=self._counts["rows"],
                        out_of_range_ids=self._counts["out_of_range_ids"], pending=len(self._pending),
                        slots_busy=busy, slots_free=self.max_in_flight - busy,
                        oldest_pending_s=0.0 if oldest is None else now - oldest,
                        worker_alive=self._worker.is_alive(), closed=self._closed, closing=self._closing,
                        inline_running=len(self._inline_jobs), abandoned_at_close=self._abandoned)

    def progress(self) -> Progress:
        """Counters and the oldest outstanding job, without the backend's lock (see the module docstring)."""
        c = self._counts  # host integers, updated under the lock; each read whole (maybe one job behind)
        rows = c["rows"]
        jobs = self._outstanding()
        now = time.monotonic()
        oldest = min(jobs) if jobs else None
        return Progress(kind=self.kind, closed=self._closed, lookups=c["lookups"], rows=rows,
                        bytes=rows * self.cols * self._itemsize, out_of_range_ids=c["out_of_range_ids"],
                        age_s=0.0, outstanding=len(jobs),
                        oldest_job=None if oldest is None else oldest[0],
                        oldest_stage=None if oldest is None else oldest[1],
                        oldest_age_s=None if oldest is None else now - oldest[2])

    def health(self, stall_s: float = DEFAULT_STALL_S) -> Health:
        """Whether work progresses: unhealthy when a job has been outstanding (admitted, not finished on the
        host and the device) for more than ``stall_s`` seconds, naming it (``CopyJob.seq``) and its stage;
        also when the worker died or the backend is closed. Takes no lock and waits for nothing (event
        queries only), so it answers while the worker is stuck, in a time bounded by ``max_in_flight``.
        """
        if not stall_s > 0:
            raise ValueError(f"stall_s must be positive seconds, got {stall_s!r}")
        broken = self._broken
        if broken is not None:
            return Health(False, f"the copy worker died ({broken!r}); build a new CopyBackend")
        if self._closing or self._closed:
            return Health(False, "the CopyBackend is closed")
        top = self._seq  # before the scan: jobs admitted during it are not counted as finished
        jobs = self._outstanding()
        worker_alive = self._worker.is_alive()
        if not jobs:
            if not worker_alive:
                return Health(False, "the copy worker is not running")
            return Health(True, "no copy job outstanding")
        now = time.monotonic()
        seq, stage, admitted, since = min(jobs)
        age, in_stage = now - admitted, now - since
        # jobs admitted after the oldest one that have finished since it was admitted
        later_done = top - seq + 1 - sum(1 for j in jobs if j[0] <= top)
        what = (f"copy job {seq} admitted {age:.3g} s ago, in stage {stage!r} for {in_stage:.3g} s "
                f"({len(jobs)} outstanding; ")
        what += f"{later_done} later job(s) finished since)" if later_done else "no job finished since)"
        healthy = age <= stall_s and worker_alive
        if healthy:
            reason = what
        elif not worker_alive:
            reason = f"the copy worker is not running; {what}"
        else:
            reason = f"stalled: {what}, over stall_s={stall_s:.3g} s"
        return Health(healthy, reason, oldest_job=seq, stage=stage, age_s=age, stage_age_s=in_stage,
                      outstanding=len(jobs))

    @property
    def closed(self) -> bool:
        """True once ``close()`` has finished (released slots and an owned table)."""
        return self._closed

    def close(self, timeout: float | None = None) -> None:
        """Fail pending jobs with :class:`BackendClosed`, stop the worker and release the slots (bounded).

        Jobs whose copy was launched keep their result. Raises :class:`CopyTimeout` when the worker or a
        gather on a caller's thread (inline ``lookup``) does not stop within ``timeout`` (default
        ``close_timeout``); nothing is released then (the table stays open: they may still read it), and
        calling ``close()`` again re-checks and finishes the release. Called on the worker thread itself,
        it begins closing and returns; the worker releases when it stops. Idempotent.
        """
        if self._forked:
            self._close_in_child()
            return
        t = self.close_timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        on_worker = threading.current_thread() is self._worker
        with self._cond:
            if self._closed:
                return
            self._begin_close_locked()
            if on_worker:
                # joining ourselves would deadlock; gathering continues after we return, so the table
                # must stay mapped until this thread has left its loop: it releases then
                self._release_on_worker_exit = t
                return
        self._worker.join(max(0.0, deadline - time.monotonic()))
        self._release(deadline, t, on_worker=False)

    def _close_in_child(self) -> None:
        """close() in a forked child: the worker, streams and slots are the parent's, nothing here waits for
        or releases them; the child lets go of its copy of the table (which only unmaps it)."""
        with self._cond:  # a ForkSafeLock: free here. The backend's and its jobs' Events are the parent's
            if self._closed:  # (their internal locks may be held for ever): untouched, as jobs refuse wait()
                return
            self._closing = self._closed = True
            self._pending.clear()
            self._slots, self._free, self._host_block = [], [], None
        live_backends.discard(self)
        if self._owns_table:
            self.table.close()

    def _begin_close_locked(self) -> None:
        """Closing begins (once): no new jobs, pending jobs fail, the worker leaves its loop."""
        if self._closing:
            return
        self._closing = True
        while self._pending:
            job = self._pending.popleft()
            job._fail_locked(BackendClosed(f"copy job {job.seq}: the CopyBackend was closed"))
        self._cond.notify_all()
        self._wake.set()

    def _release(self, deadline: float, t: float, *, on_worker: bool) -> None:
        """Second half of close(): once nothing runs a gather, release the slots and an owned table."""
        delay = POLL_MIN_S
        with self._cond:
            # inline gathers read the table (and launch from the slots) like the worker: wait for them
            while self._inline_jobs and time.monotonic() < deadline:
                self._cond.wait(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, POLL_MAX_S)
            worker_stuck = not on_worker and self._worker.is_alive()
            runners = len(self._inline_jobs)
            if worker_stuck or runners:
                what = "the copy worker" if worker_stuck else f"{runners} inline lookup(s)"
                raise CopyTimeout(
                    f"{what} did not stop within {t:.3g} s (a gather is stuck); pending jobs were failed "
                    "with BackendClosed and the table was left open; call close() again to finish")
            while self._releasing:  # another thread is releasing: wait for it (bounded)
                if self._closed or time.monotonic() >= deadline:
                    return
                self._cond.wait(POLL_MAX_S)
            if self._closed:
                return
            self._releasing = True
            busy, leaked = self._release_slots_locked(deadline)
        try:
            if busy:
                log.warning("CopyBackend closed with %d copies not completed after %.3g s (%d leaked slots); "
                            "their pinned staging stays referenced by their jobs (and torch's host allocator)",
                            busy, t, leaked)
            # nothing reads the table any more (worker stopped, no inline runner, closing refuses new ones)
            live_backends.discard(self)
            super().close()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def __enter__(self) -> CopyBackend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CopyBackend({self.rows}x{self.cols} {str(self.dtype).replace('torch.', '')} -> "
                f"{self.device}, max_in_flight={self.max_in_flight}, max_rows={self.max_rows})")

    def device_bytes(self) -> int:
        """Device memory held for conversions (``out_dtype`` differing from the table's), in bytes."""
        return sum(sl.device_buf.numel() * sl.device_buf.element_size()
                   for sl in self._slots if sl.device_buf is not None and sl.device_buf.is_cuda)



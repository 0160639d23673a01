"""``CopyBackend``: the classic copy-based PLE path, built correctly.

The baseline every UVA claim is compared against, and the fallback where host memory cannot be mapped
into the GPU. It is a :class:`~uvaple.integration.lookup.Lookup`: the policy is its spec's,
``lookup(ids, out)`` gives the bits every placement gives (:func:`uvaple.kernels.reference_gather` is
the definition).

Design
------
One worker thread per backend takes admitted jobs, gathers their rows on the CPU with a numba kernel
(a byte copy over ``HostTable.bytes_view()``, columns as a byte range, out-of-range ids as a zero row or
row 0; ``torch.index_select`` for big calls of short rows, same bytes: :mod:`.cpu_gather`) into the
job's pinned staging slot, and launches the host-to-device copy on a dedicated copy
stream. The consumer's stream waits on that job's own event; nothing synchronises the host with the GPU
on the hot path. Pipelined use: ``job = backend.submit(ids, out)`` early, ``job.wait()`` when the model
needs the rows; ``lookup`` is both at once (small CPU-ids lookups do the gather and launch on the
caller's thread, which blocks for them anyway: same protocol, two thread hand-offs fewer).

Streams. Device-to-host copies of CUDA ids get their own stream. On the copy stream, pass B's ids copy
(waiting for B's submit point) would sit in front of pass A's rows copy, and B's submit point may come
after the model waited for A's rows: seed 000's circular wait. The ids stream holds only ids copies, each
behind its own pass's submit point, and the worker never launches a copy ahead of its ids.

Exactness. Rows are copied as bytes; ``scale`` is a device ``mul_`` by the scale rounded to the table
dtype (HF's ``emb * scale.to(weight.dtype)``: one fp32 product, one rounding); ``out_dtype`` is a device
cast after it. Zero rows (``oob="zero"``) are staged as -0.0 when the scale is negative, so that the
product is +0.0 like ``gather_rows``' zero rows; an inf/NaN scale (0 * inf = NaN) is applied on the CPU
by torch (rare path), followed by re-zeroing the out-of-range rows.

    caller stream  ──record S_j─────────────────(CUDA ids) wait I_j──────wait D_j── model reads out
                           │                                ▲            ▲
    (CUDA ids) d2h stream  └─wait S_j─ ids → slot.ids ─record I_j        │
    worker (CPU)                        poll I_j ─ gather → slot.staging
    copy stream                    wait S_j ─ staging → out [× scale, cast] ─record D_j

How the five rules of seed 000 (and seed 004's WAR rule) are met
----------------------------------------------------------------
1. Admission. There are exactly ``max_in_flight`` slots; a job is admitted only with a free slot, so the
   internal job list can never overflow (no ``queue.Full``). With no free slot ``submit`` polls (bounded
   by ``admission_timeout``) for an earlier job's copy to complete on the GPU — which needs no action of
   the caller, so the wait cannot deadlock — then raises :class:`CopyBackendOverloaded`. All checks and
   the admission happen before anything is mutated: a refused job has recorded no event, touched no
   buffer and queued nothing.
2. Events. Each slot owns its events (submit, ids-ready, copy-done); a slot belongs to one job at a time
   and is reused only after every event recorded for its previous job has completed, so no event is ever
   shared by two jobs in flight. ``wait()`` checks, under the lock, that the event still belongs to the job.
3. Ownership. CPU ids are snapshotted into the slot at submit (the caller may reuse its ids tensor at
   once). CUDA ids are copied to the host on the d2h stream after the submit point, i.e. later than the
   caller's stream: ``submit`` therefore makes the caller's current stream wait on the job's ids-copy
   event (``wait_event``, no host sync), so work the caller enqueues after ``submit`` — the next pass
   rewriting a persistent ``input_ids`` buffer — is ordered after the copy and the job gathers the ids
   as they were at submit (write-after-read). Chosen over a snapshot into a per-slot device buffer on
   the caller's stream: no device memory, no extra kernel; the cost is that the caller's later work
   waits for an ``n * 8``-byte device-to-host copy (microseconds). It cannot deadlock: the ids copy
   depends only on earlier submit points, never on the worker or on a rows copy. CUDA ids, the caller's
   ``out`` and the slot's staging/device buffers are referenced by the job until every event recorded
   for it has completed. Completion is observed with ``event.query()`` (by ``submit`` looking for a
   slot, by the worker, by ``close``) — the worker never blocks on the GPU. When recording an event
   fails after the job's device work was queued, nothing can tell when that work is done: the slot
   stays owned by the job for the backend's lifetime (``stats()['slots_leaked']``) rather than being
   reused under a copy that may still run.
4. Failures. Every job has its own result slot and ``threading.Event``; an exception in job B's gather or
   launch is stored on B and raised by ``B.wait()``, whatever state A is in. Jobs whose ids are not ready
   yet do not block later jobs (the worker takes the first ready job). A crashing worker fails every
   pending job and closes the backend; a job whose submit overlaps the worker's death is failed at
   once with :class:`BackendClosed` (``__cause__``: the worker's error), not left to time out. A
   ``KeyboardInterrupt``/``SystemExit`` in a gather the caller's thread runs (inline ``lookup``) fails
   that job and propagates as itself.
5. Cancellation and shutdown. ``job.cancel()`` fails a job whose gather has not started with
   :class:`CopyJobCancelled` (True); a job already being gathered, launched or failed is not cancelled
   (False). ``close()`` fails pending jobs with :class:`BackendClosed`, joins the worker and waits for
   gathers running on callers' threads (inline lookups, counted under the lock; one starting after
   closing began fails with :class:`BackendClosed`), all with one bounded timeout, then releases slots
   as their events complete (bounded; pinned blocks still read by a copy are protected by torch's
   caching host allocator, which records the copy's event). If the worker or an inline gather is still
   running when the time is up, ``close`` raises :class:`CopyTimeout` and leaves everything (table,
   slots) in place; closing has begun (no new jobs) but the release has not, and a later ``close()``
   re-checks and finishes it. ``close()`` called on the worker thread itself (e.g. from a callback)
   cannot join it: it begins closing and returns; the worker finishes the release when it stops.
   Every wait is bounded and raises :class:`CopyTimeout` when it runs out.
   Table lifetime: the backend holds views of its table (``tensor``, ``bytes_view()``), and a view keeps
   the table's memory mapped (``uvaple.uva.host_table``): a table closed under the backend, or the
   interpreter exiting while a gather runs, never unmaps memory the worker reads. At exit a hook closes
   live backends with a short bounded timeout, so no worker writes pinned staging torch is freeing.
   A backend dropped without ``close()`` is freed: the worker holds it only weakly between jobs (it
   looks again at least every ``_IDLE_WAIT_S``), so the backend is collected, its staging with it, and
   the worker then stops.
   Fork. A forked child has no worker and the parent's streams and slots: there ``submit``/``lookup``
   and a parent's job's ``wait``/``cancel`` raise :class:`~uvaple.integration.errors.LookupForkedError`,
   and ``close()`` (also at the child's exit) waits for nothing, touches none of the parent's events and
   lets go of the child's copy of the table.
   The backend's lock is a :class:`~uvaple.integration._fork.ForkSafeLock`: free in the child, whoever
   held it at the fork.
WAR (seed 004). The copy into the caller's ``out`` runs on the copy stream after a wait on an event
recorded on the caller's stream at submit, so it cannot overwrite ``out`` while work enqueued before the
submit (the previous pass's readers) still reads it. Contract: reuse an ``out`` buffer only for a job
submitted after the previous job using it was waited on and its readers were enqueued.

Progress and health. ``progress()`` and ``health(stall_s)`` take no lock: they must answer while the
worker is stuck, possibly inside a CUDA call made under the backend's lock. They read each slot's job and
its ``(state, since)`` pair (one attribute, set at every transition, so never torn), and ask a job done on
the host whether the device work recorded for it has completed (``event.query()``, which never waits; a
slot's events are re-recorded only for a next job, after ``slot.job`` changed, so a query followed by
``slot.job`` still being the job was about that job). A job admitted more than ``stall_s`` seconds ago
and not finished makes the backend unhealthy, named with its stage (seeds 000 and 002: ``/health`` said
200 while nothing progressed; track the oldest outstanding operation and its stage, not liveness).

Testing. The stream/event operations sit behind ``DeviceOps`` (``CudaOps``; ``CpuOps``, synchronous,
for CPU-only runs); the tests inject a fake whose copies complete only when the test says
(``CopyBackend(..., _ops=fake)``), so ownership, WAR, failure delivery, admission and shutdown are
checked deterministically on CPU. ``backend._fault_hook = fn`` (private) runs ``fn(job)`` in the worker
before each gather: tests use it to delay or fail a chosen job.

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
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from uvaple.kernels.capture import RelaxedCaptureMode
from uvaple.kernels.gather import check_ids, check_out
from uvaple.uva import HostTable

from .._fork import ForkSafeLock
from ..errors import (
    BackendClosed,
    CopyBackendOverloaded,
    CopyJobCancelled,
    CopyJobFailed,
    CopyRequestTooLarge,
    CopyTimeout,
)
from ..lookup import Lookup
from ..metrics import Health, Progress
from ..spec import TableSpec, spec_for
from . import cpu_gather
from ._exit import ExitRegistry
from .device_ops import DeviceOps, ops_for

log = logging.getLogger("uvaple.integration.copy")

__all__ = ["CopyBackend", "CopyJob"]

# Async scheduling keeps up to two passes in flight (seed 000: the overlap that broke the depth-1 queue);
# four covers that with margin for pipelined prefetch. Derive it from your runtime's bound.
DEFAULT_MAX_IN_FLIGHT = 4
# vLLM's usual max_num_batched_tokens; one slot stages this many rows.
DEFAULT_MAX_ROWS = 8192
# Default bounds of the waits (seconds). They are far above any healthy forward pass (ms); hitting one
# means the GPU or the caller stopped making progress, and the named error says which wait it was.
DEFAULT_ADMISSION_TIMEOUT_S = 10.0
DEFAULT_WAIT_TIMEOUT_S = 60.0
DEFAULT_IDS_TIMEOUT_S = 60.0
DEFAULT_CLOSE_TIMEOUT_S = 10.0
# health(): a job outstanding this long has stalled (a healthy one takes milliseconds). The admission bound:
# a submit that finds every slot busy for this long is refused.
DEFAULT_STALL_S = DEFAULT_ADMISSION_TIMEOUT_S
# Polling of GPU completion (no callback exists without cudaLaunchHostFunc): back off from 20 us, about
# the cost of a Python sleep round trip, to 1 ms, well under a forward pass.
_POLL_MIN_S = 20e-6
_POLL_MAX_S = 1e-3
# Staging slots start on 4 KiB boundaries (page aligned DMA sources, any dtype view is aligned).
_SLOT_ALIGN = 4096
# Interpreter exit: total seconds the exit hook waits for the workers of live backends to stop. Short: a
# worker that does not stop in time is a daemon thread reading memory that stays mapped (no crash).
_EXIT_CLOSE_TIMEOUT_S = 2.0
# The idle worker lets go of its backend this often (seconds), so a backend dropped without close() is
# collected and its worker stops within about this long.
_IDLE_WAIT_S = 0.5
_IDLE = object()  # _next_job: nothing to do this turn


def _close_backends_at_exit() -> None:
    backends = _live_backends.items()
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


_live_backends = ExitRegistry(_close_backends_at_exit)


def _worker_loop(ref: weakref.ref, wake: threading.Event) -> None:
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
        if turn is _IDLE:
            wake.wait(_IDLE_WAIT_S)


# --------------------------------------------------------------------------- jobs and slots
_PENDING, _RUNNING, _LAUNCHING, _LAUNCHED, _FAILED = "pending", "running", "launching", "launched", "failed"
# health()'s name of where a job is (pending: "ids" while its CUDA ids are owed to the host)
_STAGES = {_PENDING: "queued", _RUNNING: "gather", _LAUNCHING: "launch", _LAUNCHED: "copy", _FAILED: "failed"}


class _Slot:
    """Preallocated resources of one job in flight: staging rows, ids, events, device buffer."""

    def __init__(self, index: int, staging: torch.Tensor, ids_buf: torch.Tensor, ops: DeviceOps) -> None:
        self.index = index
        self.staging = staging  # uint8 [max_rows * row_bytes], pinned
        self.staging_np = staging.numpy()
        self.ids_buf = ids_buf  # uint8 [max_rows * 8], pinned (int32/int64 views)
        self.ids_np = ids_buf.numpy()
        # int64 [max_rows]: the rows read by the gather's torch path (cpu_gather's row_ids), not pinned
        self.row_ids = np.empty(ids_buf.numel() // 8, dtype=np.int64)
        self.submit_event = ops.new_event()  # recorded on the caller's stream at submit
        self.ids_event = ops.new_event()  # recorded on the d2h stream after the ids copy (CUDA ids)
        self.done_event = ops.new_event()  # recorded on the copy stream after the job's last copy
        self.device_buf: torch.Tensor | None = None  # table-dtype rows for casts / strided out, lazily
        self.job: CopyJob | None = None
        # an event record failed after device work was queued: that work's end is unknowable, so the slot
        # is never reused (owned by its last job for the backend's lifetime)
        self.leaked = False


class CopyJob:
    """One admitted lookup. ``wait()`` returns its rows; ``cancel()`` abandons it before its copy."""

    def __init__(self, backend: CopyBackend, seq: int) -> None:
        self._backend = backend
        self.seq = seq
        self._stage: tuple[str, float] = (_PENDING, time.monotonic())  # (state, since): read without the lock
        self._exc: BaseException | None = None
        self._host_done = threading.Event()
        self._slot: _Slot | None = None
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
            if self._state == _PENDING and self in b._pending:
                b._pending.remove(self)
                b._fail_locked(self, CopyJobCancelled(f"copy job {self.seq} was cancelled"))
                b._counts["cancelled"] += 1
                return True
            return False

    def __repr__(self) -> str:
        return f"CopyJob(seq={self.seq}, state={self._state}, n={self._n})"


# --------------------------------------------------------------------------- the backend
class CopyBackend(Lookup):
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

            row_bytes = self.cols * self._itemsize
            staging_bytes = _round_up(self.max_rows * row_bytes, _SLOT_ALIGN)
            ids_bytes = _round_up(self.max_rows * 8, _SLOT_ALIGN)
            per_slot = staging_bytes + ids_bytes
            self._host_block = self._ops.alloc_host(per_slot * self.max_in_flight)
            self._slots = []
            for i in range(self.max_in_flight):
                base = i * per_slot
                self._slots.append(_Slot(i, self._host_block[base: base + staging_bytes],
                                         self._host_block[base + staging_bytes: base + per_slot], self._ops))
            self._free: list[_Slot] = list(reversed(self._slots))
            self._copy_stream = self._ops.new_stream()
            self._d2h_stream = self._ops.new_stream()
            # HF Gemma 3n: embedding * embed_scale.to(weight.dtype); a CPU 0-dim tensor is a scalar operand.
            # A device multiply cannot give +0.0 zero rows for an inf/NaN scale (0 * inf = NaN): such scales
            # are applied on the CPU in the worker (rare path), finite ones on the device.
            self._scale_t = (None if spec.scale is None else
                             torch.tensor(spec.scale, dtype=torch.float32).to(self.dtype))
            self._scale_on_cpu = self._scale_t is not None and not math.isfinite(float(self._scale_t))
            self._oob_row0 = spec.oob == "row0"
            self._neg_zero = spec.oob == "neg_zero"
            # +0.0 and -0.0 of the table dtype as bytes: zero rows are written as -0.0 when a negative scale
            # follows on the device, so that (-0.0) * scale = +0.0, the zero row of gather_rows.
            self._zero_pos = np.zeros(self._itemsize, dtype=np.uint8)
            self._zero_neg = self._zero_pos.copy()
            if self.dtype.is_floating_point:
                self._zero_neg[-1] = 0x80  # little-endian sign bit
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
                cpu_gather.warm_up(self._bytes, self._zero_pos)
            # the worker holds the backend weakly between jobs: dropping the backend frees it (see above)
            self._wake = threading.Event()  # set by submit and close: the idle worker waits on it, not on us
            self._worker = threading.Thread(target=_worker_loop, args=(weakref.ref(self), self._wake),
                                            name="uvaple-copy-worker", daemon=True)
            self._worker.start()
        except BaseException:
            if owns_table:
                table.close()
            raise
        _live_backends.add(self)

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
        # ---- checks (nothing mutated)
        if self._forked:
            self._check_usable()  # a forked child: the worker, streams and slots are the parent's
        check_ids(ids)
        device_ids = self._ops.needs_d2h(ids)
        if ids.device.type != "cpu" and not device_ids:
            raise ValueError(f"ids are on {ids.device}; pass CPU ids or ids on {self.device}")
        if device_ids:
            self._ops.check_device(ids, "ids")
        c0, c1 = self.spec.columns(columns)
        ncols = c1 - c0
        dtype = self.spec.output_dtype
        shape = (*ids.shape, ncols)
        if out is not None:
            self._ops.check_device(out, "out")
            check_out(out, shape, dtype, out.device)
        n = ids.numel()
        if n > self.max_rows:
            raise CopyRequestTooLarge(
                f"{n} ids in one request, but staging slots hold max_rows={self.max_rows}; construct the "
                f"CopyBackend with max_rows >= {n} or split the request")
        scale_t, scale_on_cpu = self._scale_t, self._scale_on_cpu
        # ---- admission
        slot, job = self._admit()
        # ---- from here the job owns the slot; failures release it through the normal path
        try:
            job._n = n
            job._ids_dtype = ids.dtype
            job._byte_start = c0 * self._itemsize
            job._ncols = ncols
            job._scale = scale_t
            job._scale_on_cpu = scale_on_cpu
            job._oob_row0 = self._oob_row0
            job._inference = torch.is_inference_mode_enabled()
            if out is None:
                out = torch.empty(shape, dtype=dtype, device=self.device)
            job._out = out
            ops = self._ops
            # flatten before the submit event: a non-contiguous ids tensor is copied on the caller's stream
            flat = ids.reshape(-1)
            caller = ops.current_stream()
            ops.record(slot.submit_event, caller)
            job._recorded.append(slot.submit_event)
            isz = ids.element_size()
            ids_dst = slot.ids_buf[: n * isz].view(ids.dtype)
            if device_ids:
                job._device_ids = (ids, flat)  # owned by the job until the ids copy has completed

                def d2h(dst=ids_dst, src=flat) -> None:
                    dst.copy_(src, non_blocking=True)

                ops.wait_event(self._d2h_stream, slot.submit_event)
                try:
                    ops.enqueue(self._d2h_stream, d2h)
                finally:
                    self._record(job, slot, slot.ids_event, self._d2h_stream)
                # WAR on the caller's ids: the copy above runs after the submit point, later than the
                # caller's stream; order the caller's later work (e.g. the next pass rewriting its
                # input_ids buffer) after it. Device-side only; depends on no worker action.
                ops.wait_event(caller, slot.ids_event)
                job._ids_deadline = time.monotonic() + self.ids_timeout
            elif n:
                ids_dst.copy_(flat)  # snapshot: the caller may reuse its ids at once
        except BaseException as e:
            with self._cond:
                self._fail_locked(job, CopyJobFailed(f"copy job {job.seq} failed at submit: {e}"))
            raise
        try:
            with self._cond:
                # the worker may have died or close() begun since _admit: fail now, do not leave the job to
                # time out in a queue nobody serves
                if self._broken is not None:
                    err = BackendClosed(f"copy job {job.seq}: the copy worker died ({self._broken!r}); build a "
                                        "new CopyBackend")
                    err.__cause__ = self._broken
                    self._fail_locked(job, err)
                    return job
                if self._closing:
                    self._fail_locked(job, BackendClosed("the CopyBackend was closed while this job was submitted"))
                    return job
                self._counts["submitted"] += 1
                # inline only for small CPU-ids requests (serial gather): there the two thread hand-offs
                # dominate; large ones stay on the worker, so one thread drives numba's parallel pool
                if inline and not device_ids and n * ncols * self._itemsize < cpu_gather.PARALLEL_MIN_BYTES:
                    job._state = _RUNNING  # never queued: the worker does not see it
                    self._inline_jobs.add(job)  # close() waits for it before releasing the table
                else:
                    self._pending.append(job)
                    self._cond.notify_all()
                    self._wake.set()
                    return job
            self._run(job, inline=True)  # the caller's thread gathers and launches, as the worker would
            return job
        finally:
            if inline:
                with self._cond:
                    self._inline_jobs.discard(job)
                    self._cond.notify_all()

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

    def _outstanding(self) -> list[tuple[int, str, float, float]]:
        """``(seq, stage, admitted_at, stage_since)`` of every job holding a slot and not finished, read
        without the lock (a job finished on the host is asked about its device work: a query, no wait)."""
        if self._ops.device.type == "cuda":  # event queries from any thread, also during a graph capture
            with RelaxedCaptureMode():
                return self._scan()
        return self._scan()

    def _scan(self) -> list[tuple[int, str, float, float]]:
        found = []
        for slot in self._slots:  # one read of the list: close() swaps in an empty one
            job = slot.job
            if job is None or slot.leaked:  # a leaked slot is counted in stats()['slots_leaked']
                continue
            state, since = job._stage
            if state in (_LAUNCHED, _FAILED):
                if all(self._ops.query(ev) for ev in tuple(job._recorded)) or slot.job is not job:
                    continue  # its device work is done (the slot awaits reclaim), or it was reclaimed
            stage = "ids" if state == _PENDING and job._device_ids is not None else _STAGES[state]
            found.append((job.seq, stage, job._submitted_at, since))
        return found

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
        _live_backends.discard(self)
        if self._owns_table:
            self.table.close()

    def _begin_close_locked(self) -> None:
        """Closing begins (once): no new jobs, pending jobs fail, the worker leaves its loop."""
        if self._closing:
            return
        self._closing = True
        while self._pending:
            job = self._pending.popleft()
            self._fail_locked(job, BackendClosed(f"copy job {job.seq}: the CopyBackend was closed"))
        self._cond.notify_all()
        self._wake.set()

    def _release(self, deadline: float, t: float, *, on_worker: bool) -> None:
        """Second half of close(): once nothing runs a gather, release the slots and an owned table."""
        delay = _POLL_MIN_S
        with self._cond:
            # inline gathers read the table (and launch from the slots) like the worker: wait for them
            while self._inline_jobs and time.monotonic() < deadline:
                self._cond.wait(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, _POLL_MAX_S)
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
                self._cond.wait(_POLL_MAX_S)
            if self._closed:
                return
            self._releasing = True
            delay = _POLL_MIN_S
            while True:
                self._reclaim_locked()
                leaked = sum(1 for sl in self._slots if sl.leaked)
                if len(self._free) + leaked == self.max_in_flight or time.monotonic() >= deadline:
                    break
                self._cond.wait(delay)
                delay = min(delay * 2, _POLL_MAX_S)
            busy = self.max_in_flight - len(self._free)
            self._abandoned = busy
            # drop the preallocated memory (a copy still running holds its own references via its job)
            self._slots = []
            self._free = []
            self._host_block = None
            self._cond.notify_all()
        try:
            if busy:
                log.warning("CopyBackend closed with %d copies not completed after %.3g s (%d leaked slots); "
                            "their pinned staging stays referenced by their jobs (and torch's host allocator)",
                            busy, t, leaked)
            # nothing reads the table any more (worker stopped, no inline runner, closing refuses new ones)
            _live_backends.discard(self)
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

    # ------------------------------------------------------------------ admission and reclaim
    def _admit(self) -> tuple[_Slot, CopyJob]:
        deadline = time.monotonic() + self.admission_timeout
        delay = _POLL_MIN_S
        with self._cond:
            while True:
                self._check_open_locked()
                if not self._free:
                    self._reclaim_locked()
                if self._free:
                    slot = self._free.pop()
                    self._seq += 1
                    job = CopyJob(self, self._seq)
                    job._slot = slot
                    slot.job = job
                    return slot, job
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._counts["overloaded"] += 1
                    raise CopyBackendOverloaded(
                        f"all {self.max_in_flight} copy slots stayed busy for {self.admission_timeout:.3g} s "
                        f"({len(self._pending)} jobs waiting for the CPU gather, the rest for their GPU "
                        "copy); raise max_in_flight to the runtime's bound on passes in flight, or "
                        "admission_timeout to wait for the GPU longer")
                # slot release is observed by polling events (no callback); the lock is released here
                self._cond.wait(min(delay, remaining))
                delay = min(delay * 2, _POLL_MAX_S)

    def _check_open_locked(self) -> None:
        if self._broken is not None:
            raise BackendClosed(f"the copy worker died ({self._broken!r}); build a new CopyBackend") \
                from self._broken
        if self._closing or self._closed:
            raise BackendClosed("the CopyBackend is closed; build a new one")

    def _reclaim_locked(self) -> None:
        """Release slots whose job is finished on the host and whose every recorded event has completed."""
        for slot in self._slots:
            job = slot.job
            if job is None or slot.leaked or job._state not in (_LAUNCHED, _FAILED):
                continue
            if all(self._ops.query(ev) for ev in job._recorded):
                job._copy_complete = True
                job._device_ids = None
                slot.job = None
                self._free.append(slot)
                self._counts["reclaimed"] += 1
                self._cond.notify_all()

    def _fail_locked(self, job: CopyJob, exc: BaseException) -> None:
        job._state = _FAILED
        job._exc = exc
        job._host_done.set()
        self._counts["failed"] += 1
        self._cond.notify_all()

    # ------------------------------------------------------------------ worker
    def _worker_turn(self) -> bool | object:
        """One turn of the worker: run the next ready job (True), find nothing to do (``_IDLE``), or stop
        (False)."""
        job = None
        stop = False
        try:
            job = self._next_job()
            if job is _IDLE:
                return _IDLE
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
                    self._fail_locked(job, CopyJobFailed(f"copy job {job.seq}: the copy worker died: {e!r}"))
                while self._pending:
                    job = self._pending.popleft()
                    self._fail_locked(job, CopyJobFailed(f"copy job {job.seq}: the copy worker died: {e!r}"))
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
        """The next job whose ids are ready; None when closing; ``_IDLE`` when there is none."""
        delay = _POLL_MIN_S
        with self._cond:
            while True:
                if self._closing:
                    return None
                waiting_for_ids = False
                for job in self._pending:
                    if job._device_ids is not None and not self._ops.query(self._slot_of(job).ids_event):
                        if time.monotonic() > job._ids_deadline:
                            self._pending.remove(job)
                            self._fail_locked(job, CopyTimeout(
                                f"copy job {job.seq}: CUDA ids did not reach the host within "
                                f"{self.ids_timeout:.3g} s (the caller's stream did not reach the submit "
                                "point); pass CPU ids or check the model stream"))
                            break  # the deque changed; rescan
                        waiting_for_ids = True
                        continue
                    self._pending.remove(job)
                    job._state = _RUNNING
                    return job
                else:
                    if waiting_for_ids:
                        self._cond.wait(delay)
                        delay = min(delay * 2, _POLL_MAX_S)
                    else:
                        return _IDLE  # the loop waits for submit/close without holding the backend

    @staticmethod
    def _slot_of(job: CopyJob) -> _Slot:
        assert job._slot is not None
        return job._slot

    def _run(self, job: CopyJob, inline: bool = False) -> None:
        """Gather and launch ``job`` (on the worker, or inline on the caller's thread).

        Failures are stored on the job. Inline, a ``KeyboardInterrupt``/``SystemExit`` (any non-``Exception``)
        also fails the job (its slot is released as usual) and then propagates to the caller as itself.
        """
        slot = self._slot_of(job)
        try:
            if self._fault_hook is not None:
                self._fault_hook(job)
            n, isz = job._n, job._ids_dtype.itemsize
            nbytes = job._ncols * self._itemsize
            ids_np = slot.ids_np[: n * isz].view(np.int32 if isz == 4 else np.int64)
            staged = slot.staging_np[: n * nbytes].reshape(n, nbytes)
            scale = job._scale
            # zero rows leave the device multiply as -0.0 for oob="neg_zero", else +0.0
            neg = scale is not None and not job._scale_on_cpu and math.copysign(1.0, float(scale)) < 0
            if n:
                bad = cpu_gather.cpu_gather(self._bytes, ids_np, staged, job._byte_start, job._oob_row0,
                                            self._zero_neg if neg != self._neg_zero else self._zero_pos,
                                            id_base=self._id_base, row_ids=slot.row_ids)
                with self._cond:
                    self._counts["out_of_range_ids"] += bad
                    self._counts["rows"] += n
                    self._counts["lookups"] += 1  # calls with rows, as the gather's device counters count
            if n and job._scale_on_cpu:  # inf/NaN scale: multiply here, then restore +0.0 zero rows
                rows_t = slot.staging[: n * nbytes].view(self.dtype).view(n, job._ncols)
                rows_t.mul_(scale)
                if not job._oob_row0:
                    r = ids_np.astype(np.int64) - self._id_base
                    bad = np.flatnonzero((r < 0) | (r >= self._bytes.shape[0]))
                    rows_t[torch.from_numpy(bad)] = -0.0 if self._neg_zero else 0.0
        except BaseException as e:
            with self._cond:
                self._fail_locked(job, self._wrap(job, "CPU gather", e))
            if inline and not isinstance(e, Exception):
                raise
            return
        with self._cond:
            if self._closing:
                self._fail_locked(job, BackendClosed(f"copy job {job.seq}: the CopyBackend was closed"))
                return
            job._state = _LAUNCHING
        try:
            self._launch(job, slot, n, nbytes)
        except BaseException as e:
            with self._cond:
                self._fail_locked(job, self._wrap(job, "copy launch", e))
            if inline and not isinstance(e, Exception):
                raise
            return
        with self._cond:
            job._state = _LAUNCHED
            job._host_done.set()
            self._counts["launched"] += 1
            self._cond.notify_all()

    @staticmethod
    def _wrap(job: CopyJob, stage: str, e: BaseException) -> BaseException:
        err = CopyJobFailed(f"copy job {job.seq} failed in its {stage}: {e!r}")
        err.__cause__ = e
        return err

    def _launch(self, job: CopyJob, slot: _Slot, n: int, nbytes: int) -> None:
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

        def device_work() -> None:
            if n == 0:
                return
            dev_rows.copy_(src, non_blocking=True)
            if scale is not None:
                dev_rows.mul_(scale)
            if not direct:
                out.copy_(dev_rows.view(out.shape))

        ops.wait_event(stream, slot.submit_event)  # WAR: after every reader enqueued before submit
        try:
            # in the submitter's inference mode (an inference-mode `out` may only be written inside it);
            # no autograd: this is a lookup
            with torch.inference_mode(job._inference), torch.no_grad():
                ops.enqueue(stream, device_work)
        finally:
            self._record(job, slot, slot.done_event, stream)

    def _record(self, job: CopyJob, slot: _Slot, event: Any, stream: Any) -> None:
        """Record ``event`` for ``job`` after device work that uses the slot was (maybe) queued on ``stream``.

        If the record fails, nothing tells when that work ends: the slot is marked leaked and never reused
        (reclaiming it on the event's previous, completed record would hand a live buffer to the next job).
        """
        try:
            self._ops.record(event, stream)
        except BaseException:
            with self._cond:
                slot.leaked = True
                self._counts["slots_leaked"] += 1
            raise
        job._recorded.append(event)

    def device_bytes(self) -> int:
        """Device memory held for conversions (``out_dtype`` differing from the table's), in bytes."""
        return sum(sl.device_buf.numel() * sl.device_buf.element_size()
                   for sl in self._slots if sl.device_buf is not None and sl.device_buf.is_cuda)



def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m

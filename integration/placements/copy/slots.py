"""Admission and slots of the copy placement: a fixed pool of per-job resources, and who may take one.

Design
------
A backend preallocates exactly ``max_in_flight`` slots at construction: one pinned host block cut into
per-slot staging rows (``max_rows * row_bytes``) and ids (``max_rows * 8`` bytes), each part on a
``_SLOT_ALIGN`` boundary, plus per slot an int64 buffer for the torch gather's row ids, three events
(submit, ids-ready, copy-done) and, lazily, a device buffer for conversions. A job holds one slot from
admission until every event recorded for it has completed; then the slot is reclaimed (``event.query()``,
never a wait). The methods here are :class:`SlotAdmission`'s, a part of ``CopyBackend`` (its state, its
one lock ``_cond``): admission, reclaim, the records that tie an event to a job, and the lock-free scan of
the slots that ``progress()`` and ``health()`` read.

Seed rules kept here
--------------------
Seed 000, rule 1 (admission). There are exactly ``max_in_flight`` slots; a job is admitted only with a
free slot, so the internal job list can never overflow (no ``queue.Full``). With no free slot ``submit``
polls (bounded by ``admission_timeout``) for an earlier job's copy to complete on the GPU -- which needs
no action of the caller, so the wait cannot deadlock -- then raises :class:`CopyBackendOverloaded`. All
checks and the admission happen before anything is mutated: a refused job has recorded no event, touched
no buffer and queued nothing.

Seed 000, rule 2 (events). Each slot owns its events; a slot belongs to one job at a time and is reused
only after every event recorded for its previous job has completed, so no event is ever shared by two
jobs in flight.

Seed 000, rule 3 (ownership), the slot's part. Completion is observed with ``event.query()`` (by
``submit`` looking for a slot, by the worker, by ``close``) -- the worker never blocks on the GPU. When
recording an event fails after the job's device work was queued, nothing can tell when that work is done:
the slot stays owned by the job for the backend's lifetime (``stats()['slots_leaked']``) rather than being
reused under a copy that may still run.

Seeds 000 and 002 (progress, not liveness). :meth:`SlotAdmission._outstanding` takes no lock: it reads each
slot's job and its ``(state, since)`` pair (one attribute, set at every transition, so never torn), and
asks a job done on the host whether the device work recorded for it has completed (a query; a slot's
events are re-recorded only for a next job, after ``slot.job`` changed, so a query followed by
``slot.job`` still being the job was about that job).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from uvaple.kernels.capture import RelaxedCaptureMode

from ...errors import BackendClosed, CopyBackendOverloaded
from .device_ops import DeviceOps
from .job import FAILED, LAUNCHED, PENDING, STAGES, CopyJob

__all__ = ["Slot", "SlotAdmission", "allocate_slots", "DEFAULT_MAX_IN_FLIGHT", "DEFAULT_MAX_ROWS",
           "DEFAULT_ADMISSION_TIMEOUT_S", "POLL_MIN_S", "POLL_MAX_S"]

# Async scheduling keeps up to two passes in flight (seed 000: the overlap that broke the depth-1 queue);
# four covers that with margin for pipelined prefetch. Derive it from your runtime's bound.
DEFAULT_MAX_IN_FLIGHT = 4
# vLLM's usual max_num_batched_tokens; one slot stages this many rows.
DEFAULT_MAX_ROWS = 8192
# Default bound of the wait for a slot (seconds). Far above any healthy forward pass (ms); hitting it
# means the GPU or the caller stopped making progress, and the named error says which wait it was.
DEFAULT_ADMISSION_TIMEOUT_S = 10.0
# Polling of GPU completion (no callback exists without cudaLaunchHostFunc): back off from 20 us, about
# the cost of a Python sleep round trip, to 1 ms, well under a forward pass.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
# Staging slots start on 4 KiB boundaries (page aligned DMA sources, any dtype view is aligned).
_SLOT_ALIGN = 4096


class Slot:
    """Preallocated resources of one job in flight: staging rows, ids, events, device buffer."""

    def __init__(self, index: int, staging: torch.Tensor, ids_buf: torch.Tensor, ops: DeviceOps) -> None:
        self.index = index
        self.staging = staging  # uint8 [max_rows * row_bytes], pinned
        self.staging_np = staging.numpy()
        self.ids_buf = ids_buf  # uint8 [max_rows * 8], pinned (int32/int64 views)
        self.ids_np = ids_buf.numpy()
        # int64 [max_rows]: the rows read by the gather's torch path (host_gather's row_ids), not pinned
        self.row_ids = np.empty(ids_buf.numel() // 8, dtype=np.int64)
        self.submit_event = ops.new_event()  # recorded on the caller's stream at submit
        self.ids_event = ops.new_event()  # recorded on the d2h stream after the ids copy (CUDA ids)
        self.done_event = ops.new_event()  # recorded on the copy stream after the job's last copy
        self.device_buf: torch.Tensor | None = None  # table-dtype rows for casts / strided out, lazily
        self.job: CopyJob | None = None
        # an event record failed after device work was queued: that work's end is unknowable, so the slot
        # is never reused (owned by its last job for the backend's lifetime)
        self.leaked = False


def allocate_slots(ops: DeviceOps, max_in_flight: int, max_rows: int, row_bytes: int
                   ) -> tuple[torch.Tensor, list[Slot]]:
    """One pinned host block of ``max_in_flight`` slots (staging rows, then ids) and the slots cut from it."""
    staging_bytes = _round_up(max_rows * row_bytes, _SLOT_ALIGN)
    ids_bytes = _round_up(max_rows * 8, _SLOT_ALIGN)
    per_slot = staging_bytes + ids_bytes
    host_block = ops.alloc_host(per_slot * max_in_flight)
    slots = []
    for i in range(max_in_flight):
        base = i * per_slot
        slots.append(Slot(i, host_block[base: base + staging_bytes],
                          host_block[base + staging_bytes: base + per_slot], ops))
    return host_block, slots


class SlotAdmission:
    """``CopyBackend``'s admission and reclaim of its slots (state and lock are the backend's)."""

    def _admit(self) -> tuple[Slot, CopyJob]:
        deadline = time.monotonic() + self.admission_timeout
        delay = POLL_MIN_S
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
                delay = min(delay * 2, POLL_MAX_S)

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
            if job is None or slot.leaked or job._state not in (LAUNCHED, FAILED):
                continue
            if all(self._ops.query(ev) for ev in job._recorded):
                job._copy_complete = True
                job._device_ids = None
                slot.job = None
                self._free.append(slot)
                self._counts["reclaimed"] += 1
                self._cond.notify_all()

    def _release_slots_locked(self, deadline: float) -> tuple[int, int]:
        """At close, once nothing gathers: wait (until ``deadline``) for every slot's events, then drop the
        slots and the pinned block. Returns the slots still busy (their copies hold their own references
        through their jobs, and torch's host allocator) and how many of them leaked."""
        delay = POLL_MIN_S
        while True:
            self._reclaim_locked()
            leaked = sum(1 for sl in self._slots if sl.leaked)
            if len(self._free) + leaked == self.max_in_flight or time.monotonic() >= deadline:
                break
            self._cond.wait(delay)
            delay = min(delay * 2, POLL_MAX_S)
        busy = self.max_in_flight - len(self._free)
        self._abandoned = busy
        # drop the preallocated memory (a copy still running holds its own references via its job)
        self._slots = []
        self._free = []
        self._host_block = None
        self._cond.notify_all()
        return busy, leaked

    def _record(self, job: CopyJob, slot: Slot, event: Any, stream: Any) -> None:
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
            if state in (LAUNCHED, FAILED):
                if all(self._ops.query(ev) for ev in tuple(job._recorded)) or slot.job is not job:
                    continue  # its device work is done (the slot awaits reclaim), or it was reclaimed
            stage = "ids" if state == PENDING and job._device_ids is not None else STAGES[state]
            found.append((job.seq, stage, job._submitted_at, since))
        return found


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m

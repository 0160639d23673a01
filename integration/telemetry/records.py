"""Progress, not liveness: what a lookup has certainly done (:class:`Progress`), and the copy placement's
verdict on whether its work moves (:class:`Health`).

A lookup's ``stats()`` is exact but synchronises: on a GPU it waits until every kernel queued on the device
has finished, which in a serving process stalls the caller behind the model's queued work. A health check
or a metrics scrape needs something else: *the latest values the device has certainly reached*, and how
old they may be, at no cost to the model. That is ``lookup.progress()``, a :class:`Progress`:

* ``GatherLookup`` (``uva``/``device``): the newest completed copy of its device counters
  (:class:`~uvaple.integration.telemetry.snapshots.CounterSnapshots`), with its age.
* ``CopyBackend`` (``copy``): its counters are host integers; ``progress()`` reads them without the
  backend's lock and adds the oldest outstanding copy job (its sequence number, stage and age).
  ``CopyBackend.health(stall_s)`` turns that into a :class:`Health`: work outstanding that has not
  finished for ``stall_s`` seconds is unhealthy, naming the job and the stage it is stuck in (seeds 000
  and 002: ``/health`` said 200 while nothing progressed).

Plain frozen records: no torch, no lock, nothing imported beyond the standard library.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Progress", "Health"]


@dataclasses.dataclass(frozen=True)
class Progress:
    """What a lookup has certainly done, read without a host synchronisation (``lookup.progress()``).

    A field is None where the lookup does not keep it (``count=False``, no hot set, not the copy placement).

    Attributes
    ----------
    kind : str
        The placement (``uva``, ``device``, ``copy``).
    closed : bool
        The lookup was closed (its counters are final).
    lookups, rows, out_of_range_ids : int
        Calls with at least one id, ids served, ids outside the table (as ``stats()``).
    bytes : int
        ``rows`` x the table's row bytes (whole rows: a column range reads fewer).
    hot_hits : int
        Ids served from the hot set (a lookup with ``hot=``).
    age_s : float
        How old the values may be, in seconds: since the snapshot's device-to-host copy was enqueued (the
        device had done at least the counted work then). 0.0 for a plain host read (CPU, copy placement).
        A growing age means the device ran not even a 32-byte copy since.
    outstanding : int
        Copy placement: jobs admitted and not finished (host gather, launch or device copy).
    oldest_job, oldest_stage, oldest_age_s :
        Copy placement: the oldest outstanding job's sequence number, stage (``queued``, ``ids``,
        ``gather``, ``launch``, ``copy``, ``failed``: see ``CopyBackend.health``) and seconds since it
        was admitted; None when nothing is outstanding.
    """

    kind: str
    closed: bool = False
    lookups: int | None = None
    rows: int | None = None
    bytes: int | None = None
    out_of_range_ids: int | None = None
    hot_hits: int | None = None
    age_s: float | None = None
    outstanding: int | None = None
    oldest_job: int | None = None
    oldest_stage: str | None = None
    oldest_age_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Health:
    """The copy placement's progress verdict (``CopyBackend.health(stall_s)``).

    Attributes
    ----------
    healthy : bool
        False when a job has been outstanding for more than ``stall_s`` seconds, or the backend's worker
        died, or it is closed.
    reason : str
        One sentence: what is outstanding, what is stuck where, since when.
    oldest_job : int or None
        Sequence number (``CopyJob.seq``) of the oldest outstanding job.
    stage : str or None
        Its stage: ``queued`` (waiting for the worker), ``ids`` (its CUDA ids are being copied to the
        host, then the worker takes it), ``gather`` (CPU gather), ``launch`` (enqueueing its copy),
        ``copy`` (its device copy has not completed), ``failed`` (failed on the host; device work recorded
        for it has not completed, so its slot is still held).
    age_s : float
        Seconds since the oldest outstanding job was admitted (0.0 when none is).
    stage_age_s : float
        Seconds it has been in its current stage.
    outstanding : int
        Jobs admitted and not finished.
    """

    healthy: bool
    reason: str
    oldest_job: int | None = None
    stage: str | None = None
    age_s: float = 0.0
    stage_age_s: float = 0.0
    outstanding: int = 0


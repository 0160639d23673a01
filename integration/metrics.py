"""Progress, not liveness: counters read without a host synchronisation, and their Prometheus export.

A lookup's ``stats()`` is exact but synchronises: on a GPU it waits until every kernel queued on the device
has finished, which in a serving process stalls the caller behind the model's queued work. A health check
or a metrics scrape needs something else: *the latest values the device has certainly reached*, and how
old they may be, at no cost to the model. That is ``lookup.progress()``:

* ``GatherLookup`` (``uva``/``device``): :class:`CounterSnapshots` copies the device counters to pinned
  host memory on a side stream the lookup owns and returns the newest copy that has completed
  (``event.query()``, never a synchronisation), with its age. Stale by at most ``age_s``; never torn.
* ``CopyBackend`` (``copy``): its counters are host integers; ``progress()`` reads them without the
  backend's lock and adds the oldest outstanding copy job (its sequence number, stage and age).
  ``CopyBackend.health(stall_s)`` turns that into a verdict (:class:`Health`): work outstanding that has
  not finished for ``stall_s`` seconds is unhealthy, naming the job and the stage it is stuck in.

:func:`register_prometheus` exports both through ``prometheus_client`` (imported only when called) with a
collector that reads ``progress()`` at scrape time: no synchronisation, no thread of its own. Where another
process serves ``/metrics`` (vLLM's API server, for its engine processes), :class:`MultiprocessExporter`
pushes the same series into ``prometheus_client``'s multiprocess files from one daemon thread instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from uvaple.kernels.capture import RelaxedCaptureMode

from ._fork import ForkSafeLock, gate_fork, keep_in_child

__all__ = ["Progress", "Health", "CounterSnapshots", "ProgressCollector",
           "register_prometheus", "MultiprocessExporter", "multiprocess_dir"]

log = logging.getLogger("uvaple.integration.metrics")


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


# ----------------------------------------------------------------------------------- non-blocking counter read
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


# ----------------------------------------------------------------------------------- Prometheus
_COUNTERS = (  # (Progress field, metric name, help)
    ("lookups", "uvaple_lookups", "Lookup calls with at least one id."),
    ("rows", "uvaple_rows", "Ids served (rows gathered)."),
    ("bytes", "uvaple_bytes", "Bytes of the rows served (rows x row bytes)."),
    ("out_of_range_ids", "uvaple_out_of_range_ids", "Ids outside the table (served as the oob policy says)."),
    ("hot_hits", "uvaple_hot_hits", "Ids served from the hot set in device memory."),
)
_LABELS = ["lookup", "placement"]


class _NamedLookups:
    """Lookups held weakly under names (the label ``lookup=name`` of their series)."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._refs: dict[str, weakref.ref] = {}

    def add(self, name: str, lookup) -> None:
        """Export ``lookup`` (anything with ``progress()`` and ``kind``) under the label ``lookup=name``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a lookup's name must be a non-empty str, got {name!r}")
        if not callable(getattr(lookup, "progress", None)):
            raise TypeError(f"{name!r}: {type(lookup).__name__} has no progress(); pass a uvaple Lookup")
        with self._lock:
            self._check_open()
            if name in self._refs and self._refs[name]() is not None:
                raise ValueError(f"a lookup named {name!r} is already exported; names label the series")
            self._refs[name] = weakref.ref(lookup)
            self._added(name)

    def remove(self, name: str) -> None:
        with self._lock:
            self._refs.pop(name, None)

    def _check_open(self) -> None:
        pass

    def _added(self, name: str) -> None:
        pass

    def _progress(self, where: str):
        """``(name, Progress)`` of every live lookup; dead names dropped, a failing lookup logged and skipped."""
        with self._lock:
            refs = list(self._refs.items())
        for name, ref in refs:
            lk = ref()
            if lk is None:
                with self._lock:
                    if self._refs.get(name) is ref:
                        del self._refs[name]
                continue
            try:
                p = lk.progress()
            except Exception as e:  # noqa: BLE001 - one broken lookup must not stop the others' metrics
                log.warning("uvaple: progress() of lookup %r failed %s: %s", name, where, e)
                continue
            yield name, p


class ProgressCollector(_NamedLookups):
    """A ``prometheus_client`` collector over named lookups; ``collect()`` reads each one's ``progress()``.

    Holds the lookups weakly: a lookup dropped or closed disappears from the next scrape. Register one
    collector per registry (the metric names are declared by :meth:`describe`); :meth:`add` and
    :meth:`remove` change the lookups it exports.
    """

    def __init__(self, lookups: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        super().__init__()
        items = lookups.items() if isinstance(lookups, Mapping) else lookups
        for name, lk in items:
            self.add(name, lk)

    def describe(self):
        return self._families()

    def collect(self):
        families = self._families()
        counters, age, outstanding, oldest = (families[:len(_COUNTERS)], *families[len(_COUNTERS):])
        for name, p in self._progress("at scrape"):
            if p.closed:
                continue
            labels = [name, p.kind]
            for (field, _, _), fam in zip(_COUNTERS, counters, strict=True):
                value = getattr(p, field)
                if value is not None:
                    fam.add_metric(labels, value)
            if p.age_s is not None:
                age.add_metric(labels, p.age_s)
            if p.outstanding is not None:
                outstanding.add_metric(labels, p.outstanding)
                if p.oldest_job is not None:
                    oldest.add_metric([*labels, p.oldest_stage], p.oldest_age_s)
        return families

    @staticmethod
    def _families() -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        return [
            *(CounterMetricFamily(metric, doc, labels=_LABELS) for _, metric, doc in _COUNTERS),
            GaugeMetricFamily("uvaple_snapshot_age_seconds", "How old the exported counter values may be: "
                              "seconds since their device-to-host copy was enqueued (0 for host counters).",
                              labels=_LABELS),
            GaugeMetricFamily("uvaple_copy_outstanding_jobs", "Copy placement: jobs admitted and not finished.",
                              labels=_LABELS),
            GaugeMetricFamily("uvaple_copy_oldest_job_age_seconds", "Copy placement: seconds since the oldest "
                              "outstanding job was admitted, labelled with the stage it is in.",
                              labels=[*_LABELS, "stage"]),
        ]


def register_prometheus(lookups: Mapping[str, Any] | Iterable[tuple[str, Any]], registry=None) -> ProgressCollector:
    """Export ``lookups`` (``{name: lookup}``) to Prometheus; returns the registered :class:`ProgressCollector`.

    Metrics (labels ``lookup`` = the name given, ``placement`` = the lookup's kind): the counters
    ``uvaple_lookups_total``, ``uvaple_rows_total``, ``uvaple_bytes_total``,
    ``uvaple_out_of_range_ids_total``, ``uvaple_hot_hits_total`` (with a hot set); the gauges
    ``uvaple_snapshot_age_seconds``, and for the copy placement ``uvaple_copy_outstanding_jobs`` and
    ``uvaple_copy_oldest_job_age_seconds{stage=...}`` (alert on it exceeding your stall threshold). Every
    scrape reads ``progress()``: no host synchronisation, no background thread.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (default: ``prometheus_client.REGISTRY``).
    Unregister with ``registry.unregister(collector)``. Needs ``prometheus_client`` (imported here only).
    """
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("register_prometheus needs prometheus_client: pip install prometheus_client") from e
    collector = ProgressCollector(lookups)
    (prometheus_client.REGISTRY if registry is None else registry).register(collector)
    return collector


# ----------------------------------------------------------------------------------- multiprocess push (vLLM)
def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when it names a directory (this process then writes
    ``prometheus_client``'s multiprocess files there), else None. vLLM's API server aggregates that
    directory into its ``/metrics`` whenever the variable is set; it sets the variable itself only when it
    runs several API server processes, so for a single one set it (an empty directory) before ``vllm
    serve``: its engine processes inherit it."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")
    return path if path and os.path.isdir(path) else None


_PUSH_METRICS: dict | None = None  # made once, whole, under _PUSH_LOCK; read without it afterwards
_PUSH_LOCK = ForkSafeLock()
# push interval bounds (seconds): a scrape every few seconds needs no more; below this a thread would spin
MIN_PUSH_INTERVAL_S = 0.01


def _push_metrics() -> dict:
    """This process's metric objects for :class:`MultiprocessExporter` (one set: multiprocess values are
    keyed by name and labels in this process's files), not registered in any registry."""
    global _PUSH_METRICS
    if _PUSH_METRICS is not None:
        return _PUSH_METRICS
    with _PUSH_LOCK:
        if _PUSH_METRICS is None:
            try:
                from prometheus_client import Counter, Gauge
            except ImportError as e:
                raise ImportError("MultiprocessExporter needs prometheus_client: pip install prometheus_client") \
                    from e
            made = {field: Counter(metric, doc, _LABELS, registry=None) for field, metric, doc in _COUNTERS}
            # one writer per series (a lookup's name is its layer and rank), except data-parallel replicas of
            # a rank: the largest age, the sum of outstanding jobs, over processes that have not closed
            made["age_s"] = Gauge("uvaple_snapshot_age_seconds", "How old the exported counter values may be "
                                  "(the largest over live processes).", _LABELS, registry=None,
                                  multiprocess_mode="livemax")
            made["outstanding"] = Gauge("uvaple_copy_outstanding_jobs", "Copy placement: jobs admitted and not "
                                        "finished.", _LABELS, registry=None, multiprocess_mode="livesum")
            made["oldest_age_s"] = Gauge("uvaple_copy_oldest_job_age_seconds", "Copy placement: seconds since "
                                         "the oldest outstanding job was admitted (0 when none is), the largest "
                                         "over live processes; its stage: CopyBackend.health().", _LABELS,
                                         registry=None, multiprocess_mode="livemax")
            _PUSH_METRICS = made
        return _PUSH_METRICS


def _close_at_exit(ref: weakref.ref) -> None:
    exporter = ref()
    if exporter is not None:
        exporter.close(timeout_s=1.0)


class MultiprocessExporter(_NamedLookups):
    """Push named lookups' ``progress()`` into ``prometheus_client``'s multiprocess metrics every
    ``interval_s`` seconds, from one daemon thread: how a process that serves no HTTP endpoint of its own
    (a vLLM engine process) reaches the ``/metrics`` of the process that does.

    With ``PROMETHEUS_MULTIPROC_DIR`` naming a directory (:func:`multiprocess_dir`), every process writes
    its ``prometheus_client`` values into files there, and a server's ``/metrics`` aggregates them (vLLM's
    API server does whenever the variable is set). A collector read at scrape time
    (:func:`register_prometheus`) cannot cross that process boundary; values written to those files can.
    Without the variable the values stay in this process's memory. The series are the collector's:
    ``uvaple_lookups_total`` ... ``uvaple_hot_hits_total`` (counters: each process adds what its lookups
    did since its last push, so the aggregated sum is the total over processes), and the gauges
    ``uvaple_snapshot_age_seconds``, ``uvaple_copy_outstanding_jobs``,
    ``uvaple_copy_oldest_job_age_seconds`` (over the processes that have not closed their exporter; a
    process killed outright leaves its last values until ``prometheus_client.multiprocess
    .mark_process_dead`` is called for it). Values are at most ``interval_s`` plus the snapshot's age old.

    The thread only reads ``progress()`` (no host synchronisation, nothing enqueued on the model's
    streams; safe during graph capture on any thread) and writes the metric files. It starts with the
    first :meth:`add` and holds the lookups weakly (a dropped or closed lookup's series stay as they
    were). A fork waits for a push in progress to end (:func:`~uvaple.integration._fork.gate_fork`), so
    the child finds whole values and free locks (its own, the lookups', and ``prometheus_client``'s as far
    as uvaple's pushes hold it). A forked child exports only the lookups added there: the parent's refuse
    use in the child, and the parent pushes their counts. :meth:`close` (also run at interpreter exit)
    stops it and pushes once more, both within ``timeout_s``, and retires this process's gauges.
    """

    def __init__(self, interval_s: float = 5.0) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or \
                not MIN_PUSH_INTERVAL_S <= interval_s < 1e6:
            raise ValueError(f"interval_s must be a number of seconds from {MIN_PUSH_INTERVAL_S}, got {interval_s!r}")
        _push_metrics()  # prometheus_client is needed: fail here, not in the thread
        super().__init__()
        self.interval_s = float(interval_s)
        # one push at a time (deltas are read, added and stored together), and never split by a fork: a child
        # finds whole values and free locks, the ones this push takes (its own, the lookups', prometheus_client's)
        self._push_lock = gate_fork(ForkSafeLock())
        self._last: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.pushes = 0
        atexit.register(_close_at_exit, weakref.ref(self))

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise RuntimeError("this MultiprocessExporter is closed")

    def add(self, name: str, lookup) -> None:
        """Push ``lookup``'s progress under ``lookup=name`` from now on (starts the thread)."""
        self._after_fork()
        super().add(name, lookup)

    def _added(self, name: str) -> None:  # under self._lock
        self._last[name] = {}
        self._start()

    def _start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="uvaple-metrics", daemon=True)
            self._thread.start()

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's lookups (they refuse use here, and the parent pushes
        their counts: the child pushing them too would count them twice); the thread starts again with the
        next :meth:`add`. The locks are :class:`ForkSafeLock`: free in the child."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        stop = threading.Event()  # the parent's thread may have held the event's own lock at the fork
        if self._stop.is_set():
            stop.set()
        self._stop, self._thread = stop, None
        with self._lock:
            self._refs.clear()
            self._last.clear()

    def push(self) -> None:
        """Write every live lookup's progress now (the thread calls this every ``interval_s``)."""
        self._after_fork()
        m = _push_metrics()
        with self._push_lock:
            for name, p in self._progress("in the metrics push"):
                labels = (name, p.kind)
                last = self._last.setdefault(name, {})
                for field, _, _ in _COUNTERS:
                    value = getattr(p, field)
                    if value is not None and value > last.get(field, 0):
                        m[field].labels(*labels).inc(value - last.get(field, 0))
                        last[field] = value
                for field in ("age_s", "outstanding", "oldest_age_s"):
                    value = getattr(p, field)
                    if field == "oldest_age_s" and value is None and p.outstanding is not None:
                        value = 0.0
                    if value is not None:
                        m[field].labels(*labels).set(value)
            self.pushes += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.push()
            except Exception as e:  # noqa: BLE001 - a metrics failure must never end the server
                log.warning("uvaple: metrics push failed: %s", e)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, push once more and retire this process's gauges (``mark_process_dead``: the live
        gauge modes then leave it out), all within ``timeout_s`` (a stuck push is logged and left).
        Idempotent."""
        self._after_fork()
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            thread = self._thread
        deadline = time.monotonic() + timeout_s
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("uvaple: the metrics thread did not stop within %.3g s (a push is stuck); the "
                            "last values pushed stay", timeout_s)
                return
        # the last push on a thread of its own, joined within what is left of timeout_s: a lock held for
        # ever (prometheus_client's, in a child forked while another thread updated a metric) cannot hold
        # this caller, nor the interpreter's exit
        try:
            last = threading.Thread(target=self._final_push, name="uvaple-metrics-close", daemon=True)
            last.start()
        except RuntimeError:  # no new thread at interpreter shutdown (Python >= 3.12): push here
            self._final_push()
            return
        last.join(max(0.0, deadline - time.monotonic()))
        if last.is_alive():
            log.warning("uvaple: the final metrics push did not finish within %.3g s; the last values pushed "
                        "stay", timeout_s)

    def _final_push(self) -> None:
        try:
            self.push()
            if multiprocess_dir() is not None:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(os.getpid())
        except Exception as e:  # noqa: BLE001
            log.warning("uvaple: final metrics push failed: %s", e)

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and self._pid == os.getpid()

"""The multiprocess push: :class:`MultiprocessExporter`, and :func:`multiprocess_dir`.

Where another process serves ``/metrics`` (vLLM's API server, for its engine processes), a collector read
at scrape time (:mod:`.prometheus`) cannot cross the process boundary. :class:`MultiprocessExporter`
pushes the same series into ``prometheus_client``'s multiprocess files from one daemon thread that only
calls ``progress()``; a fork waits for a push in progress (``fork.gate_fork``), so a child finds whole
values and free locks.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

from ..fork import ForkSafeLock, gate_fork
from .prometheus import COUNTERS, LABELS, NamedLookups

__all__ = ["MultiprocessExporter", "multiprocess_dir"]

log = logging.getLogger("uvaple.integration.telemetry")


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
            made = {field: Counter(metric, doc, LABELS, registry=None) for field, metric, doc in COUNTERS}
            # one writer per series (a lookup's name is its layer and rank), except data-parallel replicas of
            # a rank: the largest age, the sum of outstanding jobs, over processes that have not closed
            made["age_s"] = Gauge("uvaple_snapshot_age_seconds", "How old the exported counter values may be "
                                  "(the largest over live processes).", LABELS, registry=None,
                                  multiprocess_mode="livemax")
            made["outstanding"] = Gauge("uvaple_copy_outstanding_jobs", "Copy placement: jobs admitted and not "
                                        "finished.", LABELS, registry=None, multiprocess_mode="livesum")
            made["oldest_age_s"] = Gauge("uvaple_copy_oldest_job_age_seconds", "Copy placement: seconds since "
                                         "the oldest outstanding job was admitted (0 when none is), the largest "
                                         "over live processes; its stage: CopyBackend.health().", LABELS,
                                         registry=None, multiprocess_mode="livemax")
            _PUSH_METRICS = made
        return _PUSH_METRICS


def _close_at_exit(ref: weakref.ref) -> None:
    exporter = ref()
    if exporter is not None:
        exporter.close(timeout_s=1.0)


class MultiprocessExporter(NamedLookups):
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
    were). A fork waits for a push in progress to end (:func:`~uvaple.integration.fork.gate_fork`), so
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
                for field, _, _ in COUNTERS:
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


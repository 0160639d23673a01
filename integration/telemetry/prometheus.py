"""The Prometheus export read at scrape time: :func:`register_prometheus` and its :class:`ProgressCollector`.

A collector reads every named lookup's ``progress()`` when scraped: no host synchronisation, no thread of
its own, ``prometheus_client`` imported only when called. :data:`COUNTERS` and :data:`LABELS` name the
series, and :class:`NamedLookups` holds the lookups weakly under their names; the multiprocess exporter
(:mod:`.exporter`) pushes the same series.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from ..fork import ForkSafeLock

__all__ = ["ProgressCollector", "register_prometheus"]

log = logging.getLogger("uvaple.integration.telemetry")

COUNTERS = (  # (Progress field, metric name, help)
    ("lookups", "uvaple_lookups", "Lookup calls with at least one id."),
    ("rows", "uvaple_rows", "Ids served (rows gathered)."),
    ("bytes", "uvaple_bytes", "Bytes of the rows served (rows x row bytes)."),
    ("out_of_range_ids", "uvaple_out_of_range_ids", "Ids outside the table (served as the oob policy says)."),
    ("hot_hits", "uvaple_hot_hits", "Ids served from the hot set in device memory."),
)
LABELS = ["lookup", "placement"]


class NamedLookups:
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


class ProgressCollector(NamedLookups):
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
        counters, age, outstanding, oldest = (families[:len(COUNTERS)], *families[len(COUNTERS):])
        for name, p in self._progress("at scrape"):
            if p.closed:
                continue
            labels = [name, p.kind]
            for (field, _, _), fam in zip(COUNTERS, counters, strict=True):
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
            *(CounterMetricFamily(metric, doc, labels=LABELS) for _, metric, doc in COUNTERS),
            GaugeMetricFamily("uvaple_snapshot_age_seconds", "How old the exported counter values may be: "
                              "seconds since their device-to-host copy was enqueued (0 for host counters).",
                              labels=LABELS),
            GaugeMetricFamily("uvaple_copy_outstanding_jobs", "Copy placement: jobs admitted and not finished.",
                              labels=LABELS),
            GaugeMetricFamily("uvaple_copy_oldest_job_age_seconds", "Copy placement: seconds since the oldest "
                              "outstanding job was admitted, labelled with the stage it is in.",
                              labels=[*LABELS, "stage"]),
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


"""Telemetry: progress, not liveness. Counters read without a host synchronisation, and their export.

* :mod:`.records`: :class:`Progress` (``lookup.progress()``) and :class:`Health` (``CopyBackend.health``).
* :mod:`.snapshots`: :class:`CounterSnapshots`, the non-blocking read of a lookup's device counters.
* :mod:`.prometheus`: :func:`register_prometheus`, a collector that reads ``progress()`` at scrape time.
* :mod:`.exporter`: :class:`MultiprocessExporter`, the push into ``prometheus_client``'s multiprocess files
  from one daemon thread, where another process serves ``/metrics`` (vLLM's API server).

``prometheus_client`` is imported only by the calls that need it.
"""

from .exporter import MultiprocessExporter, multiprocess_dir
from .prometheus import ProgressCollector, register_prometheus
from .records import Health, Progress
from .snapshots import CounterSnapshots

__all__ = ["Progress", "Health", "CounterSnapshots", "ProgressCollector",
           "register_prometheus", "MultiprocessExporter", "multiprocess_dir"]

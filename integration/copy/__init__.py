"""The ``copy`` placement: the classic copy-based PLE path (worker thread, CPU gather, staged copy).

The baseline every UVA claim is compared against, and the fallback where host memory cannot be mapped
into the GPU; it implements :class:`uvaple.integration.lookup.Lookup`. Built so that it cannot wedge:
see :mod:`uvaple.integration.copy.backend` (jobs, slots, events, shutdown),
:mod:`~uvaple.integration.copy.cpu_gather` (the numba gather) and
:mod:`~uvaple.integration.copy.device_ops` (the stream operations, swappable for tests).
"""

from .backend import CopyBackend, CopyJob

__all__ = ["CopyBackend", "CopyJob"]

"""The ``copy`` placement: the classic copy-based PLE path (worker thread, CPU gather, staged copy).

The baseline every UVA claim is compared against, and the fallback where host memory cannot be mapped
into the GPU; it implements :class:`uvaple.integration.lookup.Lookup`. Built so that it cannot wedge:
:mod:`.backend` (``CopyBackend``: the ``Lookup`` API, health, closing, and which module keeps which seed
rule), :mod:`.slots` (admission and slots), :mod:`.job` (``CopyJob`` and its states), :mod:`.worker`
(the worker thread and its exit hook), :mod:`.policy` (scale and out-of-range rows, exactly as
``gather_rows``), :mod:`.device_ops` (the stream operations, swappable for tests). Its CPU gather is
:mod:`uvaple.integration.placements.host_gather`.
"""

from .backend import CopyBackend
from .job import CopyJob

__all__ = ["CopyBackend", "CopyJob"]

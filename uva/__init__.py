"""Host memory: tables in pinned, mapped host memory that the GPU reads through UVA.

``host_table`` (the ``HostTable`` object: properties, views, fills, lifetime), ``views`` (views that
hold the memory they read), ``memory`` (geometry, private mapping, page commit, registration),
``sharing`` (named tables: create-or-attach, the creator's fill, readiness), ``segments`` (the shared
segment files' protocol), ``reaper`` (a killed process's segments removed by its watcher), ``loading``
(safetensors), ``table_file`` (a table as a file on disk, read a page at a time), ``row_cache`` (a disk
table's rows held by slot in host memory), ``page_reader`` (a step's missing rows read with many reads in
flight), ``uring`` (its io_uring from the calling thread), ``workers`` (work split over the host's cores),
``cuda_runtime`` and ``system`` (checked CUDA runtime and libc calls), ``_region`` (when a mapping is
released). Importing it changes nothing global.
"""

from .errors import (
    CheckpointError,
    DeviceCapabilityError,
    HostMemoryError,
    RegistrationError,
    SharedSegmentError,
    SharedSegmentTimeout,
    TableClosedError,
    TableForkedError,
    UvapleError,
)
from .host_table import HostTable
from .memory import SUPPORTED_DTYPES, row_stride_bytes
from .page_reader import PageReader, ReadTimeout
from .row_cache import Misses, RowCache, RowCacheFull
from .table_file import RowSource, TableFile, TableFileError, write_table_file

__all__ = [
    "HostTable",
    "TableFile",
    "TableFileError",
    "write_table_file",
    "RowSource",
    "RowCache",
    "PageReader",
    "ReadTimeout",
    "RowCacheFull",
    "Misses",
    "SUPPORTED_DTYPES",
    "row_stride_bytes",
    "UvapleError",
    "HostMemoryError",
    "RegistrationError",
    "DeviceCapabilityError",
    "CheckpointError",
    "SharedSegmentError",
    "SharedSegmentTimeout",
    "TableClosedError",
    "TableForkedError",
]

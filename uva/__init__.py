"""Host memory: tables in pinned, mapped host memory that the GPU reads through UVA."""

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
from .host_table import SUPPORTED_DTYPES, HostTable, row_stride_bytes

__all__ = [
    "HostTable",
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

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


def capabilities(*args, **kwargs):
    """What this machine can do for the UVA path (see :func:`uvaple.uva.doctor.capabilities`)."""
    from .doctor import capabilities as _capabilities

    return _capabilities(*args, **kwargs)


__all__ = [
    "HostTable",
    "SUPPORTED_DTYPES",
    "row_stride_bytes",
    "capabilities",
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

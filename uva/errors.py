"""Named errors of the host-memory layer.

Every failure a user can hit while allocating, registering, loading or sharing a host table raises one
of these. Each message says what failed and what to do about it; none leaves memory mapped, registered
or half-written behind (the constructors clean up before raising).
"""

from __future__ import annotations

__all__ = [
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


class UvapleError(RuntimeError):
    """Base of every error uvaple raises on purpose."""


class HostMemoryError(UvapleError, MemoryError):
    """Host memory could not be mapped or populated (too large for free memory, mmap refused, ...)."""


class RegistrationError(UvapleError):
    """``cudaHostRegister`` (or a related CUDA runtime call) refused the table's memory."""


class DeviceCapabilityError(UvapleError):
    """The GPU (or its absence) cannot read registered host memory through a host pointer."""


class CheckpointError(UvapleError, ValueError):
    """A checkpoint or array to load is missing, truncated, corrupt, or of the wrong name/dtype/shape."""


class SharedSegmentError(UvapleError):
    """A named shared segment is missing, already exists, or does not match what was asked for."""


class SharedSegmentTimeout(SharedSegmentError, TimeoutError):
    """A bounded wait for a shared segment ran out (its creator still filling it, or a lock held)."""


class TableClosedError(UvapleError):
    """The host table was used after ``close()``."""


class TableForkedError(UvapleError):
    """A host table inherited through ``fork()`` was used in the child (it belongs to the parent)."""

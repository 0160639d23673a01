"""Named errors of the PLE backends (``uvaple.integration``).

Each error a backend raises on purpose derives from :class:`BackendError` (itself a
:class:`uvaple.uva.errors.UvapleError`). Messages say what failed and what to do about it. The copy
backend's errors are delivered to the job (pass) that caused them: a failure of one job never surfaces
on another job's ``wait()``.
"""

from __future__ import annotations

from uvaple.uva.errors import UvapleError

__all__ = [
    "BackendError",
    "CopyBackendOverloaded",
    "CopyRequestTooLarge",
    "CopyTimeout",
    "BackendClosed",
    "LookupForkedError",
    "CopyJobFailed",
    "CopyJobCancelled",
    "DiskStepTimeout",
    "DiskStreamError",
]


class BackendError(UvapleError):
    """Base of every error a PLE backend raises on purpose."""


class CopyBackendOverloaded(BackendError):
    """Admission refused: every in-flight slot of the copy backend stayed busy for ``admission_timeout``.

    Raised before anything (events, buffers, queues) was touched, so accepted jobs are unaffected.
    Size ``max_in_flight`` from the runtime's bound on passes in flight (async scheduling can have two or
    more), or give ``admission_timeout`` so that a submit waits for the GPU to finish an earlier copy.
    """


class CopyRequestTooLarge(BackendError, ValueError):
    """More ids in one request than the preallocated staging slots hold (``max_rows``)."""


class CopyTimeout(BackendError, TimeoutError):
    """A bounded wait of the copy backend ran out (job result, CUDA ids, worker shutdown)."""


class BackendClosed(BackendError):
    """The backend was closed (or its worker stopped) before or while this job was pending."""


class LookupForkedError(BackendError):
    """A lookup inherited through ``fork()`` was used in the child: its table, streams and worker are the
    parent's (a private table reads zeros there). Build the table and the lookup in the child."""


class CopyJobFailed(BackendError):
    """The copy job failed (CPU gather, copy launch, ...); ``__cause__`` holds the original exception."""


class CopyJobCancelled(BackendError):
    """The job was cancelled with ``CopyJob.cancel()`` before its copy was launched."""


class DiskStepTimeout(BackendError, TimeoutError):
    """A disk lookup's call waited its ``wait_s`` for earlier steps to complete (their gathers, queued on the GPU,
    did not run that far): the message names the steps."""


class DiskStreamError(BackendError, RuntimeError):
    """A disk lookup was called under CUDA graph capture: each call plans and reads its rows on the host, which a
    graph cannot replay."""

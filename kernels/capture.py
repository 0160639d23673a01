"""CUDA graph capture: host memory a captured graph reads stays alive; a few CUDA calls safe during any capture.

Keeping host memory.
A graph replays its kernels with the addresses it captured, and torch says nothing when a graph is
destroyed. If the host table a captured gather reads were released (closed and dropped), a later replay
would read unmapped memory and kill the CUDA context. So a launch under capture keeps a reference to its
host-memory table tensor: the tensor holds its storage, the storage holds whatever owns the mapping
(a uvaple host table's views hold it), and nothing is released before exit. Device (HBM) tables follow
torch's usual rule instead: a graph's inputs must outlive it.
"""

from __future__ import annotations

import functools
import threading

import torch

_lock = threading.Lock()
_kept: dict[tuple[int, int], torch.Tensor] = {}
_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: registered or pinned host memory


def capturing(t: torch.Tensor) -> bool:
    """Whether this thread's current stream is capturing (only CUDA launches can be captured)."""
    return t.is_cuda and _stream_capturing()


# what torch.cuda.is_current_stream_capturing calls (one frame less on every eager launch); it exists in CUDA builds,
# the only ones where a tensor is_cuda
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def is_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is host memory (a CPU tensor, or a CUDA view of registered or pinned host memory)."""
    if not t.is_cuda:
        return True
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        return True  # cannot tell: keep it (the safe side)
    err, attrs = rt.cudaPointerGetAttributes(t.data_ptr())
    if int(err) != 0:
        rt.cudaGetLastError()
        return True
    return int(attrs.type) == _CUDA_MEMORY_TYPE_HOST


def keep_for_graph(table: torch.Tensor) -> None:
    """Keep ``table`` (and so its host mapping) until exit: a captured graph reads it."""
    if not is_host_memory(table):
        return
    storage = table.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    with _lock:
        _kept.setdefault(key, table)


def kept() -> int:
    """How many host tables captured graphs keep alive (for tests)."""
    return len(_kept)



class CaptureModeError(RuntimeError):
    """The driver refused to change this thread's stream-capture mode: its CUDA context is not usable."""


@functools.lru_cache(maxsize=1)
def _driver():
    """cuda-python's driver bindings (a dependency), or None where they cannot be imported."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


class RelaxedCaptureMode:
    """This thread's stream-capture interaction mode set to relaxed for a few CUDA calls, then restored.

    Under ``torch.cuda.graph``'s default (global) capture mode, a ``cudaEventQuery`` or an event record
    from *another* thread counts as a potentially unsafe call and invalidates that capture (PyTorch's NCCL
    watchdog met this; it now queries in a non-global mode). The callers (a lookup's counter snapshots, the
    copy placement's health) touch only their own streams and events, never one recorded inside a capture,
    so they may run during any capture. So may a split lookup's last words (its ``close`` or its finaliser,
    which the collector can run in the middle of a capture): a wait on an event recorded before and the
    destruction of its own CUDA graphs, which under global mode also invalidate the capture.
    """

    __slots__ = ("_old",)

    def __enter__(self) -> None:
        self._old = None
        drv = _driver()
        if drv is None:
            return
        try:
            err, old = drv.cuThreadExchangeStreamCaptureMode(
                drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
        except Exception as e:  # noqa: BLE001 - the bindings could not reach the driver
            raise CaptureModeError(f"cuThreadExchangeStreamCaptureMode could not be called: {e}") from e
        if int(err) != 0:
            raise CaptureModeError(f"cuThreadExchangeStreamCaptureMode failed: {getattr(err, 'name', err)}; the "
                                   "CUDA context of this process is not usable")
        self._old = old

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            _driver().cuThreadExchangeStreamCaptureMode(self._old)

"""Host memory read by a captured CUDA graph stays alive for the life of the process.

A graph replays its kernels with the addresses it captured, and torch says nothing when a graph is
destroyed. If the host table a captured gather reads were released (closed and dropped), a later replay
would read unmapped memory and kill the CUDA context. So a launch under capture keeps a reference to its
host-memory table tensor: the tensor holds its storage, the storage holds whatever owns the mapping
(a uvaple host table's views hold it), and nothing is released before exit. Device (HBM) tables follow
torch's usual rule instead: a graph's inputs must outlive it.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_kept: dict[tuple[int, int], torch.Tensor] = {}
_CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: registered or pinned host memory


def capturing(t: torch.Tensor) -> bool:
    """Whether this thread's current stream is capturing (only CUDA launches can be captured)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _is_host_memory(t: torch.Tensor) -> bool:
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
    if not _is_host_memory(table):
        return
    storage = table.untyped_storage()
    key = (storage.data_ptr(), storage.nbytes())
    with _lock:
        _kept.setdefault(key, table)


def kept() -> int:
    """How many host tables captured graphs keep alive (for tests)."""
    return len(_kept)


"""Views of a host table's memory that keep it mapped: a view cannot outlive the memory it reads.

Design
------
What it owns. Building the views a :class:`~uvaple.uva.host_table.HostTable` hands out, each over one
object that holds the table's :class:`~uvaple.uva._region.Anchor`:

* CPU views (``HostTable.tensor``, ``HostTable.bytes_view()``) are built over a ctypes buffer of the
  table's bytes, an instance of a subclass of the ctypes array type with an ``anchor`` slot.
  ``torch.frombuffer`` and ``np.frombuffer`` keep that buffer as the base of what they return, and so
  does every slice, view or state-dict tensor built from it.
* CUDA views (``HostTable.cuda_view()``) are built through ``__cuda_array_interface__`` from a holder that
  carries the anchor; torch keeps the holder alive as long as the tensor.

So the region (:mod:`._region`) is released only after the last thing built from a view is gone, and a
view read after ``close()`` reads the table's bytes, never an unmapped page. The table decides when views
are built (it caches its CPU views, and takes the anchor under its lock so that a concurrent ``close()``
cannot hand out a view without it); this module only builds them.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from ._region import Anchor
from .memory import Layout

__all__ = ["buffer", "cpu_tensor", "byte_array", "cuda_tensor"]


@functools.lru_cache(maxsize=64)
def _buffer_type(nbytes: int) -> type:
    # A subclass of the ctypes array type, so that an instance can carry the anchor: every tensor or array
    # built over the buffer keeps it, hence the mapping, alive.
    return type("_TableBuffer", (ctypes.c_ubyte * nbytes,), {"__slots__": ("anchor",)})


def buffer(anchor: Anchor, address: int, nbytes: int):
    """A ctypes buffer of the ``nbytes`` bytes at ``address`` that holds ``anchor``."""
    buf = _buffer_type(nbytes).from_address(address)
    buf.anchor = anchor
    return buf


def cpu_tensor(buf, layout: Layout) -> torch.Tensor:
    """CPU tensor ``[rows, cols]``, strides ``(stride, 1)``, over ``buf`` (from :func:`buffer`)."""
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(layout.dtype).as_strided((layout.rows, layout.cols),
                                              (layout.stride_bytes // layout.itemsize, 1))


def byte_array(buf, layout: Layout) -> np.ndarray:
    """numpy ``uint8`` array ``[rows, stride_bytes]`` over ``buf`` (from :func:`buffer`)."""
    return np.frombuffer(buf, dtype=np.uint8).reshape(layout.rows, layout.stride_bytes)


class _CudaArrayHolder:
    """Exposes a registered table's rows through ``__cuda_array_interface__`` (holds the mapping)."""

    def __init__(self, anchor: Anchor, ptr: int, shape: tuple[int, int], typestr: str):
        self._anchor = anchor
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def cuda_tensor(anchor: Anchor, ptr: int, layout: Layout, device: torch.device) -> torch.Tensor:
    """CUDA tensor ``[rows, cols]`` over the registered host memory at ``ptr`` (holds ``anchor``)."""
    itemsize = layout.itemsize
    typestr = {1: "|u1", 2: "<i2", 4: "<i4"}[itemsize]
    holder = _CudaArrayHolder(anchor, ptr, (layout.rows, layout.stride_bytes // itemsize), typestr)
    with torch.cuda.device(device):
        raw = torch.as_tensor(holder, device=device)
    return raw[:, : layout.cols].view(layout.dtype)

"""Peer implementations the benchmark measures ``uva`` against.

Three peers, each as good as we can make it (a baseline is built to win):

* :func:`row_gather` — one Triton program per id that loads the whole row as one masked tile
  (``BLOCK = next_power_of_2(cols)``). This is the shape of vLLM's UVA PLE kernel (PR 54371); the code
  here is our own.
* :func:`embedding_gather` — ``torch.nn.functional.embedding`` over :meth:`HostTable.cuda_view`, a CUDA
  view of the same pinned, mapped memory.
* :func:`memcpy_ceiling` — a pinned host→device ``copy_`` (``non_blocking`` from a pinned buffer) of the
  same number of bytes: what PCIe gives a contiguous transfer, the ceiling every gather is held to.

The Triton peer runs compiled on CUDA tensors and under the interpreter on CPU tensors (the module is
loaded a second time for that by :mod:`uvaple.kernels.jit`).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from uvaple.kernels import jit
from uvaple.kernels import rows as row_code

kernel = jit.kernel_decorator(__name__)
safe_row = jit.same_variant(__name__, row_code).safe_row  # the ids prologue every gather shares (kernels/rows.py)

__all__ = ["row_gather", "embedding_gather", "memcpy_ceiling", "row_gather_num_warps", "vllm_ple_gather",
           "vllm_ple_dequant"]

# Elements one thread holds at most: 64 bf16 values are 32 registers, far below the 255 a thread may use,
# so the whole-row tile never spills (vLLM sizes its one-program-per-row kernel the same way: whole row,
# one program). 4 warps is Triton's default and the floor; 32 warps (1024 threads) is the hardware cap.
_ELEMS_PER_THREAD = 64
_MIN_WARPS = 4
_MAX_WARPS = 32


@kernel
def _row_gather_kernel(
    table_ptr,  # *Pointer* to row 0 of the table [rows, stride] (host-mapped or device memory)
    ids_ptr,  # *Pointer* to the ids [n] (int32 or int64)
    out_ptr,  # *Pointer* to the output [n, out_stride]
    rows,  # number of table rows; ids outside [0, rows) give a zero row
    cols,  # values per row
    table_stride,  # elements between table rows
    out_stride,  # elements between output rows
    BLOCK: tl.constexpr,  # next_power_of_2(cols): the whole row is one tile
):
    pid = tl.program_id(0).to(tl.int64)
    row, valid = safe_row(ids_ptr, pid, 0, 0, rows)
    offs = tl.arange(0, BLOCK)
    # Invalid ids load nothing (mask all false) and store zeros.
    load_mask = offs < tl.where(valid, cols, 0)
    vals = tl.load(table_ptr + row * table_stride + offs, mask=load_mask, other=0)
    tl.store(out_ptr + pid * out_stride + offs, vals, mask=offs < cols)


def row_gather_num_warps(cols: int) -> int:
    """Warps for a whole-row tile of ``cols`` values (at most ``_ELEMS_PER_THREAD`` per thread)."""
    block = triton.next_power_of_2(max(1, cols))
    warps = block // (32 * _ELEMS_PER_THREAD)
    return int(min(_MAX_WARPS, max(_MIN_WARPS, triton.next_power_of_2(max(1, warps)))))


def row_gather(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Gather ``table[ids]`` into ``out`` with one Triton program per id (whole-row tile).

    Parameters
    ----------
    table : torch.Tensor
        ``[rows, cols]`` with unit column stride: a CPU tensor over registered host memory (read through
        UVA), a CUDA tensor, or (interpreted) any CPU tensor.
    ids : torch.Tensor
        ``[n]`` int32/int64 on the compute device. Ids outside ``[0, rows)`` give zero rows.
    out : torch.Tensor
        ``[n, cols]``, same dtype as ``table``, unit column stride; written in place.

    Launches on the current stream; no allocation, no synchronisation (CUDA-graph capturable).
    """
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be 2-D with unit column stride, got shape {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    rows, cols = table.shape
    n = ids.shape[0]
    if out.shape != (n, cols) or out.dtype != table.dtype or (n and out.stride(1) != 1):
        raise ValueError(f"out must be [{n}, {cols}] {table.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    block = triton.next_power_of_2(cols)
    kernels = jit.variant(sys.modules[__name__], jit.running_on_cpu(ids, out))
    kernels._row_gather_kernel[(n,)](
        table, ids, out, rows, cols, table.stride(0), out.stride(0),
        BLOCK=block, num_warps=row_gather_num_warps(cols),
    )
    return out


@kernel
def _vllm_ple_kernel(
    table_ptr,  # *Pointer* uint8 to row 0 of the rank's shard (host-mapped or device memory)
    ids_ptr,  # *Pointer* to the global ids [n]
    out_ptr,  # *Pointer* uint8 to the output [n, row_bytes]
    row_bytes,  # bytes per row (also the table's row stride)
    vocab_start,  # first global id of the shard
    vocab_end,  # one past its last
    BLOCK_D: tl.constexpr,  # next_power_of_2(row_bytes): the whole row of bytes is one tile
):
    pid = tl.program_id(0).to(tl.int64)
    gid = tl.load(ids_ptr + pid)
    offs = tl.arange(0, BLOCK_D)
    gids = gid + offs * 0  # the id per lane: a vector mask (the interpreter refuses a scalar one mixed in)
    owned = (gids >= vocab_start) & (gids < vocab_end)
    local = tl.where(owned, gids - vocab_start, 0)
    in_row = offs < row_bytes
    vals = tl.load(table_ptr + local * row_bytes + offs, mask=in_row & owned, other=0)
    tl.store(out_ptr + pid * row_bytes + offs, vals, mask=in_row)


def vllm_ple_gather(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, vocab_start: int = 0,
                    vocab_end: int | None = None) -> torch.Tensor:
    """The shape of vLLM's pinned-host PLE lookup (``Qwen4ExpPLEPinnedHostEmbedding``), our own code: rows as
    raw bytes, one program per id, ``BLOCK_D = next_power_of_2(row_bytes)``, ids outside
    ``[vocab_start, vocab_end)`` give zero rows. ``table`` ``[rows, cols]`` contiguous (any dtype), ``ids``
    any shape, ``out`` ``[*ids.shape, cols]`` of the table's dtype. Dequantisation is a separate op
    (:func:`vllm_ple_dequant`), as in vLLM.
    """
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError("table must be a contiguous 2-D tensor (rows of row_bytes, no padding)")
    row_bytes = table.shape[1] * table.element_size()
    if out.dtype != table.dtype or out.shape != (*ids.shape, table.shape[1]) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(*ids.shape, table.shape[1])} {table.dtype}")
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return out
    end = table.shape[0] + vocab_start if vocab_end is None else vocab_end
    kernels = jit.variant(sys.modules[__name__], jit.running_on_cpu(ids, out))
    kernels._vllm_ple_kernel[(flat.numel(),)](table.view(torch.uint8), flat, out.view(torch.uint8), row_bytes,
                                              vocab_start, end, BLOCK_D=triton.next_power_of_2(row_bytes))
    return out


def vllm_ple_dequant(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """vLLM's fp8 PLE dequantisation after the gather: ``rows.to(dtype) * scale.to(dtype)``."""
    return rows.to(dtype) * scale.to(dtype)


def embedding_gather(view: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, view)``: ``view`` is ``HostTable.cuda_view()`` (or a CPU table without CUDA).

    Allocates its output (``F.embedding`` has no ``out=``): that is the peer as people use it.
    """
    return torch.nn.functional.embedding(ids, view)


def memcpy_ceiling(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` (pinned host, contiguous) into ``dst`` (device) with ``non_blocking=True``."""
    return dst.copy_(src, non_blocking=True)

"""Row gather: ``out[i, :] = table[ids[i], c0:c1] (* scale)`` in the caller's current CUDA stream.

One kernel serves every table placement: a ``HostTable`` (pinned, mapped host memory read over PCIe
through UVA), a pinned/registered CPU tensor, or a CUDA tensor in HBM. Under ``TRITON_INTERPRET=1`` the
same source runs on CPU tensors (the interpreter is chosen per call, for CPU tensors: see
:mod:`uvaple.kernels._jit`), which is how CI checks indexing, masking, rounding and edge cases.

Work split: program ``(i, j)`` copies column tile ``j`` of row ``ids[i]``. Tile width comes from
:func:`uvaple.kernels.heuristics.launch_config` (bytes per tile and warps, by row bytes).

Out-of-range ids (negative, >= rows, any int64) never form an address outside the table: the id is
replaced by 0 before any pointer arithmetic, then
  * ``oob="zero"``: the row's loads are masked off and the output row is +0.0 (scale or not);
  * ``oob="row0"``: the row reads row 0 (what Gemma 3n's embedding path does for such ids).

Rounding: with ``scale``, the result is bit-identical to HF Gemma 3n's ``emb * scale.to(weight.dtype)``:
the scale is rounded to the table dtype on the host (and passed as its fp32 bits, so -0.0 and subnormals
arrive intact), the product is formed in fp32 and rounded once to the table dtype with
round-to-nearest-even, then converted to the output dtype. NaN results are NaN; their sign and payload
are the device's (torch on the CPU and a GPU disagree there too). The fp32 -> bf16 rounding
is written out with integer ops because Triton's interpreter rounds half away from zero (and the GPU's
``cvt.rn.bf16.f32`` gives the same bits as this), so CPU and GPU agree.

Hot path: no host synchronisation, no allocation when ``out`` is given, launch on the current stream only;
capturable in a CUDA graph and replayable with new ids written into the captured ids buffer.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton

from ..uva.host_table import HostTable
from . import _capture, _gather_triton, _jit
from .heuristics import launch_config

__all__ = ["gather_rows", "OOB_POLICIES", "TABLE_DTYPES", "OUT_DTYPES"]

OOB_POLICIES = ("zero", "row0")
TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_DTYPES = FLOAT_DTYPES
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _table_tensor(table) -> tuple[torch.Tensor, bool]:
    """(2-D tensor to hand Triton, whether it is a registered host table)."""
    if isinstance(table, HostTable):
        return table.tensor, table.registered
    if isinstance(table, torch.Tensor):
        return table, False
    raise TypeError(f"table must be a HostTable or a 2-D torch.Tensor, got {type(table).__name__}")


def _columns(columns, cols: int) -> tuple[int, int]:
    if columns is None:
        return 0, cols
    if isinstance(columns, slice):
        if columns.step not in (None, 1):
            raise ValueError(f"columns must be a contiguous range, got step {columns.step}")
        c0, c1 = columns.start or 0, cols if columns.stop is None else columns.stop
    else:
        try:
            c0, c1 = columns
        except (TypeError, ValueError):
            raise ValueError(f"columns must be None, (start, stop) or a slice, got {columns!r}") from None
    if not (isinstance(c0, int) and isinstance(c1, int)) or not 0 <= c0 < c1 <= cols:
        raise ValueError(f"columns {columns!r} is not a non-empty range inside 0..{cols}")
    return c0, c1


def check_request(table_dtype: torch.dtype, ids: torch.Tensor, out: torch.Tensor | None, *, scale, oob: str,
                  out_dtype, ncols: int) -> torch.dtype:
    """The checks every backend shares: policy, scale, output dtype, ``out``'s shape and layout.

    Returns the output dtype; raises TypeError/ValueError naming what is wrong.
    """
    if oob not in OOB_POLICIES:
        raise ValueError(f"oob must be one of {OOB_POLICIES}, got {oob!r}")
    if scale is not None:
        if table_dtype not in FLOAT_DTYPES:
            raise TypeError(f"scale needs a float table, this one is {table_dtype}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    if out is not None:
        dtype = out.dtype
        if out_dtype is not None and out_dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype={out_dtype}")
    else:
        dtype = out_dtype or table_dtype
    if dtype != table_dtype and (dtype not in OUT_DTYPES or table_dtype not in FLOAT_DTYPES):
        raise TypeError(f"cannot convert a {table_dtype} table to {dtype} output; "
                        f"supported outputs are {OUT_DTYPES} from float tables")
    if out is not None:
        want = (*ids.shape, ncols)
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {want} ([*ids.shape, columns])")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
    return dtype


def check_args(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None, *, scale, oob: str,
               out_dtype, c0: int, c1: int, host_registered: bool) -> torch.dtype:
    """Validate a gather; returns the output dtype. Raises TypeError/ValueError naming what is wrong."""
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be 2-D with unit column stride, got shape {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if table.dtype not in TABLE_DTYPES:
        raise TypeError(f"table dtype {table.dtype} is not supported")
    if table.shape[0] == 0:
        raise ValueError("table has no rows: there is no row to read, not even row 0 for out-of-range ids")
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be an int32 or int64 tensor, got "
                        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    dtype = check_request(table.dtype, ids, out, scale=scale, oob=oob, out_dtype=out_dtype, ncols=c1 - c0)
    if out is not None:
        if out.device != ids.device:
            raise ValueError(f"out is on {out.device} but ids are on {ids.device}")
    if ids.device.type == "cuda":
        if table.device.type == "cpu" and not host_registered and not table.is_pinned():
            raise ValueError("the table is an ordinary CPU tensor; the GPU can only read a HostTable or "
                             "registered/pinned host memory (use uvaple.uva.HostTable.from_tensor)")
        if table.device.type == "cuda" and table.device != ids.device:
            raise ValueError(f"table is on {table.device} but ids are on {ids.device}")
    elif table.device.type != "cpu":
        raise ValueError(f"ids are on {ids.device} but the table is on {table.device}")
    return dtype


def scale_bits(scale: float, dtype: torch.dtype) -> int:
    """The kernel's scale argument: the bits (signed int32) of ``torch.tensor(scale).to(dtype)`` as fp32.

    HF: ``embedding * embed_scale.to(weight.dtype)``: the scale is rounded to fp32, then to the table
    dtype. Cached by the scale's own bits, so -0.0 and +0.0 (equal as floats) are distinct keys.
    """
    return _scale_bits(struct.pack("<d", float(scale)), dtype)


@functools.lru_cache(maxsize=256)
def _scale_bits(key: bytes, dtype: torch.dtype) -> int:
    (value,) = struct.unpack("<d", key)
    rounded = torch.tensor(value, dtype=torch.float32).to(dtype).to(torch.float32)
    return int(rounded.view(torch.int32).item())


def launch(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, scale: float | None, col_start: int,
           oob_row0: bool) -> None:
    """Launch the gather kernel (arguments already validated; ``out`` is ``[*ids.shape, ncols]``)."""
    n = ids.numel()
    ncols = out.shape[-1] if out.dim() else 0
    if n == 0 or ncols == 0:
        return
    cfg = launch_config(ncols * table.element_size(), table.element_size(), n)
    convert = scale is not None or out.dtype != table.dtype
    bits = 0 if scale is None else scale_bits(scale, table.dtype)
    if _capture.capturing(ids):
        _capture.keep_for_graph(table)
    if not convert:
        # A plain copy moves bits: give the kernel same-width integers (fp8 and friends need no support).
        as_int = _INT_OF_SIZE[table.element_size()]
        table, out = table.view(as_int), out.view(as_int)
    grid = (n, triton.cdiv(ncols, cfg.block))
    kernels = _jit.variant(_gather_triton, _jit.running_on_cpu(ids, out))
    kernels.gather_rows_kernel[grid](
        table, ids, out, table.shape[0], table.stride(0), col_start, ncols, bits,
        HAS_SCALE=scale is not None, CONVERT=convert, OOB_ROW0=oob_row0, BLOCK=cfg.block,
        num_warps=cfg.num_warps,
    )


def gather_rows(table, ids: torch.Tensor, out: torch.Tensor | None = None, *, scale: float | None = None,
                columns=None, oob: str = "zero", out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gather rows ``table[ids, columns]`` (optionally scaled) into ``out`` on the current stream.

    Parameters
    ----------
    table : HostTable or torch.Tensor
        ``[rows, cols]``: a registered ``HostTable``, a pinned/registered CPU tensor, or a CUDA tensor.
        Under the Triton interpreter (no GPU) a plain CPU tensor.
    ids : torch.Tensor
        int32/int64 ids of any shape on the compute device.
    out : torch.Tensor, optional
        ``[*ids.shape, ncols]`` contiguous, written in place. Allocated when omitted.
    scale : float, optional
        Multiply rows by ``scale`` with the model's rounding (bit-identical to
        ``rows * torch.tensor(scale).to(table.dtype)``).
    columns : (start, stop) or slice, optional
        A contiguous column range, e.g. one layer's 256 values of a PLE row.
    oob : {"zero", "row0"}
        What out-of-range ids produce: a zero row, or row 0.
    out_dtype : torch.dtype, optional
        bf16/fp16/fp32 output for float tables (default: the table's dtype).

    Returns
    -------
    torch.Tensor
        ``out``: ``[*ids.shape, ncols]``.
    """
    tensor, registered = _table_tensor(table)
    c0, c1 = _columns(columns, tensor.shape[1] if tensor.dim() == 2 else 0)
    dtype = check_args(tensor, ids, out, scale=scale, oob=oob, out_dtype=out_dtype, c0=c0, c1=c1,
                       host_registered=registered)
    if out is None:
        out = torch.empty((*ids.shape, c1 - c0), dtype=dtype, device=ids.device)
    ids_flat = ids if ids.is_contiguous() else ids.contiguous()
    if torch.compiler.is_compiling():
        torch.ops.uvaple.gather_rows(tensor, ids_flat, out, scale, c0, oob == "row0")
    else:
        launch(tensor, ids_flat, out, scale, c0, oob == "row0")
    return out

"""What a gather may be asked: the checks of a table, a policy, ids and ``out``, and the policy constants.

The functional :func:`~uvaple.kernels.gather.gather_rows` and the operators run every check on every call;
a lookup runs the policy and table checks once, when it plans, and only :func:`check_ids` /
:func:`check_out` per call (what the caller controls).
"""

from __future__ import annotations

import functools
import struct

import torch

from uvaple.dtypes import FLOAT_DTYPES, TABLE_DTYPES

from .encodings import FP8_FORMATS, encoding_of_code

__all__ = ["OOB_POLICIES", "OOB_MODES", "ID_BASE_LIMIT", "OUT_DTYPES", "ID_DTYPES", "column_range", "check_policy",
           "check_ids", "check_out", "check_table", "scale_bits", "check_fixed", "check_call", "check_hot",
           "check_workspace", "check_reach", "writes_as"]

OOB_POLICIES = ("zero", "row0", "neg_zero")
#: oob policy -> the kernels' ``oob_mode``
OOB_MODES = {"zero": 0, "row0": 1, "neg_zero": 2}
#: ids are shifted by ``id_base`` (``0 <= id_base < ID_BASE_LIMIT``) before the range check; below 2**62 a
#: wrapped int64 difference of an extreme id stays far outside any table.
ID_BASE_LIMIT = 1 << 62
OUT_DTYPES = FLOAT_DTYPES
ID_DTYPES = (torch.int32, torch.int64)


def column_range(columns, cols: int) -> tuple[int, int]:
    """``(start, stop)`` of a request: ``None`` (the whole row), ``(start, stop)`` or a unit-step slice."""
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


def writes_as(table_dtype: torch.dtype, out_dtype: torch.dtype, dequant: bool) -> bool:
    """Whether rows of a ``table_dtype`` table are written as ``out_dtype``: as stored, or converted to a float
    output (from a float table, or dequantised fp8 codes)."""
    if dequant:
        return out_dtype in OUT_DTYPES
    return out_dtype == table_dtype or (out_dtype in OUT_DTYPES and table_dtype in FLOAT_DTYPES)


def check_policy(table_dtype: torch.dtype, *, scale, oob: str, out_dtype, dequant: bool = False) -> torch.dtype:
    """Policy checks (once per spec, or per functional call): returns the output dtype.

    ``dequant``: rows are fp8 codes dequantised with a global scale (the output dtype defaults to bf16).
    """
    if table_dtype not in TABLE_DTYPES:
        raise TypeError(f"table dtype {table_dtype} is not supported; use one of {TABLE_DTYPES}")
    if oob not in OOB_POLICIES:
        raise ValueError(f"oob must be one of {OOB_POLICIES}, got {oob!r}")
    if dequant:
        if table_dtype not in FP8_FORMATS:
            raise TypeError(f"fp8 dequantisation needs an fp8 table (e4m3fn or e5m2), this one is {table_dtype}")
        if scale is not None:
            raise TypeError("an fp8 table's rows are scaled by its dequantisation scale; a second scale is not "
                            "supported")
        dtype = out_dtype or torch.bfloat16
        if not writes_as(table_dtype, dtype, True):
            raise TypeError(f"fp8 rows dequantise to one of {OUT_DTYPES}, not {dtype}")
        return dtype
    if scale is not None:
        if table_dtype not in FLOAT_DTYPES:
            raise TypeError(f"scale needs a float table, this one is {table_dtype}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    dtype = out_dtype or table_dtype
    if not writes_as(table_dtype, dtype, False):
        raise TypeError(f"cannot convert a {table_dtype} table to {dtype} output; "
                        f"supported outputs are {OUT_DTYPES} from float tables")
    if oob == "neg_zero" and dtype not in FLOAT_DTYPES:
        raise TypeError(f"oob='neg_zero' writes -0.0: it needs a float output, not {dtype}")
    return dtype


def check_ids(ids) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES:
        raise TypeError(f"ids must be an int32 or int64 tensor, got "
                        f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")


def check_out(out: torch.Tensor, want: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """``out`` must be ``want``-shaped, of ``dtype``, contiguous and on ``device``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype} (the out_dtype of the request)")
    if tuple(out.shape) != want:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {want} ([*ids.shape, columns])")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the ids are on {device}")


def check_table(table: torch.Tensor, device: torch.device) -> None:
    """A table tensor a launch on ``device`` (the ids') can read."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"table must be a 2-D torch.Tensor (for a HostTable pass table.tensor, or use "
                        f"uvaple.integration.make_lookup), got {type(table).__name__}")
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be 2-D with unit column stride, got shape {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if table.dtype not in TABLE_DTYPES:
        raise TypeError(f"table dtype {table.dtype} is not supported")
    if table.shape[0] == 0:
        raise ValueError("table has no rows: there is no row to read, not even row 0 for out-of-range ids")
    if device.type == "cuda":
        # is_pinned() asks the driver, which torch.compile cannot trace: checked in eager calls only
        if table.device.type == "cpu" and not torch.compiler.is_compiling() and not table.is_pinned():
            raise ValueError("the table is an ordinary CPU tensor; the GPU can only read registered or pinned "
                             "host memory (use uvaple.uva.HostTable.from_tensor)")
        if table.device.type == "cuda" and table.device != device:
            raise ValueError(f"table is on {table.device} but ids are on {device}")
    elif table.device.type != "cpu":
        raise ValueError(f"ids are on {device} but the table is on {table.device}")


def scale_bits(scale: float, dtype: torch.dtype) -> int:
    """The kernels' scale argument: the bits (signed int32) of ``torch.tensor(scale).to(dtype)`` as fp32.

    HF: ``embedding * embed_scale.to(weight.dtype)``: the scale is rounded to fp32, then to the table
    dtype. Cached by the scale's own bits, so -0.0 and +0.0 (equal as floats) are distinct keys.
    """
    return _scale_bits(struct.pack("<d", float(scale)), dtype)


@functools.lru_cache(maxsize=256)
def _scale_bits(key: bytes, dtype: torch.dtype) -> int:
    (value,) = struct.unpack("<d", key)
    rounded = torch.tensor(value, dtype=torch.float32).to(dtype).to(torch.float32)
    return int(rounded.view(torch.int32).item())


# ------------------------------------------------------------------ the operators' integer checks
# The operators are public: even a direct call with any integers stays inside the table and ``out``. A plan
# makes the checks of what it fixes once (check_fixed); a call through an operator makes check_call too.

def check_fixed(table: torch.Tensor, dq_scale, id_base: int, row_lo: int, oob_mode: int, dequant: int,
                what: str) -> None:
    """What a plan fixes: the table's layout, the row range, the policy codes, the fp8 scale."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"uvaple::{what}: the table must be a 2-D tensor with unit column stride")
    if not 0 <= row_lo < table.shape[0] or not 0 <= id_base < ID_BASE_LIMIT or oob_mode not in (0, 1, 2):
        raise ValueError(f"uvaple::{what}: row_lo {row_lo}, id_base {id_base} or oob_mode {oob_mode} is out of "
                         f"range (table of {table.shape[0]} rows, id_base < 2**62)")
    try:
        enc, fmt = encoding_of_code(dequant)
    except ValueError as e:
        raise ValueError(f"uvaple::{what}: {e}") from None
    if fmt is not None and table.element_size() != fmt.itemsize:
        raise ValueError(f"uvaple::{what}: {enc.name} rows of {fmt} need a table of {fmt.itemsize}-byte elements, "
                         f"got {table.dtype}")
    if enc.scale == "global" and (dq_scale is None or dq_scale.numel() != 1 or dq_scale.dtype != torch.float32):
        raise ValueError(f"uvaple::{what}: {enc.name} dequantisation needs a float32 scale of one element")
    if enc.trailer_bytes and table.shape[1] <= enc.trailer_bytes:
        raise ValueError(f"uvaple::{what}: {enc.name} rows end in {enc.trailer_bytes} bytes of scale: the table "
                         f"needs more than {enc.trailer_bytes} columns, it has {table.shape[1]}")


def check_call(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, col_start: int, dequant: int, what: str,
               dq_scale=None) -> int:
    """What a call brings: contiguous ids and ``out`` of ``[*ids.shape, ncols]``, the columns inside the table
    (and before an fp8 row's scale), ``out`` (and the fp8 scale) on the ids' device; returns ``ncols``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES:
        raise TypeError(f"uvaple::{what}: ids must be an int32 or int64 tensor")
    n = ids.numel()
    ncols = out.shape[-1] if out.dim() else 0
    if out.numel() != n * ncols or not out.is_contiguous() or not ids.is_contiguous():
        raise ValueError(f"uvaple::{what}: out must be contiguous [*ids.shape, ncols] and ids contiguous "
                         f"(got out {tuple(out.shape)}, ids {tuple(ids.shape)})")
    if col_start < 0 or col_start + ncols > table.shape[1]:
        raise ValueError(f"uvaple::{what}: columns {col_start}..{col_start + ncols} are not inside the table's "
                         f"{table.shape[1]}")
    trailer = encoding_of_code(dequant)[0].trailer_bytes
    if trailer and col_start + ncols > table.shape[1] - trailer:
        raise ValueError(f"uvaple::{what}: the last {trailer} columns of these rows are their scale; columns "
                         f"{col_start}..{col_start + ncols} reach into them (table of {table.shape[1]} columns)")
    if out.device != ids.device or (dq_scale is not None and dq_scale.device != ids.device):
        raise ValueError(f"uvaple::{what}: out (and an fp8 scale) must be on the ids' device {ids.device}")
    return ncols


def check_reach(table: torch.Tensor, device: torch.device, out_dtype: torch.dtype, has_scale: bool, oob_mode: int,
                dequant: int, what: str) -> None:
    """What an operator's full path checks beyond :func:`check_fixed` and :func:`check_call`: the table readable
    by a launch on ``device`` (the ids': :func:`check_table`) and ``out_dtype`` one the policy writes (the
    functional path's :func:`check_policy`, from the operator's codes)."""
    try:
        check_table(table, device)
    except (TypeError, ValueError) as e:
        raise type(e)(f"uvaple::{what}: {e}") from None
    if not writes_as(table.dtype, out_dtype, bool(dequant)):
        want = f"one of {OUT_DTYPES}" if dequant or table.dtype in FLOAT_DTYPES else f"{table.dtype}"
        raise TypeError(f"uvaple::{what}: out has dtype {out_dtype}; rows of this {table.dtype} table are written as "
                        f"{want}")
    if has_scale and dequant:
        raise TypeError(f"uvaple::{what}: fp8 rows are scaled by their dequantisation scale; a second scale is not "
                        "supported")
    if has_scale and table.dtype not in FLOAT_DTYPES:
        raise TypeError(f"uvaple::{what}: a scale needs a float table, this one is {table.dtype}")
    if oob_mode == 2 and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"uvaple::{what}: oob_mode 2 writes -0.0 rows: it needs a float output, not {out_dtype}")


def check_hot(table: torch.Tensor, device: torch.device, counters, hot_rows, slot_map, id_counts,
              hot_only_rows: int = 0) -> None:
    """A hot set's buffers (and the counters it adds hits to) fit the table, on ``device``; with
    ``hot_only_rows``, the map covers that many rows past the table's and names a hot slot for each (one read of
    those entries)."""
    rows = table.shape[0] + hot_only_rows
    if hot_rows.dim() != 2 or hot_rows.dtype != table.dtype or hot_rows.shape[1] != table.shape[1] or \
            hot_rows.stride(0) != table.stride(0) or hot_rows.stride(1) != 1 or hot_rows.device != device:
        raise ValueError(f"uvaple::gather_rows_hot: the hot rows must be a {table.dtype} [slots, {table.shape[1]}] "
                         f"tensor with the table's row stride ({table.stride(0)}) on {device}, got "
                         f"{hot_rows.dtype} {tuple(hot_rows.shape)} stride {hot_rows.stride()} on {hot_rows.device}")
    if slot_map is None or slot_map.dtype != torch.int32 or slot_map.dim() != 1 or \
            slot_map.numel() < rows or not slot_map.is_contiguous() or slot_map.device != device:
        raise ValueError(f"uvaple::gather_rows_hot: the slot map must be a contiguous int32 [>= {rows}] "
                         f"tensor on {device}")
    if id_counts is not None and (id_counts.dtype != torch.int64 or id_counts.dim() != 1 or
                                  id_counts.numel() < rows or not id_counts.is_contiguous() or
                                  id_counts.device != device):
        raise ValueError(f"uvaple::gather_rows_hot: id counts must be a contiguous int64 [>= {rows}] "
                         f"tensor on {device}")
    if isinstance(hot_only_rows, bool) or not isinstance(hot_only_rows, int) or hot_only_rows < 0:
        raise ValueError(f"uvaple::gather_rows_hot: hot_only_rows must be an int >= 0, got {hot_only_rows!r}")
    if hot_only_rows:
        past = slot_map[table.shape[0]:rows]
        if not bool(((past >= 0) & (past < hot_rows.shape[0])).all()):
            raise ValueError(f"uvaple::gather_rows_hot: each of the {hot_only_rows} rows past the table's "
                             f"{table.shape[0]} must have a hot slot (0 .. {hot_rows.shape[0] - 1}) in the slot map")
    if counters is not None and counters.numel() < 4:
        raise ValueError("uvaple::gather_rows_hot: counters must be int64 [>= 4] (lookups, rows, out-of-range "
                         "ids, hits)")


def check_workspace(workspace, n: int, device: torch.device) -> None:
    """The sorted gather's workspace: contiguous int64 ``[2, >= n]`` on ``device``."""
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.int64 or workspace.dim() != 2 or \
            workspace.shape[0] != 2 or workspace.shape[1] < n or not workspace.is_contiguous() or \
            workspace.device != device:
        raise ValueError(f"uvaple::gather_rows_sorted: the workspace must be a contiguous int64 [2, >= {n}] "
                         f"tensor on {device}, got {getattr(workspace, 'dtype', None)} "
                         f"{tuple(getattr(workspace, 'shape', ()))}")

"""What a gather may be asked: the checks of a table, a policy, ids and ``out``, and the policy constants.

The functional :func:`~uvaple.kernels.gather.gather_rows` and the operators run every check on every call;
a lookup runs the policy and table checks once, when it plans, and only :func:`check_ids` /
:func:`check_out` per call (what the caller controls).
"""

from __future__ import annotations

import torch

from uvaple._util import FLOAT_DTYPES, TABLE_DTYPES

from .encodings import FP8_FORMATS

__all__ = ["OOB_POLICIES", "OOB_MODES", "ID_BASE_LIMIT", "OUT_DTYPES", "ID_DTYPES", "column_range", "check_policy",
           "check_ids", "check_out", "check_table"]

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
        if dtype not in OUT_DTYPES:
            raise TypeError(f"fp8 rows dequantise to one of {OUT_DTYPES}, not {dtype}")
        return dtype
    if scale is not None:
        if table_dtype not in FLOAT_DTYPES:
            raise TypeError(f"scale needs a float table, this one is {table_dtype}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    dtype = out_dtype or table_dtype
    if dtype != table_dtype and (dtype not in OUT_DTYPES or table_dtype not in FLOAT_DTYPES):
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

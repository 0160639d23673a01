"""Small shared definitions under every layer: dtype names and sizes, byte formatting.

Imports torch only, so ``uvaple.uva`` and ``uvaple.kernels`` (siblings that never import each other) can
both use it.
"""

from __future__ import annotations

import torch

__all__ = ["SAFETENSORS_DTYPES", "TABLE_DTYPES", "FLOAT_DTYPES", "dtype_name", "fmt_bytes"]

#: safetensors' dtype names (also what a shared table's header stores).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAME_OF = {v: k for k, v in SAFETENSORS_DTYPES.items()}

#: dtypes a table can hold (host tables, the gather, the copy backend).
TABLE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                                         torch.float8_e4m3fn, torch.float8_e5m2)
#: dtypes a scale or an output conversion applies to.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    """safetensors' name of ``dtype`` (``"BF16"``)."""
    return _NAME_OF[dtype]


def fmt_bytes(n: float) -> str:
    """``17.50 GiB``, ``3.00 MiB``, ``12 B``."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{int(n)} B"

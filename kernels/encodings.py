"""Row encodings: how a table's rows are stored and turned into the values a lookup returns."""

from __future__ import annotations

import torch

__all__ = ["FP8_FORMATS", "ROW_SCALE_BYTES"]

#: fp8 dtype -> the kernels' ``dequant`` format (rows of fp8 codes times a global scale; + 2: times the
#: row's own scale, stored after its codes)
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
#: bytes of the float32 scale an fp8 row with its own scale carries after its codes (dequant 3/4)
ROW_SCALE_BYTES = 4

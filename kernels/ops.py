"""``torch.ops.uvaple.gather_rows``: the gather as an opaque custom op.

``torch.compile`` and vLLM see a call that mutates ``out`` and nothing else; they never trace into the
Triton launcher and never treat the host table as something to copy. The fake implementation makes the
op usable under FakeTensor/meta tracing.
"""

from __future__ import annotations

import torch

from .gather import launch


@torch.library.custom_op("uvaple::gather_rows", mutates_args=("out",))
def gather_rows_op(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, scale: float | None,
                   col_start: int, oob_row0: bool) -> None:
    """out[i] = table[ids[i], col_start:col_start + out.shape[-1]] (* scale); see ``gather_rows``."""
    launch(table, ids, out, scale, col_start, oob_row0)


@gather_rows_op.register_fake
def _(table, ids, out, scale, col_start, oob_row0) -> None:
    return None

"""The copy placement's copy of the row policy: the bits of ``gather_rows``, from a CPU gather and a copy.

Every placement gives the bits of :func:`uvaple.kernels.reference_gather` for the same ids and spec. The
direct kernel applies the spec's out-of-range policy (``oob``) and ``scale`` as it reads a row; the copy
placement reads rows on the CPU into pinned staging and copies them up, so it applies the same policy in
two halves, both here: :meth:`CopyPolicy.stage` (the CPU half) and :meth:`CopyPolicy.device_copy` (the
device half, enqueued by the worker on the copy stream).

Exactness
---------
Rows are copied as bytes (columns as a byte range: ``host_gather.cpu_gather``), so every dtype is
exact. ``scale`` is a device ``mul_`` by the scale rounded to the table dtype (HF's ``emb *
scale.to(weight.dtype)``: one fp32 product, one rounding); ``out_dtype`` is a device cast after it.
Out-of-range ids read row 0 (``oob="row0"``) or a zero row; zero rows are staged as -0.0 when the scale
is negative, so that the product is +0.0 like ``gather_rows``' zero rows (``-0.0`` rows for
``oob="neg_zero"``, +0.0 staged then). An inf/NaN scale (0 * inf = NaN) is applied on the CPU by torch
(:meth:`CopyPolicy.scale_on_host`, a rare path), followed by re-zeroing the out-of-range rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ...spec import TableSpec
from .. import host_gather

__all__ = ["CopyPolicy"]


class CopyPolicy:
    """A spec's ``scale`` and ``oob`` as the copy placement applies them, fixed at construction.

    Attributes
    ----------
    scale : 0-dim CPU tensor of the table dtype, or None
        The spec's scale rounded to the table dtype (a scalar operand of the device ``mul_``).
    scale_on_cpu : bool
        The scale is inf or NaN: it is applied on the CPU (:meth:`scale_on_host`), not on the device.
    oob_row0, neg_zero : bool
        ``oob="row0"`` (row 0 for an out-of-range id), ``oob="neg_zero"`` (-0.0 rows).
    zero_pos, zero_neg : uint8 ``[itemsize]``
        +0.0 and -0.0 of the table dtype as bytes, the element the gather writes for a zero row.
    """

    def __init__(self, spec: TableSpec, dtype: torch.dtype, itemsize: int) -> None:
        # HF Gemma 3n: embedding * embed_scale.to(weight.dtype); a CPU 0-dim tensor is a scalar operand.
        # A device multiply cannot give +0.0 zero rows for an inf/NaN scale (0 * inf = NaN): such scales
        # are applied on the CPU in the worker (rare path), finite ones on the device.
        self.scale = None if spec.scale is None else torch.tensor(spec.scale, dtype=torch.float32).to(dtype)
        self.scale_on_cpu = self.scale is not None and not math.isfinite(float(self.scale))
        self.oob_row0 = spec.oob == "row0"
        self.neg_zero = spec.oob == "neg_zero"
        # +0.0 and -0.0 of the table dtype as bytes: zero rows are written as -0.0 when a negative scale
        # follows on the device, so that (-0.0) * scale = +0.0, the zero row of gather_rows.
        self.zero_pos = np.zeros(itemsize, dtype=np.uint8)
        self.zero_neg = self.zero_pos.copy()
        if dtype.is_floating_point:
            self.zero_neg[-1] = 0x80  # little-endian sign bit

    def stage(self, table: np.ndarray, ids: np.ndarray, staged: np.ndarray, byte_start: int, *, id_base: int,
              row_ids: np.ndarray, scale: torch.Tensor | None, scale_on_cpu: bool, oob_row0: bool) -> int:
        """Gather ``table[ids - id_base]`` (bytes from ``byte_start``) into ``staged`` (uint8 ``[n, nbytes]``),
        zero rows as the device half expects them; returns how many ids were out of range."""
        # zero rows leave the device multiply as -0.0 for oob="neg_zero", else +0.0
        neg = scale is not None and not scale_on_cpu and math.copysign(1.0, float(scale)) < 0
        return host_gather.cpu_gather(table, ids, staged, byte_start, oob_row0,
                                      self.zero_neg if neg != self.neg_zero else self.zero_pos,
                                      id_base=id_base, row_ids=row_ids)

    def scale_on_host(self, rows: torch.Tensor, ids: np.ndarray, table_rows: int, *, id_base: int,
                      scale: torch.Tensor, oob_row0: bool) -> None:
        """An inf/NaN scale: multiply the staged ``rows`` (``[n, ncols]``, table dtype) here, then restore
        the zero rows of out-of-range ids (+0.0, or -0.0 under ``oob="neg_zero"``)."""
        rows.mul_(scale)
        if not oob_row0:
            r = ids.astype(np.int64) - id_base
            bad = np.flatnonzero((r < 0) | (r >= table_rows))
            rows[torch.from_numpy(bad)] = -0.0 if self.neg_zero else 0.0

    @staticmethod
    def device_copy(src: torch.Tensor, dev_rows: torch.Tensor, out: torch.Tensor, n: int,
                    scale: torch.Tensor | None, direct: bool) -> Callable[[], None]:
        """The device half, to enqueue on the copy stream: staged ``src`` ``[n, ncols]`` (pinned) up into
        ``dev_rows`` (``out`` itself when ``direct``, else a table-dtype buffer), times ``scale`` (a finite
        one; None when there is none or it was applied on the CPU), then cast or copied into ``out``."""

        def device_work() -> None:
            if n == 0:
                return
            dev_rows.copy_(src, non_blocking=True)
            if scale is not None:
                dev_rows.mul_(scale)
            if not direct:
                out.copy_(dev_rows.view(out.shape))

        return device_work

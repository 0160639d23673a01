"""Plan once, then only launch: everything a table's gathers need, checked and chosen when a lookup is built.

FlashInfer's shape: a :class:`GatherPlan` is made once per lookup (``plan()``) from the table's tensor and
the policy as integers; :meth:`GatherPlan.run` (``run()``) is all a call does. The plan

* checks what it fixes (the table's layout, the row range, the policy codes, the fp8 scale, a hot set's
  buffers: :mod:`uvaple.kernels.checks`), once;
* makes the direct gather's launcher (:class:`~uvaple.kernels.gather.DirectGather`: the table's view as the
  kernel reads it, the constants, None for the buffers the constants leave unread, a tile config and a
  compiled kernel per column count, :class:`~uvaple.kernels.launch.KernelLaunch`) and, where calls may be
  sorted, the workspace (int64 ``[2, max_rows]``) and the sorted gather's launcher
  (:class:`~uvaple.kernels.gather_sorted.SortedGather`);
* resolves ``order`` into size classes: a call of ``n`` ids is sorted when ``n >= sort_from`` (``"auto"``:
  the smallest ``n`` that :func:`uvaple.kernels.tuning.use_sorted` sorts, which is monotone in ``n``);
  sorted calls take their program shape by size (``SortedGather.launch_config``).

A call (:meth:`run`) has had its ids and ``out`` checked by its caller (a lookup checks what the caller
controls: the ids' dtype, device and count, ``out``'s shape, dtype, layout and device, the column range),
picks the size class and launches on the current stream: no allocation, no synchronisation, no other
check. Under ``torch.compile`` a lookup calls the operators instead (they are what the compiler sees) with
the plan's :attr:`handle`: the operator then runs this plan's launchers after checking what the call
brings (:mod:`uvaple.kernels.registry`).
"""

from __future__ import annotations

import torch

from . import registry, tuning
from .checks import check_fixed, check_hot, check_workspace
from .gather import DirectGather
from .gather_sorted import SortedGather

__all__ = ["GatherPlan", "ORDERS", "NEVER", "first_sorted", "new_workspace"]

#: how a plan's calls read the table: in the caller's id order, sorted, or by size (tuning.use_sorted)
ORDERS = ("auto", "direct", "sorted")
NEVER = 1 << 62


class GatherPlan:
    """The gathers of ``table`` (2-D, unit column stride: host memory through UVA, or HBM) into ``out_dtype``
    rows on ``device`` with one policy; see the module docstring.

    ``bits``/``has_scale``: the model's scale (:func:`~uvaple.kernels.checks.scale_bits`); ``oob_mode``,
    ``dequant``, ``id_base``, ``row_lo``, ``counters``, ``dq_scale``: as the operators take them
    (:mod:`uvaple.kernels.gather`); ``hot_rows``/``slot_map``/``id_counts``: a hot set
    (:mod:`uvaple.kernels.gather_hot`); ``order``/``dedup``/``max_rows``: which calls are sorted (sorting needs
    ``max_rows``: the workspace is sized from it; ``workspace``: one made already, :func:`new_workspace`).

    ``hot_only_rows``: rows past the table's last that the hot set alone holds, valid ids of their own (the disk
    placement's hot rows, which no cache slot holds): the slot map's entries for them must each name a hot slot,
    checked here (one read of the map), so no id reaches past the table; the direct gather only.
    """

    def __init__(self, table: torch.Tensor, device: torch.device, out_dtype: torch.dtype, *, bits: int = 0,
                 has_scale: bool = False, oob_mode: int = 0, dequant: int = 0, id_base: int = 0, row_lo: int = 0,
                 counters: torch.Tensor | None = None, dq_scale: torch.Tensor | None = None,
                 hot_rows: torch.Tensor | None = None, slot_map: torch.Tensor | None = None,
                 id_counts: torch.Tensor | None = None, order: str = "direct", dedup: bool = False,
                 max_rows: int | None = None, workspace: torch.Tensor | None = None, hot_only_rows: int = 0) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if device.type == "cuda" and device.index is None:  # calls' tensors name their device's index
            device = torch.device("cuda", torch.cuda.current_device())
        check_fixed(table, dq_scale, id_base, row_lo, oob_mode, dequant, "gather_rows")
        if hot_rows is not None:
            check_hot(table, device, counters, hot_rows, slot_map, id_counts, hot_only_rows)
        elif hot_only_rows:
            raise ValueError("uvaple::gather_rows: rows past the table (hot_only_rows) need a hot set holding them")
        self.table_ptr, self.table_shape = table.data_ptr(), table.shape
        self.device, self.out_dtype = device, out_dtype  # what the launchers are made for (registry.find)
        self.hot_rows = hot_rows
        kw = dict(counters=counters, dq_scale=dq_scale, bits=bits, has_scale=has_scale, id_base=id_base,
                  row_lo=row_lo, oob_mode=oob_mode, dequant=dequant, hot_rows=hot_rows, slot_map=slot_map,
                  id_counts=id_counts)
        self.direct = DirectGather(table, device, out_dtype, hot_only_rows=hot_only_rows, **kw)
        self.row_bytes = table.shape[1] * table.element_size()
        self.span_bytes = (table.shape[0] - row_lo) * table.stride(0) * table.element_size()
        self.sort_from = first_sorted(order, dedup, max_rows, self.row_bytes, self.span_bytes, hot_rows is not None,
                                      dequant != 0)
        self.workspace = self.sorted = None
        if hot_only_rows and self.sort_from <= (max_rows or 0):
            raise ValueError("uvaple::gather_rows: rows past the table (hot_only_rows) are read by the direct gather "
                             "only; plan with order='direct'")
        if max_rows is not None and self.sort_from <= max_rows:
            self.workspace = workspace if workspace is not None else new_workspace(max_rows, device)
            check_workspace(self.workspace, max_rows, device)
            self.sorted = SortedGather(table, device, out_dtype, self.workspace, dedup=dedup, **kw)
        self.handle = registry.register(self)

    def uses_sorted(self, n: int) -> bool:
        """Whether a call of ``n`` ids takes the sorted path."""
        return n >= self.sort_from

    def run(self, ids: torch.Tensor, out: torch.Tensor, col_start: int = 0) -> None:
        """Gather ``ids`` (contiguous, on the plan's device) into ``out`` (``[*ids.shape, ncols]`` of the plan's
        dtype, contiguous) from column ``col_start``: both checked by the caller."""
        torch.autograd.graph.increment_version(out)  # `out` was written: autograd must know a saved one changed
        n = ids.numel()
        if n >= self.sort_from:
            self.sorted(ids, out, col_start, n)
        elif n:
            self.direct(ids, out, col_start, n)


def new_workspace(max_rows: int, device: torch.device) -> torch.Tensor:
    """The sorted gather's workspace for calls of up to ``max_rows`` ids: int64 ``[2, max_rows]``."""
    return torch.empty(2, max_rows, dtype=torch.int64, device=device)


def first_sorted(order: str, dedup: bool, max_rows: int | None, row_bytes: int, span_bytes: int, hot: bool,
                 dequant: bool) -> int:
    """The fewest ids a sorted call of a plan has (``NEVER``: none is sorted): ``order`` resolved for rows of
    ``row_bytes`` over ``span_bytes`` of table, with or without de-duplication, a hot set, fp8 rows."""
    if max_rows is None or order == "direct":
        return NEVER
    if order == "sorted":
        return 1
    lo, hi = 1, max_rows + 1  # use_sorted is monotone in n: the smallest n in [1, max_rows] it sorts, or past
    while lo < hi:
        mid = (lo + hi) // 2
        if tuning.use_sorted(mid, row_bytes, span_bytes, dedup, hot, dequant):
            hi = mid
        else:
            lo = mid + 1
    return lo if lo <= max_rows else NEVER

"""The gather through a hot set: rows resident in device memory read from there, the others from the table,
in one launch, same bits, direct or sorted (operator and fake; the kernels are :mod:`.gather`'s and
:mod:`.gather_sorted`'s with their ``HOT`` constant).

``hot_rows`` are device copies of some table rows (the table's dtype, width and row stride, so an fp8
row's own scale comes along) and ``slot_map`` (int32, one entry per table row) is each row's slot or -1: a
slot outside ``0 <= s < len(hot_rows)`` is a miss whatever the map holds, so no address outside either
buffer is ever formed. With a ``workspace`` the call is sorted (and de-duplicated with ``dedup``: a
prefill's repeats of misses read once, its hits from HBM); ``id_counts`` (int64, one per table row), when
given, counts each valid id's lookup on the device; ``counters`` (int64 ``[>= 4]``) count hits fourth.

Operator schema::

    uvaple::gather_rows_hot(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale,
        Tensor hot_rows, Tensor slot_map, Tensor(c!)? workspace, Tensor(d!)? id_counts, int scale_bits,
        bool has_scale, int col_start, int id_base, int row_lo, int oob_mode, int dequant, bool dedup,
        int plan=-1) -> ()
"""

from __future__ import annotations

import torch

from . import registry
from .checks import check_call, check_fixed, check_hot, check_reach, check_workspace
from .gather import DirectGather
from .gather_sorted import SortedGather

__all__: list[str] = []


def _gather_rows_hot(table, ids, out, counters, dq_scale, hot_rows, slot_map, workspace, id_counts, bits, has_scale,
                     col_start, id_base, row_lo, oob_mode, dequant, dedup, plan=-1) -> None:
    torch.autograd.graph.increment_version(out)
    mine = registry.find(plan, table, ids, out)
    if mine is not None and mine.hot_rows is hot_rows and (workspace is None or workspace is mine.workspace):
        if check_call(table, ids, out, col_start, dequant, "gather_rows_hot") and ids.numel():
            if workspace is None:
                mine.direct(ids, out, col_start, ids.numel())
            else:
                check_workspace(workspace, ids.numel(), ids.device)
                mine.sorted(ids, out, col_start, ids.numel())
        return
    check_fixed(table, dq_scale, id_base, row_lo, oob_mode, dequant, "gather_rows_hot")
    ncols = check_call(table, ids, out, col_start, dequant, "gather_rows_hot", dq_scale)
    check_reach(table, ids.device, out.dtype, has_scale, oob_mode, dequant, "gather_rows_hot")
    check_hot(table, ids.device, counters, hot_rows, slot_map, id_counts)
    if workspace is not None:
        check_workspace(workspace, ids.numel(), ids.device)
    if not ids.numel() or not ncols:
        return
    kw = dict(counters=counters, dq_scale=dq_scale, bits=bits, has_scale=has_scale, id_base=id_base, row_lo=row_lo,
              oob_mode=oob_mode, dequant=dequant, hot_rows=hot_rows, slot_map=slot_map, id_counts=id_counts)
    if workspace is None:
        DirectGather(table, ids.device, out.dtype, **kw)(ids, out, col_start, ids.numel())
    else:
        SortedGather(table, ids.device, out.dtype, workspace, dedup=dedup, **kw)(ids, out, col_start, ids.numel())


def _gather_rows_hot_fake(table, ids, out, counters, dq_scale, hot_rows, slot_map, workspace, id_counts, bits,
                          has_scale, col_start, id_base, row_lo, oob_mode, dequant, dedup, plan=-1) -> None:
    return None


_lib = torch.library.Library("uvaple", "FRAGMENT")
_lib.define("gather_rows_hot(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale, "
            "Tensor hot_rows, Tensor slot_map, Tensor(c!)? workspace, Tensor(d!)? id_counts, int scale_bits, "
            "bool has_scale, int col_start, int id_base, int row_lo, int oob_mode, int dequant, bool dedup, "
            "int plan=-1) -> ()")
_lib.impl("gather_rows_hot", _gather_rows_hot, "CompositeExplicitAutograd")
torch.library.register_fake("uvaple::gather_rows_hot", _gather_rows_hot_fake, lib=_lib)

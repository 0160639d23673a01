"""``torch.ops.uvaple.gather_rows``: the gather as an opaque operator, entered on every call, eager too.

``torch.compile`` and vLLM see a call that mutates ``out`` (and the counters) and nothing else; they never
trace into the Triton launcher and never treat a host table as something to copy. Eager calls go through
the same operator, so eager and compiled runs execute the same code and give the same bits.

Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: both are opaque to the
compiler, but the latter's Python wrapper costs ~20 us per call on a 2-core CI host where the plain
library operator costs ~2 us (measured with a no-op body), and the eager launch is on the hot path of
an eager decode step. The fake implementation makes it usable under FakeTensor/meta tracing.

Schema::

    uvaple::gather_rows(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale,
                        int scale_bits, bool has_scale, int col_start, int id_base, int row_lo,
                        int oob_mode, int dequant) -> ()

``oob_mode``: 0 zero rows, 1 row ``row_lo``, 2 -0.0 rows (a sum over ranks keeps every owner's bits).
``dequant``: 0 rows as stored, 1/2 fp8 e4m3fn/e5m2 codes times ``dq_scale`` (vLLM's formula).

``uvaple::gather_rows_sorted`` takes the same arguments plus ``Tensor(c!) workspace`` (int64
``[2, >= ids.numel()]``) and ``bool dedup``: the ids are sorted into the workspace and the rows read in
ascending id order (each written to its own output row), repeats read once when ``dedup``. Same bits.

``uvaple::gather_rows_hot`` takes the arguments of ``gather_rows`` plus ``Tensor hot_rows`` (device copies
of some table rows, the table's dtype, width and row stride) and ``Tensor slot_map`` (int32, one entry per
table row: its slot in ``hot_rows`` or -1): hits are read from ``hot_rows``, misses from the table, in one
launch; with ``Tensor(c!)? workspace`` and ``bool dedup`` (last), in sorted order as ``gather_rows_sorted``;
``Tensor(d!)? id_counts`` (int64, one per table row), when given, counts each valid id's lookup.
Same bits; ``counters`` (int64 ``[>= 4]``) count hits in their fourth entry.
Valid ids are ``row_lo <= id - id_base < table.shape[0]`` and read row ``id - id_base``
(``id_base``: the first id of a vocabulary shard stored alone).
"""

from __future__ import annotations

import torch

from .gather import launch, launch_hot, launch_sorted

_SCHEMA = ("gather_rows(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale, "
           "int scale_bits, bool has_scale, int col_start, int id_base, int row_lo, int oob_mode, int dequant) -> ()")

_lib = torch.library.Library("uvaple", "DEF")
_lib.define(_SCHEMA)
_lib.impl("gather_rows", launch, "CompositeExplicitAutograd")


_SORTED_SCHEMA = (
    "gather_rows_sorted(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale, "
    "Tensor(c!) workspace, int scale_bits, bool has_scale, int col_start, int id_base, int row_lo, int oob_mode, "
    "int dequant, bool dedup) -> ()")
_lib.define(_SORTED_SCHEMA)
_lib.impl("gather_rows_sorted", launch_sorted, "CompositeExplicitAutograd")


_HOT_SCHEMA = (
    "gather_rows_hot(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale, "
    "Tensor hot_rows, Tensor slot_map, Tensor(c!)? workspace, Tensor(d!)? id_counts, int scale_bits, "
    "bool has_scale, int col_start, int id_base, int row_lo, int oob_mode, int dequant, bool dedup) -> ()")
_lib.define(_HOT_SCHEMA)
_lib.impl("gather_rows_hot", launch_hot, "CompositeExplicitAutograd")


@torch.library.register_fake("uvaple::gather_rows_hot", lib=_lib)
def _gather_rows_hot_fake(table, ids, out, counters, dq_scale, hot_rows, slot_map, workspace, id_counts, scale_bits,
                          has_scale, col_start, id_base, row_lo, oob_mode, dequant, dedup) -> None:
    return None


@torch.library.register_fake("uvaple::gather_rows_sorted", lib=_lib)
def _gather_rows_sorted_fake(table, ids, out, counters, dq_scale, workspace, scale_bits, has_scale, col_start,
                             id_base, row_lo, oob_mode, dequant, dedup) -> None:
    return None


@torch.library.register_fake("uvaple::gather_rows", lib=_lib)
def _gather_rows_fake(table, ids, out, counters, dq_scale, scale_bits, has_scale, col_start, id_base, row_lo,
                      oob_mode, dequant) -> None:
    return None


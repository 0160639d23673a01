"""``make_lookup``: a lookup of any placement over a host table (or over a tensor, copied into one)."""

from __future__ import annotations

import torch

from uvaple.uva import HostTable

from .lookup import Lookup
from .placements.copy import CopyBackend
from .placements.gather import GatherLookup
from .placements.split import SplitLookup
from .spec import TableSpec, spec_for

__all__ = ["make_lookup", "KINDS"]

#: Placements :func:`make_lookup` builds.
KINDS = ("uva", "device", "split", "copy")


def make_lookup(kind: str, table, *, device=None, spec: TableSpec | None = None, max_rows: int | None = None,
                scale: float | None = None, oob: str = "zero", out_dtype: torch.dtype | None = None,
                column_block: int | None = None, **options) -> Lookup:
    """Build a lookup of placement ``kind`` (``"uva"``, ``"device"``, ``"split"`` or ``"copy"``) over ``table``.

    ``table`` is a :class:`HostTable` (shared, not closed by the lookup) or a 2-D tensor/ndarray, copied
    into a new HostTable that the lookup owns and closes. The policy comes from ``spec`` or from
    ``scale``/``oob``/``out_dtype``/``column_block``. ``options`` go to the placement (``view``, ``count``
    for uva/device; the gather's options for split, which needs ``max_rows``; the copy backend's slots and
    timeouts for copy).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown lookup kind {kind!r}; choose one of {list(KINDS)}")
    spec = spec_for(table, spec, scale=scale, oob=oob, out_dtype=out_dtype, column_block=column_block)
    owns = False
    if not isinstance(table, HostTable):
        table = HostTable.from_tensor(table) if isinstance(table, torch.Tensor) else HostTable.from_numpy(table)
        owns = True
    try:
        if kind == "copy":
            return CopyBackend(table, device=device, spec=spec, owns_table=owns, **options,
                               **({} if max_rows is None else {"max_rows": max_rows}))
        if kind == "split":
            return SplitLookup(table, spec, device, owns_table=owns, max_rows=max_rows, **options)
        return GatherLookup(table, spec, device, kind=kind, owns_table=owns, max_rows=max_rows, **options)
    except BaseException:
        if owns:
            table.close()
        raise

"""``HotSet``: the most frequent rows of a host table, resident in device memory, for token-id PLE tables.

Token ids follow real text, which is Zipfian: a few percent of a 200k vocabulary cover most lookups.
A hot set keeps ``capacity`` rows of a :class:`~uvaple.uva.HostTable` in HBM, byte for byte (the table's
dtype and row stride: a row's own fp8 scale comes along), with a device map from table row to slot (or
-1). A lookup built with ``hot=`` (:class:`~uvaple.integration.GatherLookup`) reads hits from HBM and
misses from the host table in the same launch (``uvaple::gather_rows_hot``), so the bits are those of the
uncached lookup whatever is resident.

Which rows: :meth:`HotSet.set_rows` takes them (distinct table rows, most important first), and
:func:`rank_rows` makes them from a profile: counts per row (a file of counts, or the ids of a text the
user gives, :func:`counts_of_ids`). Or the served ids themselves: with ``count_ids=True`` every lookup
through the hot set adds its valid ids to a device histogram (one relaxed atomic per id, in the kernel,
no host work), and :meth:`HotSet.refresh` ranks that histogram on the device and swaps the set, with no
host synchronisation at all.

Changing the rows (``set_rows``) is stream-ordered work on the current CUDA stream, in place: the map
entries of the rows leaving are cleared, the new rows copied into their slots, their map entries set. Call
it on the stream the lookups run on, between steps: every lookup enqueued before it reads the old set,
every one after it the new one, and a lookup never sees a slot whose row is being replaced (stream order;
no second stream: seed 004). The buffers never move, so CUDA graphs captured with the lookup stay valid
and see the new contents.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from uvaple.uva import HostTable

from ..devices import resolve_device

__all__ = ["HotSet", "rank_rows", "counts_of_ids", "HOT_OPTIONS", "hot_set_from_options"]

#: the lookup options that describe a hot set (``make_lookup``'s ``backend_options`` in the HF modules)
HOT_OPTIONS = ("cache_gb", "hot_fraction", "hot_profile", "count_ids")
# counts add_counts takes: every integer dtype that widens to int64 exactly
_COUNT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class HotSet:
    """``capacity`` rows of ``table`` in the memory of ``device`` (see the module docstring).

    Parameters
    ----------
    table : HostTable
        The table whose rows are cached (registered for a GPU lookup).
    capacity : int
        Slots (rows) in device memory; :meth:`capacity_for` converts bytes or a fraction.
    device : torch.device
        Where the hot rows and the map live (the lookup's device).
    rows : tensor, optional
        The first rows to hold (as :meth:`set_rows`).
    count_ids : bool
        Count the ids served through this set on the device, for :meth:`refresh`.
    """

    def __init__(self, table: HostTable, capacity: int, device: torch.device | str | int, *,
                 rows: torch.Tensor | None = None, count_ids: bool = False) -> None:
        if not isinstance(table, HostTable):
            raise TypeError(f"table must be a HostTable, got {type(table).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 0 < capacity <= table.rows:
            raise ValueError(f"capacity must be an int in 1..{table.rows} (the table's rows), got {capacity!r}")
        self.table = table
        self.device = resolve_device(device)  # "cuda" is the current device, as a lookup's
        self.capacity = capacity
        # the table's full stride, so the kernel addresses both with one row stride
        self._raw = torch.zeros(capacity, table.stride, dtype=table.dtype, device=self.device)
        self.rows = self._raw[:, : table.cols]
        self.slot_map = torch.full((table.rows,), -1, dtype=torch.int32, device=self.device)
        self.held = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)  # the row of each slot
        self._slots = torch.arange(capacity, dtype=torch.int32, device=self.device)
        self._count = 0
        # lookups per table row, added to by the kernel (count_ids); ranked by refresh()
        self.id_counts = torch.zeros(table.rows, dtype=torch.int64, device=self.device) if count_ids else None
        if rows is not None:
            self.set_rows(rows)

    @staticmethod
    def capacity_for(table: HostTable, *, cache_gb: float | None = None, fraction: float | None = None,
                     count_ids: bool = False) -> int:
        """Slots for ``cache_gb`` (10^9 bytes of device memory: the rows, the row-to-slot map, the slot
        lists and, with ``count_ids``, the served-id counts, all of :attr:`nbytes`) or ``fraction`` of the
        table's rows (one of them), at least 1 and at most every row."""
        if (cache_gb is None) == (fraction is None):
            raise ValueError("give exactly one of cache_gb= and fraction=")
        if cache_gb is not None:
            if not cache_gb > 0:
                raise ValueError(f"cache_gb must be positive, got {cache_gb!r}")
            fixed = table.rows * (4 + (8 if count_ids else 0))  # the map (int32), the counts (int64)
            budget = int(cache_gb * 1e9) - fixed
            if budget < table.stride_bytes + 12:
                raise ValueError(f"cache_gb={cache_gb!r} holds no row: the map of {table.rows} rows alone takes "
                                 f"{fixed / 1e9:.4g} GB of device memory" + (" with count_ids" if count_ids else ""))
            n = budget // (table.stride_bytes + 12)  # a row, its held-row entry (int64) and its slot (int32)
        else:
            if not 0 < fraction <= 1:
                raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
            n = int(table.rows * fraction)
        return max(1, min(table.rows, n))

    @property
    def size(self) -> int:
        """Rows held now."""
        return self._count

    @property
    def nbytes(self) -> int:
        """Device bytes the hot set holds: its rows, the map, the slot lists and the served-id counts."""
        counts = 0 if self.id_counts is None else self.id_counts.numel() * 8
        return self._raw.numel() * self._raw.element_size() + self.slot_map.numel() * 4 + self.held.numel() * 8 + \
            self._slots.numel() * 4 + counts

    def set_rows(self, rows: torch.Tensor) -> None:
        """Hold ``rows`` (distinct table rows, int, at most ``capacity``; the first ones when there are
        more) from now on, in stream order on the current stream (see the module docstring)."""
        if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
            raise TypeError(f"rows must be a 1-D int32/int64 tensor, got {rows!r}")
        rows = rows[: self.capacity].to(device=self.device, dtype=torch.int64)
        k = rows.numel()
        if k and (int(rows.min()) < 0 or int(rows.max()) >= self.table.rows):  # a profile's, not the hot path
            raise ValueError(f"hot rows must be table rows 0..{self.table.rows - 1}")
        if k and torch.unique(rows).numel() != k:
            raise ValueError("hot rows must be distinct")
        self._swap(rows, k)

    def add_counts(self, counts: torch.Tensor) -> None:
        """Add ``counts`` (int, one per table row, >= 0: :func:`counts_of_ids` of a profile, say) to the
        served-id counts :meth:`refresh` ranks (``count_ids``): a profile as the prior that the served ids
        then refine, fading with ``refresh``'s ``decay``. Stream-ordered on the current stream."""
        if self.id_counts is None:
            raise ValueError("add_counts() adds to the served-id counts: build the HotSet with count_ids=True")
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1 or counts.numel() != self.table.rows or \
                counts.dtype not in _COUNT_DTYPES:
            raise TypeError(f"counts must be a 1-D integer tensor of {self.table.rows} counts (one per table row), "
                            f"got {counts!r:.80}")
        if counts.numel() and int(counts.min()) < 0:  # a profile's, not the hot path
            raise ValueError("counts must be >= 0")
        self.id_counts.add_(counts.to(device=self.device, dtype=torch.int64))

    def refresh(self, *, decay: int = 1) -> None:
        """Hold the ``capacity`` rows served most often so far (``count_ids``), ranked on the device; then
        divide the counts by ``2**decay`` (0: keep them), so that recent ids weigh more. Stream-ordered
        on the current stream, without a host synchronisation (rows never served may fill the last slots:
        their ranking is arbitrary and they cost nothing but HBM)."""
        if self.id_counts is None:
            raise ValueError("refresh() ranks the served ids: build the HotSet with count_ids=True")
        if isinstance(decay, bool) or not isinstance(decay, int) or not 0 <= decay < 63:
            raise ValueError(f"decay must be an int in 0..62, got {decay!r}")
        top = torch.sort(self.id_counts, descending=True, stable=True).indices[: self.capacity]
        self._swap(top, top.numel())
        if decay:
            self.id_counts.bitwise_right_shift_(decay)

    def _swap(self, rows: torch.Tensor, k: int) -> None:
        """The set becomes ``rows`` (distinct, valid, ``k`` of them, int64 on the device): stream order."""
        if self._count:
            self.slot_map.index_fill_(0, self.held[: self._count], -1)  # leaving: misses from here on
        self.held.fill_(-1)
        if k:
            self._copy_rows(rows, k)
            self.held[:k].copy_(rows)
            self.slot_map.index_copy_(0, rows, self._slots[:k])
        self._count = k

    def _copy_rows(self, rows: torch.Tensor, k: int) -> None:
        """The table's bytes of ``rows`` into slots ``0..k`` (whole strides: a row scale comes along)."""
        t = self.table
        # on a GPU, the registered pages read by the GPU; on the CPU, the table itself
        src = t.cuda_view(self.device.index) if self.device.type == "cuda" else t.tensor
        full = torch.as_strided(src, (t.rows, t.stride), (t.stride, 1))
        torch.index_select(full, 0, rows.to(full.device), out=self._raw[:k])

    def __repr__(self) -> str:
        return f"HotSet({self._count}/{self.capacity} rows of {self.table.rows}, {self.device})"


def counts_of_ids(ids, rows: int, start: int = 0) -> torch.Tensor:
    """Counts per table row (int64 ``[rows]``) of ``ids``: a tensor, an array, or a path to a ``.npy``
    file or a text file of whitespace-separated ids (a tokenised text). Id ``start + r`` counts for row
    ``r`` (``start``: the first id of a vocabulary shard); ids outside ``start .. start + rows`` are not
    counted."""
    if isinstance(ids, (str, os.PathLike)):
        path = os.fspath(ids)
        if path.endswith(".npy"):
            ids = np.load(path)
        else:
            with open(path) as f:
                ids = np.array(f.read().split(), dtype=np.int64)
    t = torch.as_tensor(np.asarray(ids) if not isinstance(ids, torch.Tensor) else ids).reshape(-1).to(torch.int64)
    t = t.cpu() - start
    t = t[(t >= 0) & (t < rows)]
    return torch.bincount(t, minlength=rows)


def rank_rows(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` rows with the highest counts (ties: the lower row first), rows never counted excluded."""
    if not isinstance(counts, torch.Tensor) or counts.dim() != 1:
        raise TypeError("counts must be a 1-D tensor of counts per row")
    order = torch.sort(counts.cpu().to(torch.int64), descending=True, stable=True).indices
    top = order[:k]
    return top[counts.cpu()[top] > 0]


def hot_set_from_options(table: HostTable, device, options: dict, placement) -> HotSet | None:
    """Take the hot-set settings out of ``options`` (a module's lookup options for ``placement``, the factory's
    entry) and build its HotSet, or None without them: ``cache_gb`` or ``hot_fraction`` (the size),
    ``hot_profile`` (counts per row, or ids / a file of ids ranked by :func:`rank_rows`), ``count_ids`` (count
    served ids for :meth:`HotSet.refresh`)."""
    if not placement.hot_set and any(k in options for k in HOT_OPTIONS):
        raise ValueError(f"{sorted(k for k in options if k in HOT_OPTIONS)}: a hot set stands in front of a table "
                         f"the GPU reads from host memory, not of the {placement.name!r} placement")
    cache_gb, fraction = options.pop("cache_gb", None), options.pop("hot_fraction", None)
    profile, count_ids = options.pop("hot_profile", None), options.pop("count_ids", False)
    if cache_gb is None and fraction is None:
        if profile is not None or count_ids:
            raise ValueError("hot_profile and count_ids describe a hot set: give its size too (cache_gb= or "
                             "hot_fraction=)")
        return None
    k = HotSet.capacity_for(table, cache_gb=cache_gb, fraction=fraction, count_ids=bool(count_ids))
    rows = None
    if profile is not None:
        # one integer count per table row is a counts profile; anything else, ids (or a file of them)
        is_counts = isinstance(profile, torch.Tensor) and profile.dim() == 1 and profile.numel() == table.rows \
            and not profile.is_floating_point()
        counts = profile if is_counts else counts_of_ids(profile, table.rows)
        rows = rank_rows(counts, k)
    hot = HotSet(table, k, device, rows=rows, count_ids=bool(count_ids))
    if profile is not None and count_ids:
        hot.add_counts(counts)  # the profile is the prior that refresh() ranks with the served ids
    return hot

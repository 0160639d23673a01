"""The placements and what each serves; ``make_lookup`` builds a lookup of any of them.

:data:`PLACEMENTS` is the one list of placements. Each entry (a :class:`Placement`) says how its lookup is
built and what it serves: which row encodings it reads, whether an HBM hot set may stand in front of it,
whether its rows stay in host memory and whether the GPU maps them, whether CUDA graphs can capture its
calls and whether model layers (the HF swap-ins; the vLLM plugin) serve it, each refusal with its reason.
Everything above the library (``embedding``, ``encoded_embedding``, the hot set's options, the vLLM
plugin's settings and shards) asks the entry, never a placement's name: a new placement is its module under
``placements/`` and one entry here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from uvaple.kernels.encodings import ENCODINGS
from uvaple.uva import HostTable, TableFile

from .lookup import Lookup
from .placements.copy import CopyBackend
from .placements.disk import DiskLookup
from .placements.gather import GatherLookup
from .placements.split import SplitLookup
from .spec import TableSpec, spec_for

__all__ = ["make_lookup", "KINDS", "PLACEMENTS", "Placement", "placement", "model_placements"]


@dataclass(frozen=True)
class Placement:
    """A placement: how its lookup is built and what it serves (see the module docstring)."""

    name: str
    #: ``(table, spec, device, owns_table, max_rows, options) -> Lookup``
    build: Callable[..., Lookup]
    #: the row encodings its lookups read (None: every entry of the encoding registry)
    encodings: frozenset[str] | None = None
    #: an HBM hot set (``HotSet``) may serve its hottest rows from device memory
    hot_set: bool = False
    #: the rows stay in host memory (False: the lookup keeps a copy in device memory)
    host_rows: bool = True
    #: the GPU reads the host table through UVA, so the table must be registered (mapped) for it
    mapped: bool = False
    #: it takes the gather lookup's options (``dequant_scale``, ``order``, ``dedup``, ``hot``, ``count``, ``view``)
    gather_options: bool = True
    #: why a CUDA graph cannot capture its calls (None: graphs capture them like any other op)
    graph_refusal: str | None = None
    #: why model layers do not serve it (None: the HF swap-ins do, and the vLLM plugin unless ``engine_refusal``)
    model_refusal: str | None = None
    #: why the vLLM plugin does not serve it where the HF swap-ins do (None: it does)
    engine_refusal: str | None = None
    #: its table is a table file on disk (``TableFile``; ``make_lookup`` opens a path), not a ``HostTable``
    reads_file: bool = False
    #: ``(options, max_rows=None, row_bytes=None) -> None``: a ValueError naming an option its lookups would refuse
    #: (None: its lookups check their options when built)
    option_check: Callable[..., None] | None = None

    def check_options(self, options: dict, **call) -> None:
        """A ValueError naming an option its lookups would refuse (an option they do not take, a bad value, a size
        too small for ``max_rows`` rows of ``row_bytes``): for a caller that builds the lookups after work a bad
        option would waste."""
        if self.option_check is not None:
            self.option_check(options, **call)

    def reads(self, encoding: str) -> bool:
        """Whether its lookups read rows stored in ``encoding``."""
        return encoding in ENCODINGS if self.encodings is None else encoding in self.encodings


def _gather(kind: str):
    def build(table, spec, device, owns_table, max_rows, options):
        return GatherLookup(table, spec, device, kind=kind, owns_table=owns_table, max_rows=max_rows, **options)
    return build


def _split(table, spec, device, owns_table, max_rows, options):
    return SplitLookup(table, spec, device, owns_table=owns_table, max_rows=max_rows, **options)


def _disk(table, spec, device, owns_table, max_rows, options):
    return DiskLookup(table, spec, device, owns_table=owns_table, max_rows=max_rows, **options)


def _copy(table, spec, device, owns_table, max_rows, options):
    return CopyBackend(table, device=device, spec=spec, owns_table=owns_table, **options,
                       **({} if max_rows is None else {"max_rows": max_rows}))


#: Every placement, by name (the order is the one messages list them in).
PLACEMENTS: dict[str, Placement] = {p.name: p for p in (
    Placement("uva", _gather("uva"), hot_set=True, mapped=True),
    Placement("device", _gather("device"), host_rows=False),
    Placement("split", _split, mapped=True,
              graph_refusal="a split call gathers part of its rows on the calling thread from ids on the host",
              model_refusal="the split placement gathers part of each call on the calling thread from ids on the "
                            "host, and a model's PLE layer has its ids on the GPU (under vLLM, inside its CUDA "
                            "graphs): use 'uva' (the GPU reads the rows it needs from host memory)"),
    Placement("copy", _copy, encodings=frozenset({"raw"}), gather_options=False,
              graph_refusal="each copy-placement call waits on the host for its ids and records events on the "
                            "calling stream"),
    Placement("disk", _disk, mapped=True, gather_options=False, reads_file=True, option_check=DiskLookup.check_options,
              graph_refusal="a disk call plans its rows on the host and reads the missing ones from the file on "
                            "the calling thread"),
)}

#: Placements :func:`make_lookup` builds.
KINDS = tuple(PLACEMENTS)


def placement(name: str) -> Placement:
    """The entry of placement ``name``, or a ValueError naming the placements."""
    entry = PLACEMENTS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown placement {name!r}; choose one of {list(PLACEMENTS)}")
    return entry


def model_placements(*, engine: bool = False) -> tuple[str, ...]:
    """The placements model layers serve: the HF swap-ins' ``backend``, or with ``engine`` the vLLM plugin's
    ``placement``."""
    return tuple(name for name, p in PLACEMENTS.items()
                 if p.model_refusal is None and not (engine and p.engine_refusal is not None))


def make_lookup(kind: str, table, *, device=None, spec: TableSpec | None = None, max_rows: int | None = None,
                scale: float | None = None, oob: str = "zero", out_dtype: torch.dtype | None = None,
                column_block: int | None = None, **options) -> Lookup:
    """Build a lookup of placement ``kind`` (a name of :data:`PLACEMENTS`: ``"uva"``, ``"device"``, ``"split"``,
    ``"copy"`` or ``"disk"``) over ``table``.

    ``table`` is a :class:`HostTable` (shared, not closed by the lookup) or a 2-D tensor/ndarray, copied
    into a new HostTable that the lookup owns and closes; for ``"disk"``, a :class:`~uvaple.uva.TableFile`
    (not closed by the lookup) or its path (opened, and closed with the lookup). The policy comes from ``spec`` or from
    ``scale``/``oob``/``out_dtype``/``column_block``. ``options`` go to the placement (``view``, ``count``
    for uva/device; the gather's options for split, which needs ``max_rows``; the copy backend's slots and
    timeouts for copy; the row cache's ``budget_bytes`` or ``slots``, ``steps_in_flight``, ``wait_s`` and
    ``dequant_scale`` for disk, which needs ``max_rows``).
    """
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown lookup kind {kind!r}; choose one of {list(PLACEMENTS)}")
    entry = PLACEMENTS[kind]
    if entry.reads_file:
        return _file_lookup(entry, table, device, spec, max_rows, options,
                            dict(scale=scale, oob=oob, out_dtype=out_dtype, column_block=column_block))
    if isinstance(table, TableFile):
        readers = [name for name, p in PLACEMENTS.items() if p.reads_file]
        raise TypeError(f"a table file is read by the {readers} placement, not {kind!r}; for {kind!r} load the "
                        "rows into a HostTable")
    spec = spec_for(table, spec, scale=scale, oob=oob, out_dtype=out_dtype, column_block=column_block)
    owns = False
    if not isinstance(table, HostTable):
        table = HostTable.from_tensor(table) if isinstance(table, torch.Tensor) else HostTable.from_numpy(table)
        owns = True
    try:
        return PLACEMENTS[kind].build(table, spec, device, owns, max_rows, options)
    except BaseException:
        if owns:
            table.close()
        raise


def _file_lookup(entry: Placement, table, device, spec, max_rows, options, policy) -> Lookup:
    """A lookup of a placement that reads a table file: ``table`` a ``TableFile`` or its path (opened here, and
    closed with the lookup)."""
    owns = isinstance(table, (str, os.PathLike))
    if owns:
        table = TableFile.open(table)
    elif not isinstance(table, TableFile):
        raise TypeError(f"the {entry.name} placement reads a table file: pass its path or a uvaple.uva.TableFile "
                        f"(write one with uvaple.uva.write_table_file), got {type(table).__name__}")
    try:
        entry.check_options(options)
        spec = spec_for(table, spec, **policy)
        return entry.build(table, spec, device, owns, max_rows, options)
    except BaseException:
        if owns:
            table.close()
        raise

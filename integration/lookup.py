"""The one lookup interface every placement implements: ``lookup(ids, out)`` on the caller's stream.

A :class:`Lookup` is built once from a :class:`~uvaple.integration.spec.TableSpec` (validated at
construction) and a placement; a call with ``out`` allocates nothing and never synchronises. The base class
holds what every placement shares: the table and spec, the per-call checks of what the caller controls
(:meth:`Lookup._prepare`: the ids' dtype, device and count, ``out``'s shape, dtype, layout and device, the
column range; everything else was checked when the lookup was built), the refusal of a closed lookup and of
one inherited through ``fork()``, ``stats()``/``progress()``, and the lifetime.

Placements (:mod:`uvaple.integration.placements`), siblings behind this interface:

* ``uva`` / ``device``: :class:`~uvaple.integration.placements.gather.GatherLookup`, the Triton gather over
  the table in pinned, mapped host memory (through UVA) or over an HBM copy (the speed and memory
  reference); with a :class:`~uvaple.integration.placements.hot.HotSet`, hot rows read from HBM.
* ``split``: :class:`~uvaple.integration.placements.split.SplitLookup`, a gather lookup that also takes host
  ids and has the calling thread gather a share of the rows on the CPU.
* ``copy``: :class:`~uvaple.integration.placements.copy.CopyBackend`, the classic copy-based path (worker
  thread, CPU gather, staged host-to-device copy), built so it cannot wedge: the baseline.

Every placement gives the same bits for the same ids: ``uva``, ``device`` and ``copy`` under random overlapped
schedules (``tests/test_equivalence.py``), ``split`` against the gather it extends (``tests/test_gpu_lookup.py``).

Lifetime: a lookup holds views of its table, so the table's memory stays mapped (and registered) while the
lookup lives, also if the table is closed under it. ``close()`` drops them (and closes a table the lookup
owns); a lookup dropped without ``close()`` is freed by reference counting. In a forked child a lookup
built by the parent refuses calls (:class:`~uvaple.integration.errors.LookupForkedError`): its table is the
parent's (a private table reads zeros in the child), and so are its streams and threads.
"""

from __future__ import annotations

import abc
import os

import torch

from uvaple.kernels.checks import ID_DTYPES, check_ids, check_out
from uvaple.kernels.ngram import ngram_rows
from uvaple.uva import HostTable

from .devices import default_device, resolve_device
from .errors import BackendClosed, LookupForkedError
from .spec import TableSpec
from .telemetry import Progress

__all__ = ["Lookup", "default_device"]


class Lookup(abc.ABC):
    """Rows ``table[ids, columns]`` with the spec's policy, on ``device`` (see the module docstring).

    Parameters
    ----------
    table : HostTable
        The table (not closed by the lookup unless ``owns_table``).
    spec : TableSpec
        Its shape and the policy of the rows returned.
    device : torch.device
        Where ids come from and rows go.
    max_rows : int, optional
        Most ids per call; workspaces are sized from it (a larger call is an error). Default: no bound
        (placements that need one set their own).
    """

    kind = "base"

    def __init__(self, table: HostTable, spec: TableSpec, device, *, owns_table: bool = False,
                 max_rows: int | None = None) -> None:
        if (spec.rows, spec.cols, spec.dtype) != (table.rows, table.cols, table.dtype) or \
                spec.stride not in (table.stride, table.cols):
            raise ValueError(f"spec {spec.describe()} (stride {spec.stride}) does not describe the table {table!r} "
                             f"(stride {table.stride}); build it with TableSpec.of(table, ...)")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        self.table = table
        self.spec = spec
        self.device = resolve_device(device)
        self.max_rows = max_rows
        self._owns_table = owns_table
        self._closed = False
        self._whole = spec.columns(None)
        self._out_dtype = spec.output_dtype

    # ------------------------------------------------------------------ shape
    @property
    def rows(self) -> int:
        return self.spec.rows

    @property
    def cols(self) -> int:
        return self.spec.cols

    @property
    def dtype(self) -> torch.dtype:
        """The table's dtype (the output's is ``spec.output_dtype``)."""
        return self.spec.dtype

    # ------------------------------------------------------------------ calls
    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> torch.Tensor:
        """Rows for ``ids`` (int32/int64, any shape, on ``device``) in ``out`` ``[*ids.shape, ncols]``.

        ``columns``: ``None`` (whole rows) or a range the spec allows (``column_block``). ``out`` is
        allocated when omitted; pass it on the hot path. Non-contiguous ids are copied first.
        """

    def lookup_ngrams(self, history: torch.Tensor, *, multipliers: torch.Tensor, sizes: torch.Tensor,
                      offsets: torch.Tensor, eos: int, last: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of an n-gram PLE layer's ids (Qwen4Exp's): for each of the last ``last`` positions of
        ``history [B, L]`` (int64 tokens, on ``device``), the rows of its n-gram ids, ``[B, last, heads, cols]``
        in ``out`` (allocated when omitted), the same rows as ``lookup(ngram_rows(history, ...))``.

        ``multipliers``, ``sizes``, ``offsets`` (int64, on ``device``) and ``eos``: the layer's hash
        (:mod:`uvaple.kernels.ngram`). This base hashes in one launch, then calls :meth:`lookup` (the count of
        ids, ``B * last * heads``, is what ``max_rows`` bounds); a placement that can compute the ids inside its
        gather does (:class:`~uvaple.integration.placements.gather.GatherLookup`: one launch).
        """
        ids = ngram_rows(history, eos=eos, multipliers=multipliers, sizes=sizes, offsets=offsets, last=last)
        return self.lookup(ids, out)

    @property
    def _forked(self) -> bool:
        """True in a forked child: the lookup's table (and its streams and threads) are the parent's."""
        return self.table.forked

    def _check_usable(self) -> None:
        """Refuse a closed lookup, and one inherited through ``fork()``."""
        if self._closed:
            raise BackendClosed(f"this {self.kind} lookup was closed; build a new one")
        if self._forked:
            raise LookupForkedError(
                f"this {self.kind} lookup was built in process {self.table.owner_pid}, and this is a forked "
                f"child (pid {os.getpid()}): its table, streams and threads are the parent's (a private "
                "table reads zeros here). Build the table and the lookup in the child (HostTable.attach "
                "for a shared table)")

    def _prepare(self, ids: torch.Tensor, out: torch.Tensor | None, columns, *, ids_on: str = "device",
                 allocate: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        """The per-call checks of every placement, of what the caller controls (everything else was checked
        when the lookup was built): the lookup open and not inherited through ``fork()``, the ids' dtype, their
        device (``ids_on``: ``"device"``, this lookup's; ``"host"``, the CPU; ``"either"``), their count
        (``max_rows``: :meth:`_too_many`), the column range, ``out``'s shape, dtype, layout and device
        (:meth:`_shape_call`). Returns (contiguous ids, ``out``, the column range); ``out`` is allocated when
        None and ``allocate``."""
        if self._closed or self.table.forked:
            self._check_usable()
        if not isinstance(ids, torch.Tensor) or ids.dtype not in ID_DTYPES:
            check_ids(ids)
        if ids.device != self.device or ids_on == "host":  # only host ids may still be right here
            if ids_on == "device" or ids.device.type != "cpu":
                want = {"device": f"this lookup serves {self.device}", "host": "this call takes host ids (on the CPU)",
                        "either": f"pass host ids (on the CPU) or ids on {self.device}"}[ids_on]
                raise ValueError(f"ids are on {ids.device}; {want}")
        out, c0, c1 = self._shape_call(ids.numel(), ids.shape, out, columns, allocate)
        return (ids if ids.is_contiguous() else ids.contiguous()), out, c0, c1

    def _shape_call(self, n: int, shape, out: torch.Tensor | None, columns=None,
                    allocate: bool = True) -> tuple[torch.Tensor | None, int, int]:
        """The per-call checks that do not read the ids, of a call of ``n`` ids shaped ``shape``: the column
        range, ``n`` within ``max_rows``, ``out`` ``[*shape, columns]`` of the output's dtype on ``device``
        (allocated when None and ``allocate``). Returns (``out``, the column range)."""
        c0, c1 = self._whole if columns is None else self.spec.columns(columns)
        if self.max_rows is not None and n > self.max_rows:
            raise self._too_many(n)
        want = (*shape, c1 - c0)
        if out is not None:
            # the usual call passes every test at once; check_out names what a call got wrong
            if not (isinstance(out, torch.Tensor) and out.dtype is self._out_dtype and out.shape == want
                    and out.device == self.device and out.is_contiguous()):
                check_out(out, want, self._out_dtype, self.device)
        elif allocate:
            out = torch.empty(want, dtype=self._out_dtype, device=self.device)
        return out, c0, c1

    def _too_many(self, n: int) -> Exception:
        """The error of a call of ``n`` ids, more than ``max_rows``."""
        return ValueError(f"{n} ids in one call, but this lookup was built for max_rows={self.max_rows}; build it "
                          "with a larger max_rows or split the call")

    def stats(self) -> dict:
        """Progress counters (lookups, rows, out-of-range ids) and what the lookup holds."""
        return {"kind": self.kind, "closed": self._closed, "device_bytes": self.device_bytes()}

    def progress(self) -> Progress:
        """The counters as far as they are known without a host synchronisation, and how old they may be
        (:class:`~uvaple.integration.telemetry.Progress`; never waits, allocates no device memory)."""
        return Progress(kind=self.kind, closed=self._closed)

    def device_bytes(self) -> int:
        """Bytes of device memory this lookup holds for the table."""
        return 0

    # ------------------------------------------------------------------ lifetime
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drop the lookup's hold on the table (closing it when owned). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_table:
            self.table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, {self.spec.describe()}, device={self.device})"

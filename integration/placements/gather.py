"""``GatherLookup``: the Triton gather over the table where it lies, host memory (``uva``) or HBM (``device``).

Built once (FlashInfer's plan/run): the lookup takes the device-readable view of its table (a CUDA tensor
aliasing the registered host pages, marked static for ``torch.compile``; or an HBM copy), its counters,
and a :class:`~uvaple.kernels.plan.GatherPlan` that has checked the policy and made every launcher, the
sort's workspace included. A call checks only what the caller controls (:meth:`Lookup._prepare`: the ids'
dtype, device and count, ``out``, the column range) and runs the plan: in eager mode the plan launches
directly; under ``torch.compile`` the lookup calls the operator the call's size class needs
(``torch.ops.uvaple.gather_rows`` / ``_sorted`` / ``_hot``) with the plan's handle, so the compiler sees an
opaque operator and the operator runs the same plan. No allocation (with ``out``), no host
synchronisation, on the caller's stream: capturable in a CUDA graph and compilable with
``fullgraph=True``.

Lifetime: the lookup holds views of its table, so the table's memory stays mapped (and registered) while
the lookup lives, also if the table is closed under it. A plan that launched under CUDA graph capture keeps
its host table for the life of the process (:mod:`uvaple.kernels.capture`): a graph may replay any time.

Counters: an int64 ``[4]`` device tensor the kernels add to (lookups, rows, out-of-range ids, hot-set hits):
correct under CUDA graph replays, no host work on the hot path. ``stats()`` reads it with one
synchronisation, at its call; ``progress()`` without any: the newest completed copy to pinned host memory,
and its age (:class:`~uvaple.integration.telemetry.CounterSnapshots`).
"""

from __future__ import annotations

import torch

from uvaple.kernels import eager_call
from uvaple.kernels.encodings import ENCODINGS as _REGISTRY
from uvaple.kernels.gather_ngram import NgramGather
from uvaple.kernels.ngram import check_eos, check_history
from uvaple.kernels.plan import ORDERS, GatherPlan, first_sorted, new_workspace
from uvaple.uva import HostTable

from ..lookup import Lookup
from ..spec import TableSpec
from ..telemetry import CounterSnapshots, Progress

__all__ = ["GatherLookup"]


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile the tensor never moves: CUDA graphs must not copy it in before each replay."""
    if t.is_cuda:
        try:
            torch._dynamo.mark_static_address(t)
        except Exception:  # noqa: BLE001 - an optimisation hint only; absent on some torch builds
            pass
    return t


class GatherLookup(Lookup):
    """The Triton gather over the table where it lies: host memory (``uva``) or an HBM copy (``device``).

    Parameters
    ----------
    table, spec, device, owns_table, max_rows :
        As in :class:`~uvaple.integration.lookup.Lookup`.
    kind : {"uva", "device"}
        Where the kernel reads: the registered host table through UVA, or a copy in HBM.
    view : {"cuda", "host"}
        ``uva`` only: hand the kernel a CUDA tensor aliasing the registered pages (default: then
        ``torch.compile`` sees CUDA inputs only and keeps CUDA graphs on) or the CPU tensor over them;
        both are the same bytes.
    count : bool
        Keep device counters for ``stats()`` (default True; one relaxed atomic per call and per
        out-of-range id).
    dequant_scale : torch.Tensor, optional
        The float32 ``[1]`` scale of an ``fp8_global`` table, on ``device``; read by every call (so a
        scale loaded in place later, as vLLM's loader does, is the one used).
    order : {"auto", "direct", "sorted"}
        How a call reads the table. ``direct``: in the caller's id order. ``sorted``: the ids are sorted
        on the device first and the rows read in ascending id order, each written to its own output row:
        random small rows spread over a big table are read several times faster in order. ``auto``
        (default): sorted where the committed sweep measured it faster
        (:func:`uvaple.kernels.tuning.use_sorted`: by ids per call, row bytes and table span; with ``dedup``
        also every call of ``tuning.dedup_min_ids`` ids or more), else direct. Sorting needs ``max_rows``:
        its workspace (``2 x max_rows`` int64) is allocated here, once, where some call may be sorted;
        without ``max_rows`` every call is direct. Sorted calls of one lookup share that workspace: calls
        on several streams at once must be ordered by the caller, as calls writing one ``out`` are.
    dedup : bool
        With the sorted order, read each distinct id of the call once: its repeats copy the first
        reader's output row. Same bits either way. Off by default: finding repeats needs several rows per
        program, and on random 160-B rows that shape was 1.43x slower at 65,536 ids than one row per
        program (tuning.sorted_config); turn it on where ids repeat a lot (token-id tables). With
        ``order="auto"`` a prefill-sized call is then sorted and de-duplicated whatever the rows, from
        2,048 ids, or with a hot set from 4,096 (16,384 for fp8 rows; ``tuning.dedup_min_ids``); decode-sized
        calls stay direct.
    hot : HotSet, optional
        Rows of this table resident in device memory (:class:`uvaple.integration.HotSet`): each call reads
        them from there and the others from the table, in one launch, same bits, in either order;
        ``stats()`` adds hits, misses and the bytes the hits did not move.
    """

    def __init__(self, table: HostTable, spec: TableSpec | None = None, device=None, *, kind: str = "uva",
                 owns_table: bool = False, max_rows: int | None = None, view: str = "cuda",
                 count: bool = True, dequant_scale: torch.Tensor | None = None, order: str = "auto",
                 dedup: bool = False, hot=None) -> None:
        if not isinstance(table, HostTable):
            raise TypeError(f"table must be a HostTable, got {type(table).__name__}")
        spec = spec or TableSpec.of(table)
        super().__init__(table, spec, device, owns_table=owns_table, max_rows=max_rows)
        if kind not in ("uva", "device"):
            raise ValueError(f"kind must be 'uva' or 'device', got {kind!r}")
        if view not in ("host", "cuda"):
            raise ValueError(f"view must be 'host' or 'cuda', got {view!r}")
        if order not in ORDERS:
            raise ValueError(f"order must be 'auto', 'direct' or 'sorted', got {order!r}")
        if order == "sorted" and max_rows is None:
            raise ValueError("order='sorted' needs max_rows: the sort's workspace is sized from it")
        self.kind = kind
        on_gpu = self.device.type == "cuda"
        if kind == "uva":
            if on_gpu and not table.registered:
                raise ValueError("the uva placement needs a registered HostTable (build it with register=True on "
                                 "a CUDA machine), or use the 'copy' placement")
            self._arg = _static(table.cuda_view(self.device.index)) if on_gpu and view == "cuda" else table.tensor
        else:
            self._arg = _static(table.tensor.to(self.device, copy=True).contiguous())
        lo, hi = spec.window
        if hi < table.rows:
            self._arg = self._arg[:hi]  # ids >= hi are outside: the kernel's row count is hi
        self._row_lo = lo
        self._dq_scale = None
        if _REGISTRY[spec.encoding].scale == "global":
            s = dequant_scale
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1 or s.device != self.device:
                raise ValueError(f"an {spec.encoding} lookup needs dequant_scale: a float32 tensor of one element on "
                                 f"{self.device}, got {s!r}")
            self._dq_scale = s.reshape(1)
        elif dequant_scale is not None:
            raise ValueError(f"dequant_scale is for fp8_global tables (an encoding with one global scale); this "
                             f"spec's encoding is {spec.encoding!r}")
        # static too: a compiled CUDA graph mutates the counters in place, replay after replay
        self._counters = _static(torch.zeros(4, dtype=torch.int64, device=self.device)) if count else None
        # progress(): double-buffered pinned copies of the counters on a side stream, made here, once (a
        # lookup built while torch.compile traces, as a module's lazy one, makes them at its first progress())
        self._snapshots = CounterSnapshots(self._counters) if count and not torch.compiler.is_compiling() else None
        self._hot = None
        if hot is not None:
            from .hot import HotSet

            if not isinstance(hot, HotSet) or hot.table is not table or hot.device != self.device:
                raise ValueError(f"hot must be a HotSet of this table on {self.device}, got {hot!r}")
            if kind != "uva":
                raise ValueError("a hot set serves the uva placement")
            self._hot = hot
        self._row_bytes = spec.cols * table.itemsize
        self.order = order if max_rows is not None else "direct"
        self.dedup = bool(dedup)
        self._span_bytes = (hi - lo) * table.stride_bytes
        self._sort_from = first_sorted(self.order, self.dedup, max_rows, self._row_bytes, self._span_bytes,
                                       self._hot is not None, spec.dequant != 0)
        self._workspace = new_workspace(max_rows, self.device) if self._sort_from <= (max_rows or 0) else None
        # The plan: made here, or, for a lookup built while torch.compile traces (a module's lazy one), at its
        # first eager call (compiled calls take the operators' own path until then)
        self._eager = None  # the whole-row eager call below Python (kernels/eager_call.py), made with the plan
        self._plan = None if torch.compiler.is_compiling() else self._make_plan()
        self._ngram: NgramGather | None = None  # lookup_ngrams' launcher, for the last layer hash it served

    def _make_plan(self) -> GatherPlan:
        spec, hot = self.spec, self._hot
        self._plan = GatherPlan(
            self._arg, self.device, spec.output_dtype, bits=spec.scale_arg, has_scale=spec.has_scale,
            oob_mode=spec.oob_mode, dequant=spec.dequant, id_base=spec.id_offset, row_lo=self._row_lo,
            counters=self._counters, dq_scale=self._dq_scale, hot_rows=None if hot is None else hot.rows,
            slot_map=None if hot is None else hot.slot_map, id_counts=None if hot is None else hot.id_counts,
            order=self.order, dedup=self.dedup, max_rows=self.max_rows, workspace=self._workspace)
        self._eager = eager_call.for_lookup(self._plan, self.device, spec.output_dtype, self._whole, self.max_rows)
        return self._plan

    @property
    def hot(self):
        """The :class:`~uvaple.integration.HotSet` this lookup reads hits from, or None."""
        return self._hot

    @property
    def plan(self) -> GatherPlan:
        """The lookup's plan: its launchers, made once."""
        self._check_usable()
        return self._plan or self._make_plan()

    def uses_sorted(self, n: int) -> bool:
        """Whether a call of ``n`` ids takes the sorted path."""
        return n >= self._sort_from

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        if columns is None and not compiling:
            eager = self._eager  # whole rows, eager: the C call, which declines what it is unsure of (None)
            if eager is not None:
                done = eager(ids, out)
                if done is not None:
                    return done
        ids, out, c0, _ = self._prepare(ids, out, columns)
        if compiling:
            self._operator(ids, out, c0)
        else:
            (self._plan or self._make_plan()).run(ids, out, c0)
        return out

    def lookup_ngrams(self, history: torch.Tensor, *, multipliers: torch.Tensor, sizes: torch.Tensor,
                      offsets: torch.Tensor, eos: int, last: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`Lookup.lookup_ngrams` in one launch: the ids hashed inside the gather
        (:class:`~uvaple.kernels.gather_ngram.NgramGather`, made at the first call of a layer's hash buffers and
        kept while they are the same tensors), same bits, same counters. A lookup with a hot set, a call the plan
        sorts (prefill-sized, ``order``), and a call while ``torch.compile`` traces take the base's hash, then
        the gather."""
        if self._closed or self.table.forked:
            self._check_usable()
        if self._hot is not None or torch.compiler.is_compiling():
            return super().lookup_ngrams(history, multipliers=multipliers, sizes=sizes, offsets=offsets, eos=eos,
                                         last=last, out=out)
        plan = self._plan or self._make_plan()
        fused = self._ngram
        if fused is None or not fused.serves(multipliers, sizes, offsets, eos):
            check_eos(eos)
            if isinstance(multipliers, torch.Tensor) and multipliers.device != self.device:
                raise ValueError(f"the n-gram hash's multipliers are on {multipliers.device}; this lookup serves "
                                 f"{self.device}")
            fused = self._ngram = NgramGather(plan.direct, multipliers, sizes, offsets, eos)
        check_history(history, last)
        if history.device != self.device:
            raise ValueError(f"history is on {history.device}; this lookup serves {self.device}")
        n = history.shape[0] * last * fused.heads
        out, c0, _ = self._shape_call(n, (history.shape[0], last, fused.heads), out)
        if plan.uses_sorted(n):
            return super().lookup_ngrams(history, multipliers=multipliers, sizes=sizes, offsets=offsets, eos=eos,
                                         last=last, out=out)
        torch.autograd.graph.increment_version(out)  # `out` was written: autograd must know a saved one changed
        fused(history, out, c0, last)
        return out

    def _operator(self, ids: torch.Tensor, out: torch.Tensor, c0: int) -> None:
        """The call as the compiler sees it: the operator of its size class, given the plan's handle."""
        spec, handle = self.spec, -1 if self._plan is None else self._plan.handle
        policy = (spec.scale_arg, spec.has_scale, c0, spec.id_offset, self._row_lo, spec.oob_mode, spec.dequant)
        ws = self._workspace if self.uses_sorted(ids.numel()) else None
        if self._hot is not None:
            hot = self._hot
            torch.ops.uvaple.gather_rows_hot(self._arg, ids, out, self._counters, self._dq_scale, hot.rows,
                                             hot.slot_map, ws, hot.id_counts, *policy, self.dedup, handle)
        elif ws is not None:
            torch.ops.uvaple.gather_rows_sorted(self._arg, ids, out, self._counters, self._dq_scale, ws, *policy,
                                                self.dedup, handle)
        else:
            torch.ops.uvaple.gather_rows(self._arg, ids, out, self._counters, self._dq_scale, *policy, handle)

    def stats(self) -> dict:
        st = super().stats()
        if self._counters is not None:
            if self._counters.is_cuda:  # count work launched on any stream, not only the current one
                torch.cuda.synchronize(self._counters.device)
            lookups, rows, oob, hits = self._counters.tolist()  # the one synchronisation: here, not per call
            st.update(lookups=lookups, rows=rows, out_of_range_ids=oob)
            if self._hot is not None:
                st.update(hot_hits=hits, hot_misses=rows - oob - hits, hot_bytes_saved=hits * self._row_bytes,
                          hot_rows=self._hot.size)
        return st

    def progress(self) -> Progress:
        """The newest completed snapshot of the device counters, without a host synchronisation.

        Polls the snapshot copy in flight and enqueues the next one on the lookup's side stream (which
        waits on nothing of the model's); returns values at most ``age_s`` seconds old, eventually those of
        ``stats()``. Under CUDA graph capture on this thread it returns the last snapshot and enqueues
        nothing. See :class:`~uvaple.integration.telemetry.CounterSnapshots` for the race with the kernels.
        """
        if self._counters is None:
            return Progress(kind=self.kind, closed=self._closed)
        if self._snapshots is None:
            if self._counters.is_cuda and torch.cuda.is_current_stream_capturing():
                return Progress(kind=self.kind, closed=self._closed)  # made at a read outside capture
            self._snapshots = CounterSnapshots(self._counters)
        (lookups, rows, oob, hits), age = self._snapshots.read()
        return Progress(kind=self.kind, closed=self._closed, lookups=lookups, rows=rows,
                        bytes=rows * self._row_bytes, out_of_range_ids=oob,
                        hot_hits=hits if self._hot is not None else None, age_s=age)

    def device_bytes(self) -> int:
        if self.kind == "device" and self._arg is not None and self._arg.is_cuda:
            return self._arg.numel() * self._arg.element_size()
        return 0

    def close(self) -> None:
        if self._eager is not None:
            self._eager.close()  # a call holding it from another thread declines from now on
            self._eager = None
        self._arg = None
        self._workspace = None
        self._plan = self._ngram = None
        super().close()

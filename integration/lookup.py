"""One lookup object for every placement: ``lookup(ids, out)`` on the caller's stream.

A :class:`Lookup` is built once from a :class:`~uvaple.integration.spec.TableSpec` (validated at
construction) and a placement, FlashInfer-style: everything a call needs (the table's device-readable
view, the counters) exists before the first call, and a call with ``out`` allocates nothing, never
synchronises and launches through the ``uvaple::gather_rows`` op (one kernel) or, for big calls of small
rows, ``uvaple::gather_rows_sorted`` (a device sort into a workspace allocated with the lookup, then one
kernel), so it can be captured in a CUDA graph and compiled with ``torch.compile(fullgraph=True)``.

Placements
----------
* ``uva``: the table stays in pinned, mapped host memory (:class:`~uvaple.uva.HostTable`); the gather
  reads it over PCIe through unified virtual addressing. No thread, no queue, no event: stream order is
  the only synchronisation.
* ``device``: a copy of the table in HBM, same kernel: the speed and memory reference.
* ``copy``: the classic copy-based path (worker thread, CPU gather, staged host-to-device copy), built so
  it cannot wedge: the baseline, and the fallback where UVA is unavailable
  (:mod:`uvaple.integration.copy`).

Every placement gives the same bits for the same ids (``tests/test_equivalence.py``).

Lifetime: a lookup holds views of its table, so the table's memory stays mapped (and registered) while
the lookup lives, also if the table is closed under it. ``close()`` drops them (and closes a table the
lookup owns); a lookup dropped without ``close()`` is freed by reference counting. In a forked child a
lookup built by the parent refuses calls (:class:`~uvaple.integration.errors.LookupForkedError`): its
table is the parent's (a private table reads zeros in the child, ``uvaple.uva.host_table``), and so are
its streams and threads. ``close()`` there only lets go of the child's copies; what holds the parent's
CUDA resources (a split lookup's pinned staging, events and graphs, the counters' pinned snapshots) is
kept, never freed, in the child (``_fork.keep_in_child``): freeing it there would abort the child.

Counters: ``stats()`` reads an int64 ``[4]`` tensor that the kernel adds to on the device (lookups,
rows, out-of-range ids, hot-set hits): correct under CUDA graph replays, and no host work on the hot
path. Reading it synchronises with the device, once, at the ``stats()`` call. ``progress()`` reads it
without any synchronisation: the newest completed copy to pinned host memory, and its age
(:mod:`uvaple.integration.metrics`).
"""

from __future__ import annotations

import abc
import os
import threading
import weakref

import torch

from uvaple.kernels import heuristics
from uvaple.kernels.capture import RelaxedCaptureMode
from uvaple.kernels.gather import check_ids, check_out, prepared_launch
from uvaple.uva import HostTable
from uvaple.uva._cuda import copy_async

from ._fork import keep_in_child
from .copy.cpu_gather import gather_up, ids_within, split_rows, warm_split
from .devices import default_device, resolve_device
from .errors import BackendClosed, LookupForkedError
from .metrics import CounterSnapshots, Progress
from .spec import TableSpec

__all__ = ["Lookup", "GatherLookup", "default_device"]


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile the table never moves: CUDA graphs must not copy it in before each replay."""
    if t.is_cuda:
        try:
            torch._dynamo.mark_static_address(t)
        except Exception:  # noqa: BLE001 - an optimisation hint only; absent on some torch builds
            pass
    return t


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

    @property
    def _forked(self) -> bool:
        """True in a forked child: the lookup's table (and its streams and threads) are the parent's."""
        return self.table._region.foreign

    def _check_usable(self) -> None:
        """Refuse a closed lookup, and one inherited through ``fork()``."""
        if self._closed:
            raise BackendClosed(f"this {self.kind} lookup was closed; build a new one")
        if self._forked:
            raise LookupForkedError(
                f"this {self.kind} lookup was built in process {self.table._region.pid}, and this is a forked "
                f"child (pid {os.getpid()}): its table, streams and threads are the parent's (a private "
                "table reads zeros here). Build the table and the lookup in the child (HostTable.attach "
                "for a shared table)")

    def _prepare(self, ids: torch.Tensor, out: torch.Tensor | None, columns) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The per-call checks every placement shares: (contiguous ids, out, first column)."""
        self._check_usable()
        check_ids(ids)
        if ids.device != self.device:
            raise ValueError(f"ids are on {ids.device}; this lookup serves {self.device}")
        c0, c1 = self.spec.columns(columns)
        if self.max_rows is not None and ids.numel() > self.max_rows:
            raise ValueError(f"{ids.numel()} ids in one call, but this lookup was built for max_rows="
                             f"{self.max_rows}; build it with a larger max_rows or split the call")
        want = (*ids.shape, c1 - c0)
        if out is None:
            out = torch.empty(want, dtype=self.spec.output_dtype, device=self.device)
        else:
            check_out(out, want, self.spec.output_dtype, self.device)
        return (ids if ids.is_contiguous() else ids.contiguous()), out, c0

    def stats(self) -> dict:
        """Progress counters (lookups, rows, out-of-range ids) and what the lookup holds."""
        return {"kind": self.kind, "closed": self._closed, "device_bytes": self.device_bytes()}

    def progress(self) -> Progress:
        """The counters as far as they are known without a host synchronisation, and how old they may be
        (:class:`~uvaple.integration.metrics.Progress`; never waits, allocates no device memory)."""
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


class GatherLookup(Lookup):
    """The Triton gather over the table where it lies: host memory (``uva``) or an HBM copy (``device``).

    Parameters
    ----------
    table, spec, device, owns_table, max_rows :
        As in :class:`Lookup`.
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
        How a call reads the table. ``direct``: in the caller's id order (``uvaple::gather_rows``).
        ``sorted``: the ids are sorted on the device first and the rows read in ascending id order, each
        written to its own output row (``uvaple::gather_rows_sorted``): random small rows spread over a
        big table are read several times faster in order. ``auto`` (default): sorted where the committed
        sweep measured it faster (:func:`uvaple.kernels.heuristics.use_sorted`: by ids per call, row bytes
        and table span; with ``dedup`` also every call of ``heuristics.dedup_min_ids`` ids or more), else
        direct.
        Sorting needs ``max_rows``: its workspace (``2 x max_rows`` int64)
        is allocated here, once (with ``auto``, only for rows the heuristic may sort); without
        ``max_rows`` every call is direct. Sorted calls of one lookup share that workspace: calls on
        several streams at once must be ordered by the caller, as calls writing one ``out`` are.
    dedup : bool
        With the sorted order, read each distinct id of the call once: its repeats copy the first
        reader's output row. Same bits either way. Off by default: finding repeats needs several rows per
        program, and on random 160-B rows that shape was 1.43x slower at 65,536 ids than one row per
        program (heuristics.sorted_config); turn it on where ids repeat a lot (token-id tables). With
        ``order="auto"`` a prefill-sized call is then sorted and de-duplicated whatever the rows, from 2,048
        ids, or with a hot set from 4,096 (16,384 for fp8 rows: the set already saves most of the reads;
        ``heuristics.dedup_min_ids``); decode-sized calls stay direct.
    split : bool
        Also serve :meth:`lookup_split` (ids on the host; the caller's thread gathers a share of the rows
        while the GPU gathers the rest). Needs ``max_rows``: pinned staging for that many rows and ids, and
        a device buffer of the same size, are allocated here, once.
    hot : HotSet, optional
        Rows of this table resident in device memory (:class:`uvaple.integration.HotSet`): each call reads
        them from there and the others from the table, in one launch, same bits, in either order (and
        with ``dedup``: a prefill's repeats read once, its hot ids from HBM); ``stats()`` adds hits,
        misses and the bytes the hits did not move.
    """

    def __init__(self, table: HostTable, spec: TableSpec | None = None, device=None, *, kind: str = "uva",
                 owns_table: bool = False, max_rows: int | None = None, view: str = "cuda",
                 count: bool = True, dequant_scale: torch.Tensor | None = None, order: str = "auto",
                 dedup: bool = False, split: bool = False, hot=None) -> None:
        if not isinstance(table, HostTable):
            raise TypeError(f"table must be a HostTable, got {type(table).__name__}")
        spec = spec or TableSpec.of(table)
        super().__init__(table, spec, device, owns_table=owns_table, max_rows=max_rows)
        if kind not in ("uva", "device"):
            raise ValueError(f"kind must be 'uva' or 'device', got {kind!r}")
        if view not in ("host", "cuda"):
            raise ValueError(f"view must be 'host' or 'cuda', got {view!r}")
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
        if spec.encoding == "fp8_global":
            s = dequant_scale
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1 or s.device != self.device:
                raise ValueError(f"an fp8_global lookup needs dequant_scale: a float32 tensor of one element on "
                                 f"{self.device}, got {s!r}")
            self._dq_scale = s.reshape(1)
        elif dequant_scale is not None:
            raise ValueError("dequant_scale is for fp8_global tables; this spec's encoding is "
                             f"{spec.encoding!r}")
        # static too: a compiled CUDA graph mutates the counters in place, replay after replay
        self._counters = _static(torch.zeros(4, dtype=torch.int64, device=self.device)) if count else None
        # progress(): double-buffered pinned copies of the counters on a side stream, made here, once (a
        # lookup built while torch.compile traces, as a module's lazy one, makes them at its first progress())
        self._snapshots = CounterSnapshots(self._counters) if count and not torch.compiler.is_compiling() else None
        self._hot = None
        if hot is not None:
            from .hotset import HotSet

            if not isinstance(hot, HotSet) or hot.table is not table or hot.device != self.device:
                raise ValueError(f"hot must be a HotSet of this table on {self.device}, got {hot!r}")
            if kind != "uva" or split:
                raise ValueError("a hot set serves the uva placement (not split)")
            self._hot = hot
        if order not in ("auto", "direct", "sorted"):
            raise ValueError(f"order must be 'auto', 'direct' or 'sorted', got {order!r}")
        if order == "sorted" and max_rows is None:
            raise ValueError("order='sorted' needs max_rows: the sort's workspace is sized from it")
        self._span_bytes = (hi - lo) * table.stride_bytes
        self._row_bytes = spec.cols * table.itemsize  # once: itemsize builds a tensor, not for the hot path
        self.order = order if max_rows is not None else "direct"
        self.dedup = bool(dedup)
        self._workspace = None
        # "auto" never sorts rows above SORT_MAX_ROW_BYTES (Gemma 3n's) unless it de-duplicates calls of
        # heuristics.dedup_min_ids ids or more: no workspace otherwise
        self._auto_hot, self._auto_dequant = self._hot is not None, spec.dequant != 0
        if self.order == "sorted" or (self.order == "auto" and (
                self._row_bytes <= heuristics.SORT_MAX_ROW_BYTES or
                (self.dedup and max_rows >= heuristics.dedup_min_ids(self._auto_hot, self._auto_dequant)))):
            self._workspace = torch.empty(2, max_rows, dtype=torch.int64, device=self.device)
        self._split = None
        if split:
            if max_rows is None or not on_gpu or kind != "uva":
                raise ValueError("split=True needs max_rows and the uva placement on a CUDA device (the CPU share is "
                                 "copied to the GPU from pinned staging)")
            self._split = _SplitState(self, max_rows, self.device)

    @property
    def hot(self):
        """The :class:`~uvaple.integration.HotSet` this lookup reads hits from, or None."""
        return self._hot

    def uses_sorted(self, n: int) -> bool:
        """Whether a call of ``n`` ids takes the sorted path."""
        if self.order == "auto":
            return heuristics.use_sorted(n, self._row_bytes, self._span_bytes, self.dedup, self._auto_hot,
                                         self._auto_dequant)
        return self.order == "sorted"

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> torch.Tensor:
        ids, out, c0 = self._prepare(ids, out, columns)
        spec = self.spec
        if self._hot is not None:
            ws = self._workspace if self._workspace is not None and self.uses_sorted(ids.numel()) else None
            hot = self._hot
            torch.ops.uvaple.gather_rows_hot(self._arg, ids, out, self._counters, self._dq_scale, hot.rows,
                                             hot.slot_map, ws, hot.id_counts, spec.scale_arg, spec.has_scale, c0,
                                             spec.id_offset, self._row_lo, spec.oob_mode, spec.dequant, self.dedup)
        elif self._workspace is not None and self.uses_sorted(ids.numel()):
            torch.ops.uvaple.gather_rows_sorted(self._arg, ids, out, self._counters, self._dq_scale, self._workspace,
                                                spec.scale_arg, spec.has_scale, c0, spec.id_offset, self._row_lo,
                                                spec.oob_mode, spec.dequant, self.dedup)
        else:
            torch.ops.uvaple.gather_rows(self._arg, ids, out, self._counters, self._dq_scale, spec.scale_arg,
                                         spec.has_scale, c0, spec.id_offset, self._row_lo, spec.oob_mode,
                                         spec.dequant)
        return out

    def lookup_split(self, ids: torch.Tensor, out: torch.Tensor, *, gpu_share: float | None = None,
                     chunk_rows: int | None = None) -> torch.Tensor:
        """Rows for host ``ids`` (a CPU int32/int64 tensor: the scheduler's) in ``out`` (on ``device``): the
        first ``gpu_share`` of them gathered by the GPU (the direct or sorted path, as :meth:`lookup`), the
        rest by this thread into pinned staging (``heuristics.SPLIT_CPU_PATH``), copied to the device and
        given the spec's policy by the same kernel. The staged rows are copied up ``chunk_rows`` at a time
        (default :func:`uvaple.kernels.heuristics.split_chunk_rows`), each chunk's copy beside the gather of
        the next. No worker thread, no queue: the staging is reused
        only after the previous call's copy out of it has completed (an event this lookup owns, waited
        for here). Not under CUDA graph capture (host work cannot be captured). Same bits as
        :meth:`lookup`. ``gpu_share`` defaults to :func:`uvaple.kernels.heuristics.split_gpu_share`.

        A GPU share within the ladder of :func:`uvaple.kernels.heuristics.split_graph_sizes` is rounded down
        to the ladder's size and replays the CUDA graph of :meth:`lookup` for that size captured when the
        lookup was built (one launch on the host: the split's own host work is what decides it at 65,536
        ids); its rows land in a device buffer and are copied into ``out`` after the CPU's gather.
        """
        self._check_usable()
        if self._split is None:
            raise ValueError("this lookup was built without split=True")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lookup_split runs host work per call and cannot be captured in a CUDA graph; "
                               "capture lookup() with device ids instead")
        check_ids(ids)
        if ids.device.type != "cpu":
            raise ValueError(f"lookup_split takes host ids (the CPU gathers its share), got ids on {ids.device}")
        n = ids.numel()
        if n > self.max_rows:
            raise ValueError(f"{n} ids in one call, but this lookup was built for max_rows={self.max_rows}")
        c0, c1 = self.spec.columns(None)
        check_out(out, (*ids.shape, c1 - c0), self.spec.output_dtype, self.device)
        share = heuristics.split_gpu_share(n, self._row_bytes, self._span_bytes) if gpu_share is None \
            else float(gpu_share)
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"gpu_share must be in [0, 1], got {gpu_share!r}")
        if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                       or chunk_rows < 1):
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        if n == 0:
            return out  # as lookup(): nothing launched, nothing counted
        k = round(n * share)
        sp = self._split
        graph_rows = sp.graph_rows(k, n)
        if graph_rows:
            k = graph_rows  # the GPU's share replays the graph of the ladder's size at or below it
        flat_ids, flat_out = ids.reshape(-1), out.view(n, -1)
        with sp.lock:
            sp.free.synchronize()  # the previous call's copies out of the staging are done
            stream = torch.cuda.current_stream(sp.device_index)
            waited = False  # whether the caller's stream already waits for every copy queued out of the staging
            try:
                if k:  # the GPU's share first: it runs while this thread gathers the rest
                    sp.ids_host[:k].copy_(flat_ids[:k])
                    dev_ids = sp.ids_dev[:k]
                    # (raw copies: this state's buffers, fenced by `free` before any reuse or release)
                    if not copy_async(sp.ids_dev.data_ptr(), sp.ids_host.data_ptr(), k * 8, stream.cuda_stream,
                                      "the GPU share's ids"):
                        dev_ids.copy_(sp.ids_host[:k], non_blocking=True)
                    if graph_rows:
                        sp.graphs[k].replay()  # lookup(ids_dev[:k], gpu_out[:k]) on this stream
                    else:
                        self.lookup(dev_ids, flat_out[:k])
                m = n - k
                if m:
                    self._stage_cpu_share(flat_ids[k:], flat_out[k:], k, n, heuristics.split_chunk_rows(n)
                                          if chunk_rows is None else chunk_rows, stream)
                    waited = True
                if graph_rows and not copy_async(flat_out.data_ptr(), sp.gpu_out.data_ptr(),
                                                 k * sp.gpu_out.stride(0) * sp.gpu_out.element_size(),
                                                 stream.cuda_stream, "the GPU share's rows"):
                    flat_out[:k].copy_(sp.gpu_out[:k])
            finally:  # also after a failure: the staging is free only once every copy queued out of it is done
                if not waited:
                    stream.wait_stream(sp.copy_stream)
                sp.free.record(stream)
        return out

    def _stage_cpu_share(self, cpu_ids: torch.Tensor, out: torch.Tensor, k: int, n: int, chunk: int,
                         stream) -> None:
        """The CPU's share of a split call (ids ``k .. n``, their rows ``out``): gathered into the pinned
        staging, copied up on the copy stream chunk by chunk as gathered (beside the GPU share's reads on the
        caller's stream), then given the spec's policy by one kernel on the caller's stream, after it waits
        for the copies. The staging is this lookup's alone and free (``lookup_split`` waited for it)."""
        sp, spec = self._split, self.spec
        m = n - k
        lo, hi = spec.window
        row0, off = spec.oob == "row0", spec.id_offset
        path = heuristics.SPLIT_CPU_PATH

        def stage(rows):
            gather_up(sp.table_bytes, rows, sp.rows_host, sp.rows_dev, sp.copy_stream, sp.row_bytes, chunk, path=path,
                      track=False)

        # Every id a row of the window: the ids are the rows to stage (less the offset), and staged row j is
        # staged id j (a device arange, nothing to copy up). Over the whole table, index_select itself
        # refuses an id outside it (IndexError, before reading it): nothing to check first. Otherwise one
        # aminmax decides, and where it fails one serial pass maps the ids. A gather abandoned at an
        # IndexError leaves copies queued on the copy stream; those of the serial pass's gather come after
        # them on that stream and write the same device rows last.
        staged_ids, bad = None, 0
        if sp.whole_window and path == "torch":
            try:
                stage(cpu_ids)
                staged_ids = sp.arange_dev[:m]
            except IndexError:
                pass
        elif ids_within(cpu_ids, lo + off, hi + off):
            stage(cpu_ids if off == 0 else sp.rows_idx[:m].copy_(cpu_ids).sub_(off))
            staged_ids = sp.arange_dev[:m]
        if staged_ids is None:
            bad = split_rows(cpu_ids.numpy(), off, lo, hi, row0, sp.rows_idx[:m].numpy(), sp.ids_host[k:n].numpy())
            staged_ids = sp.ids_dev[k:n]
            with torch.cuda.stream(sp.copy_stream):
                staged_ids.copy_(sp.ids_host[k:n], non_blocking=True)
            stage(sp.rows_idx[:m])
        sp.staged.record(sp.copy_stream)
        stream.wait_event(sp.staged)
        sp.policy(staged_ids, out)  # the kernel of gather_rows over the staged rows (every staged id below m)
        if self._counters is not None:  # one call, whatever its shares; row0's staged ids look valid
            if k:
                self._counters[0].sub_(1)
            if row0 and bad:
                self._counters[2].add_(bad)

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
        nothing. See :class:`~uvaple.integration.metrics.CounterSnapshots` for the race with the kernels.
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
        if self._split is not None and not self._forked:  # (a forked child has no CUDA)
            self._split.release()  # no copy may still read the staging when it goes; also inside a capture
        self._arg = None
        self._workspace = None
        self._split = None
        super().close()


def _wait_free(free: torch.cuda.Event, graphs: dict) -> None:
    """A split state's last words: its device buffers and graphs go back only after the last call's work
    (copies out of the staging, graph replays) is done. The wait and the graphs' destruction run in the
    relaxed capture mode: the collector (or ``close()``) may run this in the middle of a graph capture,
    which either would otherwise invalidate. Not in a forked child: no CUDA there."""
    if not torch.cuda._is_in_bad_fork():
        with RelaxedCaptureMode():
            free.synchronize()
            for g in graphs.values():
                g.reset()
            graphs.clear()


class _SplitState:
    """What :meth:`GatherLookup.lookup_split` reuses call after call: pinned staging for rows and ids, their
    device twins, the event that says the staging is free again, a lock (one call at a time), and the
    CUDA graphs of the GPU share (one per size of the ladder, ``heuristics.split_graph_sizes``) with the
    device buffer they write."""

    def __init__(self, lookup: GatherLookup, max_rows: int, device: torch.device) -> None:
        table = lookup.table
        stride = table.stride_bytes  # 16-byte aligned rows, as in the table
        self.rows_host = torch.empty(max_rows, stride, dtype=torch.uint8, pin_memory=True)
        self.ids_host = torch.empty(max_rows, dtype=torch.int64, pin_memory=True)
        self.rows_dev = torch.empty(max_rows, stride, dtype=torch.uint8, device=device)
        self.ids_dev = torch.empty(max_rows, dtype=torch.int64, device=device)
        self.arange_dev = torch.arange(max_rows, dtype=torch.int64, device=device)  # staged ids, all in range
        self.rows_idx = torch.empty(max_rows, dtype=torch.int64)  # the table rows the CPU stages
        self.row_bytes = table.row_bytes  # once: HostTable.row_bytes builds a tensor
        self.table_bytes = table.tensor.view(torch.uint8)
        self.device_index = device.index  # (resolve_device: a CUDA device always has its index)
        self.staged_rows = self.rows_dev[:, : self.row_bytes].view(table.dtype)  # the policy kernel's table
        spec = lookup.spec
        c0, c1 = spec.columns(None)
        # the policy over the staged rows, checked here once: one kernel launch a call (through the operator,
        # with its checks each call, the split took 3-6% longer; torch's own ops, where every staged row is
        # valid and the policy is vLLM's fp8 formula, took less host time but as long or 4% longer to
        # complete: perf/results/h200_2026-12-03/run11_split_policy_ab)
        self.policy = prepared_launch(self.staged_rows, spec.output_dtype, c1 - c0, lookup._counters, lookup._dq_scale,
                                      spec.scale_arg, spec.has_scale, spec.oob_mode, spec.dequant)
        lo, hi = spec.window
        self.whole_window = lo == 0 and hi == table.rows and spec.id_offset == 0
        with torch.cuda.device(device):
            self.free = torch.cuda.Event()
            self.staged = torch.cuda.Event()
            self.copy_stream = torch.cuda.Stream(device)
        warm_split()
        self.lock = threading.Lock()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # filled by _capture
        # close() calls it; the collector does where the state is dropped without close()
        self.release = weakref.finalize(self, _wait_free, self.free, self.graphs)
        self.release.atexit = False
        keep_in_child(self)  # its pinned staging, events and graphs are never freed in a forked child
        self.graph_sizes = heuristics.split_graph_sizes(max_rows, (c1 - c0) * spec.output_dtype.itemsize)
        self.gpu_out = None
        if self.graph_sizes:
            self.gpu_out = torch.empty(self.graph_sizes[-1], c1 - c0, dtype=spec.output_dtype, device=device)
            self._capture(lookup, device)
        with torch.cuda.device(device):
            self.free.record()  # after the capture's warm-up (the current stream waited for it): a first call
            # on any stream finds the warm-up's writes to ids_dev, gpu_out and the counters done

    def graph_rows(self, k: int, n: int) -> int:
        """The GPU share of ``k`` of a call's ``n`` ids as the size of the graph that serves it (at or below
        ``k``), or 0: the share launches eagerly (all or none of the call, or off the ladder)."""
        return heuristics.split_graph_rows(k, self.graph_sizes) if 0 < k < n else 0

    def _capture(self, lookup: GatherLookup, device: torch.device) -> None:
        """One graph of ``lookup.lookup(ids_dev[:k], gpu_out[:k])`` per ladder size ``k``, on a side stream
        (each path compiled first by an eager call on zero ids; the counters restored after it), all in
        one memory pool: they never run at the same time. The current stream waits for the side stream,
        also when a capture fails."""
        top = self.graph_sizes[-1]
        counters = lookup._counters
        saved = counters.clone() if counters is not None else None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.device(device), torch.cuda.stream(side):
                try:
                    self.ids_dev[:top].zero_()
                    for k in self.graph_sizes:
                        lookup.lookup(self.ids_dev[:k], self.gpu_out[:k])
                    pool = None
                    for k in self.graph_sizes:
                        g = torch.cuda.CUDAGraph()
                        # thread-local: other threads' CUDA calls go on while this one captures
                        g.capture_begin(pool=pool, capture_error_mode="thread_local")
                        try:
                            lookup.lookup(self.ids_dev[:k], self.gpu_out[:k])
                        except BaseException:
                            try:
                                g.capture_end()
                            except Exception:  # the capture's own error says less than the one raised above
                                pass
                            raise
                        g.capture_end()
                        pool = g.pool()
                        self.graphs[k] = g
                finally:
                    if saved is not None:
                        counters.copy_(saved)
        finally:
            torch.cuda.current_stream(device).wait_stream(side)

"""``SplitLookup``: a uva gather lookup that also takes host ids and lets the calling thread gather a share.

Host ids (the scheduler's, a CPU tensor) in, rows in device ``out``: the GPU gathers the first share of
the call (as :meth:`GatherLookup.lookup`; a split by table rows instead, the GPU taking the ids of the
table's first rows so that they lie as densely as the whole call's, was built and measured slower, commit
8b914a8) while the calling thread gathers the rest into pinned staging
(:func:`~uvaple.integration.placements.host_gather.gather_up`: ``torch.index_select``, or the copy
backend's numba gather of 8-byte words, ``SPLIT_CPU_PATH``), copied up in chunks (``split_chunk_rows``),
each chunk's copy beside the gather of the next; the direct kernel over the staged rows applies the spec's
policy (ids mapped so that out-of-range ones stay out of range), through a plan made once. Eager only
(refused under capture: host work cannot be captured). No thread of ours, no queue.

The staging is reused only after the lookup's event says the previous copy out of it is done; a lock keeps
one call at a time. The split's host work is what decides it at 65,536 ids (a call's gather there is ~300
us of 16 threads), so each step is the cheapest one measured:

* The GPU share replays a CUDA graph of ``lookup(ids_dev[:k], gpu_out[:k])``, one per size of a ladder
  (``split_graph_sizes``: 4 sizes an octave from 4,096 to 262,144 rows and 128 MiB of output), all captured
  when the lookup is built (each path run once on zero ids first, the counters restored), in one memory
  pool. A share between two sizes is rounded down; outside the ladder it launches eagerly. Its rows land
  in ``gpu_out`` and are copied into ``out`` after the CPU's gather.
* Over the whole table (window = table, no id offset) nothing checks the CPU's ids first: ``index_select``
  raises ``IndexError`` at an id outside the table before reading it, and the call then runs the serial
  pass. With a window or an offset one ``torch.aminmax`` decides. In range, the ids are staged as they are
  (less the offset) and the policy kernel reads the staged rows through a device arange the lookup owns;
  otherwise one serial numba pass (``split_rows``) maps them and the mapped ids go up too.
* Every chunk but the last goes up through the runtime's ``cudaMemcpyAsync`` (7-10 us on the host where
  torch's ``copy_`` takes 19-21); the last through torch's ``copy_``, whose event in torch's pinned-memory
  cache keeps the staging from being handed out again before every copy out of it is done.

The staged rows go up on a copy stream the lookup owns, beside the GPU share's reads; the caller's stream
waits on an event before the policy kernel. That stream touches only the lookup's own staging. A split
state dropped without ``close()`` waits for its last call's work (a finaliser on the event) before its
buffers and graphs go; in a forked child the whole split state is kept, never freed, not even at the
child's exit (:func:`~uvaple.integration.fork.keep_in_child`: freeing pinned staging makes a CUDA call,
which aborts a child).

The plan below (``SPLIT_PLAN``: the GPU's share and the rows per copy, by ids per call) and the graph
ladder are this placement's measured tables, with their sources.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import torch

from uvaple.kernels.capture import RelaxedCaptureMode
from uvaple.kernels.plan import GatherPlan
from uvaple.uva import HostTable
from uvaple.uva.cuda_runtime import copy_async

from ..fork import keep_in_child
from ..lookup import Lookup
from ..spec import TableSpec
from ..telemetry import Progress
from .gather import GatherLookup
from .host_gather import gather_up, ids_within, split_rows, warm_split

__all__ = ["SplitLookup", "split_gpu_share", "split_chunk_rows", "split_graph_sizes", "split_graph_rows",
           "SPLIT_PLAN", "SPLIT_CPU_PATH"]


# lookup_split: the share of a call's rows the GPU gathers while the caller's thread gathers the rest on
# the CPU, and the rows per copy up of the CPU's share (0: all at once), by ids per call. From three split
# sweeps on the H200 host with the GPU share replayed as a CUDA graph and the staged rows copied up
# through cudaMemcpyAsync (perf/results/h200_2026-12-02/run22_*, run23_*, run24_*/ngram/ngram.log: 160-B
# rows, 24 GiB table, 16 host threads, random ids, shares 0.05-0.45 x chunks of 16,384-65,536 rows or
# whole; run 22 swept 0.2-0.6), the best share of each run and the median of them: 16,384 ids: 0.35 / 0.35
# / 0.3 (223 / 226 / 258 us; the GPU alone 372-374); 65,536: 0.2 in all three (543-570 us; chunks of
# 16,384 and 32,768 within 1%); 262,144: 0.2 / 0.1 / 0.25, 0.15 within 0.5% of the best in runs 23-24;
# 1M: 0.2 / 0.2 / 0.25 (4,841-5,933 us). Below the first entry the GPU takes every row. Where the CPU
# gathers 230 M random rows/s on 16 threads (65,536 rows in 284 us, run 22) and the GPU 40-55 M/s at
# these sizes, a split gains at most the GPU's rate over the CPU's (1.2x at 65,536 ids).
# Those sweeps read partly cached rows (four id sets reused). The plan below is the best of the first
# sweep on rows from DRAM (perf/results/h200_2026-12-03/run2_tests_ngram_shape_split, "split_sweep"):
# 16,384 ids 0.45 whole (309 us; the CPU alone 301); 65,536: 0.25 in chunks of 32,768 (778 us; 0.2 814,
# the CPU 831); 262,144: 0.25 in chunks of 16,384 (2,038 us; 0.15 2,286, the CPU 2,423); 1M: 0.25 in
# chunks of 65,536 (5,674 us; 0.2 5,873, the CPU 7,511).
# The GPU takes the first ids of the call. A split by table rows (the GPU sorts every id and reads those
# of the rows below the ids' share-quantile, as densely as the whole call's; the CPU stages the others,
# found by two parallel passes, and their rows are put in place by index_copy_; built and measured in
# commit 8b914a8) lost at 65,536 and 262,144 ids and was even at 1M in two sweeps
# (perf/results/h200_2026-12-02/run27_*, run28_*/ngram/ngram.log; run 28 at 65,536 / 262,144 / 1M: best
# 1,283 / 2,464 / 5,833 us by rows, 613 / 1,743 / 5,509 by ids): it launches the sorted gather of all
# the ids eagerly (400 us of host time at 1M) and its GPU share ran 1.35x slower than its part of the
# GPU's whole sorted gather (split_profile.log there), the CPU's copies up then crossing the same link.
SPLIT_PLAN = ((16384, 0.45, 0), (65536, 0.25, 32768), (262144, 0.25, 16384), (1 << 20, 0.25, 65536))
SPLIT_GPU_SHARE = tuple((at, share) for at, share, _ in SPLIT_PLAN)
# The CPU gather of the split's share: torch's index_select (measured above); the copy backend's numba
# word gather ("parallel", integration/copy/cpu_gather.py) is the alternative the split sweep times too.
SPLIT_CPU_PATH = "torch"


def _split_entry(n: int) -> tuple[float, int]:
    share, chunk = 1.0, 0
    for at, s, c in SPLIT_PLAN:
        if n >= at:
            share, chunk = s, c
    return share, chunk


def split_gpu_share(n: int, row_bytes: int, span_bytes: int) -> float:
    """The GPU's share of a split call of ``n`` ids (the entry for the nearest measured ``n`` at or below)."""
    del row_bytes, span_bytes  # measured for the n-gram shape only (160-B rows, 24 GiB)
    return _split_entry(n)[0]


def split_chunk_rows(n: int) -> int:
    """Rows per copy up of a split call's CPU share (``n`` ids): the plan's chunk, or all of them (``n``)."""
    return _split_entry(n)[1] or max(1, n)


# lookup_split's GPU share replays a CUDA graph (one launch on the host instead of the ids' checks and the
# sorted path's several launches) when it is one of these sizes: a ladder of SPLIT_GRAPH_STEPS sizes per
# octave from SPLIT_GRAPH_MIN_ROWS to SPLIT_GRAPH_MAX_ROWS (multiples of 256), each captured once when the
# lookup is built. A share between two sizes is rounded down to the lower (at most 16% fewer GPU rows);
# outside the ladder the share launches eagerly. The top keeps the graphs' output buffer (top rows of the
# output) within 262,144 rows and SPLIT_GRAPH_MAX_BYTES; above it a call's launches are a small part of
# its time (1.6 ms of 7 at 1M ids, perf/results/h200_2026-12-02/run20_*/ngram/split_profile.log).
SPLIT_GRAPH_MIN_ROWS = 4096
SPLIT_GRAPH_MAX_ROWS = 262144
SPLIT_GRAPH_MAX_BYTES = 128 << 20
SPLIT_GRAPH_STEPS = 4


def split_graph_sizes(max_rows: int, out_row_bytes: int) -> tuple[int, ...]:
    """The GPU-share sizes a split lookup of ``max_rows`` ids per call (rows of ``out_row_bytes`` bytes of
    output) captures as CUDA graphs, ascending."""
    top = min(max_rows - 1, SPLIT_GRAPH_MAX_ROWS, SPLIT_GRAPH_MAX_BYTES // max(1, out_row_bytes))
    sizes, i = [], 0
    while True:
        s = int(round(SPLIT_GRAPH_MIN_ROWS * 2 ** (i / SPLIT_GRAPH_STEPS) / 256)) * 256
        if s > top:
            return tuple(sizes)
        sizes.append(s)
        i += 1


def split_graph_rows(k: int, sizes: tuple[int, ...]) -> int:
    """The largest of ``sizes`` (ascending) at or below ``k``, or 0 when ``k`` is below them all or above
    the largest by more than the ladder's step (that share launches eagerly)."""
    i = bisect.bisect_right(sizes, k)
    if i == 0 or (i == len(sizes) and k >= sizes[-1] * 2 ** (1 / SPLIT_GRAPH_STEPS)):
        return 0
    return sizes[i - 1]


class SplitLookup(Lookup):
    """A ``uva`` gather lookup that also serves :meth:`lookup_split` (host ids; see the module docstring).

    Parameters
    ----------
    table, spec, device, owns_table :
        As in :class:`~uvaple.integration.lookup.Lookup`; ``device`` must be a CUDA device and the table
        registered.
    max_rows : int
        Most ids per call: pinned staging for that many rows and ids, and a device buffer of the same size,
        are allocated here, once.
    count, dequant_scale, order, dedup, view :
        The gather lookup's (:class:`~uvaple.integration.placements.gather.GatherLookup`), which serves
        :meth:`lookup` (device ids) and the GPU's share of a split call.
    """

    kind = "split"

    def __init__(self, table: HostTable, spec: TableSpec | None = None, device=None, *, max_rows: int,
                 owns_table: bool = False, count: bool = True, dequant_scale: torch.Tensor | None = None,
                 order: str = "auto", dedup: bool = False, view: str = "cuda") -> None:
        if not isinstance(table, HostTable):
            raise TypeError(f"table must be a HostTable, got {type(table).__name__}")
        spec = spec or TableSpec.of(table)
        super().__init__(table, spec, device, owns_table=owns_table, max_rows=max_rows)
        if max_rows is None or self.device.type != "cuda":
            raise ValueError("a split lookup needs max_rows and a CUDA device (the CPU's share is copied to the GPU "
                             "from pinned staging)")
        self.gather = GatherLookup(table, spec, self.device, kind="uva", max_rows=max_rows, count=count,
                                   dequant_scale=dequant_scale, order=order, dedup=dedup, view=view)
        self._counters = self.gather._counters
        self._row_bytes = self.gather._row_bytes
        self._span_bytes = self.gather._span_bytes
        try:
            self._split = _SplitState(self.gather, max_rows, self.device)
        except BaseException:
            self.gather.close()
            raise

    def uses_sorted(self, n: int) -> bool:
        """Whether the gather of ``n`` device ids takes the sorted path."""
        return self.gather.uses_sorted(n)

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> torch.Tensor:
        """Rows for device ``ids``: the gather lookup's call."""
        self._check_usable()
        return self.gather.lookup(ids, out, columns=columns)

    def lookup_split(self, ids: torch.Tensor, out: torch.Tensor, *, gpu_share: float | None = None,
                     chunk_rows: int | None = None) -> torch.Tensor:
        """Rows for host ``ids`` (a CPU int32/int64 tensor: the scheduler's) in ``out`` (on ``device``): the
        first ``gpu_share`` of them gathered by the GPU (the direct or sorted path, as :meth:`lookup`), the
        rest by this thread into pinned staging (``SPLIT_CPU_PATH``), copied to the device and
        given the spec's policy by the same kernel. The staged rows are copied up ``chunk_rows`` at a time
        (default :func:`split_chunk_rows`), each chunk's copy beside the gather of
        the next. No worker thread, no queue: the staging is reused
        only after the previous call's copy out of it has completed (an event this lookup owns, waited
        for here). Not under CUDA graph capture (host work cannot be captured). Same bits as
        :meth:`lookup`. ``gpu_share`` defaults to :func:`uvaple.kernels.split_gpu_share`.

        A GPU share within the ladder of :func:`uvaple.kernels.split_graph_sizes` is rounded down
        to the ladder's size and replays the CUDA graph of :meth:`lookup` for that size captured when the
        lookup was built (one launch on the host: the split's own host work is what decides it at 65,536
        ids); its rows land in a device buffer and are copied into ``out`` after the CPU's gather.
        """
        self._check_usable()  # first: in a forked child even asking CUDA about capture would fail
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lookup_split runs host work per call and cannot be captured in a CUDA graph; "
                               "capture lookup() with device ids instead")
        if out is None:
            raise TypeError("lookup_split writes into out: pass out [*ids.shape, ncols] on the lookup's device")
        # every placement's checks (Lookup._prepare), with host ids: the CPU gathers its share
        ids, out, _, _ = self._prepare(ids, out, None, ids_on="host")
        n = ids.numel()
        share = split_gpu_share(n, self._row_bytes, self._span_bytes) if gpu_share is None \
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
                        self.gather.lookup(dev_ids, flat_out[:k])
                m = n - k
                if m:
                    self._stage_cpu_share(flat_ids[k:], flat_out[k:], k, n, split_chunk_rows(n)
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
        path = SPLIT_CPU_PATH

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
        sp.policy.run(staged_ids, out)  # the kernel of gather_rows over the staged rows (every staged id below m)
        if self._counters is not None:  # one call, whatever its shares; row0's staged ids look valid
            if k:
                self._counters[0].sub_(1)
            if row0 and bad:
                self._counters[2].add_(bad)

    def stats(self) -> dict:
        return dict(self.gather.stats(), kind=self.kind, closed=self._closed)

    def progress(self) -> Progress:
        return self.gather.progress()

    def close(self) -> None:
        if self._closed:
            return
        if self._split is not None and not self._forked:  # (a forked child has no CUDA)
            self._split.release()  # no copy may still read the staging when it goes; also inside a capture
        self._split = None
        self.gather.close()
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
    CUDA graphs of the GPU share (one per size of the ladder, ``split_graph_sizes``) with the
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
        self.row_bytes = table.row_bytes
        self.table_bytes = table.tensor.view(torch.uint8)
        self.device_index = device.index  # (resolve_device: a CUDA device always has its index)
        self.staged_rows = self.rows_dev[:, : self.row_bytes].view(table.dtype)  # the policy kernel's table
        spec = lookup.spec
        c0, c1 = spec.columns(None)
        # the policy over the staged rows, planned here once: one kernel launch a call (through the operator,
        # with its checks each call, the split took 3-6% longer; torch's own ops, where every staged row is
        # valid and the policy is vLLM's fp8 formula, took less host time but as long or 4% longer to
        # complete: perf/results/h200_2026-12-03/run11_split_policy_ab)
        self.policy = GatherPlan(self.staged_rows, device, spec.output_dtype, bits=spec.scale_arg,
                                 has_scale=spec.has_scale, oob_mode=spec.oob_mode, dequant=spec.dequant,
                                 counters=lookup._counters, dq_scale=lookup._dq_scale)
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
        self.graph_sizes = split_graph_sizes(max_rows, (c1 - c0) * spec.output_dtype.itemsize)
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
        return split_graph_rows(k, self.graph_sizes) if 0 < k < n else 0

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

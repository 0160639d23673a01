"""``DiskLookup``: a table on local disk (a table file), its rows read through a host row cache the GPU maps.

For tables larger than the host memory a server can give them. The table is a file in the project's row layout
(:mod:`uvaple.uva.table_file`: written once, checksummed, opened without reading its data); a
:class:`~uvaple.uva.RowCache` holds a budget of its rows in pinned, mapped host memory, by slot. Each call is
planned on the host, from its ids there: a serving engine knows a step's ids when it prepares the step, and
passes them on the CPU; ids on the lookup's device (transformers' ``generate()``, an n-gram hash on the GPU) are
copied to the host first, one small copy a call into pinned memory that waits for the stream's work before it
(the ids must exist before they are read), so such a call holds the host until the GPU has caught up with it:
0. **Ids** on the device: copied into the lookup's pinned buffer in the stream, then the stream synchronised.

1. **Plan** (this thread): the call's table rows (ids less ``id_offset``, inside the spec's window; under
   ``oob="row0"`` the window's first row stands in for the others) go to :meth:`RowCache.plan` as step ``k``:
   hits are kept, misses get slots that no step in flight reads (the completion word says which steps are
   done). A step that does not fit waits, bounded by ``wait_s``, for the steps in flight to complete, then is
   :class:`~uvaple.uva.RowCacheFull`.
2. **Read** the misses from the file into their slots (:class:`~uvaple.uva.PageReader`: ``read_depth`` page
   reads in flight, each checked against its sum, ``O_DIRECT`` where the filesystem allows it, copied into
   the slots by this thread once all have returned); a failed or late read unmaps them and raises a named
   error: no gather ever reads a slot that does not hold its row.
3. **Cache ids**: each id's slot plus one, from the map, 0 for an id outside the table, written into one of
   ``steps_in_flight`` pinned, mapped staging rows (step ``k`` takes row ``k % steps_in_flight``, free once
   step ``k - steps_in_flight`` is complete).
4. **Gather** (the caller's stream): the direct gather over the cache's rows with ``id_base`` 1
   (:class:`~uvaple.kernels.plan.GatherPlan`, made once), its ids read from the staging row through UVA, the
   spec's encoding, scale and row policy: an id of 0 is outside the cache, the policy's zero row. Then, in the
   same stream, the completion word is set to ``k`` (a one-word write into host memory): from then on step
   ``k``'s slots and staging row may be reused.

**Hot rows** (``hot_rows``): table rows held in device memory, read from the file once, when the lookup is
built, and never planned in the cache: a call stages each hot id as a row past the cache's (the cache's ``S``
slots, then hot row ``k`` as cache id ``S + 1 + k``), and the same gather reads those from device memory (the
hot set's slot map names a hot slot for each of them, checked by the plan), the others from their slots.

**Reading ahead** (:meth:`DiskLookup.prefetch`): the next call's step planned with its ids and its misses read
before the call, so that a model's PLE layers read their rows in one round, all of them in flight together
(:class:`~uvaple.integration.placements.read_round.ReadRound`), instead of one layer's reads after another's.
The call plans the same step again and finds the rows cached (:class:`~uvaple.uva.RowCache` counts and
references them once). A read-ahead whose call never comes is let go by the next read-ahead, on the host: its
slots go to the last step a call launched (:meth:`~uvaple.uva.RowCache.release`), never waiting on a word the GPU
writes later. A call takes its step's read-ahead as its own just before it plans (from then on the step completes
in stream order, whatever happens to the call); one that fails before that leaves the read-ahead to be let go. A
call whose ids differ from its read-ahead's, and which does not fit beside the rows read ahead, lets them go first
and plans again (as a call with no read-ahead would fit). A call counts its step as launched just before it
launches, so a read-ahead is never let go once its gather may be queued.

A call that fails once its step is planned (a full cache, a failed read, an interrupt) still completes that
step in stream order (after whatever it launched): its hits are released when the steps before it are done,
and the next call takes the next number.

So the only order between the host's reads and the GPU's is the stream's: the host writes a slot only after
the completion word (written by the stream after the last gather that read it) says so (seed 004's race),
and launches a gather only after its rows are read in. The completion word must be written in the steps' order,
so a call on another stream than the last call's (vLLM's async scheduling runs its steps on a stream of its own
after a warm-up on the default one) first makes its stream wait, on the GPU, for an event recorded right after
the last call's word: its own word lands after that one, and the caller's later work on the old stream is not
waited for. The steps' host work
(plan, reads) is on the calling thread, so CUDA graphs cannot capture a call
(:data:`~uvaple.integration.factory.PLACEMENTS`), and ``torch.compile`` never traces one: a compiled model calls
it eagerly (a graph break; ``fullgraph=True`` refuses it, naming why).

Counters (``stats()``, ``progress()``): kept on the host (every id passes it), with the cache's hits, misses,
evictions and the pages read; no synchronisation.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time

import numpy as np
import torch

from uvaple.dtypes import fmt_bytes
from uvaple.kernels.encodings import ENCODINGS as _REGISTRY
from uvaple.kernels.plan import GatherPlan
from uvaple.uva import HostMemoryError, HostTable, PageReader, RowCache, RowCacheFull, TableFile, row_stride_bytes
from uvaple.uva.errors import TableClosedError
from uvaple.uva.page_reader import ENGINES

from ..errors import BackendClosed, DiskStepTimeout, DiskStreamError
from ..lookup import Lookup
from ..spec import TableSpec
from ..telemetry import Progress

__all__ = ["DiskLookup", "DiskStepTimeout", "DiskStreamError"]

_POLL_S = 0.0002  # how often a full step looks at the completion word again
_VIEWS_KEPT = 4096  # the gather's views of the staging rows kept (a server's batch sizes: a few hundred shapes)
_NOT_OPTIONS = {"self", "table", "spec", "device", "owns_table", "max_rows"}  # the constructor's other parameters
#: why torch.compile runs a call eagerly (a graph break), and what ``fullgraph=True`` names when it refuses one
_EAGER = ("the disk placement plans each call on the host (the ids read there, the cache's map, reads from the "
          "file): a compiled model calls it eagerly, and fullgraph=True cannot hold it; compile with graph breaks "
          "allowed, or serve the table with the uva placement")


def _eager(fn):
    """``fn`` never traced by torch.compile: called eagerly from compiled code (a graph break), with the reason."""
    try:
        return torch.compiler.disable(fn, reason=_EAGER)
    except TypeError:  # a torch whose disable() takes no reason
        return torch.compiler.disable(fn)


def _ids_view(views: dict, dev_ids: torch.Tensor, slot: int, shape: torch.Size) -> torch.Tensor:
    """Staging row ``slot``'s first ids (of ``dev_ids``) as the gather reads them, in ``shape``: made once a (row,
    shape), kept in ``views``."""
    key = (slot, shape)
    view = views.get(key)
    if view is None:
        if len(views) >= _VIEWS_KEPT:  # shapes without end: start again
            views.clear()
        view = views[key] = dev_ids[slot, :shape.numel()].view(shape)
    return view


class DiskLookup(Lookup):
    """Rows of a table file through a host row cache (see the module docstring).

    Parameters
    ----------
    table : TableFile
        The table file (closed with the lookup when ``owns_table``).
    spec, device, owns_table :
        As in :class:`~uvaple.integration.lookup.Lookup`; the spec's encoding is the file's.
    max_rows : int
        Most ids per call (the staging rows are sized from it).
    budget_bytes, slots : int
        The row cache's size: bytes of rows at the host stride, or slots; one of them.
    steps_in_flight : int
        Calls whose gathers may be queued at once (default 4): a call waits for the one this many before it.
    wait_s : float
        How long a call waits for earlier steps to complete (a full cache, a staging row in use) before a named
        error (default 10).
    read_depth, read_timeout_s, read_engine :
        The misses' reads in flight at once (default 32), how long a call waits for them before
        :class:`~uvaple.uva.ReadTimeout` (default 30 s), and how they are kept in flight
        (:class:`~uvaple.uva.PageReader`: ``"auto"``, io_uring from the calling thread where the kernel allows
        it, else threads; or ``"uring"`` or ``"threads"``).
    dequant_scale : torch.Tensor, optional
        An ``fp8_global`` file's float32 ``[1]`` scale on ``device``.
    hot_rows : sequence of int or 1-D integer tensor, optional
        Table rows (ids less the spec's ``id_offset``) to hold in device memory: read from the file here, served
        from there by every call, never read again nor held in the cache (the hottest rows of a profile, such as
        ``uvaple bench --workload hotset``'s).
    """

    kind = "disk"

    @classmethod
    def check_options(cls, options: dict, *, max_rows: int | None = None, row_bytes: int | None = None) -> None:
        """A ValueError naming an option this lookup would refuse: one it does not take, a size given as neither or
        both of ``budget_bytes`` and ``slots``, a count or a time that is not positive; with ``max_rows`` and
        ``row_bytes`` (a row's bytes in the file), a cache too small to hold a call of ``max_rows`` distinct rows
        (such a call would be :class:`~uvaple.uva.RowCacheFull`)."""
        takes = sorted(set(inspect.signature(cls.__init__).parameters) - _NOT_OPTIONS)
        unknown = sorted(k for k in options if k not in takes)
        if unknown:
            raise ValueError(f"the disk placement takes no option {unknown} (its options: {takes})")
        given = [k for k in ("budget_bytes", "slots") if options.get(k) is not None]
        if len(given) != 1:
            raise ValueError("the disk placement needs exactly one of budget_bytes (bytes of host memory) or slots "
                             f"(rows) as its row cache's size, got {' and '.join(given) if given else 'neither'}")
        for key in ("budget_bytes", "slots", "steps_in_flight", "read_depth"):
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"the disk placement's {key} must be a positive int, got {value!r}")
        engine = options.get("read_engine")
        if engine is not None and engine not in ENGINES:
            raise ValueError(f"the disk placement's read_engine must be one of {', '.join(map(repr, ENGINES))}, got "
                             f"{engine!r}")
        for key in ("wait_s", "read_timeout_s"):
            value = options.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"the disk placement's {key} must be a number of seconds > 0, got {value!r}")
        if max_rows is None or row_bytes is None:
            return
        stride = row_stride_bytes(row_bytes)
        slots = options.get("slots") or options["budget_bytes"] // stride
        if slots < max_rows:
            raise ValueError(f"the disk placement's row cache holds {slots} rows of {fmt_bytes(stride)}, and a call "
                             f"may bring {max_rows} distinct rows: give budget_bytes >= {max_rows * stride} "
                             f"({fmt_bytes(max_rows * stride)}) or slots >= {max_rows}")

    def __init__(self, table: TableFile, spec: TableSpec | None = None, device=None, *, owns_table: bool = False,
                 max_rows: int | None = None, budget_bytes: int | None = None, slots: int | None = None,
                 steps_in_flight: int = 4, wait_s: float = 10.0, read_depth: int = 32, read_timeout_s: float = 30.0,
                 read_engine: str = "auto", dequant_scale: torch.Tensor | None = None, hot_rows=None) -> None:
        if not isinstance(table, TableFile):
            raise TypeError(f"the disk placement reads a table file (uvaple.uva.TableFile, or its path through "
                            f"make_lookup), got {type(table).__name__}; write one with write_table_file()")
        table._check_open()
        spec = spec or TableSpec.of(table)
        super().__init__(table, spec, device, owns_table=owns_table, max_rows=max_rows)
        if max_rows is None:
            raise ValueError("the disk placement needs max_rows (the most ids a call brings): its staging is sized "
                             "from it")
        if spec.encoding != table.encoding:
            raise ValueError(f"{table.path} holds {table.encoding} rows; the spec says {spec.encoding!r}")
        if isinstance(steps_in_flight, bool) or not isinstance(steps_in_flight, int) or steps_in_flight < 1:
            raise ValueError(f"steps_in_flight must be an int >= 1, got {steps_in_flight!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not wait_s > 0:
            raise ValueError(f"wait_s must be a number of seconds > 0, got {wait_s!r}")
        self.file = table
        self._ring, self._wait_s = steps_in_flight, float(wait_s)
        on_gpu = self.device.type == "cuda"
        index = self.device.index if on_gpu else None
        register = True if on_gpu else "auto"  # the GPU reads the slots and the staging through UVA
        try:
            self.cache = RowCache.for_file(table, slots=slots, budget_bytes=budget_bytes, register=register,
                                           device=index)
        except HostMemoryError as e:
            raise HostMemoryError(f"the disk placement's row cache (budget_bytes={budget_bytes}, slots={slots}) does "
                                  f"not fit in host memory: give it a smaller budget_bytes or slots ({e})") from None
        self._staging = self._reader = self._call = None
        try:
            per_row = max(1, table.layout.pages_per_row)  # a round of the reader holds a whole step where it can
            self._reader = PageReader(table, depth=read_depth, timeout_s=read_timeout_s, engine=read_engine,
                                      buffer_pages=min(4096 // per_row, max_rows) * per_row)
            self._staging = HostTable.empty(steps_in_flight, max_rows * 4, torch.uint8, register=register,
                                            device=index)
            host_ids = self._staging.tensor.view(torch.int32).numpy()  # [steps_in_flight, max_rows]
            # a call's ids copied from the device (as bytes: the ids' own dtype, no conversion on the way)
            ids_in = torch.empty(max_rows * 8, dtype=torch.uint8, pin_memory=True) if on_gpu else None
            dev_ids = (self._staging.cuda_view(index) if on_gpu else self._staging.tensor).view(torch.int32)
            rows_view, word = self.cache.views(self.device)
            scale = self._check_scale(dequant_scale)
            self._hot_sorted = np.empty(0, dtype=np.int64)  # the hot rows, ascending: hot row k is the k-th
            self._hot_buffers: tuple[torch.Tensor, ...] = ()  # their rows and the slot map, in device memory
            hot = self._hot_set(hot_rows, rows_view) if hot_rows is not None else {}
            plan = GatherPlan(rows_view, self.device, spec.output_dtype, bits=spec.scale_arg,
                              has_scale=spec.has_scale, oob_mode=spec.oob_mode, dequant=spec.dequant, id_base=1,
                              dq_scale=scale, **hot)
            # what a call uses, one tuple that each call takes whole and close() drops whole: the gather's plan,
            # the staging as numpy and as the gather reads it, the gather's views of the staging rows by (row, the
            # ids' shape), made once each; the cache's completion word; the pinned buffer of ids from the device;
            # the hot rows and their slot map in device memory (recorded on each stream a call runs on)
            self._call = (plan, host_ids, dev_ids, {}, word, ids_in, self._hot_buffers)
        except BaseException:
            host_ids = dev_ids = ids_in = word = rows_view = None  # (a traceback kept would hold them mapped)
            self._release()
            raise
        self._lo, self._hi = spec.window
        self._step = 0
        self._ahead = 0  # the step read ahead whose call has not come (0: none)
        self._stream = None  # the last call's stream
        self._streams = []  # every stream a call ran on
        self._last_word = None  # an event recorded on it right after its completion word (its first call makes it)
        self._lock = threading.Lock()
        # waits: for earlier steps; hot_hits: ids read from the hot rows
        # read_ahead: prefetches that fitted; rows_ahead: the rows they read in
        self._counts = {"lookups": 0, "rows": 0, "out_of_range_ids": 0, "waits": 0, "hot_hits": 0, "read_ahead": 0,
                        "rows_ahead": 0}
        self._row_bytes = spec.value_cols * table.dtype.itemsize

    @property
    def _plan(self) -> GatherPlan | None:
        """The gather's plan (None once closed)."""
        return None if self._call is None else self._call[0]

    def _hot_set(self, hot_rows, rows_view: torch.Tensor) -> dict:
        """The hot rows read from the file into device memory (the cache's row layout), the slot map that gives each
        its id past the cache's slots, and the plan's keywords for them."""
        rows = torch.as_tensor(hot_rows).to("cpu")  # a profile's top rows may come on the GPU
        if rows.dim() != 1 or rows.numel() == 0 or rows.dtype.is_floating_point or rows.dtype == torch.bool \
                or rows.is_complex():
            raise ValueError(f"hot_rows must be a non-empty 1-D sequence of table rows (ints), got {hot_rows!r:.80}")
        rows = torch.unique(rows.to(torch.int64))  # ascending, once each
        lo, hi = self.spec.window
        if int(rows[0]) < lo or int(rows[-1]) >= hi:
            raise ValueError(f"hot_rows must be rows of the table's window {lo} .. {hi - 1} (ids less the spec's "
                             f"id_offset {self.spec.id_offset}), got {int(rows[0])} .. {int(rows[-1])}")
        slots, count = rows_view.shape[0], rows.numel()
        if slots + count + 1 > np.iinfo(np.int32).max:
            raise ValueError(f"{count} hot rows and {slots} cache slots: the staged ids (int32) cannot name them all")
        stride = rows_view.stride(0)
        hot = torch.empty(count, stride, dtype=rows_view.dtype, device=self.device)[:, :rows_view.shape[1]]
        for a in range(0, count, 4096):  # read in rounds: the pages of a round are held at once
            hot[a:a + 4096].copy_(self.file.read_rows(rows[a:a + 4096]))
        slot_map = torch.full((slots + count,), -1, dtype=torch.int32, device=self.device)
        slot_map[slots:] = torch.arange(count, dtype=torch.int32, device=self.device)
        self._hot_sorted = rows.numpy()
        self._hot_buffers = (hot, slot_map)
        return dict(hot_rows=hot, slot_map=slot_map, hot_only_rows=count)

    def _check_scale(self, s) -> torch.Tensor | None:
        if _REGISTRY[self.spec.encoding].scale != "global":
            if s is not None:
                raise ValueError(f"dequant_scale is for fp8_global tables; {self.file.path} holds {self.spec.encoding} "
                                 "rows")
            return None
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1 or s.device != self.device:
            raise ValueError(f"an fp8_global table needs dequant_scale: a float32 tensor of one element on "
                             f"{self.device}, got {s!r}")
        return s.reshape(1)

    # ------------------------------------------------------------------ calls
    @_eager
    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, columns=None) -> torch.Tensor:
        ids, out, c0, _ = self._prepare(ids, out, columns, ids_on="either")
        n = ids.numel()
        if n == 0:
            return out
        with self._lock:  # one call at a time: the steps are numbered in the order they are planned
            # the views a call uses, held as locals: a close() from another thread meanwhile drops only the
            # lookup's own reference (their memory goes when this call returns)
            held = self._call
            if held is None:
                raise BackendClosed(f"this {self.kind} lookup was closed; build a new one")
            plan, host_ids, dev_ids, dev_views, word, ids_in, hot_buffers = held
            if self.device.type == "cuda":
                if self._check_stream():
                    for t in hot_buffers:  # its gathers read them: their blocks wait for this stream when freed
                        t.record_stream(self._stream)
                if ids.is_cuda:
                    ids = self._ids_to_host(ids, ids_in)
            step = self._step + 1
            slot = (step - 1) % self._ring
            self._wait_for(step - self._ring, f"its staging row (step {step - self._ring}'s)")
            rows, valid, outside, masked, hot, at, cached = self._rows_of(ids)
            try:
                ahead, self._ahead = self._ahead == step, 0  # a read-ahead of this step is this call's now: the
                try:  # step completes below. Planned and read in as one: a failure leaves no row it placed mapped
                    self._read_in(cached, step)
                except RowCacheFull:
                    if not ahead:
                        raise
                    # the rows read ahead were not this call's (other ids) and hold the slots it needs: let them
                    # go (to the last launched step) and plan again, as a call with no read-ahead would
                    self.cache.release(step, self._step)
                    self._read_in(cached, step)
                staged = host_ids[slot, :n]
                self.cache.cache_ids(rows, staged)
                if hot is not None:  # past the cache's slots: the hot rows in device memory
                    staged[hot] = self.cache.slots + 1 + at[hot]
                if masked:
                    staged[~valid] = 0  # outside the cache: the policy's zero row
                self._step = step  # launched from here on (an interrupt below leaves no read-ahead of it to release)
                plan.run(_ids_view(dev_views, dev_ids, slot, ids.shape), out, c0)
            finally:
                if self.cache.planned >= step:  # its rows are marked as this step's, read in or not: the step
                    self._step = step  # completes in stream order, after what it launched (if anything)
                    word.fill_(step)
                    if self._last_word is not None:  # (a call on another stream waits for it)
                        self._last_word.record(self._stream)
            self._counts["lookups"] += 1
            self._counts["rows"] += n
            self._counts["out_of_range_ids"] += outside
            if hot is not None:  # the hot ids read (an id outside the window reads a row only under row0)
                self._counts["hot_hits"] += int(np.count_nonzero(hot & valid if masked else hot))
        return out

    def _rows_of(self, ids: torch.Tensor) -> tuple:
        """A call's host ids as table rows: (every id's row, which are inside the window, how many are not, whether
        those read the zero row, which rows are hot and each one's hot row, the rows the cache serves)."""
        rows = ids.numpy().reshape(-1).astype(np.int64)
        if self.spec.id_offset:
            rows -= self.spec.id_offset
        valid = (rows >= self._lo) & (rows < self._hi)
        outside = rows.size - int(np.count_nonzero(valid))
        if outside:
            rows = np.where(valid, rows, self._lo)  # inside the table: read under row0, zero-masked otherwise
        masked = outside and self.spec.oob != "row0"  # ids outside read the policy's zero row, not a row
        hot, at = self._hot_of(rows)
        cached = valid if masked else None
        if hot is not None:
            cached = ~hot if cached is None else cached & ~hot
        return rows, valid, outside, masked, hot, at, rows if cached is None else rows[cached]

    @_eager
    def prefetch(self, ids: torch.Tensor) -> int:
        """Read ahead the rows of this lookup's next call: plan its step with ``ids`` (host ids, on the CPU: the ids
        that call will bring) and read the misses into their slots now, on this thread. The next call plans the same
        step again, finds them cached and reads only what it asks for beyond them; nothing else changes (the bits,
        the counters but the pages' time). A read-ahead whose call never comes (a forward that stopped between them)
        is let go by the next read-ahead: its slots are handed to the last step a call launched
        (:meth:`~uvaple.uva.RowCache.release`). No CUDA work, no stream touched: a thread of a
        :class:`~uvaple.integration.placements.read_round.ReadRound` runs it beside the other tables'. The call's
        own errors (a full cache, a failed read, ids it would refuse); a failure leaves no row of it held. Returns
        the rows read."""
        ids, _, _, _ = self._prepare(ids, None, None, ids_on="host", allocate=False)
        if ids.numel() == 0:
            return 0
        with self._lock:
            if self._call is None:
                raise BackendClosed(f"this {self.kind} lookup was closed; build a new one")
            step = self._step + 1
            if self._ahead == step:  # read ahead before, and its call never came: no gather reads those slots
                self.cache.release(step, self._step)
            self._ahead = 0
            try:
                misses = self._read_in(self._rows_of(ids)[-1], step)
            except BaseException:
                if self.cache.planned >= step:  # its hits were marked as the step's: handed back
                    with contextlib.suppress(TableClosedError):  # (closed meanwhile: nothing left to hand back)
                        self.cache.release(step, self._step)
                raise
            self._ahead = step
            self._counts["read_ahead"] += 1
            self._counts["rows_ahead"] += len(misses)
        return len(misses)

    def _hot_of(self, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(which of ``rows`` are hot, each one's hot row), or (None, None) without hot rows or without a hot one."""
        table = self._hot_sorted
        if not table.size:
            return None, None
        at = np.searchsorted(table, rows)
        np.minimum(at, table.size - 1, out=at)
        hot = table[at] == rows
        return (hot, at) if hot.any() else (None, None)

    def _check_stream(self) -> bool:
        """Refuse a capture; on another stream than the last call's, make it wait (on the GPU) for the last
        completion word, so that the words stay in the steps' order. Whether no call ran on this stream before."""
        if torch.cuda.is_current_stream_capturing():
            raise DiskStreamError("a disk lookup plans and reads each call on the host: CUDA graphs cannot capture "
                                  "it (use the uva placement inside a graph)")
        stream = torch.cuda.current_stream(self.device)
        if self._stream is None:  # the first call (a Stream compared with None is never unequal to it)
            self._last_word = torch.cuda.Event()
        elif stream != self._stream:
            stream.wait_event(self._last_word)  # (never recorded yet: a no-op, no word written before)
        new = (self._stream is None or stream != self._stream) and all(stream != s for s in self._streams)
        if new:
            self._streams.append(stream)
        self._stream = stream
        return new

    def _ids_to_host(self, ids: torch.Tensor, ids_in: torch.Tensor) -> torch.Tensor:
        """The call's device ids in the pinned buffer ``ids_in``: copied in this lookup's stream, after the work that
        made them, and waited for (the one synchronisation of a call whose ids are on the device)."""
        host = ids_in[:ids.numel() * ids.element_size()].view(ids.dtype)
        host.copy_(ids.reshape(-1), non_blocking=True)
        self._stream.synchronize()
        return host.view(ids.shape)

    def _read_in(self, rows: np.ndarray, step: int):
        """The step planned and its misses read into their slots (:meth:`RowCache.read_in`; returns them); a cache
        too full of steps in flight waits for them (bounded), then is named; a failed read raises the file's named
        error."""
        try:
            return self.cache.read_in(rows, step, self.file, self._reader)
        except RowCacheFull:
            if self.cache.done() >= step - 1:
                raise  # no step in flight: waiting frees nothing
        self._wait_for(step - 1, "slots of the steps in flight")
        return self.cache.read_in(rows, step, self.file, self._reader)

    def _wait_for(self, step: int, what: str) -> None:
        """Until the completion word reaches ``step`` (at most ``wait_s``); polls host memory, no CUDA call."""
        if step <= 0 or self.cache.done() >= step:
            return
        self._counts["waits"] += 1
        deadline = time.monotonic() + self._wait_s
        while self.cache.done() < step:
            if time.monotonic() > deadline:
                raise DiskStepTimeout(
                    f"step {self._step + 1} of this disk lookup waited {self._wait_s:g} s for {what}: step {step} "
                    f"has not completed (the completion word says {self.cache.done()}). Are this lookup's gathers "
                    f"queued behind work that does not run? (pid {os.getpid()})")
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ reading
    def stats(self) -> dict:
        st = super().stats()
        try:
            done = self.cache.done()
        except TableClosedError:  # closed: the completion word went with the cache
            done = None
        st.update(self._counts, cache=dict(self.cache.stats), slots=self.cache.slots, hot_rows=self._hot_sorted.size,
                  completed_step=done,
                  planned_step=self._step, pages_read=self._reader.pages_read if self._reader else 0,
                  file=self.file.path)
        return st

    def progress(self) -> Progress:
        c = self._counts
        return Progress(kind=self.kind, closed=self._closed, lookups=c["lookups"], rows=c["rows"],
                        bytes=c["rows"] * self._row_bytes, out_of_range_ids=c["out_of_range_ids"],
                        hot_hits=c["hot_hits"] if self._hot_sorted.size else None, age_s=0.0)

    def device_bytes(self) -> int:
        """The hot rows' device memory (and their slot map)."""
        return sum(t.untyped_storage().nbytes() for t in self._hot_buffers if t.is_cuda)

    # ------------------------------------------------------------------ lifetime
    def _release(self) -> None:
        # (the hot rows were recorded on each stream a call ran on, by that call: gathers still queued there read
        # them, so their blocks are not reused before those run, whichever thread drops them last)
        self._hot_buffers = ()
        # the plan and the views of the staging, the cache's word and the pinned ids: dropped, so that their memory
        # goes with the tables (a call on another thread holds its own until it returns)
        self._call = None
        if self._reader is not None:
            self._reader.close()
        if self._staging is not None:
            self._staging.close()
        self.cache.close()

    def close(self) -> None:
        if self._closed:
            return
        self._release()  # (releasing a table synchronises the GPUs first: a gather still queued reads its rows)
        super().close()

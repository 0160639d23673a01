"""A host row cache over a table on disk: pinned, mapped rows held by slot, the row -> slot map the gather reads,
and eviction that never takes a slot a step in flight still reads.

What it holds (three host tables, each pinned and mapped where CUDA is usable, so the GPU reads them through
UVA):

* ``rows``: ``[slots, cols]`` of the table's dtype at the host stride, the cached rows (a page of the table
  file copies into them as it is: :mod:`.table_file`);
* ``row_map``: int32 ``[table rows]``, each table row's slot plus one, 0 where it is not cached (4 bytes a row
  of the table: 1.2 GB for the 300 M rows of a 95 GiB n-gram table, next to its budget of rows). Laid out for
  the gather kernel as it is: gathered by a step's ids (an id outside the table gives the policy's zero, 0),
  it gives ids of the cached rows with ``id_base`` 1, which read slot ``value - 1``, and 0 (a row not cached)
  is then an id outside the cache: the policy's zero row, counted, never a read outside either table;
* ``completed``: one int64 word, the last step whose reads of the cache are done. Whoever runs the steps
  writes it in stream order after a step's last gather (on the GPU: a write into its CUDA view, captured in
  the step's graph); the host reads it without synchronising anything.

A step (:meth:`RowCache.plan`, on the host, before the step's gather is launched): the distinct rows it will
read; those cached are hits, marked as read by this step; the others get slots, and the map says so at once,
while their slots still hold the rows they evict. The caller then reads them into their slots
(:meth:`RowCache.fill`, or a batched reader) and only then lets the gather run (it launches after the fill,
or its stream waits on a flag the fill sets). If the reads fail, :meth:`RowCache.abandon` unmaps them: no row
ever maps to a slot that does not hold it when a gather that asked for it runs.

Which slot a miss takes. Each slot records the last step that reads it; a slot is free to take only when
that step is completed (``last_step <= completed``). That is the rule that answers seed 004's race: a step
in flight (planned, its gather maybe still queued on the GPU) keeps every slot it reads, its bytes and its
map entry, until the completion word passes it. Among the free slots, CLOCK with a reference bit that a
*hit* sets (a row just read in is not referenced): the hand sweeps, clears set bits, and takes the first
free slot whose bit is clear, so a row read by two steps outlives rows read once (a scan of one-off n-grams
does not flush the rows every step reads). A step whose misses do not fit in the slots free of steps in
flight is :class:`RowCacheFull`, naming the counts: the cache is left as it was, but for the rows the sweep
already evicted (unmapped, never half-mapped).

The sweep is one numba loop per step: its cost follows the slots it passes, not the cache's size.

Reading ahead. A step may be planned twice: once ahead of its gather, to read its misses early (a read round of
every layer's table at once), then again by the call that launches the gather, which finds those rows cached
(and reads any it did not plan ahead). The second plan neither counts nor references again a row the first gave
the step, so a row read once is still the first to go. A step planned ahead whose gather never comes (a forward
that stopped between the two) is :meth:`RowCache.release`'d: its slots are handed to the last step whose gather
was launched, so they free as that one completes; no word written behind the GPU's queue is waited for.

:meth:`RowCache.close` releases the three tables then, not when the object is dropped (the map alone is 1.2 GB
at the real size): the cache lets go of its own views, and a call running on another thread keeps the views it
took until it returns (each call takes the state tuple once, :meth:`RowCache._state`, and checks the word and
the rows' view as it reads them). After it, every call that reads or writes the cache (``plan``, ``fill``,
``read_in``, ``abandon``, ``release``, ``slots_of``, ``cache_ids``, ``views``, ``done``, ``complete``, ``row_map``,
``completed``) is the closed cache's named error; ``stats`` and ``planned`` stay. Releasing a table synchronises
the GPUs first, so a queued gather still reads its rows.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import numpy as np
import torch

from uvaple.dtypes import fmt_bytes

from .errors import TableClosedError, TableForkedError, UvapleError
from .host_table import HostTable
from .memory import SUPPORTED_DTYPES, row_stride_bytes

__all__ = ["RowCache", "RowCacheFull", "Misses"]


class RowCacheFull(UvapleError):
    """A step needs more rows read in than there are slots free of the steps in flight (the message says how
    many of each): a larger budget, or fewer steps in flight, serves it."""


@dataclass(frozen=True)
class Misses:
    """The rows a step must read in before its gather, each with the slot it goes to (``rows[i]`` into
    ``slots[i]``; distinct rows, in the order the sweep placed them)."""

    step: int
    rows: np.ndarray  # int64
    slots: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.rows)


@functools.lru_cache(maxsize=1)
def _sweep():
    """The plan of a step, compiled as the first cache is built (numba imports slowly). Returns (misses placed,
    the hand, hits, rows evicted, status): status 1, every miss found a slot; 0, one did not; -1, a row is outside
    the table (nothing read or changed then). ``need`` is scratch of ``len(rows)``. ``again``: the step was planned
    before (a read-ahead, then its call): a row that plan already gave the step is neither a hit again nor
    referenced again (a row read once stays the first to go)."""
    import numba

    @numba.njit(nogil=True, cache=False)
    def plan(rows, row_map, row_of_slot, last_step, ref, hand, step, completed, need, miss_slots, again):
        nslots = row_of_slot.shape[0]
        for i in range(rows.shape[0]):  # every row inside the map before any is looked up
            if rows[i] < 0 or rows[i] >= row_map.shape[0]:
                return 0, hand, 0, 0, -1
        hits = 0
        n_need = 0
        for i in range(rows.shape[0]):  # hits first: every row this step reads is kept from the sweep below
            s = row_map[rows[i]] - 1
            if s >= 0:
                if again and last_step[s] == step:
                    continue  # planned for this step before (read ahead): counted and referenced once
                last_step[s] = step
                ref[s] = 1
                hits += 1
            else:
                need[n_need] = rows[i]
                n_need += 1
        placed = 0
        evicted = 0
        scanned = 0
        for i in range(n_need):
            r = need[i]
            if row_map[r] > 0:  # a repeat of a row placed above
                continue
            found = -1
            # two rounds clear every free slot's bit: a slot not taken by then is read by a step in flight
            while scanned < 2 * nslots:
                s = hand
                hand = hand + 1 if hand + 1 < nslots else 0
                scanned += 1
                if last_step[s] > completed:
                    continue
                if ref[s]:
                    ref[s] = 0
                    continue
                found = s
                break
            if found < 0:
                return placed, hand, hits, evicted, 0
            old = row_of_slot[found]
            if old >= 0:
                row_map[old] = 0
                evicted += 1
            row_map[r] = found + 1
            row_of_slot[found] = r
            last_step[found] = step
            ref[found] = 0
            need[placed] = r  # compacted in place: placed <= i
            miss_slots[placed] = found
            placed += 1
        return placed, hand, hits, evicted, 1

    return plan


@functools.lru_cache(maxsize=1)
def _compile_sweep() -> None:
    """The sweep compiled for the types a step brings (numba compiles on a first call: seconds, which belong to
    building a cache, not to its first step)."""
    one = np.zeros(1, dtype=np.int64)
    _sweep()(one, np.ones(1, dtype=np.int32), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
             np.zeros(1, dtype=np.uint8), 0, 1, 0, one.copy(), one.copy(), False)


class RowCache:
    """``slots`` rows of a ``[rows, cols]`` table of ``dtype`` in pinned, mapped host memory (see the module
    docstring). ``budget_bytes`` sizes it instead of ``slots`` (whole rows at the host stride, at most the
    table). ``register``/``device``: as :meth:`HostTable.empty`."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, *, slots: int | None = None,
                 budget_bytes: int | None = None, register: bool | str = "auto", device: int | None = None) -> None:
        for name, value in (("rows", rows), ("cols", cols)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a row cache needs {name} >= 1, got {value!r}")
        if (slots is None) == (budget_bytes is None):
            raise ValueError("give a row cache its size as slots= or as budget_bytes=, one of them")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"a row cache holds rows of {[str(d) for d in SUPPORTED_DTYPES]}, not {dtype}")
        stride_bytes = row_stride_bytes(cols * dtype.itemsize)
        if slots is None:
            if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < stride_bytes:
                raise ValueError(f"a row cache's budget must hold at least one row ({fmt_bytes(stride_bytes)} at "
                                 f"the host stride), got {budget_bytes!r} bytes")
            slots = budget_bytes // stride_bytes
        elif isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"a row cache needs slots >= 1, got {slots!r}")
        self.table_rows, self.slots = rows, min(slots, rows)
        _compile_sweep()  # (before anything is mapped: an interrupt during the compile leaves nothing open)
        kw = dict(register=register, device=device)
        self.rows = HostTable.empty(self.slots, cols, dtype, **kw)
        opened = [self.rows]
        try:
            # as bytes in 16-byte rows (contiguous), viewed as the int32 map and the int64 word
            self._map = HostTable.empty(-(-rows // 4), 16, torch.uint8, **kw)
            opened.append(self._map)
            self._word = HostTable.empty(1, 16, torch.uint8, **kw)
            opened.append(self._word)
        except BaseException:
            for t in opened:
                t.close()
            raise
        self._row_map = self._map.tensor.view(-1).view(torch.int32)[:rows]  # zeros: nothing cached
        self._word_t = self._word.tensor.view(-1).view(torch.int64)[:1]  # zeros (HostTable.empty): no step done
        self._bytes = torch.from_numpy(self.rows.bytes_view())  # [slots, stride] uint8: what a reader copies into
        self._completed = self._word_t.numpy()
        # the map as numpy, each slot's row (-1: none), the last step that reads it, its reference bit: one tuple,
        # taken whole by each call (:meth:`_state`), dropped whole by close()
        self._arrays = (self._row_map.numpy(), np.full(self.slots, -1, dtype=np.int64),
                        np.zeros(self.slots, dtype=np.int64), np.zeros(self.slots, dtype=np.uint8))
        self._hand = 0
        self._planned = 0
        self._counted = 0  # the last step whose plan fitted (a plan of it again counts none of its rows twice)
        self._lock = threading.Lock()  # one step planned, filled or abandoned at a time
        self.stats = {"steps": 0, "hits": 0, "misses": 0, "evictions": 0}
        self._closed = False

    @classmethod
    def for_file(cls, file, **kw) -> RowCache:
        """A cache of the rows of ``file`` (a :class:`~uvaple.uva.table_file.TableFile`)."""
        lay = file.layout
        return cls(lay.rows, lay.cols, lay.dtype, **kw)

    # ------------------------------------------------------------------ steps
    def _state(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(the map, each slot's row, each slot's last step, the reference bits), or the closed cache's named error.
        A call holds the tuple as a local: a close() from another thread meanwhile drops only the cache's own
        references, and the memory goes when the call returns."""
        return self._held(self._arrays)

    def slots_of(self, rows) -> np.ndarray:
        """The slots of table rows ``rows`` as the map says now (int64; -1 where a row is not cached)."""
        return self._state()[0][np.asarray(rows, dtype=np.int64)].astype(np.int64) - 1

    def cache_ids(self, rows: np.ndarray, out: np.ndarray) -> None:
        """The map's values of table rows ``rows`` (int64, inside the table) into ``out`` (int32): each row's slot
        plus one, 0 where it is not cached; the ids a gather of :attr:`rows` reads with ``id_base`` 1."""
        np.take(self._state()[0], rows, out=out)

    def views(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slots' rows ``[slots, cols]``, the completion word ``[1]`` int64) as work on ``device`` reads and
        writes them: CUDA tensors aliasing the host memory (the cache must be registered), or the host tensors
        themselves for the CPU."""
        self._live()
        if device.type != "cuda":
            return self.rows.tensor, self.completed
        word = self._word.cuda_view(device.index).view(-1).view(torch.int64)[:1]
        return self.rows.cuda_view(device.index), word

    @property
    def planned(self) -> int:
        """The last step :meth:`plan` was called for (0: none), whether or not it fitted."""
        return self._planned

    @property
    def row_map(self) -> torch.Tensor:
        """The map (int32 ``[table rows]``, host memory; see the module docstring); the closed cache's named error
        once closed."""
        return self._held(self._row_map)

    @property
    def completed(self) -> torch.Tensor:
        """The completion word (int64 ``[1]``, host memory); the closed cache's named error once closed."""
        return self._held(self._word_t)

    @staticmethod
    def _held(what):
        """``what``, one of the cache's own references that close() drops, or the closed cache's named error."""
        if what is None:
            raise TableClosedError("this row cache is closed")
        return what

    def done(self) -> int:
        """The last completed step (the completion word, read as it is now); the closed cache's named error once
        closed (the word goes with the cache)."""
        return int(self._held(self._completed)[0])

    def complete(self, step: int) -> None:
        """Write the completion word from the host (where the steps run on the host; on the GPU, write
        ``completed`` in stream order instead)."""
        self._live()
        self.completed.fill_(int(step))

    def plan(self, rows, step: int) -> Misses:
        """Rows ``rows`` (int, any order, repeats allowed) are read by step ``step``: keep the cached ones, give
        the others slots, and return those (:class:`Misses`) for the caller to read in before the step's gather.
        ``step`` counts up (a step may be planned more than once) and is after the completed one."""
        with self._lock:
            return self._plan(rows, step, self._opened())

    def read_in(self, rows, step: int, file, reader=None) -> Misses:
        """:meth:`plan` then :meth:`fill` from ``file`` (by ``reader`` where given), as one: whatever stops it after
        the plan (a failed read, an interrupt) leaves none of the rows it placed mapped. Returns the misses it read
        in."""
        with self._lock:
            arrays = self._opened()
            misses = self._plan(rows, step, arrays)
            try:
                self._fill(misses, file, reader, arrays)
            except BaseException:
                self._unmap(misses.rows, misses.slots, arrays)
                raise
            return misses

    def _opened(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The cache open and this process's: its state, taken whole for a call (:meth:`_state`)."""
        self._live()
        return self._state()

    def _plan(self, rows, step: int, arrays) -> Misses:
        if isinstance(step, bool) or not isinstance(step, int) or step < max(1, self._planned):
            raise ValueError(f"step {step!r}: steps are ints from 1 that never go back (the last planned was "
                             f"{self._planned})")
        done = self.done()
        if step <= done:
            raise ValueError(f"step {step} is already completed (the completion word says {done}): a step is "
                             "planned before its gather runs")
        if not isinstance(rows, np.ndarray):
            rows = torch.as_tensor(rows).cpu().numpy()
        ids = np.ascontiguousarray(rows, dtype=np.int64).reshape(-1)
        before, self._planned = self._planned, step
        need = np.empty(ids.size, dtype=np.int64)
        slots = np.full(ids.size, -1, dtype=np.int64)  # the sweep's placed rows: (need[i], slots[i]) where >= 0
        try:
            again = step == self._counted  # planned before, whole: its rows are counted and referenced
            placed, self._hand, hits, evicted, status = _sweep()(ids, *arrays, self._hand, step, done, need, slots,
                                                                 again)
            if status < 0:  # a row outside the table: nothing placed, the step not planned
                self._planned = before
                raise ValueError(f"a row cache of a {self.table_rows}-row table was asked for rows "
                                 f"{int(ids.min())} .. {int(ids.max())}")
            self.stats["evictions"] += evicted
            if status:
                self.stats["steps"] += not again
                self._counted = step
                self.stats["hits"] += hits
                self.stats["misses"] += placed
                return Misses(step, need[:placed], slots[:placed])  # (views of this call's own arrays)
            self._unmap(need[:placed], slots[:placed], arrays)  # the step does not fit: none of its rows stay placed
        except BaseException:  # an interrupt (as the sweep returns, in the rollback above, or before the caller holds
            placed_ = slots >= 0  # the misses): the rows it placed are found by their slots, whatever was assigned
            self._unmap(need[placed_], slots[placed_], arrays)  # (unmapping twice is harmless)
            raise
        raise self._full(ids, step, done, arrays)

    def _full(self, ids: np.ndarray, step: int, done: int, arrays) -> RowCacheFull:
        """The error of step ``step``, whose rows ``ids`` do not fit beside the steps in flight."""
        row_map, _, last_step, _ = arrays
        busy = int((last_step > done).sum())
        missing = int((row_map[np.unique(ids)] == 0).sum())
        return RowCacheFull(f"step {step} needs {missing} rows read in, but only {self.slots - busy} of the "
                            f"cache's {self.slots} slots are free of the steps in flight (steps {done + 1} .. "
                            f"{step} hold {busy}): give it more than {self.slots} slots, or complete earlier "
                            "steps first")

    def fill(self, misses: Misses, file, reader=None) -> None:
        """Read ``misses`` from ``file`` (a :class:`~uvaple.uva.table_file.TableFile` of this table) into their
        slots: by ``reader`` (a :class:`~uvaple.uva.page_reader.PageReader` of ``file``: many reads in flight), or
        the reference reader (pages by ``pread`` on this thread). A read that fails, or a file or reader that is not
        this table's, unmaps the rows (:meth:`abandon`) and raises."""
        with self._lock:
            self._fill(misses, file, reader, self._opened())

    def _fill(self, misses: Misses, file, reader, arrays) -> None:
        try:  # whatever is refused or fails, the rows placed for these misses are unmapped: none is served unread
            lay = file.layout
            if (lay.rows, lay.cols, lay.dtype) != (self.table_rows, self.rows.cols, self.rows.dtype):
                raise ValueError(f"{file.path} holds {lay.rows} x {lay.cols} {lay.dtype} rows; this cache is of "
                                 f"{self.table_rows} x {self.rows.cols} {self.rows.dtype}")
            if not len(misses):
                return
            if reader is None:
                self.rows.tensor[torch.from_numpy(misses.slots)] = file.read_rows(misses.rows)
            else:
                if reader.file is not file:
                    raise ValueError(f"the reader reads {reader.file.path}, not {file.path}")
                # (held for the read: a close() from another thread meanwhile drops only the cache's own)
                reader.read_rows_into(misses.rows, self._held(self._bytes), misses.slots)
        except BaseException:
            self._unmap(misses.rows, misses.slots, arrays)
            raise

    def release(self, step: int, to: int) -> int:
        """Step ``step`` was planned (and its misses read in) but its gather will never run (a read-ahead whose call
        did not come): its slots are handed to step ``to``, the last step whose gather was launched (or was
        completed), and are free once that one is. Its rows stay cached, each in its slot: they were read in whole
        (counted as misses; a later plan that reads them counts them as hits), unreferenced. This needs no word from
        the GPU: the slots a queued gather reads stay held by that gather's own step (``to`` is never before it),
        and the next plan sees them free as soon as the word passes ``to``. Returns how many slots were handed
        on."""
        with self._lock:
            arrays = self._opened()
            if isinstance(step, bool) or not isinstance(step, int) or isinstance(to, bool) or not isinstance(to, int) \
                    or not 0 <= to < step:
                raise ValueError(f"release(step={step!r}, to={to!r}): a step's slots go to an earlier step (ints, "
                                 "0 <= to < step)")
            last_step, ref = arrays[2], arrays[3]
            mine = last_step == step
            last_step[mine] = to
            ref[mine] = 0  # a later plan of the step references what it reads again (a row read once: first to go)
            return int(np.count_nonzero(mine))

    def abandon(self, misses: Misses) -> None:
        """The rows of ``misses`` were not read in: unmap them, and free their slots."""
        with self._lock:
            self._unmap(misses.rows, misses.slots, self._opened())

    def _unmap(self, rows: np.ndarray, slots: np.ndarray, arrays) -> None:
        """Rows given slots that were never read in: unmapped, and their slots free at once (what they held
        before was evicted, so no step reads them)."""
        row_map, row_of_slot, last_step, ref = arrays
        mine = row_of_slot[slots] == rows  # slots still holding these rows' places
        row_map[rows[mine]] = 0
        row_of_slot[slots[mine]] = -1
        last_step[slots[mine]] = 0
        ref[slots[mine]] = 0

    # ------------------------------------------------------------------ lifetime
    def _live(self) -> None:
        if self._closed:
            raise TableClosedError("this row cache is closed")
        if self.rows.forked:  # (its views of the rows are the parent's mapping: a private one reads zeros here)
            raise TableForkedError(f"this row cache belongs to process {self.rows.owner_pid}, and this is a forked "
                                   f"child (pid {os.getpid()}): build the cache in the child")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # views hold their tables' mappings (the map is 4 bytes a row of the table): dropped, so that closing
        # releases them; a call on another thread holds its own until it returns
        self._bytes = self._arrays = self._row_map = self._word_t = self._completed = None
        for t in (self.rows, self._map, self._word):
            t.close()

    def __enter__(self) -> RowCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RowCache({self.slots} of {self.table_rows} rows, {self.rows.dtype}, stats={self.stats})"

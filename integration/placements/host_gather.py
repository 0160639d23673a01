"""CPU gathers of table rows into pinned staging, by numba or by ``torch.index_select``.

Two placements use them, so they sit beside both: the copy placement (:mod:`.copy`) stages every row of
a job with :func:`cpu_gather`, and the split lookup (``SplitLookup.lookup_split``, :mod:`.split`) gathers its CPU share
with :func:`gather_up` (chunks copied up while the next is gathered), mapping ids with :func:`split_rows`
and :func:`ids_within` first.

Rows are copied as bytes (columns as a byte range), so every dtype is exact. Out-of-range ids write the
zero element given (the copy placement passes -0.0 when a negative scale follows on the device) or row 0.
The gather returns how many ids were out of range (the copy placement's counter).

Four paths, one result (the numba kernel is the definition):

* serial numba, below ``PARALLEL_MIN_BYTES`` of output;
* parallel numba (``numba.prange`` over all cores);
* prefetching numba, from ``PREFETCH_MIN_BYTES`` where torch does not take the call: each thread copies
  one block of the ids and asks for the lines of the row some ids ahead while it copies this one;
* torch: calls of ``TORCH_MIN_BYTES`` or more, rows of at most ``TORCH_MAX_ROW_BYTES``, while torch has
  at least as many threads as numba. ``torch.index_select`` copies straight into the staging rows; its
  per-row ``memcpy`` beats numba's slice copy on short rows. Numba stays where the two are even (long
  rows) and where torch runs on fewer threads (a process that set ``OMP_NUM_THREADS=1``, as vLLM does
  in its worker processes).

Ids on the torch path. When the table has no id offset and every id is a row (one ``torch.aminmax`` over the
ids, on torch's threads, says so), ``index_select`` takes the ids as they are. Otherwise, as ``index_select``
refuses out-of-range ids, a serial numba pass first writes each id's row into the caller's int64 buffer
(``row_ids``: the slot's, so nothing is allocated), row 0 for an out-of-range id, and counts those. Under
``oob="row0"`` that is the whole answer: ``index_select`` copies row 0 for them. Under zero rows a call with
any out-of-range id is gathered by the numba kernel instead; nothing was written to ``out`` yet. That pass is
serial: on the H200 host it cost a third of the copy of 160-B rows
(``perf/results/h200_2026-12-01/tune_copy_torch_path.log``: the backend's gather 1.36-1.49x a bare
``index_select``), hence the direct case first. The torch path never writes ``out``
twice: zeroing rows after ``index_select`` would
need their positions (a compaction pass that does not vectorise) or a masked pass over all of ``out``,
and a call with many out-of-range ids (a shard's) is mostly zero rows, which numba writes in the same
pass as the rest. The ids pass is serial, so that it never starts numba's thread pool while torch's
threads may still be spinning after the previous ``index_select``.

Concurrent calls of a parallel numba function from several threads abort under numba's default
"workqueue" threading layer, so one process-wide lock serialises gathers of several backends (each
parallel gather already uses every core; so does ``index_select``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numpy as np
import torch

from uvaple.uva.cuda_runtime import copy_async

__all__ = ["cpu_gather", "gather_path", "warm_up", "ids_within", "PARALLEL_MIN_BYTES", "PREFETCH_MIN_BYTES",
           "TORCH_MIN_BYTES", "TORCH_MAX_ROW_BYTES"]

# Below this many gathered bytes the serial gather is used. Swept on the H200 host (16 cores) by
# perf/tune_copy.py (perf/results/h200_2026-12-01/tune_copy.log): the parallel gather is faster from 8 KiB
# (160-byte rows) and 4 KiB (17,920-byte rows) at every larger size, and 8-150x faster above 64 KiB.
PARALLEL_MIN_BYTES = 8 << 10
# From this many gathered bytes, rows of at most TORCH_MAX_ROW_BYTES go through torch.index_select.
# perf/tune_copy.py on the H200 host (16 cores; perf/results/h200_2026-12-01/tune_copy_with_torch.log), 160-byte
# rows: index_select beats the parallel numba gather by 1.1-2.2x at every size from 512 KiB (419,430 rows:
# 1634 us against 2743 us) and loses below (0.81-0.88x at 64-256 KiB). At 512 KiB and 1 MiB it wins by
# 1.6 and 3.3 us, about what the torch path adds to index_select (tensor views and the ids pass: 3.4 us
# a call on a 2-core CPU; tune_copy's torch_path_us column measures it), so the torch path takes over at
# 1 MiB, where the two are even, and wins from 2 MiB (by 40 us of 74).
TORCH_MIN_BYTES = 1 << 20
# The same log: with 17,920-byte rows the two are within 6% at every size (0.94-1.05x), so long rows
# stay on numba. Between 160 and 17,920 bytes nothing was measured; the bound sits low in that gap, and
# perf/tune_copy.py sweeps 1,024- and 4,096-byte rows (either side of it) to place it.
TORCH_MAX_ROW_BYTES = 1024

# From this many gathered bytes the numba gather is the prefetching one (PREFETCH_AHEAD, below).
# perf/tune_copy.py on the H200 host (16 cores; perf/results/h200_2026-12-02/run30_tune_copy_prefetch/
# tune_copy.log, the prefetching gather against the parallel one as cpu_gather runs it, in words): from
# 8 MiB faster at every size and row length (0.54-0.63x the time with 160-B rows, 0.58-0.92x with 1,024 B,
# 0.76-0.99x with 4,096 B, 0.80-0.94x with 17,920 B); below, slower wherever the parallel one takes the
# call (its fixed cost, 23 us against 16, decides there) and mixed at 2-4 MiB (0.56-1.28x). It reads as
# fast as torch's index_select on all cores (1,151 against 1,071 us for 64 MiB of 160-B rows), which the
# backend prefers where torch has the threads: the prefetching gather serves processes that run torch on
# fewer threads (vLLM's workers) and long rows.
PREFETCH_MIN_BYTES = 8 << 20

_GATHER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _gather_kernels() -> tuple[Callable, Callable]:
    """(serial, parallel) numba gathers, compiled lazily (numba imports slowly) for each element type they
    meet: bytes, or 8-byte words where rows, the column range and both buffers are 8-byte aligned
    (:func:`_as_words`). Rows are copied by an explicit loop: a slice copy of bytes is not vectorised by
    numba (about 0.4 GB/s a thread on the H200 host, ``perf/results/h200_2026-12-01/tune_copy.log``)."""
    import numba

    def gather(table, ids, out, start, oob_row0, zero, id_base):
        # table: [rows, stride] and out: [n, width] of one element type (uint8 or uint64); ids: int32/int64
        # [n]; start: the first element of a row copied; zero: the elements written for out-of-range ids
        # under oob="zero" (repeated: the zero of the model's dtype as bytes, or one word of it);
        # id_base: the id of table row 0 (0 <= id_base < 2**62, so a wrapped difference stays out of range)
        rows = table.shape[0]
        width = out.shape[1]
        nz = zero.shape[0]
        bad = 0
        for i in numba.prange(ids.shape[0]):
            r = np.int64(ids[i]) - id_base
            if r < 0 or r >= rows:
                bad += 1
                if oob_row0:
                    for j in range(width):
                        out[i, j] = table[0, start + j]
                else:
                    for j in range(width):
                        out[i, j] = zero[j % nz]
            else:
                for j in range(width):
                    out[i, j] = table[r, start + j]
        return bad

    serial = numba.njit(parallel=False, nogil=True, cache=False)(gather)
    parallel = numba.njit(parallel=True, nogil=True, cache=False)(gather)
    return serial, parallel


# The prefetching gather: each numba thread copies one contiguous block of the ids, and while it copies
# row i it asks for the first PREFETCH_LINES cache lines of row i + PREFETCH_AHEAD (a prefetch instruction
# retires at once, where a load that misses holds the core's window: a thread then waits for several rows
# at a time instead of about one).
PREFETCH_AHEAD = 8
PREFETCH_LINES = 4


def _prefetch_intrinsic():
    """A numba intrinsic ``prefetch(address)`` (LLVM's ``llvm.prefetch``, for reading, kept in every cache
    level), or None where this numba cannot compile it. LLVM names the intrinsic by its pointer type:
    ``p0`` with opaque pointers, ``p0i8`` before them; each is tried on a tiny function."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def make(name: str):
        def codegen(context, builder, signature, args):
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                name)
            builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                              ir.Constant(i32, 1)])
            return context.get_dummy_value()

        def prefetch(typingctx, addr):
            return types.void(types.intp), codegen

        return intrinsic(prefetch)

    for name in ("llvm.prefetch.p0", "llvm.prefetch.p0i8"):
        prefetch = make(name)

        @numba.njit(nogil=True, cache=False)
        def probe(a, prefetch=prefetch):
            prefetch(a.ctypes.data)
            return a[0]

        try:
            probe(np.ones(1, dtype=np.int64))
        except Exception:  # this LLVM wants the other name (or has neither)
            continue
        return prefetch
    return None


@functools.lru_cache(maxsize=1)
def _zero_rows() -> Callable:
    """A serial pass writing ``zero`` (repeated) over the rows of ``out`` whose id is out of range."""
    import numba

    @numba.njit(nogil=True, cache=False)
    def zero_rows(ids, rows, id_base, out, zero):
        nz = zero.shape[0]
        for i in range(ids.shape[0]):
            r = np.int64(ids[i]) - id_base
            if r < 0 or r >= rows:
                for j in range(out.shape[1]):
                    out[i, j] = zero[j % nz]

    return zero_rows


@functools.lru_cache(maxsize=1)
def _prefetch_kernel() -> Callable | None:
    """The prefetching parallel gather ``(table, ids, out, id_base, rows ahead, lines a row) -> out-of-range
    ids`` (row 0 copied for them), or None where the prefetch intrinsic does not compile."""
    import numba

    prefetch = _prefetch_intrinsic()
    if prefetch is None:
        return None

    @numba.njit(parallel=True, nogil=True, cache=False)
    def gather(table, ids, out, id_base, ahead, lines):
        # row 0's elements for an out-of-range id (the caller writes zero rows over them where the policy
        # says so); each thread one contiguous block of the ids, its loop in the parallel body itself and
        # free of branches on the ids (a loop in a function of its own, or a branch per id, ran at half
        # the rate); column 0 on (a column offset's signed index costs the copy its speed): the caller
        # passes out's columns only
        n = ids.shape[0]
        threads = numba.get_num_threads()
        per = (n + threads - 1) // threads
        first = table.ctypes.data
        row_step = table.strides[0]
        rows = table.shape[0]
        width = out.shape[1]
        bads = np.zeros(threads, dtype=np.int64)
        for t in numba.prange(threads):
            a = t * per
            e = min(n, a + per)
            bad = 0
            for i in range(a, e):
                if i + ahead < e:  # an address inside the table, whatever the id
                    q = min(max(np.int64(ids[i + ahead]) - id_base, 0), rows - 1)
                    p = first + q * row_step
                    for c in range(lines):
                        prefetch(p + 64 * c)
                r = np.int64(ids[i]) - id_base
                ok = (r >= 0) & (r < rows)
                bad += 0 if ok else 1
                r = r if ok else 0
                for j in range(width):
                    out[i, j] = table[r, j]
            bads[t] = bad
        return bads.sum()

    return gather


def _as_words(table: np.ndarray, out: np.ndarray, byte_start: int, zero: np.ndarray):
    """(table words, out words, word start, the zero element as one word) for a copy in 8-byte words, or None."""
    nbytes = out.shape[1]
    if byte_start % 8 or nbytes % 8 or table.shape[1] % 8 or 8 % zero.shape[0] or \
            table.ctypes.data % 8 or out.ctypes.data % 8 or table.strides[1] != 1 or out.strides[1] != 1 or \
            table.strides[0] % 8 or out.strides[0] % 8:
        return None
    zero_word = np.tile(zero, 8 // zero.shape[0]).view(np.uint64)  # writable, as warm_up's: one numba variant
    return table.view(np.uint64), out.view(np.uint64), np.int64(byte_start // 8), zero_word


@functools.lru_cache(maxsize=1)
def _rows_kernel() -> Callable:
    """The torch path's serial numba pass over the ids, compiled lazily."""
    import numba

    @numba.njit(parallel=False, nogil=True, cache=False)
    def rows_of(ids, rows, id_base, row_ids):
        # row_ids[i] = ids[i] - id_base, or 0 when out of range (the gather kernel's test); branch-free,
        # so it vectorises
        bad = 0
        for i in range(ids.shape[0]):
            r = np.int64(ids[i]) - id_base
            ok = (r >= 0) & (r < rows)
            bad += 1 - np.int64(ok)
            row_ids[i] = r if ok else 0
        return bad

    return rows_of


def ids_within(ids: torch.Tensor, lo: int, hi: int) -> bool:
    """Whether every one of the (non-empty, CPU) ``ids`` lies in ``[lo, hi)``: one ``torch.aminmax``, on
    torch's threads (numpy's min and max are two single-threaded passes)."""
    id_lo, id_hi = torch.aminmax(ids)
    return int(id_lo) >= lo and int(id_hi) < hi


def _numba_threads() -> int:
    import numba

    return numba.get_num_threads()


def gather_path(n: int, row_bytes: int, *, parallel_min_bytes: int | None = None) -> str:
    """The path of a gather of ``n`` rows of ``row_bytes``: ``"serial"``, ``"parallel"``, ``"prefetch"`` or
    ``"torch"`` (a torch-path call with zero rows and an out-of-range id is gathered by the parallel
    kernel; a prefetch-path call of a column range, and any where numba cannot compile the prefetch, too)."""
    total = n * row_bytes
    if total >= TORCH_MIN_BYTES and row_bytes <= TORCH_MAX_ROW_BYTES \
            and torch.get_num_threads() >= _numba_threads():
        return "torch"
    if total >= PREFETCH_MIN_BYTES:
        return "prefetch"
    threshold = PARALLEL_MIN_BYTES if parallel_min_bytes is None else parallel_min_bytes
    return "parallel" if total >= threshold else "serial"


def cpu_gather(table: np.ndarray, ids: np.ndarray, out: np.ndarray, byte_start: int, oob_row0: bool,
               zero: np.ndarray, *, id_base: int = 0, parallel_min_bytes: int | None = None,
               row_ids: np.ndarray | None = None, path: str | None = None) -> int:
    """Gather ``table[ids - id_base, byte_start:byte_start+out.shape[1]]`` into ``out``; returns the count
    of out-of-range ids.

    ``row_ids``: an int64 buffer of at least ``len(ids)`` elements that the gather may overwrite; without
    it the torch path is not taken. ``out`` is C-contiguous (staging rows are). ``path`` forces one of
    :func:`gather_path`'s answers (the tuning sweep and the tests compare them); ``"torch"`` still needs
    ``row_ids``, and still hands a zero-row call (not ``oob_row0``) with an out-of-range id to numba.
    """
    serial, parallel = _gather_kernels()
    n, nbytes = out.shape
    if path is None:
        path = gather_path(n, nbytes, parallel_min_bytes=parallel_min_bytes)
    elif path not in ("serial", "parallel", "prefetch", "torch"):
        raise ValueError(f"path must be 'serial', 'parallel', 'prefetch' or 'torch', got {path!r}")
    base = np.int64(id_base)
    with _GATHER_LOCK:
        if path == "torch" and row_ids is not None:
            src = torch.from_numpy(table[:, byte_start:byte_start + nbytes])  # numpy slices faster
            ids_t = torch.from_numpy(ids)
            if base == 0 and n:
                # every id a row already: index_select takes them as they are. One reduction on torch's
                # threads instead of the serial pass, and instead of numpy's min and max (two single-threaded
                # passes: the torch path was 1.11-1.27x a bare index_select at 105k-419k 160-B rows with them,
                # 0.97-1.06x with this, perf/results/h200_2026-12-02/run11_tune_copy_aminmax)
                if ids_within(ids_t, 0, table.shape[0]):
                    torch.index_select(src, 0, ids_t, out=torch.from_numpy(out))
                    return 0
            idx = row_ids[:n]
            bad = int(_rows_kernel()(ids, table.shape[0], base, idx))
            if not bad or oob_row0:
                torch.index_select(src, 0, torch.from_numpy(idx), out=torch.from_numpy(out))
                return bad
        words = _as_words(table, out, byte_start, zero) if n and nbytes else None
        if path == "prefetch":
            pf = _prefetch_kernel() if byte_start == 0 and n else None  # else the parallel kernel
            if pf is not None:
                t_, o_ = (words[0], words[1]) if words is not None else (table, out)
                bad = int(pf(t_, ids, o_, base, np.int64(PREFETCH_AHEAD), np.int64(min(PREFETCH_LINES,
                                                                                       -(-nbytes // 64)))))
                if bad and not oob_row0:  # zero rows for them, over row 0's
                    _zero_rows()(ids, table.shape[0], base, out, zero)
                return bad
        fn = serial if path == "serial" else parallel
        if words is not None:
            return int(fn(words[0], ids, words[1], words[2], oob_row0, words[3], base))
        return int(fn(table, ids, out, byte_start, oob_row0, zero, base))


def warm_up(table: np.ndarray, zero: np.ndarray) -> None:
    """Compile every kernel for int32 and int64 ids now, not in the first lookup."""
    out = np.empty((1, min(8, table.shape[1])), dtype=np.uint8)
    serial, parallel = _gather_kernels()
    rows_of = _rows_kernel()
    row_ids = np.empty(1, dtype=np.int64)
    t64, o64, z64 = np.zeros((1, 1), dtype=np.uint64), np.empty((1, 1), dtype=np.uint64), np.zeros(1, np.uint64)
    prefetch, zero_rows = _prefetch_kernel(), _zero_rows()
    for dt in (np.int32, np.int64):
        ids = np.zeros(1, dtype=dt)
        with _GATHER_LOCK:
            for fn in (serial, parallel):
                fn(table, ids, out, 0, False, zero, np.int64(0))
                fn(t64, ids, o64, np.int64(0), False, z64, np.int64(0))
            if prefetch is not None:
                for t_, o_ in ((table, out), (t64, o64)):
                    prefetch(t_, ids, o_, np.int64(0), np.int64(PREFETCH_AHEAD), np.int64(1))
            zero_rows(ids, table.shape[0], np.int64(0), out, zero)
            rows_of(ids, table.shape[0], np.int64(0), row_ids)


@functools.lru_cache(maxsize=1)
def _split_kernel() -> Callable:
    import numba

    @numba.njit(parallel=False, nogil=True, cache=False)  # serial: no numba pool beside torch's threads
    def split_rows(ids, id_base, lo, hi, row0, rows, staged):
        bad = 0
        for j in range(ids.shape[0]):
            r = np.int64(ids[j]) - id_base
            ok = (r >= lo) & (r < hi)
            rows[j] = r if ok else lo
            staged[j] = j if (ok | row0) else -1
            bad += 0 if ok else 1
        return bad

    return split_rows


def split_rows(ids: np.ndarray, id_base: int, lo: int, hi: int, row0: bool, rows: np.ndarray,
               staged: np.ndarray) -> int:
    """A split lookup's CPU share, in one serial pass over its ids: ``rows[j]``, the table row to stage (id
    ``j`` less ``id_base`` when inside ``[lo, hi)``, else ``lo``: any row, read and never used unless
    ``row0``), and ``staged[j]``, the id of staged row ``j`` for the device kernel that applies the policy
    (``j``, or ``-1``, out of range there too, for an id outside the window under zero rows). Returns
    how many ids were outside the window (under ``row0`` the device kernel cannot see them)."""
    return int(_split_kernel()(ids, np.int64(id_base), np.int64(lo), np.int64(hi), bool(row0), rows, staged))


def warm_split() -> None:
    """Compile :func:`split_rows` for int32 and int64 ids now, not in the first split lookup."""
    rows, staged = np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64)
    for dt in (np.int32, np.int64):
        split_rows(np.zeros(1, dtype=dt), 0, 0, 1, False, rows, staged)


def gather_up(table_bytes, rows, host, dev, copy_stream, row_bytes: int, chunk_rows: int, *,
              path: str = "torch", track: bool = True) -> None:
    """Rows ``rows`` (int32 or int64, CPU) of ``table_bytes`` (a uint8 ``[rows, stride]`` CPU tensor)
    gathered into pinned ``host`` and copied to ``dev`` (rows of ``host``'s stride) on ``copy_stream``,
    ``chunk_rows`` rows at a time: the copy of one chunk runs while the next is gathered. ``path``:
    ``"parallel"`` or ``"prefetch"`` (this module's numba gathers: 8-byte words on every numba thread;
    every row must be inside the table) or ``"torch"`` (``torch.index_select`` on torch's intra-op threads, which raises
    ``IndexError`` at a row outside the table, before reading it). The caller owns ``host`` until the
    copies are done (an event recorded on ``copy_stream`` after this).

    The chunks go up through the runtime's ``cudaMemcpyAsync`` (a few µs on the host, a third of torch's
    ``copy_``). With ``track``, the last goes through torch's ``copy_`` instead, which tells torch's
    pinned-memory cache that ``copy_stream`` used ``host``'s memory: when ``host`` is freed, the cache
    records an event on that stream and hands the memory out again only once it has passed, after every
    copy out of it (all on ``copy_stream``, in order), also if ``host`` is dropped while they run. A caller
    that fences its staging itself (a split lookup: an event waited for before any reuse or release)
    passes ``track=False``."""
    if path not in ("parallel", "prefetch", "torch"):
        raise ValueError(f"path must be 'parallel', 'prefetch' or 'torch', got {path!r}")
    m = rows.shape[0]
    step = max(1, int(chunk_rows))
    if path != "torch":
        t_np, r_np, h_np = table_bytes.numpy(), rows.numpy(), host.numpy()
        zero = np.zeros(1, dtype=np.uint8)  # unused: every row is inside the table
    stride = host.stride(0)
    if dev.stride(0) != stride or host.stride(1) != 1 or dev.stride(1) != 1 or host.element_size() != 1 or \
            dev.element_size() != 1 or dev.shape[0] < m or host.shape[0] < m:
        raise ValueError(f"gather_up: host and device staging need byte rows of the same stride, at least {m} "
                         f"of them, got {tuple(host.shape)} {host.stride()} and {tuple(dev.shape)} {dev.stride()}")
    host_ptr, dev_ptr, handle = host.data_ptr(), dev.data_ptr(), copy_stream.cuda_stream
    with torch.cuda.device(dev.get_device()):
        for a in range(0, m, step):
            b = min(m, a + step)
            if path == "torch":
                torch.index_select(table_bytes, 0, rows[a:b], out=host[a:b, :row_bytes])
            else:
                cpu_gather(t_np, r_np[a:b], h_np[a:b, :row_bytes], 0, True, zero, path=path)
            if (b == m and track) or not copy_async(dev_ptr + a * stride, host_ptr + a * stride, (b - a) * stride,
                                                    handle, "staged rows"):
                with torch.cuda.stream(copy_stream):
                    dev[a:b].copy_(host[a:b], non_blocking=True)

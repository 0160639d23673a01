"""The sorted gather: the ids sorted on the device, then the rows read in ascending order, each written to its
own output row; with ``dedup`` each distinct id read once. Same arguments and bits as :mod:`.gather`.

Kernels, launcher, operator and fake, in that order.

Random small rows spread over a big table are read several times faster in order (neighbours share host
pages). ``torch.sort`` of 4-byte row keys into the workspace (int64 ``[2, max_rows]``: the keys, computed by
``row_keys_kernel`` into the first half of row 0 and sorted into its second half, and their positions in
row 1); a table of ``ROW_KEY_MAX`` rows or more past ``row_lo`` sorts the ids as given. A key is ``row -
row_lo + 1``, 0 for every out-of-range id, so int64 ids sort in half the radix passes and the out-of-range
ids form one run at the front. The sort's scratch comes from torch's caching allocator (a captured graph
owns it). The exact order pays: 8,192 buckets of rows (5 MB of a 24 GiB table), their ids in no set order
(count / starts / scatter kernels), read 7% slower at 65,536 ids (as fast at 1M), and their kernels cost no
less than this sort (52 us at 65,536 ids, 407 against 102 at 1M; perf/results/h200_2026-12-03/
run9_ngram_sort_sweep_split, ngram.json "sort_sweep"). int16 keys of 8,192-row buckets sorted in 34 us
instead of 52 with the gather's time within 1% (run7_sort_sweep_split_cprofile): not worth a second key
format.

De-duplication: a program holds several sorted ids; only the first of equal ids in the whole call (its
leader) reads the table, so each distinct id crosses PCIe once. After a barrier the repeats led from the
same program copy that output row; ``dedup_tail_kernel`` then copies the leader's row to the repeats at
the start of a program whose run began in an earlier one (a binary search of the sorted ids finds the
leader). Repeats copy from the leader's output row rather than from a compact buffer of distinct rows: both
read each distinct row over PCIe once, and a compact buffer moves more through HBM besides. Without
``dedup`` a program holds one row, its warps chosen per call by how sparse the ids lie in the table
(:func:`uvaple.kernels.tuning.sorted_warps`, where the row fits one tile).

Operator schema: ``uvaple::gather_rows_sorted`` takes the arguments of ``uvaple::gather_rows`` plus
``Tensor(c!) workspace`` (int64 ``[2, >= ids.numel()]``) and ``bool dedup`` (then ``int plan=-1``)::

    uvaple::gather_rows_sorted(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale,
        Tensor(c!) workspace, int scale_bits, bool has_scale, int col_start, int id_base, int row_lo,
        int oob_mode, int dequant, bool dedup, int plan=-1) -> ()
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl

from . import capture, jit, registry
from . import rows as _rows
from .checks import check_call, check_fixed, check_reach, check_workspace
from .gather import FixedArgs
from .launch import KernelLaunch
from .tuning import NUM_WARPS, SORTED_TILE_BYTES, TILE_BYTES, SortedConfig, sorted_config, sorted_warps

__all__ = ["SortedGather", "sorted_launch_config", "ROW_KEY_MAX"]

kernel = jit.kernel_decorator(__name__)
_rows = jit.same_variant(__name__, _rows)
convert_rows, either, row_scale_bits = _rows.convert_rows, _rows.either, _rows.row_scale_bits
leader_index, add = _rows.leader_index, _rows.add

#: the largest row key (row - row_lo + 1, int32); tables with more rows past row_lo sort the ids as given
ROW_KEY_MAX = (1 << 31) - 1
ROW_KEY_BLOCK = 1024
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_I32_MAX = (1 << 31) - 1


# n changes from call to call: not specialised (see gather_rows_kernel).
@kernel(do_not_specialize=["scale_bits", "n"])
def gather_sorted_kernel(
    table_ptr,  # *Pointer* to row 0 of the table
    sorted_ptr,  # *Pointer* to the ids in ascending order [n] (int32/int64, as the caller's), or (KEYS) row keys
    order_ptr,  # *Pointer* to int64 [n]: the output row of each sorted id (its position in the caller's ids)
    out_ptr,  # *Pointer* to the output [n, n_cols]
    counters_ptr,  # as gather_rows_kernel
    dq_scale_ptr,  # as gather_rows_kernel
    hot_ptr, slot_ptr, n_hot,  # as gather_rows_kernel (HOT)
    id_counts_ptr,  # as gather_rows_kernel (COUNT_IDS)
    n,  # ids in this call
    id_base, row_lo, n_rows, table_stride, col_start, n_cols, scale_bits, scale_col,  # as gather_rows_kernel
    HAS_SCALE: tl.constexpr, CONVERT: tl.constexpr, OOB_ROW0: tl.constexpr, NEG_ZERO: tl.constexpr,
    FP8: tl.constexpr, SCALE: tl.constexpr, COUNT: tl.constexpr, HOT: tl.constexpr, COUNT_IDS: tl.constexpr,
    SCALE_WORD: tl.constexpr,
    DEDUP: tl.constexpr,  # read each distinct id of a tile once; its repeats copy the first one's output row
    KEYS: tl.constexpr,  # sorted_ptr holds row keys (row_keys_kernel: row - row_lo + 1, 0 for an out-of-range id)
    BLOCK_R: tl.constexpr,  # sorted ids per program
    BLOCK_C: tl.constexpr,  # columns per program
):
    """Program ``(p, j)``: column tile ``j`` of sorted ids ``p*BLOCK_R ...``, each written to its own output
    row (``order``): rows are read in ascending id order, so one program's reads cluster in the table.

    De-duplication: only the first of equal ids in the whole sorted order (a "leader") reads the table,
    so each distinct id is read once. After a barrier, the repeats whose leader is in this program copy
    its output row, which this program has just written. The repeats whose run began in an earlier
    program (at most one run per program: the one its first id continues) are left to
    :func:`dedup_tail_kernel`, launched next in the same stream. With a hot set every hit reads its row
    from the set, repeat or not (HBM: no PCIe read to save; fp8 rows move half the bytes of a copy of
    the leader's output), so only the repeats of misses copy.
    """
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    local = tl.arange(0, BLOCK_R)
    r = pid * BLOCK_R + local
    in_n = r < n
    raw = tl.load(sorted_ptr + r, mask=in_n, other=0)
    if KEYS:  # keys past the table (none come from row_keys_kernel) are out of range too
        row = raw.to(tl.int64) - 1 + row_lo
        valid = (raw > 0) & (row < n_rows) & in_n
    else:
        row = raw.to(tl.int64) - id_base
        valid = (row >= row_lo) & (row < n_rows) & in_n
    row = tl.where(valid, row, row_lo)  # no address outside the table, whatever the id
    pos = tl.load(order_ptr + r, mask=in_n, other=0)
    if HOT:  # as in gather_rows_kernel: a slot outside the hot set is a miss
        slot = tl.load(slot_ptr + row, mask=in_n, other=-1).to(tl.int64)
        hit = (slot >= 0) & (slot < n_hot) & in_n
        if not OOB_ROW0:
            hit = hit & valid
        # a miss's slot is clamped into the set (its loads are masked off). No tl.where on `hit` in this kernel:
        # Triton 3.6's TritonGPURemoveLayoutConversions fails on such a select beside the tile's 2-D masks
        # (fp8 rows with their own scale, oob row0 or -0.0, 8- and 16-column tiles)
        slot = tl.maximum(tl.minimum(slot, n_hot - 1), 0)
    if COUNT:
        if tile == 0:
            first = pid == 0
            tl.atomic_add(counters_ptr, 1, mask=first, sem="relaxed")
            tl.atomic_add(counters_ptr + 1, n, mask=first, sem="relaxed")
            # tl.reduce with our own combine: tl.sum's is a triton.jit of the standard library, which the
            # interpreted copy of this module (kernels/_jit.py) cannot call
            bad = tl.reduce((in_n & (valid == 0)).to(tl.int64), 0, add)
            tl.atomic_add(counters_ptr + 2, bad, mask=bad > 0, sem="relaxed")
            if HOT:
                hits = tl.reduce((hit & valid).to(tl.int64), 0, add)
                tl.atomic_add(counters_ptr + 3, hits, mask=hits > 0, sem="relaxed")
    if COUNT_IDS:
        if tile == 0:
            tl.atomic_add(id_counts_ptr + row, tl.full([BLOCK_R], 1, tl.int64), mask=valid, sem="relaxed")
    if DEDUP:
        prev = tl.load(sorted_ptr + r - 1, mask=in_n & (r > 0), other=0)
        leader = in_n & ((r == 0) | (raw != prev))
    else:
        leader = in_n
    # The ids that read their row: the leaders and, with a hot set, every hit. De-duplication saves PCIe reads;
    # a repeat of a hot row reads the set's bytes from HBM (fp8 rows: half of a copy of the leader's output).
    if HOT:
        reads = leader | hit
    else:
        reads = leader
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    if OOB_ROW0:
        keep = reads[:, None] & col_ok[None, :]
    else:
        keep = (reads & valid)[:, None] & col_ok[None, :]
    if HOT:
        hot2 = hit[:, None] & col_ok[None, :]
        x_hot = tl.load(hot_ptr + slot[:, None] * table_stride + col_start + cols[None, :], mask=keep & hot2, other=0)
        x = tl.load(table_ptr + row[:, None] * table_stride + col_start + cols[None, :], mask=keep & (hot2 == 0),
                    other=0)
        x = either(x_hot, x, hot2)
    else:
        x = tl.load(table_ptr + row[:, None] * table_stride + col_start + cols[None, :], mask=keep, other=0)
    row_scale = 0.0
    if SCALE == 2:
        if HOT:
            # the scale's bits from the set or the table, each load masked: the other gives 0 (no select)
            bits = row_scale_bits(hot_ptr + slot * table_stride + scale_col, hit, SCALE_WORD) | \
                row_scale_bits(table_ptr + row * table_stride + scale_col, leader & (hit == 0), SCALE_WORD)
        else:
            bits = row_scale_bits(table_ptr + row * table_stride + scale_col, leader, SCALE_WORD)  # repeats: none
        row_scale = bits.to(tl.float32, bitcast=True)[:, None]
    y = convert_rows(x, keep, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE, CONVERT, OOB_ROW0,
                 NEG_ZERO, FP8, SCALE)
    tl.store(out_ptr + pos[:, None] * n_cols + cols[None, :], y, mask=reads[:, None] & col_ok[None, :])
    if DEDUP:
        tl.debug_barrier()  # the leaders' rows are written and visible to the whole program
        lead = tl.associative_scan(tl.where(leader, local, -1), 0, leader_index)  # -1: led from before
        has_lead = lead >= 0
        lead_pos = tl.load(order_ptr + pid * BLOCK_R + lead, mask=in_n & has_lead, other=0)
        dup = (in_n & (reads == 0) & has_lead)[:, None] & col_ok[None, :]
        v = tl.load(out_ptr + lead_pos[:, None] * n_cols + cols[None, :], mask=dup, other=0)
        tl.store(out_ptr + pos[:, None] * n_cols + cols[None, :], v, mask=dup)




# n changes from call to call: not specialised (see gather_rows_kernel).
@kernel(do_not_specialize=["n"])
def row_keys_kernel(
    ids_ptr,  # *Pointer* to the ids [n] (int32 or int64)
    keys_ptr,  # *Pointer* to the keys written [n] (int32: the table has fewer than 2**31 - 1 rows past row_lo)
    n,  # ids in this call
    id_base, row_lo, n_rows,  # as gather_rows_kernel
    BLOCK: tl.constexpr,
):
    """The sort key of each id: ``row - row_lo + 1`` for a row inside the table (or its window), 0 for an
    out-of-range id. Sorting these 4-byte keys instead of the caller's (often 8-byte) ids halves the radix
    sort's passes, and every out-of-range id sorts into one run at the front (one leader under ``dedup``:
    they all give the same output row)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row = tl.load(ids_ptr + i, mask=m, other=0).to(tl.int64) - id_base
    valid = (row >= row_lo) & (row < n_rows)
    key = tl.where(valid, row - row_lo + 1, 0)
    tl.store(keys_ptr + i, key.to(keys_ptr.dtype.element_ty), mask=m)


@kernel(do_not_specialize=["n"])
def dedup_tail_kernel(
    sorted_ptr,  # *Pointer* to the sorted ids [n] (as gather_sorted_kernel's)
    order_ptr,  # *Pointer* to int64 [n]: the output row of each sorted id
    out_ptr,  # *Pointer* to the output [n, n_cols], every leader's row already written
    n,  # ids in this call
    n_cols,  # columns per output row
    STEPS: tl.constexpr,  # binary-search steps: at least n.bit_length()
    BLOCK_R: tl.constexpr,  # sorted ids per program of the gather it follows
    BLOCK_C: tl.constexpr,  # columns per program
):
    """Program ``(p, j)``: column tile ``j`` of the repeats at the start of gather program ``p`` whose run of
    equal ids began in an earlier program. Each copies the output row of its run's leader (the first equal
    id: a binary search of the sorted ids), which the gather launched before this kernel wrote. A program
    whose first id starts a run copies nothing. (A hot-set hit's repeats read their row in the gather; the
    copy here writes them the same bits again.)
    """
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    first = pid * BLOCK_R
    in_run = (first > 0) & (first < n)
    v0 = tl.load(sorted_ptr + first, mask=in_run, other=0)
    before = tl.load(sorted_ptr + first - 1, mask=in_run, other=0)
    in_run = in_run & (v0 == before)
    if in_run:
        lo = first * 0  # the first position holding v0: in [0, first), sorted[first - 1] is v0
        hi = first
        for _ in range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(sorted_ptr + mid, mask=active, other=0)
            less = active & (v < v0)
            lo, hi = tl.where(less, mid + 1, lo), tl.where(active & (less == 0), mid, hi)
        lead_pos = tl.load(order_ptr + lo)
        r = first + tl.arange(0, BLOCK_R)
        raw = tl.load(sorted_ptr + r, mask=r < n, other=0)
        rep = (r < n) & (raw == v0)  # a prefix of the program: its ids are sorted
        pos = tl.load(order_ptr + r, mask=rep, other=0)
        cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
        m = rep[:, None] & (cols < n_cols)[None, :]
        v = tl.load(out_ptr + lead_pos * n_cols + cols[None, :] + pos[:, None] * 0, mask=m, other=0)
        tl.store(out_ptr + pos[:, None] * n_cols + cols[None, :], v, mask=m)


# ------------------------------------------------------------------ launcher
_INTERPRETED_SMS = 132  # the interpreter runs one program at a time: any count gives the same bits


@functools.lru_cache(maxsize=16)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (asked once per device)."""
    if device.type != "cuda":
        return _INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def sorted_launch_config(table: torch.Tensor, device: torch.device, n: int, ncols: int, row_lo: int,
                         dedup: bool) -> SortedConfig:
    """The sorted gather's program shape for a call of ``n`` ids: :func:`~.tuning.sorted_config`, and for
    one-row programs of rows within one tile, warps by how sparse the ids lie in the table
    (:func:`~.tuning.sorted_warps`; measured on such rows). Rows of several tiles keep the default."""
    row_bytes = ncols * table.element_size()
    warps = None
    if not dedup and row_bytes <= SORTED_TILE_BYTES:
        span = (table.shape[0] - row_lo) * table.stride(0) * table.element_size()
        warps = sorted_warps(n, span, _sms(device))
    return sorted_config(row_bytes, table.element_size(), dedup, num_warps=warps)


class SortedGather:
    """The sorted gather over one table with one policy and one ``workspace`` (int64 ``[2, max_rows]``),
    everything that does not depend on the call made here, once (see :class:`.gather.DirectGather`). The
    program shape depends on the call's size (warps by the ids' gap): a
    :class:`~uvaple.kernels.launch.KernelLaunch` per shape and column count, made at its first call.
    ``config``: a fixed program shape; ``keys``: sort 4-byte row keys (True) or the ids as given (False),
    default by the table's rows (the bench's sweeps set both)."""

    def __init__(self, table: torch.Tensor, device: torch.device, out_dtype: torch.dtype, workspace: torch.Tensor, *,
                 dedup: bool = False, config: SortedConfig | None = None, keys: bool | None = None, **policy) -> None:
        self.interpret = device.type != "cuda"
        self.kernels = jit.variant(sys.modules[__name__], self.interpret)
        self.args = a = FixedArgs(table, out_dtype, **policy)
        self.out_int = _INT_OF_SIZE.get(out_dtype.itemsize)
        self.dedup = bool(dedup)
        self.config = config
        self.ws = workspace
        self.use_keys = a.view.shape[0] - a.row_lo <= ROW_KEY_MAX if keys is None else bool(keys)
        self.halves = workspace[0].view(torch.int32)  # 2 x max_rows: the keys as computed, then sorted
        self.half = workspace.shape[1]
        self.device = device
        self.constants = dict(a.constants, DEDUP=self.dedup, KEYS=self.use_keys)
        self.keys_launch = KernelLaunch(self.kernels.row_keys_kernel, dict(BLOCK=ROW_KEY_BLOCK, num_warps=4),
                                        interpret=self.interpret)
        self._launches: dict[tuple, KernelLaunch] = {}

    def launch_config(self, n: int, ncols: int) -> SortedConfig:
        """The program shape of a call of ``n`` ids of ``ncols`` columns (:func:`sorted_launch_config`)."""
        if self.config is not None:
            return self.config
        return sorted_launch_config(self.args.view, self.device, n, ncols, self.args.row_lo, self.dedup)

    def _launch(self, what: str, constants: dict, views=()) -> KernelLaunch:
        key = (what, *sorted(constants.items()))
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = KernelLaunch(getattr(self.kernels, what), constants,
                                                        interpret=self.interpret, views=views)
        return launch

    def sort(self, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sort a call's ids into the workspace: (the sorted row keys or ids, the position of each)."""
        order = self.ws[1, :n]
        if self.use_keys:
            unsorted, keys = self.halves[:n], self.halves[self.half: self.half + n]
            self.keys_launch((triton.cdiv(n, ROW_KEY_BLOCK),), (ids, unsorted, n, *self.args.fixed[:3]),
                             (ids.dtype, ids.data_ptr() % 16 == 0, n <= _I32_MAX), ids.get_device())
            torch.sort(unsorted, stable=False, out=(keys, order))
        else:
            keys = self.ws[0].view(ids.dtype)[:n] if ids.dtype != torch.int64 else self.ws[0, :n]
            torch.sort(ids.reshape(-1), stable=False, out=(keys, order))
        return keys, order

    def gather_ordered(self, keys: torch.Tensor, order: torch.Tensor, out: torch.Tensor, col_start: int,
                       cfg: SortedConfig) -> tuple[int, int]:
        """``gather_sorted_kernel`` over sorted ``keys`` (row keys when ``use_keys``, else ids) and their
        ``order``: each row to its output row ``order[i]``; returns the grid. (:meth:`__call__` after its sort;
        the bench's sort sweep gives orders of its own.)"""
        n, ncols = order.shape[0], out.shape[-1]
        grid = (triton.cdiv(n, cfg.block_rows), triton.cdiv(ncols, cfg.block_cols))
        launch = self._launch("gather_sorted_kernel", dict(self.constants, BLOCK_R=cfg.block_rows,
                                                           BLOCK_C=cfg.block_cols, num_warps=cfg.num_warps),
                              views=((3, self.out_int),) if not self.constants["CONVERT"] else ())
        a = self.args
        launch(grid, (a.view, keys, order, out, *a.mid, n, *a.fixed, col_start, ncols, *a.tail),
               (keys.dtype, out.data_ptr() % 16 == 0, col_start, ncols, n <= _I32_MAX), out.get_device())
        return grid

    def __call__(self, ids: torch.Tensor, out: torch.Tensor, col_start: int, n: int) -> None:
        ncols = out.shape[-1]
        cfg = self.launch_config(n, ncols)
        if self.args.host_memory and capture.capturing(ids):
            capture.keep_for_graph(self.args.source)
        keys, order = self.sort(ids, n)
        grid = self.gather_ordered(keys, order, out, col_start, cfg)
        if self.dedup and grid[0] > 1:  # the repeats of runs that cross into a program copy their leader's row
            # a plain HBM copy (of bits, whatever the dtype): wide tiles, so few programs repeat the leader's
            # search; 32 search steps cover any n below 2**32 (one compiled variant; the steps past the answer
            # load nothing)
            block_c = min(triton.next_power_of_2(ncols), max(1, TILE_BYTES // out.element_size()))
            launch = self._launch("dedup_tail_kernel", dict(STEPS=32 if n < 1 << 32 else 64, BLOCK_R=cfg.block_rows,
                                                            BLOCK_C=block_c, num_warps=NUM_WARPS),
                                  views=((2, self.out_int),))
            launch((grid[0], triton.cdiv(ncols, block_c)), (keys, order, out, n, ncols),
                   (keys.dtype, out.data_ptr() % 16 == 0, ncols, n <= _I32_MAX), out.get_device())


# ------------------------------------------------------------------ operator
def _gather_rows_sorted(table, ids, out, counters, dq_scale, workspace, bits, has_scale, col_start, id_base, row_lo,
                        oob_mode, dequant, dedup, plan=-1) -> None:
    torch.autograd.graph.increment_version(out)
    mine = registry.find(plan, table, ids, out)
    if mine is not None and mine.sorted is not None and workspace is mine.workspace:
        if check_call(table, ids, out, col_start, dequant, "gather_rows_sorted") and ids.numel():
            check_workspace(workspace, ids.numel(), ids.device)
            mine.sorted(ids, out, col_start, ids.numel())
        return
    check_fixed(table, dq_scale, id_base, row_lo, oob_mode, dequant, "gather_rows_sorted")
    ncols = check_call(table, ids, out, col_start, dequant, "gather_rows_sorted", dq_scale)
    check_reach(table, ids.device, out.dtype, has_scale, oob_mode, dequant, "gather_rows_sorted")
    check_workspace(workspace, ids.numel(), ids.device)
    if ids.numel() and ncols:
        SortedGather(table, ids.device, out.dtype, workspace, dedup=dedup, counters=counters, dq_scale=dq_scale,
                     bits=bits, has_scale=has_scale, id_base=id_base, row_lo=row_lo, oob_mode=oob_mode,
                     dequant=dequant)(ids, out, col_start, ids.numel())


def _gather_rows_sorted_fake(table, ids, out, counters, dq_scale, workspace, bits, has_scale, col_start, id_base,
                             row_lo, oob_mode, dequant, dedup, plan=-1) -> None:
    return None


if not jit.is_interpreted_copy(__name__):  # the interpreted copy of this module holds the kernels' twins only
    _lib = torch.library.Library("uvaple", "FRAGMENT")
    _lib.define("gather_rows_sorted(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale, "
                "Tensor(c!) workspace, int scale_bits, bool has_scale, int col_start, int id_base, int row_lo, "
                "int oob_mode, int dequant, bool dedup, int plan=-1) -> ()")
    _lib.impl("gather_rows_sorted", _gather_rows_sorted, "CompositeExplicitAutograd")
    torch.library.register_fake("uvaple::gather_rows_sorted", _gather_rows_sorted_fake, lib=_lib)

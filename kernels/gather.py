"""The direct gather: ``out[i, :] = table[ids[i], c0:c1]`` with the row policy, in the caller's CUDA stream.

Kernel, launcher, operator and fake, in that order (Liger's), and the functional :func:`gather_rows`.

One kernel serves every table placement: a CPU tensor over registered host memory (read over PCIe through
UVA), a CUDA tensor aliasing it, or a CUDA tensor in HBM. On CPU tensors the same source runs under
Triton's interpreter (:mod:`uvaple.kernels.jit`), which is how CI checks indexing, masking, rounding and
edge cases. This layer takes tensors and ints only; host tables, specs and placements are
:mod:`uvaple.integration`'s.

Work split: program ``(i, j)`` copies column tile ``j`` of row ``ids[i]``; the tile width comes from
:func:`uvaple.kernels.tuning.launch_config` (bytes per tile and warps, by row bytes).

Out-of-range ids (negative, >= rows, any int64) never form an address outside the table: the id is replaced
by ``row_lo`` before any pointer arithmetic (``rows.safe_row``), then ``oob_mode`` 0 masks the row's loads
off (a +0.0 row whatever the scale), 1 reads row ``row_lo`` (Gemma 3n's embedding does this), 2 writes -0.0
rows (a sum over ranks keeps every owner's bits).

Counters: a launch may add to an int64 ``[>= 3]`` device tensor (lookups, rows, out-of-range ids; a hot set's
hits fourth) with relaxed atomics (one per call, one per out-of-range id), so progress is readable without
host work on the hot path, under CUDA graphs too.

:class:`DirectGather` is made once per table and policy (a lookup's plan, :mod:`uvaple.kernels.plan`): it
holds the table's view, the constants, a config per column count and the compiled kernels
(:class:`~uvaple.kernels.launch.KernelLaunch`); a call passes ids, ``out`` and the first column. The
operator ``uvaple::gather_rows`` makes one for its call after checking every argument, or, given a plan's
handle, runs that plan's: the same launcher either way.

Operator schema::

    uvaple::gather_rows(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale,
                        int scale_bits, bool has_scale, int col_start, int id_base, int row_lo,
                        int oob_mode, int dequant, int plan=-1) -> ()

Valid ids are ``row_lo <= id - id_base < table.shape[0]`` and read row ``id - id_base``. ``dequant``: the
encoding's kernel code (:mod:`uvaple.kernels.encodings`). ``plan``: the handle of the plan that makes this
call (a lookup's, :mod:`uvaple.kernels.registry`), or -1. Entered on every call of a compiled model, so
``torch.compile`` and vLLM see an opaque call that mutates ``out`` and the counters: they never trace into
Triton and never treat a host table as something to copy. Defined with ``torch.library.Library`` rather
than ``custom_op``, whose Python wrapper costs ~20 us a call where the plain library operator costs ~2 us.
"""

from __future__ import annotations

import functools
import sys

import torch
import triton.language as tl

from . import capture, eager_call, jit, registry
from . import rows as _rows
from .checks import (
    OOB_MODES,
    check_call,
    check_fixed,
    check_ids,
    check_out,
    check_policy,
    check_reach,
    check_table,
    column_range,
    scale_bits,
)
from .encodings import encoding_of_code
from .launch import KernelLaunch
from .tuning import LaunchConfig, launch_config

__all__ = ["gather_rows", "DirectGather", "FixedArgs", "kernel_views", "scale_word"]

kernel = jit.kernel_decorator(__name__)
_rows = jit.same_variant(__name__, _rows)
safe_row, convert_rows, either, row_scale_bits = _rows.safe_row, _rows.convert_rows, _rows.either, _rows.row_scale_bits
program_row, tile_columns, count_call = _rows.program_row, _rows.tile_columns, _rows.count_call


# n_ids changes from call to call (1 in decode, thousands in prefill) and only feeds the counters: not
# specialised, so a new batch size never compiles a new variant (perhaps inside a graph capture).
@kernel(do_not_specialize=["scale_bits", "n_ids"])
def gather_rows_kernel(
    table_ptr,  # *Pointer* to row 0 of the table (host memory through UVA, or HBM)
    ids_ptr,  # *Pointer* to the flattened ids, int32 or int64
    out_ptr,  # *Pointer* to the output [n_ids, n_cols], contiguous
    counters_ptr,  # *Pointer* to int64 [3]: lookups, rows, out-of-range ids (read only when COUNT)
    dq_scale_ptr,  # *Pointer* to the fp32 dequantisation scale [1] (read only when SCALE is 1)
    hot_ptr,  # *Pointer* to row 0 of the hot set: device copies of table rows, the table's stride (HOT)
    slot_ptr,  # *Pointer* to int32 [n_rows]: the hot slot of each table row, or -1 (HOT)
    n_hot,  # slots in the hot set (a slot outside 0..n_hot is a miss, whatever the map holds)
    id_counts_ptr,  # *Pointer* to int64 [n_rows]: lookups of each table row, added to (COUNT_IDS)
    n_ids,  # ids in this call
    id_base,  # the id of table row 0 (a rank's vocabulary shard stored alone; 0 for a whole table)
    row_lo,  # valid rows are row_lo <= id - id_base < n_rows (a rank's shard of a full table; else 0)
    n_rows,  # one past the last valid row
    table_stride,  # elements between two table rows (>= the row length, padded)
    col_start,  # first column of the range to copy
    n_cols,  # columns to copy per row
    scale_bits,  # int32: the bits of the fp32 scale, already rounded to the table dtype (HAS_SCALE)
    scale_col,  # the column (byte) of a row's own float32 scale (SCALE 2)
    HAS_SCALE: tl.constexpr,  # multiply by the scale with the model's rounding
    CONVERT: tl.constexpr,  # go through fp32 (scale or a different output dtype)
    OOB_ROW0: tl.constexpr,  # out-of-range ids read row row_lo (else they give a zero row)
    NEG_ZERO: tl.constexpr,  # zero rows are -0.0 (a sum over ranks then keeps every owner's bits)
    FP8: tl.constexpr,  # the codes' fp8 format (encodings.FP8_FORMATS: 1 e4m3fn, 2 e5m2), 0: rows as stored
    SCALE: tl.constexpr,  # encodings.SCALE_KINDS: 1 x the scale at dq_scale_ptr, 2 x the row's own (at scale_col)
    COUNT: tl.constexpr,  # add to the counters (one atomic per call, one per out-of-range id; HOT: per hit)
    HOT: tl.constexpr,  # rows in the hot set are read from it (HBM), the others from the table
    COUNT_IDS: tl.constexpr,  # count each valid id's lookup at id_counts_ptr (a hot set's profile)
    SCALE_WORD: tl.constexpr,  # SCALE 2: the row scale is a 4-byte aligned word in the table and the hot set
    BLOCK: tl.constexpr,  # columns per program
    ROW_TILES: tl.constexpr,  # a 1-D grid, the tiles of a row side by side (tuning.LaunchConfig.row_tiles)
):
    pid, tile = program_row(n_cols, BLOCK, ROW_TILES)
    row, valid = safe_row(ids_ptr, pid, id_base, row_lo, n_rows)
    cols, load_mask = tile_columns(valid, tile, n_cols, BLOCK, OOB_ROW0)
    if HOT:
        # row is inside the table (valid or not), so its map entry is too; a slot outside the hot set is a
        # miss, so no address outside either buffer is formed, whatever the map holds
        slot = tl.load(slot_ptr + row).to(tl.int64)
        hit = (slot >= 0) & (slot < n_hot)
        if not OOB_ROW0:
            hit = hit & valid  # an out-of-range id reads nothing
        slot = tl.where(hit, slot, 0)
        hit_cols = (tl.full([BLOCK], 0, tl.int32) + hit.to(tl.int32)) != 0  # the masks as blocks of bool
        x_hot = tl.load(hot_ptr + slot * table_stride + col_start + cols, mask=load_mask & hit_cols, other=0)
        x = tl.load(table_ptr + row * table_stride + col_start + cols, mask=load_mask & (hit_cols == 0), other=0)
        x = either(x_hot, x, hit_cols)
    else:
        hit = False
        x = tl.load(table_ptr + row * table_stride + col_start + cols, mask=load_mask, other=0)
    if COUNT:
        count_call(counters_ptr, pid, tile, n_ids, valid)
        if HOT:
            if tile == 0:
                tl.atomic_add(counters_ptr + 3, 1, mask=hit & valid, sem="relaxed")
    if COUNT_IDS:
        if tile == 0:
            tl.atomic_add(id_counts_ptr + row, 1, mask=valid, sem="relaxed")
    row_scale = 0.0
    if SCALE == 2:
        if HOT:
            # one read of the scale, from wherever the row's codes came (slot and row are inside their buffers)
            src = tl.where(hit, hot_ptr + slot * table_stride, table_ptr + row * table_stride)
        else:
            src = table_ptr + row * table_stride  # row is inside the table
        row_scale = row_scale_bits(src + scale_col, True, SCALE_WORD).to(tl.float32, bitcast=True)
    y = convert_rows(x, load_mask, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE, CONVERT,
                 OOB_ROW0, NEG_ZERO, FP8, SCALE)
    tl.store(out_ptr + pid * n_cols + cols, y, mask=cols < n_cols)



# ------------------------------------------------------------------ launcher
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_I32_MAX = (1 << 31) - 1


def kernel_views(table: torch.Tensor, out_dtype: torch.dtype, has_scale: bool, oob_mode: int, dequant: int
                 ) -> tuple[torch.Tensor, torch.dtype | None, bool]:
    """(the table as the kernels read it, the dtype ``out`` is viewed as or None, whether rows are converted):
    fp8 codes as bytes (widened with integer ops in the kernel); a plain copy moves bits, so the table and
    ``out`` as same-width integers (fp8 and friends need no support)."""
    convert = has_scale or out_dtype != table.dtype or oob_mode == 2
    if dequant:
        return table.view(torch.uint8), None, convert
    if not convert:
        as_int = _INT_OF_SIZE[table.element_size()]
        return table.view(as_int), as_int, convert
    return table, None, convert


def scale_word(view: torch.Tensor, hot_view: torch.Tensor | None, dequant: int) -> bool:
    """Whether every row's own scale (a row-scaled encoding's) is a 4-byte aligned word in the table (and the
    hot set): the kernels then read it with one load, not four (1-byte tables: strides and offsets are bytes)."""
    trailer = encoding_of_code(dequant)[0].trailer_bytes
    if not trailer:
        return False
    col = view.shape[1] - trailer
    bufs = (view,) if hot_view is None else (view, hot_view)
    return all((b.data_ptr() + col) % 4 == 0 and b.stride(0) % 4 == 0 for b in bufs)


class FixedArgs:
    """What either gather kernel takes that a plan fixes: the table as the kernel reads it (and a hot set's rows),
    the buffers (None where the constants say the kernel does not use them: Triton then takes them as
    constants, with no pointer for the launcher to look up on every call), the row range, the policy's
    constants. ``policy``: the keywords of :class:`DirectGather`; ``hot_only_rows``: rows past the table's last,
    each held by the hot set alone (checked by the plan: :class:`~uvaple.kernels.plan.GatherPlan`)."""

    def __init__(self, table: torch.Tensor, out_dtype: torch.dtype, *, counters=None, dq_scale=None, bits: int = 0,
                 has_scale: bool = False, id_base: int = 0, row_lo: int = 0, oob_mode: int = 0, dequant: int = 0,
                 hot_rows=None, slot_map=None, id_counts=None, hot_only_rows: int = 0) -> None:
        self.view, self.as_int, convert = kernel_views(table, out_dtype, has_scale, oob_mode, dequant)
        hot_view = None if hot_rows is None else kernel_views(hot_rows, out_dtype, has_scale, oob_mode, dequant)[0]
        self.source = table  # what a captured graph must keep alive (capture.keep_for_graph)
        self.host_memory = capture.is_host_memory(table)
        enc, fmt = encoding_of_code(dequant)  # the registry's entry: what the kernels read and where
        self.dequant, self.row_lo = dequant, row_lo
        self.mid = (counters, dq_scale if enc.scale == "global" else None, hot_view, slot_map,
                    0 if hot_view is None else hot_view.shape[0], id_counts)
        self.fixed = (id_base, row_lo, self.view.shape[0] + hot_only_rows, self.view.stride(0))
        self.tail = (bits, self.view.shape[1] - enc.trailer_bytes if enc.trailer_bytes else 0)
        self.constants = dict(HAS_SCALE=has_scale, CONVERT=convert, OOB_ROW0=oob_mode == 1, NEG_ZERO=oob_mode == 2,
                              **enc.kernel_constants(fmt), COUNT=counters is not None, HOT=hot_view is not None,
                              COUNT_IDS=id_counts is not None, SCALE_WORD=scale_word(self.view, hot_view, dequant))


class DirectGather:
    """``gather_rows_kernel`` over one table with one policy, everything that does not depend on the call made
    here, once (:class:`FixedArgs`: the views, the buffers, the constants); a config and a
    :class:`~uvaple.kernels.launch.KernelLaunch` per column count, made at its first call.

    ``table``: 2-D, unit column stride (checked by the caller: :func:`~uvaple.kernels.checks.check_fixed`);
    ``device``: where calls' ids and ``out`` are (CPU: interpreted). ``hot_rows``/``slot_map``/``id_counts``:
    a hot set (:mod:`uvaple.kernels.gather_hot`). ``config``: a fixed tile config (the bench's sweeps).
    A call (:meth:`__call__`) takes contiguous ids (``n > 0``), ``out`` ``[n, ncols]`` of ``out_dtype`` and the
    first column, already checked, and launches on the current stream: no check, no allocation, no sync.
    """

    def __init__(self, table: torch.Tensor, device: torch.device, out_dtype: torch.dtype, *,
                 config: LaunchConfig | None = None, **policy) -> None:
        self.interpret = device.type != "cuda"
        # the device calls launch on: their ids' and out's (every caller checks that they are on it)
        self.index = -1 if self.interpret else device.index if device.index is not None else torch.cuda.current_device()
        self.kernels = jit.variant(sys.modules[__name__], self.interpret)
        self.args = a = FixedArgs(table, out_dtype, **policy)
        self.views = () if a.as_int is None else ((2, a.as_int),)
        # the item a program writes sizes its tile: fp8 codes are widened in the kernel (tuning.launch_config)
        self.item = out_dtype.itemsize if a.dequant else table.element_size()
        self.config = config
        self._by_cols: dict[int, tuple[LaunchConfig, KernelLaunch, int]] = {}  # config, launcher, tiles a row
        self._eager = None  # (the eager C call, its first column, its column count): serve_eager
        #: why a call key's compiled kernel was not handed to the eager C call (by key), for diagnostics
        self.eager_refused: dict = {}

    def _for_cols(self, ncols: int) -> tuple[LaunchConfig, KernelLaunch, int]:
        cfg = self.config or launch_config(ncols * self.item, self.item, 0)
        constants = dict(self.args.constants, BLOCK=cfg.block, ROW_TILES=cfg.row_tiles, num_warps=cfg.num_warps)
        launch = KernelLaunch(self.kernels.gather_rows_kernel, constants, interpret=self.interpret, views=self.views)
        entry = self._by_cols[ncols] = cfg, launch, -(-ncols // cfg.block)
        if self._eager is not None and self._eager[2] == ncols:
            call, col_start, _ = self._eager
            # bound to what it needs, not to this launcher's owner (which holds the launcher: a cycle)
            launch.on_compile = functools.partial(_teach, call, col_start, self.eager_refused, entry[2],
                                                  bool(cfg.row_tiles))
        return entry

    def serve_eager(self, call, col_start: int, ncols: int) -> None:
        """Teach ``call`` (:class:`~uvaple.kernels.eager_call` 's EagerCall) every variant of the calls of
        ``ncols`` columns from ``col_start`` as Triton compiles it (before any call of that column count)."""
        if ncols in self._by_cols:
            raise RuntimeError("serve_eager: calls of this column count were launched already")
        self._eager = (call, col_start, ncols)

    def __call__(self, ids: torch.Tensor, out: torch.Tensor, col_start: int, n: int) -> None:
        # launch_of's launch, written out: one frame less on the eager hot path
        ncols = out.shape[-1]
        cfg, launch, tiles = self._by_cols.get(ncols) or self._for_cols(ncols)
        a = self.args
        if a.host_memory and capture.capturing(ids):
            capture.keep_for_graph(a.source)
        launch((n * tiles,) if cfg.row_tiles else (n, tiles),
               (a.view, ids, out, *a.mid, n, *a.fixed, col_start, ncols, *a.tail),
               (ids.dtype, ids.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, col_start, n <= _I32_MAX), self.index)

    def launch_of(self, ids: torch.Tensor, out: torch.Tensor, col_start: int = 0) -> tuple:
        """(the launcher, the grid, the runtime arguments, the call key, the device) of the call
        ``self(ids, out, col_start, ids.numel())``: what :meth:`__call__` hands its launcher."""
        n, ncols = ids.numel(), out.shape[-1]
        cfg, launch, tiles = self._by_cols.get(ncols) or self._for_cols(ncols)
        a = self.args
        return (launch, (n * tiles,) if cfg.row_tiles else (n, tiles),
                (a.view, ids, out, *a.mid, n, *a.fixed, col_start, ncols, *a.tail),
                (ids.dtype, ids.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, col_start, n <= _I32_MAX), self.index)

    def bare(self, ids: torch.Tensor, out: torch.Tensor, col_start: int = 0):
        """This call (made once first) as a zero-argument launch with everything bound: the floor of its host
        work (:meth:`~uvaple.kernels.launch.KernelLaunch.bare`)."""
        launch, grid, args, key, device = self.launch_of(ids, out, col_start)
        return launch.bare(grid, args, key, device)


def _teach(call, col_start: int, refused: dict, tiles: int, row_tiles: bool, key, kernel, args: tuple) -> None:
    """A direct gather launcher's ``on_compile``: hand a whole-row key's compiled kernel to the eager C call
    ``call`` (:func:`~uvaple.kernels.eager_call.teach`); why one is not kept goes into ``refused`` by key."""
    if key[3] != col_start:
        return
    try:
        why = eager_call.teach(call, kernel, args, key, tiles, row_tiles)
    except Exception as e:  # noqa: BLE001 - a variant not kept is a call the Python path serves
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        refused[key] = why


# ------------------------------------------------------------------ operator
def _gather_rows(table, ids, out, counters, dq_scale, bits, has_scale, col_start, id_base, row_lo, oob_mode, dequant,
                 plan=-1) -> None:
    torch.autograd.graph.increment_version(out)  # `out` was written: autograd must know a saved one changed
    mine = registry.find(plan, table, ids, out)
    if mine is not None:
        if check_call(table, ids, out, col_start, dequant, "gather_rows") and ids.numel():
            mine.direct(ids, out, col_start, ids.numel())
        return
    check_fixed(table, dq_scale, id_base, row_lo, oob_mode, dequant, "gather_rows")
    ncols = check_call(table, ids, out, col_start, dequant, "gather_rows", dq_scale)
    check_reach(table, ids.device, out.dtype, has_scale, oob_mode, dequant, "gather_rows")
    if ids.numel() and ncols:
        DirectGather(table, ids.device, out.dtype, counters=counters, dq_scale=dq_scale, bits=bits, has_scale=has_scale,
                     id_base=id_base, row_lo=row_lo, oob_mode=oob_mode, dequant=dequant)(ids, out, col_start,
                                                                                         ids.numel())


def _gather_rows_fake(table, ids, out, counters, dq_scale, bits, has_scale, col_start, id_base, row_lo, oob_mode,
                      dequant, plan=-1) -> None:
    return None


if not jit.is_interpreted_copy(__name__):  # the interpreted copy of this module holds the kernel's twin only
    _lib = torch.library.Library("uvaple", "FRAGMENT")
    _lib.define("gather_rows(Tensor table, Tensor ids, Tensor(a!) out, Tensor(b!)? counters, Tensor? dq_scale, "
                "int scale_bits, bool has_scale, int col_start, int id_base, int row_lo, int oob_mode, int dequant, "
                "int plan=-1) -> ()")
    _lib.impl("gather_rows", _gather_rows, "CompositeExplicitAutograd")
    torch.library.register_fake("uvaple::gather_rows", _gather_rows_fake, lib=_lib)


# ------------------------------------------------------------------ functional
def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None, *,
                scale: float | None = None, columns=None, oob: str = "zero",
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gather rows ``table[ids, columns]`` (optionally scaled) into ``out`` on the current stream.

    The functional entry point: every check, and a launcher made for the call, on every call. A table
    used more than once is better served by :func:`uvaple.integration.make_lookup`, which checks and plans
    once and then only launches.

    Parameters
    ----------
    table : torch.Tensor
        ``[rows, cols]`` with unit column stride: a CPU tensor over registered host memory
        (``HostTable.tensor``), a CUDA view of it (``HostTable.cuda_view()``) or a CUDA tensor; with CPU
        ids, any CPU tensor (interpreted).
    ids : torch.Tensor
        int32/int64 ids of any shape on the compute device.
    out : torch.Tensor, optional
        ``[*ids.shape, ncols]`` contiguous, written in place. Allocated when omitted.
    scale : float, optional
        Multiply rows by ``scale`` with the model's rounding (bit-identical to
        ``rows * torch.tensor(scale).to(table.dtype)``).
    columns : (start, stop) or slice, optional
        A contiguous column range, e.g. one layer's 256 values of a PLE row.
    oob : {"zero", "row0", "neg_zero"}
        What out-of-range ids produce: a zero row, row 0, or a -0.0 row.
    out_dtype : torch.dtype, optional
        bf16/fp16/fp32 output for float tables (default: the table's dtype).

    Returns
    -------
    torch.Tensor
        ``out``: ``[*ids.shape, ncols]``.
    """
    check_ids(ids)
    check_table(table, ids.device)
    c0, c1 = column_range(columns, table.shape[1])
    dtype = check_policy(table.dtype, scale=scale, oob=oob, out_dtype=out.dtype if out is not None and
                         out_dtype is None else out_dtype)
    want = (*ids.shape, c1 - c0)
    if out is None:
        out = torch.empty(want, dtype=dtype, device=ids.device)
    else:
        check_out(out, want, dtype, ids.device)
    ids_flat = ids if ids.is_contiguous() else ids.contiguous()
    bits = 0 if scale is None else scale_bits(scale, table.dtype)
    torch.ops.uvaple.gather_rows(table, ids_flat, out, None, None, bits, scale is not None, c0, 0, 0, OOB_MODES[oob], 0)
    return out

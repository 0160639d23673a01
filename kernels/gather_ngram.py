"""The n-gram gather: a PLE layer's rows straight from its tokens, the hash and the gather in one launch.

Kernel and launcher (the operator path stays two operators: see below), as in :mod:`uvaple.kernels.gather`.

What it computes. ``out[b, p, j, :]`` is the row the direct gather gives for the id that
:mod:`uvaple.kernels.ngram` hashes for head ``j`` of position ``p`` of sequence ``b`` (the last ``last``
positions of ``history [B, L]``): the same hash steps (``history_position``, ``mix_token``, ``head_row``,
shared with the hash kernel), then the same row prologue (``rows.clamp_row``: an id outside the table or its
window forms no address outside it) and the same conversion (``rows.convert_rows``), so its bits are the two
launches' bits, for every encoding, scale and row policy, and its counters move as theirs do (one lookup, one
row per id, one per id outside the table).

Work split: program ``(i, tile)`` (or the flattened grid of ``ROW_TILES``) writes output row ``i`` of
``B * last * heads``: it loads its position's ``N`` tokens (L1/L2 hits after the first of its ``heads``
programs), mixes as many as its head's order takes, and copies its row's column tile. A hash per program costs
a few integer operations against a row read over PCIe.

Why a kernel. The hash kernel writes ``heads`` ids a position that the gather reads back: two launches, an
int64 round trip through HBM, and, eager, two calls' host work for each PLE layer. Fused, an eager PLE layer is
one launch (:meth:`uvaple.integration.Lookup.lookup_ngrams`). Under ``torch.compile`` a lookup calls the two
operators (``uvaple::ngram_rows``, then the gather's), which a CUDA graph replays for a few microseconds more
than one: the fusion is the eager path's, where each call's host work is what it saves.

A launcher (:class:`NgramGather`) is made once per plan and layer from the plan's direct gather
(:class:`~uvaple.kernels.gather.FixedArgs`: the table's view, the buffers, the policy's constants) and the
layer's checked hash buffers; a hot set, whose map the hashed rows would have to consult too, is served by
the two launches instead.
"""

from __future__ import annotations

import sys

import torch
import triton.language as tl

from . import capture, jit
from . import ngram as _ngram
from . import rows as _rows
from .gather import DirectGather
from .launch import KernelLaunch
from .tuning import LaunchConfig, launch_config

__all__ = ["NgramGather"]

kernel = jit.kernel_decorator(__name__)
_rows = jit.same_variant(__name__, _rows)
_ngram = jit.same_variant(__name__, _ngram)
clamp_row, convert_rows, row_scale_bits = _rows.clamp_row, _rows.convert_rows, _rows.row_scale_bits
program_row, tile_columns, count_call = _rows.program_row, _rows.tile_columns, _rows.count_call
history_position, mix_token, head_row = _ngram.history_position, _ngram.mix_token, _ngram.head_row

_I32_MAX = (1 << 31) - 1


# length, last, n_out and eos change with the batch, the step and the model; scale_bits carries float bits:
# none is specialised, so a new shape never compiles a new variant (perhaps inside a graph capture).
@kernel(do_not_specialize=["length", "last", "n_out", "eos", "scale_bits"])
def gather_ngram_rows_kernel(
    table_ptr,  # *Pointer* to row 0 of the table (host memory through UVA, or HBM)
    hist_ptr,  # *Pointer* to history [B, length] int64, contiguous
    mult_ptr,  # *Pointer* to the N multipliers, int64
    sizes_ptr,  # *Pointer* to the (N - 1) * HPN head sizes, int64, positive
    offsets_ptr,  # *Pointer* to the (N - 1) * HPN head offsets, int64
    out_ptr,  # *Pointer* to the output [B * last * (N - 1) * HPN, n_cols], contiguous
    counters_ptr,  # *Pointer* to int64 [3]: lookups, rows, out-of-range ids (read only when COUNT)
    dq_scale_ptr,  # *Pointer* to the fp32 dequantisation scale [1] (read only when SCALE is 1)
    length,  # L: tokens per sequence in the history
    last,  # positions per sequence: the last `last` of the history
    n_out,  # output rows: B * last * (N - 1) * HPN
    eos,  # the end-of-sequence token
    id_base,  # the id of table row 0
    row_lo,  # valid rows are row_lo <= id - id_base < n_rows
    n_rows,  # one past the last valid row
    table_stride,  # elements between two table rows
    col_start,  # first column of the range to copy
    n_cols,  # columns to copy per row
    scale_bits,  # int32: the bits of the fp32 scale, already rounded to the table dtype (HAS_SCALE)
    scale_col,  # the column (byte) of a row's own float32 scale (SCALE 2)
    N: tl.constexpr,  # the n-gram size (orders 2..N)
    HPN: tl.constexpr,  # heads per n-gram order
    HAS_SCALE: tl.constexpr,
    CONVERT: tl.constexpr,
    OOB_ROW0: tl.constexpr,
    NEG_ZERO: tl.constexpr,
    FP8: tl.constexpr,
    SCALE: tl.constexpr,
    COUNT: tl.constexpr,
    SCALE_WORD: tl.constexpr,
    BLOCK: tl.constexpr,
    ROW_TILES: tl.constexpr,
):
    pid, tile = program_row(n_cols, BLOCK, ROW_TILES)
    # the id: head j of hashed position idx, as the hash kernel makes it
    idx = pid // ((N - 1) * HPN)
    j = pid - idx * ((N - 1) * HPN)
    hist, pos = history_position(hist_ptr, idx, length, last)
    live = pos >= 0  # every program's position is in the history: an unmasked load, as a tensor
    end = eos.to(tl.int64)
    mixed = tl.load(hist + pos) * tl.load(mult_ptr)
    clean = live
    order = j // HPN + 1  # the tokens back this head's n-gram reaches
    for s in tl.static_range(1, N):
        more, still = mix_token(hist, pos, s, mixed, clean, live & (s <= order), end, mult_ptr)
        mixed = tl.where(s <= order, more, mixed)
        clean = still
    row, valid = clamp_row(head_row(mixed, j, sizes_ptr, offsets_ptr), id_base, row_lo, n_rows)
    # the row, as the direct gather copies it
    cols, load_mask = tile_columns(valid, tile, n_cols, BLOCK, OOB_ROW0)
    x = tl.load(table_ptr + row * table_stride + col_start + cols, mask=load_mask, other=0)
    if COUNT:
        count_call(counters_ptr, pid, tile, n_out, valid)
    row_scale = 0.0
    if SCALE == 2:
        row_scale = row_scale_bits(table_ptr + row * table_stride + scale_col, True, SCALE_WORD).to(
            tl.float32, bitcast=True)
    y = convert_rows(x, load_mask, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE, CONVERT,
                     OOB_ROW0, NEG_ZERO, FP8, SCALE)
    tl.store(out_ptr + pid * n_cols + cols, y, mask=cols < n_cols)


# ------------------------------------------------------------------ launcher
# the direct gather's constants that this kernel does not take: it has no hot set
_NOT_HERE = ("HOT", "COUNT_IDS")


class NgramGather:
    """:func:`gather_ngram_rows_kernel` for the table and policy of ``direct`` (a plan's
    :class:`~uvaple.kernels.gather.DirectGather`, with no hot set) and one layer's hash: ``multipliers``,
    ``sizes``, ``offsets`` (int64, on the plan's device) and ``eos``, checked here (:func:`~uvaple.kernels.ngram.
    check_layer`). A config and a :class:`~uvaple.kernels.launch.KernelLaunch` per column count, made at its
    first call.

    A call (:meth:`__call__`) takes ``history [B, L]`` (contiguous int64 on the plan's device), ``out``
    (contiguous, ``B * last * heads`` rows of the plan's dtype and ``ncols`` columns) and the first column, all
    checked by its caller, and launches on the current stream: no check, no allocation, no synchronisation.
    """

    def __init__(self, direct: DirectGather, multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor,
                 eos: int) -> None:
        a = direct.args
        if a.constants["HOT"]:
            raise ValueError("the n-gram gather reads the table alone: a lookup with a hot set hashes, then gathers")
        self.n, self.heads_per_ngram = _ngram.check_layer(multipliers, sizes, offsets, eos)
        self.multipliers, self.sizes, self.offsets, self.eos = multipliers, sizes, offsets, eos
        self.heads = sizes.numel()
        self.direct = direct
        self.interpret = direct.interpret
        self.kernels = jit.variant(sys.modules[__name__], self.interpret)
        self.counters, self.dq_scale = a.mid[0], a.mid[1]
        self.views = () if a.as_int is None else ((5, a.as_int),)
        self._by_cols: dict[int, tuple[LaunchConfig, KernelLaunch]] = {}

    def serves(self, multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor, eos: int) -> bool:
        """Whether this launcher was made for these hash buffers (the same tensors, of the same lengths: values
        changed in place are read at launch) and this ``eos`` (an int: anything else is checked anew)."""
        return multipliers is self.multipliers and sizes is self.sizes and offsets is self.offsets \
            and type(eos) is int and eos == self.eos and multipliers.numel() == self.n \
            and sizes.numel() == self.heads and offsets.numel() == self.heads

    def _for_cols(self, ncols: int) -> tuple[LaunchConfig, KernelLaunch]:
        d = self.direct
        cfg = d.config or launch_config(ncols * d.item, d.item, 0)
        constants = {k: v for k, v in d.args.constants.items() if k not in _NOT_HERE}
        constants.update(N=self.n, HPN=self.heads_per_ngram, BLOCK=cfg.block, ROW_TILES=cfg.row_tiles,
                         num_warps=cfg.num_warps)
        launch = KernelLaunch(self.kernels.gather_ngram_rows_kernel, constants, interpret=self.interpret,
                              views=self.views)
        self._by_cols[ncols] = cfg, launch
        return cfg, launch

    def __call__(self, history: torch.Tensor, out: torch.Tensor, col_start: int, last: int) -> None:
        b, length = history.shape
        n_out = b * last * self.heads
        if n_out == 0:
            return
        ncols = out.shape[-1]
        cfg, launch = self._by_cols.get(ncols) or self._for_cols(ncols)
        a = self.direct.args
        if a.host_memory and capture.capturing(history):
            capture.keep_for_graph(a.source)
        tiles = -(-ncols // cfg.block)
        grid = (n_out * tiles,) if cfg.row_tiles else (n_out, tiles)
        launch(grid, (a.view, history, self.multipliers, self.sizes, self.offsets, out, self.counters, self.dq_scale,
                      length, last, n_out, self.eos, *a.fixed, col_start, ncols, *a.tail),
               (history.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0, col_start, length <= _I32_MAX,
                last <= _I32_MAX, n_out <= _I32_MAX),
               history.get_device())

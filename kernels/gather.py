"""Row gather: ``out[i, :] = table[ids[i], c0:c1] (* scale)`` in the caller's current CUDA stream.

One kernel serves every table placement: a CPU tensor over registered host memory (read over PCIe
through UVA), a CUDA tensor aliasing it, or a CUDA tensor in HBM. On CPU tensors the same source runs
under Triton's interpreter (chosen per launch: :mod:`uvaple.kernels._jit`), which is how CI checks
indexing, masking, rounding and edge cases. This layer takes tensors and ints only; host tables, specs
and placements are :mod:`uvaple.integration`'s.

Work split: program ``(i, j)`` copies column tile ``j`` of row ``ids[i]``. Tile width comes from
:func:`uvaple.kernels.heuristics.launch_config` (bytes per tile and warps, by row bytes).

Out-of-range ids (negative, >= rows, any int64) never form an address outside the table: the id is
replaced by 0 before any pointer arithmetic, then
  * ``oob="zero"``: the row's loads are masked off and the output row is +0.0 (scale or not);
  * ``oob="row0"``: the row reads row 0 (what Gemma 3n's embedding path does for such ids).

Rounding: with ``scale``, the result is bit-identical to HF Gemma 3n's ``emb * scale.to(weight.dtype)``:
the scale is rounded to the table dtype on the host (and passed as its fp32 bits, so -0.0 and subnormals
arrive intact), the product is formed in fp32 and rounded once to the table dtype with
round-to-nearest-even, then converted to the output dtype. NaN results are NaN; their sign and payload
are the device's (torch on the CPU and a GPU disagree there too). bf16 is widened with a shift and
narrowed with integer ops (Triton's interpreter mangles bf16 subnormals and rounds half away from zero;
the GPU's own conversions give the same bits as these), so CPU and GPU agree.

Counters: a launch may add to an int64 ``[3]`` tensor on the device — lookups, rows, out-of-range ids
— with relaxed atomics (one per call, one per out-of-range id), so progress is readable without any
host work on the hot path, under CUDA graphs too.

Hot path: no host synchronisation, no allocation when ``out`` is given, launch on the current stream only,
always through the ``uvaple::gather_rows`` op (eager and compiled give the same bits); capturable in a
CUDA graph and replayable with new ids written into the captured ids buffer.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton

from . import _gather_triton, _jit, capture
from .checks import (
    ID_BASE_LIMIT,
    OOB_MODES,
    OOB_POLICIES,
    OUT_DTYPES,
    check_ids,
    check_out,
    check_policy,
    check_table,
    column_range,
)
from .encodings import ROW_SCALE_BYTES
from .heuristics import (
    NUM_WARPS,
    SORTED_TILE_BYTES,
    TILE_BYTES,
    LaunchConfig,
    SortedConfig,
    launch_config,
    sorted_config,
    sorted_warps,
)

__all__ = ["gather_rows", "launch", "launch_hot", "launch_sorted", "scale_bits", "column_range", "check_ids",
           "check_out", "OOB_POLICIES",
           "OUT_DTYPES"]

#: the largest row key of the sorted gather (row - row_lo + 1, int32); tables with more rows sort the ids as given
ROW_KEY_MAX = (1 << 31) - 1
ROW_KEY_BLOCK = 1024
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def scale_bits(scale: float, dtype: torch.dtype) -> int:
    """The kernel's scale argument: the bits (signed int32) of ``torch.tensor(scale).to(dtype)`` as fp32.

    HF: ``embedding * embed_scale.to(weight.dtype)``: the scale is rounded to fp32, then to the table
    dtype. Cached by the scale's own bits, so -0.0 and +0.0 (equal as floats) are distinct keys.
    """
    return _scale_bits(struct.pack("<d", float(scale)), dtype)


@functools.lru_cache(maxsize=256)
def _scale_bits(key: bytes, dtype: torch.dtype) -> int:
    (value,) = struct.unpack("<d", key)
    rounded = torch.tensor(value, dtype=torch.float32).to(dtype).to(torch.float32)
    return int(rounded.view(torch.int32).item())


def _check_launch(table, ids, out, dq_scale, col_start, id_base, row_lo, oob_mode, dequant, what) -> int:
    """The integer checks every launch makes (the operators are public: even a direct call stays inside
    the table and ``out``); returns the columns per row."""
    n = ids.numel()
    ncols = out.shape[-1] if out.dim() else 0
    if out.numel() != n * ncols or not out.is_contiguous() or not ids.is_contiguous():
        raise ValueError(f"uvaple::{what}: out must be contiguous [*ids.shape, ncols] and ids contiguous "
                         f"(got out {tuple(out.shape)}, ids {tuple(ids.shape)})")
    if table.dim() != 2 or table.stride(1) != 1 or col_start < 0 or col_start + ncols > table.shape[1]:
        raise ValueError(f"uvaple::{what}: columns {col_start}..{col_start + ncols} are not inside the "
                         f"table's {table.shape[-1]} (or the table is not 2-D with unit column stride)")
    if not 0 <= row_lo < table.shape[0] or not 0 <= id_base < ID_BASE_LIMIT or oob_mode not in (0, 1, 2) \
            or dequant not in (0, 1, 2, 3, 4):
        raise ValueError(f"uvaple::{what}: row_lo {row_lo}, id_base {id_base}, oob_mode {oob_mode} or dequant "
                         f"{dequant} is out of range (table of {table.shape[0]} rows, id_base < 2**62)")
    if dequant in (1, 2) and (dq_scale is None or dq_scale.numel() != 1 or dq_scale.dtype != torch.float32
                              or table.element_size() != 1 or dq_scale.device != out.device):
        raise ValueError(f"uvaple::{what}: fp8 dequantisation needs a 1-byte table and a float32 scale of "
                         "one element on the output's device")
    if dequant in (3, 4) and (table.element_size() != 1 or col_start + ncols > table.shape[1] - ROW_SCALE_BYTES):
        raise ValueError(f"uvaple::{what}: fp8 rows with a row scale need a 1-byte table whose last "
                         f"{ROW_SCALE_BYTES} columns are the scale; columns {col_start}..{col_start + ncols} reach "
                         f"into them (table of {table.shape[1]} columns)")
    return ncols


def _scale_col(table: torch.Tensor, dequant: int) -> int:
    """The column of a row's own scale (``dequant`` 3/4), else 0 (unused)."""
    return table.shape[1] - ROW_SCALE_BYTES if dequant >= 3 else 0


def _scale_word(table: torch.Tensor, hot_rows: torch.Tensor | None, dequant: int) -> bool:
    """Whether every row's own scale (``dequant`` 3/4) is a 4-byte aligned word, in the table and the hot set:
    the kernels then read it with one load, not four (1-byte tables: strides and offsets are bytes)."""
    if dequant < 3:
        return False
    col = _scale_col(table, dequant)
    bufs = (table,) if hot_rows is None else (table, hot_rows)
    return all((b.data_ptr() + col) % 4 == 0 and b.stride(0) % 4 == 0 for b in bufs)


def _kernel_views(table, ids, out, has_scale: bool, oob_mode: int, dequant: int):
    """(table, out, convert) as the kernels take them: fp8 codes as bytes, plain copies as integers."""
    convert = has_scale or out.dtype != table.dtype or oob_mode == 2
    if capture.capturing(ids):
        capture.keep_for_graph(table)
    if dequant:
        table = table.view(torch.uint8)  # fp8 codes, widened with integer ops in the kernel
    elif not convert:
        # A plain copy moves bits: give the kernel same-width integers (fp8 and friends need no support).
        as_int = _INT_OF_SIZE[table.element_size()]
        table, out = table.view(as_int), out.view(as_int)
    return table, out, convert


def launch(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, counters: torch.Tensor | None,
           dq_scale: torch.Tensor | None, bits: int, has_scale: bool, col_start: int, id_base: int, row_lo: int,
           oob_mode: int, dequant: int, *, config: LaunchConfig | None = None, hot_rows: torch.Tensor | None = None,
           slot_map: torch.Tensor | None = None, id_counts: torch.Tensor | None = None) -> None:
    """Launch the gather kernel (arguments already checked; ``ids`` contiguous, ``out`` ``[*ids.shape, ncols]``).

    The body of the ``uvaple::gather_rows`` op; call the op, not this (``perf/tune_gather.py`` calls it
    with an explicit ``config`` to sweep tile widths). ``hot_rows``/``slot_map``: :func:`launch_hot`'s.
    """
    n = ids.numel()
    what = "gather_rows" if hot_rows is None else "gather_rows_hot"
    ncols = _check_launch(table, ids, out, dq_scale, col_start, id_base, row_lo, oob_mode, dequant, what)
    if hot_rows is not None:
        _check_hot(table, ids, counters, hot_rows, slot_map, id_counts)
    torch.autograd.graph.increment_version(out)  # `out` was written: autograd must know a saved one changed
    if n == 0 or ncols == 0:
        return
    # fp8 codes widened in the kernel: the tile is sized by what a program writes (heuristics.launch_config)
    item = out.element_size() if dequant else table.element_size()
    cfg = config or launch_config(ncols * item, item, n)
    hot_args = _hot_args(ids, out, hot_rows, slot_map, id_counts, has_scale, oob_mode, dequant)
    table, out, convert = _kernel_views(table, ids, out, has_scale, oob_mode, dequant)
    kernels = _jit.variant(_gather_triton, _jit.running_on_cpu(ids, out))
    _gather_kernel(kernels, cfg, table, ids, out, counters, dq_scale, hot_args, n, ncols, bits, has_scale, convert,
                   col_start, id_base, row_lo, oob_mode, dequant, hot_rows is not None, id_counts is not None,
                   _scale_word(table, hot_rows, dequant))


def _gather_kernel(kernels, cfg: LaunchConfig, table, ids, out, counters, dq_scale, hot_args: tuple, n: int,
                   ncols: int, bits: int, has_scale: bool, convert: bool, col_start: int, id_base: int, row_lo: int,
                   oob_mode: int, dequant: int, hot: bool, count_ids: bool, scale_word: bool) -> None:
    """``gather_rows_kernel``'s launch over ``n`` ids (the tensors already as :func:`_kernel_views` gives them)."""
    tiles = triton.cdiv(ncols, cfg.block)
    grid = (n * tiles,) if cfg.row_tiles else (n, tiles)
    kernels.gather_rows_kernel[grid](
        table, ids, out, ids if counters is None else counters, ids if dq_scale is None else dq_scale, *hot_args,
        n, id_base,
        row_lo, table.shape[0], table.stride(0), col_start, ncols, bits, _scale_col(table, dequant),
        HAS_SCALE=has_scale, CONVERT=convert, OOB_ROW0=oob_mode == 1, NEG_ZERO=oob_mode == 2, DEQUANT=dequant,
        COUNT=counters is not None, HOT=hot, COUNT_IDS=count_ids, SCALE_WORD=scale_word, BLOCK=cfg.block,
        ROW_TILES=cfg.row_tiles, num_warps=cfg.num_warps,
    )


def prepared_launch(table: torch.Tensor, out_dtype: torch.dtype, ncols: int, counters: torch.Tensor | None,
                    dq_scale: torch.Tensor | None, bits: int, has_scale: bool, oob_mode: int, dequant: int):
    """:func:`launch` for one table and policy, its checks and choices made here, once: ``go(ids, out)``
    launches the kernel :func:`launch` would (same arguments, same bits) for ``ids`` and ``out`` with no
    per-call check, dispatch or choice left but the grid. For a caller whose every call's ids and ``out``
    are its own and already checked (a split lookup's staged ids and rows: int64 ids, contiguous, on the
    table's CUDA device; ``out`` contiguous ``[n, ncols]`` of ``out_dtype`` there), never under graph
    capture. Columns from 0, ids not shifted, rows from 0."""
    ids0 = torch.empty(1, dtype=torch.int64, device=table.device)
    out0 = torch.empty(1, ncols, dtype=out_dtype, device=table.device)
    _check_launch(table, ids0, out0, dq_scale, 0, 0, 0, oob_mode, dequant, "gather_rows")
    item = out0.element_size() if dequant else table.element_size()
    cfg = launch_config(ncols * item, item, 0)
    view, out0, convert = _kernel_views(table, ids0, out0, has_scale, oob_mode, dequant)
    as_int = None if out0.dtype == out_dtype else out0.dtype  # a plain copy: out viewed as the table's integers
    scale_word = _scale_word(view, None, dequant)
    kernels = _jit.variant(_gather_triton, _jit.running_on_cpu(table))

    def go(ids: torch.Tensor, out: torch.Tensor) -> None:
        torch.autograd.graph.increment_version(out)
        n = ids.shape[0]
        if n:
            _gather_kernel(kernels, cfg, view, ids, out if as_int is None else out.view(as_int), counters, dq_scale,
                           (ids, ids, 0, ids), n, ncols, bits, has_scale, convert, 0, 0, 0, oob_mode, dequant, False,
                           False, scale_word)

    return go


def _hot_args(ids, out, hot_rows, slot_map, id_counts, has_scale: bool, oob_mode: int, dequant: int) -> tuple:
    """The kernels' hot-set arguments (rows viewed as the table is, map, slots, id counts), or stand-ins
    (never read) without a hot set."""
    if hot_rows is not None:
        hot_rows = _kernel_views(hot_rows, ids, out, has_scale, oob_mode, dequant)[0]  # kept for a graph too
    return (ids if hot_rows is None else hot_rows, ids if slot_map is None else slot_map,
            0 if hot_rows is None else hot_rows.shape[0], ids if id_counts is None else id_counts)


def launch_hot(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, counters: torch.Tensor | None,
               dq_scale: torch.Tensor | None, hot_rows: torch.Tensor, slot_map: torch.Tensor,
               workspace: torch.Tensor | None, id_counts: torch.Tensor | None, bits: int, has_scale: bool,
               col_start: int, id_base: int, row_lo: int, oob_mode: int, dequant: int, dedup: bool) -> None:
    """The body of ``uvaple::gather_rows_hot``: as :func:`launch` (or, with a ``workspace``, as
    :func:`launch_sorted`, repeats read once when ``dedup``), but a row whose ``slot_map`` entry is a slot
    ``0 <= s < len(hot_rows)`` is read from ``hot_rows[s]`` (device memory, the same bytes as the table
    row) and the others from the table; ``counters`` (int64 ``[>= 4]``) also count hits; ``id_counts``
    (int64, one per table row) counts each valid id's lookup, on the device."""
    if workspace is not None:
        launch_sorted(table, ids, out, counters, dq_scale, workspace, bits, has_scale, col_start, id_base, row_lo,
                      oob_mode, dequant, dedup, hot_rows=hot_rows, slot_map=slot_map, id_counts=id_counts)
    else:
        launch(table, ids, out, counters, dq_scale, bits, has_scale, col_start, id_base, row_lo, oob_mode, dequant,
               hot_rows=hot_rows, slot_map=slot_map, id_counts=id_counts)


def _check_hot(table, ids, counters, hot_rows, slot_map, id_counts=None) -> None:
    if hot_rows.dim() != 2 or hot_rows.dtype != table.dtype or hot_rows.shape[1] != table.shape[1] or \
            hot_rows.stride(0) != table.stride(0) or hot_rows.stride(1) != 1 or hot_rows.device != ids.device:
        raise ValueError(f"uvaple::gather_rows_hot: the hot rows must be a {table.dtype} [slots, {table.shape[1]}] "
                         f"tensor with the table's row stride ({table.stride(0)}) on {ids.device}, got "
                         f"{hot_rows.dtype} {tuple(hot_rows.shape)} stride {hot_rows.stride()} on {hot_rows.device}")
    if slot_map is None or slot_map.dtype != torch.int32 or slot_map.dim() != 1 or \
            slot_map.numel() < table.shape[0] or not slot_map.is_contiguous() or slot_map.device != ids.device:
        raise ValueError(f"uvaple::gather_rows_hot: the slot map must be a contiguous int32 [>= {table.shape[0]}] "
                         f"tensor on {ids.device}")
    if id_counts is not None and (id_counts.dtype != torch.int64 or id_counts.dim() != 1 or
                                  id_counts.numel() < table.shape[0] or not id_counts.is_contiguous() or
                                  id_counts.device != ids.device):
        raise ValueError(f"uvaple::gather_rows_hot: id counts must be a contiguous int64 [>= {table.shape[0]}] "
                         f"tensor on {ids.device}")
    if counters is not None and counters.numel() < 4:
        raise ValueError("uvaple::gather_rows_hot: counters must be int64 [>= 4] (lookups, rows, out-of-range "
                         "ids, hits)")


_INTERPRETED_SMS = 132  # the interpreter runs one program at a time: any count gives the same bits


@functools.lru_cache(maxsize=16)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (asked once per device)."""
    if device.type != "cuda":
        return _INTERPRETED_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def sorted_launch_config(table: torch.Tensor, device: torch.device, n: int, ncols: int, row_lo: int,
                         dedup: bool) -> SortedConfig:
    """The sorted gather's program shape for a call of ``n`` ids: :func:`~.heuristics.sorted_config`, and
    for one-row programs of rows within one tile, warps by how sparse the ids lie in the table
    (:func:`~.heuristics.sorted_warps`; measured on such rows). Rows of several tiles keep the default."""
    row_bytes = ncols * table.element_size()
    warps = None
    if not dedup and row_bytes <= SORTED_TILE_BYTES:
        span = (table.shape[0] - row_lo) * table.stride(0) * table.element_size()
        warps = sorted_warps(n, span, _sms(device))
    return sorted_config(row_bytes, table.element_size(), dedup, num_warps=warps)


def launch_sorted(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, counters: torch.Tensor | None,
                  dq_scale: torch.Tensor | None, workspace: torch.Tensor, bits: int, has_scale: bool, col_start: int,
                  id_base: int, row_lo: int, oob_mode: int, dequant: int, dedup: bool, *,
                  config: SortedConfig | None = None, hot_rows: torch.Tensor | None = None,
                  slot_map: torch.Tensor | None = None, id_counts: torch.Tensor | None = None) -> None:
    """The body of ``uvaple::gather_rows_sorted``: sort the ids into ``workspace`` (int64 ``[2, max_rows]``:
    the sort keys and their positions), then gather in sorted order, each row to its own output position,
    repeats de-duplicated when ``dedup``. Same arguments and bits as :func:`launch`.

    The keys are 4-byte row keys (``row_keys_kernel``: one small launch; out-of-range ids all key 0) written
    into the first half of ``workspace[0]`` and sorted into its second half, for any table of fewer than
    ``ROW_KEY_MAX`` rows; a bigger one sorts the ids as given.
    """
    n = ids.numel()
    ncols = _check_launch(table, ids, out, dq_scale, col_start, id_base, row_lo, oob_mode, dequant,
                          "gather_rows_sorted" if hot_rows is None else "gather_rows_hot")
    if hot_rows is not None:
        _check_hot(table, ids, counters, hot_rows, slot_map, id_counts)
    if workspace.dtype != torch.int64 or workspace.dim() != 2 or workspace.shape[0] != 2 or \
            workspace.shape[1] < n or not workspace.is_contiguous() or workspace.device != ids.device:
        raise ValueError(f"uvaple::gather_rows_sorted: the workspace must be a contiguous int64 [2, >= {n}] "
                         f"tensor on {ids.device}, got {workspace.dtype} {tuple(workspace.shape)}")
    torch.autograd.graph.increment_version(out)
    if n == 0 or ncols == 0:
        return
    cfg = config or sorted_launch_config(table, ids.device, n, ncols, row_lo, dedup)
    kernels = _jit.variant(_gather_triton, _jit.running_on_cpu(ids, out))
    order = workspace[1, :n]
    # What is sorted: 4-byte row keys (row_keys_kernel) wherever they can name every row, else the ids as given.
    # torch's sort (cub radix sort on CUDA): its scratch comes from the caching allocator, no cudaMalloc once
    # warm, and a captured graph owns it. The exact order pays: 8,192 buckets of rows (5 MB of a 24 GiB
    # table), their ids in no set order (count / starts / scatter kernels), read 7% slower at 65,536 ids (as
    # fast at 1M), and their kernels cost no less than this sort (52 us at 65,536 ids, 407 against 102 at 1M;
    # perf/results/h200_2026-12-03/run9_ngram_sort_sweep_split, ngram.json "sort_sweep"). int16 keys of
    # 8,192-row buckets (1.3 MB, stable: in call order within a bucket) sorted in 34 us instead of 52 with the
    # gather's time within 1% (run7_sort_sweep_split_cprofile): not worth a second key format.
    use_keys = table.shape[0] - row_lo <= ROW_KEY_MAX
    if use_keys:
        halves = workspace[0].view(torch.int32)  # 2 x max_rows: the keys as computed, then sorted
        unsorted, keys = halves[:n], halves[workspace.shape[1]: workspace.shape[1] + n]
        kernels.row_keys_kernel[(triton.cdiv(n, ROW_KEY_BLOCK),)](ids, unsorted, n, id_base, row_lo, table.shape[0],
                                                                   BLOCK=ROW_KEY_BLOCK, num_warps=4)
        torch.sort(unsorted, stable=False, out=(keys, order))
    else:
        keys = workspace[0].view(ids.dtype)[:n] if ids.dtype != torch.int64 else workspace[0, :n]
        torch.sort(ids.reshape(-1), stable=False, out=(keys, order))
    hot_args = _hot_args(ids, out, hot_rows, slot_map, id_counts, has_scale, oob_mode, dequant)
    table, out, convert = _kernel_views(table, ids, out, has_scale, oob_mode, dequant)
    grid = sorted_kernel(kernels, cfg, table, keys, order, ids, out, counters, dq_scale, hot_args, ncols, bits,
                         has_scale, convert, col_start, id_base, row_lo, oob_mode, dequant, hot=hot_rows is not None,
                         count_ids=id_counts is not None, scale_word=_scale_word(table, hot_rows, dequant),
                         dedup=dedup, use_keys=use_keys)
    if dedup and grid[0] > 1:  # the repeats of runs that cross into a program copy their leader's row
        rows_out = out.view(_INT_OF_SIZE[out.element_size()])  # a copy of bits, whatever the dtype
        # a plain HBM copy: wide tiles, so few programs repeat the leader's search; 32 search steps cover
        # any n below 2**32 (one compiled variant; the steps past the answer load nothing)
        block_c = min(triton.next_power_of_2(ncols), max(1, TILE_BYTES // out.element_size()))
        kernels.dedup_tail_kernel[(grid[0], triton.cdiv(ncols, block_c))](
            keys, order, rows_out, n, ncols, STEPS=32 if n < 1 << 32 else 64, BLOCK_R=cfg.block_rows,
            BLOCK_C=block_c, num_warps=NUM_WARPS)


def sorted_kernel(kernels, cfg: SortedConfig, table, keys, order, ids, out, counters, dq_scale, hot_args: tuple,
                  ncols: int, bits: int, has_scale: bool, convert: bool, col_start: int, id_base: int, row_lo: int,
                  oob_mode: int, dequant: int, *, hot: bool, count_ids: bool, scale_word: bool, dedup: bool,
                  use_keys: bool) -> tuple[int, int]:
    """``gather_sorted_kernel``'s launch over the ``order``-ed ``keys`` (row keys, or ids as given) of the
    call's ``ids`` (tensors as :func:`_kernel_views` gives them); returns its grid. :func:`launch_sorted`'s
    body after the sort; ``perf/ngram.py``'s sort sweep launches it on orders of its own."""
    n = order.shape[0]
    grid = (triton.cdiv(n, cfg.block_rows), triton.cdiv(ncols, cfg.block_cols))
    kernels.gather_sorted_kernel[grid](
        table, keys, order, out, ids if counters is None else counters, ids if dq_scale is None else dq_scale,
        *hot_args, n,
        id_base, row_lo, table.shape[0], table.stride(0), col_start, ncols, bits, _scale_col(table, dequant),
        HAS_SCALE=has_scale, CONVERT=convert, OOB_ROW0=oob_mode == 1, NEG_ZERO=oob_mode == 2, DEQUANT=dequant,
        COUNT=counters is not None, HOT=hot, COUNT_IDS=count_ids, SCALE_WORD=scale_word, DEDUP=dedup, KEYS=use_keys,
        BLOCK_R=cfg.block_rows, BLOCK_C=cfg.block_cols, num_warps=cfg.num_warps,
    )
    return grid


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None, *,
                scale: float | None = None, columns=None, oob: str = "zero",
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gather rows ``table[ids, columns]`` (optionally scaled) into ``out`` on the current stream.

    The functional entry point (every check, every call). A table used more than once is better served
    by :func:`uvaple.integration.make_lookup`, which checks its policy once.

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
    oob : {"zero", "row0"}
        What out-of-range ids produce: a zero row, or row 0.
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

"""The measured launch tables of the gathers, each with the run it comes from: the tile of the direct gather
(one shared heuristic, like Liger's ``calculate_settings``), the sorted gather's program shape and warps,
and when a lookup sorts (and de-duplicates) a call. (The split lookup's plan lives with the split:
:mod:`uvaple.integration.placements.split`.)

A program copies one tile of one row. The tile is ``TILE_BYTES`` wide (or the whole row when shorter),
so a 17,920-byte Gemma 3n E4B row is 5 programs and a 128 KiB n-gram row is 32: small batches still put
several independent PCIe reads in flight per row, large batches have plenty of programs either way.

Measured on the H200 with CUDA-graph replays (perf/results/h200_2026-11-29/gather_tiles_graph.log):
2, 4 and 8 KiB tiles and whole-row tiles, 4 or 8 warps, all reach 0.93x the pinned-memcpy ceiling at
>= 1024 rows of 15,360 and 17,920 bytes; at one 128 KiB row a whole-row tile with 4 warps takes 68.5 us
where 4 KiB tiles take 5.6 us (the memcpy of those bytes: 5.8 us). Loads that bypass L1 (``.cg``) and a
TMA tensor-descriptor gather were no better (TMA: 0.31x at 16,384 rows of 17,920 bytes).

fp8 rows widened in the kernel take the tile by the bytes a program *writes* (``launch`` passes the output's
row bytes): 2,048 B of codes per program, 4,096 B of bf16 out. Measured on E4B fp8 rows (8,960 B of codes
and a 4-byte scale, perf/results/h200_2026-12-01/hotset/decode_batches/hotset.json, ``fp8_t*`` providers,
same run): 2,048 B of codes with 4 warps took 1,322 us at 8,192 rows and 2,532 us at 16,384 where 4,096 B
(the tile by codes) took 1,379 and 2,687, 4,096 B with 8 warps 1,353 / 2,641, and 8 or 16 KiB 1,392-1,414
/ 2,751-2,785; at 1 and 8 rows 2 KiB was also the fastest, at 64 all were within 2%. Only bf16 output
was measured: fp32 output (1,024 codes a program) and the warps of rows under 2 KiB follow the same rule
unmeasured.

Launch order: every row's tile 0, then every row's tile 1, ... (a 2-D grid, the tile on axis 1). Launching the
tiles of a row side by side instead (``LaunchConfig.row_tiles``, a 1-D grid) was slower in the same run
(perf/results/h200_2026-12-02/run8_hotset_tunecopy_ngram/hotset/hotset.json): E4B bf16 rows 0.90-0.93x at
8,192-16,384 ids, fp8 rows 1.72-1.76x the bf16 lookup where the 2-D grid gave 1.88-1.89x.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

# Bytes one program copies (perf/results/h200_2026-11-29/gather_tiles_graph.log).
TILE_BYTES = 4096
# 16-byte loads: 128 threads x 16 B = 2 KiB per load wave, two waves per 4 KiB tile.
NUM_WARPS = 4


@dataclass(frozen=True)
class LaunchConfig:
    block: int  # elements per program
    num_warps: int
    # the tiles of one row launched side by side (a 1-D grid, program i*tiles+j: tile j of row i) rather
    # than every row's tile 0 first (a 2-D grid, tile = axis 1)
    row_tiles: bool = False


@functools.lru_cache(maxsize=256)
def _config(row_bytes: int, itemsize: int, tile_bytes: int, num_warps: int) -> LaunchConfig:
    tile = min(triton.next_power_of_2(row_bytes), tile_bytes)
    block = max(1, tile // itemsize)
    # Tiny tiles need few threads: keep at least one 16-byte vector per thread where possible.
    warps = max(1, min(num_warps, tile // (32 * 16)))
    return LaunchConfig(block, warps)


def launch_config(row_bytes: int, itemsize: int, n_rows: int, *, tile_bytes: int | None = None,
                  num_warps: int | None = None) -> LaunchConfig:
    """Tile width (elements) and warps for gathering ``n_rows`` rows of ``row_bytes`` bytes."""
    del n_rows  # the measured best does not depend on the row count (see module docstring)
    return _config(row_bytes, itemsize, tile_bytes or TILE_BYTES, num_warps or NUM_WARPS)


# The sorted gather's program shape, from the committed shape sweep (perf/results/h200_2026-12-01/ngram/
# ngram.json "shape_sweep": 160-B rows, 24 GiB, sorted random ids): one row per program with 4 warps took
# 1,209 us at 65,536 ids where 4 rows took 1,728 and 16 rows 1,781 (1M ids: 8.66 ms for 1 and 4 rows,
# 11.2-12.5 for 64). So without de-duplication a program takes one row. De-duplication needs several
# rows per program (repeats are found within a program): then SORTED_PROGRAM_BYTES per program (16 rows
# of a 160-byte row's 256-byte tile), at least SORTED_MIN_ROWS.
# The warps of a one-row program decide how many rows an SM has in flight (64 warps an SM, at most 32
# programs), so how wide a stretch of the sorted order is read at once: the ids' mean gap in the table
# times the rows in flight. The sorted call's time fits a cost per distinct 64-KiB page of host memory it
# touches (~21 ns) plus ~1 ns a row (65,536 and 1M ids; 7% under the time at 262,144), as if each page
# needed a translation that reads in flight together can share, as long as their stretch stays within
# SORTED_WINDOW_BYTES. So a call takes the fewest warps (the most rows in flight, which dense calls need)
# whose stretch fits (sorted_warps), where its rows fit one tile (measured there; gather.
# sorted_launch_config). The lookup's own call, cold random rows over 24 GiB, two runs (perf/results/
# h200_2026-12-03/run1_shape_sweep_cold, run2_tests_ngram_shape_split; 4 / 8 / 16 / 32
# warps, us): 16,384 ids 441 / 409 / 371 / 335 (run 2; 1-2 warps 494); 65,536 ids 1,382 / 1,311 / 1,312 /
# 1,323 and 1,413 / 1,355 / 1,356 / 1,363 (1-2 warps 1,684-1,722); 262,144 ids within 0.4% from 1 to 32
# warps; 1M ids 8,590 / 8,602 / 8,703 / 12,830 and 8,919 / 8,928 / 8,987 / 12,750 (1-2 warps as 4).
SORTED_PROGRAM_BYTES = 4096
SORTED_TILE_BYTES = 1024
SORTED_MIN_ROWS = 4
SORTED_MAX_ROWS = 64
SORTED_NUM_WARPS = 4  # programs of several rows (de-duplication), and one-row programs of dense calls
SORTED_ONE_ROW_WARPS = (4, 8, 16, 32)  # the choices for one-row programs, most rows in flight first
SORTED_WINDOW_BYTES = 448 << 20  # the widest stretch of table that the rows in flight may span
SM_BLOCKS = 32  # resident programs an SM can hold (Hopper), whatever their warps
SM_WARPS = 64


def sorted_warps(n: int, span_bytes: int, sms: int) -> int:
    """Warps of the sorted gather's one-row programs for a call of ``n`` ids over ``span_bytes`` of table
    on a GPU of ``sms`` SMs: the fewest whose rows in flight span at most ``SORTED_WINDOW_BYTES``."""
    gap = span_bytes / max(1, n)
    for w in SORTED_ONE_ROW_WARPS:
        if sms * min(SM_BLOCKS, SM_WARPS // w) * gap <= SORTED_WINDOW_BYTES:
            return w
    return SORTED_ONE_ROW_WARPS[-1]


@dataclass(frozen=True)
class SortedConfig:
    block_rows: int  # sorted ids per program
    block_cols: int  # elements per program per row
    num_warps: int


@functools.lru_cache(maxsize=256)
def sorted_config(row_bytes: int, itemsize: int, dedup: bool = True, program_bytes: int | None = None,
                  tile_bytes: int | None = None, num_warps: int | None = None) -> SortedConfig:
    """Rows per program, tile width (elements) and warps of the sorted gather for ``row_bytes`` rows."""
    tile = min(triton.next_power_of_2(row_bytes), tile_bytes or SORTED_TILE_BYTES)
    if dedup:
        rows = (program_bytes or SORTED_PROGRAM_BYTES) // tile
        rows = triton.next_power_of_2(max(SORTED_MIN_ROWS, min(SORTED_MAX_ROWS, rows)))
    else:
        rows = 1
    return SortedConfig(rows, max(1, tile // itemsize), num_warps or SORTED_NUM_WARPS)


# When the sorted gather is used (GatherLookup(order="auto")): from the committed sweep of the default
# shape (perf/results/h200_2026-12-01/ngram/sweep_default_shape/ngram.json, "sweep": direct vs sorted by
# row bytes, span and n; 24 GiB table). The sort costs ~30 us at 1,024 ids, and the order pays only where
# the direct read is slow (a big span) and the ids are dense enough in it for neighbours to share pages.
# 160-B rows: 1.32x at 16,384 ids over 4 GiB, 1.57x at 65,536 and 1.82x at 262,144 over 24 GiB, but
# 0.81x at 16,384 over 1 GiB (1.75x at 65,536), 1.05x at 16,384 over 24 GiB, and a loss everywhere over
# 0.25 GiB; 32-B rows alike; 512-B rows gain from 4 GiB up only; 2 KiB and 17,920-B rows never gain.
# That sweep ran the one-row programs with 4 warps. With their warps by the ids' gap (sorted_warps) the
# sparse calls gain too: 16,384 ids over 24 GiB, 160-B rows, 332 us sorted against 470 direct (random
# ids; 313 against 387 for n-gram ids) and 109 against 112 at 4,096 (n-gram ids 96 against 92), the
# lookup's own calls on cold rows (perf/results/h200_2026-12-03/run3_tests_ngram_window_warps_blocks;
# run 2's shape sweep: 335 against 473). So rows up to SORT_SPARSE_MAX_ROW_BYTES no longer need the
# density; wider rows (512 B, not measured with the new warps) still do.
SORT_MIN_IDS = 16384  # below this the sort costs more than the order saves, at any span
SORT_MIN_IDS_PER_GIB = 2730  # ... and rows wider than SORT_SPARSE_MAX_ROW_BYTES need ids this dense in the span
SORT_SPARSE_MAX_ROW_BYTES = 256
SORT_MIN_IDS_SMALL_SPAN = 65536  # ... and this many where the span is below 4 GiB (the direct read is fast)
SORT_MAX_ROW_BYTES = 512
SORT_MIN_SPAN_BYTES = {256: 1 << 30, 512: 4 << 30}  # rows up to K bytes: the smallest span that gains


# With de-duplication (the caller says its ids repeat: token ids) a call is also sorted from this many ids,
# whatever its rows: each distinct id then crosses PCIe once. E4B rows (17,920 B) of a 262,144-row table,
# prefill chunks of real text, two runs (perf/results/h200_2026-12-02/run8_hotset_tunecopy_ngram and
# run9_tests_memcheck_hotset_ngram, hotset/hotset.json): without a hot set "dedup" over "uncached" was
# 2.7-2.8x at 2,048 ids, 3.4-3.6x at 4,096 and 3.8-4.1x at 8,192, while decode batches of 64 mostly distinct
# ids lost (0.73-0.80x); nothing was measured between 64 and 2,048, so the bound is the smallest measured win.
# With a hot set only the repeats of misses are saved: bf16 rows, "hot_dedup" over "hot", tied at 2,048
# (92 vs 94 us; 105 vs 94) and won from 4,096 (138 vs 187 us; 158 vs 192); fp8 rows dequantised in the kernel,
# "all" over "hot_fp8", lost up to 8,192 (226 vs 210 us; 276 vs 240) and tied or won at 16,384 (398 vs 417;
# 461 vs 461). fp8 rows without a hot set were not measured apart: they take the first bound.
DEDUP_MIN_IDS = 2048
DEDUP_MIN_IDS_HOT = 4096
DEDUP_MIN_IDS_HOT_DEQUANT = 16384


def dedup_min_ids(hot: bool = False, dequant: bool = False) -> int:
    """The fewest ids per call that ``order="auto"`` sorts and de-duplicates, for a lookup with or without a
    hot set and with or without fp8 rows dequantised in the kernel."""
    if not hot:
        return DEDUP_MIN_IDS
    return DEDUP_MIN_IDS_HOT_DEQUANT if dequant else DEDUP_MIN_IDS_HOT


def use_sorted(n: int, row_bytes: int, span_bytes: int, dedup: bool = False, hot: bool = False,
               dequant: bool = False) -> bool:
    """Whether a call of ``n`` ids of ``row_bytes``-byte rows over ``span_bytes`` of table is sorted first
    (``dedup``: the lookup de-duplicates sorted calls; ``hot``: it reads hits from a hot set; ``dequant``: its
    rows are fp8 codes dequantised in the kernel)."""
    if dedup and n >= dedup_min_ids(hot, dequant):
        return True
    if row_bytes > SORT_MAX_ROW_BYTES or n < SORT_MIN_IDS:
        return False
    min_span = next(v for k, v in sorted(SORT_MIN_SPAN_BYTES.items()) if row_bytes <= k)
    if span_bytes < min_span:
        return False
    if row_bytes > SORT_SPARSE_MAX_ROW_BYTES and n < SORT_MIN_IDS_PER_GIB * span_bytes / (1 << 30):
        return False
    return span_bytes >= 4 << 30 or n >= SORT_MIN_IDS_SMALL_SPAN

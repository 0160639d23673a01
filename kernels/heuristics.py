"""Launch settings for the gather, chosen by row bytes (one shared heuristic, like Liger's
``calculate_settings``).

A program copies one tile of one row. The tile is ``TILE_BYTES`` wide (or the whole row when shorter),
so a 17,920-byte Gemma 3n E4B row is 5 programs and a 128 KiB n-gram row is 32: small batches still put
several independent PCIe reads in flight per row, large batches have plenty of programs either way.

Measured on the H200 with CUDA-graph replays (perf/results/h200_2026-11-29/gather_tiles_graph.log):
2, 4 and 8 KiB tiles and whole-row tiles, 4 or 8 warps, all reach 0.93x the pinned-memcpy ceiling at
>= 1024 rows of 15,360 and 17,920 bytes; at one 128 KiB row a whole-row tile with 4 warps takes 68.5 us
where 4 KiB tiles take 5.6 us (the memcpy of those bytes: 5.8 us). Loads that bypass L1 (``.cg``) and a
TMA tensor-descriptor gather were no better (TMA: 0.31x at 16,384 rows of 17,920 bytes).
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

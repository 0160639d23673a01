"""Benchmark configuration: presets, row sizes, providers and the constants the sweep uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GIB = 1 << 30
MIB = 1 << 20

# Row sizes of the PLE tables we serve: Gemma 3n E2B = 30 layers × 256 bf16, E4B = 35 × 256 bf16,
# and an n-gram PLE row (tables reach ~95 GB with rows of 100–200 KB; 128 KiB is their middle).
ROW_BYTES = {"e2b": 30 * 256 * 2, "e4b": 35 * 256 * 2, "ngram": 128 * 1024}
ROW_COUNTS = (1, 8, 64, 256, 1024, 4096, 16384)
PROVIDERS = (
    "uva",
    "device",
    "copy",
    "copy-pipelined",
    "torch-embedding-uva",
    "peer-row-triton",
    "memcpy-ceiling",
)
# Providers whose lookups are also timed as CUDA-graph replays (GPU time without host launch cost), at
# every row count. The copy path is not capturable (a CPU gather happens at call time), nor is its
# pipelined form. Graph GB/s against the graph-timed memcpy ceiling is the throughput ratio.
GRAPH_PROVIDERS = frozenset({"uva", "device", "peer-row-triton", "torch-embedding-uva", "memcpy-ceiling"})
# Bytes one graph replay moves at most: a replay of 16 small lookups, or of 2 huge ones.
GRAPH_REPLAY_BYTES = 512 * MIB
CEILING = "memcpy-ceiling"
REFERENCE = "uva"

# Rotate among enough id sets that the bytes touched between two uses of a set exceed the L2 several
# times over (H200: 60 MB L2, KINDS.md), so repeated timings never read rows out of L2.
ROTATION_BYTES = 256 * MIB
# Bytes generated per GPU randn call when filling a table with random rows (fill runs at PCIe speed).
FILL_CHUNK_BYTES = 256 * MIB
# Ids compared against a CPU index_select of the table per point (uva's own check; the rest compare to uva).
CPU_CHECK_IDS = 256
# Pinned staging the copy backend may take (torch rounds each pinned block up to a power of two: 6 GiB of
# slots pins 8 GiB), so 64-GiB tables, their staging and the ceiling buffers fit a 128-GiB host together.
COPY_STAGING_BYTES = 6 * GIB
# Longest a safetensors file may take to write before readiness gives up on that size (slow disks).
ST_WRITE_LIMIT_S = 60.0


# ----------------------------------------------------------------------------------------------- config
@dataclass
class BenchConfig:
    """One benchmark run. Sizes: ``row_bytes`` in bytes, ``table_gib`` / ``readiness_gib`` in GiB."""

    preset: str = "quick"
    row_bytes: tuple[int, ...] = (ROW_BYTES["e4b"],)
    rows: tuple[int, ...] = ROW_COUNTS
    providers: tuple[str, ...] = PROVIDERS
    table_gib: tuple[float, ...] = (1.0, 8.0)
    readiness_gib: tuple[float, ...] = (1.0, 8.0)
    safetensors_max_gib: float = 8.0  # largest safetensors readiness file (disk/page cache permitting)
    dtype: torch.dtype = torch.bfloat16
    point_time_s: float = 0.05  # timed work per (provider, point), split into reps
    min_reps: int = 5
    max_reps: int = 200
    warmup: int = 3
    graphs: bool = True
    graph_calls: int = 16  # lookups captured per graph
    graph_replays: int = 20
    copy_in_flight: int = 4  # jobs in flight for copy-pipelined
    seed: int = 0
    cuda: bool = True
    host_mem_gib: float | None = None  # trust this much host memory (ballooned VMs report less at start)
    tmp_dir: str | None = None
    time_budget_s: float | None = None  # stop starting new tables/readiness sizes after this (None: no limit)
    out: str | None = None
    plots: bool = True
    verbose: bool = True


PRESETS = ("quick", "full", "cpu")


def make_config(preset: str | None = None, *, cuda: bool | None = None, **overrides: Any) -> BenchConfig:
    """The named preset (``quick``/``full``; ``cpu`` whenever CUDA is absent), then ``overrides``.

    quick: E4B rows, 1 + 8 GiB tables, all row counts, all providers, readiness at 1 and 8 GiB.
    full: E2B, E4B and 128-KiB rows × 1, 8, 32, 64 GiB tables; readiness up to 64 GiB.
    cpu: interpreter-sized: 1–64 rows, 4 MiB tables, readiness at 16 and 64 MiB, few repeats.
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    preset = preset or "quick"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if not cuda:
        preset = "cpu"
    if preset == "quick":
        cfg = BenchConfig(preset="quick", cuda=True, time_budget_s=110.0)
    elif preset == "full":
        cfg = BenchConfig(
            preset="full", cuda=True,
            row_bytes=(ROW_BYTES["e2b"], ROW_BYTES["e4b"], ROW_BYTES["ngram"]),
            table_gib=(1.0, 8.0, 32.0, 64.0),
            readiness_gib=(1.0, 8.0, 32.0, 64.0),
            safetensors_max_gib=32.0,
            point_time_s=0.04,
            time_budget_s=420.0,  # perf/gpu_check.sh gives `uvaple bench --full` 480 s
        )
    else:
        cfg = BenchConfig(
            preset="cpu", cuda=False,
            row_bytes=(ROW_BYTES["e4b"], ROW_BYTES["ngram"]),
            rows=(1, 8, 64),
            table_gib=(4 / 1024,),
            readiness_gib=(16 / 1024, 64 / 1024),
            safetensors_max_gib=64 / 1024,
            point_time_s=0.0, min_reps=2, max_reps=2, warmup=1,
            graphs=False, graph_calls=2, graph_replays=2, copy_in_flight=2,
        )
    for key, value in overrides.items():
        if value is None:
            continue
        if not hasattr(cfg, key):
            raise TypeError(f"unknown BenchConfig field {key!r}")
        setattr(cfg, key, value)
    unknown = [p for p in cfg.providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown providers {unknown}; choose from {', '.join(PROVIDERS)}")
    return cfg


def row_label(row_bytes: int) -> str:
    """``E2B``/``E4B``/``ngram`` for the known row sizes, else ``<bytes>B``."""
    for name, nbytes in ROW_BYTES.items():
        if nbytes == row_bytes:
            return name.upper() if name != "ngram" else "ngram128K"
    return f"{row_bytes}B"


def fmt_gib(gib: float) -> str:
    if gib >= 1:
        return f"{gib:g}GiB"
    return f"{gib * 1024:g}MiB"

def error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:500]

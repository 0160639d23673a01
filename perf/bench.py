"""``uvaple bench``: gather latency and bandwidth of every PLE provider, and table readiness, in one run.

What one run measures (all ratios come from the same run, never a lone time — DESIGN.md):

* **gather** points: for each row size (Gemma 3n E2B 15,360 B, E4B 17,920 B, n-gram PLE 128 KiB), each
  table size (random rows over the whole table) and each row count ``n``, every provider:
  ``uva`` (the project's Triton gather over the pinned, mapped table), ``device`` (same kernel, table in
  HBM), ``copy`` (CPU gather + H2D on the copy backend's thread), ``copy-pipelined`` (the copy backend
  with several jobs in flight: its best throughput), ``torch-embedding-uva`` (``F.embedding`` over the
  CUDA view), ``peer-row-triton`` (one program per row, whole-row tile: the shape of vLLM's kernel) and
  ``memcpy-ceiling`` (a contiguous pinned H2D copy of the same bytes). Per point: median and p20/p80 in
  µs, GB/s (``n × row_bytes`` over the median), × ceiling, × uva, host CPU seconds per lookup, GPU
  memory the provider holds; for ``n <= 64`` also CUDA-graph replays (launch overhead removed).
* **readiness**: seconds and GiB/s to make a table usable: ``HostTable.empty`` (create, prefault,
  register) vs ``torch.empty(pin_memory=True)``; ``HostTable.from_safetensors`` (file in page cache) vs
  ``torch.empty(pin_memory=True)`` + ``copy_`` from the mmapped file.

Timing method (``.library/device/METHOD.md``): each eager call is bracketed by CUDA events from an idle
stream (so a call's own CPU cost — Python, launch, the copy path's CPU gather — is inside its time);
the host waits on a blocking-sync event between calls, so ``time.process_time`` over the loop counts the
provider's CPU work (all threads), not a spin-wait. Id sets rotate so that no row is re-read from L2.
Graph timings replay ``GRAPH_CALLS`` captured calls per replay over fresh random ids.

Before timing, every provider's output for the same ids is compared bit-exactly with ``uva``'s (and
``uva``'s with a CPU ``index_select`` of the table): a mismatch is reported loudly and makes the exit
code 1. A provider that fails reports its error in its row and the run goes on (exit code 2 at the end).

Without CUDA the same code runs tiny sizes under the Triton interpreter (chosen for CPU tensors) on CPU
tensors: a correctness run whose times are interpreter times, not GPU figures (the banner says so).
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import csv
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BenchConfig",
    "PRESETS",
    "PROVIDERS",
    "ROW_BYTES",
    "ROW_COUNTS",
    "collect_meta",
    "format_readiness_table",
    "format_table",
    "main",
    "make_config",
    "parse_args",
    "run_bench",
    "write_results",
]

GIB = 1 << 30
MIB = 1 << 20

# Row sizes of the PLE tables we serve (DESIGN.md): Gemma 3n E2B = 30 layers × 256 bf16, E4B = 35 × 256 bf16,
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
_GRAPH_REPLAY_BYTES = 512 * MIB
CEILING = "memcpy-ceiling"
REFERENCE = "uva"

# Rotate among enough id sets that the bytes touched between two uses of a set exceed the L2 several
# times over (H200: 60 MB L2, KINDS.md), so repeated timings never read rows out of L2.
_ROTATION_BYTES = 256 * MIB
# Bytes generated per GPU randn call when filling a table with random rows (fill runs at PCIe speed).
_FILL_CHUNK_BYTES = 256 * MIB
# Ids compared against a CPU index_select of the table per point (uva's own check; the rest compare to uva).
_CPU_CHECK_IDS = 256
# Pinned staging the copy backend may take (torch rounds each pinned block up to a power of two: 6 GiB of
# slots pins 8 GiB), so 64-GiB tables, their staging and the ceiling buffers fit a 128-GiB host together.
_COPY_STAGING_BYTES = 6 * GIB
# Longest a safetensors file may take to write before readiness gives up on that size (slow disks).
_ST_WRITE_LIMIT_S = 60.0


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


def _fmt_gib(gib: float) -> str:
    if gib >= 1:
        return f"{gib:g}GiB"
    return f"{gib * 1024:g}MiB"


# --------------------------------------------------------------------------------------------- metadata
def _run(cmd: Sequence[str], cwd: str | None = None, timeout: float = 10.0) -> str | None:
    try:
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _gpu_info_nvml(index: int) -> dict[str, Any] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVML missing or unusable: fall back to nvidia-smi
        return None
    try:
        handle = None
        try:  # match torch's device by PCI bus id (CUDA_VISIBLE_DEVICES may reorder)
            bus = torch.cuda.get_device_properties(index).pci_bus_id  # type: ignore[attr-defined]
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:  # noqa: BLE001
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)

        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        info: dict[str, Any] = {
            "gpu_name": text(pynvml.nvmlDeviceGetName(handle)),
            "driver": text(pynvml.nvmlSystemGetDriverVersion()),
        }
        try:
            cur = (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
                   pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
            top = (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
                   pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
            info["pcie_link"] = f"Gen{cur[0]} x{cur[1]} (max Gen{top[0]} x{top[1]})"
        except Exception:  # noqa: BLE001
            info["pcie_link"] = "unknown"
        return info
    except Exception:  # noqa: BLE001
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _gpu_info_smi(index: int) -> dict[str, Any] | None:
    out = _run(["nvidia-smi", "-i", str(index), "--format=csv,noheader",
                "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,"
                "pcie.link.gen.max,pcie.link.width.max"])
    if not out:
        return None
    parts = [p.strip() for p in out.splitlines()[0].split(",")]
    if len(parts) < 6:
        return None
    return {"gpu_name": parts[0], "driver": parts[1],
            "pcie_link": f"Gen{parts[2]} x{parts[3]} (max Gen{parts[4]} x{parts[5]})"}


def _git_commit() -> tuple[str, bool | None]:
    here = str(Path(__file__).resolve().parent)
    commit = _run(["git", "rev-parse", "HEAD"], cwd=here)
    if not commit:
        return "unknown", None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here)
    return commit, bool(dirty) if dirty is not None else None


def _host_mem_total() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _host_mem_available() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001
        return _host_mem_total()


def collect_meta(cfg: BenchConfig) -> dict[str, Any]:
    """Machine and software facts every result row carries."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = "unavailable"
    commit, dirty = _git_commit()
    meta: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": socket.gethostname(),
        "mode": "gpu" if cfg.cuda else "cpu-interpreter",
        "preset": cfg.preset,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_runtime": torch.version.cuda or "none",
        "git_commit": commit,
        "git_dirty": dirty,
        "cpu_count": os.cpu_count(),
        "host_mem_gib": round(_host_mem_total() / GIB, 1),
        "gpu_name": "none (CPU, Triton interpreter)",
        "driver": "none",
        "pcie_link": "none",
    }
    if cfg.cuda:
        index = torch.cuda.current_device()
        info = _gpu_info_nvml(index) or _gpu_info_smi(index)
        if info is None:
            info = {"gpu_name": torch.cuda.get_device_name(index), "driver": "unknown", "pcie_link": "unknown"}
        meta.update(info)
    return meta


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """A plain progress line on stderr: a redrawn line on a terminal, a line every ``every_s`` otherwise."""

    def __init__(self, total: int, *, stream=None, every_s: float = 15.0, enabled: bool = True):
        self.total = max(1, total)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self._last = -math.inf
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, what: str, *, force: bool = False) -> None:
        self.done = min(self.total, self.done + 1)
        self._show(what, force)

    def note(self, what: str) -> None:
        self._show(what, True)

    def _show(self, what: str, force: bool) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not self._tty and not force and now - self._last < self.every_s:
            return
        self._last = now
        elapsed = now - self.t0
        frac = self.done / self.total
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        width = 20
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (f"[{bar}] {self.done}/{self.total} {frac:4.0%} {_hms(elapsed)} elapsed"
                f"{'' if math.isnan(eta) else ' ~' + _hms(eta) + ' left'}  {what}")
        if self._tty:
            self.stream.write("\r\x1b[2K" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def _hms(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


# ------------------------------------------------------------------------------------------------ timing
def _quantiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p20, median, p80) of ``values``."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=10, method="inclusive")  # deciles: q[1] = p20, q[7] = p80
    return q[1], statistics.median(xs), q[7]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _drain(cuda: bool) -> None:
    """Wait for the current stream without spinning (a blocking-sync event), so CPU time stays honest."""
    if cuda:
        ev = torch.cuda.Event(blocking=True)
        ev.record()
        ev.synchronize()


def _time_eager(call: Callable[[int], Any], n_sets: int, reps: int, cuda: bool) -> dict[str, float]:
    """Time ``call(i)`` (id set ``i % n_sets``) from an idle stream, ``reps`` times.

    Returns µs quantiles (device events around each call; on CPU, ``perf_counter``), host CPU seconds
    per call (``time.process_time``: every thread of the process) and wall µs per call.
    """
    times: list[float] = []
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        # blocking=True: the host sleeps in synchronize() instead of spinning, so process_time counts work.
        ends = [torch.cuda.Event(enable_timing=True, blocking=True) for _ in range(reps)]
        torch.cuda.synchronize()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for r in range(reps):
            starts[r].record()
            call(r % n_sets)
            ends[r].record()
            ends[r].synchronize()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
    else:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for r in range(reps):
            t0 = time.perf_counter()
            call(r % n_sets)
            times.append((time.perf_counter() - t0) * 1e6)
        cpu1, wall1 = time.process_time(), time.perf_counter()
    p20, med, p80 = _quantiles(times)
    return {"us_p20": p20, "us_median": med, "us_p80": p80,
            "cpu_s_per_lookup": (cpu1 - cpu0) / reps, "wall_us_per_lookup": (wall1 - wall0) / reps * 1e6}


def _time_graph(call_on: Callable[[torch.Tensor, torch.Tensor], Any], out: torch.Tensor, rows: int,
                n: int, device: torch.device, cfg: BenchConfig) -> dict[str, float]:
    """Per-lookup µs of ``call_on(ids, out)`` replayed from a CUDA graph of ``cfg.graph_calls`` lookups.

    Fresh random ids are written into the captured id buffers before every replay (outside the timed
    region), so replays read new rows, not L2-resident ones.
    """
    calls = max(2, min(cfg.graph_calls, _GRAPH_REPLAY_BYTES // max(1, out.numel() * out.element_size())))
    replays = cfg.graph_replays if calls >= cfg.graph_calls else max(5, cfg.graph_replays // 2)
    gids = torch.randint(0, rows, (calls, n), device=device, dtype=torch.int64)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graphs asks
        for j in range(3):
            call_on(gids[j % calls], out)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(calls):
            call_on(gids[j], out)
    graph.replay()  # first replay uploads the graph
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for r in range(replays):
        gids.random_(0, rows)
        starts[r].record()
        graph.replay()
        ends[r].record()
    torch.cuda.synchronize(device)
    per_call = [s.elapsed_time(e) * 1e3 / calls for s, e in zip(starts, ends, strict=True)]
    del graph
    p20, med, p80 = _quantiles(per_call)
    return {"graph_us_p20": p20, "graph_us_median": med, "graph_us_p80": p80}


def _reps_for(cfg: BenchConfig, est_us: float) -> int:
    if cfg.point_time_s <= 0 or not math.isfinite(est_us) or est_us <= 0:
        return cfg.min_reps
    return int(min(cfg.max_reps, max(cfg.min_reps, cfg.point_time_s * 1e6 / est_us)))


# --------------------------------------------------------------------------------------------- providers
def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _poison(t: torch.Tensor) -> None:
    t.view(-1).view(torch.uint8).fill_(0xA5)  # NaN-ish bf16 0xA5A5: never a value a gather writes by luck


def _compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, int]:
    """(bit-identical, rows that differ)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False, int(ref.shape[0]) if ref.dim() else 1
    a = _bytes_view(out).view(out.shape[0], -1) if out.shape[0] else _bytes_view(out)
    b = _bytes_view(ref.to(out.device)).view(ref.shape[0], -1) if ref.shape[0] else _bytes_view(ref)
    if torch.equal(a, b):
        return True, 0
    return False, int((a != b).any(dim=-1).sum().item()) if a.dim() == 2 else 1


def _make_backend(kind: str, table: Any, cfg: BenchConfig, **options: Any) -> Any:
    from uvaple.integration import make_backend

    if cfg.cuda:
        return make_backend(kind, table, **options)
    return make_backend(kind, table, device=torch.device("cpu"), **options)


class _Provider(abc.ABC):
    """One provider bound to one table: ``run(ids, out)`` gathers ``table[ids]``; returns the output."""

    name = ""
    capturable = False
    gathers = True  # False for the ceiling (moves bytes, no ids)

    def __init__(self) -> None:
        self.gpu_mem_bytes = 0  # persistent device memory allocated when the provider was built

    @abc.abstractmethod
    def run(self, ids: torch.Tensor, ids_cpu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Gather ``table[ids]`` into ``out`` (``ids_cpu``: the same ids on the host) and return it."""

    def close(self) -> None:  # noqa: B027 - most providers hold nothing to release
        """Release what the provider holds (default: nothing)."""


class _BackendProvider(_Provider):
    capturable = True

    def __init__(self, name: str, backend: Any) -> None:
        super().__init__()
        self.name = name
        self.backend = backend
        self.capturable = name in GRAPH_PROVIDERS

    def run(self, ids, ids_cpu, out):
        return self.backend.lookup(ids, out=out)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.backend.close()


class _CopyProvider(_BackendProvider):
    """The copy backend's synchronous-from-the-caller form: ``lookup(ids, out=out)``."""

    def __init__(self, name: str, backend: Any, ids_on_host: bool) -> None:
        super().__init__(name, backend)
        self.capturable = False
        self.ids_on_host = ids_on_host

    def run(self, ids, ids_cpu, out):
        return self.backend.lookup(ids_cpu if self.ids_on_host else ids, out=out)


class _PeerProvider(_Provider):
    """A peer that reads the same table view: ``gather(view, ids, out)`` (see :mod:`uvaple.perf.peers`)."""

    capturable = True

    def __init__(self, name: str, gather: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 view: torch.Tensor) -> None:
        super().__init__()
        self.name, self._gather, self.view = name, gather, view

    def run(self, ids, ids_cpu, out):
        return self._gather(self.view, ids, out)


class _CeilingProvider(_Provider):
    """Contiguous pinned H2D copy of ``n × row_bytes`` (on CPU: a plain CPU memcpy of the same bytes)."""

    name = CEILING
    gathers = False
    capturable = True

    def __init__(self, src: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        from . import peers

        self._copy = peers.memcpy_ceiling
        self.src = src  # pinned uint8 [max bytes]
        self.device = device

    def run(self, ids, ids_cpu, out):
        nbytes = out.numel() * out.element_size()
        return self._copy(out.view(-1).view(torch.uint8), self.src[:nbytes])


# ------------------------------------------------------------------------------------------------ tables
def _host_budget(cfg: BenchConfig) -> int:
    if cfg.host_mem_gib:
        return int(cfg.host_mem_gib * GIB)
    return _host_mem_total()


def _fill_random(table: Any, cfg: BenchConfig, seed: int) -> None:
    """Random normal rows (never zeros: they hide unwritten outputs), generated on the GPU if there is one."""
    t = table.tensor
    if cfg.cuda:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        chunk = max(1, _FILL_CHUNK_BYTES // table.row_bytes)
        for a in range(0, table.rows, chunk):
            b = min(table.rows, a + chunk)
            g = torch.randn((b - a, table.cols), generator=gen, device="cuda", dtype=torch.float32)
            t[a:b].copy_(g.to(table.dtype))
        torch.cuda.synchronize()
    else:
        gen = torch.Generator().manual_seed(seed)
        t.copy_(torch.randn((table.rows, table.cols), generator=gen).to(table.dtype))


class _TooBig(MemoryError):
    """A table the host cannot hold (by ``_host_budget``): its points are skipped, not failed."""


def _make_table(row_bytes: int, table_gib: float, cfg: BenchConfig, seed: int):
    from uvaple.uva import HostTable

    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    if row_bytes % itemsize:
        raise ValueError(f"row size {row_bytes} B is not a multiple of the {cfg.dtype} item size")
    cols = row_bytes // itemsize
    rows = max(64, int(table_gib * GIB) // row_bytes)
    need = rows * row_bytes
    budget = _host_budget(cfg)
    if need + 4 * GIB > budget and cfg.cuda:
        raise _TooBig(f"a {_fmt_gib(table_gib)} table needs {need / GIB:.1f} GiB + 4 GiB headroom; the host "
                          f"has {budget / GIB:.1f} GiB (pass --host-mem-gib on a ballooned VM)")
    t0 = time.perf_counter()
    table = HostTable.empty(rows, cols, cfg.dtype, check_memory=cfg.host_mem_gib is None)
    t1 = time.perf_counter()
    try:
        _fill_random(table, cfg, seed)
    except BaseException:
        table.close()
        raise
    t2 = time.perf_counter()
    return table, t1 - t0, t2 - t1


def _build_provider(name: str, table: Any, cfg: BenchConfig, device: torch.device,
                    ceiling_src: torch.Tensor | None, shared: dict[str, Any]) -> _Provider:
    before = torch.cuda.memory_allocated(device) if cfg.cuda else 0
    prov: _Provider
    if name in ("uva", "device"):
        prov = _BackendProvider(name, _make_backend(name, table, cfg))
    elif name in ("copy", "copy-pipelined"):
        # One CopyBackend serves both forms (its pinned staging is max_in_flight × max_rows × row_bytes).
        if "copy" not in shared:
            shared["copy"] = _make_backend("copy", table, cfg, **_copy_options(cfg, table.row_bytes))
        backend = shared["copy"]
        if name == "copy":
            prov = _CopyProvider(name, backend, ids_on_host=True)
        else:
            prov = _PipelinedCopyProvider(backend, backend.max_in_flight, ids_on_host=True)
    elif name in ("peer-row-triton", "torch-embedding-uva"):
        from . import peers

        # Like vLLM's kernel, the peers read a CUDA view of the pinned table (same bytes, device pointer).
        gather = peers.row_gather if name == "peer-row-triton" else (lambda v, i, o: peers.embedding_gather(v, i))
        prov = _PeerProvider(name, gather, table.cuda_view() if cfg.cuda else table.tensor)
    elif name == CEILING:
        if ceiling_src is None:
            raise RuntimeError("no pinned source buffer for the memcpy ceiling")
        prov = _CeilingProvider(ceiling_src, device)
    else:
        raise ValueError(f"unknown provider {name!r}")
    if cfg.cuda:
        torch.cuda.synchronize(device)
        prov.gpu_mem_bytes = max(0, torch.cuda.memory_allocated(device) - before)
    return prov


def _copy_options(cfg: BenchConfig, row_bytes: int) -> dict[str, Any]:
    """Staging for the largest request (no point refused as CopyRequestTooLarge), ``copy_in_flight`` slots
    but at most ``_COPY_STAGING_BYTES`` of them (at 16384 × 128 KiB one slot is 2 GiB; 2 slots already
    overlap the CPU gather of one job with the copy of the other). The copy path gets its ids on the host
    (the scheduler has them there first: no device-to-host dependency)."""
    max_rows = max(cfg.rows)
    slots = max(2, min(cfg.copy_in_flight, _COPY_STAGING_BYTES // max(1, max_rows * row_bytes)))
    return {"max_in_flight": slots, "max_rows": max_rows}


class _PipelinedCopyProvider(_Provider):
    """The copy backend at its best throughput: ``submit`` keeps ``depth`` jobs in flight.

    Timed differently from the others (see :func:`_time_pipelined`): wall time per lookup in steady
    state, since per-call latency is not what pipelining improves.
    """

    name = "copy-pipelined"

    def __init__(self, backend: Any, depth: int, ids_on_host: bool) -> None:
        super().__init__()
        self.backend = backend
        self.depth = max(1, depth)
        self.ids_on_host = ids_on_host

    def _ids(self, ids, ids_cpu):
        return ids_cpu if self.ids_on_host else ids

    def run(self, ids, ids_cpu, out):
        job = self.backend.submit(self._ids(ids, ids_cpu), out=out)
        result = job.wait()
        return result if isinstance(result, torch.Tensor) else out

    def run_stream(self, id_sets: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                   outs: Sequence[torch.Tensor], count: int) -> list[float]:
        """``count`` lookups with up to ``depth`` in flight; job ``i`` writes ``outs[i % len(outs)]``.

        At most ``len(outs)`` jobs are in flight, so an output is reused only after the job that used it
        was waited on (the copy backend's contract). Returns ``perf_counter`` when each job's ``wait()``
        returned (its copy launched; a slot is only reused once the GPU finished its previous copy).
        """
        depth = min(self.depth, len(outs))
        jobs: deque = deque()
        stamps: list[float] = []
        for i in range(count):
            if len(jobs) >= depth:
                jobs.popleft().wait()
                stamps.append(time.perf_counter())
            ids, ids_cpu = id_sets(i)
            jobs.append(self.backend.submit(self._ids(ids, ids_cpu), out=outs[i % len(outs)]))
        while jobs:
            jobs.popleft().wait()
            stamps.append(time.perf_counter())
        return stamps

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.backend.close()


def _time_pipelined(prov: _PipelinedCopyProvider, id_sets, outs: Sequence[torch.Tensor], reps: int,
                    cuda: bool) -> dict[str, float]:
    """Steady-state µs per lookup with up to ``depth`` jobs in flight.

    One continuous stream of ``depth + 3 × per`` jobs; the first ``depth`` completions are ramp-up, the
    rest are cut into 3 windows and each window's time per job is one sample (p20/median/p80 over them).
    """
    depth = min(prov.depth, len(outs))
    windows = 3
    per = max(2, reps // windows)
    count = depth + windows * per
    _drain(cuda)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    stamps = prov.run_stream(id_sets, outs, count)
    _drain(cuda)  # job.wait() made the current stream wait on every copy
    cpu1, wall1 = time.process_time(), time.perf_counter()
    base = depth - 1
    samples = [(stamps[base + (w + 1) * per] - stamps[base + w * per]) / per * 1e6 for w in range(windows)]
    p20, med, p80 = _quantiles(samples)
    return {"us_p20": p20, "us_median": med, "us_p80": p80,
            "cpu_s_per_lookup": (cpu1 - cpu0) / count, "wall_us_per_lookup": (wall1 - wall0) / count * 1e6}


# ------------------------------------------------------------------------------------------------- sweep
def _empty_row(meta: dict[str, Any], **kw: Any) -> dict[str, Any]:
    row = {
        "kind": "gather", "provider": "", "row_label": "", "row_bytes": 0, "cols": 0, "dtype": "",
        "n": 0, "table_gib": 0.0, "table_rows": 0, "id_sets": 0, "reps": 0,
        "us_median": None, "us_p20": None, "us_p80": None, "gbps": None,
        "x_ceiling": None, "x_uva": None, "graph_x_ceiling": None, "graph_x_uva": None,
        "graph_us_median": None, "graph_us_p20": None, "graph_us_p80": None, "graph_gbps": None,
        "launch_overhead_us": None, "cpu_s_per_lookup": None, "wall_us_per_lookup": None,
        "gpu_mem_bytes": None, "check": "", "mismatch_rows": 0, "error": "",
    }
    row.update(kw)
    row.update({f"meta_{k}": v for k, v in meta.items()})
    return row


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:500]


def _id_sets_needed(n: int, row_bytes: int, reps: int) -> int:
    return int(min(max(2, reps), max(2, math.ceil(_ROTATION_BYTES / max(1, n * row_bytes)))))


def _sweep_table(row_bytes: int, table_gib: float, cfg: BenchConfig, meta: dict[str, Any],
                 progress: Progress, ceiling_src: torch.Tensor | None, device: torch.device,
                 results: list[dict[str, Any]]) -> None:
    label = row_label(row_bytes)
    where = f"{label} {_fmt_gib(table_gib)}"
    base = {"row_label": label, "row_bytes": row_bytes, "table_gib": table_gib,
            "dtype": str(cfg.dtype).replace("torch.", "")}
    try:
        progress.note(f"{where}: creating and filling the table")
        table, t_create, t_fill = _make_table(row_bytes, table_gib, cfg, cfg.seed)
    except Exception as e:  # noqa: BLE001 - a table that cannot be built skips its points, loudly
        msg = _error_text(e)
        # Our own size guard says "skipped"; anything else (allocation, registration) is an error.
        check = "skipped" if isinstance(e, _TooBig) else "error"
        if check == "error" and "memory" in msg.lower() and cfg.host_mem_gib is None:
            msg += " (on a VM whose memory grows on demand pass --host-mem-gib)"
        print(f"!! {where}: table not built: {msg}", file=sys.stderr)
        for n in cfg.rows:
            for p in cfg.providers:
                progress.step(f"{where} n={n} {p} ({check})")
                results.append(_empty_row(meta, provider=p, n=n, check=check,
                                          error=f"table not built: {msg}", **base))
        return
    base.update(cols=table.cols, table_rows=table.rows)
    progress.note(f"{where}: table ready ({t_create:.1f} s create, {t_fill:.1f} s random fill)")
    providers: dict[str, _Provider] = {}
    shared: dict[str, Any] = {}
    build_errors: dict[str, str] = {}
    try:
        for name in cfg.providers:
            if name == "device" and cfg.cuda:
                free, _total = torch.cuda.mem_get_info(device)
                largest_out = max(cfg.rows) * row_bytes
                if table.nbytes + 4 * largest_out + 2 * GIB > free:
                    build_errors[name] = (f"skipped: the table ({table.nbytes / GIB:.1f} GiB) does not fit in "
                                          f"free GPU memory ({free / GIB:.1f} GiB)")
                    continue
            try:
                providers[name] = _build_provider(name, table, cfg, device, ceiling_src, shared)
            except Exception as e:  # noqa: BLE001
                build_errors[name] = f"build failed: {_error_text(e)}"
                print(f"!! {where}: provider {name} not built: {build_errors[name]}", file=sys.stderr)
        for n in cfg.rows:
            _sweep_point(n, table, providers, build_errors, cfg, meta, base, progress, device, results)
    finally:
        for prov in providers.values():
            prov.close()
        providers.clear()
        for backend in shared.values():
            with contextlib.suppress(Exception):
                backend.close()
        shared.clear()
        if cfg.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        table.close()


def _sweep_point(n: int, table: Any, providers: dict[str, _Provider], build_errors: dict[str, str],
                 cfg: BenchConfig, meta: dict[str, Any], base: dict[str, Any], progress: Progress,
                 device: torch.device, results: list[dict[str, Any]]) -> None:
    row_bytes = base["row_bytes"]
    where = f"{base['row_label']} {_fmt_gib(base['table_gib'])} n={n}"
    est_reps = cfg.max_reps if cfg.point_time_s > 0 else cfg.min_reps
    n_sets = _id_sets_needed(n, row_bytes, est_reps)
    gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + n)
    ids_all = torch.randint(0, table.rows, (n_sets, n), device=device, dtype=torch.int64, generator=gen)
    ids_cpu_all = ids_all.cpu()
    point_rows: dict[str, dict[str, Any]] = {}

    # Reference: uva on id set 0, itself checked against a CPU index_select of the table.
    ref: torch.Tensor | None = None
    ref_note = ""
    if REFERENCE in providers:
        try:
            out = torch.empty((n, table.cols), dtype=table.dtype, device=device)
            _poison(out)
            ref = providers[REFERENCE].run(ids_all[0], ids_cpu_all[0], out)
            _sync(cfg.cuda)
            m = min(n, _CPU_CHECK_IDS)
            cpu_rows = table.tensor.index_select(0, ids_cpu_all[0][:m])
            ok, bad = _compare(ref[:m].cpu(), cpu_rows)
            if not ok:
                ref_note = f"uva differs from a CPU index_select of the table in {bad} of {m} rows"
        except Exception as e:  # noqa: BLE001
            ref = None
            ref_note = f"uva failed: {_error_text(e)}"
    ref_name = "uva's output"
    if ref is None:
        # No uva output: the others are compared with a CPU index_select of the table instead.
        try:
            ref = table.tensor.index_select(0, ids_cpu_all[0]).to(device)
            ref_name = "a CPU index_select of the table"
        except Exception as e:  # noqa: BLE001
            ref_note = (ref_note + "; " if ref_note else "") + f"CPU reference failed: {_error_text(e)}"

    for name in cfg.providers:
        progress.step(f"{where} {name}")
        row = _empty_row(meta, provider=name, n=n, **base)
        point_rows[name] = row
        if name in build_errors:
            row["check"] = "skipped" if build_errors[name].startswith("skipped") else "error"
            row["error"] = build_errors[name]
            continue
        prov = providers[name]
        row["gpu_mem_bytes"] = prov.gpu_mem_bytes if cfg.cuda else None
        try:
            _measure(prov, row, n, table, ids_all, ids_cpu_all, n_sets, ref, ref_name, ref_note, cfg, device)
        except Exception as e:  # noqa: BLE001 - the run goes on; the row says what failed
            row["check"] = "MISMATCH" if row["check"] == "MISMATCH" else "error"
            row["error"] = _error_text(e)
            print(f"!! {where} {name}: {row['error']}", file=sys.stderr)
        finally:
            if cfg.cuda:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(device)

    # Ratios within the point.
    ceil_row = point_rows.get(CEILING)
    uva_row = point_rows.get(REFERENCE)
    for row in point_rows.values():
        if row["gbps"] is None:
            continue
        if ceil_row and ceil_row["gbps"]:
            row["x_ceiling"] = row["gbps"] / ceil_row["gbps"]
        if uva_row and uva_row["gbps"]:
            row["x_uva"] = row["gbps"] / uva_row["gbps"]
        if row.get("graph_gbps"):
            if ceil_row and ceil_row.get("graph_gbps"):
                row["graph_x_ceiling"] = row["graph_gbps"] / ceil_row["graph_gbps"]
            if uva_row and uva_row.get("graph_gbps"):
                row["graph_x_uva"] = row["graph_gbps"] / uva_row["graph_gbps"]
    results.extend(point_rows.values())
    del ref


def _measure(prov: _Provider, row: dict[str, Any], n: int, table: Any, ids_all: torch.Tensor,
             ids_cpu_all: torch.Tensor, n_sets: int, ref: torch.Tensor | None, ref_name: str, ref_note: str,
             cfg: BenchConfig, device: torch.device) -> None:
    row_bytes = table.row_bytes
    out = torch.empty((n, table.cols), dtype=table.dtype, device=device)

    # 1. correctness, before any timing
    t_first = time.perf_counter()
    if prov.gathers:
        _poison(out)
        got = prov.run(ids_all[0], ids_cpu_all[0], out)
        _sync(cfg.cuda)
        if prov.name == REFERENCE and ref_note:
            row["check"] = "error" if ref_note.startswith("uva failed") else "MISMATCH"
            row["error"] = ref_note
        elif ref is None:
            row["check"] = "unchecked"
            row["error"] = ref_note
        else:
            ok, bad = _compare(got, ref)
            row["check"] = "ok" if ok else "MISMATCH"
            row["mismatch_rows"] = bad
            if not ok:
                row["error"] = f"{bad} of {n} rows differ from {ref_name}"
        del got
    else:
        row["check"] = "n/a"
        prov.run(ids_all[0], ids_cpu_all[0], out)
        _sync(cfg.cuda)
    first_s = time.perf_counter() - t_first

    # 2. eager timing: a short probe picks the repeat count
    def call(i: int) -> Any:
        return prov.run(ids_all[i], ids_cpu_all[i], out)

    transient = 0
    if cfg.cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    # Slow points (the first call took > 20 ms: large n, copy path) warm up once; they are already warm.
    for i in range(cfg.warmup if first_s < 0.02 else 1):
        call(i % n_sets)
    _sync(cfg.cuda)
    if cfg.cuda:
        transient = max(0, torch.cuda.max_memory_allocated(device) - before)
        row["gpu_mem_bytes"] = prov.gpu_mem_bytes + transient
    probe = _time_eager(call, n_sets, min(3, cfg.min_reps), cfg.cuda)
    reps = _reps_for(cfg, probe["us_median"])
    if isinstance(prov, _PipelinedCopyProvider):
        res = _time_pipelined(prov, _id_getter(ids_all, ids_cpu_all, n_sets),
                              _pipeline_outs(out, prov.depth), reps, cfg.cuda)
    else:
        res = _time_eager(call, n_sets, reps, cfg.cuda)
    row.update(res)
    row["reps"] = reps
    row["id_sets"] = n_sets
    row["gbps"] = n * row_bytes / (res["us_median"] * 1e-6) / 1e9 if res["us_median"] > 0 else None

    # 3. CUDA-graph replays (GPU time with host launch cost removed)
    if cfg.cuda and cfg.graphs and prov.capturable:
        def call_on(ids: torch.Tensor, o: torch.Tensor) -> Any:
            return prov.run(ids, ids, o)

        try:
            g = _time_graph(call_on, out, table.rows, n, device, cfg)
            row.update(g)
            row["graph_gbps"] = n * row_bytes / (g["graph_us_median"] * 1e-6) / 1e9
            row["launch_overhead_us"] = res["us_median"] - g["graph_us_median"]
        except Exception as e:  # noqa: BLE001
            row["error"] = (row["error"] + "; " if row["error"] else "") + f"graph: {_error_text(e)}"


def _id_getter(ids_all: torch.Tensor, ids_cpu_all: torch.Tensor, n_sets: int):
    return lambda i: (ids_all[i % n_sets], ids_cpu_all[i % n_sets])


def _pipeline_outs(out: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """One output per job in flight (jobs in flight must not share an output), ``out`` first."""
    outs = [out]
    budget = 8 * GIB  # bound the extra outputs of huge points (4 × 2 GiB at 16384 × 128 KiB)
    for _ in range(depth - 1):
        if (len(outs) + 1) * out.numel() * out.element_size() > budget:
            break
        outs.append(torch.empty_like(out))
    return outs


# -------------------------------------------------------------------------------------------- readiness
def _release_pinned() -> bool:
    """Return torch's cached pinned host blocks to the OS (the name moved between torch releases)."""
    candidates = (
        getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
        getattr(torch._C, "_host_emptyCache", None),
        getattr(torch._C, "_accelerator_emptyHostCache", None),
    )
    for fn in candidates:
        if fn is None:
            continue
        try:
            fn()
            return True
        except Exception:  # noqa: BLE001 - try the next spelling
            continue
    return False


def _write_safetensors(path: Path, name: str, rows: int, cols: int, dtype: torch.dtype,
                       seed: int, deadline_s: float) -> None:
    """Write a ``[rows, cols]`` tensor of random values (a repeated 64-MiB random block) to ``path``."""
    from uvaple.uva import SUPPORTED_DTYPES

    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = rows * cols * itemsize
    header = {name: {"dtype": SUPPORTED_DTYPES[dtype], "shape": [rows, cols], "data_offsets": [0, nbytes]},
              "__metadata__": {"format": "pt", "written_by": "uvaple.perf.bench"}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    gen = torch.Generator().manual_seed(seed)
    block_elems = max(1, min(nbytes, 64 * MIB) // itemsize)
    block = torch.randn(block_elems, generator=gen).to(dtype).view(torch.uint8).numpy().tobytes()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        left = nbytes
        while left > 0:
            chunk = block[: min(left, len(block))]
            f.write(chunk)
            left -= len(chunk)
            if time.perf_counter() - t0 > deadline_s:
                raise TimeoutError(f"writing the {nbytes / GIB:.1f} GiB file took over {deadline_s:.0f} s")


def _safetensors_source(path: Path) -> tuple[int, int]:
    with open(path, "rb") as f:
        hlen = int.from_bytes(f.read(8), "little")
    return 8 + hlen, path.stat().st_size - 8 - hlen


def _pick_tmp_dir(cfg: BenchConfig, nbytes: int) -> Path | None:
    candidates = [cfg.tmp_dir] if cfg.tmp_dir else ["/dev/shm", tempfile.gettempdir()]
    for d in candidates:
        try:
            if d and os.path.isdir(d) and shutil.disk_usage(d).free > nbytes * 1.1 + 2 * GIB:
                return Path(d)
        except OSError:
            continue
    return None


def _readiness_row(meta: dict[str, Any], **kw: Any) -> dict[str, Any]:
    row = {"kind": "readiness", "method": "", "table_gib": 0.0, "bytes": 0, "seconds": None,
           "gib_per_s": None, "check": "", "error": "", "note": ""}
    row.update(kw)
    row.update({f"meta_{k}": v for k, v in meta.items()})
    return row


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def run_readiness(cfg: BenchConfig, meta: dict[str, Any], progress: Progress, *, deadline: float = math.inf,
                  checkpoint: Callable[[list[dict[str, Any]]], Any] | None = None) -> list[dict[str, Any]]:
    """Time making a table usable, per size: HostTable vs ``torch.empty(pin_memory=True)`` (+ copy).

    Sizes not started by ``deadline`` (a ``perf_counter`` value) are reported as skipped.
    """
    from uvaple.uva import HostTable

    rows_out: list[dict[str, Any]] = []
    row_bytes = ROW_BYTES["e4b"] if ROW_BYTES["e4b"] in cfg.row_bytes or not cfg.row_bytes else cfg.row_bytes[0]
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    cols = row_bytes // itemsize
    pin = cfg.cuda
    torch_label = "torch.empty(pin_memory=True)" if pin else "torch.empty (no CUDA: unpinned)"
    budget = _host_budget(cfg)
    for gib in cfg.readiness_gib:
        rows = max(1, int(gib * GIB) // row_bytes)
        nbytes = rows * row_bytes
        torch_bytes = 1 << (nbytes - 1).bit_length() if pin else nbytes  # torch pins power-of-two blocks
        where = f"readiness {_fmt_gib(gib)}"
        if checkpoint is not None and rows_out:
            checkpoint(rows_out)
        # Start a size only if its estimate ends by the deadline (+30 s of slack on a 480-s outer timeout).
        if time.perf_counter() + _readiness_size_estimate_s(cfg, gib) > deadline + 30.0:
            for m in ("HostTable.empty", torch_label, "HostTable.from_safetensors", f"{torch_label} + copy_ from mmap"):
                rows_out.append(_readiness_row(meta, method=m, table_gib=gib, bytes=nbytes, check="skipped",
                                               error="skipped: time budget spent (--time-budget)"))
            for _ in range(3):
                progress.step(f"{where} (skipped: time budget)")
            continue

        def add(method: str, seconds: float | None, *, check: str = "ok", error: str = "", note: str = "",
                nb: int = nbytes, _gib: float = gib) -> None:
            rows_out.append(_readiness_row(
                meta, method=method, table_gib=_gib, bytes=nb, seconds=seconds,
                gib_per_s=(nb / GIB / seconds) if seconds else None, check=check, error=error, note=note))

        # HostTable.empty: create + prefault + register
        progress.step(f"{where}: HostTable.empty")
        if nbytes + 4 * GIB > budget and cfg.cuda:
            add("HostTable.empty", None, check="skipped", error=f"needs {nbytes / GIB:.1f} GiB; host has "
                f"{budget / GIB:.1f} GiB (--host-mem-gib)")
        else:
            try:
                secs, table = _timed(lambda r=rows: HostTable.empty(
                    r, cols, cfg.dtype, check_memory=cfg.host_mem_gib is None))
                reg = bool(table.registered)
                table.close()
                add("HostTable.empty", secs, check="ok" if (reg or not cfg.cuda) else "unregistered")
            except Exception as e:  # noqa: BLE001
                add("HostTable.empty", None, check="error", error=_error_text(e))

        # torch.empty(pin_memory=True): what vLLM does
        progress.step(f"{where}: {torch_label}")
        if torch_bytes + 4 * GIB > budget and cfg.cuda:
            add(torch_label, None, check="skipped", nb=torch_bytes,
                error=f"torch pins a {torch_bytes / GIB:.0f} GiB block; host has {budget / GIB:.1f} GiB")
        else:
            try:
                # An empty pinned cache, or torch would hand back a cached block in no time.
                cache_note = "" if (_release_pinned() or not pin) else "torch's pinned cache could not be emptied; "
                secs, buf = _timed(lambda nb=nbytes: torch.empty(nb, dtype=torch.uint8, pin_memory=pin))
                del buf
                _release_pinned()
                add(torch_label, secs, note=cache_note + ("" if torch_bytes == nbytes else
                    f"torch pins a {torch_bytes / GIB:.2f} GiB block for {nbytes / GIB:.2f} GiB"))
            except Exception as e:  # noqa: BLE001
                add(torch_label, None, check="error", error=_error_text(e))

        # from a safetensors file in page cache
        progress.step(f"{where}: from_safetensors")
        st_methods = ("HostTable.from_safetensors", f"{torch_label} + copy_ from mmap")
        if gib > cfg.safetensors_max_gib + 1e-9:
            for m in st_methods:
                add(m, None, check="skipped",
                    error=f"over --safetensors-max-gib {cfg.safetensors_max_gib:g} (file + table + page cache)")
            continue
        if cfg.cuda and nbytes + max(nbytes, torch_bytes) + 8 * GIB > budget:
            for m in st_methods:
                add(m, None, check="skipped", error="file in page cache + table would not fit in host memory")
            continue
        tmp = _pick_tmp_dir(cfg, nbytes)
        if tmp is None:
            for m in st_methods:
                add(m, None, check="skipped", error="no temporary directory with room for the file")
            continue
        path = tmp / f"uvaple_bench_{os.getpid()}_{rows}x{cols}.safetensors"
        try:
            _readiness_safetensors(path, rows, cols, cfg, pin, st_methods, add)
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
    return rows_out


def _readiness_safetensors(path: Path, rows: int, cols: int, cfg: BenchConfig, pin: bool,
                           methods: tuple[str, str], add: Callable[..., None]) -> None:
    import numpy as np
    from uvaple.uva import HostTable

    try:
        _write_safetensors(path, "table", rows, cols, cfg.dtype, cfg.seed, _ST_WRITE_LIMIT_S)
        offset, nbytes = _safetensors_source(path)
        # The file was just written, so its pages are in the page cache (tmpfs or dirty/clean disk pages).
        mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
    except Exception as e:  # noqa: BLE001
        for m in methods:
            add(m, None, check="skipped", error=f"could not write the file: {_error_text(e)}")
        return
    probe = sorted({0, rows // 2, rows - 1})
    row_bytes = nbytes // rows
    expect = {r: bytes(mm[r * row_bytes:(r + 1) * row_bytes]) for r in probe}

    try:
        secs, table = _timed(lambda: HostTable.from_safetensors(
            path, "table", check_memory=cfg.host_mem_gib is None))
        try:
            view = table.bytes_view()  # [rows, stride_bytes] uint8
            ok = all(view[r, :row_bytes].tobytes() == expect[r] for r in probe)
        finally:
            table.close()
        add(methods[0], secs, check="ok" if ok else "MISMATCH",
            error="" if ok else "loaded rows differ from the file")
    except Exception as e:  # noqa: BLE001
        add(methods[0], None, check="error", error=_error_text(e))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only memmap: torch warns about non-writable arrays
            src = torch.from_numpy(mm)

        _release_pinned()

        def load() -> torch.Tensor:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            buf.copy_(src)
            return buf

        secs, buf = _timed(load)
        ok = all(buf[r * row_bytes:(r + 1) * row_bytes].numpy().tobytes() == expect[r] for r in probe)
        del buf
        _release_pinned()
        add(methods[1], secs, check="ok" if ok else "MISMATCH", error="" if ok else "copied rows differ")
    except Exception as e:  # noqa: BLE001
        add(methods[1], None, check="error", error=_error_text(e))
    del mm


# ------------------------------------------------------------------------------------------------ driver
def _ceiling_source(row_bytes: int, cfg: BenchConfig) -> torch.Tensor | None:
    """Pinned (CUDA) or plain (CPU) uint8 buffer of the largest point's bytes, filled with a pattern."""
    nbytes = max(cfg.rows) * row_bytes
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cfg.cuda)
        buf.fill_(0x5A)  # DMA speed does not depend on the bytes; not zeros all the same
        return buf
    except Exception as e:  # noqa: BLE001
        print(f"!! memcpy ceiling source ({nbytes / MIB:.0f} MiB) not allocated: {_error_text(e)}",
              file=sys.stderr)
        return None


def _readiness_estimate_s(cfg: BenchConfig) -> float:
    """Seconds the readiness part should take (kept in reserve by the gather sweep's time budget).

    Per GiB: ~0.1 s HostTable.empty (DESIGN.md: 32 GiB prefault + register in 2.1 s), ~0.6 s
    torch.empty(pin_memory=True) (single-threaded fault + pin: 100 GiB in 44-78 s), and where a file is
    written ~1.2 s more (write, HostTable load, pinned alloc + copy).
    """
    return sum(_readiness_size_estimate_s(cfg, g) for g in cfg.readiness_gib)


def _readiness_size_estimate_s(cfg: BenchConfig, gib: float) -> float:
    if not cfg.cuda:
        return 0.0
    return 0.7 * gib + (1.2 * gib if gib <= cfg.safetensors_max_gib else 0.0)


def run_bench(config: BenchConfig | None = None, *, meta: dict[str, Any] | None = None,
              checkpoint: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Run every gather point and readiness size of ``config``; return one dict per result row.

    Gather rows have ``kind == "gather"``, readiness rows ``kind == "readiness"``; every row carries the
    run's metadata as ``meta_*`` fields. Nothing is written to disk here (see :func:`write_results`);
    ``checkpoint(rows_so_far)`` is called after each table and readiness size (``main`` saves partial
    results with it, so a run killed by a timeout still leaves numbers).

    Order: table size outer, row size inner, so a run cut short by ``time_budget_s`` has every row size
    at the small tables. Tables whose turn comes after the budget (less the readiness reserve) is spent
    are reported as skipped.
    """
    cfg = config or make_config()
    if cfg.cuda and not torch.cuda.is_available():
        raise RuntimeError("BenchConfig.cuda is set but torch sees no CUDA device")
    meta = meta or collect_meta(cfg)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cuda else torch.device("cpu")
    n_gather = len(cfg.row_bytes) * len(cfg.table_gib) * len(cfg.rows) * len(cfg.providers)
    n_ready = 3 * len(cfg.readiness_gib)
    progress = Progress(n_gather + n_ready, enabled=cfg.verbose)
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    budget = cfg.time_budget_s if cfg.time_budget_s and cfg.time_budget_s > 0 else math.inf
    reserve = _readiness_estimate_s(cfg)

    def save() -> None:
        if checkpoint is not None:
            try:
                checkpoint(results)
            except Exception as e:  # noqa: BLE001 - a failed partial save must not stop the run
                print(f"!! saving partial results failed: {_error_text(e)}", file=sys.stderr)

    ceiling_srcs: dict[int, torch.Tensor | None] = {}
    try:
        for gib in cfg.table_gib:
            for row_bytes in cfg.row_bytes:
                elapsed = time.perf_counter() - t0
                if elapsed + reserve > budget:
                    why = (f"skipped: time budget ({budget:.0f} s, {reserve:.0f} s kept for readiness) spent "
                           f"after {elapsed:.0f} s (--time-budget)")
                    _skip_table(row_bytes, gib, cfg, meta, progress, results, why)
                    continue
                if CEILING in cfg.providers and row_bytes not in ceiling_srcs:
                    ceiling_srcs[row_bytes] = _ceiling_source(row_bytes, cfg)
                _sweep_table(row_bytes, gib, cfg, meta, progress, ceiling_srcs.get(row_bytes), device, results)
                save()
        ceiling_srcs.clear()
        _release_pinned()
        if cfg.readiness_gib:
            results.extend(run_readiness(cfg, meta, progress, deadline=t0 + budget, checkpoint=lambda rows: (
                checkpoint(results + rows) if checkpoint is not None else None)))
            save()
    finally:
        progress.close()
    return results


def _skip_table(row_bytes: int, gib: float, cfg: BenchConfig, meta: dict[str, Any], progress: Progress,
                results: list[dict[str, Any]], why: str) -> None:
    base = {"row_label": row_label(row_bytes), "row_bytes": row_bytes, "table_gib": gib,
            "dtype": str(cfg.dtype).replace("torch.", "")}
    for n in cfg.rows:
        for p in cfg.providers:
            progress.step(f"{row_label(row_bytes)} {_fmt_gib(gib)} n={n} {p} (skipped)")
            results.append(_empty_row(meta, provider=p, n=n, check="skipped", error=why, **base))


# ------------------------------------------------------------------------------------------------ output
def _num(v: Any, fmt: str, width: int) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-".rjust(width)
    return format(v, fmt).rjust(width)


_TABLE_HEADER = (f"{'provider':<20} {'table':>7} {'row_B':>7} {'n':>6} {'us_med':>9} {'p20-p80':>15} "
                 f"{'GB/s':>7} {'xceil':>6} {'xuva':>6} {'graph_us':>9} {'g_xceil':>7} {'cpu_us':>8} {'gpu_MiB':>8} "
                 f"check")


def format_table(rows: Iterable[dict[str, Any]]) -> str:
    """One line per gather point: provider, table, row bytes, n, µs median (p20–p80), GB/s, ×ceiling, ×uva,
    graph-replay µs and its ×ceiling (against the graph-timed memcpy), host CPU µs per lookup, provider
    GPU MiB, check (+ error text when there is one)."""
    lines = [_TABLE_HEADER]
    for r in rows:
        if r.get("kind") != "gather":
            continue
        spread = ("-" if r.get("us_p20") is None else f"{r['us_p20']:.1f}-{r['us_p80']:.1f}")
        cpu_us = None if r.get("cpu_s_per_lookup") is None else r["cpu_s_per_lookup"] * 1e6
        mib = None if r.get("gpu_mem_bytes") is None else r["gpu_mem_bytes"] / MIB
        line = (f"{r['provider']:<20} {_fmt_gib(r['table_gib']):>7} {r['row_bytes']:>7} {r['n']:>6} "
                f"{_num(r.get('us_median'), '.1f', 9)} {spread:>15} {_num(r.get('gbps'), '.2f', 7)} "
                f"{_num(r.get('x_ceiling'), '.2f', 6)} {_num(r.get('x_uva'), '.2f', 6)} "
                f"{_num(r.get('graph_us_median'), '.2f', 9)} {_num(r.get('graph_x_ceiling'), '.2f', 7)} "
                f"{_num(cpu_us, '.1f', 8)} {_num(mib, '.0f', 8)} "
                f"{r.get('check', '')}")
        if r.get("error"):
            line += f"  [{r['error'][:160]}]"
        lines.append(line)
    return "\n".join(lines)


def format_readiness_table(rows: Iterable[dict[str, Any]]) -> str:
    """One line per readiness measurement: method, size, seconds, GiB/s, check."""
    lines = [f"{'method':<52} {'size':>7} {'seconds':>9} {'GiB/s':>8} check"]
    for r in rows:
        if r.get("kind") != "readiness":
            continue
        line = (f"{r['method']:<52} {_fmt_gib(r['table_gib']):>7} {_num(r.get('seconds'), '.3f', 9)} "
                f"{_num(r.get('gib_per_s'), '.2f', 8)} {r.get('check', '')}")
        for key in ("error", "note"):
            if r.get(key):
                line += f"  [{r[key][:160]}]"
        lines.append(line)
    return "\n".join(lines)


def format_headline(rows: Iterable[dict[str, Any]]) -> str:
    """Two lines per (row size, table): GB/s of each provider at the largest n, µs at the smallest n.

    Short enough to survive ``| tail -80``; the full table is above it and in ``summary.txt``.
    """
    gather = [r for r in rows if r.get("kind") == "gather"]
    keys = list(dict.fromkeys((r["row_bytes"], r["table_gib"]) for r in gather))
    abbrev = {"uva": "uva", "device": "dev", "copy": "copy", "copy-pipelined": "copy-pipe",
              "torch-embedding-uva": "emb", "peer-row-triton": "peer", CEILING: "ceil"}
    lines = []
    for rb, gib in keys:
        pts = [r for r in gather if r["row_bytes"] == rb and r["table_gib"] == gib]
        ns = sorted({r["n"] for r in pts})
        if not ns:
            continue
        for n, unit in ((ns[-1], "GB/s"), (ns[0], "us")):
            parts = []
            for r in pts:
                if r["n"] != n:
                    continue
                name = abbrev.get(r["provider"], r["provider"])
                if r.get("check") in ("MISMATCH", "error", "skipped") and r.get("us_median") is None:
                    parts.append(f"{name} {r['check']}")
                    continue
                if unit == "GB/s":
                    graph = r.get("graph_gbps")
                    parts.append(f"{name} {_num(r.get('gbps'), '.1f', 0)}"
                                 + (f" (graph {graph:.1f})" if graph is not None else ""))
                else:
                    graph = r.get("graph_us_median")
                    parts.append(f"{name} {_num(r.get('us_median'), '.1f', 0)}"
                                 + (f" (graph {graph:.1f})" if graph is not None else ""))
                if r.get("check") == "MISMATCH":
                    parts[-1] += " MISMATCH"
            lines.append(f"{row_label(rb):>9} {_fmt_gib(gib):>7} n={n:<6} {unit:>4}: " + " | ".join(parts))
    return "\n".join(lines)


def banner(meta: dict[str, Any]) -> str:
    """The lines printed first: what machine, and whether the times are GPU figures at all."""
    lines = []
    if meta.get("mode") != "gpu":
        lines.append("=" * 100)
        lines.append("NO GPU: these are CPU / Triton-interpreter times, NOT GPU figures. This run checks that every")
        lines.append("provider returns the same rows; memcpy-ceiling is a CPU memcpy and no CUDA graphs are timed.")
        lines.append("=" * 100)
    lines.append(f"uvaple bench  preset={meta.get('preset')}  {meta.get('timestamp')}  git {meta.get('git_commit')}"
                 f"{' (dirty)' if meta.get('git_dirty') else ''}")
    lines.append(f"GPU {meta.get('gpu_name')}  driver {meta.get('driver')}  PCIe {meta.get('pcie_link')}  "
                 f"torch {meta.get('torch')}  triton {meta.get('triton')}  CPUs {meta.get('cpu_count')}  "
                 f"host {meta.get('host_mem_gib')} GiB")
    return "\n".join(lines)


def _csv_fields(rows: Sequence[dict[str, Any]]) -> list[str]:
    fields: list[str] = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    return fields


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_results(rows: Sequence[dict[str, Any]], out_dir: str | os.PathLike, meta: dict[str, Any], *,
                  plots: bool = True, config: BenchConfig | None = None) -> dict[str, Path]:
    """Write ``results.json``, ``gather.csv``, ``readiness.csv``, ``summary.txt`` and (``plots``) PNGs.

    Returns the paths written by name. Plots are skipped with a message if matplotlib is missing.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    cfg_dict = None
    if config is not None:
        cfg_dict = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in dataclasses.asdict(config).items()}
    doc = {"meta": meta, "config": cfg_dict, "rows": [{k: _jsonable(v) for k, v in r.items()} for r in rows]}
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=1))
    written["json"] = path
    for kind, name in (("gather", "gather.csv"), ("readiness", "readiness.csv")):
        subset = [r for r in rows if r.get("kind") == kind]
        if not subset:
            continue
        path = out / name
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=_csv_fields(subset))
            w.writeheader()
            for r in subset:
                w.writerow({k: ("" if v is None else v) for k, v in r.items()})
        written[f"csv_{kind}"] = path
    path = out / "summary.txt"
    path.write_text(banner(meta) + "\n\n" + format_table(rows) + "\n\n" + format_readiness_table(rows) + "\n")
    written["summary"] = path
    if plots:
        written.update(plot_results(rows, out, meta))
    return written


def plot_results(rows: Sequence[dict[str, Any]], out_dir: Path, meta: dict[str, Any]) -> dict[str, Path]:
    """``gather_gbps.png`` (GB/s vs n, one panel per row size, ceiling drawn) and ``readiness.png``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'uvaple[bench]')", file=sys.stderr)
        return {}
    written: dict[str, Path] = {}
    title = f"{meta.get('gpu_name')} | PCIe {meta.get('pcie_link')} | {meta.get('timestamp')}"
    if meta.get("mode") != "gpu":
        title = "CPU / Triton interpreter times, NOT GPU figures | " + title
    gather = [r for r in rows if r.get("kind") == "gather" and r.get("gbps")]
    if gather:
        sizes = sorted({r["row_bytes"] for r in gather})
        fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 5), squeeze=False)
        for ax, rb in zip(axes[0], sizes, strict=True):
            pts = [r for r in gather if r["row_bytes"] == rb]
            biggest = max(r["table_gib"] for r in pts)
            for prov in [p for p in PROVIDERS if any(r["provider"] == p for r in pts)]:
                sel = sorted((r for r in pts if r["provider"] == prov and r["table_gib"] == biggest),
                             key=lambda r: r["n"])
                if not sel:
                    continue
                style = {"linestyle": "--", "color": "black", "linewidth": 2} if prov == CEILING else {}
                ax.plot([r["n"] for r in sel], [r["gbps"] for r in sel], marker="o", label=prov, **style)
            for gib in sorted({r["table_gib"] for r in pts} - {biggest}):
                sel = sorted((r for r in pts if r["provider"] == REFERENCE and r["table_gib"] == gib),
                             key=lambda r: r["n"])
                if sel:
                    ax.plot([r["n"] for r in sel], [r["gbps"] for r in sel], linestyle=":", alpha=0.6,
                            label=f"uva @ {_fmt_gib(gib)}")
            ceil = [r["gbps"] for r in pts if r["provider"] == CEILING]
            if ceil:
                ax.axhline(max(ceil), color="grey", linestyle=":", linewidth=1,
                           label=f"ceiling max {max(ceil):.1f} GB/s")
            _log_log_axes(ax, "rows per lookup (n)", "GB/s (n × row bytes / median time)",
                          f"{row_label(rb)} rows ({rb} B), table {_fmt_gib(biggest)}")
        written["plot_gather"] = _save_figure(plt, fig, title, 9, out_dir / "gather_gbps.png")
    ready = [r for r in rows if r.get("kind") == "readiness" and r.get("seconds")]
    if ready:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for method in dict.fromkeys(r["method"] for r in ready):
            sel = sorted((r for r in ready if r["method"] == method), key=lambda r: r["table_gib"])
            ax.plot([r["table_gib"] for r in sel], [r["seconds"] for r in sel], marker="o", label=method)
        _log_log_axes(ax, "table size (GiB)", "seconds until usable", "table readiness", title_size=10)
        written["plot_readiness"] = _save_figure(plt, fig, title, 8, out_dir / "readiness.png")
    return written


def _log_log_axes(ax, xlabel: str, ylabel: str, title: str, title_size=None) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **({"fontsize": title_size} if title_size else {}))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save_figure(plt, fig, title: str, title_size: int, path: Path) -> Path:
    fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------- CLI
def _parse_row_bytes(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part in ROW_BYTES:
            out.append(ROW_BYTES[part])
        elif part.endswith("k") or part.endswith("kib"):
            out.append(int(float(part.rstrip("kib")) * 1024))
        else:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError("no row sizes given")
    return tuple(out)


def _parse_ints(text: str) -> tuple[int, ...]:
    vals = tuple(int(p) for p in text.split(",") if p.strip())
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("row counts must be positive integers")
    return vals


def _parse_floats(text: str) -> tuple[float, ...]:
    vals = tuple(float(p) for p in text.split(",") if p.strip())
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError("sizes must be positive")
    return vals


def _parse_readiness(text: str) -> tuple[float, ...]:
    vals = tuple(float(p) for p in text.split(",") if p.strip())
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError("sizes must be positive (0 skips readiness)")
    return tuple(v for v in vals if v > 0)


def _parse_providers(text: str) -> tuple[str, ...]:
    vals = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in vals if p not in PROVIDERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown providers {bad}; choose from {', '.join(PROVIDERS)}")
    return vals


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="uvaple bench",
        description="Gather latency/bandwidth of the uva, device, copy and peer providers against the pinned "
                    "memcpy ceiling, plus table readiness. Without CUDA: a small correctness run under the "
                    "Triton interpreter.")
    p.add_argument("--full", action="store_true",
                   help="whole sweep: E2B, E4B, 128-KiB rows x 1, 8, 32, 64 GiB tables; readiness to 64 GiB "
                        "(about 5 min on the H200; --time-budget caps it at 420 s + the last step)")
    p.add_argument("--row-bytes", type=_parse_row_bytes,
                   help="row sizes: bytes or e2b, e4b, ngram (comma-separated)")
    p.add_argument("--rows", type=_parse_ints, help=f"row counts per lookup (default {','.join(map(str, ROW_COUNTS))})")
    p.add_argument("--providers", type=_parse_providers, help=f"subset of {','.join(PROVIDERS)}")
    p.add_argument("--table-gib", type=_parse_floats, help="table sizes in GiB (comma-separated; 0.25 = 256 MiB)")
    p.add_argument("--readiness-gib", type=_parse_readiness,
                   help="readiness table sizes in GiB; 0 to skip readiness")
    p.add_argument("--no-readiness", action="store_true", help="skip the readiness measurements")
    p.add_argument("--safetensors-max-gib", type=float, help="largest safetensors file readiness writes")
    p.add_argument("--host-mem-gib", type=float,
                   help="host memory to trust (ballooned VMs report less at start); also lifts HostTable's "
                        "MemAvailable check")
    p.add_argument("--point-time", type=float, dest="point_time_s", help="seconds of timed work per point")
    p.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph replays")
    p.add_argument("--time-budget", type=float, dest="time_budget_s",
                   help="seconds after which no new table or readiness size is started (quick 110, full 420; "
                        "0 = no limit)")
    p.add_argument("--tmp-dir", help="where readiness writes its safetensors file (default /dev/shm or $TMPDIR)")
    p.add_argument("--out", help="output directory (default perf/results/<timestamp>_<gpu>/)")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p.parse_args(list(argv) if argv is not None else None)


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    readiness = ns.readiness_gib
    if ns.no_readiness or (readiness is not None and not readiness):
        readiness = ()
    return make_config(
        "full" if ns.full else "quick",
        row_bytes=ns.row_bytes, rows=ns.rows, providers=ns.providers, table_gib=ns.table_gib,
        readiness_gib=readiness, safetensors_max_gib=ns.safetensors_max_gib, host_mem_gib=ns.host_mem_gib,
        point_time_s=ns.point_time_s, graphs=False if ns.no_graphs else None, tmp_dir=ns.tmp_dir,
        time_budget_s=ns.time_budget_s,
        out=ns.out, plots=False if ns.no_plots else None, verbose=False if ns.quiet else None,
    )


def default_out_dir(meta: dict[str, Any]) -> Path:
    stamp = meta["timestamp"].replace("-", "").replace(":", "").replace("T", "_").rstrip("Z")
    gpu = "".join(c if c.isalnum() else "-" for c in str(meta.get("gpu_name", "gpu"))).strip("-")
    if meta.get("mode") != "gpu":
        gpu = "cpu-interpreter"
    return Path(__file__).resolve().parent / "results" / f"{stamp}_{gpu[:40]}"


def exit_code(rows: Sequence[dict[str, Any]]) -> int:
    """1 if any output mismatched, 2 if a provider failed (error rows), else 0."""
    if any(r.get("check") == "MISMATCH" for r in rows):
        return 1
    if any(r.get("check") == "error" for r in rows):
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``uvaple bench [options]``; returns the exit code (see :func:`exit_code`)."""
    ns = parse_args(argv)
    cfg = config_from_args(ns)
    meta = collect_meta(cfg)
    print(banner(meta), flush=True)
    out_dir = Path(cfg.out) if cfg.out else default_out_dir(meta)
    print(f"results will go to {out_dir}/ (saved after every table)", flush=True)

    def checkpoint(rows_so_far: list[dict[str, Any]]) -> None:
        write_results(rows_so_far, out_dir, dict(meta, partial=True), plots=False, config=cfg)

    t0 = time.perf_counter()
    rows = run_bench(cfg, meta=meta, checkpoint=checkpoint)
    elapsed = time.perf_counter() - t0
    meta["elapsed_s"] = round(elapsed, 1)
    if cfg.cuda:  # the link may train down at idle: read it again after the transfers
        index = torch.cuda.current_device()
        info = _gpu_info_nvml(index) or _gpu_info_smi(index)
        meta["pcie_link_end"] = info["pcie_link"] if info else "unknown"
    print()
    print(format_table(rows))
    if any(r.get("kind") == "readiness" for r in rows):
        print()
        print(format_readiness_table(rows))
    headline = format_headline(rows)
    if headline:
        print()
        print("headline (largest n: eager GB/s; smallest n: eager us; CUDA-graph figures in parentheses):")
        print(headline)
    written = write_results(rows, out_dir, meta, plots=cfg.plots, config=cfg)
    code = exit_code(rows)
    bad = [r for r in rows if r.get("check") == "MISMATCH"]
    errs = [r for r in rows if r.get("check") == "error"]
    print()
    if bad:
        print("!" * 100)
        print(f"!! OUTPUT MISMATCH in {len(bad)} row(s): these providers returned different rows for the same ids:")
        for r in bad:
            where = f"{r.get('row_bytes', '')} B n={r.get('n', '')}" if r["kind"] == "gather" else r["method"]
            print(f"!!   {r.get('provider') or r.get('method')} {where} {_fmt_gib(r['table_gib'])}: {r['error']}")
        print("!" * 100)
    if errs:
        print(f"!! {len(errs)} row(s) failed with errors (see the 'error' column); first: {errs[0]['error'][:200]}")
    if meta.get("mode") != "gpu":
        print("(CPU / Triton-interpreter times, not GPU figures)")
    print(f"done in {elapsed:.0f} s; exit code {code}; results in {out_dir}/")
    for name, path in written.items():
        print(f"  {name}: {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())

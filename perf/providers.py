"""The benchmark's providers (ours, the peers, the copy baseline, the memcpy ceiling) and its tables."""

from __future__ import annotations

import abc
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import command
from .config import CEILING, COPY_STAGING_BYTES, FILL_CHUNK_BYTES, GIB, GRAPH_PROVIDERS, BenchConfig, fmt_gib
from .meta import host_mem_total
from .timing import drain, quantiles


# --------------------------------------------------------------------------------------------- providers
def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def poison(t: torch.Tensor) -> None:
    t.view(-1).view(torch.uint8).fill_(0xA5)  # NaN-ish bf16 0xA5A5: never a value a gather writes by luck


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, int]:
    """(bit-identical, rows that differ)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False, int(ref.shape[0]) if ref.dim() else 1
    a = _bytes_view(out).view(out.shape[0], -1) if out.shape[0] else _bytes_view(out)
    b = _bytes_view(ref.to(out.device)).view(ref.shape[0], -1) if ref.shape[0] else _bytes_view(ref)
    if torch.equal(a, b):
        return True, 0
    return False, int((a != b).any(dim=-1).sum().item()) if a.dim() == 2 else 1


def _make_lookup(kind: str, table: Any, cfg: BenchConfig, **options: Any) -> Any:
    from uvaple.integration import make_lookup

    if cfg.cuda:
        return make_lookup(kind, table, **options)
    return make_lookup(kind, table, device=torch.device("cpu"), **options)


class Provider(abc.ABC):
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


class _BackendProvider(Provider):
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


class _PeerProvider(Provider):
    """A peer that reads the same table view: ``gather(view, ids, out)`` (see :mod:`uvaple.perf.peers`)."""

    capturable = True

    def __init__(self, name: str, gather: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 view: torch.Tensor) -> None:
        super().__init__()
        self.name, self._gather, self.view = name, gather, view

    def run(self, ids, ids_cpu, out):
        return self._gather(self.view, ids, out)


class _CeilingProvider(Provider):
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
def host_budget(cfg: BenchConfig) -> int:
    if cfg.host_mem_gib:
        return int(cfg.host_mem_gib * GIB)
    return host_mem_total()


def _fill_random(table: Any, cfg: BenchConfig, seed: int) -> None:
    """Random normal rows (never zeros: they hide unwritten outputs), generated on the GPU if there is one."""
    t = table.tensor
    if cfg.cuda:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        chunk = max(1, FILL_CHUNK_BYTES // table.row_bytes)
        for a in command.bar(range(0, table.rows, chunk), desc="filling the table", unit="chunk"):
            b = min(table.rows, a + chunk)
            g = torch.randn((b - a, table.cols), generator=gen, device="cuda", dtype=torch.float32)
            t[a:b].copy_(g.to(table.dtype))
        torch.cuda.synchronize()
    else:
        gen = torch.Generator().manual_seed(seed)
        t.copy_(torch.randn((table.rows, table.cols), generator=gen).to(table.dtype))


class TooBig(MemoryError):
    """A table the host cannot hold (by ``host_budget``): its points are skipped, not failed."""


def make_table(row_bytes: int, table_gib: float, cfg: BenchConfig, seed: int):
    from uvaple.uva import HostTable

    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    if row_bytes % itemsize:
        raise ValueError(f"row size {row_bytes} B is not a multiple of the {cfg.dtype} item size")
    cols = row_bytes // itemsize
    rows = max(64, int(table_gib * GIB) // row_bytes)
    need = rows * row_bytes
    budget = host_budget(cfg)
    if need + 4 * GIB > budget and cfg.cuda:
        raise TooBig(f"a {fmt_gib(table_gib)} table needs {need / GIB:.1f} GiB + 4 GiB headroom; the host "
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


def build_provider(name: str, table: Any, cfg: BenchConfig, device: torch.device,
                    ceiling_src: torch.Tensor | None, shared: dict[str, Any]) -> Provider:
    before = torch.cuda.memory_allocated(device) if cfg.cuda else 0
    prov: Provider
    if name in ("uva", "device"):
        prov = _BackendProvider(name, _make_lookup(name, table, cfg))
    elif name in ("copy", "copy-pipelined"):
        # One CopyBackend serves both forms (its pinned staging is max_in_flight × max_rows × row_bytes).
        if "copy" not in shared:
            shared["copy"] = _make_lookup("copy", table, cfg, **_copy_options(cfg, table.row_bytes))
        backend = shared["copy"]
        if name == "copy":
            prov = _CopyProvider(name, backend, ids_on_host=True)
        else:
            prov = PipelinedCopyProvider(backend, backend.max_in_flight, ids_on_host=True)
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
    but at most ``COPY_STAGING_BYTES`` of them (at 16384 × 128 KiB one slot is 2 GiB; 2 slots already
    overlap the CPU gather of one job with the copy of the other). The copy path gets its ids on the host
    (the scheduler has them there first: no device-to-host dependency)."""
    max_rows = max(cfg.rows)
    slots = max(2, min(cfg.copy_in_flight, COPY_STAGING_BYTES // max(1, max_rows * row_bytes)))
    return {"max_in_flight": slots, "max_rows": max_rows}


class PipelinedCopyProvider(Provider):
    """The copy backend at its best throughput: ``submit`` keeps ``depth`` jobs in flight.

    Timed differently from the others (see :func:`time_pipelined`): wall time per lookup in steady
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


def time_pipelined(prov: PipelinedCopyProvider, id_sets, outs: Sequence[torch.Tensor], reps: int,
                    cuda: bool) -> dict[str, float]:
    """Steady-state µs per lookup with up to ``depth`` jobs in flight.

    One continuous stream of ``depth + 3 × per`` jobs; the first ``depth`` completions are ramp-up, the
    rest are cut into 3 windows and each window's time per job is one sample (p20/median/p80 over them).
    """
    depth = min(prov.depth, len(outs))
    windows = 3
    per = max(2, reps // windows)
    count = depth + windows * per
    drain(cuda)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    stamps = prov.run_stream(id_sets, outs, count)
    drain(cuda)  # job.wait() made the current stream wait on every copy
    cpu1, wall1 = time.process_time(), time.perf_counter()
    base = depth - 1
    samples = [(stamps[base + (w + 1) * per] - stamps[base + w * per]) / per * 1e6 for w in range(windows)]
    p20, med, p80 = quantiles(samples)
    return {"us_p20": p20, "us_median": med, "us_p80": p80,
            "cpu_s_per_lookup": (cpu1 - cpu0) / count, "wall_us_per_lookup": (wall1 - wall0) / count * 1e6}

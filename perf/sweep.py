"""The gather sweep: every provider at every (row size, table size, row count) point, checked then timed."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from .config import (
    CEILING,
    CPU_CHECK_IDS,
    GIB,
    MIB,
    REFERENCE,
    ROTATION_BYTES,
    BenchConfig,
    error_text,
    fmt_gib,
    make_config,
    row_label,
)
from .meta import collect_meta
from .progress import Progress
from .providers import (
    PipelinedCopyProvider,
    Provider,
    TooBig,
    build_provider,
    compare,
    make_table,
    poison,
    time_pipelined,
)
from .readiness import readiness_estimate_s, release_pinned, run_readiness
from .timing import reps_for, sync, time_eager, time_graph


# ------------------------------------------------------------------------------------------------- sweep
def empty_row(meta: dict[str, Any], **kw: Any) -> dict[str, Any]:
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




def _id_sets_needed(n: int, row_bytes: int, reps: int) -> int:
    return int(min(max(2, reps), max(2, math.ceil(ROTATION_BYTES / max(1, n * row_bytes)))))


def _sweep_table(row_bytes: int, table_gib: float, cfg: BenchConfig, meta: dict[str, Any],
                 progress: Progress, ceiling_src: torch.Tensor | None, device: torch.device,
                 results: list[dict[str, Any]]) -> None:
    label = row_label(row_bytes)
    where = f"{label} {fmt_gib(table_gib)}"
    base = {"row_label": label, "row_bytes": row_bytes, "table_gib": table_gib,
            "dtype": str(cfg.dtype).replace("torch.", "")}
    try:
        progress.note(f"{where}: creating and filling the table")
        table, t_create, t_fill = make_table(row_bytes, table_gib, cfg, cfg.seed)
    except Exception as e:  # noqa: BLE001 - a table that cannot be built skips its points, loudly
        msg = error_text(e)
        # Our own size guard says "skipped"; anything else (allocation, registration) is an error.
        check = "skipped" if isinstance(e, TooBig) else "error"
        if check == "error" and "memory" in msg.lower() and cfg.host_mem_gib is None:
            msg += " (on a VM whose memory grows on demand pass --host-mem-gib)"
        print(f"!! {where}: table not built: {msg}", file=sys.stderr)
        for n in cfg.rows:
            for p in cfg.providers:
                progress.step(f"{where} n={n} {p} ({check})")
                results.append(empty_row(meta, provider=p, n=n, check=check,
                                          error=f"table not built: {msg}", **base))
        return
    base.update(cols=table.cols, table_rows=table.rows)
    progress.note(f"{where}: table ready ({t_create:.1f} s create, {t_fill:.1f} s random fill)")
    providers: dict[str, Provider] = {}
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
                providers[name] = build_provider(name, table, cfg, device, ceiling_src, shared)
            except Exception as e:  # noqa: BLE001
                build_errors[name] = f"build failed: {error_text(e)}"
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


def _sweep_point(n: int, table: Any, providers: dict[str, Provider], build_errors: dict[str, str],
                 cfg: BenchConfig, meta: dict[str, Any], base: dict[str, Any], progress: Progress,
                 device: torch.device, results: list[dict[str, Any]]) -> None:
    row_bytes = base["row_bytes"]
    where = f"{base['row_label']} {fmt_gib(base['table_gib'])} n={n}"
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
            poison(out)
            ref = providers[REFERENCE].run(ids_all[0], ids_cpu_all[0], out)
            sync(cfg.cuda)
            m = min(n, CPU_CHECK_IDS)
            cpu_rows = table.tensor.index_select(0, ids_cpu_all[0][:m])
            ok, bad = compare(ref[:m].cpu(), cpu_rows)
            if not ok:
                ref_note = f"uva differs from a CPU index_select of the table in {bad} of {m} rows"
        except Exception as e:  # noqa: BLE001
            ref = None
            ref_note = f"uva failed: {error_text(e)}"
    ref_name = "uva's output"
    if ref is None:
        # No uva output: the others are compared with a CPU index_select of the table instead.
        try:
            ref = table.tensor.index_select(0, ids_cpu_all[0]).to(device)
            ref_name = "a CPU index_select of the table"
        except Exception as e:  # noqa: BLE001
            ref_note = (ref_note + "; " if ref_note else "") + f"CPU reference failed: {error_text(e)}"

    for name in cfg.providers:
        progress.step(f"{where} {name}")
        row = empty_row(meta, provider=name, n=n, **base)
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
            row["error"] = error_text(e)
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


def _measure(prov: Provider, row: dict[str, Any], n: int, table: Any, ids_all: torch.Tensor,
             ids_cpu_all: torch.Tensor, n_sets: int, ref: torch.Tensor | None, ref_name: str, ref_note: str,
             cfg: BenchConfig, device: torch.device) -> None:
    row_bytes = table.row_bytes
    out = torch.empty((n, table.cols), dtype=table.dtype, device=device)

    # 1. correctness, before any timing
    t_first = time.perf_counter()
    if prov.gathers:
        poison(out)
        got = prov.run(ids_all[0], ids_cpu_all[0], out)
        sync(cfg.cuda)
        if prov.name == REFERENCE and ref_note:
            row["check"] = "error" if ref_note.startswith("uva failed") else "MISMATCH"
            row["error"] = ref_note
        elif ref is None:
            row["check"] = "unchecked"
            row["error"] = ref_note
        else:
            ok, bad = compare(got, ref)
            row["check"] = "ok" if ok else "MISMATCH"
            row["mismatch_rows"] = bad
            if not ok:
                row["error"] = f"{bad} of {n} rows differ from {ref_name}"
        del got
    else:
        row["check"] = "n/a"
        prov.run(ids_all[0], ids_cpu_all[0], out)
        sync(cfg.cuda)
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
    sync(cfg.cuda)
    if cfg.cuda:
        transient = max(0, torch.cuda.max_memory_allocated(device) - before)
        row["gpu_mem_bytes"] = prov.gpu_mem_bytes + transient
    probe = time_eager(call, n_sets, min(3, cfg.min_reps), cfg.cuda)
    reps = reps_for(cfg, probe["us_median"])
    if isinstance(prov, PipelinedCopyProvider):
        res = time_pipelined(prov, _id_getter(ids_all, ids_cpu_all, n_sets),
                              _pipeline_outs(out, prov.depth), reps, cfg.cuda)
    else:
        res = time_eager(call, n_sets, reps, cfg.cuda)
    row.update(res)
    row["reps"] = reps
    row["id_sets"] = n_sets
    row["gbps"] = n * row_bytes / (res["us_median"] * 1e-6) / 1e9 if res["us_median"] > 0 else None

    # 3. CUDA-graph replays (GPU time with host launch cost removed)
    if cfg.cuda and cfg.graphs and prov.capturable:
        def call_on(ids: torch.Tensor, o: torch.Tensor) -> Any:
            return prov.run(ids, ids, o)

        try:
            g = time_graph(call_on, out, table.rows, n, device, cfg)
            row.update(g)
            row["graph_gbps"] = n * row_bytes / (g["graph_us_median"] * 1e-6) / 1e9
            row["launch_overhead_us"] = res["us_median"] - g["graph_us_median"]
        except Exception as e:  # noqa: BLE001
            row["error"] = (row["error"] + "; " if row["error"] else "") + f"graph: {error_text(e)}"


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

# ------------------------------------------------------------------------------------------------ driver
def _ceiling_source(row_bytes: int, cfg: BenchConfig) -> torch.Tensor | None:
    """Pinned (CUDA) or plain (CPU) uint8 buffer of the largest point's bytes, filled with a pattern."""
    nbytes = max(cfg.rows) * row_bytes
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cfg.cuda)
        buf.fill_(0x5A)  # DMA speed does not depend on the bytes; not zeros all the same
        return buf
    except Exception as e:  # noqa: BLE001
        print(f"!! memcpy ceiling source ({nbytes / MIB:.0f} MiB) not allocated: {error_text(e)}",
              file=sys.stderr)
        return None

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
    reserve = readiness_estimate_s(cfg)

    def save() -> None:
        if checkpoint is not None:
            try:
                checkpoint(results)
            except Exception as e:  # noqa: BLE001 - a failed partial save must not stop the run
                print(f"!! saving partial results failed: {error_text(e)}", file=sys.stderr)

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
        release_pinned()
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
            progress.step(f"{row_label(row_bytes)} {fmt_gib(gib)} n={n} {p} (skipped)")
            results.append(empty_row(meta, provider=p, n=n, check="skipped", error=why, **base))

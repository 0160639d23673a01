"""Benchmark output: the console tables, the headline, JSON/CSV files and the plots."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .config import CEILING, MIB, PROVIDERS, REFERENCE, BenchConfig, fmt_gib, row_label


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
        line = (f"{r['provider']:<20} {fmt_gib(r['table_gib']):>7} {r['row_bytes']:>7} {r['n']:>6} "
                f"{_num(r.get('us_median'), '.1f', 9)} {spread:>15} {_num(r.get('gbps'), '.2f', 7)} "
                f"{_num(r.get('x_ceiling'), '.2f', 6)} {_num(r.get('x_uva'), '.2f', 6)} "
                f"{_num(r.get('graph_us_median'), '.2f', 9)} {_num(r.get('graph_x_ceiling'), '.2f', 7)} "
                f"{_num(cpu_us, '.1f', 8)} {_num(mib, '.0f', 8)} "
                f"{r.get('check', '')}")
        if r.get("error"):
            line += f"  [{r['error'][:160]}]"
        lines.append(line)
    return "\n".join(lines)


#: what each column of :func:`format_table` is (printed under it, and written to summary.txt)
TABLE_LEGEND = (
    "columns: us_med and p20-p80 eager microseconds a lookup (median, 20th-80th percentile); GB/s the rows' "
    "bytes over us_med; xceil GB/s over memcpy-ceiling's (a contiguous pinned copy of the same bytes, the "
    "link's best), xuva over uva's; graph_us the same call replayed from a CUDA graph (launch cost removed) and "
    "g_xceil its GB/s over the graph-timed ceiling; cpu_us host CPU time a lookup, every thread; gpu_MiB device "
    "memory the provider holds; check its rows against uva's (ok: bit for bit).")
#: under a CPU run's table: why its ratios are no bound
CPU_LEGEND = (
    "CPU run: every provider and the ceiling are CPU copies here (no link is crossed), and the ceiling copies one "
    "contiguous block while the providers gather rows into buffers already warm in cache: a provider above 1.00 "
    "xceil here breaks no bound; the ratios mean something on a GPU only.")


def format_readiness_table(rows: Iterable[dict[str, Any]]) -> str:
    """One line per readiness measurement: method, size, seconds, GiB/s, check."""
    lines = [f"{'method':<52} {'size':>7} {'seconds':>9} {'GiB/s':>8} check"]
    for r in rows:
        if r.get("kind") != "readiness":
            continue
        line = (f"{r['method']:<52} {fmt_gib(r['table_gib']):>7} {_num(r.get('seconds'), '.3f', 9)} "
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
            lines.append(f"{row_label(rb):>9} {fmt_gib(gib):>7} n={n:<6} {unit:>4}: " + " | ".join(parts))
    return "\n".join(lines)


def banner(meta: dict[str, Any]) -> str:
    """The lines printed first: what machine, and whether the times are GPU figures at all."""
    lines = []
    if meta.get("mode") != "gpu":
        lines.append("=" * 100)
        lines.append("CPU RUN (no CUDA GPU here, or --smoke): CPU / Triton-interpreter times, NOT GPU figures. It")
        lines.append("checks that every provider returns the same rows; memcpy-ceiling is a CPU memcpy and no CUDA")
        lines.append("graphs are timed.")
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
    legend = TABLE_LEGEND if meta.get("mode") == "gpu" else TABLE_LEGEND + "\n" + CPU_LEGEND
    path.write_text(banner(meta) + "\n\n" + format_table(rows) + "\n" + legend + "\n\n" +
                    format_readiness_table(rows) + "\n")
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
                            label=f"uva @ {fmt_gib(gib)}")
            ceil = [r["gbps"] for r in pts if r["provider"] == CEILING]
            if ceil:
                ax.axhline(max(ceil), color="grey", linestyle=":", linewidth=1,
                           label=f"ceiling max {max(ceil):.1f} GB/s")
            _log_log_axes(ax, "rows per lookup (n)", "GB/s (n × row bytes / median time)",
                          f"{row_label(rb)} rows ({rb} B), table {fmt_gib(biggest)}")
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

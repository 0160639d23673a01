"""``uvaple bench``: gather latency and bandwidth of every PLE provider, and table readiness, in one run.

What one run measures (all ratios come from the same run, never a lone time):

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
code 1. A provider that fails reports its error in its row and the run goes on (exit code 3 at the end).

Without CUDA, or with ``--smoke`` on any machine, the same code runs tiny sizes under the Triton interpreter
(chosen for CPU tensors) on CPU tensors: a correctness run whose times are interpreter times, not GPU figures
(the banner says so).

The command line (every workload's, :mod:`uvaple.perf.command`): what this machine cannot run (``--full``
without CUDA, a table bigger than free host memory) is refused before anything is built, exit status 2,
naming the flag that runs here; ``--out`` is made and checked writable before any work; progress goes to
stderr, results to stdout and ``--out``, whose path is the last line.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from uvaple.machine import gpu_info

from . import command
from .config import CEILING, GIB, PRESETS, PROVIDERS, ROW_BYTES, ROW_COUNTS, BenchConfig, fmt_gib, make_config
from .meta import collect_meta
from .report import (
    CPU_LEGEND,
    TABLE_LEGEND,
    banner,
    format_headline,
    format_readiness_table,
    format_table,
    write_results,
)
from .sweep import empty_row, run_bench

# The pieces live in config, meta, timing, providers, sweep, readiness and report; this module is the
# command line and re-exports what its users (and tests) call.
__all__ = ["BenchConfig", "PRESETS", "PROVIDERS", "ROW_BYTES", "ROW_COUNTS", "CEILING", "collect_meta",
           "empty_row", "format_readiness_table", "format_table", "format_headline", "banner", "main",
           "make_config", "parse_args", "config_from_args", "run_bench", "write_results", "default_out_dir",
           "exit_code"]


# ---------------------------------------------------------------------------------------------------- CLI
def _parse_row_bytes(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            if part in ROW_BYTES:
                out.append(ROW_BYTES[part])
            elif part.endswith("k") or part.endswith("kib"):
                out.append(int(float(part.removesuffix("kib").removesuffix("k")) * 1024))
            else:
                out.append(int(part))
        except ValueError:
            out = []
            break
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected row sizes in bytes (17920, 128k) or {', '.join(ROW_BYTES)}, "
                                         f"comma-separated, got {text!r}")
    return tuple(out)


def _parse_ints(text: str) -> tuple[int, ...]:
    return tuple(command.positive_ints(text))


def _floats(text: str) -> tuple[float, ...] | None:
    try:
        vals = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        return None
    return vals if vals and all(v == v for v in vals) else None


def _parse_floats(text: str) -> tuple[float, ...]:
    vals = _floats(text)
    if vals is None or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected sizes in GiB above 0, comma-separated (0.25 = 256 MiB), got "
                                         f"{text!r}")
    return vals


def _parse_readiness(text: str) -> tuple[float, ...]:
    vals = _floats(text)
    if vals is None or min(vals) < 0:
        raise argparse.ArgumentTypeError(f"expected sizes in GiB, comma-separated (0 skips readiness), got {text!r}")
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
                    "memcpy ceiling, plus table readiness (the ple workload). Without CUDA, or with --smoke: a "
                    "small correctness run on the CPU under the Triton interpreter (about a minute on 2 cores).",
        epilog=command.EXIT_STATUSES + " Progress goes to stderr, results to stdout and --out.")
    p.add_argument("--workload", choices=tuple(command.WORKLOADS), default="ple",
                   help="what to measure: " + "; ".join(f"{k}: {v}" for k, v in command.WORKLOADS.items())
                        + ". Each takes its own options, and each takes --out, --smoke and --quiet: "
                          "uvaple bench --workload NAME --help")
    p.add_argument("--smoke", action="store_true",
                   help="the small CPU run on any machine: 4 MiB tables of E4B and 128-KiB rows, 1/8/64 ids, "
                        "readiness at 16 and 64 MiB, interpreted kernels (correctness, not GPU figures); what "
                        "runs without CUDA anyway")
    p.add_argument("--full", action="store_true",
                   help="whole sweep on a GPU: E2B, E4B, 128-KiB rows x 1, 8, 32, 64 GiB tables; readiness to "
                        "64 GiB (about 5 min on the H200; --time-budget caps it at 420 s + the last step)")
    p.add_argument("--row-bytes", type=_parse_row_bytes,
                   help="row sizes: bytes or e2b, e4b, ngram (comma-separated; default e4b, --full "
                        "e2b,e4b,ngram, --smoke e4b,ngram)")
    p.add_argument("--rows", type=_parse_ints,
                   help=f"row counts per lookup (default {','.join(map(str, ROW_COUNTS))}; --smoke 1,8,64)")
    p.add_argument("--providers", type=_parse_providers, help=f"subset of {','.join(PROVIDERS)} (default all)")
    p.add_argument("--table-gib", type=_parse_floats,
                   help="table sizes in GiB (comma-separated; 0.25 = 256 MiB; default 1,8, --full 1,8,32,64, "
                        "--smoke 4 MiB); each must fit in free host memory")
    p.add_argument("--readiness-gib", type=_parse_readiness,
                   help="readiness table sizes in GiB; 0 to skip readiness (default as --table-gib; --smoke 16 "
                        "and 64 MiB)")
    p.add_argument("--no-readiness", action="store_true", help="skip the readiness measurements")
    p.add_argument("--safetensors-max-gib", type=command.number(meaning="GiB"),
                   help="largest safetensors file readiness writes (default 8, --full 32, --smoke 64 MiB)")
    p.add_argument("--host-mem-gib", type=command.number(meaning="GiB"),
                   help="host memory to trust (ballooned VMs report less at start); also lifts HostTable's "
                        "MemAvailable check and the up-front size check")
    p.add_argument("--point-time", type=command.number(meaning="seconds"), dest="point_time_s",
                   help="seconds of timed work per point (default 0.05, --full 0.04; --smoke: 2 calls)")
    p.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph replays (none run without CUDA)")
    p.add_argument("--time-budget", type=command.number(inclusive=True, meaning="seconds; 0: no limit"),
                   dest="time_budget_s",
                   help="seconds after which no new table or readiness size is started (default 110, --full "
                        "420, --smoke none; 0 = no limit)")
    p.add_argument("--tmp-dir", help="where readiness writes its safetensors file (default /dev/shm, else $TMPDIR "
                                     "or /tmp)")
    p.add_argument("--out", help="output directory, made and checked writable before any work (default "
                                 "./uvaple-results/<UTC time>_ple_<gpu or cpu>/)")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p.parse_args(list(argv) if argv is not None else None)


def config_from_args(ns: argparse.Namespace) -> BenchConfig:
    readiness = ns.readiness_gib
    if ns.no_readiness or (readiness is not None and not readiness):
        readiness = ()
    smoke = getattr(ns, "smoke", False)
    return make_config(
        "cpu" if smoke else "full" if ns.full else "quick", cuda=False if smoke else None,
        row_bytes=ns.row_bytes, rows=ns.rows, providers=ns.providers, table_gib=ns.table_gib,
        readiness_gib=readiness, safetensors_max_gib=ns.safetensors_max_gib, host_mem_gib=ns.host_mem_gib,
        point_time_s=ns.point_time_s, graphs=False if ns.no_graphs else None, tmp_dir=ns.tmp_dir,
        time_budget_s=ns.time_budget_s,
        out=ns.out, plots=False if ns.no_plots else None, verbose=False if ns.quiet else None,
    )


def check_runnable(ns: argparse.Namespace, cfg: BenchConfig) -> None:
    """Refuse (:class:`command.Refused`) what this machine cannot run, before anything is built: ``--full``
    without CUDA or with ``--smoke``, a table or readiness size bigger than free host memory."""
    if ns.full and ns.smoke:
        raise command.Refused("--full (the GPU sweep) and --smoke (the small CPU run) exclude each other: "
                              "give one")
    if ns.full:
        command.needs_cuda("--full (the GPU sweep)", "Run without --full (or with --smoke) for the small CPU "
                                                     "correctness run")
    smoke = "--smoke" if cfg.cuda else "the default sizes (as --smoke)"
    for gib in cfg.table_gib:
        command.check_fits(int(gib * GIB), f"a {fmt_gib(gib)} table (--table-gib)",
                           f"Pass a smaller --table-gib, or {smoke}", trust_gib=cfg.host_mem_gib)
    for gib in cfg.readiness_gib:
        command.check_fits(int(gib * GIB), f"readiness at {fmt_gib(gib)} (--readiness-gib)",
                           "Pass a smaller --readiness-gib, or --no-readiness", trust_gib=cfg.host_mem_gib)


def default_out_dir(meta: dict[str, Any]) -> Path:
    """``./uvaple-results/<stamp>_ple_<gpu or cpu>/`` under the current directory (never inside the package)."""
    stamp = meta["timestamp"].replace("-", "").replace(":", "").replace("T", "_").rstrip("Z")
    gpu = "".join(c if c.isalnum() else "-" for c in str(meta.get("gpu_name", "gpu"))).strip("-")
    return command.default_out_dir("ple", gpu[:40] if meta.get("mode") == "gpu" else "cpu", stamp)


def exit_code(rows: Sequence[dict[str, Any]]) -> int:
    """:data:`~command.EXIT_MISMATCH` if any output mismatched, :data:`~command.EXIT_FAILED` if a provider failed
    (error rows), else 0."""
    if any(r.get("check") == "MISMATCH" for r in rows):
        return command.EXIT_MISMATCH
    if any(r.get("check") == "error" for r in rows):
        return command.EXIT_FAILED
    return 0


def _workload(argv: list[str]) -> tuple[str, list[str]]:
    """``--workload NAME`` (``ple``, the default, ``ngram``, ``hotset``, ``host`` or ``disk``) and the other
    arguments."""
    rest, name = [], "ple"
    it = iter(argv)
    for a in it:
        if a == "--workload":
            name = next(it, "")
        elif a.startswith("--workload="):
            name = a.split("=", 1)[1]
        else:
            rest.append(a)
    if name not in command.WORKLOADS:
        raise SystemExit(f"uvaple bench: --workload must be 'ple' (Gemma 3n-shaped rows, the default), 'ngram' "
                         f"(160-byte n-gram rows at random), 'hotset' (token-id rows: hot set, dedup, fp8) or "
                         f"'host' (the host's cost of one eager call) or 'disk' (random reads of a table file), "
                         f"got {name!r}")
    return name, rest


def main(argv: Sequence[str] | None = None) -> int:
    """``uvaple bench [options]``; returns the exit code (see :func:`exit_code`; 2 also for a run refused up
    front). ``--workload ngram|hotset|host|disk`` runs that workload's module (its own options) instead."""
    try:
        workload, argv = _workload(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return command.refuse("uvaple bench", command.Refused(str(e).removeprefix("uvaple bench: ")))
    if workload == "ngram":
        from . import ngram

        return ngram.main(argv)
    if workload == "hotset":
        from . import hotset

        return hotset.main(argv)
    if workload == "host":
        from . import host_cost

        return host_cost.main(argv)
    if workload == "disk":
        from . import disk

        return disk.main(argv)
    ns = parse_args(argv)
    cfg = config_from_args(ns)
    try:
        check_runnable(ns, cfg)
        meta = collect_meta(cfg)
        out_dir = command.prepare_out(cfg.out, default_out_dir(meta))
    except command.Refused as e:
        return command.refuse("uvaple bench", e)
    print(banner(meta), flush=True)
    print(f"results will go to {out_dir}/ (saved after every table)", flush=True)

    def checkpoint(rows_so_far: list[dict[str, Any]]) -> None:
        write_results(rows_so_far, out_dir, dict(meta, partial=True), plots=False, config=cfg)

    t0 = time.perf_counter()
    with command.progress(cfg.verbose):
        try:
            rows = run_bench(cfg, meta=meta, checkpoint=checkpoint)
        except BaseException as e:  # say where the tables finished so far are, and fail as before
            print(f"the run failed ({type(e).__name__}: {str(e)[:200]}); the tables it finished are in "
                  f"{out_dir}/ (saved after every table; none if it failed in the first)", file=sys.stderr)
            raise
    elapsed = time.perf_counter() - t0
    meta["elapsed_s"] = round(elapsed, 1)
    if cfg.cuda:  # the link may train down at idle: read it again after the transfers
        index = torch.cuda.current_device()
        info = gpu_info(index)
        meta["pcie_link_end"] = info["pcie_link"] if info else "unknown"
    print()
    print(format_table(rows))
    print(TABLE_LEGEND if cfg.cuda else TABLE_LEGEND + "\n" + CPU_LEGEND)
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
            print(f"!!   {r.get('provider') or r.get('method')} {where} {fmt_gib(r['table_gib'])}: {r['error']}")
        print("!" * 100)
    if errs:
        print(f"!! {len(errs)} row(s) failed with errors (see the 'error' column); first: {errs[0]['error'][:200]}")
    if meta.get("mode") != "gpu":
        print("(CPU / Triton-interpreter times, not GPU figures)")
    print(f"done in {elapsed:.0f} s; exit code {code}")
    command.wrote(out_dir, written.values())
    return code


if __name__ == "__main__":
    sys.exit(main())

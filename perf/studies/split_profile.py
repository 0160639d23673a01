"""Where does a split lookup's time go, stage by stage on the host, call by call?

``python3 perf/studies/split_profile.py [--table-gib 24] [--rows 65536,1048576] [--share S]``

The n-gram shape (160-B fp8 rows, random ids, a fresh id set each call: no cached rates). The stages
``lookup_split`` calls (an eager GPU share's launch, the CPU's share whole, and within it the id pass and
the gather with its copies up) are wrapped with timestamps; per ``n``, the median µs of each stage and
of the gaps between them, the call's host time and the wait for the stream after it. Each ``n`` at the
plan's GPU share and at share 0 (the CPU alone, through the same call); before each call, a bare
``index_select`` of as many other fresh ids as the CPU's share, timed, to set beside the split's
``gather_up`` (``host_rates.py`` beside it has the rates of each reader by threads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from host_rates import fresh_id_sets

import uvaple.integration.placements.split as lookup_mod  # the split's module: its globals are wrapped below
from uvaple.integration import SplitLookup, TableSpec
from uvaple.perf.timing import cuda_missing
from uvaple.perf.vllm_shapes import random_table

ROW_BYTES = 160
GIB = 1 << 30


def _wrap(marks: list, name: str, fn):
    def timed(*args, **kwargs):
        marks.append((name + ">", time.perf_counter()))
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append((name + "<", time.perf_counter()))
    return timed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 perf/studies/split_profile.py", description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=24.0)
    p.add_argument("--rows", default="16384,65536,262144,1048576")
    p.add_argument("--share", type=float, default=None, help="the GPU's share (default: SPLIT_PLAN)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--ab", type=int, default=0, metavar="N",
                   help="then N calls of each way to launch the CPU share's policy kernel, taking turns")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="then N calls at the plan's share of each n under cProfile: the host functions by own time")
    a = p.parse_args(argv)
    if cuda_missing(p.prog):
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    ns = [int(x) for x in a.rows.split(",")]
    table = random_table(int(a.table_gib * GIB) // ROW_BYTES, ROW_BYTES, torch.float8_e4m3fn, seed=7)
    scale = torch.tensor([0.37], device=dev)
    spec = TableSpec.of(table, encoding="fp8_global", out_dtype=torch.bfloat16)
    lk = SplitLookup(table, spec, dev, dequant_scale=scale, count=False, max_rows=max(ns))
    out = torch.empty(max(ns), ROW_BYTES, dtype=torch.bfloat16, device=dev)
    marks: list = []
    saved = {name: getattr(lookup_mod, name) for name in ("split_rows", "gather_up")}
    for name, fn in saved.items():
        setattr(lookup_mod, name, _wrap(marks, name, fn))
    # an eager GPU share: the inner gather lookup's call (a graph's replay is not wrapped)
    lk.gather.lookup = _wrap(marks, "gpu_launch", lk.gather.lookup)
    lk._stage_cpu_share = _wrap(marks, "cpu_share", lk._stage_cpu_share)
    print(f"torch intra-op threads {torch.get_num_threads()}; table {table.nbytes / GIB:.1f} GiB", flush=True)
    try:
        src = table.tensor.view(torch.uint8)
        staging = torch.empty(max(ns), ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        for n in ns:
            plan = lookup_mod.split_gpu_share(n, ROW_BYTES, table.nbytes) if a.share is None else a.share
            sets = fresh_id_sets(n, table.rows, seed=n)
            for share in sorted({plan, 0.0}, reverse=True):  # the plan's split, and the CPU alone through it
                k = round(n * share)
                k = lk._split.graph_rows(k, n) or k  # as lookup_split rounds it
                spans: dict[str, list[float]] = {}
                for r in range(a.reps + 2):
                    ids = sets[r % len(sets)]
                    # the CPU share's gather alone first, on other ids (fresh rows, as the split's are)
                    other = sets[(r + len(sets) // 2) % len(sets)][k:]
                    torch.cuda.synchronize(dev)
                    c0 = time.perf_counter()
                    torch.index_select(src, 0, other, out=staging[: n - k])
                    c1 = time.perf_counter()
                    marks.clear()
                    t0 = time.perf_counter()
                    lk.lookup_split(ids, out[:n], gpu_share=share)
                    t1 = time.perf_counter()
                    torch.cuda.current_stream(dev).synchronize()
                    t2 = time.perf_counter()
                    if r < 2:
                        continue
                    seq = [("call>", t0)] + marks + [("call<", t1), ("synced", t2)]
                    for (na, ta), (nb, tb) in zip(seq, seq[1:], strict=False):
                        spans.setdefault(f"{na}..{nb}", []).append((tb - ta) * 1e6)
                    spans.setdefault("host call", []).append((t1 - t0) * 1e6)
                    spans.setdefault("whole", []).append((t2 - t0) * 1e6)
                    spans.setdefault("the CPU share's index_select alone", []).append((c1 - c0) * 1e6)
                print(f"n {n:8d} gpu share {share:.2f}: " +
                      " | ".join(f"{k} {statistics.median(v):.0f}us" for k, v in spans.items()), flush=True)
        for name, fn in saved.items():
            setattr(lookup_mod, name, fn)
        if a.ab:
            _ab(lk, out, ns, table.rows, a.share, a.ab)
        if a.cprofile:
            _cprofile(lk, out, ns, table.rows, a.share, a.cprofile)
    finally:
        for name, fn in saved.items():
            setattr(lookup_mod, name, fn)
        lk.close()
        table.close()
    return 0


def _ab(lk, out, ns, rows: int, share, calls: int) -> None:
    """The CPU share's policy kernel launched two ways, taking turns call by call (so the machine's drift
    falls on both): through the split state's plan (``sp.policy.run``, as shipped; printed as "prepared
    launch") and through the ``uvaple::gather_rows`` operator with its checks (no plan handle: the operator
    checks every argument and makes its launcher each call); the median host time of the call and its time to
    completion, at the plan's share and at share 0."""
    sp, spec = lk._split, lk.spec
    prepared = sp.policy  # a GatherPlan over the staged rows

    class ThroughOp:
        """Stands in for the split state's plan: ``run(ids, out)`` through the operator."""

        @staticmethod
        def run(ids, o, col_start=0):
            torch.ops.uvaple.gather_rows(sp.staged_rows[: ids.shape[0]], ids, o, lk._counters, lk.gather._dq_scale,
                                         spec.scale_arg, spec.has_scale, col_start, 0, 0, spec.oob_mode, spec.dequant)

    ways = {"prepared launch": prepared, "operator": ThroughOp()}
    names = list(ways)
    try:
        for n in ns:
            plan = lookup_mod.split_gpu_share(n, ROW_BYTES, 0) if share is None else share
            sets = fresh_id_sets(n, rows, seed=n + 2)
            for s in sorted({plan, 0.0}, reverse=True):
                host = {w: [] for w in ways}
                whole = {w: [] for w in ways}
                for r in range(len(ways) * (calls + 2)):
                    w = names[r % len(names)]
                    sp.policy = ways[w]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    lk.lookup_split(sets[r % len(sets)], out[:n], gpu_share=s)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    if r >= 2 * len(ways):
                        host[w].append((t1 - t0) * 1e6)
                        whole[w].append((t2 - t0) * 1e6)
                print(f"n {n:8d} gpu share {s:.2f} policy by: " + " | ".join(
                    f"{w} host {statistics.median(host[w]):.0f}us whole {statistics.median(whole[w]):.0f}us"
                    for w in ways), flush=True)
    finally:
        sp.policy = prepared


def _cprofile(lk, out, ns, rows: int, share, calls: int) -> None:
    """``calls`` split calls of each ``n`` (fresh ids, the stream synchronised after each, outside the profile)
    under cProfile: the 22 functions with the most own time, per call."""
    import cProfile
    import pstats

    for n in ns:
        sets = fresh_id_sets(n, rows, seed=n + 1)
        prof = cProfile.Profile()
        for r in range(calls + 2):
            if r >= 2:
                prof.enable()
            lk.lookup_split(sets[r % len(sets)], out[:n], gpu_share=share)
            prof.disable()
            torch.cuda.synchronize()
        st = pstats.Stats(prof)
        top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:22]
        print(f"n {n:8d} cProfile, us per call (own / with callees, calls per call):", flush=True)
        for (file, line, fn), (_, ncalls, tottime, cumtime, _) in top:
            print(f"  {tottime / calls * 1e6:8.1f} {cumtime / calls * 1e6:8.1f} {ncalls / calls:6.1f}  "
                  f"{fn} ({file.rsplit('/', 1)[-1]}:{line})", flush=True)


if __name__ == "__main__":
    sys.exit(main())

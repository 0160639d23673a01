"""Where are random small-row reads bound on this host: the CPU's threads, the GPU, or both at once?

``python3 perf/studies/host_rates.py [--table-gib 24] [--rows 65536,1048576] [--threads 1,2,4,8,16]
[--spans 1,0]``

160-B rows (the n-gram shape), uniform random ids over the first ``span`` GiB of the table (0: all of
it). Every repetition reads a fresh id set (sets are cycled only after enough rows to flush the host's
last-level cache), so no rate below is a cached one. Per span and ``n``, median µs and M rows/s of:

* ``cpu-torch T``: ``torch.index_select`` on ``T`` intra-op threads into pinned staging;
* ``cpu-numba T``: the copy backend's numba word gather (``cpu_gather(path="parallel")``) on ``T`` threads;
* ``gpu-sorted`` / ``gpu-direct``: the GPU's gathers of raw row bytes alone (event-timed);
* ``idle`` / ``both``: after 2 ms idle, this thread's ``index_select`` of ``n`` other ids on every thread,
  alone or while the GPU's sorted gather of ``n`` ids runs (launched first); each side's own time and
  the pair's combined rate; ``+wake``: a small parallel op first, so that the pool is awake.

Beside each other, each reader keeps some fraction of its rate alone; a perfect split of a call moves the
sum of the two rates, which bounds what ``SplitLookup.lookup_split`` can gain over the CPU alone (before
the copy up of the CPU's rows, which the split overlaps with the GPU's reads and the CPU alone does not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from uvaple.integration.placements.host_gather import cpu_gather
from uvaple.perf.timing import cuda_missing
from uvaple.perf.vllm_shapes import random_table

ROW_BYTES = 160
GIB = 1 << 30
FLUSH_BYTES = 512 << 20  # the id sets of one point touch at least this much table between reuses


def _host_facts() -> dict:
    facts = {"cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            facts["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    for key, path in (("thp", "/sys/kernel/mm/transparent_hugepage/enabled"),):
        try:
            with open(path) as f:
                facts[key] = f.read().strip()
        except OSError:
            pass
    return facts


def fresh_id_sets(n: int, rows: int, seed: int) -> list[torch.Tensor]:
    """Sets of ``n`` random ids over ``rows`` rows, enough of them that cycling through them touches at least
    ``FLUSH_BYTES`` of 160-B rows between two uses of one set (3 to 64 sets)."""
    k = max(3, min(64, -(-FLUSH_BYTES // (n * ROW_BYTES))))
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, rows, (n,), generator=g) for _ in range(k)]


def _median_us(fn, sets: list[torch.Tensor], reps: int) -> float:
    ts = []
    for r in range(reps + 2):
        ids = sets[r % len(sets)]
        t0 = time.perf_counter()
        fn(ids)
        if r >= 2:
            ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def _gpu_us(fn, sets: list[torch.Tensor], reps: int) -> float:
    ts = []
    for r in range(reps + 2):
        ids = sets[r % len(sets)]
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(ids)
        b.record()
        b.synchronize()
        if r >= 2:
            ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def _pair(gpu_call, src, staging, dev_sets, cpu_sets, wake: bool, reps: int) -> tuple[float, float, float]:
    """Median µs of (the GPU's call, this thread's ``index_select``, the whole) when the GPU's call is
    launched and the CPU gathers other ids meanwhile (``gpu_call`` None: the CPU alone), each after the
    threads idled 2 ms (as between the steps of a server); ``wake``: a small parallel op (the ids'
    ``aminmax``, which a split's range check runs anyway) first, so that torch's pool is awake when the
    gather starts."""
    g, c, w = [], [], []
    for r in range(reps + 2):
        ids = cpu_sets[r % len(cpu_sets)]
        torch.cuda.synchronize()
        time.sleep(0.002)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        w0 = time.perf_counter()
        if wake:
            torch.aminmax(ids)
        ev0.record()
        if gpu_call is not None:
            gpu_call(dev_sets[r % len(dev_sets)])
        ev1.record()
        c0 = time.perf_counter()
        torch.index_select(src, 0, ids, out=staging)
        c1 = time.perf_counter()
        ev1.synchronize()
        w1 = time.perf_counter()
        if r >= 2:
            g.append(ev0.elapsed_time(ev1) * 1e3)
            c.append((c1 - c0) * 1e6)
            w.append((w1 - w0) * 1e6)
    return statistics.median(g), statistics.median(c), statistics.median(w)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 perf/studies/host_rates.py", description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=24.0)
    p.add_argument("--rows", default="65536,1048576")
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--spans", default="1,0", help="table spans in GiB read at random (0: the whole table)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--out", help="a JSON file for the results")
    a = p.parse_args(argv)
    if cuda_missing(p.prog):
        return 2
    import numba

    dev = torch.device("cuda", torch.cuda.current_device())
    ns = [int(x) for x in a.rows.split(",")]
    threads = [int(x) for x in a.threads.split(",")]
    all_threads = max(threads)
    t0 = time.perf_counter()
    table = random_table(int(a.table_gib * GIB) // ROW_BYTES, ROW_BYTES, torch.uint8, seed=7)
    src_all = table.tensor.view(torch.uint8)
    view_all = table.cuda_view().view(torch.uint8)
    facts = _host_facts()
    print(f"# {table.rows:,} rows of {ROW_BYTES} B ({table.nbytes / GIB:.1f} GiB, stride {table.stride_bytes} B) in "
          f"{time.perf_counter() - t0:.1f} s; {facts}; numba threads {numba.get_num_threads()}", flush=True)
    nmax = max(ns)
    staging = torch.empty(nmax, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    staging_np = staging.numpy()
    out = torch.empty(nmax, ROW_BYTES, dtype=torch.uint8, device=dev)
    ws = torch.empty(2, nmax, dtype=torch.int64, device=dev)
    zero = np.zeros(1, dtype=np.uint8)
    recs = []
    try:
        for span_gib in (float(x) for x in a.spans.split(",")):
            rows = table.rows if span_gib <= 0 else min(table.rows, int(span_gib * GIB) // table.stride_bytes)
            src, view = src_all[:rows], view_all[:rows]
            src_np = src.numpy()
            for n in ns:
                sets = fresh_id_sets(n, rows, seed=n + rows)
                others = fresh_id_sets(n, rows, seed=n + rows + 1)
                dev_sets = [s.to(dev) for s in sets]
                rec = {"span_gib": rows * table.stride_bytes / GIB, "n": n, "us": {}}
                us = rec["us"]
                for t in threads:
                    torch.set_num_threads(t)
                    us[f"cpu-torch {t}"] = _median_us(
                        lambda i, n=n, src=src: torch.index_select(src, 0, i, out=staging[:n]), sets, a.reps)
                torch.set_num_threads(all_threads)
                time.sleep(0.3)  # torch's pool idles before numba's runs
                for t in threads:
                    numba.set_num_threads(min(t, numba.config.NUMBA_NUM_THREADS))
                    us[f"cpu-numba {t}"] = _median_us(
                        lambda i, n=n, s=src_np: cpu_gather(s, i.numpy(), staging_np[:n], 0, True, zero,
                                                            path="parallel"), sets, a.reps)
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
                time.sleep(0.3)

                def direct(i, n=n, view=view):
                    torch.ops.uvaple.gather_rows(view, i, out[:n], None, None, 0, False, 0, 0, 0, 0, 0)

                def ordered(i, n=n, view=view):
                    torch.ops.uvaple.gather_rows_sorted(view, i, out[:n], None, None, ws, 0, False, 0, 0, 0,
                                                        0, 0, False)

                us["gpu-direct"] = _gpu_us(direct, dev_sets, a.reps)
                us["gpu-sorted"] = _gpu_us(ordered, dev_sets, a.reps)
                for name, gpu, wake in (("idle", False, False), ("idle+wake", False, True), ("both", True, False),
                                        ("both+wake", True, True)):
                    g_us, c_us, w_us = _pair(ordered if gpu else None, src, staging[:n], dev_sets, others, wake,
                                             a.reps)
                    us[f"{name}: cpu-torch"] = c_us
                    us[f"{name}: wall"] = w_us
                    if gpu:
                        us[f"{name}: gpu-sorted"] = g_us
                rec["rows_per_s_m"] = {k: n / v for k, v in us.items()}
                # each reader's rate beside the other against alone, and what a perfect split would move
                rec["cpu_kept"] = us["idle+wake: cpu-torch"] / us["both+wake: cpu-torch"]
                rec["gpu_kept"] = us["gpu-sorted"] / us["both+wake: gpu-sorted"]
                both_rate = n / us["both+wake: cpu-torch"] + n / us["both+wake: gpu-sorted"]
                rec["split_bound_over_cpu"] = both_rate / (n / us["idle+wake: cpu-torch"])
                recs.append(rec)
                print(f"span {rec['span_gib']:6.2f} GiB n {n:8d}: " +
                      " ".join(f"[{k}] {v:.0f}us {n / v:.0f}M/s" for k, v in us.items()) +
                      f" | beside each other the CPU keeps {rec['cpu_kept']:.2f} and the GPU {rec['gpu_kept']:.2f} of "
                      f"its rate: a perfect split moves {rec['split_bound_over_cpu']:.2f}x the CPU's rows", flush=True)
    finally:
        table.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "host": facts, "row_bytes": ROW_BYTES,
                       "results": recs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

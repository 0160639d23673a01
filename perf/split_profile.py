"""Where a split lookup's time goes: each stage of ``lookup_split`` timed alone, then the whole call.

``python -m uvaple.perf.split_profile [--table-gib 24] [--rows 256,65536,1048576] [--threads 4,8,16]``

The n-gram shape (160-B fp8 rows, random ids). Per n, to completion (a stream synchronisation after each
call), median µs of:

* ``gpu``: the GPU share alone (``lookup`` on device ids: direct or sorted as ``order='auto'`` picks);
* ``cpu_gather``: ``torch.index_select`` of the CPU share into pinned staging, by intra-op thread count;
* ``h2d``: the staged rows' host-to-device copy;
* ``whole``: ``lookup_split`` at the given GPU share, and a ``torch.profiler`` table of its host time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from uvaple.integration import GatherLookup, TableSpec

from .vllm_shapes import random_table

ROW_BYTES = 160
GIB = 1 << 30


def _median_us(fn, reps: int) -> float:
    ts = []
    for r in range(reps + 2):
        t0 = time.perf_counter()
        fn()
        torch.cuda.current_stream().synchronize()
        if r >= 2:
            ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=24.0)
    p.add_argument("--rows", default="256,4096,65536,1048576")
    p.add_argument("--threads", default="4,8,12,16")
    p.add_argument("--share", type=float, default=0.35)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    ns = [int(x) for x in a.rows.split(",")]
    table = random_table(int(a.table_gib * GIB) // ROW_BYTES, ROW_BYTES, torch.float8_e4m3fn, seed=7)
    scale = torch.tensor([0.37], device=dev)
    spec = TableSpec.of(table, encoding="fp8_global", out_dtype=torch.bfloat16)
    lk = GatherLookup(table, spec, dev, dequant_scale=scale, count=False, max_rows=max(ns), split=True)
    out = torch.empty(max(ns), ROW_BYTES, dtype=torch.bfloat16, device=dev)
    staging = torch.empty(max(ns), ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    dev_rows = torch.empty(max(ns), ROW_BYTES, dtype=torch.uint8, device=dev)
    src = table.tensor.view(torch.uint8)
    threads0 = torch.get_num_threads()
    print(f"torch intra-op threads {threads0}; table {table.nbytes / GIB:.1f} GiB; GPU share {a.share}", flush=True)
    for n in ns:
        ids = torch.randint(0, table.rows, (n,), generator=torch.Generator().manual_seed(n))
        k = round(n * a.share)
        dev_ids = ids[:k].to(dev)
        line = {"n": n, "gpu_share_rows": k}
        line["gpu_us"] = _median_us(lambda d=dev_ids, k=k: lk.lookup(d, out[:k]), a.reps) if k else 0.0
        for t in (int(x) for x in a.threads.split(",")):
            torch.set_num_threads(t)
            line[f"cpu_gather_{t}t_us"] = _median_us(
                lambda i=ids[k:], m=n - k: torch.index_select(src, 0, i, out=staging[:m]), a.reps)
        torch.set_num_threads(threads0)
        line["h2d_us"] = _median_us(lambda m=n - k: dev_rows[:m].copy_(staging[:m], non_blocking=True), a.reps)
        line["whole_us"] = _median_us(lambda i=ids, n=n: lk.lookup_split(i, out[:n], gpu_share=a.share), a.reps)
        line["whole_cpu_only_us"] = _median_us(lambda i=ids, n=n: lk.lookup_split(i, out[:n], gpu_share=0.0),
                                               a.reps)
        print(" ".join(f"{key} {v:.1f}" if isinstance(v, float) else f"{key} {v}" for key, v in line.items()),
              flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                lk.lookup_split(ids, out[:n], gpu_share=a.share)
                torch.cuda.current_stream().synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14), flush=True)
    lk.close()
    table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

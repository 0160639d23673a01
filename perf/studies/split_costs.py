"""What does each host-side step of a split lookup cost on this host, one step at a time?

``python3 perf/studies/split_costs.py [--table-gib 24] [--rows 65536] [--share 0.3] [--chunk 16384]``

The n-gram shape (160-B fp8 rows, random ids over the table, a fresh id set per repetition). Each line is
the median host µs of one step of ``SplitLookup.lookup_split`` (or of an alternative to it) for a call of
``n`` ids of which the CPU stages ``m = n - round(n * share)``, timed alone: the GPU is idle before each
repetition, and torch's intra-op pool either just ran (``warm``) or idled 2 ms, as between the steps of a
server (``idle``). Steps that queue GPU work also give ``whole``: until the GPU is done.

The copy up of staged rows three ways: torch's ``copy_`` (non-blocking, on a side stream), the runtime's
``cudaMemcpyAsync`` on the same stream, and no copy at all (the policy kernel reads the pinned staging
through UVA, in sequential order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from host_rates import fresh_id_sets

from uvaple.integration import SplitLookup, TableSpec
from uvaple.perf.timing import cuda_missing
from uvaple.perf.vllm_shapes import random_table
from uvaple.uva.cuda_runtime import check, runtime

ROW_BYTES = 160
GIB = 1 << 30


def _time(step, sets, reps: int, idle: bool, dev) -> tuple[float, float]:
    """Median µs of ``step(ids)`` on the host, and until the device is done."""
    host, whole = [], []
    for r in range(reps + 2):
        ids = sets[r % len(sets)]
        torch.cuda.synchronize(dev)
        if idle:
            time.sleep(0.002)
        else:
            torch.aminmax(sets[(r + 1) % len(sets)][:4096])  # a small parallel op: the pool is awake
        t0 = time.perf_counter()
        step(ids)
        t1 = time.perf_counter()
        torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        if r >= 2:
            host.append((t1 - t0) * 1e6)
            whole.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(whole)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 perf/studies/split_costs.py", description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=24.0)
    p.add_argument("--rows", default="65536")
    p.add_argument("--share", type=float, default=0.3)
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--reps", type=int, default=21)
    a = p.parse_args(argv)
    if cuda_missing(p.prog):
        return 2
    rt = runtime()
    dev = torch.device("cuda", torch.cuda.current_device())
    table = random_table(int(a.table_gib * GIB) // ROW_BYTES, ROW_BYTES, torch.float8_e4m3fn, seed=7)
    src = table.tensor.view(torch.uint8)
    stride = table.stride_bytes
    scale = torch.tensor([0.37], device=dev)
    spec = TableSpec.of(table, encoding="fp8_global", out_dtype=torch.bfloat16)
    nmax = max(int(x) for x in a.rows.split(","))
    lk = SplitLookup(table, spec, dev, dequant_scale=scale, count=True, max_rows=nmax)
    out = torch.empty(nmax, ROW_BYTES, dtype=torch.bfloat16, device=dev)
    host = torch.empty(nmax, stride, dtype=torch.uint8, pin_memory=True)
    devbuf = torch.empty(nmax, stride, dtype=torch.uint8, device=dev)
    ids_host = torch.empty(nmax, dtype=torch.int64, pin_memory=True)
    ids_dev = torch.empty(nmax, dtype=torch.int64, device=dev)
    arange = torch.arange(nmax, dtype=torch.int64, device=dev)
    cs = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    kinds = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
    print(f"torch intra-op threads {torch.get_num_threads()}; table {table.nbytes / GIB:.1f} GiB; "
          f"chunk {a.chunk} rows", flush=True)

    def up_torch(lo, hi):
        with torch.cuda.stream(cs):
            devbuf[lo:hi].copy_(host[lo:hi], non_blocking=True)

    def up_raw(lo, hi):
        check(rt.cudaMemcpyAsync(devbuf[lo].data_ptr(), host[lo].data_ptr(), (hi - lo) * stride, kinds,
                                 cs.cuda_stream), "cudaMemcpyAsync")

    def staged_up(up):
        def step(ids):
            m = ids.shape[0]
            for lo in range(0, m, a.chunk):
                hi = min(m, lo + a.chunk)
                torch.index_select(src, 0, ids[lo:hi], out=host[lo:hi, :ROW_BYTES])
                if up is not None:
                    up(lo, hi)
        return step

    def policy(staged_from):
        def step(ids):
            m = ids.shape[0]
            staged = staged_from[:m, :ROW_BYTES].view(torch.float8_e4m3fn)
            torch.ops.uvaple.gather_rows(staged, arange[:m], out[:m], None, scale, spec.scale_arg,
                                         spec.has_scale, 0, 0, 0, spec.oob_mode, spec.dequant)
        return step

    def gather_then_read_pinned(ids):
        torch.index_select(src, 0, ids, out=host[: ids.shape[0], :ROW_BYTES])
        policy(host)(ids)

    def gpu_share(ids):
        k = ids.shape[0]
        ids_host[:k].copy_(ids)
        ids_dev[:k].copy_(ids_host[:k], non_blocking=True)
        lk.gather.lookup(ids_dev[:k], out[:k])  # as lookup_split's eager GPU share calls it

    def small_ops(ids):
        ev.record(cs)
        torch.cuda.current_stream(dev).wait_event(ev)
        lk._counters[0].sub_(1)
        ev.synchronize()

    try:
        for n in (int(x) for x in a.rows.split(",")):
            k = round(n * a.share)
            m = n - k
            sets_m = fresh_id_sets(m, table.rows, seed=n)
            sets_k = fresh_id_sets(k, table.rows, seed=n + 1) if k else None
            steps = [
                ("aminmax of the CPU's ids (torch)", lambda ids: torch.aminmax(ids), sets_m),
                ("min and max of the CPU's ids (numpy)", lambda ids: (ids.numpy().min(), ids.numpy().max()), sets_m),
                ("index_select of m rows, one call",
                 lambda ids: torch.index_select(src, 0, ids, out=host[: ids.shape[0], :ROW_BYTES]), sets_m),
                (f"index_select of m rows in chunks of {a.chunk}", staged_up(None), sets_m),
                ("chunks, each copied up with torch copy_", staged_up(up_torch), sets_m),
                ("chunks, each copied up with cudaMemcpyAsync", staged_up(up_raw), sets_m),
                ("one index_select, the policy kernel reads the pinned staging", gather_then_read_pinned, sets_m),
                ("the policy kernel on m staged rows in device memory (launch)", policy(devbuf), sets_m),
                ("the policy kernel on m staged rows in pinned memory", policy(host), sets_m),
                ("one torch copy_ of a chunk", lambda ids: up_torch(0, min(ids.shape[0], a.chunk)), sets_m),
                ("one cudaMemcpyAsync of a chunk", lambda ids: up_raw(0, min(ids.shape[0], a.chunk)), sets_m),
                ("event record, stream wait, counter sub_, event sync", small_ops, sets_m),
            ]
            if k:
                steps.append(("the GPU share: ids to pinned, H2D, lookup (sorted)", gpu_share, sets_k))
            print(f"\nn {n}: GPU share {k} ids, CPU share m = {m} ids", flush=True)
            for name, step, sets in steps:
                res = [_time(step, sets, a.reps, idle, dev) for idle in (False, True)]
                print(f"  {name:64s} warm host {res[0][0]:7.0f} us whole {res[0][1]:7.0f} us | "
                      f"idle host {res[1][0]:7.0f} us whole {res[1][1]:7.0f} us", flush=True)
    finally:
        lk.close()
        table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

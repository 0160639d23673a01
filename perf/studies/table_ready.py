"""How long does a big HostTable take to become ready (map, parallel pre-fault, cudaHostRegister)?

Usage: python3 perf/studies/table_ready.py [--gib 64] [--threads 16]
Prints seconds and GiB/s per stage, with 1 thread and with ``--threads`` on a 4 GiB table first (the
scaling), then the big table once. Compared in the same run with ``torch.empty(pin_memory=True)`` of the
4 GiB size (what the caching host allocator pins for it is printed too).
"""

from __future__ import annotations

import argparse
import time

import torch


def ready(gib: float, threads: int) -> dict:
    from uvaple.uva import HostTable

    row_bytes = 17920
    rows = int(gib * (1 << 30)) // row_bytes
    t0 = time.perf_counter()
    t = HostTable.empty(rows, row_bytes // 2, torch.bfloat16, threads=threads,
                        register=torch.cuda.is_available(), check_memory=False)
    total = time.perf_counter() - t0
    res = {"gib": t.nbytes / (1 << 30), "threads": threads, "total_s": total,
           "populate_s": t.timings.get("populate", 0.0), "register_s": t.timings.get("register", 0.0),
           "registered": t.registered}
    t0 = time.perf_counter()
    t.close()
    res["close_s"] = time.perf_counter() - t0
    res["gibps"] = res["gib"] / total
    return res


def torch_pinned(gib: float) -> dict:
    n = int(gib * (1 << 30))
    before = torch.cuda.memory.host_memory_stats().get("reserved_bytes.current", 0) \
        if hasattr(torch.cuda.memory, "host_memory_stats") else 0
    t0 = time.perf_counter()
    x = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    x.fill_(1)
    s = time.perf_counter() - t0
    stats = torch.cuda.memory.host_memory_stats() if hasattr(torch.cuda.memory, "host_memory_stats") else {}
    reserved = stats.get("reserved_bytes.current", 0) - before
    del x
    return {"gib": gib, "total_s": s, "reserved_gib": reserved / (1 << 30) if reserved else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=64.0)
    p.add_argument("--threads", type=int, default=16)
    a = p.parse_args(argv)

    def show(label, r):
        extra = "".join(f" {k}={v:.2f}s" for k, v in r.items() if k.endswith("_s") and k != "total_s")
        print(f"{label:<34} {r['gib']:7.2f} GiB  total {r['total_s']:7.2f} s  {r.get('gibps', 0):6.2f} GiB/s{extra}",
              flush=True)

    # The first touch of memory in a VM can include the hypervisor backing it: run the threaded case on
    # both sides of the single-threaded one so the comparison is visible.
    show(f"HostTable 4 GiB, {a.threads} threads", ready(4, a.threads))
    show("HostTable 4 GiB, 1 thread", ready(4, 1))
    show(f"HostTable 4 GiB, {a.threads} threads (again)", ready(4, a.threads))
    if torch.cuda.is_available():
        r = torch_pinned(4)
        print(f"{'torch.empty(pin_memory) 4 GiB+fill':<34} {r['gib']:7.2f} GiB  total {r['total_s']:7.2f} s  "
              f"host allocator reserved {r['reserved_gib']} GiB", flush=True)
    big = ready(a.gib, a.threads)
    show(f"HostTable {a.gib:g} GiB, {a.threads} threads", big)
    print(f"target: ready in under 10 s -> {'MET' if big['total_s'] < 10 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

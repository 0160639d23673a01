"""Do a host table's close, finalizer, fork and sharing hold at full size on a GPU (8-16 GiB)?

Host-table lifetime at full size on a GPU: what the unit tests check small, measured and logged big.

1. **Close under pending kernels.** A gather queued behind ~0.5 s of GPU work; ``close()`` returns after
   the device finished (it synchronises), the result is exact.
2. **Finalizer release of a registered 8 GiB table.** Built, registered, read by a gather, then dropped
   without ``close()``: registration gone (``cudaPointerGetAttributes``), mapping gone, host memory back
   (``MemAvailable`` before, with, after).
3. **fork() after registration.** The parent forks with the 8 GiB table registered; the child reads its
   inherited view (zeros) and exits; the parent rewrites 1 GiB of rows and its gather is bit-exact
   against the new rows (no copy-on-write moved a page under the device).
4. **One 16 GiB table shared by 4 processes on one GPU.** ``HostTable.shared`` from 4 processes at once:
   one fills, all register and gather bit-exact; the node's shared memory grows by the table once.

Usage: ``python3 perf/studies/lifetime_gpu.py [--big-gib 8] [--shared-gib 16] [--procs 4]``. Exit 0 when
every check passed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid

import torch

from uvaple.perf.timing import cuda_missing
from uvaple.uva.cuda_runtime import is_registered as registered
from uvaple.uva.system import mapped

GiB = 1 << 30
HERE = os.path.dirname(os.path.abspath(__file__))  # the child imports fill_random from here


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def fill_random(view: torch.Tensor, seed: int, threads: int = 16) -> None:
    """Random bits into a [rows, cols] bf16 view, in parallel blocks (deterministic per block)."""
    from concurrent.futures import ThreadPoolExecutor

    rows = view.shape[0]
    block = max(1, rows // (threads * 4))

    def one(i: int) -> None:
        g = torch.Generator().manual_seed(seed * 100003 + i)
        part = view[i * block:(i + 1) * block].view(torch.int16)
        part.random_(-(1 << 15), 1 << 15, generator=g)
        part.bitwise_and_(0x7F7F)  # finite bf16 values only (no inf/NaN), random bits otherwise

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(-(-rows // block))))


def check(name: str, ok: bool, results: dict, **facts) -> None:
    results[name] = dict(ok=bool(ok), **facts)
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: " + ", ".join(f"{k}={v}" for k, v in facts.items()), flush=True)


def close_under_pending(results: dict) -> None:
    from uvaple.kernels import gather_rows
    from uvaple.uva import HostTable

    rows, cols = 60000, 8960
    h = HostTable.empty(rows, cols, torch.bfloat16, register=True)
    fill_random(h.tensor, 1)
    ids = torch.randint(0, rows, (16384,), device="cuda")
    out = torch.empty(16384, cols, dtype=torch.bfloat16, device="cuda")
    ref = h.tensor[ids.cpu()].clone()
    ptr = h.ptr
    gather_rows(h.tensor, ids, out)  # compiled and warm: the close below waits for the device, not for Triton
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of the gather
    gather_rows(h.tensor, ids, out)
    t0 = time.perf_counter()
    h.close()
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    check("close under pending kernels", torch.equal(out.cpu(), ref) and not registered(ptr) and not mapped(ptr),
          results, close_waited_s=round(waited, 3), table_gib=round(rows * 17920 / GiB, 2))


def finalizer_and_fork(big_gib: float, results: dict) -> None:
    from uvaple.kernels import gather_rows
    from uvaple.uva import HostTable

    cols = 8960  # 17,920-byte rows (Gemma 3n E4B)
    rows = int(big_gib * GiB) // (cols * 2)
    avail0 = meminfo("MemAvailable")
    t0 = time.perf_counter()
    h = HostTable.empty(rows, cols, torch.bfloat16, register=True)
    ready_s = time.perf_counter() - t0
    fill_random(h.tensor, 2)
    avail1 = meminfo("MemAvailable")
    ptr = h.ptr
    ids = torch.randint(0, rows, (65536,), device="cuda")
    got = gather_rows(h.tensor, ids)
    exact = torch.equal(got.cpu(), h.tensor[ids.cpu()])
    # fork after registration: the child reads its inherited view and exits; the parent rewrites rows
    view = h.tensor
    pid = os.fork()
    if pid == 0:  # the child: numpy only (no CUDA, no OpenMP after a fork), and always _exit
        code = 4
        try:
            code = 0 if not view[:4096].view(torch.int16).numpy().any() else 3  # it sees zeros
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    child_ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    del view
    n_new = GiB // (cols * 2)
    fill_random(h.tensor[:n_new], 3)  # the parent writes after the fork
    ids2 = torch.randint(0, n_new, (65536,), device="cuda")
    got2 = gather_rows(h.tensor, ids2)
    fork_exact = torch.equal(got2.cpu(), h.tensor[ids2.cpu()])
    check("fork after registration", exact and fork_exact and child_ok, results,
          table_gib=round(h.nbytes / GiB, 2), rewritten_gib=1.0, child_saw_zeros=child_ok,
          parent_gather_exact_after_fork=fork_exact)
    # drop without close(): the finalizer releases
    del got, got2
    t0 = time.perf_counter()
    del h
    gc.collect()
    release_s = time.perf_counter() - t0
    time.sleep(0.5)
    avail2 = meminfo("MemAvailable")
    back = avail2 - avail1
    check("finalizer release of a registered table", not registered(ptr) and not mapped(ptr)
          and back > 0.9 * big_gib * GiB, results, table_gib=big_gib, ready_s=round(ready_s, 2),
          release_s=round(release_s, 2), mem_available_gib=[round(a / GiB, 2) for a in (avail0, avail1, avail2)],
          returned_gib=round(back / GiB, 2), still_registered=registered(ptr), still_mapped=mapped(ptr))


SHARED_WORKER = textwrap.dedent("""
    import json, os, sys, time, torch
    sys.path.insert(0, sys.argv[4])  # this script's folder (perf/studies/ is not installed)
    from lifetime_gpu import fill_random
    from uvaple.uva import HostTable
    from uvaple.kernels import gather_rows
    name, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print("loaded", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    t = HostTable.shared(name, rows, cols, torch.bfloat16, fill=lambda t: fill_random(t.tensor, 4),
                         timeout=600, register=True)
    ready = time.perf_counter() - t0
    g = torch.Generator().manual_seed(os.getpid())
    ids = torch.randint(0, rows, (65536,), generator=g)
    got = gather_rows(t, ids.cuda())
    ok = torch.equal(got.cpu(), t.tensor[ids])
    with open(f"/proc/{os.getpid()}/status") as f:
        rss_shmem = next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssShmem:"))
    print(json.dumps({"created": t.created, "exact": ok, "ready_s": ready, "rss_shmem": rss_shmem,
                      "timings": t.timings}), flush=True)
    sys.stdin.readline()
    t.close()
""")


def shared_by_processes(gib: float, procs: int, results: dict) -> None:
    cols = 8960
    rows = int(gib * GiB) // (cols * 2)
    name = f"lifetime-{uuid.uuid4().hex[:8]}"
    shmem0 = meminfo("Shmem")
    ps = [subprocess.Popen([sys.executable, "-c", SHARED_WORKER, name, str(rows), str(cols), HERE],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for _ in range(procs)]
    for p in ps:
        assert p.stdout.readline().strip() == "loaded", p.stderr.read()
    for p in ps:
        p.stdin.write("go\n")
        p.stdin.flush()
    rep = []
    for p in ps:
        line = p.stdout.readline()
        if not line:
            print(p.stderr.read(), file=sys.stderr)
            rep.append({"created": False, "exact": False, "ready_s": 0, "rss_shmem": 0})
        else:
            rep.append(json.loads(line))
    shmem1 = meminfo("Shmem")
    for p in ps:
        try:
            p.stdin.write("done\n")
            p.stdin.flush()
        except BrokenPipeError:
            pass
    codes = [p.wait(120) for p in ps]
    time.sleep(0.5)
    shmem2 = meminfo("Shmem")
    grown = shmem1 - shmem0
    ok = (sum(r["created"] for r in rep) == 1 and all(r["exact"] for r in rep) and codes == [0] * procs
          and grown < 1.05 * gib * GiB and not os.path.exists(f"/dev/shm/uvaple.{name}"))
    check(f"one {gib:g} GiB table shared by {procs} processes", ok, results, processes=procs,
          creators=sum(r["created"] for r in rep), all_exact=all(r["exact"] for r in rep),
          shmem_grown_gib=round(grown / GiB, 2),
          per_process_rss_shmem_gib=[round(r["rss_shmem"] / GiB, 2) for r in rep],
          sum_of_rss_shmem_gib=round(sum(r["rss_shmem"] for r in rep) / GiB, 2),
          ready_s=[round(r["ready_s"], 2) for r in rep], shmem_after_close_gib=round((shmem2 - shmem0) / GiB, 2),
          exit_codes=codes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--big-gib", type=float, default=8.0)
    p.add_argument("--shared-gib", type=float, default=16.0)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if cuda_missing("lifetime_gpu"):
        return 2
    results: dict = {}
    close_under_pending(results)
    finalizer_and_fork(a.big_gib, results)
    shared_by_processes(a.shared_gib, a.procs, results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

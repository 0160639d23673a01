"""Where does the time of making a big table ready go: page commit, page size, registration, by variant?

``python3 perf/studies/ready_probe.py [--gib 16] [--threads 16]`` on the GPU machine (registration needs
CUDA; without it only the memory stages run). One line per variant, seconds per stage:

* ``private``: an anonymous mapping (2 MiB aligned, ``MADV_HUGEPAGE``), ``MADV_POPULATE_WRITE`` on
  ``threads`` threads, then registration: one call, or ``threads`` pieces registered at once;
* ``shm``: a ``/dev/shm`` file, mapped shared, ``MADV_HUGEPAGE``, populated the same way (which
  allocates its pages), registered the same two ways;
* ``*-no-populate``: registered straight after mapping (the driver's pinning faults the pages);
* ``*-pipelined``: each thread populates its piece and registers it (populate and register overlap);
* ``shm8``/``shm64``: the table in 8 or 64 ``/dev/shm`` files mapped back to back into one range (each
  tmpfs file has its own page-cache lock, so their allocation can run in parallel), registered as one;
* ``dir``: a file in ``--dir`` (e.g. a ``tmpfs -o huge=always`` mount), otherwise as ``shm``;
* populate ``fill``: no pre-fault; ``threads`` threads copy a source table in (the fill allocates the
  pages as it writes, as a serving engine's weight loader would), then registration.

The huge pages each variant got (``AnonHugePages`` / ``ShmemHugePages`` growth) are printed with it,
and the kernel's THP settings first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

from uvaple.uva import cuda_runtime, system, workers

GIB = 1 << 30


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    return 0


def _pieces(total: int, n: int) -> list[tuple[int, int]]:
    """``total`` bytes in ``n`` even, 2 MiB-granular ranges (the table's own split)."""
    return workers.chunks(total, system.round_up(-(-total // n), 2 << 20))


def _pool(fn, ranges, threads):
    workers.parallel(fn, ranges, threads, name="uvaple-probe")


def _files(directory: str, nbytes: int, count: int) -> tuple[int, list[int]]:
    """``count`` unlinked files in ``directory`` holding ``nbytes`` together, mapped back to back."""
    parts = _pieces(nbytes, count)
    base = system.mmap(nbytes, 0, system.MAP_PRIVATE | system.MAP_ANONYMOUS | system.MAP_NORESERVE)  # the range
    fds = []
    for i, (o, n) in enumerate(parts):
        path = os.path.join(directory, f"uvaple-probe-{os.getpid()}-{i}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        os.ftruncate(fd, n)
        fds.append(fd)
        system.mmap(n, system.PROT_READ | system.PROT_WRITE, system.MAP_SHARED | system.MAP_FIXED, fd, addr=base + o)
    return base, fds


def run_variant(kind: str, nbytes: int, threads: int, populate: str, register: str, cuda: bool,
                directory: str = "/dev/shm", source: int | None = None) -> dict:
    """populate: 'threads' | 'none' | 'pipelined' | 'fill'; register: 'one' | 'pieces' | 'none'."""
    rec: dict = {"variant": f"{kind} populate={populate} register={register}", "gib": nbytes / GIB}
    if kind == "dir":
        rec["dir"] = directory
    huge_key = "AnonHugePages" if kind == "private" else "ShmemHugePages"
    huge0 = _meminfo(huge_key)
    fds: list[int] = []
    t = time.perf_counter()
    if kind == "private":
        base = system.map_anonymous_aligned(nbytes)
    else:
        count = int(kind[3:]) if kind[3:].isdigit() else 1
        base, fds = _files("/dev/shm" if kind.startswith("shm") else directory, nbytes, count)
        rec["create_s"] = time.perf_counter() - t
    system.madvise(base, nbytes, system.MADV_HUGEPAGE)
    flags = cuda_runtime.HOST_REGISTER_PORTABLE | cuda_runtime.HOST_REGISTER_MAPPED
    done: list[int] = []

    def populate_piece(o, n):
        err = system.madvise(base + o, n, system.MADV_POPULATE_WRITE)
        if err:
            raise OSError(err, os.strerror(err))

    def register_piece(o, n):
        cuda_runtime.ensure_context(0)
        cuda_runtime.host_register(base + o, n, flags)
        done.append(base + o)

    def fill_piece(o, n):
        ctypes.memmove(base + o, source + o, n)

    try:
        if populate == "fill":
            t = time.perf_counter()
            _pool(fill_piece, _pieces(nbytes, threads * 4), threads)
            rec["fill_s (allocates)"] = time.perf_counter() - t
        if populate == "threads":
            t = time.perf_counter()
            _pool(populate_piece, _pieces(nbytes, threads * 4), threads)
            rec["populate_s"] = time.perf_counter() - t
        if cuda and populate == "pipelined":
            t = time.perf_counter()
            _pool(lambda o, n: (populate_piece(o, n), register_piece(o, n)), _pieces(nbytes, threads), threads)
            rec["populate_and_register_s"] = time.perf_counter() - t
        elif cuda and register != "none":
            t = time.perf_counter()
            if register == "one":
                register_piece(0, nbytes)
            else:
                _pool(register_piece, _pieces(nbytes, threads), threads)
            rec["register_s"] = time.perf_counter() - t
        rec["huge_pages_gib"] = (_meminfo(huge_key) - huge0) / GIB
        rec["ready_s"] = sum(v for k, v in rec.items() if k.endswith("_s"))
        if populate == "fill":
            rec["ready_after_fill_s"] = rec.get("register_s", 0.0)
        rec["ready_gib_s"] = nbytes / GIB / rec["ready_s"] if rec["ready_s"] else None
    finally:
        t = time.perf_counter()
        for p in done:
            cuda_runtime.host_unregister(p)
        system.munmap(base, nbytes)
        for fd in fds:
            os.close(fd)
        rec["release_s (not counted)"] = time.perf_counter() - t
    print(json.dumps(rec), flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=16.0)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--variants", default="all", help="comma list of kind:populate:register, or 'all'")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--dir", default="/dev/shm", help="directory of the 'dir' kind (a huge-page tmpfs, say)")
    a = p.parse_args(argv)
    for f in ("enabled", "defrag", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{f}") as fh:
                print(f"thp {f}: {fh.read().strip()}")
        except OSError:
            pass
    print("kernel:", os.uname().release, "| free huge pages:", _meminfo("HugePages_Free"))
    cuda = cuda_runtime.cuda_available()
    nbytes = system.round_up(int(a.gib * GIB), 2 << 20)
    if a.variants == "all":
        variants = [(k, pop, reg) for k in ("private", "shm")
                    for pop, reg in (("threads", "one"), ("threads", "pieces"), ("none", "pieces"), ("pipelined", "-"))]
    else:
        variants = [tuple(v.split(":")) for v in a.variants.split(",")]
    source = None
    if any(pop == "fill" for _k, pop, _r in variants):  # a populated private table to copy from
        source = system.map_anonymous_aligned(nbytes)
        system.madvise(source, nbytes, system.MADV_HUGEPAGE)
        _pool(lambda o, n: system.memset(source + o, 0x5A, n), _pieces(nbytes, a.threads * 4), a.threads)
    recs = [run_variant(k, nbytes, a.threads, pop, reg, cuda, a.dir, source) for k, pop, reg in variants]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

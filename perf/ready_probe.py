"""Where the time of making a big table ready goes: page commit, page size, registration, by variant.

``python -m uvaple.perf.ready_probe [--gib 16] [--threads 16]`` on the GPU machine (registration needs
CUDA; without it only the memory stages run). One line per variant, seconds per stage:

* ``private``: an anonymous mapping (2 MiB aligned, ``MADV_HUGEPAGE``), ``MADV_POPULATE_WRITE`` on
  ``threads`` threads, then registration: one call, or ``threads`` pieces registered at once;
* ``shm``: a ``/dev/shm`` file, ``posix_fallocate`` on ``threads`` threads, mapped shared,
  ``MADV_HUGEPAGE``, populated the same way, registered the same two ways;
* ``*-no-populate``: registered straight after mapping (the driver's pinning faults the pages);
* ``*-pipelined``: each thread populates its piece and registers it (populate and register overlap).

The huge pages each variant got (``AnonHugePages`` / ``ShmemHugePages`` growth) are printed with it,
and the kernel's THP settings first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from uvaple.uva import _cuda, _sys, host_table

GIB = 1 << 30


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) << 10
    return 0


def _pieces(total: int, n: int) -> list[tuple[int, int]]:
    """``total`` bytes in ``n`` even, 2 MiB-granular ranges (the table's own split)."""
    return host_table._chunks(total, _sys.round_up(-(-total // n), 2 << 20))


def _pool(fn, ranges, threads):
    host_table._parallel(fn, ranges, threads, name="uvaple-probe")


def run_variant(kind: str, nbytes: int, threads: int, populate: str, register: str, cuda: bool) -> dict:
    """populate: 'threads' | 'none' | 'pipelined'; register: 'one' | 'pieces' | 'none'."""
    rec: dict = {"variant": f"{kind} populate={populate} register={register}", "gib": nbytes / GIB}
    huge_key = "AnonHugePages" if kind == "private" else "ShmemHugePages"
    huge0 = _meminfo(huge_key)
    fd = None
    t = time.perf_counter()
    if kind == "private":
        base = _sys.map_anonymous_aligned(nbytes)
    else:
        path = f"/dev/shm/uvaple-probe-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
        _pool(lambda o, n: os.posix_fallocate(fd, o, n), _pieces(nbytes, threads * 4), threads)
        rec["fallocate_s"] = time.perf_counter() - t
        base = _sys.mmap(nbytes, _sys.PROT_READ | _sys.PROT_WRITE, _sys.MAP_SHARED, fd)
    _sys.madvise(base, nbytes, _sys.MADV_HUGEPAGE)
    flags = _cuda.HOST_REGISTER_PORTABLE | _cuda.HOST_REGISTER_MAPPED
    done: list[int] = []

    def populate_piece(o, n):
        err = _sys.madvise(base + o, n, _sys.MADV_POPULATE_WRITE)
        if err:
            raise OSError(err, os.strerror(err))

    def register_piece(o, n):
        _cuda.ensure_context(0)
        _cuda.host_register(base + o, n, flags)
        done.append(base + o)

    try:
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
        rec["ready_gib_s"] = nbytes / GIB / rec["ready_s"] if rec["ready_s"] else None
    finally:
        t = time.perf_counter()
        for p in done:
            _cuda.host_unregister(p)
        _sys.munmap(base, nbytes)
        if fd is not None:
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
    a = p.parse_args(argv)
    for f in ("enabled", "defrag", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{f}") as fh:
                print(f"thp {f}: {fh.read().strip()}")
        except OSError:
            pass
    print("kernel:", os.uname().release, "| free huge pages:", _meminfo("HugePages_Free"))
    cuda = _cuda.cuda_available()
    nbytes = _sys.round_up(int(a.gib * GIB), 2 << 20)
    if a.variants == "all":
        variants = [(k, pop, reg) for k in ("private", "shm")
                    for pop, reg in (("threads", "one"), ("threads", "pieces"), ("none", "pieces"), ("pipelined", "-"))]
    else:
        variants = [tuple(v.split(":")) for v in a.variants.split(",")]
    recs = [run_variant(k, nbytes, a.threads, pop, reg, cuda) for k, pop, reg in variants]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``uvaple bench --workload disk``: what the disk under a disk placement reads at random, and what the table
file's reference reader gets of it.

A table file of n-gram-shaped rows (``fp8_row`` bytes: 160 fp8 codes and a 4-byte scale, 176 bytes at the host
stride, 23 rows to a 4 KiB page) is written once (``--file-gib``, random bytes), or an existing one is read
(``--file``). Then, on its data pages:

* **the disk's limit**: 4 KiB random reads at each queue depth of ``--depths`` for ``--seconds`` each. With
  ``fio`` on the ``PATH``: fio's ``randread`` (``io_uring``, ``direct=1``) over the file. Always: this module's
  own probe, ``depth`` threads each issuing one ``pread`` at a time (``O_DIRECT`` where the filesystem allows
  it) in a compiled loop (numba, no GIL between two reads: an interpreted loop measured the GIL, 53 k reads/s
  where the compiled one reads 121 k on the same 2-core machine's disk: ``perf/results/cpu_vm_2026-12-05/``),
  the one measure where fio is absent. Reads per second, MB/s, and each depth's latency median and 99th
  percentile;
* **the reference reader**: :meth:`~uvaple.uva.table_file.TableFile.read_rows` of ``n`` random rows
  (``--rows``), each page once, one ``pread`` a run of adjacent pages on the calling thread, every row checked
  against what was written (where this run wrote the file): rows and pages per second, and the pages per
  second over the disk's best rate;
* **the batched reader** (:class:`~uvaple.uva.PageReader`, what the disk placement reads its misses with) at
  each thread count of ``--read-depths``, the same calls, against the same limit (goal: 90%).

``O_DIRECT`` refused (a tmpfs), the reads come from the page cache: the output says so, and the rates are not
a disk's. ``--smoke``: a 64 MiB file and 0.2 s a depth (CI). Results: ``disk.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from uvaple.dtypes import fmt_bytes
from uvaple.uva.page_reader import PageReader
from uvaple.uva.table_file import (
    PAGE,
    FileLayout,
    TableFile,
    TableFileError,
    _open_direct,
    page_buffer,
    write_table_file,
)

from . import command

ROW_COLS = 164  # an fp8_row n-gram row: 160 codes and a float32 scale, as bytes
SMOKE_GIB = 1 / 16
MAX_DEPTH = 256


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="uvaple bench --workload disk", description=__doc__.splitlines()[0],
                                epilog=command.EXIT_STATUSES)
    p.add_argument("--file", help="an existing table file to read (default: write one of --file-gib in --dir)")
    p.add_argument("--dir", help="where the file is written (default: a new directory under the system's "
                   "temporary one; it should be on the disk the placement will read)")
    p.add_argument("--file-gib", type=command.number(float, meaning="GiB of table file to write"), default=None,
                   help="the table file's size when this run writes it (default 4; more than the host's page "
                   "cache is what a cold read is)")
    p.add_argument("--depths", type=command.positive_ints, default=[1, 8, 64],
                   help=f"queue depths of the random reads (comma-separated, at most {MAX_DEPTH})")
    p.add_argument("--seconds", type=command.number(float, meaning="seconds of reads at each depth"), default=3.0)
    p.add_argument("--rows", type=command.positive_ints, default=[1, 64, 4096],
                   help="rows a reader's call reads (comma-separated)")
    p.add_argument("--read-depths", type=command.positive_ints, default=[8, 32, 64],
                   help="threads of the batched reader (the disk placement's PageReader), comma-separated; each is "
                        "timed beside the reference reader")
    p.add_argument("--keep", action="store_true", help="keep the file this run writes")
    steps = p.add_argument_group("the disk placement's decode steps (perf/disk_steps.py; a CUDA GPU, or --smoke)")
    steps.add_argument("--no-steps", dest="steps_on", action="store_false", help="measure the disk only")
    steps.add_argument("--batches", type=command.positive_ints, default=[1, 8, 64],
                       help="lanes a step (default 1,8,64)")
    steps.add_argument("--budgets", type=fractions, default=[0.25, 0.125],
                       help="the disk placement's row cache, as fractions of the table (default 0.25,0.125)")
    steps.add_argument("--hot", type=fractions, default=[0.01],
                       help="rows held in device memory above the smallest budget's cache, as fractions of the table: "
                            "the most frequent rows of a profile run over another part of the text (default 0.01; "
                            "each fraction is one more provider)")
    steps.add_argument("--no-hot", dest="hot", action="store_const", const=[], help="leave out the hot rows' providers")
    steps.add_argument("--steps", type=command.number(int, meaning="decode steps a run"), default=400)
    steps.add_argument("--cold-steps", type=command.number(int, meaning="first steps reported as the cold start"),
                       default=50)
    steps.add_argument("--blocks", type=command.number(int, meaning="blocks of the steady steps"), default=5)
    steps.add_argument("--text", nargs="+", help="text files the token ids come from (default: this package's own "
                                                 "docs and sources)")
    steps.add_argument("--layers", type=command.number(int, meaning="PLE layers read a step"), default=0,
                       help="also time N lookups read a step as N PLE layers are, layer by layer and in one read "
                            "round, at the smallest budget (N caches of it; default 0: not run)")
    steps.add_argument("--no-pinned", dest="pinned", action="store_false", help="leave out the whole table pinned "
                                                                                  "(it needs the table's size in RAM)")
    steps.add_argument("--no-mmap", dest="mmap", action="store_false", help="leave out the mmap baseline")
    steps.add_argument("--mmap-cap-gib", type=command.number(float, meaning="GiB the mmap baseline's page cache may "
                                                                             "hold"),
                       help="hold the rest of the available memory while the mmap baseline runs (default: no cap)")
    p.add_argument("--smoke", action="store_true", help="a 64 MiB file and 0.2 s a depth: the code path only")
    p.add_argument("--out", help="directory for disk.json, made and checked writable before any work (default "
                                 "./uvaple-results/<UTC time>_disk_<gpu or cpu>/)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    if max(a.depths) > MAX_DEPTH:
        p.error(f"--depths {','.join(map(str, a.depths))}: at most {MAX_DEPTH}")
    if a.file:
        given = [flag for flag, value in (("--file-gib", a.file_gib), ("--dir", a.dir), ("--keep", a.keep)) if value]
        if given:
            p.error(f"--file {a.file} with {' '.join(given)}: --file reads an existing table file, and "
                    f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} a file this run writes; drop one")
    elif a.file_gib is None:
        a.file_gib = SMOKE_GIB if a.smoke else 4.0
    if a.smoke:
        a.seconds = 0.2
        a.batches, a.budgets, a.steps, a.cold_steps, a.blocks = [1, 3], [0.25], 10, 2, 2
    if a.cold_steps >= a.steps or a.steps - a.cold_steps < a.blocks:
        p.error(f"--steps {a.steps}, --cold-steps {a.cold_steps}, --blocks {a.blocks}: the steps after the cold ones "
                "must fill every block")
    return a


def fractions(text: str) -> list[float]:
    """An argparse type: comma-separated fractions in (0, 1]."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions of the table in (0, 1], got {text!r}")
    return vals


# ------------------------------------------------------------------ the file
def write_file(directory: str, gib: float) -> tuple[str, torch.Tensor]:
    """A table file of about ``gib`` GiB of random n-gram-shaped rows in ``directory``; the rows (to check
    reads)."""
    rows = max(1, int(gib * (1 << 30)) // PAGE) * FileLayout.of(1, ROW_COLS, torch.uint8).rows_per_page
    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (rows, ROW_COLS), generator=g, dtype=torch.uint8)
    path = os.path.join(directory, "disk_bench.uvt")
    bar, lock = command.bar(total=rows, desc="writing the table file", unit="row"), threading.Lock()

    def progress(done: int, total: int) -> None:  # called from the writing threads
        with lock:
            bar.update(done - bar.n)

    write_table_file(path, src, encoding="raw", overwrite=True, progress=progress)
    bar.close()
    return path, src


# ------------------------------------------------------------------ the disk's limit
@functools.lru_cache(maxsize=1)
def _compiled_probe():
    """A thread's probe loop compiled (numba, ``nogil``; ``pread`` and ``clock_gettime`` through ctypes): random
    page reads with no interpreter between them, so the threads together measure the disk, not the GIL."""
    import ctypes
    import ctypes.util

    import numba

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    pread = libc.pread
    pread.restype, pread.argtypes = ctypes.c_ssize_t, [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    clock = libc.clock_gettime
    clock.restype, clock.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]

    @numba.njit(nogil=True, cache=False)
    def loop(fd, buf, offsets, seconds, lat, ts):
        """Reads ``offsets`` in turn into ``buf`` until ``seconds`` pass; each read's ns into ``lat``. Returns the
        reads made, or -(reads + 1) at a short or failed read."""
        clock(1, ts.ctypes.data)  # CLOCK_MONOTONIC
        start = ts[0] * 1_000_000_000 + ts[1]
        end = start + np.int64(seconds * 1e9)
        k = 0
        now = start
        while now < end and k < lat.shape[0]:
            t0 = now
            if pread(fd, buf.ctypes.data, 4096, offsets[k % offsets.shape[0]]) != 4096:
                return -(k + 1)
            clock(1, ts.ctypes.data)
            now = ts[0] * 1_000_000_000 + ts[1]
            lat[k] = now - t0
            k += 1
        return k

    return loop


def probe(path: str, first_page: int, pages: int, depth: int, seconds: float) -> dict:
    """``depth`` threads, each reading random 4 KiB pages of ``path`` (from page ``first_page``, ``pages`` of
    them) one ``pread`` at a time for ``seconds``, in a compiled loop (:func:`_compiled_probe`): reads/s, MB/s,
    latency median and p99 (us)."""
    fd = _open_direct(path)  # the table file's own: O_DIRECT, or None where the filesystem refuses it
    direct = fd is not None
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    lat: list[list[float]] = [[] for _ in range(depth)]
    errors: list[str] = []
    start = threading.Barrier(depth + 1)

    loop = _compiled_probe()

    def worker(i: int) -> None:
        buf = page_buffer(1).numpy()
        offs = (first_page + np.random.default_rng(1000 + i).integers(0, pages, 1 << 16)) * PAGE
        ns = np.empty(4_000_000, dtype=np.int64)  # at most 4 M reads a thread a depth
        start.wait()
        n = loop(fd, buf, offs, seconds, ns, np.zeros(2, dtype=np.int64))
        if n < 0:
            errors.append(f"a read of 4 KiB at byte {int(offs[(-n - 1) % len(offs)])} was short or failed")
            n = -n - 1
        lat[i] = (ns[:n] / 1e9).tolist()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(depth)]
    try:
        for t in threads:
            t.start()
        start.wait()
        t0 = time.monotonic()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
    finally:
        os.close(fd)
    if errors:
        raise OSError(f"the probe's reads of {path} failed: {errors[0]}")
    every = sorted(x for ls in lat for x in ls)
    n = len(every)
    return {"depth": depth, "reads": n, "seconds": round(wall, 3), "reads_per_s": round(n / wall),
            "MB_per_s": round(n * PAGE / wall / 1e6, 1), "direct": direct,
            "latency_us_median": round(statistics.median(every) * 1e6, 1),
            "latency_us_p99": round(every[min(n - 1, int(n * 0.99))] * 1e6, 1)}


def fio(path: str, depth: int, seconds: float) -> dict | None:
    """fio's 4 KiB random reads of ``path`` at ``depth`` (``io_uring``, ``direct=1``), or None without fio."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    cmd = [exe, "--name=uvaple", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
           "--ioengine=io_uring", f"--iodepth={depth}", f"--runtime={seconds}", "--time_based", "--readonly",
           "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if r.returncode:
        return {"depth": depth, "error": (r.stderr or r.stdout).strip()[-300:], "command": " ".join(cmd)}
    job = json.loads(r.stdout)["jobs"][0]["read"]
    lat = job.get("clat_ns", {}).get("percentile", {})
    return {"depth": depth, "reads_per_s": round(job["iops"]), "MB_per_s": round(job["bw_bytes"] / 1e6, 1),
            "latency_us_median": round(lat.get("50.000000", 0) / 1e3, 1),
            "latency_us_p99": round(lat.get("99.000000", 0) / 1e3, 1), "command": " ".join(cmd)}


# ------------------------------------------------------------------ the reference reader
def reader(f: TableFile, n: int, seconds: float, src: torch.Tensor | None, depth: int | None = None,
           engine: str = "threads") -> dict:
    """``n`` distinct random rows a call, repeated for ``seconds`` over 16 id sets (each read once first, and
    compared with ``src`` where given): rows/s, pages/s, a call's median us. ``depth`` None:
    ``TableFile.read_rows``, the reference (one read at a time); else a :class:`~uvaple.uva.PageReader` with
    ``depth`` reads in flight by ``engine`` (``threads``, or ``uring``: the calling thread's io_uring) into slots,
    as the disk placement reads its misses."""
    lay = f.layout
    g = np.random.default_rng(n)
    sets = [g.choice(lay.rows, size=n, replace=False) for _ in range(16)]
    pages = [len(np.unique(ids // lay.rows_per_page)) if lay.rows_per_page else n * lay.pages_per_row
             for ids in sets]
    out = torch.empty((n, lay.cols), dtype=lay.dtype)
    slots = np.arange(n)
    pool = None if depth is None else PageReader(f, depth=depth, engine=engine,
                                                 buffer_pages=max(n * max(1, lay.pages_per_row), 1))

    def call(ids: np.ndarray) -> None:
        if pool is None:
            f.read_rows(torch.from_numpy(ids), out)
        else:
            pool.read_rows_into(ids, out.view(torch.uint8).reshape(n, lay.row_bytes), slots)

    try:
        exact = True
        for ids in sets:
            call(ids)
            exact = exact and (src is None or torch.equal(out, src[torch.from_numpy(ids)]))
        calls = read = 0
        times = []
        t0 = time.perf_counter()
        while True:
            t1 = time.perf_counter()
            call(sets[calls % 16])
            times.append(time.perf_counter() - t1)
            read += pages[calls % 16]
            calls += 1
            if t1 + times[-1] - t0 >= seconds:
                break
        wall = time.perf_counter() - t0
    finally:
        if pool is not None:
            pool.close()
    return {"rows_per_call": n, "depth": depth, "engine": None if depth is None else engine, "calls": calls,
            "rows_per_s": round(calls * n / wall), "pages_per_s": round(read / wall),
            "call_us_median": round(statistics.median(times) * 1e6, 1),
            "bit_exact": exact if src is not None else None}


# ------------------------------------------------------------------ io_uring from one thread
def uring_rates(path: str, data_pages: int, depths: list[int], seconds: float) -> dict:
    """io_uring's random-read rate at each depth from one thread (:mod:`uvaple.perf.uring`), or why it cannot
    run here."""
    from . import uring

    why = uring.unavailable()
    if why is not None:
        command.say(f"io_uring: not run ({why})")
        return {"error": why}
    out: dict = {"rate": []}
    for d in depths:
        r = uring.rate(path, 1, data_pages, d, seconds)
        out["rate"].append(r)
        command.say(f"io_uring, one thread, depth {d:>3}: {r['reads_per_s']:>9,} reads/s {r['MB_per_s']:>8} MB/s, "
                    f"latency median {r['latency_us_median']} us, p99 {r['latency_us_p99']} us")
    return out


# ------------------------------------------------------------------ the run
def steps(a, path: str, best: float, res: dict) -> None:
    """The disk placement's decode steps (:mod:`uvaple.perf.disk_steps`) into ``res["steps"]``; without CUDA only
    under ``--smoke`` (the gather interpreted on the CPU), else said and skipped."""
    from . import disk_steps

    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        command.say("steps: not run (the disk placement's gather needs a CUDA GPU; --smoke runs them small on the "
                    "CPU, --no-steps leaves them out)")
        res["steps"] = None
        return
    res["steps"] = {}  # filled as it runs: a late error keeps what ran
    try:
        res["steps"] = disk_steps.run(a, path, best, torch.device("cuda" if cuda else "cpu"))
    except command.Refused as e:
        command.say(f"steps: not run ({e})")
        res["steps"] = None


def main(argv: list[str] | None = None) -> int:
    prog = "uvaple bench --workload disk"
    a = parse_args(argv)
    try:
        out = command.workload_out("disk", a.out, cuda=False)
        if a.file and not os.path.isfile(a.file):
            raise command.Refused(f"--file {a.file}: no such file. Pass a table file (uvaple's), or leave --file "
                                  "out to write one")
        made = None
        if not a.file:  # checked before the file's folder is made: a refusal leaves nothing behind
            where, need = a.dir or tempfile.gettempdir(), int(a.file_gib * (1 << 30))
            free = shutil.disk_usage(where).free
            if need > free * 0.9:
                raise command.Refused(f"--file-gib {a.file_gib:g}: {fmt_bytes(need)} does not fit the "
                                      f"{fmt_bytes(free)} free in {where}; pass a smaller --file-gib or another "
                                      "--dir")
            command.check_fits(need, f"--file-gib {a.file_gib:g} (the rows are drawn in host memory first)",
                               "Pass a smaller --file-gib.")
            made = tempfile.mkdtemp(prefix="uvaple-disk-", dir=a.dir)
    except command.Refused as e:
        return command.refuse(prog, e)
    res: dict = {"smoke": a.smoke}
    try:
        with command.progress(not a.quiet), command.kept_on_failure(out, "disk.json", res):
            src = None
            if made:
                path, src = write_file(made, a.file_gib)
            else:
                path = a.file
            try:
                f = TableFile.open(path)
            except TableFileError as e:
                return command.refuse(prog, command.Refused(f"--file {path}: {e}"))
            with f:
                lay = f.layout
                res["file"] = {"path": path, "bytes": os.path.getsize(path), "rows": lay.rows,
                               "row_bytes": lay.row_bytes, "data_pages": lay.data_pages, "direct": f.direct}
                if not f.direct:
                    command.say("O_DIRECT is refused on this filesystem: reads come from the page cache, and the "
                                "rates below are not a disk's")
                res["fio"] = [] if shutil.which("fio") else None
                res["probe"] = []
                for d in command.bar(a.depths, desc="random 4 KiB reads by depth", unit="depth"):
                    r = probe(path, 1, lay.data_pages, d, a.seconds)
                    res["probe"].append(r)
                    command.say(f"probe depth {d:>3}: {r['reads_per_s']:>9,} reads/s {r['MB_per_s']:>8} MB/s, latency "
                                f"median {r['latency_us_median']} us, p99 {r['latency_us_p99']} us")
                    if res["fio"] is not None:
                        fr = fio(path, d, a.seconds)
                        res["fio"].append(fr)
                        if "error" not in fr:
                            command.say(f"fio   depth {d:>3}: {fr['reads_per_s']:>9,} reads/s {fr['MB_per_s']:>8} "
                                        f"MB/s, latency median {fr['latency_us_median']} us")
                res["uring"] = uring_rates(path, lay.data_pages, a.depths, a.seconds)
                best = max([r["reads_per_s"] for r in res["probe"] + res["uring"].get("rate", [])] +
                           [r["reads_per_s"] for r in res["fio"] or [] if "error" not in r])
                res["limit_reads_per_s"] = best
                res["reader"] = []
                engines = ["threads"] + (["uring"] if "rate" in res["uring"] else [])
                for depth, engine in [(None, None)] + [(d, e) for e in engines for d in a.read_depths]:
                    for n in a.rows:
                        r = reader(f, min(n, lay.rows), a.seconds, src, depth, engine or "threads")
                        r["x_limit"] = round(r["pages_per_s"] / best, 3)
                        res["reader"].append(r)
                        who = "reference reader" if depth is None else \
                            f"batched reader, {'io_uring' if engine == 'uring' else 'threads':>8}, depth {depth:>3}"
                        command.say(f"{who}, {r['rows_per_call']:>5} rows a call: {r['call_us_median']:>10,.1f} us "
                                    f"a call, {r['pages_per_s']:>9,} pages/s = {r['x_limit']} x the best random-read "
                                    "rate")
                if a.steps_on:
                    steps(a, path, best, res)
    finally:
        if made and not a.keep:
            shutil.rmtree(made, ignore_errors=True)
    if made and a.keep:
        res["file"]["kept"] = True
    path = command.write_json(out, "disk.json", res)
    command.wrote(out, [path])
    if any(r["bit_exact"] is False for r in res["reader"]):
        print("NOT BIT-EXACT: the reader's rows differed from the rows written (see disk.json)", file=sys.stderr)
        return command.EXIT_MISMATCH
    return 0


if __name__ == "__main__":
    sys.exit(main())

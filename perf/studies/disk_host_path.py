"""What does the disk placement's host work cost a call, apart from its reads and its gather?

A decode step of the disk placement (`uvaple bench --workload disk`) is its page reads, its gather and the host
work between them: the call's checks, the row cache's plan, the pages of the misses, the rows copied into their
slots, the cache ids staged. On a GPU host that work was as much as the reads at batch 1 (`docs/RESULTS.md`,
"Where a step goes"). This script times it on any machine, the way that workload feeds the placement: a table
file of 164-byte rows (the n-gram table's fp8 rows) read through a `DiskLookup` on the CPU with a row cache of
1/8 of it, ids hashed from text (`uvaple.perf.disk_steps.Steps`), the gather replaced by a no-op (on the CPU it
would run interpreted).

* ``--reads file`` (the default): the misses read from the file as the placement reads them (``O_DIRECT`` where
  the file system allows it); the call's parts as the workload reports them (``pages``: the reader's rounds;
  ``plan_copy``: the rest of the plan-and-read; ``rest``: the call less the two).
* ``--reads none``: every round handed a page buffer as it is, no read: the call is its host work alone.

Medians of the steps after ``--warm`` (each run a fresh lookup, cold), each run's median printed, then the
median of the runs. The rows are not checked (the placement's tests check them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from uvaple.perf import disk_steps
from uvaple.uva.table_file import page_buffer, write_table_file

COLS = 164  # the n-gram table's fp8 row: 160 codes and a float32 scale


def run_once(path: str, rows: int, batch: int, steps: int, warm: int, reads: str) -> dict:
    """One lookup, cold: its steps' medians (us)."""
    walk = disk_steps.Steps(disk_steps.text_tokens(None), rows, batch, warm + steps)
    p = disk_steps.Disk(path, torch.device("cpu"), 0.125, batch * disk_steps.HEADS)
    lk = p.lookup
    try:
        lk._plan.run = lambda ids, out, c0: None  # the gather: a no-op (its launch is not what is timed here)
        if reads == "none":
            buf = page_buffer(lk._reader.buffer_pages).numpy()
            lk._reader._read = lambda pages: buf[:len(pages)]
        out = torch.empty(batch, disk_steps.HEADS, COLS, dtype=torch.uint8)
        calls = []
        for s in range(warm + steps):
            ids = walk.ids(s)
            p._part = dict.fromkeys(p.phases, 0.0)
            t0 = time.perf_counter()
            lk.lookup(ids, out)
            calls.append((time.perf_counter() - t0) * 1e6)
            for k, v in p._part.items():
                p.phases[k].append(v)
    finally:
        p.close()
    read_in, pages = p.phases["read_in"][warm:], p.phases["pages"][warm:]
    call = calls[warm:]
    return {"call": statistics.median(call),
            "pages": statistics.median(pages) if reads == "file" else 0.0,
            "plan_copy": statistics.median([a - b for a, b in zip(read_in, pages, strict=True)]),
            "rest": statistics.median([c - a for c, a in zip(call, read_in, strict=True)])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000, help="rows of the table file (164 B each)")
    ap.add_argument("--batches", default="1,8,64", help="lanes a step (16 ids each)")
    ap.add_argument("--steps", type=int, default=500, help="steps timed a run")
    ap.add_argument("--warm", type=int, default=100, help="steps before them, not timed")
    ap.add_argument("--runs", type=int, default=3, help="runs a batch, each a fresh lookup")
    ap.add_argument("--reads", choices=("file", "none"), default="file")
    ap.add_argument("--dir", default=None, help="where the table file is written (default: a temporary folder)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    if a.rows < 1024 or a.steps < 1 or a.warm < 0 or a.runs < 1:
        ap.error(f"--rows {a.rows} (>= 1024), --steps {a.steps} (>= 1), --warm {a.warm} (>= 0) and --runs {a.runs} "
                 "(>= 1): one of them is out of range")
    batches = [int(b) for b in a.batches.split(",")]
    res = {"rows": a.rows, "reads": a.reads, "steps": a.steps, "warm": a.warm, "batches": {}}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = os.path.join(d, "t.uvt")
        g = torch.Generator().manual_seed(1)
        write_table_file(path, torch.randint(0, 255, (a.rows, COLS), dtype=torch.uint8, generator=g))
        for b in batches:
            runs = [run_once(path, a.rows, b, a.steps, a.warm, a.reads) for _ in range(a.runs)]
            med = {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}
            res["batches"][str(b)] = {"median_us": med, "runs_us": [{k: round(v, 1) for k, v in r.items()}
                                                                     for r in runs]}
            print(f"batch {b:>3} ({a.reads}): call {med['call']:,.1f} us = pages {med['pages']:,.1f} + plan_copy "
                  f"{med['plan_copy']:,.1f} + rest {med['rest']:,.1f}; runs' calls "
                  f"{[round(r['call'], 1) for r in runs]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

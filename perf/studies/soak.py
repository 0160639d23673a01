"""Do 10,000 overlapped schedules (tests/test_equivalence.py) stay bit-exact and leave the machine as found?

The overlapped-schedule soak: ``tests/test_equivalence.py`` over many seeds, split over processes.

One schedule takes a few hundred milliseconds on the GPU machine, most of it host work of one Python
thread (plans, reference gathers, comparisons, bounded waits), so 10,000 schedules in one process would
take over half an hour. The seeds ``0 .. schedules-1`` are split into ``--workers`` contiguous ranges, each
run by its own pytest process (``UVAPLE_EQUIV_FIRST_SEED``/``UVAPLE_EQUIV_SCHEDULES``) on the same GPU. Each
process checks its own schedules bit for bit and, at its end, that its host memory, registrations and
copy workers are back to its baseline (the test's own checks); this script adds what the whole machine
shows before and after (``MemAvailable``, locked memory, ``/dev/shm``) and sums the processes' summaries.

Usage: ``python3 perf/studies/soak.py [--schedules 10000] [--workers 14] [--deadline-s 420] [--timeout-s 540]
[--json FILE]``, from the repository root (it runs ``tests/test_equivalence.py``). A worker starts no schedule
after ``--deadline-s`` (``schedules_run`` says how many ran) and is killed after ``--timeout-s``. Exit 0 when
every process passed, all requested schedules ran and nothing was left in ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

TEST = "tests/test_equivalence.py::test_random_schedules_agree"


def machine_state() -> dict:
    """What the whole machine shows: available and locked memory (kB), files in /dev/shm."""
    info = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            key, value = line.split(":", 1)
            if key in ("MemAvailable", "Mlocked", "Shmem"):
                info[key + "_kB"] = int(value.split()[0])
    info["dev_shm_files"] = sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []
    return info


def split(schedules: int, workers: int) -> list[tuple[int, int]]:
    """``(first_seed, count)`` of each worker: contiguous ranges covering ``0 .. schedules-1`` once."""
    workers = max(1, min(workers, schedules))
    base, extra = divmod(schedules, workers)
    ranges, first = [], 0
    for w in range(workers):
        count = base + (w < extra)
        ranges.append((first, count))
        first += count
    return ranges


def merge(summaries: list[dict]) -> dict:
    """The workers' summaries summed (counts), merged (depths) and maxed (max_depth)."""
    total, depths = Counter(), Counter()
    for s in summaries:
        for k, v in s.items():
            if k == "depths":
                depths.update({int(d): n for d, n in v.items()})
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and k not in (
                    "max_depth", "seconds", "first_seed", "requested"):
                total[k] += v
    out = dict(total)
    out["max_depth"] = max((s.get("max_depth", 0) for s in summaries), default=0)
    out["depths"] = {str(k): v for k, v in sorted(depths.items())}
    out["worker_seconds"] = [s.get("seconds") for s in summaries]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedules", type=int, default=10000)
    p.add_argument("--workers", type=int, default=14)
    p.add_argument("--timeout-s", type=float, default=540.0, help="each worker's bound (killed past it)")
    p.add_argument("--deadline-s", type=float, default=420.0,
                   help="no schedule starts after this many seconds of a worker (the summary counts what ran)")
    p.add_argument("--json", help="write the merged summary here")
    a = p.parse_args(argv)
    if not os.path.exists(TEST.split("::")[0]):
        p.error(f"{TEST.split('::')[0]} not found: run from the repository root")
    before = machine_state()
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="uvaple-soak-")
    procs = []
    for w, (first, count) in enumerate(split(a.schedules, a.workers)):
        env = dict(os.environ, UVAPLE_EQUIV_FIRST_SEED=str(first), UVAPLE_EQUIV_SCHEDULES=str(count),
                   UVAPLE_EQUIV_DEADLINE_S=str(a.deadline_s),
                   UVAPLE_EQUIV_SUMMARY=os.path.join(tmp, f"w{w}.json"), OMP_NUM_THREADS="1",
                   NUMBA_NUM_THREADS="2")
        log = open(os.path.join(tmp, f"w{w}.log"), "w")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={int(a.timeout_s)}", TEST]
        procs.append((w, first, count, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    results, summaries = [], []
    for w, first, count, proc, log in procs:
        left = max(1.0, a.timeout_s + 30 - (time.monotonic() - t0))
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed"
        log.close()
        path = os.path.join(tmp, f"w{w}.json")
        summary = json.load(open(path)) if os.path.exists(path) else None
        if summary:
            summaries.append(summary)
        lines = open(os.path.join(tmp, f"w{w}.log")).read().strip().splitlines()
        tail = lines[-3:]
        # a failure's own words: pytest's "E   " lines (the assertion, the schedule it names)
        errors = [ln[:2000] for ln in lines if ln.startswith("E ")][:40]
        results.append({"worker": w, "seeds": [first, first + count - 1], "rc": rc, "tail": tail, "errors": errors})
        print(f"worker {w:2d} seeds {first}..{first + count - 1}: rc {rc}; {tail[-1] if tail else ''}", flush=True)
        for ln in errors[:6]:
            print(f"    {ln[:600]}", flush=True)
    time.sleep(1.0)  # let the last processes' pages go back before the machine is read again
    after = machine_state()
    ok = all(r["rc"] == 0 for r in results) and len(summaries) == len(results)
    ran = sum(s.get("schedules", 0) for s in summaries)
    report = {"requested": a.schedules, "schedules_run": ran, "workers": len(results), "passed": ok,
              "wall_s": round(time.monotonic() - t0, 1), "merged": merge(summaries), "workers_detail": results,
              "machine_before": before, "machine_after": after,
              "dev_shm_left": sorted(set(after["dev_shm_files"]) - set(before["dev_shm_files"]))}
    line = json.dumps({k: v for k, v in report.items() if k not in ("workers_detail",)}, sort_keys=True)
    print("soak summary:", line)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1, sort_keys=True)
    return 0 if ok and ran == a.schedules and not report["dev_shm_left"] else 1


if __name__ == "__main__":
    sys.exit(main())

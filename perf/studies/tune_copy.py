"""Where should the copy backend's CPU-gather thresholds sit on this host, and does it keep up with torch?

Sweep the copy backend's CPU-gather thresholds (``host_gather.PARALLEL_MIN_BYTES``, ``TORCH_MIN_BYTES``,
``TORCH_MAX_ROW_BYTES``), and its gather against torch's.

For requests from 4 KiB to 64 MiB of gathered bytes (rows of 160 B, the n-gram PLE shape, 17,920 B,
Gemma 3n E4B, and 1,024 B and 4,096 B, either side of ``TORCH_MAX_ROW_BYTES``), times the serial and the
parallel numba byte gather over random rows of a 1 GiB table, median of repeated runs, and prints the
smallest request at which parallel is faster at every larger size for every row size: the threshold to
ship. ``torch_us`` is ``torch.index_select`` of the same rows on torch's threads (all cores): the bare
CPU gather the copy backend is held to. ``gather_us`` is the backend's gather itself
(``host_gather.cpu_gather`` as a job calls it: a slot's ``row_ids``, ``oob="zero"``, ids in range) on the
path it picks (``path``, from ``host_gather.gather_path``), so ``gather/torch`` <= 1 confirms the choice;
``torch_path_us`` is that gather forced onto its torch path (index_select plus the tensor views and the
ids pass). The last lines give, per row size, the smallest request from which the torch path beats the
better numba gather at every larger size (``TORCH_MIN_BYTES``; None: ``TORCH_MAX_ROW_BYTES`` lies
below that row size), and the parallel threshold. CPU only (no GPU needed); run it on the serving host,
since the crossovers depend on its core count. Id sets rotate (rows come from DRAM, not the caches).

Usage: ``python3 perf/studies/tune_copy.py [--table-gib 1] [--max-bytes N] [--budget-s S]
[--row-bytes 160,1024,4096,17920] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

# Id sets rotate so the rows read between two uses of a set exceed the host's caches (the table itself is
# far larger): every timing reads rows from DRAM, as a lookup over a real table does.
_ROTATE_BYTES = 256 << 20
_ID_BASE = np.int64(0)  # the kernels' id_base argument: whole tables here


def median_s(fn, sets: int, budget_s: float = 0.2, min_reps: int = 5) -> float:
    """Median seconds of ``fn(k)`` over id sets ``k`` in rotation."""
    fn(0)
    times, t_end, k = [], time.perf_counter() + budget_s, 1
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn(k % sets)
        times.append(time.perf_counter() - t0)
        k += 1
    return statistics.median(times)


def _first_of_run(wins: list[tuple[int, bool]]) -> int | None:
    """The smallest size from which the test won at every larger size (None: it lost at the largest)."""
    return next((sz for i, (sz, _) in enumerate(wins) if all(w for _, w in wins[i:])), None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table-gib", type=float, default=1.0)
    p.add_argument("--out", default=None)
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest request (default 64 MiB)")
    p.add_argument("--budget-s", type=float, default=0.2, help="timing seconds per point")
    p.add_argument("--row-bytes", default="160,1024,4096,17920", help="row sizes, comma separated")
    a = p.parse_args(argv)
    import torch

    from uvaple.integration.placements import host_gather

    torch.set_num_threads(os.cpu_count() or 1)

    serial, parallel = host_gather._gather_kernels()
    lines = [f"# tune_copy: {os.cpu_count()} cores, torch {torch.get_num_threads()} threads, numba "
             f"{host_gather._numba_threads()} threads; median microseconds; TORCH_MIN_BYTES="
             f"{host_gather.TORCH_MIN_BYTES}, TORCH_MAX_ROW_BYTES={host_gather.TORCH_MAX_ROW_BYTES}"]
    lines.append(f"{'row_B':>7} {'bytes':>10} {'rows':>8} {'serial_us':>10} {'parallel_us':>12} {'par/ser':>8} "
                 f"{'torch_us':>10} {'best_numba/torch':>17} {'torch_path_us':>14} {'path':>8} {'gather_us':>10} "
                 f"{'gather/torch':>13} {'par_words_us':>13} {'prefetch_us':>12} {'pf/par_words':>13}")
    first_win, torch_from = {}, {}
    rng = np.random.default_rng(0)
    for row_bytes in (int(v) for v in a.row_bytes.split(",")):
        stride = row_bytes if row_bytes % 16 == 0 else (row_bytes + 15) // 16 * 16
        rows = int(a.table_gib * (1 << 30)) // stride
        table = np.empty((rows, stride), dtype=np.uint8)
        table.fill(3)  # touch every page (a fresh mapping would measure page faults)
        zero = np.zeros(2, dtype=np.uint8)
        wins, torch_wins = [], []
        size = 4 << 10
        tt = torch.from_numpy(table)
        while size <= a.max_bytes:
            n = max(1, size // row_bytes)
            sets = max(2, min(64, _ROTATE_BYTES // (n * row_bytes)))
            id_sets = rng.integers(0, rows, (sets, n), dtype=np.int64)
            out = np.empty((n, row_bytes), dtype=np.uint8)
            s = median_s(lambda k, o=out, t=table, i=id_sets, z=zero: serial(t, i[k], o, 0, False, z, _ID_BASE), sets,
                         a.budget_s)
            q = median_s(lambda k, o=out, t=table, i=id_sets, z=zero: parallel(t, i[k], o, 0, False, z, _ID_BASE),
                         sets, a.budget_s)
            tid, tout = torch.from_numpy(id_sets), torch.from_numpy(out)
            view = tt[:, :row_bytes]
            g = median_s(lambda k, i=tid, o=tout, v=view: torch.index_select(v, 0, i[k], out=o), sets, a.budget_s)
            # the backend's gather as a job calls it (a slot's row_ids buffer, oob="zero"): its torch path
            # (the ids pass and tensor views on top of index_select), and the path it picks
            row_ids = np.empty(n, dtype=np.int64)

            def gather(k, path=None, o=out, t=table, i=id_sets, z=zero, r=row_ids):
                host_gather.cpu_gather(t, i[k], o, 0, False, z, id_base=int(_ID_BASE), row_ids=r, path=path)

            tp = median_s(lambda k: gather(k, "torch"), sets, a.budget_s)
            b = median_s(gather, sets, a.budget_s)
            # the parallel path as cpu_gather runs it (8-byte words where aligned) and the prefetching gather
            pw = median_s(lambda k: gather(k, "parallel"), sets, a.budget_s)
            pf = median_s(lambda k: gather(k, "prefetch"), sets, a.budget_s)
            path = host_gather.gather_path(n, row_bytes)
            wins.append((size, q < s))
            torch_wins.append((size, tp < min(s, q)))
            lines.append(f"{row_bytes:>7} {size:>10} {n:>8} {s * 1e6:>10.1f} {q * 1e6:>12.1f} {q / s:>8.2f} "
                         f"{g * 1e6:>10.1f} {min(s, q) / g:>17.2f} {tp * 1e6:>14.1f} {path:>8} {b * 1e6:>10.1f} "
                         f"{b / g:>13.2f} {pw * 1e6:>13.1f} {pf * 1e6:>12.1f} {pf / pw:>13.2f}")
            size *= 2
        first_win[row_bytes] = _first_of_run(wins)
        torch_from[row_bytes] = _first_of_run(torch_wins)
    lines.append(f"# the torch path beats the better numba gather from: {torch_from} (TORCH_MIN_BYTES "
                 f"{host_gather.TORCH_MIN_BYTES}, TORCH_MAX_ROW_BYTES {host_gather.TORCH_MAX_ROW_BYTES})")
    pick = max(v for v in first_win.values() if v is not None) if all(first_win.values()) else None
    lines.append(f"# parallel wins from: {first_win}; threshold to ship: {pick} bytes")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

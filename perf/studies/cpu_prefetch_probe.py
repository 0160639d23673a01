"""Does prefetching speed up the CPU's gather of random 160-B rows, and how many rows ahead (``PREFETCH_AHEAD``)?

Random 160-B rows gathered on the CPU: torch's index_select, the copy backend's numba gather, and the
prefetching numba gather (``cpu_gather(path="prefetch")``) at 8, 4 and 16 rows ahead.

``python3 perf/studies/cpu_prefetch_probe.py THREADS TABLE_GIB``: a fresh id set each repetition, median of 8.
"""

from __future__ import annotations

import sys
import time

import numba
import numpy as np
import torch

from uvaple.integration.placements import host_gather as cg
from uvaple.uva import HostTable


def main() -> int:
    threads, gib = int(sys.argv[1]), float(sys.argv[2])
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    print("numba", numba.__version__, "prefetch", cg._prefetch_kernel() is not None, flush=True)
    rows = int(gib * (1 << 30)) // 160
    table = HostTable.empty(rows, 160, torch.uint8, register="auto")
    t = table.tensor
    t.view(torch.int64).fill_(0x0102030405060708)
    tn, zero = t.numpy(), np.zeros(1, np.uint8)
    for n in (65536, 262144, 1 << 20):
        out, rid = np.empty((n, 160), np.uint8), np.empty(n, np.int64)
        for name in ("torch", "parallel", "prefetch", "pf4", "pf16"):
            cg.PREFETCH_AHEAD = int(name[2:]) if name.startswith("pf") else 8
            path = "prefetch" if name.startswith("pf") else name
            ts = []
            for k in range(9):
                ids = np.random.randint(0, rows, n).astype(np.int64)
                t0 = time.perf_counter()
                cg.cpu_gather(tn, ids, out, 0, True, zero, row_ids=rid, path=path)
                ts.append(time.perf_counter() - t0)
                if k == 0:
                    assert np.array_equal(out, tn[ids]), name
            med = sorted(ts[1:])[4]
            print(f"threads {threads} n {n:8d} {name:9s} {med * 1e6:9.0f} us {n / med / 1e6:6.1f} M rows/s", flush=True)
    table.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Eager host launch cost of one small lookup, next to torch's own ops over the same CUDA view.

At one row (a decode step of batch 1) the device work is a few microseconds, so an eager call costs
what the host spends launching it. Each provider is called ``--calls`` times back to back with no
synchronisation in between (the host runs ahead of the GPU until the loop ends) and the wall time per
call is reported, median of ``--repeats`` loops; every provider gathers the same bytes from the same
registered host table (17,920-byte rows, Gemma 3n E4B). Providers:

* ``lookup``: ``make_lookup("uva", table).lookup(ids, out)`` (the Lookup, through the library op);
* ``gather_rows``: the functional entry point (every check, every call);
* ``index_select``: ``torch.index_select(view, 0, ids, out=out)`` over ``table.cuda_view()``;
* ``embedding``: ``F.embedding(ids, view)`` (allocates its output, as people use it).

Usage: ``python3 -m uvaple.perf.launch_cost [--rows 1 8 64] [--calls 2000]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from .timing import cuda_missing


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    if cuda_missing("launch_cost"):
        return 2
    from uvaple.integration import make_lookup
    from uvaple.kernels import gather_rows
    from uvaple.uva import HostTable

    cols, table_rows = 35 * 256, 60000
    with HostTable.empty(table_rows, cols, torch.bfloat16, register=True) as h:
        h.tensor.view(torch.int16)[::97].random_(-(1 << 14), 1 << 14)
        view = h.cuda_view()
        lk = make_lookup("uva", h)
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; eager us per call, "
              f"{a.calls} calls x {a.repeats} loops")
        print(f"{'rows':>5} {'lookup':>9} {'gather_rows':>12} {'index_select':>13} {'embedding':>10} "
              f"{'lookup/index_select':>20}")
        for n in a.rows:
            ids = torch.randint(0, table_rows, (n,), device="cuda")
            out = torch.empty(n, cols, dtype=torch.bfloat16, device="cuda")
            res = {
                "lookup": per_call_us(lambda ids=ids, out=out: lk.lookup(ids, out), a.calls, a.repeats),
                "gather_rows": per_call_us(lambda ids=ids, out=out: gather_rows(h.tensor, ids, out), a.calls,
                                           a.repeats),
                "index_select": per_call_us(lambda ids=ids, out=out: torch.index_select(view, 0, ids, out=out),
                                            a.calls, a.repeats),
                "embedding": per_call_us(lambda ids=ids: torch.nn.functional.embedding(ids, view), a.calls,
                                         a.repeats),
            }
            # bits, not values: the table's random bit patterns include NaNs, which never compare equal
            check = torch.equal(lk.lookup(ids, out).view(torch.int16).cpu(),
                                torch.index_select(view, 0, ids).view(torch.int16).cpu())
            print(f"{n:>5} {res['lookup']:>9.2f} {res['gather_rows']:>12.2f} {res['index_select']:>13.2f} "
                  f"{res['embedding']:>10.2f} {res['lookup'] / res['index_select']:>20.2f}"
                  f"{'' if check else '  MISMATCH'}")
        lk.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

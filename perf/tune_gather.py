"""Sweep the gather's tile width and warps on a registered host table; justifies kernels/heuristics.py.

Usage: python -m uvaple.perf.tune_gather [--table-gib 4] [--out FILE]
Prints one line per (row bytes, rows, tile, warps): median us, GB/s, ratio to the pinned-memcpy ceiling of
the same byte count measured in the same run. Random ids over the whole table, rotated among 8 id sets.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table-gib", type=float, default=4.0)
    p.add_argument("--row-bytes", type=int, nargs="*", default=[15360, 17920, 131072])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 256, 1024, 16384])
    p.add_argument("--tiles", type=int, nargs="*", default=[2048, 4096, 8192, 0])
    p.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_gather needs a CUDA GPU", file=sys.stderr)
        return 1
    import triton.testing

    from uvaple.kernels import gather_rows, heuristics
    from uvaple.uva import HostTable

    lines = []

    def emit(s):
        print(s, flush=True)
        lines.append(s)

    dev = torch.device("cuda")
    emit(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    emit(f"{'row_B':>7} {'n':>6} {'tile':>6} {'warps':>5} {'us':>9} {'GB/s':>7} {'xceil':>6}")
    for row_bytes in a.row_bytes:
        cols = row_bytes // 2
        rows = int(a.table_gib * (1 << 30)) // row_bytes
        with HostTable.empty(rows, cols, torch.bfloat16, register=True, check_memory=False) as t:
            t.tensor[:: max(1, rows // 1000)].normal_()  # non-zero rows scattered through the table
            for n in a.rows:
                nbytes = n * row_bytes
                if nbytes > (1 << 30) or n > rows:
                    continue
                src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                ceil_ms = triton.testing.do_bench(lambda: dst.copy_(src, non_blocking=True), warmup=25, rep=100,
                                                  return_mode="median")
                ceil_gbps = nbytes / ceil_ms / 1e6
                emit(f"{row_bytes:>7} {n:>6} {'memcpy':>6} {'-':>5} {ceil_ms * 1e3:>9.1f} {ceil_gbps:>7.1f} "
                     f"{1.0:>6.2f}")
                id_sets = [torch.randint(0, rows, (n,), device=dev) for _ in range(8)]
                out = torch.empty(n, cols, dtype=torch.bfloat16, device=dev)
                for tile in a.tiles:
                    for warps in a.warps:
                        heuristics.TILE_BYTES = tile or (1 << 30)
                        heuristics.NUM_WARPS = warps
                        heuristics._config.cache_clear()
                        k = [0]

                        def run():
                            k[0] = (k[0] + 1) % 8
                            gather_rows(t, id_sets[k[0]], out)

                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                        gbps = nbytes / ms / 1e6
                        emit(f"{row_bytes:>7} {n:>6} {tile or 'row':>6} {warps:>5} {ms * 1e3:>9.1f} "
                             f"{gbps:>7.1f} {gbps / ceil_gbps:>6.2f}")
                del src, dst
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

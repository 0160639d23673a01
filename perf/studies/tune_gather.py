"""Which tile width and warps should the gather launch with on a registered host table?

Usage: python3 perf/studies/tune_gather.py [--table-gib 4] [--out FILE]
Prints one line per (row bytes, rows, variant): median us, GB/s, ratio to the pinned-memcpy ceiling of
the same byte count measured in the same run. Random ids over the whole table, rotated among 8 id sets.
Times are CUDA-graph replays of 8 gathers (one per id set) divided by 8, so launch overhead on the host
is excluded (it is reported separately by ``uvaple bench``). Variants: the shipped kernel at several tile
widths and warps; the same with loads that bypass L1 (``.cg``); and a TMA (tensor-descriptor) gather.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from uvaple.kernels.rows import safe_row  # the compiled helpers: these kernels run on CUDA only
from uvaple.perf.timing import cuda_missing


@triton.jit
def _cg_gather_kernel(table_ptr, ids_ptr, out_ptr, n_rows, stride, n_cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row, valid = safe_row(ids_ptr, pid, 0, 0, n_rows)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(table_ptr + row * stride + cols, mask=cols < tl.where(valid, n_cols, 0), other=0,
                cache_modifier=".cg")
    tl.store(out_ptr + pid * n_cols + cols, x, mask=cols < n_cols, cache_modifier=".cs")


@triton.jit
def _tma_gather_kernel(desc, ids_ptr, out_ptr, n_rows, n_cols, BOX: tl.constexpr, BOXES: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + pid)
    row = tl.where((row >= 0) & (row < n_rows), row, 0).to(tl.int32)
    for k in tl.static_range(BOXES):
        c = (tl.program_id(1) * BOXES + k) * BOX
        x = desc.load([row, c])
        offs = c + tl.arange(0, BOX)
        tl.store(out_ptr + pid * n_cols + offs[None, :], x, mask=offs[None, :] < n_cols)


def graph_time_ms(fns, reps: int = 20) -> float:
    """Median time of one call: ``do_bench_cudagraph`` over all ``fns`` in sequence (launch gaps removed)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(lambda: [f() for f in fns], rep=reps, return_mode="median") / len(fns)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table-gib", type=float, default=4.0)
    p.add_argument("--row-bytes", type=int, nargs="*", default=[15360, 17920, 131072])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 256, 1024, 16384])
    p.add_argument("--tiles", type=int, nargs="*", default=[2048, 4096, 8192, 0])
    p.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if cuda_missing("tune_gather"):
        return 2
    import triton.testing

    from uvaple.uva import HostTable

    lines = []

    def emit(s):
        print(s, flush=True)
        lines.append(s)

    dev = torch.device("cuda")
    emit(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    emit(f"{'row_B':>7} {'n':>6} {'variant':>9} {'us':>9} {'GB/s':>7} {'xceil':>6}")
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
                ceil_ms = graph_time_ms([lambda d=dst, h=src: d.copy_(h, non_blocking=True)] * 4)
                ceil_gbps = nbytes / ceil_ms / 1e6
                emit(f"{row_bytes:>7} {n:>6} {'memcpy':>9} {ceil_ms * 1e3:>9.1f} {ceil_gbps:>7.1f} {1.0:>6.2f}")
                id_sets = [torch.randint(0, rows, (n,), device=dev) for _ in range(8)]
                out = torch.empty(n, cols, dtype=torch.bfloat16, device=dev)
                variants = [(f"{tile or 'row'}/{warps}w", tile, warps) for tile in a.tiles for warps in a.warps]
                variants += [("cg4K/4w", "cg", 4), ("tma4K", "tma", 4)]
                for label, tile, warps in variants:
                    try:
                        fns = make_fns(t, id_sets, out, tile, warps)
                        ms = graph_time_ms(fns)
                    except Exception as e:  # noqa: BLE001 - report the variant, keep sweeping
                        emit(f"{row_bytes:>7} {n:>6} {label:>9} failed: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    gbps = nbytes / ms / 1e6
                    emit(f"{row_bytes:>7} {n:>6} {label:>9} {ms * 1e3:>9.1f} {gbps:>7.1f} {gbps / ceil_gbps:>6.2f}")
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def make_fns(t, id_sets, out, tile, warps):
    """One callable per id set for a variant (see the module docstring)."""
    n, cols = out.shape
    if tile == "cg":
        grid = (n, triton.cdiv(cols, 2048))
        return [lambda ids=ids: _cg_gather_kernel[grid](t.tensor, ids, out, t.rows, t.stride, cols, BLOCK=2048,
                                                         num_warps=warps) for ids in id_sets]
    if tile == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        box = 256
        desc = TensorDescriptor(t.tensor, [t.rows, cols], [t.stride, 1], [1, box])
        grid = (n, triton.cdiv(cols, box * 8))
        return [lambda ids=ids: _tma_gather_kernel[grid](desc, ids, out, t.rows, cols, BOX=box, BOXES=8,
                                                          num_warps=warps) for ids in id_sets]
    from uvaple.kernels import tuning
    from uvaple.kernels.gather import DirectGather

    cfg = tuning.launch_config(cols * 2, 2, n, tile_bytes=tile or (1 << 30), num_warps=warps)
    launcher = DirectGather(t.tensor, out.device, out.dtype, config=cfg)  # a plain copy of whole rows
    return [lambda ids=ids: launcher(ids, out, 0, n) for ids in id_sets]


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM's PLE shapes: the plugin's op against a peer in vLLM's kernel shape, inside CUDA graphs, one run.

``python -m uvaple.perf.vllm_shapes [--table-gib 16] [--out DIR]`` on a GPU; ``--smoke`` on a CPU
(interpreted kernels, a tiny table, correctness only: no timing is reported).

Cases (the shapes the plugin serves):

* ``qwen4exp-fp8``: 160-B fp8 rows (one n-gram head's row), 16 heads per token, a ``--table-gib`` table;
  decode (1, 8, 64, 256 tokens) and prefill (2,048, 8,192 tokens) batches of random ids ``[tokens, 16]``.
  Ours: ``uvaple::gather_rows`` with the fp8 rows dequantised to bf16 in the kernel (the plugin's path).
  Peer: :func:`uvaple.perf.peers.vllm_ple_gather` (vLLM's shape: raw bytes, one program per row,
  ``BLOCK_D = next_pow2(row bytes)``) followed by vLLM's dequantisation as a separate op.
* ``gemma3n-e2b`` / ``gemma3n-e4b``: 15,360-B / 17,920-B bf16 rows (30 / 35 layers x 256), 262,144 rows;
  1 ... 4,096 tokens. Ours: the raw gather; peer: the same vLLM-shape kernel.

Every provider's output is compared bit for bit with the torch reference of vLLM's formula before it is
timed. Timing: a CUDA graph of several calls, fresh random ids written between replays (outside the
timed region), the median per call; the memcpy of the same row bytes from pinned memory, graph-timed in
the same run, is the ceiling. Writes ``vllm_shapes.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from uvaple.integration import GatherLookup, TableSpec
from uvaple.uva import HostTable

from . import command
from .peers import memcpy_ceiling, vllm_ple_dequant, vllm_ple_gather
from .timing import graph_replay_us

HEADS = 16
CASES = {
    "qwen4exp-fp8": dict(cols=160, dtype=torch.float8_e4m3fn, tokens=[1, 8, 64, 256, 2048, 8192], heads=HEADS),
    "gemma3n-e2b": dict(cols=30 * 256, dtype=torch.bfloat16, rows=262_144, tokens=[1, 8, 64, 512, 4096], heads=1),
    "gemma3n-e4b": dict(cols=35 * 256, dtype=torch.bfloat16, rows=262_144, tokens=[1, 8, 64, 512, 4096], heads=1),
}
SCALE = 0.0173


def random_blocks(nbytes: int, block_bytes: int, seed: int, keep: int = -1):
    """``nbytes`` of random-looking bytes as uint8 tensors of ``block_bytes`` (the last one shorter): one
    random block, each copy XORed with its own 62-bit pattern and ANDed with the 64-bit mask ``keep``. A
    table of tens of GiB is made in seconds and never exists twice."""
    words = -(-block_bytes // 8)
    block = torch.randint(-(1 << 62), 1 << 62, (words,), generator=torch.Generator().manual_seed(seed))
    for k, a in enumerate(range(0, nbytes, block_bytes)):
        yield ((block ^ block_pattern(k)) & keep).view(torch.uint8)[: min(block_bytes, nbytes - a)]


def block_pattern(k: int) -> int:
    """The pattern of block ``k``: distinct for every k, always inside int64."""
    return (k + 1) * 0x9E3779B97F4A7C1 % (1 << 62)


def random_table(rows: int, cols: int, dtype: torch.dtype, seed: int) -> HostTable:
    """A host table of random bytes (fp8: no NaN codes, so that dequantised values compare by bits), written
    64 MiB at a time."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    row_bytes = cols * itemsize
    t = HostTable.empty(rows, cols, dtype, register="auto")
    step = max(1, (64 << 20) // row_bytes)
    keep = -0x0101010101010102 if dtype == torch.float8_e4m3fn else -1  # 0xFEFE...: clears each byte's bit 0
    blocks = zip(range(0, rows, step), random_blocks(rows * row_bytes, step * row_bytes, seed, keep), strict=True)
    for a, blk in command.bar(blocks, total=-(-rows // step), desc="filling the table", unit="block"):
        t.write_rows(blk.view(dtype).reshape(-1, cols), a)
    return t


def _table(case: dict, table_gib: float, smoke: bool, seed: int) -> HostTable:
    itemsize = torch.empty((), dtype=case["dtype"]).element_size()
    rows = 2000 if smoke else case.get("rows") or int(table_gib * (1 << 30)) // (case["cols"] * itemsize)
    return random_table(rows, case["cols"], case["dtype"], seed)


def reference_rows(table: HostTable, ids: torch.Tensor, fp8: bool, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's rows for ``ids`` on the CPU: the gather, then (fp8) ``rows.to(bf16) * scale.to(bf16)``."""
    rows = table.tensor[ids.cpu().reshape(-1)]
    if fp8:
        rows = vllm_ple_dequant(rows, scale.cpu())
    return rows.reshape(*ids.shape, table.cols)


def _graph_us(call, ids_buf: torch.Tensor, rows: int, replays: int) -> float:
    return graph_replay_us(call, ids_buf, lambda b: b.random_(0, rows), replays)["median"]


def run(table_gib: float, smoke: bool, out_dir: str | None, cases: list[str]) -> list[dict]:
    cuda = torch.cuda.is_available() and not smoke
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    results = []
    for ci, name in enumerate(cases):
        case = CASES[name]
        fp8 = case["dtype"] == torch.float8_e4m3fn
        t0 = time.perf_counter()
        table = _table(case, table_gib, smoke, seed=ci)
        ready_s = time.perf_counter() - t0
        scale = torch.tensor([SCALE], dtype=torch.float32, device=device)
        spec = TableSpec.of(table, encoding="fp8_global", out_dtype=torch.bfloat16) if fp8 else TableSpec.of(table)
        tokens = [t for t in case["tokens"] if t <= 64] if smoke else case["tokens"]
        # as the plugin builds it: max_rows from the largest batch, so prefill-sized calls may take the sorted path
        lookup = GatherLookup(table, spec, device, dequant_scale=scale if fp8 else None, count=False,
                              max_rows=max(tokens) * case["heads"])
        view = table.cuda_view() if cuda else table.tensor
        row_bytes = table.cols * table.itemsize
        print(f"# {name}: {table.rows:,} rows of {row_bytes:,} B ({table.rows * row_bytes / (1 << 30):.2f} GiB, "
              f"ready in {ready_s:.1f} s)", flush=True)
        for tok in tokens:
            shape = (tok, case["heads"]) if case["heads"] > 1 else (tok,)
            n = tok * case["heads"]
            out_dtype = torch.bfloat16
            ours_out = torch.empty(*shape, table.cols, dtype=out_dtype, device=device)
            raw = torch.empty(*shape, table.cols, dtype=table.dtype, device=device)
            peer_out = torch.empty(*shape, table.cols, dtype=out_dtype, device=device)

            def ours(ids, out=ours_out, lookup=lookup):
                lookup.lookup(ids, out)

            def peer(ids, raw=raw, out=peer_out, view=view, fp8=fp8, scale=scale):
                vllm_ple_gather(view, ids, raw)
                if fp8:
                    torch.mul(raw.to(torch.bfloat16), scale.to(torch.bfloat16), out=out)

            ids = torch.randint(0, table.rows, shape, device=device, generator=None)
            want = reference_rows(table, ids, fp8, scale)
            for buf in (ours_out, raw, peer_out):
                buf.view(torch.uint8).fill_(0xA5)  # poisoned: every byte must be written
            ours(ids)
            peer(ids)
            got_peer = peer_out if fp8 else raw
            exact = {"ours": torch.equal(ours_out.cpu().view(torch.uint8), want.view(torch.uint8)),
                     "peer": torch.equal(got_peer.cpu().view(torch.uint8), want.view(torch.uint8))}
            rec = {"case": name, "tokens": tok, "rows": n, "row_bytes": row_bytes, "bit_exact": exact,
                   "ours_path": "sorted" if lookup.uses_sorted(n) else "direct"}
            if cuda:
                calls = max(2, min(64, (256 << 20) // max(1, n * row_bytes * 2)))
                ids_buf = torch.randint(0, table.rows, (calls, *shape), device=device)
                host = torch.empty(n * row_bytes, dtype=torch.uint8, pin_memory=True)
                dev = torch.empty(n * row_bytes, dtype=torch.uint8, device=device)
                us = {"ours": _graph_us(ours, ids_buf, table.rows, 30),
                      "peer": _graph_us(peer, ids_buf, table.rows, 30),
                      "memcpy": _graph_us(lambda _i, d=dev, h=host: memcpy_ceiling(d, h),
                                            ids_buf, table.rows, 30)}
                rec.update(us_median=us, gbps={k: n * row_bytes / (v * 1e3) for k, v in us.items()},
                           ours_over_peer=us["peer"] / us["ours"], ours_over_memcpy=us["memcpy"] / us["ours"])
                print(f"{name:13s} tokens {tok:5d} rows {n:7d}: ours {us['ours']:8.1f} us  peer {us['peer']:8.1f} us"
                      f"  memcpy {us['memcpy']:8.1f} us  ours/peer {rec['ours_over_peer']:.3f}  ours/memcpy "
                      f"{rec['ours_over_memcpy']:.3f}  path {rec['ours_path']}  exact {exact}", flush=True)
            else:
                print(f"{name:13s} tokens {tok:5d} rows {n:7d}: exact {exact} (interpreted: not timed)", flush=True)
            results.append(rec)
        lookup.close()
        table.close()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "vllm_shapes.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "table_gib": table_gib,
                       "results": results}, f, indent=1)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=16.0, help="the n-gram table's size (default 16)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny tables, correctness only")
    p.add_argument("--case", action="append", choices=sorted(CASES), help="cases to run (default: all)")
    p.add_argument("--out", help="directory for vllm_shapes.json")
    a = p.parse_args(argv)
    res = run(a.table_gib, a.smoke, a.out, a.case or list(CASES))
    bad = [r for r in res if not all(r["bit_exact"].values())]
    if bad:
        print(f"NOT BIT-EXACT: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

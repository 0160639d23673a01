"""How much pinned host memory per node does the fp8 n-gram table take: vLLM's allocation or the plugin's?

``python3 perf/studies/vllm_memory.py [--gib 47.7] [--row-bytes 160]`` prints the README's table, computed
by :func:`uvaple.integration.models.vllm.memory.node_memory` from both sides' sizing rules.
"""

from __future__ import annotations

import argparse

from uvaple.integration.models.vllm.memory import node_memory

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


def table(gib: float, row_bytes: int) -> str:
    rows = int(gib * (1 << 30)) // row_bytes
    lines = [f"fp8 n-gram table: {rows:,} rows of {row_bytes} B ({gib} GiB)", "",
             "| TP | DP | rows per rank | vLLM pinned | uvaple (shared) | uvaple ÷ vLLM |",
             "|---:|---:|---:|---:|---:|---:|"]
    for tp, dp in LAYOUTS:
        m = node_memory(rows, row_bytes, tp=tp, dp=dp)
        lines.append(f"| {tp} | {dp} | {m.rows_per_rank:,} | {m.vllm_bytes / (1 << 30):.1f} GiB | "
                     f"{m.uvaple_bytes / (1 << 30):.1f} GiB | {m.uvaple_bytes / m.vllm_bytes:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=47.7)
    p.add_argument("--row-bytes", type=int, default=160)
    a = p.parse_args(argv)
    print(table(a.gib, a.row_bytes))


if __name__ == "__main__":
    main()

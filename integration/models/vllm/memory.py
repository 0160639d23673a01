"""Pinned host memory per node for a PLE table: vLLM's pinned-host allocation against the plugin's.

Both from the code's own sizing rules:

* vLLM (``Qwen4ExpPLEPinnedHostEmbedding``): every rank of every data-parallel replica pins its shard
  with ``torch.empty(pin_memory=True)``, which PyTorch's caching host allocator rounds up to a power of
  two. Shards: the vocabulary rounded up to ``divisor`` rows, split evenly over the ETP (= TP) ranks.
* The plugin: each shard is one shared segment (:mod:`uvaple.integration.models.vllm.tables`), its rows at the
  host table's exact stride plus the segment header, rounded to a page, once per node whatever the
  number of replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

from uvaple.uva import segments, system
from uvaple.uva.memory import row_stride_bytes

__all__ = ["NodeMemory", "node_memory", "next_pow2"]


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class NodeMemory:
    tp: int
    dp: int
    rows_per_rank: int
    vllm_bytes: int
    uvaple_bytes: int


def node_memory(rows: int, row_bytes: int, *, tp: int, dp: int, divisor: int = 128) -> NodeMemory:
    """Pinned bytes on one node for a ``rows x row_bytes`` table served at ``tp`` x ``dp``."""
    if rows < 1 or row_bytes < 1 or tp < 1 or dp < 1 or divisor < 1:
        raise ValueError("rows, row_bytes, tp, dp and divisor must be positive")
    padded = -(-rows // divisor) * divisor
    if padded % tp:
        raise ValueError(f"{padded} padded rows do not split over {tp} ranks")
    per_rank = padded // tp
    vllm = next_pow2(per_rank * row_bytes) * tp * dp
    shard = segments.DATA_OFFSET + system.round_up(per_rank * row_stride_bytes(row_bytes), system.PAGE_SIZE)
    return NodeMemory(tp, dp, per_rank, vllm, shard * tp)

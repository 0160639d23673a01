"""One process of a multi-process plugin test (run by test_plugin.py, not collected by pytest).

``python _rank.py MODE RANK NPROCS PORT BASE OUTDIR``:

* ``tp``: rank RANK of a TP=WORLD gloo group (vLLM's ETP group is the TP group). Builds vLLM's device
  table and the plugin's (one shared segment per vocabulary shard), loads the same weights through their
  loaders, and looks up the same ids, ETP all-reduce included.
* ``dp``: a world-1 process, as a data-parallel replica is: the plugin's table only, attached to the
  segment of the same name as the other replica's.

Saves ``{kind: {"ours", "ref", "created", "name", "segments"}}`` to ``OUTDIR/r<RANK>.pt`` with
``torch.save``, then waits (bounded) until every process has, so that no segment is let go early.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conftest  # noqa: E402,F401 - vLLM's CPU platform, as in the tests
from conftest import init_dist, rand, vllm_config  # noqa: E402

VOCAB, DIM, HEADS, TOKENS = 1000, 160, 4, 24


def main(mode: str, rank: int, nprocs: int, port: int, base: str, outdir: str) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.common.ngram_embedding import (
        Qwen4ExpPLEDeviceEmbedding,
        Qwen4ExpPLEFp8EmbeddingMethod,
        Qwen4ExpPLEUnquantizedEmbeddingMethod,
    )

    from uvaple.integration.models.vllm import _build, config
    from uvaple.integration.models.vllm.qwen4_exp import UvaplePLEEmbedding

    methods = {"bf16": Qwen4ExpPLEUnquantizedEmbeddingMethod, "fp8": Qwen4ExpPLEFp8EmbeddingMethod}
    ctx = _build.BuildContext(cfg=config.PluginConfig(shared=True, segment=base, timeout_s=120), identity="i" * 64,
                              device=torch.device("cpu"), check_loaded=True, max_tokens=TOKENS)
    results = {}
    with set_current_vllm_config(vllm_config()):
        if mode == "tp":
            init_dist(world_size=nprocs, rank=rank, port=port, tp=nprocs)
        else:
            init_dist(world_size=1, rank=0, port=port, tp=1)  # each replica's own free port
        for kind, method in methods.items():
            kw = dict(params_dtype=torch.bfloat16, padding_size=64, prefix=f"model.layers.0.{kind}")
            ref = Qwen4ExpPLEDeviceEmbedding(VOCAB, DIM, embedding_method=method(), **kw) if mode == "tp" else None
            with _build.building(ctx, []):
                ours = UvaplePLEEmbedding(VOCAB, DIM, embedding_method=method(), num_ngram_heads=HEADS,
                                          max_total_tokens=TOKENS, **kw)
            w = rand(VOCAB, DIM, torch.float32, seed=21).to(ours.weight.dtype)
            for layer in (ref, ours):
                if layer is None:
                    continue
                layer.weight.weight_loader(layer.weight, w)
                if kind == "fp8":
                    layer.weight_scale.weight_loader(layer.weight_scale, torch.tensor(0.0291))
            ours.uvaple_finish_loading()
            ids = torch.randint(0, VOCAB, (TOKENS, HEADS), generator=torch.Generator().manual_seed(22))
            ids[0] = torch.tensor([0, 499, 500, 999])  # both shards' ends
            shard = ours._uvaple_shard
            results[kind] = {
                "ours": ours.dequantize(ours(ids), torch.bfloat16),
                "ref": None if ref is None else ref.dequantize(ref(ids), torch.bfloat16),
                "created": shard.table.created, "name": shard.name, "rows": shard.table.rows,
                "segments": sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"uvaple.{base}.")),
            }
        torch.save(results, os.path.join(outdir, f"r{rank}.tmp"))
        os.rename(os.path.join(outdir, f"r{rank}.tmp"), os.path.join(outdir, f"r{rank}.pt"))
        deadline = time.monotonic() + 120  # every process has looked up before any lets its segments go
        while len([f for f in os.listdir(outdir) if f.endswith(".pt")]) < nprocs and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    mode, rank, nprocs, port, base, outdir = sys.argv[1:7]
    main(mode, int(rank), int(nprocs), int(port), base, outdir)

"""The vLLM-shape benchmark and the plugin-path startup script, on CPU: correctness only (interpreted
kernels, tiny tables). Their GPU runs are perf/gpu_check.sh's ``vllm`` step."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import study

from uvaple.perf import peers, vllm_shapes

vllm_startup = study("vllm_startup")


def test_vllm_shapes_smoke_is_bit_exact(tmp_path):
    assert vllm_shapes.main(["--smoke", "--case", "qwen4exp-fp8", "--case", "gemma3n-e4b", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "vllm_shapes.json").read_text())["results"]
    assert {r["case"] for r in res} == {"qwen4exp-fp8", "gemma3n-e4b"}
    assert all(r["bit_exact"] == {"ours": True, "peer": True} for r in res)
    assert [r["rows"] for r in res if r["case"] == "qwen4exp-fp8"] == [16, 128, 1024]


def test_vllm_shapes_detects_a_wrong_peer(monkeypatch, tmp_path):
    real = peers.vllm_ple_gather

    def off_by_one(table, ids, out, *a, **k):
        return real(table, (ids + 1) % table.shape[0], out, *a, **k)

    monkeypatch.setattr(vllm_shapes, "vllm_ple_gather", off_by_one)
    # one call of one token (16 rows): the smoke's three sizes are test_vllm_shapes_smoke_is_bit_exact's
    monkeypatch.setitem(vllm_shapes.CASES, "qwen4exp-fp8", dict(vllm_shapes.CASES["qwen4exp-fp8"], tokens=[1]))
    assert vllm_shapes.main(["--smoke", "--case", "qwen4exp-fp8"]) == 1


def test_vllm_peer_zero_fills_rows_outside_the_shard():
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 256, (50, 37), generator=g, dtype=torch.uint8)
    ids = torch.tensor([[100, 149, 99], [150, -1, 120]])
    out = torch.full((2, 3, 37), 0xA5, dtype=torch.uint8)
    peers.vllm_ple_gather(table, ids, out, vocab_start=100, vocab_end=150)
    want = torch.zeros_like(out)
    for idx, i in enumerate(ids.reshape(-1).tolist()):
        if 100 <= i < 150:
            want.view(-1, 37)[idx] = table[i - 100]
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="contiguous"):
        peers.vllm_ple_gather(table[:, :30], ids, out[..., :30])


def test_vllm_fp8_table_has_no_nan_codes():
    t = vllm_shapes._table(vllm_shapes.CASES["qwen4exp-fp8"], 0, True, seed=0)
    with t:
        b = t.tensor.view(torch.uint8)
        assert not torch.isnan(t.tensor.to(torch.float32)).any() and b.unique().numel() > 100


def test_random_blocks_patterns_stay_in_int64_and_differ():
    pats = [vllm_shapes.block_pattern(k) for k in (0, 1, 383, 767, 10**6)]
    assert all(0 < p < 1 << 62 for p in pats) and len(set(pats)) == len(pats)
    blocks = list(vllm_shapes.random_blocks(1000, 256, seed=1))
    assert [b.numel() for b in blocks] == [256, 256, 256, 232] and all(b.dtype == torch.uint8 for b in blocks)
    assert not torch.equal(blocks[0], blocks[1])


def test_vllm_startup_small_is_exact(tmp_path):
    res = vllm_startup.run(0.02, str(tmp_path / "ckpt"), str(tmp_path / "out"), keep=False)
    assert res["sampled_rows_exact"] and res["rows"] % 128 == 0
    assert json.loads((tmp_path / "out" / "vllm_startup.json").read_text())["rows"] == res["rows"]
    assert list((tmp_path / "ckpt").iterdir()) == []  # the checkpoint is removed


def test_ngram_bench_smoke_is_bit_exact(tmp_path):
    from uvaple.perf import bench, ngram

    # calls of 40 and 150 ids: several of the sorted gather's programs and a ragged last one
    assert bench.main(["--workload", "ngram", "--smoke", "--rows", "40,150", "--patterns", "random,ngram",
                       "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "ngram.json").read_text())["results"]
    assert [(r["pattern"], r["n"]) for r in res] == [("random", 40), ("random", 150), ("ngram", 40), ("ngram", 150)]
    assert all(all(r["bit_exact"].values()) and len(r["bit_exact"]) == 5 for r in res)
    ids = ngram.ngram_ids(320, 16_000, seed=1)
    heads = ids.view(20, 16) // (16_000 // 16)
    assert torch.equal(heads, torch.arange(16).expand(20, 16))  # each head hashes into its own slice
    assert ids.unique().numel() < 320  # Zipf tokens: common n-grams repeat


def test_bench_workload_argument():
    from uvaple.perf import bench

    assert bench._workload(["--workload", "ngram", "--smoke"]) == ("ngram", ["--smoke"])
    assert bench._workload(["--quick"]) == ("ple", ["--quick"])
    with pytest.raises(SystemExit, match="--workload must be"):
        bench._workload(["--workload=zipf"])

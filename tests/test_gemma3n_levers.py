"""The Gemma 3n levers harness (``perf/studies/gemma3n_levers.py``): a whole tiny run (on the CPU: interpreted
kernels, no graphs; on CUDA with the interleaved graph-captured steps), its helpers, and the interleaved
capture of several PLE modules of one model."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'uvaple[hf]')")
from helpers import study  # noqa: E402
from test_gemma3n import VOCAB_PLE, build_reference, patched_copy, ple_table  # noqa: E402

from uvaple.integration.embedding import HostScaledEmbedding  # noqa: E402

levers = study("gemma3n_levers")
gd = study("graph_decode")


@pytest.mark.extended  # ~13 s on 2 cores; by default: test_gemma3n.py, test_gemma3n_fp8.py, test_hotset.py's HF module
def test_tiny_run(tmp_path, device):
    rc = levers.main(["--tiny", "--device", str(device), "--out", str(tmp_path), "--prompts", "2", "--prompt-len",
                      "5", "--new-tokens", "6", "--lossless-tokens", "3", "--batches", "1,3", "--steps", "2",
                      "--warm", "1"])
    res = json.loads((tmp_path / "gemma3n_levers.json").read_text())
    assert rc == 0 and not res["errors"]
    for name in levers.LOSSLESS:
        assert res["lossless"][name] == {"prefill_logits_bit_identical": True,
                                         "teacher_forced_logits_bit_identical": True, "greedy_tokens": 3,
                                         "greedy_tokens_identical": True}
    f8 = res["fp8"]
    assert f8["table"]["error"]["rows"] == 257 and f8["table"]["row_bytes"] == 4 * 16 + 4
    assert f8["teacher_forced_logits"]["positions"] == 2 * 6 and f8["teacher_forced_agreement"]["tokens"] == 12
    assert f8["teacher_forced_logits"]["max_abs"] > 0  # the PLE reaches the logits (live_per_layer_path)
    assert len(f8["free_running"]["first_divergence"]) == 2
    hs = res["hot_set"]
    # the hot set's whole device memory (rows, map, slot lists) within 5% of the table's bytes, as large as fits
    assert 0.04 < hs["hbm_over_table"] <= 0.05 and 0 < hs["capacity"] and 0 < hs["serve_trace_hit_rate"] <= 1
    if device.type == "cuda":
        for b in ("1", "3"):
            row = res["decode_graph"][b]["setups"]
            assert set(row) == set(levers.SETUPS)
            assert all(r["replay_equals_eager"] and r["ms"] > 0 for r in row.values())
            assert res["decode_graph"][b]["hot_hits"]["hits"] > 0
    else:
        assert res["decode_graph"] == {"skipped": "CUDA graphs need a CUDA device"}
    assert "criteria:" in (tmp_path / "gemma3n_levers.log").read_text()


def test_trace_helpers(tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("5 300 7\n9 1000")
    trace = levers.load_trace(str(ids), 257)
    assert trace.tolist() == [5, 300 - 257, 7, 9, 1000 % 257]
    with pytest.raises(FileNotFoundError, match="--profile-ids"):
        levers.load_trace(str(tmp_path / "none.npy"), 257)
    draw = levers.trace_draw(trace, torch.device("cpu"))
    chunks = draw(3, 2, seed=1)
    assert chunks.shape == (3, 2) and torch.equal(chunks, draw(3, 2, seed=1))
    for a, b in chunks.tolist():  # consecutive ids of the trace
        assert any(trace[i] == a and trace[i + 1] == b for i in range(len(trace) - 1))
    logits = torch.tensor([[[0.0, 5.0, 1.0, 9.0], [3.0, 2.0, 1.0, 0.0]]])
    assert levers.greedy_argmax(logits, 3, eos=1).tolist() == [[2, 0]]  # ids >= 3 and EOS suppressed
    assert levers.first_divergence(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[1, 2, 3], [4, 0, 6]])) == \
        [None, 1]
    err = levers.logits_error(torch.tensor([[[1.0, 2.5]]]), torch.tensor([[[1.0, 2.0]]]))
    assert err["max_abs"] == 0.5 and err["max_rel"] == 0.25 and err["positions"] == 1


@pytest.mark.gpu
def test_interleaved_graphs_replay_each_setups_eager_step_gpu():
    ref = build_reference(torch.bfloat16, device="cuda")
    stock = copy.deepcopy(ref.model.embed_tokens_per_layer)
    model, patch = patched_copy(ref, "uva")
    uva = ple_table(model)
    device = HostScaledEmbedding(uva.num_embeddings, uva.embedding_dim, uva.padding_idx, uva.scalar_embed_scale,
                                 table=uva.table, backend="device", scale_value=uva.scale_value)
    setups = {"hf": stock, "uva": uva, "device": device}

    def attach(name):
        model.model.embed_tokens_per_layer = setups[name]

    prompt = gd.random_ids(3, 6, VOCAB_PLE, "cuda", 1)
    toks = gd.random_ids(2 + 1 + 4, 3, VOCAB_PLE, "cuda", 2)
    row = gd.interleaved_graph_ms(model, attach, list(setups), prompt, toks, warm=1, device=torch.device("cuda"))
    assert set(row) == set(setups) and all(r["replay_equals_eager"] and r["ms"] > 0 for r in row.values())
    attach("uva")
    device.close()
    patch.revert()

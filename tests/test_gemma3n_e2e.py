"""The Gemma 3n end-to-end harness (``perf/studies/gemma3n_e2e.py``) and its graph-captured decode step
(``perf/studies/graph_decode.py``): the host-constant folding for CUDA graph capture, the captured step against
the eager one, and a whole tiny run on CPU."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'uvaple[hf]')")
from helpers import study  # noqa: E402
from test_gemma3n import VOCAB_PLE, build_reference, patched_copy  # noqa: E402

e2e = study("gemma3n_e2e")
gd = study("graph_decode")


def test_host_constants_record_then_serve_the_same_tensors():
    consts = gd.HostConstants(torch.device("cpu"))
    orig_tensor, orig_to = torch.tensor, torch.Tensor.to
    with consts.record():
        a = torch.tensor([0.95, 0.0], dtype=torch.float32, device="cpu")
        eps = torch.tensor(1e-5).to("cpu")
        free = torch.tensor([1.0, 2.0])  # no device: not a constant bound for the device, never kept
    assert len(consts.kept) == 2
    with consts.serve():
        assert torch.tensor([0.95, 0.0], dtype=torch.float32, device="cpu") is a
        assert torch.tensor(1e-5).to("cpu") is eps
        assert torch.tensor([1.0, 2.0]) is not free
        # a constant seen for the first time during capture is named, with what to do
        with pytest.raises(RuntimeError, match=r"first built during capture.*record\(\)"):
            torch.tensor([0.5], device="cpu")
        # values are part of the key: a different value is a different constant
        with pytest.raises(RuntimeError, match="first built during capture"):
            torch.tensor(2e-5).to("cpu")
    assert torch.tensor is orig_tensor and torch.Tensor.to is orig_to  # restored


def test_host_constants_restore_torch_after_an_error():
    orig_tensor, orig_to = torch.tensor, torch.Tensor.to
    consts = gd.HostConstants(torch.device("cpu"))
    with pytest.raises(RuntimeError), consts.serve():
        torch.tensor([3.0], device="cpu")
    assert torch.tensor is orig_tensor and torch.Tensor.to is orig_to


def test_host_constants_leave_other_threads_alone():
    """A torch function mode, not a swapped function: another thread builds its constants as usual."""
    import threading

    consts = gd.HostConstants(torch.device("cpu"))
    seen = {}

    def other():
        seen["t"] = torch.tensor([0.5], device="cpu")  # would raise "first built during capture" if served

    with consts.serve():
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert torch.equal(seen["t"], torch.tensor([0.5])) and not consts.kept


def test_host_constants_match_a_device_with_or_without_its_index():
    plain, first, second = (gd.HostConstants(torch.device(d)) for d in ("cuda", "cuda:0", "cuda:1"))
    assert plain._bound_here("cuda:0") and plain._bound_here("cuda:1") and plain._bound_here("cuda")
    assert first._bound_here("cuda") and first._bound_here(torch.device("cuda", 0))
    assert not first._bound_here("cuda:1") and not second._bound_here("cuda:0")
    assert not first._bound_here("cpu") and not first._bound_here(None)


def test_host_constants_leave_other_devices_and_big_tensors_alone():
    consts = gd.HostConstants(torch.device("cuda", 0))
    big = torch.arange(gd.HostConstants.MAX_NUMEL + 1, dtype=torch.float32)
    with consts.record():
        x = torch.tensor([1.0], device="cpu")  # bound for the CPU, not the capture device
        y = big.to(torch.float64)  # a dtype change on the host
    assert not consts.kept and x.device.type == "cpu" and y.dtype == torch.float64


def test_cache_counters_rewind():
    from transformers import StaticCache

    model = build_reference(torch.float32)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB_PLE, (2, 5)), past_key_values=cache, use_cache=True)
    counters = gd._cache_counters(cache)
    before = cache.get_seq_length()
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB_PLE, (2, 1)), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == before + 1
    gd._rewind(counters)
    assert cache.get_seq_length() == before
    assert all(int(layer.cumulative_length) == int(dev) for layer, dev, _ in counters if dev is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["hf", "uva", "device"])
def test_graph_decode_step_replays_the_eager_step_gpu(backend):
    ref = build_reference(torch.bfloat16, device="cuda")
    model = ref
    if backend != "hf":
        model, _ = patched_copy(ref, backend)
    for batch in (1, 5):
        r = gd.decode_graph(model, batch, prompt_len=7, steps=4, warm=1, high=VOCAB_PLE, device=torch.device("cuda"))
        assert r["replay_equals_eager"] and r["ms"] > 0


@pytest.mark.gpu
def test_two_live_captures_each_replay_their_eager_step_gpu():
    """A second capture (entering it empties the allocator's cache) leaves the first graph's memory alone:
    the constants the first capture folded live with it, and both replays stay bit-exact."""
    ref = build_reference(torch.bfloat16, device="cuda")
    model, _ = patched_copy(ref, "uva")
    prompt = gd.random_ids(8, 5, VOCAB_PLE, "cuda", 3)
    toks = gd.random_ids(4, 8, VOCAB_PLE, "cuda", 4)
    a = gd.CapturedDecode(model, prompt, toks[0], device=torch.device("cuda"))
    b = gd.CapturedDecode(model, prompt, toks[1], device=torch.device("cuda"))
    torch.cuda.empty_cache()
    try:
        assert a.matches_eager(toks[2]) and b.matches_eager(toks[3]) and a.matches_eager(toks[3])
    finally:
        a.close()
        b.close()


def test_graph_decode_refuses_a_position_past_the_sliding_window():
    model = build_reference(torch.float32)  # sliding window 8
    with pytest.raises(ValueError, match=r"past the sliding window \(8\); use a prompt of at most 7 tokens"):
        gd.decode_graph(model, 1, prompt_len=8, steps=1, warm=0, high=VOCAB_PLE, device=torch.device("cpu"))


@pytest.mark.extended  # ~19 s on 2 cores; the same checks by default: test_gemma3n.py (logits, greedy generate)
def test_tiny_run(tmp_path, device):
    """The whole harness on a toy config: on CPU (interpreter), or on CUDA with the graph-captured steps."""
    rc = e2e.main(["--tiny", "--device", str(device), "--out", str(tmp_path), "--prompts", "2", "--prompt-len", "5",
                   "--new-tokens", "3", "--batches", "1,3", "--steps", "2", "--warm", "1", "--compile-backends", ""])
    assert rc == 0
    res = json.loads((tmp_path / "gemma3n_e2e.json").read_text())
    assert not res["errors"]
    for kind in ("uva", "device", "copy"):
        assert res["correctness"][kind] == {"prefill_logits_bit_identical": True, "generate_tokens_identical": True}
        assert set(res["decode_interleaved_ms"][kind]) == {"1", "3"}
    if device.type == "cuda":
        for kind in ("hf", "uva", "device"):
            points = res["decode_graph"][kind]
            assert set(points) == {"1", "3"} and all(p["replay_equals_eager"] and p["ms"] > 0 for p in points.values())
        assert res["decode_graph"]["copy"].startswith("not capturable")
    else:
        assert res["decode_graph"] == {"skipped": "CUDA graphs need a CUDA device"}
    assert "all eager backends correct: True" in (tmp_path / "gemma3n_e2e.log").read_text()

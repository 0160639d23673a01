"""The n-gram hash kernel (Triton interpreter on CPU here, compiled on CUDA): the torch definition's rows, bit for
bit, for any tokens; one operator that torch.compile and CUDA graphs take whole; bad inputs named."""

from __future__ import annotations

import pytest
import torch
from helpers import on_cuda_1_behind_a_busy_stream

from uvaple.integration.models.qwen4_exp import layer_multipliers, ngram_ids
from uvaple.kernels.ngram import ngram_rows

POISON = -7  # what out holds before a launch: any row it still holds was never written


def layer(n: int, heads_per_ngram: int, *, vocab: int = 151_936, seed: int = 3, device="cpu"):
    """A PLE layer's hash buffers as Qwen4Exp makes them: its multipliers, prime-ish head sizes near 5 M and
    their offsets (each head's range after the previous ones)."""
    g = torch.Generator().manual_seed(seed)
    heads = (n - 1) * heads_per_ngram
    sizes = torch.randint(4_000_000, 6_000_000, (heads,), generator=g) | 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    mult = torch.tensor(layer_multipliers(vocab, n, 1, seed), dtype=torch.long)
    return {k: v.to(device) for k, v in dict(multipliers=mult, sizes=sizes, offsets=offsets).items()}


def histories(b: int, length: int, *, eos: int, vocab: int = 151_936, seed: int = 0, eos_share: float = 0.15):
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(0, vocab, (b, length), generator=g)
    h[torch.rand(h.shape, generator=g) < eos_share] = eos
    return h


def hashed(history, buffers, *, eos, last, heads_per_ngram):
    out = torch.full((history.shape[0], last, buffers["sizes"].numel()), POISON, dtype=torch.long,
                     device=history.device)
    got = ngram_rows(history, eos=eos, last=last, out=out, **buffers)
    assert got is out
    want = ngram_ids(history.cpu(), eos=eos, heads_per_ngram=heads_per_ngram, last=last,
                     **{k: v.cpu() for k, v in buffers.items()})
    return got.cpu(), want


@pytest.mark.parametrize("n,hpn", [(2, 1), (3, 2), (3, 8), (4, 3), (5, 1)])
@pytest.mark.parametrize("b,length,last", [(1, 3, 1), (1, 2, 2), (3, 40, 38), (2, 300, 300), (5, 9, 4)])
def test_rows_are_the_definitions_bit_for_bit(device, n, hpn, b, length, last):
    """Decode (one position), prefill (every position, the history shorter than the n-gram at its start),
    many sequences, positions spanning more than one program; eos tokens at random places."""
    eos = 151_643
    buffers = layer(n, hpn, device=device, seed=n * 10 + hpn)
    history = histories(b, length, eos=eos, seed=b * 1000 + length).to(device)
    got, want = hashed(history, buffers, eos=eos, last=last, heads_per_ngram=hpn)
    assert got.shape == (b, last, (n - 1) * hpn) and torch.equal(got, want)
    hi = (buffers["offsets"] + buffers["sizes"]).cpu()
    assert bool(((got >= buffers["offsets"].cpu()) & (got < hi)).all())  # every row inside its head's range


def test_any_token_values_give_the_definitions_rows(device):
    """Tokens a model never makes: negative ones (a negative mix, whose floor remainder C's % would get
    wrong), ones near the int64 limits (products that wrap), and an eos of 0 and of the largest id."""
    buffers = layer(4, 2, device=device, seed=9)
    g = torch.Generator().manual_seed(11)
    extremes = torch.tensor([-1, -(1 << 40), (1 << 62) + 12345, -(1 << 63), (1 << 63) - 1, 0, 1, 7])
    for eos in (0, 7, (1 << 31) - 1):
        history = extremes[torch.randint(0, len(extremes), (3, 33), generator=g)]
        got, want = hashed(history.to(device), buffers, eos=eos, last=33, heads_per_ngram=2)
        assert torch.equal(got, want)


def test_a_head_of_no_size_gives_the_row_outside_every_table(device):
    """A head whose size is 0 or negative (a layer's buffers are the caller's to change) has no remainder: it
    gives -1 at every position, a row no lookup reads, and the other heads keep their definition's rows."""
    eos = 151_643
    buffers = layer(3, 2, device=device, seed=4)
    good = buffers["sizes"].clone()
    buffers["sizes"][1], buffers["sizes"][2] = 0, -5
    history = histories(2, 9, eos=eos, seed=5).to(device)
    out = torch.full((2, 9, 4), POISON, dtype=torch.long, device=device)
    got = ngram_rows(history, eos=eos, last=9, out=out, **buffers).cpu()
    assert (got[..., 1] == -1).all() and (got[..., 2] == -1).all()
    want = ngram_ids(history.cpu(), eos=eos, heads_per_ngram=2, last=9, multipliers=buffers["multipliers"].cpu(),
                     sizes=good.cpu(), offsets=buffers["offsets"].cpu())
    assert torch.equal(got[..., [0, 3]], want[..., [0, 3]])
    definition = ngram_ids(history.cpu(), eos=eos, heads_per_ngram=2, last=9, **{k: v.cpu() for k, v in
                                                                                 buffers.items()})
    assert torch.equal(got, definition)  # the torch definition says the same


def test_nothing_to_hash_launches_nothing(device):
    buffers = layer(3, 2, device=device)
    empty = ngram_rows(torch.zeros(0, 5, dtype=torch.long, device=device), eos=1, last=5, **buffers)
    assert empty.shape == (0, 5, 4)
    out = torch.full((2, 0, 4), POISON, dtype=torch.long, device=device)
    assert ngram_rows(torch.ones(2, 5, dtype=torch.long, device=device), eos=1, last=0, out=out, **buffers) is out


def test_bad_inputs_are_named(device):
    buffers = layer(3, 2, device=device)
    h = torch.ones(2, 6, dtype=torch.long, device=device)

    def call(history=h, *, last=3, out=None, eos=1, **over):
        return ngram_rows(history, eos=eos, last=last, out=out, **{**buffers, **over})

    with pytest.raises(TypeError, match="history must be a contiguous \\[batch, tokens\\] int64 tensor, got "
                                        "torch.int32"):
        call(h.int())
    with pytest.raises(TypeError, match="not contiguous"):
        call(torch.ones(6, 2, dtype=torch.long, device=device).t())
    with pytest.raises(TypeError, match="history must be .* got list"):
        call([[1, 2]])
    with pytest.raises(ValueError, match="last is 7 but the history holds 6 tokens"):
        call(last=7)
    for last in (-1, 2.0, True):
        with pytest.raises(ValueError, match="last must be a count of positions"):
            call(last=last)
    with pytest.raises(ValueError, match="out has shape \\(2, 3, 5\\); .* must be \\[2, positions <= 6, 4\\]"):
        call(out=torch.empty(2, 3, 5, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="out must be a contiguous \\[batch, positions, heads\\] int64"):
        call(out=torch.empty(2, 3, 4, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="the n-gram hash's sizes must be a contiguous 1-D int64 tensor"):
        call(sizes=buffers["sizes"].float())
    with pytest.raises(ValueError, match="at least 2 multipliers"):
        call(multipliers=buffers["multipliers"][:1])
    with pytest.raises(ValueError, match="must hold \\(N - 1\\) \\* heads_per_ngram values each"):
        call(offsets=buffers["offsets"][:3])
    for eos in (True, 1 << 31, 2.0):
        with pytest.raises(ValueError, match="end-of-sequence token must be an int32 token id"):
            call(eos=eos)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="history is on cpu, the layer's hash buffers on cuda"):
            call(h.cpu())


def test_torch_compile_takes_the_hash_whole(device):
    buffers = layer(3, 4, device=device)
    eos = 5

    def f(history):
        return ngram_rows(history, eos=eos, last=history.shape[1] - 2, **buffers) + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    history = histories(3, 20, eos=eos, vocab=50, eos_share=0.3).to(device)
    want = ngram_ids(history.cpu(), eos=eos, heads_per_ngram=4, last=18, **{k: v.cpu() for k, v in buffers.items()})
    assert torch.equal(compiled(history).cpu(), want + 1)


@pytest.mark.gpu
def test_a_captured_hash_replays_with_the_tokens_of_each_step():
    """Decode as a CUDA graph runs it: the graph captured once over static history and out; each replay
    hashes what the history holds then."""
    buffers = layer(3, 8, device="cuda")
    eos = 151_643
    history = histories(8, 3, eos=eos).cuda()
    out = torch.full((8, 1, 16), POISON, dtype=torch.long, device="cuda")
    ngram_rows(history, eos=eos, last=1, out=out, **buffers)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ngram_rows(history, eos=eos, last=1, out=out, **buffers)
    for step in range(4):
        history.copy_(histories(8, 3, eos=eos, seed=step + 1))
        out.fill_(POISON)
        graph.replay()
        want = ngram_ids(history.cpu(), eos=eos, heads_per_ngram=8, last=1, **{k: v.cpu() for k, v in buffers.items()})
        assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (device kind nvidia-h200-x2)")
def test_the_hash_of_the_second_gpu_runs_there_in_its_stream_order_whatever_device_is_current():
    """As the gather: Triton launches on the current device, the hash on its tensors' and that device's
    current stream."""
    eos = 151_643
    buffers = layer(3, 2, device="cuda:1", seed=4)
    want_history = histories(2, 64, eos=eos, seed=6)
    history = torch.zeros(2, 64, dtype=torch.long, device="cuda:1")
    hashed(want_history.to("cuda:1"), buffers, eos=eos, last=64, heads_per_ngram=2)  # compiled for cuda:1 first
    out = torch.full((2, 64, 4), POISON, dtype=torch.long, device="cuda:1")
    src = want_history.to("cuda:1")
    torch.cuda.synchronize("cuda:1")
    busy = on_cuda_1_behind_a_busy_stream(lambda: ngram_rows(history, eos=eos, last=64, out=out, **buffers),
                                          history, src)
    busy.synchronize()
    want = ngram_ids(want_history, eos=eos, heads_per_ngram=2, last=64, **{k: v.cpu() for k, v in buffers.items()})
    assert torch.equal(out.cpu(), want)

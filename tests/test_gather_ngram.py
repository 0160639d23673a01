"""The n-gram gather (``Lookup.lookup_ngrams``): an n-gram PLE layer's rows from its tokens, the hash inside the
gather, one launch; the bits and counters of the hash's launch followed by the gather, for every encoding, row
policy and window; the paths that keep two launches (hot set, sorted calls, the copy placement, torch.compile)
give the same bits; every bad call a named error that writes nothing. Interpreted on CPU, compiled on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import EXTENDED, bits, capture, rand

from uvaple.integration import HotSet, TableSpec, make_lookup
from uvaple.integration.embedding import HostScaledEmbedding
from uvaple.integration.errors import BackendClosed
from uvaple.integration.models.qwen4_exp import layer_multipliers, ngram_ids
from uvaple.kernels import launch as _launch
from uvaple.kernels import reference_gather
from uvaple.kernels.ngram import ngram_rows
from uvaple.kernels.tuning import LaunchConfig
from uvaple.uva import HostTable

EOS = 3
VOCAB = 500
POISON = -13.5


def layer(n: int, hpn: int, *, size: int, seed: int, device, base: int = 0):
    """A layer's hash buffers whose heads cover ``[base, base + heads * size)`` with sizes near ``size``."""
    g = torch.Generator().manual_seed(seed)
    heads = (n - 1) * hpn
    sizes = torch.randint(size - size // 4, size, (heads,), generator=g) | 1
    offsets = base + torch.arange(heads) * size
    mult = torch.tensor(layer_multipliers(VOCAB, n, 1, seed), dtype=torch.long)
    return {k: v.to(device) for k, v in dict(multipliers=mult, sizes=sizes, offsets=offsets).items()}


def histories(b: int, length: int, *, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(0, VOCAB, (b, length), generator=g)
    h[torch.rand(h.shape, generator=g) < 0.2] = EOS
    return h.to(device)


def fp8_row_table(rows: int, values: int, fp8, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, values), generator=g, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x12  # no NaN codes: NaN payloads are the device's
    codes[codes == 0xFF] = 0x34
    scales = (torch.rand(rows, generator=g) + 0.1).view(-1, 1)
    return torch.cat([codes, scales.view(torch.uint8).reshape(-1, 4)], dim=1).view(fp8)


class Launches:
    """Counts kernel launches (every gather and hash launch goes through ``KernelLaunch``)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = _launch.KernelLaunch.__call__

        def counted(launcher, *args, **kw):
            self.count += 1
            return real(launcher, *args, **kw)

        monkeypatch.setattr(_launch.KernelLaunch, "__call__", counted)


def two_launches(table, spec, device, history, buffers, last, **lookup_kw):
    """The hash's launch, then the gather, through a lookup of their own: rows and its counters."""
    with make_lookup("uva", table, device=device, spec=spec, **lookup_kw) as lk:
        ids = ngram_rows(history, eos=EOS, last=last, **buffers)
        rows = lk.lookup(ids)
        return rows, lk.stats(), ids


# the table kinds: (dtype, encoding, spec options); ids land inside the window, outside it and past the table
KINDS = {
    "bf16 scaled row0": (torch.bfloat16, "raw", dict(scale=16.0, oob="row0")),
    "bf16 copy window": (torch.bfloat16, "raw", dict(oob="zero", row_window=(40, 330), id_offset=9)),
    "fp32 to bf16 neg_zero": (torch.float32, "raw", dict(oob="neg_zero", out_dtype=torch.bfloat16)),
    "fp8_row e4m3 window": (torch.float8_e4m3fn, "fp8_row", dict(oob="zero", row_window=(25, 340),
                                                                 out_dtype=torch.bfloat16)),
    "fp8_global e5m2 fp32": (torch.float8_e5m2, "fp8_global", dict(oob="neg_zero", out_dtype=torch.float32)),
}


def make_table(kind: str, rows: int = 360, cols: int = 24):
    dtype, encoding, opts = KINDS[kind]
    if encoding == "fp8_row":
        t = fp8_row_table(rows, cols, dtype, seed=5)
    elif encoding == "fp8_global":
        t = rand(rows, cols, torch.float32, seed=6).to(dtype)
    else:
        t = rand(rows, cols, dtype, seed=7)
    h = HostTable.from_tensor(t)
    return t, h, TableSpec.of(h, encoding=encoding, **opts)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n,hpn,b,length,last", [(3, 2, 1, 3, 1), (2, 1, 3, 7, 7), (4, 3, 2, 2, 2),
                                                 (3, 2, 5, 11, 4)])
def test_rows_and_counters_are_the_hash_then_the_gather_in_one_launch(device, monkeypatch, kind, n, hpn, b, length,
                                                                        last):
    """Decode (one position), a prefill from the history's start (shorter than an n-gram there), several
    sequences; eos tokens at random places; heads whose ranges reach past the window and the table."""
    t, h, spec = make_table(kind)
    scale = torch.tensor([0.0371], device=device) if spec.encoding == "fp8_global" else None
    heads = (n - 1) * hpn  # ids from -60 to 440: below the table, inside it and its window, past its 360 rows
    buffers = layer(n, hpn, size=500 // heads, seed=n * 7 + hpn, device=device, base=-60)
    history = histories(b, length, seed=b * 100 + length, device=device)
    want, want_stats, ids = two_launches(h, spec, device, history, buffers, last, dequant_scale=scale)
    launches = Launches(monkeypatch)
    with make_lookup("uva", h, device=device, spec=spec, dequant_scale=scale) as lk:
        out = torch.full((b, last, (n - 1) * hpn, spec.value_cols), POISON, dtype=spec.output_dtype, device=device)
        got = lk.lookup_ngrams(history, eos=EOS, last=last, out=out, **buffers)
        assert launches.count == 1 and got is out
        assert torch.equal(bits(got), bits(want))
        ref = reference_gather(t, ids, scale=spec.scale, oob=spec.oob, out_dtype=spec.output_dtype,
                               dequant_scale=None if scale is None else scale.cpu(), rows=spec.window,
                               id_base=spec.id_offset, encoding=spec.encoding)
        assert torch.equal(bits(got), bits(ref))
        stats = lk.stats()
        assert {k: stats[k] for k in ("lookups", "rows", "out_of_range_ids")} == \
            {k: want_stats[k] for k in ("lookups", "rows", "out_of_range_ids")}
    lo, hi = spec.window
    rows = ids.cpu() - spec.id_offset
    assert bool(((rows < lo) | (rows >= hi)).any()) and bool(((rows >= lo) & (rows < hi)).any())
    h.close()


def test_any_token_values_and_layers_in_turn(device, monkeypatch):
    """Tokens a model never makes (negative, near the int64 limits: wrapped products, a negative mix), an eos of
    0, and two layers' hashes through one lookup in turn (its launcher follows the buffers it is given)."""
    t, h, spec = make_table("bf16 copy window")
    layers = [layer(3, 2, size=100, seed=1, device=device), layer(4, 1, size=120, seed=2, device=device)]
    extremes = torch.tensor([-1, -(1 << 40), (1 << 62) + 12345, -(1 << 63), (1 << 63) - 1, 0, 1, 7])
    history = extremes[torch.randint(0, len(extremes), (3, 9), generator=torch.Generator().manual_seed(4))]
    history = history.to(device)
    launches = Launches(monkeypatch)
    with make_lookup("uva", h, device=device, spec=spec) as lk:
        for i in (0, 1, 0, 1):
            got = lk.lookup_ngrams(history, eos=0, last=9, **layers[i])
            ids = ngram_ids(history.cpu(), eos=0, heads_per_ngram=2 if i == 0 else 1, last=9,
                            **{k: v.cpu() for k, v in layers[i].items()})
            want = reference_gather(t, ids, oob="zero", rows=spec.window, id_base=spec.id_offset)
            assert torch.equal(bits(got), bits(want)), i
    assert launches.count == 4
    h.close()


# the copy placement's worker and CPU gather take ~12 s to start interpreted: the extended set's (the base's path is
# the hot set's too)
@pytest.mark.parametrize("path", ["hot set", "sorted", pytest.param("copy", marks=EXTENDED), "compiled"])
def test_the_paths_that_hash_then_gather_give_the_same_rows(device, monkeypatch, path):
    """A hot set (its map would have to be read for each hashed row), a call the plan sorts, the copy
    placement and a call under torch.compile keep the hash's launch, then the gather: the same bits."""
    t, h, spec = make_table("bf16 scaled row0")
    buffers = layer(3, 2, size=80, seed=9, device=device)
    history = histories(2, 6, seed=3, device=device)
    want, _, _ = two_launches(h, spec, device, history, buffers, 6)
    kind, kw = "uva", {}
    if path == "hot set":
        kw = dict(hot=HotSet(h, 120, device, rows=torch.arange(0, 360, 3)))
    elif path == "sorted":
        kw = dict(order="sorted", max_rows=64)
    elif path == "copy":
        kind, kw = "copy", dict(max_rows=64)
    launches = Launches(monkeypatch)
    with make_lookup(kind, h, device=device, spec=spec, **kw) as lk:
        if path == "compiled":
            call = torch.compile(lambda x: lk.lookup_ngrams(x, eos=EOS, last=6, **buffers) + 0, backend="eager",
                                 fullgraph=True)
        else:
            def call(x):
                return lk.lookup_ngrams(x, eos=EOS, last=6, **buffers)
        got = call(history)
        assert torch.equal(bits(got), bits(want))
        assert path == "copy" or launches.count >= 2  # the hash, then the gather (sorted: its own launches)
    h.close()


def test_a_head_of_no_size_reads_the_policys_row_in_either_launch(device):
    """A head of size 0 hashes to a row outside the table in the fused launch as in the hash's own: the
    policy's zero row at each of its positions, counted as out of range, the same bits either way."""
    t, h, spec = make_table("bf16 copy window")
    buffers = layer(3, 2, size=80, seed=12, device=device)
    buffers["sizes"][1] = 0
    history = histories(2, 5, seed=8, device=device)
    want, want_stats, ids = two_launches(h, spec, device, history, buffers, 5)
    assert (ids[..., 1] == -1).all()
    with make_lookup("uva", h, device=device, spec=spec) as lk:
        got = lk.lookup_ngrams(history, eos=EOS, last=5, **buffers)
        assert torch.equal(bits(got), bits(want))
        assert lk.stats()["out_of_range_ids"] == want_stats["out_of_range_ids"] >= 10
    assert not bits(got[:, :, 1]).any()  # +0.0 rows
    h.close()


def test_bad_calls_are_named_and_write_nothing(device):
    t, h, spec = make_table("bf16 scaled row0")
    buffers = layer(3, 2, size=80, seed=9, device=device)
    history = histories(2, 6, seed=3, device=device)
    lk = make_lookup("uva", h, device=device, spec=spec, max_rows=20)
    out = torch.full((2, 2, 4, 24), POISON, dtype=torch.bfloat16, device=device)

    def call(history=history, *, last=2, out=out, eos=EOS, **over):
        return lk.lookup_ngrams(history, eos=eos, last=last, out=out, **{**buffers, **over})

    cases = [
        (dict(history=history.int()), TypeError, "history must be a contiguous \\[batch, tokens\\] int64 tensor"),
        (dict(history=history.t()), TypeError, "not contiguous"),
        (dict(history=history[0]), TypeError, "history must be a contiguous \\[batch, tokens\\]"),
        (dict(history=[[1, 2]]), TypeError, "got list"),
        (dict(last=7), ValueError, "last is 7 but the history holds 6 tokens"),
        (dict(last=-1), ValueError, "last must be a count of positions"),
        (dict(last=True), ValueError, "last must be a count of positions"),
        (dict(last=3), ValueError, "24 ids in one call, but this lookup was built for max_rows=20"),
        (dict(out=out[:, :1]), ValueError, "out has shape \\(2, 1, 4, 24\\), expected \\(2, 2, 4, 24\\)"),
        (dict(out=out.float()), TypeError, "out has dtype torch.float32, expected torch.bfloat16"),
        (dict(sizes=buffers["sizes"].float()), TypeError, "the n-gram hash's sizes must be a contiguous 1-D int64"),
        (dict(multipliers=buffers["multipliers"][:1]), ValueError, "at least 2 multipliers"),
        (dict(offsets=buffers["offsets"][:3]), ValueError, "must hold \\(N - 1\\) \\* heads_per_ngram values"),
        (dict(eos=True), ValueError, "end-of-sequence token must be an int32 token id"),
        (dict(eos=1 << 31), ValueError, "end-of-sequence token must be an int32 token id"),
    ]
    if device.type == "cuda":
        cases += [(dict(history=history.cpu()), ValueError, "history is on cpu; this lookup serves cuda"),
                  (dict(multipliers=buffers["multipliers"].cpu()), ValueError, "multipliers are on cpu")]
    for over, error, match in cases:
        with pytest.raises(error, match=match):
            call(**over)
        assert bool((out == POISON).all()), over
    assert call() is out and not bool((out == POISON).any())  # the same lookup still serves a good call
    assert call(eos=1) is out  # its launcher is now eos 1's: values equal to 1 that are not int token ids ...
    for eos in (True, np.int64(1), 1.0):
        with pytest.raises(ValueError, match="end-of-sequence token must be an int32 token id"):
            call(eos=eos)  # ... are still refused
    sizes = buffers["sizes"].clone()
    call(sizes=sizes)
    sizes.resize_(3)  # the same tensor, another length: checked again
    with pytest.raises(ValueError, match="must hold \\(N - 1\\) \\* heads_per_ngram values"):
        call(sizes=sizes)
    lk.close()
    with pytest.raises(BackendClosed):
        call()
    h.close()


@pytest.mark.parametrize("row_tiles", [False, True])
def test_rows_of_several_tiles_in_either_launch_order(device, monkeypatch, row_tiles):
    """Rows wider than a tile (2,100 bf16 values: two 4 KiB tiles, or 64-value tiles side by side in a 1-D
    grid): every tile of every row, the counters once a row."""
    t = rand(300, 2100, torch.bfloat16, seed=8)
    with HostTable.from_tensor(t) as h:
        spec = TableSpec.of(h, oob="zero", row_window=(10, 290))
        buffers = layer(3, 2, size=90, seed=4, device=device, base=-20)
        history = histories(3, 4, seed=6, device=device)
        ids = ngram_rows(history, eos=EOS, last=2, **buffers)
        with make_lookup("uva", h, device=device, spec=spec) as lk:
            if row_tiles:
                lk.plan.direct.config = LaunchConfig(block=64, num_warps=1, row_tiles=True)  # a bench sweep's
            launches = Launches(monkeypatch)
            got = lk.lookup_ngrams(history, eos=EOS, last=2, **buffers)
            assert launches.count == 1
            assert torch.equal(bits(got), bits(reference_gather(t, ids, rows=(10, 290))))
            rows = ids.cpu()
            assert lk.stats()["out_of_range_ids"] == int(((rows < 10) | (rows >= 290)).sum()) > 0
            assert lk.stats()["rows"] == ids.numel()


def test_the_embeddings_ngram_forward_fills_its_static_output(device):
    """``HostScaledEmbedding.forward_ngrams`` with ``max_tokens``: the rows of ``forward(ngram_rows(...))`` in a
    view of the module's static output; more ids than it holds, or ``last`` past the history, named."""
    t = rand(360, 24, torch.bfloat16, seed=3)
    emb = HostScaledEmbedding.from_embedding(torch.nn.Embedding.from_pretrained(t), max_tokens=16)
    buffers = layer(3, 2, size=80, seed=9, device=device)
    history = histories(2, 5, seed=2, device=device)
    want = emb(ngram_rows(history, eos=EOS, last=2, **buffers)).clone()
    got = emb.forward_ngrams(history, eos=EOS, last=2, **buffers)
    assert got.shape == (2, 2, 4, 24) and torch.equal(bits(got), bits(want))
    assert got.data_ptr() == emb(ngram_rows(history, eos=EOS, last=2, **buffers)).data_ptr()  # the static output
    with pytest.raises(ValueError, match="24 ids in one forward, but this embedding was built with max_tokens=16"):
        emb.forward_ngrams(history, eos=EOS, last=3, **buffers)
    with pytest.raises(ValueError, match="last is 6 but the history holds 5 tokens"):
        emb.forward_ngrams(history, eos=EOS, last=6, **buffers)
    with pytest.raises(TypeError, match="history must be a contiguous \\[batch, tokens\\] int64 tensor, got list"):
        emb.forward_ngrams([[1, 2]], eos=EOS, last=1, **buffers)
    emb.close()


def test_nothing_to_gather_launches_nothing(device, monkeypatch):
    t, h, spec = make_table("bf16 scaled row0")
    buffers = layer(3, 2, size=80, seed=9, device=device)
    launches = Launches(monkeypatch)
    with make_lookup("uva", h, device=device, spec=spec) as lk:
        got = lk.lookup_ngrams(histories(2, 5, seed=1, device=device), eos=EOS, last=0, **buffers)
        empty = lk.lookup_ngrams(torch.zeros(0, 5, dtype=torch.long, device=device), eos=EOS, last=5, **buffers)
    assert got.shape == (2, 0, 4, 24) and empty.shape == (0, 5, 4, 24) and launches.count == 0
    h.close()


@pytest.mark.gpu
def test_a_captured_ngram_gather_replays_with_the_tokens_of_each_step():
    """Captured in a CUDA graph (one kernel node), each replay hashes the tokens the history holds then."""
    device = torch.device("cuda")
    t, h, spec = make_table("fp8_row e4m3 window")
    buffers = layer(3, 2, size=130, seed=2, device=device)
    history = histories(4, 3, seed=0, device=device)
    with make_lookup("uva", h, device=device, spec=spec) as lk:
        out = torch.empty(4, 1, 4, spec.value_cols, dtype=spec.output_dtype, device=device)
        graph, _ = capture(lambda: lk.lookup_ngrams(history, eos=EOS, last=1, out=out, **buffers))
        for seed in range(1, 4):
            history.copy_(histories(4, 3, seed=seed, device=device))
            out.fill_(POISON)
            graph.replay()
            ids = ngram_rows(history, eos=EOS, last=1, **buffers)
            want = reference_gather(t, ids, oob="zero", rows=spec.window, out_dtype=spec.output_dtype,
                                    encoding="fp8_row")
            assert torch.equal(bits(out), bits(want)), seed
    h.close()

"""Qwen4Exp end to end: the n-gram tables in host memory against HF transformers' own model.

A tiny random Qwen4Exp (transformers' config and modeling classes; three PLE layers, tables saved as uneven
shards) is compared with its uvaple form, built from the live model (``apply_uvaple_to_qwen4_exp``) and
loaded from ``save_pretrained`` (``load_qwen4_exp_with_host_ple``): the hashed ids of every head (the edges
of each head's prime range included), the rows, hidden states and logits bit for bit over a prefill and
decode steps with a cache; the fp8 tables (quantised on load, and a checkpoint stored in transformers' fp8
layout) against their formula; the quantiser kernel against the registry's torch quantiser on hard inputs;
every bad checkpoint a named error before anything is allocated. On CPU the gathers run under the Triton
interpreter; the GPU tests (no host synchronisation in a decode step, CUDA graphs) run on the GPU machine.
"""

from __future__ import annotations

import copy
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'uvaple[hf]')")
pytest.importorskip("transformers.models.qwen4_exp", reason="this transformers has no Qwen4Exp (5.17 or later)")
from helpers import bits  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import CompileConfig, DynamicCache, Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402
from transformers.models.qwen4_exp import modeling_qwen4_exp  # noqa: E402

from uvaple.integration import make_lookup  # noqa: E402
from uvaple.integration.embedding import HostScaledEmbedding  # noqa: E402
from uvaple.integration.encoded_embedding import HostEncodedEmbedding  # noqa: E402
from uvaple.integration.models import ngram_tables  # noqa: E402
from uvaple.integration.models.ngram_tables import (  # noqa: E402
    NoPleLayersError,
    ShardMissingError,
    ShardShapeError,
    ngram_layout,
)
from uvaple.integration.models.qwen4_exp import (  # noqa: E402
    apply_uvaple_to_qwen4_exp,
    layer_multipliers,
    load_qwen4_exp_with_host_ple,
    ngram_embedding_class,
    ngram_ids,
)
from uvaple.integration.quantize import fp8_row_table, quantize_fp8_rows_into  # noqa: E402
from uvaple.kernels.encodings import ENCODINGS, FP8_MAX, quantize_fp8_rows  # noqa: E402
from uvaple.uva import HostMemoryError, HostTable  # noqa: E402

VOCAB, EOS = 300, 1
PLE_LAYERS = [1, 2, 3]  # one-indexed decoder layers (the linear-attention ones)
ROOT = Path(__file__).resolve().parents[1]


def tiny_config(**kw) -> Qwen4ExpTextConfig:
    args = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=PLE_LAYERS, ple_embed_dim=32, ngram_size=3,
        heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=3,  # tables of 240, 312, 392 rows: shards of 80 x 3, 104 x 3, 131 + 131 + 130
        eos_token_id=EOS, pad_token_id=0, bos_token_id=2, max_position_embeddings=128, indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4)
    args.update(kw)
    return Qwen4ExpTextConfig(**args)


def ngram_modules(model) -> list:
    return [layer.ple.ple_embedding for layer in model.model.layers if layer.ple is not None]


def build_reference(seed: int = 0) -> Qwen4ExpForCausalLM:
    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(tiny_config()).to(torch.bfloat16).eval()
    with torch.no_grad():  # random rows, never zero (HF's init std would make them tiny)
        for mod in ngram_modules(model):
            w = mod.ngram_embedding.weight
            w.normal_(0.0, 1.0)
            w[w == 0] = 0.5
    return model


def cache_kw(model, cache) -> dict:
    """The model's name for the cache argument (``cache`` from 5.24, ``past_key_values`` before)."""
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def run_steps(model, prompt: torch.Tensor, steps: int) -> list:
    """Logits and hidden states of a prefill and ``steps`` greedy decode steps with a cache."""
    cache = DynamicCache(config=model.config)
    out, ids = [], prompt
    with torch.no_grad():
        for _ in range(steps + 1):
            o = model(ids, output_hidden_states=True, **cache_kw(model, cache))
            out.append((o.logits, o.hidden_states))
            ids = o.logits[:, -1:].argmax(-1)
    return out


def assert_same_steps(got: list, want: list) -> None:
    for (lg, hg), (lw, hw) in zip(got, want, strict=True):
        assert torch.equal(bits(lg), bits(lw))
        assert len(hg) == len(hw) and all(torch.equal(bits(a), bits(b)) for a, b in zip(hg, hw, strict=True))


def prompts(shape=(2, 6), seed=1, eos_at=((0, 2),)) -> torch.Tensor:
    ids = torch.randint(2, VOCAB, shape, generator=torch.Generator().manual_seed(seed))
    for b, p in eos_at:
        ids[b, p] = EOS
    return ids


@pytest.fixture(scope="module")
def ref():
    return build_reference()


@pytest.fixture(scope="module")
def checkpoint(ref, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp") / "bf16"
    ref.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def patched(ref):
    model = copy.deepcopy(ref)
    patch = apply_uvaple_to_qwen4_exp(model)
    yield model
    patch.revert()


# ---------------------------------------------------------------------- the hashed ids
class Recorder(torch.nn.Module):
    """Stands in for a table: returns the ids it is asked for (as ``[..., 1]``), so forwards return ids."""

    def __init__(self):
        super().__init__()
        self.weight = torch.empty(0)  # transformers' forward moves the ids to the table's device

    def forward(self, ids):
        return ids.unsqueeze(-1)


class IdRecorder(Recorder):
    """Our side's stand-in: a table whose row ``r`` holds ``r`` (int32 bits in a float32 column, which a gather
    copies as they are), read through the lookup's n-gram call, so the ids are those the fused hash-and-gather
    kernel computes."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = HostTable.from_tensor(torch.arange(rows, dtype=torch.int32).view(torch.float32).view(rows, 1))
        self.lookups = {}

    def forward_ngrams(self, history, **hash_and_last):
        device = history.device
        if device not in self.lookups:
            self.lookups[device] = make_lookup("uva", self.rows, device=device)
        got = self.lookups[device].lookup_ngrams(history, **hash_and_last)  # [B, last, heads, 1]
        return got.view(torch.int32).to(torch.int64)


def edge_prompt(mod) -> torch.Tensor:
    """Tokens whose n-grams hash to both ends of every head's range of ``mod``'s layer (no eos inside)."""
    m = mod.layer_multipliers
    sizes, h = mod.head_vocab_sizes, mod.heads_per_ngram
    toks = torch.arange(2, VOCAB)
    t0, t1 = torch.meshgrid(toks, toks, indexing="ij")  # current, previous
    mixed2 = t0 * m[0] ^ t1 * m[1]
    t2 = torch.full_like(t0, 7)  # a fixed token two places back
    mixed3 = mixed2 ^ t2 * m[2]
    seq = []
    for head in range(2 * h):
        mixed, order = (mixed2, 2) if head < h else (mixed3, 3)
        for target in (0, sizes[head] - 1):
            i = int((mixed % sizes[head] == target).flatten().nonzero()[0])
            gram = [int(t1.flatten()[i]), int(t0.flatten()[i])]
            seq += ([7] + gram) if order == 3 else gram
    return torch.tensor([seq])


def test_multipliers_and_table_layout_are_transformers(ref):
    cfg = ref.config
    for lay, mod in zip(ngram_layout(cfg), ngram_modules(ref), strict=True):
        assert mod.layer_multipliers.tolist() == layer_multipliers(cfg.vocab_size, cfg.ngram_size, lay.ple_index,
                                                                   cfg.seed)
        assert list(lay.head_sizes) == mod.head_vocab_sizes and lay.layer_idx == mod.layer_idx
        assert (lay.rows, lay.cols) == tuple(mod.ngram_embedding.weight.shape)
    # the real config's prime ranges (20M base), three PLE layers
    real = Qwen4ExpTextConfig(ple_layer_ids=[1, 2, 3], eos_token_id=EOS)
    with torch.device("meta"):
        hf = modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding(real, real.ple_embed_dim, 2, 2)
    lay = ngram_layout(real)[2]
    assert list(lay.head_sizes) == hf.head_vocab_sizes and lay.rows == hf.ngram_embedding.num_embeddings


def test_ids_of_every_head_and_edge_match_transformers_with_a_cache(ref):
    """Both forwards with a recorder for a table: the ids themselves, prefill then decode, cache included."""
    drop_in = ngram_embedding_class()
    for hf_mod in ngram_modules(ref):
        hf = copy.deepcopy(hf_mod)
        ours = drop_in.from_module(hf)
        hf.ngram_embedding, ours.ngram_embedding = Recorder(), IdRecorder(hf.ngram_embedding.weight.shape[0])
        edges = edge_prompt(hf)
        heads = hf.ngram_heads
        bounds = {o + e for o, s in zip(hf.head_offsets, hf.head_vocab_sizes, strict=True) for e in (0, s - 1)}
        eos_here = ((0, 0), (1, 3), (1, 4), (2, 4))  # first position, twice in a row, last position
        cases = [edges, prompts((3, 5), seed=2, eos_at=eos_here), prompts((2, 1), seed=3, eos_at=())]
        for prompt in cases:
            caches = [DynamicCache(config=ref.config) for _ in range(2)]
            step = prompt
            for i in range(4):  # prefill, then decode steps (an eos among them)
                got = ours(step, caches[0])
                want = hf(step, caches[1])
                assert got.dtype == torch.int64 and got.shape == (*step.shape, heads) and torch.equal(got, want)
                if prompt is edges and i == 0:
                    assert bounds <= set(got.flatten().tolist())  # both ends of every head's range were hit
                state = [c.layers[hf.layer_idx].conv_states[2] for c in caches]
                assert torch.equal(state[0], state[1])
                step = torch.randint(2, VOCAB, (prompt.shape[0], 1))
                if i == 1:
                    step[0] = EOS
        # without a cache too
        assert torch.equal(ours(cases[1], None), hf(cases[1], None))


def test_ngram_ids_function_on_long_histories():
    torch.manual_seed(4)
    mod = ngram_modules(build_reference())[1]
    hist = torch.randint(2, VOCAB, (4, 40))
    hist[torch.rand(hist.shape) < 0.2] = EOS
    mod.ngram_embedding = Recorder()
    want = mod(hist[:, 2:], None)  # transformers starts from an eos context of ngram_size - 1 tokens
    full = torch.cat([torch.full((4, 2), EOS), hist[:, 2:]], dim=1)
    got = ngram_ids(full, eos=EOS, multipliers=mod.layer_multipliers, sizes=mod.ngram_heads_vocab_sizes,
                    offsets=mod.ngram_heads_offsets, heads_per_ngram=mod.heads_per_ngram, last=38)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------- rows, hidden states, logits
def test_rows_through_the_host_table_are_transformers_rows(ref):
    drop_in = ngram_embedding_class()
    for hf in ngram_modules(ref)[::2]:
        ours = drop_in.from_module(hf)
        emb = ours.ngram_embedding
        assert isinstance(emb, HostScaledEmbedding) and emb.table.shape == tuple(hf.ngram_embedding.weight.shape)
        every = torch.arange(emb.num_embeddings)  # the padding rows past the last head's range too
        assert torch.equal(bits(emb(every)), bits(hf.ngram_embedding.weight))
        caches = [DynamicCache(config=ref.config) for _ in range(2)]
        for step in (edge_prompt(hf), torch.tensor([[EOS]]), torch.tensor([[5]])):
            assert torch.equal(bits(ours(step, caches[0])), bits(hf(step, caches[1])))
        ours.close()


@pytest.mark.parametrize("backend, options", [("device", {}), ("uva", {"hot_fraction": 0.25}),
                                              ("uva", {"order": "sorted", "dedup": True, "max_rows": 512})])
def test_placements_and_levers_give_transformers_rows(ref, backend, options):
    hf = ngram_modules(ref)[2]
    ours = ngram_embedding_class().from_module(hf, backend=backend, backend_options=options)
    prompt = edge_prompt(hf)
    assert torch.equal(bits(ours(prompt, None)), bits(hf(prompt, None)))
    ours.close()


def test_the_reference_logits_depend_on_the_rows_read(ref):
    """Otherwise the model-level comparisons would not test the tables at all."""
    model = copy.deepcopy(ref)
    ids = prompts((1, 8), seed=5, eos_at=())
    mod = ngram_modules(model)[1]
    rows = ngram_ids(torch.cat([torch.full((1, 2), EOS), ids], 1), eos=EOS, multipliers=mod.layer_multipliers,
                     sizes=mod.ngram_heads_vocab_sizes, offsets=mod.ngram_heads_offsets,
                     heads_per_ngram=mod.heads_per_ngram, last=8)[0]  # [8, heads]
    counts = torch.bincount(rows.flatten(), minlength=mod.ngram_embedding.num_embeddings)
    pos, head = next((p, h) for p in range(3, 8) for h in range(rows.shape[1]) if counts[rows[p, h]] == 1)
    with torch.no_grad():
        want = model(ids).logits
        mod.ngram_embedding.weight[rows[pos, head]].mul_(3.0)
        got = model(ids).logits
    changed = (got != want).any(dim=-1)[0]
    assert changed[pos:].all() and not changed[:pos].any()


def test_live_swap_logits_and_hidden_states_bit_identical_over_decode_steps(ref, patched):
    mods = ngram_modules(patched)
    assert all(isinstance(m, ngram_embedding_class()) and isinstance(m, modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding)
               for m in mods)
    n_tables = sum(m.ngram_embedding.table.rows * m.ngram_embedding.table.cols for m in mods)
    assert n_tables == sum(m.ngram_embedding.weight.numel() for m in ngram_modules(ref))
    assert all(p.numel() < 1000 or p.dim() != 2 or p.shape[1] != 8 for p in patched.parameters())
    prompt = prompts((2, 6), seed=6)
    assert_same_steps(run_steps(patched, prompt, 3), run_steps(ref, prompt, 3))
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(prompt, cache_implementation="static", **kw),
                       ref.generate(prompt, cache_implementation="static", **kw))


def test_the_ple_layer_traces_as_one_graph_with_a_static_cache(ref, patched):
    """torch.compile(fullgraph=True) takes the PLE layer, our n-gram module inside, as one graph per shape
    (prefill, decode) and gives transformers' bits; on the GPU the same graph is captured (test below)."""
    from torch._dynamo.utils import counters

    counters.clear()
    ours, theirs = patched.model.layers[1].ple, ref.model.layers[1].ple
    traced = torch.compile(ours, fullgraph=True, backend="eager")
    caches = [transformers.StaticCache(config=ref.config, max_cache_len=32) for _ in range(2)]
    width = ref.config.hc_count * ref.config.hidden_size
    hidden, step = torch.randn(2, 5, width, dtype=torch.bfloat16), prompts((2, 5), seed=13)
    with torch.no_grad():
        for i in range(3):
            assert torch.equal(bits(traced(hidden, step, caches[0])), bits(theirs(hidden, step, caches[1])))
            hidden, step = torch.randn(2, 1, width, dtype=torch.bfloat16), torch.randint(2, VOCAB, (2, 1))
            step[0] = EOS if i == 0 else step[0]
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


def test_revert_gives_the_tables_back(ref):
    model = copy.deepcopy(ref)
    children = ngram_modules(model)
    with apply_uvaple_to_qwen4_exp(model, max_tokens=16) as patch:
        assert len(patch.modules) == 3 and all(m.max_tokens == 16 * 4 for m in patch.modules)  # 4 heads a token
        assert all(c.ngram_embedding.weight.numel() == 0 for c in children)  # the original tables are freed
    assert all(type(m) is modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding for m in ngram_modules(model))
    for a, b in zip(ngram_modules(model), ngram_modules(ref), strict=True):
        assert torch.equal(bits(a.ngram_embedding.weight), bits(b.ngram_embedding.weight))


def test_class_patch_builds_host_tables_and_reverts():
    cfg = tiny_config()
    with apply_uvaple_to_qwen4_exp() as patch:
        assert modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding is not ngram_embedding_class()  # bound subclass
        torch.manual_seed(0)
        model = Qwen4ExpForCausalLM(cfg).eval()
        assert patch.kind == "class"
    assert modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding.__name__ == "Qwen4ExpTextNGramEmbedding"
    assert not issubclass(modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding, ngram_embedding_class())
    for lay, mod in zip(ngram_layout(cfg), ngram_modules(model), strict=True):
        table = mod.ngram_embedding.table
        assert isinstance(table, HostTable) and table.shape == (lay.rows, lay.cols)
        assert float(table.tensor.std()) == pytest.approx(cfg.initializer_range, rel=0.3)
        assert mod.layer_multipliers.tolist() == layer_multipliers(VOCAB, 3, lay.ple_index, cfg.seed)
    assert not any(p.shape[-1] == 8 and p.shape[0] >= 240 for p in model.parameters())
    assert "model.layers.0.ple.ple_embedding.ngram_embedding.weight" in model.state_dict()
    with torch.no_grad():
        assert model(prompts((1, 4))).logits.isfinite().all()


# ---------------------------------------------------------------------- loading from the checkpoint's shards
def shard_names(path: Path, layer: int) -> list[str]:
    keys = load_file(path / "model.safetensors").keys()
    pre = f"model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_"
    return sorted((k for k in keys if k.startswith(pre)), key=lambda k: int(k[len(pre):].split(".")[0]))


def test_load_from_uneven_shards_bit_identical_and_saves_back(ref, checkpoint, tmp_path):
    assert [len(shard_names(checkpoint, layer)) for layer in range(3)] == [3, 3, 3]
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16)
    want = Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    for lay, mod, hf in zip(ngram_layout(ref.config), ngram_modules(model), ngram_modules(want), strict=True):
        table = mod.ngram_embedding.table
        assert table.shape == (lay.rows, lay.cols) and table.dtype == torch.bfloat16
        assert torch.equal(bits(table.tensor), bits(hf.ngram_embedding.weight))
    assert all(p.numel() < 240 * 8 or p.shape[-1] != 8 for p in model.parameters())
    assert set(model.state_dict()) == set(want.state_dict())
    prompt = prompts((2, 5), seed=7)
    assert_same_steps(run_steps(model, prompt, 2), run_steps(want, prompt, 2))
    # the state dict carries the tables: transformers saves them as its shards again and loads them back
    model.save_pretrained(tmp_path)
    assert shard_names(tmp_path, 2) == shard_names(checkpoint, 2)
    back = Qwen4ExpForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for a, b in zip(ngram_modules(back), ngram_modules(want), strict=True):
        assert torch.equal(bits(a.ngram_embedding.weight), bits(b.ngram_embedding.weight))
    for mod in ngram_modules(model):
        mod.close()


# ---------------------------------------------------------------------- fp8
def test_fp8_rows_quantised_from_the_shards_equal_the_formula(ref, checkpoint, record_property):
    model = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16,
                                         backend_options={"quantize": "fp8_row", "keep_source": False})
    kept = load_qwen4_exp_with_host_ple(checkpoint, dtype=torch.bfloat16, backend_options={"quantize": "fp8_row"})
    for mod, same, hf in zip(ngram_modules(model), ngram_modules(kept), ngram_modules(ref), strict=True):
        emb = mod.ngram_embedding
        assert isinstance(emb, HostEncodedEmbedding) and emb.encoding == "fp8_row"
        assert "weight" not in emb.state_dict()  # a serving copy: no table of the source dtype exists
        src = hf.ngram_embedding.weight.detach()
        want = quantize_fp8_rows(src)
        stored = emb.table.tensor
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
        every = torch.arange(emb.num_embeddings)
        emb(every[:1])  # builds the lookup
        got = torch.full((emb.num_embeddings, emb.embedding_dim), float("nan"), dtype=torch.bfloat16)  # poisoned
        emb.lookups[0].lookup(every, got)
        codes, scale = stored[:, :-4], stored[:, -4:].contiguous().view(torch.uint8).view(torch.float32)
        assert torch.equal(bits(got), bits(codes.to(torch.bfloat16) * scale.to(torch.bfloat16)))
        rep = emb.quant_error
        diff = (got.double() - src.double()).abs().amax()
        assert rep.rows == emb.num_embeddings and float(rep.max_abs.max()) == float(diff)
        # the module's own quantiser (keep_source) makes the same bytes beside its bf16 table
        same.ngram_embedding(torch.zeros(1, dtype=torch.long))
        assert torch.equal(same.ngram_embedding.quantized_table.tensor.view(torch.uint8), stored.view(torch.uint8))
    prompt = prompts((2, 5), seed=8)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    fp8, bf16 = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    agree = float((fp8[:, 5:] == bf16[:, 5:]).float().mean())
    record_property("fp8_greedy_agreement", agree)
    print(f"\nfp8_row greedy tokens {fp8[:, 5:].tolist()} against bf16 {bf16[:, 5:].tolist()}: {agree:.0%} agree")
    assert fp8.shape == bf16.shape


def test_a_live_model_is_quantised_once_from_its_own_table_when_the_source_is_not_kept(ref):
    """``apply_uvaple_to_qwen4_exp(model, backend_options={"quantize": "fp8_row", "keep_source": False})``: each
    table is quantised straight from the live module's rows into an fp8_row host table (no host copy in bf16),
    the source is freed, the rows served are the formula's, and revert() gives back the rows as served."""
    model = copy.deepcopy(ref)
    sources = [m.ngram_embedding.weight.detach().clone() for m in ngram_modules(model)]
    patch = apply_uvaple_to_qwen4_exp(model, backend_options={"quantize": "fp8_row", "keep_source": False})
    try:
        for mod, src in zip(ngram_modules(model), sources, strict=True):
            emb = mod.ngram_embedding
            assert isinstance(emb, HostEncodedEmbedding) and emb.encoding == "fp8_row"
            assert not any(type(m) is HostScaledEmbedding for m in mod.modules())  # no bf16 host table
            stored = emb.table.tensor
            assert torch.equal(stored.view(torch.uint8), quantize_fp8_rows(src).view(torch.uint8))
            assert emb.quant_error.rows == src.shape[0] and emb.compute_dtype == torch.bfloat16
        # the tables are nowhere else: no parameter or buffer of the model holds n-gram rows
        assert not [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                    if "ngram_embedding" in n and t.numel() >= sources[0].shape[0]]
        prompt = prompts((2, 5), seed=8)
        kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        want = copy.deepcopy(ref)
        for mod, src in zip(ngram_modules(want), sources, strict=True):  # transformers' path over the served rows
            mod.ngram_embedding.weight.data = ENCODINGS["fp8_row"].dequantise(quantize_fp8_rows(src), torch.bfloat16)
        assert torch.equal(model.generate(prompt, **kw), want.generate(prompt, **kw))
    finally:
        patch.revert()
    for mod, src in zip(ngram_modules(model), sources, strict=True):
        assert type(mod).__name__ == "Qwen4ExpTextNGramEmbedding"
        back = mod.ngram_embedding.weight
        assert back.shape == src.shape and back.dtype == src.dtype
        assert torch.equal(bits(back), bits(ENCODINGS["fp8_row"].dequantise(quantize_fp8_rows(src), torch.bfloat16)))


@pytest.mark.parametrize("options,error,match", [
    ({"quantize": "fp8", "keep_source": False}, ValueError, "must be one of \\['fp8_row', 'fp8_row_e5m2'\\]"),
])
def test_a_bad_quantize_setting_on_a_live_model_is_named_and_leaves_it_whole(ref, options, error, match):
    model = copy.deepcopy(ref)
    before = [m.ngram_embedding.weight.detach().clone() for m in ngram_modules(model)]
    with pytest.raises(error, match=match):
        apply_uvaple_to_qwen4_exp(model, backend_options=options)
    for mod, src in zip(ngram_modules(model), before, strict=True):
        assert type(mod).__name__ == "Qwen4ExpTextNGramEmbedding" and torch.equal(bits(mod.ngram_embedding.weight),
                                                                                   bits(src))


def fp8_checkpoint(src: Path, dst: Path, quantization_config: bool) -> list[torch.Tensor]:
    """``src`` with its n-gram shards in transformers' FP8Embedding layout (fp8 codes, one weight_scale)."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    scales = []
    for layer in range(3):
        names = shard_names(dst, layer)
        scale = torch.cat([sd[k] for k in names]).float().abs().amax().reshape(1) / 448
        for k in names:
            sd[k] = (sd[k].float() / scale).to(torch.float8_e4m3fn)
        sd[names[0].split(".shard_")[0] + ".weight_scale"] = scale
        scales.append(scale)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    if quantization_config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "modules_to_convert": ["ngram_embedding"],
                                      "modules_to_not_convert": ["lm_head"], "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
        (dst / "config.json").write_text(json.dumps(cfg))
    return scales


def test_fp8_checkpoint_is_served_as_stored(ref, checkpoint, tmp_path):
    scales = fp8_checkpoint(checkpoint, tmp_path / "fp8", quantization_config=False)
    model = load_qwen4_exp_with_host_ple(tmp_path / "fp8", dtype=torch.bfloat16)
    # transformers' FP8Embedding returns codes.to(bf16) * weight_scale (loaded in bf16): its bf16 model with
    # those rows for tables is the reference
    want = Qwen4ExpForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    sd = load_file(tmp_path / "fp8" / "model.safetensors")
    for layer, (mod, hf) in enumerate(zip(ngram_modules(model), ngram_modules(want), strict=True)):
        emb = mod.ngram_embedding
        assert isinstance(emb, HostEncodedEmbedding) and emb.encoding == "fp8_global"
        codes = torch.cat([sd[k] for k in shard_names(tmp_path / "fp8", layer)])
        assert torch.equal(emb.table.tensor.view(torch.uint8), codes.view(torch.uint8))
        rows = codes.to(torch.bfloat16) * scales[layer].to(torch.bfloat16)
        assert torch.equal(bits(emb(torch.arange(emb.num_embeddings))), bits(rows))
        with torch.no_grad():
            hf.ngram_embedding.weight.copy_(rows)
        assert set(emb.state_dict()) == {"weight", "weight_scale"} and emb.state_dict()["weight"].dtype == codes.dtype
    prompt = prompts((2, 5), seed=9)
    assert_same_steps(run_steps(model, prompt, 1), run_steps(want, prompt, 1))
    with pytest.raises(ValueError, match="stored as torch.float8_e4m3fn already"):
        load_qwen4_exp_with_host_ple(tmp_path / "fp8", backend_options={"quantize": "fp8_row"})


def test_fp8_checkpoint_with_transformers_quantization_config(ref, checkpoint, tmp_path):
    pytest.importorskip("accelerate", reason="transformers loads an FP8 checkpoint only with accelerate")
    fp8_checkpoint(checkpoint, tmp_path / "fp8q", quantization_config=True)
    want = Qwen4ExpForCausalLM.from_pretrained(tmp_path / "fp8q", dtype=torch.bfloat16)
    assert type(ngram_modules(want)[0].ngram_embedding).__name__ == "FP8Embedding"
    model = load_qwen4_exp_with_host_ple(tmp_path / "fp8q", dtype=torch.bfloat16)
    prompt = prompts((2, 5), seed=10)
    with torch.no_grad():
        try:
            reference = want(prompt).logits
        except ImportError as e:  # with CUDA, transformers' FP8 linears need the `kernels` package
            pytest.skip(f"transformers' own FP8 model does not run here: {e}")
        assert torch.equal(bits(model(prompt).logits), bits(reference))


# ---------------------------------------------------------------------- the quantiser's kernel
def hard_rows(dtype: torch.dtype, fmt: torch.dtype) -> torch.Tensor:
    """Zeros, -0.0, subnormals, the extremes, all-zero rows, every fp8 code and every rounding boundary."""
    g = torch.Generator().manual_seed(12)
    rows = (torch.randn(80, 300, generator=g) * torch.logspace(-6, 6, 80)[:, None]).to(torch.float32)
    finfo = torch.finfo(dtype)
    rows[3] = 0.0
    rows[4] = finfo.smallest_normal / 4  # subnormal in the source dtype
    rows[5, ::2] = -finfo.smallest_normal / 8
    rows[6, 0], rows[6, 1] = finfo.max, -finfo.max
    rows[7] = -0.0
    rows[8, :10] = 0.0
    rows[9] = 1e-44 if dtype == torch.float32 else finfo.smallest_normal * 2.0 ** -7  # the scale's floor
    values = torch.arange(256, dtype=torch.uint8).view(fmt).to(torch.float32)
    values = values[values.isfinite()]
    fmax = FP8_MAX[fmt]
    codes = torch.cat([values, torch.tensor([fmax])])  # amax = fmax: scale 1, every code exactly
    rows[10, :codes.numel()] = codes[:300] if codes.numel() > 300 else codes
    mids = (values.sort().values[1:] + values.sort().values[:-1]) / 2  # ties between neighbouring codes
    ulp = mids.abs() * 2.0 ** -23 + 2.0 ** -149
    edges = torch.cat([mids, mids + ulp, mids - ulp]).clamp(-fmax, fmax)
    for i in range(0, edges.numel(), 299):
        r = 11 + i // 299
        rows[r, 0] = fmax
        rows[r, 1:1 + edges[i:i + 299].numel()] = edges[i:i + 299]
    if dtype == torch.float16:
        rows = rows.clamp(-60000, 60000)
    return rows.to(dtype)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [None, 1.7])
def test_quantiser_kernel_is_the_torch_quantiser_bit_for_bit(fmt, dtype, scale):
    src = hard_rows(dtype, fmt)
    x = src if scale is None else src * torch.tensor(scale).to(dtype)
    if not x.float().isfinite().all():
        x[~x.float().isfinite().all(dim=1)] = 1.0
        src = x if scale is None else src.masked_fill(~(src * torch.tensor(scale).to(dtype)).float().isfinite(), 0)
        x = src if scale is None else src * torch.tensor(scale).to(dtype)
    want = quantize_fp8_rows(x, fmt).view(torch.uint8)
    out_dtype = torch.float32 if dtype == torch.float16 else dtype
    out = np.full((src.shape[0], src.shape[1] + 4 + 12), 0xA5, dtype=np.uint8)  # poisoned, padded stride
    parts = [src[:37], src[37:]]  # two parts: blocks of both go to the same pool
    err = quantize_fp8_rows_into(parts, out, fmt, out_dtype=out_dtype, scale=scale, threads=2)
    assert torch.equal(torch.from_numpy(out[:, :src.shape[1] + 4].copy()), want)
    assert (out[:, src.shape[1] + 4:] == 0xA5).all()
    deq = ENCODINGS["fp8_row"].dequantise(want.view(fmt), out_dtype).double()
    diff = (deq - x.double()).abs()
    assert float(err.max_abs[0]) == float(diff[:, :256].amax()) and float(err.max_abs[1]) == float(diff[:, 256:].amax())
    mag = x.double().abs()
    d, m = diff[:, :256].amax(dim=1), mag[:, :256].amax(dim=1)
    assert float(err.max_rel[0]) == float(torch.where(m > 0, d / m, d).amax())


def test_quantiser_names_a_row_with_inf_or_nan_and_releases_its_table():
    src = torch.randn(50, 16).to(torch.bfloat16)
    src[41, 3] = float("inf")
    with pytest.raises(ValueError, match="row 41 holds inf or NaN"):
        fp8_row_table(src, register=False)
    src[41, 3], src[17, 0] = 1.0, float("nan")
    with pytest.raises(ValueError, match="row 17 holds inf or NaN"):
        quantize_fp8_rows_into(src, np.zeros((50, 20), np.uint8))


# ---------------------------------------------------------------------- bad checkpoints
@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fail the test if a host table is allocated or transformers starts building the model."""
    def refuse(*a, **k):
        raise AssertionError("allocated before the checkpoint was checked")

    monkeypatch.setattr(HostTable, "_filled", classmethod(lambda cls, *a, **k: refuse()))
    monkeypatch.setattr(Qwen4ExpForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))


def rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


PRE = "model.layers.{}.ple.ple_embedding.ngram_embedding.shard_{}.weight"


@pytest.mark.parametrize("edit, error, match", [
    (lambda sd: sd.pop(PRE.format(1, 1)), ShardMissingError, r"lacks shard\(s\) \[1\] of shard_0..shard_2"),
    (lambda sd: sd.pop(PRE.format(2, 2)), ShardMissingError, "hold 262 of its 392 rows"),
    (lambda sd: [sd.pop(PRE.format(0, k)) for k in range(3)], ShardMissingError, "no n-gram table for PLE layer 0"),
    (lambda sd: sd.update({PRE.format(1, 0): torch.zeros(104, 9, dtype=torch.bfloat16)}), ShardShapeError,
     r"is \[104, 9\]"),
    (lambda sd: sd.update({PRE.format(1, 2): sd[PRE.format(1, 2)].float()}), ShardShapeError, "torch.float32"),
    (lambda sd: sd.update({PRE.format(2, 3): torch.ones(8, 8, dtype=torch.bfloat16)}), ShardShapeError,
     "hold 400 rows"),
])
def test_bad_shards_are_named_before_anything_is_allocated(checkpoint, tmp_path, nothing_allocated, edit, error,
                                                           match):
    path = rewrite(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(error, match=match):
        load_qwen4_exp_with_host_ple(path)


def test_tables_larger_than_free_memory_are_named_first(checkpoint, monkeypatch, nothing_allocated):
    monkeypatch.setattr(ngram_tables, "mem_available_bytes", lambda: 16 << 10)
    with pytest.raises(HostMemoryError, match=r"need 20.00 KiB of host memory; 16.00 KiB is available"):
        load_qwen4_exp_with_host_ple(checkpoint)


def test_a_config_without_ple_layers_is_named(checkpoint, tmp_path, monkeypatch):
    path = tmp_path / "no_ple"
    shutil.copytree(checkpoint, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["ple_layer_ids"] = []
    (path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(Qwen4ExpForCausalLM, "from_pretrained", classmethod(lambda *a, **k: 1 / 0))
    with pytest.raises(NoPleLayersError, match="no ple_layer_ids"):
        load_qwen4_exp_with_host_ple(path)
    torch.manual_seed(0)
    plain = Qwen4ExpForCausalLM(tiny_config(ple_layer_ids=[]))
    with pytest.raises(NoPleLayersError, match="no ple_layer_ids"):
        apply_uvaple_to_qwen4_exp(plain)


def test_a_failed_fill_releases_the_tables_filled_before(checkpoint, monkeypatch):
    made = []
    real = HostTable.from_safetensors.__func__

    def second_fails(cls, *a, **k):
        if made:
            raise OSError("disk went away")
        made.append(real(cls, *a, **k))
        return made[-1]

    monkeypatch.setattr(HostTable, "from_safetensors", classmethod(second_fails))
    with pytest.raises(OSError, match="disk went away"):
        load_qwen4_exp_with_host_ple(checkpoint)
    assert len(made) == 1 and made[0].closed


# ---------------------------------------------------------------------- the GPU
@pytest.mark.gpu
def test_gpu_decode_step_has_no_host_synchronisation_and_is_captured(ref):
    model = copy.deepcopy(ref).cuda()
    want = copy.deepcopy(ref).cuda()
    for mod in ngram_modules(want):  # transformers' own path: the table on the CPU
        mod.ngram_embedding.to("cpu")
    apply_uvaple_to_qwen4_exp(model, max_tokens=64)
    assert all(m.ngram_embedding.table.registered for m in ngram_modules(model))
    mod, hf = ngram_modules(model)[0], copy.deepcopy(ngram_modules(ref)[0]).cuda()
    caches = [transformers.StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    step = torch.randint(2, VOCAB, (2, 6), device="cuda")
    for _ in range(2):  # prefill, a first decode step (compiles the kernel's variant)
        assert torch.equal(bits(mod(step, caches[0])), bits(hf(step, caches[1])))
        step = torch.randint(2, VOCAB, (2, 1), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = mod(step, caches[0])  # a decode step: ids hashed on the device, rows gathered in the stream
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(bits(got), bits(hf(step, caches[1])))
    prompt = prompts((2, 6), seed=11).cuda()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    reference = want.generate(prompt, disable_compile=True, **kw)  # transformers' own path cannot be captured
    assert torch.equal(model.generate(prompt, disable_compile=True, **kw), reference)
    # The PLE layer's decode step, our module inside, compiled whole and replayed from CUDA graphs. (The whole
    # model's step cannot be: transformers' QSA indexer calls torch.nonzero per query, 5.17 to 5.24.) Bit for
    # bit: the n-gram rows through inductor (the hash is integer arithmetic, the gather a copy), and the layer
    # through the `cudagraphs` backend (the eager kernels, captured). The layer through inductor only to
    # rounding: it fuses the layer's elementwise ops and keeps fp32 between them where eager rounds each to
    # bf16 (one or two bf16 ulps in a few values).
    # The prefill runs eagerly, as generate runs it: a linear-attention cache layer allocates its conv states on
    # its first update (transformers' LinearAttentionLayer.lazy_initialization, 5.17 to 5.24) and marks them
    # static only outside dynamo; allocated inside a compiled prefill they would live in the CUDA-graph pool and
    # a later replay would overwrite them (transformers' own states 0 and 1 as much as the n-gram context, 2).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ours, theirs = model.model.layers[1].ple, want.model.layers[1].ple
    rows_ours, rows_hf = ngram_modules(model)[1], copy.deepcopy(ngram_modules(ref)[1]).cuda()
    eager = {"theirs": theirs, "exact": ours, "fused": ours, "rows_hf": rows_hf, "rows": rows_ours}
    compiled = {"theirs": theirs, "rows_hf": rows_hf,
                "exact": torch.compile(ours, fullgraph=True, backend="cudagraphs"),
                "fused": torch.compile(ours, fullgraph=True, mode="reduce-overhead"),
                "rows": torch.compile(rows_ours, fullgraph=True, mode="reduce-overhead")}
    caches = {name: transformers.StaticCache(config=model.config, max_cache_len=32) for name in eager}
    layer = {name: (rows_ours if name.startswith("rows") else ours.ple_embedding).layer_idx for name in eager}
    width = model.config.hc_count * model.config.hidden_size
    step = prompts((2, 6), seed=12).cuda()
    states = None
    with torch.no_grad():
        for i in range(7):  # an eager prefill, then decode steps: the first compile, the next capture, the rest replay
            hidden = torch.randn(2, step.shape[1], width, device="cuda", dtype=torch.bfloat16)
            args = {name: (step,) if name.startswith("rows") else (hidden, step) for name in eager}
            calls = eager if i == 0 else compiled
            got = {name: call(*args[name], caches[name]).clone() for name, call in calls.items()}
            assert torch.equal(bits(got["rows"]), bits(got["rows_hf"]))
            assert torch.equal(bits(got["exact"]), bits(got["theirs"]))
            torch.testing.assert_close(got["fused"], got["theirs"], rtol=1.6e-2, atol=2**-10)
            now = {(name, s): caches[name].layers[layer[name]].conv_states[s] for name in eager
                   for s in ((2,) if name.startswith("rows") else (1, 2))}  # 1: the PLE's short conv, 2: n-grams
            assert all(torch.equal(t, now["theirs", 2]) for (_, s), t in now.items() if s == 2)  # the same context
            if states is None:  # allocated by the eager prefill: fixed addresses the graphs update in place
                states = {key: t.data_ptr() for key, t in now.items()}
            assert {key: t.data_ptr() for key, t in now.items()} == states
            step = torch.randint(2, VOCAB, (2, 1), device="cuda") if i != 3 else torch.full((2, 1), EOS, device="cuda")
    assert not any("cudagraph_skip" in k for k in counters["inductor"]) and not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 3  # one decode graph each, never recompiled
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_generate_compiled_by_transformers_with_a_static_cache_gives_the_eager_tokens(ref):
    """The user's path: generate with a static cache on CUDA compiles the decode forward (transformers' default
    CompileConfig: inductor, mode="reduce-overhead", fullgraph=False, the QSA indexer's torch.nonzero breaking
    the graph) after an eager prefill, the n-gram modules inside the compiled steps. Its tokens are eager
    generate's and transformers' own (table on the CPU, eager); its logits eager's to inductor's rounding. Read
    n-gram context overwritten by a replay would give other rows, and other logits. In fp32: in bf16 inductor
    moves the logits by 1e-3 where two lead by 1.5e-3 (H200, torch 2.11), a tie another version could flip."""
    from torch._dynamo.utils import counters

    model = copy.deepcopy(ref).float().cuda()
    theirs = copy.deepcopy(ref).float().cuda()
    for mod in ngram_modules(theirs):
        mod.ngram_embedding.to("cpu")
    patch = apply_uvaple_to_qwen4_exp(model, max_tokens=64)
    prompt = prompts((2, 6), seed=11).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    reference = theirs.generate(prompt, disable_compile=True, **kw)
    eager = model.generate(prompt, disable_compile=True, **kw)
    assert torch.equal(eager.sequences, reference.sequences)
    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(fullgraph=False, mode="reduce-overhead")
    for run in range(2):  # compile and capture, then again (the cache reused or rebuilt, the graphs replayed)
        got = model.generate(prompt, compile_config=config, **kw)
        assert hasattr(model, "_compiled_call")  # transformers took the compiled path for the decode steps
        assert torch.equal(got.sequences, eager.sequences), f"run {run}"
        for lg, le in zip(got.logits, eager.logits, strict=True):
            torch.testing.assert_close(lg, le, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] > 0
    patch.revert()
    torch._dynamo.reset()

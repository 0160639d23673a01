"""Does Qwen4Exp with host n-gram tables match transformers, run its decode step in CUDA graphs, and decode faster?

Qwen4Exp end to end on the GPU: a model of transformers' default ``Qwen4ExpTextConfig`` dimensions (hidden
2,048, 40 layers, vocabulary 248,320) with fewer experts (``--experts``; random weights, transformers' own
init) and a real-size n-gram table (``--ple-layers`` PLE layers of 16 heads x ``--ngram-base`` rows,
``--ple-dim`` / 16 values a row: 320 M rows of 160 values by default, 95.4 GiB bf16, 52.5 GiB ``fp8_row``).
Phases (``--phases``), all in one process, every figure from this run:

``main`` (one table precision a run, ``--table``: a captured graph keeps its host table until exit, so
bf16 and fp8 at real size do not fit one 128 GiB host together; run it twice for both):

1. Build (``--build``). ``gpu``: on the GPU, the tables in HBM for the moment; the reference tokens are
   transformers' greedy ``generate()`` with its tables in HBM. ``host``: where the tables do not fit the
   GPU beside the model (95.4 GiB on an 80 GB H100), the model is built on the GPU with transformers' own
   init but each n-gram table made on the meta device, then filled in a pinned host table from the GPU's
   random generator (normal, ``initializer_range``: transformers' init, another stream of draws); the
   reference tokens are transformers' own path on those bytes (below). ``auto`` (the default): ``gpu``
   where the tables and the rest of the model fit the GPU's free memory with 8 GiB to spare, else ``host``.
   A host build serves bf16 only (``fp8`` is quantised from the HBM table).
2. ``bf16``: the live model swapped (:func:`apply_uvaple_to_qwen4_exp`: each table copied to host memory,
   HBM freed; seconds and memory before/after; in a host build each layer is served from the host table it
   was filled in, nothing copied). transformers' own path is its original module whose
   ``weight`` aliases our host table (the same bytes; its forward copies the ids to the CPU, gathers there,
   copies back): greedy tokens and the prefill logits against uvaple eager (bit for bit), and uvaple
   captured (static cache + ``torch.compile(mode="reduce-overhead")``: CUDA graphs; skips and graph breaks
   counted). Not ``fullgraph``: transformers' QSA indexer calls ``torch.nonzero`` per query in every
   indexed-attention layer (5.17 - 5.24), a graph break and a host sync of its own; the PLE layers have none.
   ``fp8``: each table quantised from HBM straight into an ``fp8_row`` host table
   on every core (GB/s and the error report), rows against the formula on sampled ids, greedy tokens
   against the reference (agreement reported), eager and captured.
3. Decode tokens/s at ``--batches`` (two ``generate`` lengths from the same prompts, their difference:
   prefill excluded) for transformers' path (bf16, eager), uvaple eager and captured; one PLE layer's decode
   step (µs, static cache): transformers' path, uvaple eager, uvaple compiled ``fullgraph`` and replayed from
   CUDA graphs; prefill ms of ``--prefill`` tokens at batch 1 (``logits_to_keep=1``).

``ceiling``: a table of ``--ceiling-base`` rows a head (9.5 GiB bf16 by default) in HBM (the ``device``
placement: the ceiling) and the same table through ``uva``, decode tokens/s eager and captured.

``disk`` (named in ``--phases``): a table of ``--disk-base`` rows a head served by ``uva`` and then from table
files (the ``disk`` placement: the live tables written to ``--scratch``, row caches of ``--disk-fractions``
of the table), eager: greedy tokens against ``uva``'s, decode tokens/s and one PLE layer's decode step at each
batch, the caches' hit rates (random ids: the caches miss about as much as they can).

``startup``: a checkpoint of one ``--startup-gib`` table in ``split_ngram_parts`` = 512 shards written to
``--scratch`` (page cache warm): shard check, load into a host table (fill, page commit, registration),
quantise a host bf16 table to ``fp8_row``, quantise from the shards; each in GB/s of source bytes, with
the real table's time at that rate.

Fast paths: transformers takes flash-linear-attention's Triton kernels for the gated delta rule when ``fla``
imports (``env.fla`` in the JSON says whether it did); without it, and without ``causal_conv1d`` (a CUDA
extension, not carried), it runs its PyTorch reference. ``fla`` is pure Python and travels in one call: here
``pip download --no-deps --python-version 3.12 --only-binary=:all: -d .fla-carry flash-linear-attention==0.6.0
fla-core==0.6.0 einops`` (1.5 MB), carried as ``.fla-carry``; there ``pip install --no-deps --target
/tmp/fla_site .fla-carry/*.whl`` and ``PYTHONPATH=/tmp/fla_site`` for the study.

Failures are caught, logged and reported in the JSON; none ends the run. Usage (H200, 1 GPU, 128 GiB)::

    python3 perf/studies/qwen4_exp_e2e.py --table fp8 --json perf/results/qwen4_exp_e2e_fp8.json
    python3 perf/studies/qwen4_exp_e2e.py --table bf16 --phases main --json perf/results/qwen4_exp_e2e_bf16.json

On an 80 GB H100 the real-size tables do not fit the GPU: ``--build auto`` builds them in host memory (bf16).
Longer than one device call, so ``bash perf/gpu_check.sh qwen4e2e`` starts it in the background and waits;
the same step in a later call of the lease waits on (``QWEN4_E2E_ARGS``, ``QWEN4_E2E_WAIT_S``)::

    QWEN4_E2E_ARGS="--table bf16 --phases main,ceiling --batches 1,8,64 --prefill 8192 --repeats 5" \
        bash perf/gpu_check.sh qwen4e2e

Without CUDA it refuses (exit 2); ``--smoke-cpu`` runs a toy config on the CPU (Triton interpreter) to check
the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode

from uvaple.perf.timing import cuda_missing

GiB = float(1 << 30)
BATCHES = "1,8,64"  # decode batches timed (a smoke run: 1 and 2, unless given)
# transformers' Qwen4ExpTextConfig defaults are kept (hidden 2048, 40 layers, vocab 248,320, linear attention
# with an indexed-attention layer every 4th); what differs is named. The QSA indexer has no default (its
# fields are None and transformers' default config does not build): a plausible one is set (its head as wide
# as the attention's rotary dimension, which the config requires).
REAL = dict(num_experts=16, num_experts_per_tok=10, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=256,
            indexer_budget=2048, indexer_compress_ratio=4, eos_token_id=248044, pad_token_id=248044)
TINY = dict(vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1,
            indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4, eos_token_id=1, pad_token_id=0,
            max_position_embeddings=4096)


def make_config(args, base: int):
    from transformers import Qwen4ExpTextConfig

    kw = dict(TINY if args.smoke_cpu else REAL)
    kw.update(ple_layer_ids=list(range(1, 4 * args.ple_layers, 4))[:args.ple_layers], ple_embed_dim=args.ple_dim,
              ngram_vocab_size_base=base, num_experts=kw["num_experts"] if args.smoke_cpu else args.experts)
    kw["num_experts_per_tok"] = min(kw["num_experts_per_tok"], kw["num_experts"])
    return Qwen4ExpTextConfig(**kw)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device) -> dict:
    gc.collect()
    out = {"host_available_gib": _mem_available() / GiB}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        out["gpu_allocated_gib"] = torch.cuda.memory_allocated(device) / GiB
    return out


def _mem_available() -> int:
    from uvaple.uva.system import mem_available_bytes

    return mem_available_bytes() or 0


def ngram_children(model) -> list:
    return [layer.ple for layer in model.model.layers if layer.ple is not None]


@contextlib.contextmanager
def hf_path(model, originals):
    """transformers' own modules in place (their weights alias the host tables), then ours back."""
    ours = [ple.ple_embedding for ple in ngram_children(model)]
    for ple, orig in zip(ngram_children(model), originals, strict=True):
        ple.ple_embedding = orig
    try:
        yield
    finally:
        for ple, mod in zip(ngram_children(model), ours, strict=True):
            ple.ple_embedding = mod


def alias_tables(originals, model) -> None:
    """Point each original module's table at the host table of its swapped-in replacement (same bytes)."""
    for orig, ple in zip(originals, ngram_children(model), strict=True):
        orig.ngram_embedding.weight.data = ple.ple_embedding.ngram_embedding.table.tensor


def prompts(batch, length, vocab, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab - 1, (batch, length), generator=g).to(device)


@torch.no_grad()
def greedy(model, ids, new, **kw):
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=model.config.pad_token_id, **kw)


def compiled_kw(device) -> dict:
    """generate() with a static cache, compiled with CUDA graphs. Not ``fullgraph``: transformers' QSA indexer
    (every indexed-attention layer) calls ``torch.nonzero`` per query, a graph break and a host sync in any
    Qwen4Exp decode step (5.17 - 5.24); the graphs hold what lies between (the PLE layers whole)."""
    if device.type != "cuda":
        return {}
    from transformers import CompileConfig

    return {"cache_implementation": "static", "compile_config": CompileConfig(fullgraph=False, mode="reduce-overhead")}


@torch.no_grad()
def ple_step_us(ple, batch, model, device, *, compiled: bool) -> float:
    """Median µs of one PLE layer's decode step (batch ``batch``, a static cache, after a 16-token prefill);
    ``compiled``: the layer compiled whole (``fullgraph``) and replayed from CUDA graphs."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=64)
    width = model.config.hc_count * model.config.hidden_size
    vocab = model.config.vocab_size
    ple(torch.randn(batch, 16, width, device=device, dtype=torch.bfloat16),
        prompts(batch, 16, vocab, device, 6), cache)
    call = torch.compile(ple, fullgraph=True, mode="reduce-overhead") if compiled else ple
    steps = [(torch.randn(batch, 1, width, device=device, dtype=torch.bfloat16), prompts(batch, 1, vocab, device, i))
             for i in range(30)]
    times = []
    for i, (h, ids) in enumerate(steps):
        sync(device)
        t = time.perf_counter()
        call(h, ids, cache)
        sync(device)
        if i >= 10:
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def inductor_counters() -> dict:
    try:
        from torch._dynamo.utils import counters

        return {"cudagraph_skips": int(sum(v for k, v in counters["inductor"].items() if "cudagraph_skip" in k)),
                "graph_breaks": int(sum(counters["graph_break"].values()))}
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}


def decode_rate(model, batch, args, device, **kw) -> float | None:
    """Decode tokens/s: two generate lengths from the same prompts, the difference over the time's."""
    ids = prompts(batch, args.prompt_len, model.config.vocab_size, device, 3)
    greedy(model, ids, args.short, **kw)  # warm: compiles, captures
    times = {}
    for n in (args.short, args.long):
        runs = []
        for _ in range(args.repeats):
            sync(device)
            t = time.perf_counter()
            greedy(model, ids, n, **kw)
            sync(device)
            runs.append(time.perf_counter() - t)
        times[n] = statistics.median(runs)
    dt = times[args.long] - times[args.short]
    return batch * (args.long - args.short) / dt if dt > 0 else None  # None: lost in the noise


@torch.no_grad()
def prefill_ms(model, tokens, device) -> tuple[float, torch.Tensor]:
    ids = prompts(1, tokens, model.config.vocab_size, device, 5)
    out = model(ids, logits_to_keep=1).logits
    runs = []
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        out = model(ids, logits_to_keep=1).logits
        sync(device)
        runs.append((time.perf_counter() - t) * 1e3)
    return statistics.median(runs), out


class Run:
    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.res = {"errors": []}

    def save(self) -> None:
        """The results so far, written whole (a run stopped by a time limit keeps every finished stage)."""
        text = json.dumps(self.res, indent=1, default=str)
        if self.args.json == "-":
            return
        tmp = f"{self.args.json}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.args.json)

    def step(self, name):
        """A stage: its failure is recorded, never fatal; the results are saved after it."""
        run = self

        class _Step(contextlib.AbstractContextManager):
            def __exit__(self, kind, e, tb):
                if e is not None:
                    print(f"[{name}] failed: {kind.__name__}: {e}", file=sys.stderr)
                    run.res["errors"].append({"where": name, "error": f"{kind.__name__}: {e}",
                                              "trace": traceback.format_exc(limit=8)})
                run.res["elapsed_s"] = time.monotonic() - run.t0
                run.save()
                return e is not None and not isinstance(e, KeyboardInterrupt)

        print(f"[{name}] {time.monotonic() - self.t0:.0f} s", file=sys.stderr)
        return _Step()


def build(args, device, base):
    from transformers import Qwen4ExpForCausalLM

    cfg = make_config(args, base)
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):  # transformers' init on the GPU (the tables in HBM until swapped)
            model = Qwen4ExpForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model


class _TablesOnMeta(TorchFunctionMode):
    """Inside: a ``torch.empty`` of one of ``shapes`` (the n-gram tables') is made on the meta device; every
    other tensor where it was asked for. transformers' ``nn.Embedding`` allocates its table with
    ``torch.empty`` and then initialises it in place, which on the meta device does nothing."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = {tuple(s) for s in shapes}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty:
            size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if tuple(int(n) for n in size) in self.shapes:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


def planned_bytes(args, base) -> tuple[int, int, list]:
    """The model's n-gram tables' bytes, every other parameter's and buffer's (bf16), and the tables' shapes,
    from a build on the meta device (nothing allocated)."""
    from transformers import Qwen4ExpForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen4ExpForCausalLM(make_config(args, base))
    finally:
        torch.set_default_dtype(old)
    weights = [p.ple_embedding.ngram_embedding.weight for p in ngram_children(model)]
    tables = {id(w) for w in weights}
    sizes = {id(t): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    table = sum(n for k, n in sizes.items() if k in tables)
    return table, sum(sizes.values()) - table, [w.shape for w in weights]


def build_host_tables(args, device, base, shapes):
    """The model on ``device`` with transformers' init, but each n-gram table on the meta device, and a pinned
    host table a PLE layer, filled block by block from ``device``'s generator, normal(0, initializer_range)
    (transformers' init for an embedding; another stream of draws); ``shapes``: the tables' (``planned_bytes``).
    Returns the model and the host tables."""
    from transformers import Qwen4ExpForCausalLM

    from uvaple.uva import HostTable

    cfg = make_config(args, base)
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), _TablesOnMeta(shapes):
            model = Qwen4ExpForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    std = float(getattr(cfg, "initializer_range", 0.02))
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    tables = []
    try:
        for ple in ngram_children(model):
            emb = ple.ple_embedding.ngram_embedding
            if emb.weight.device.type != "meta":
                raise RuntimeError(f"layer {ple.ple_embedding.layer_idx}'s n-gram table was allocated on "
                                   f"{emb.weight.device}, not left on the meta device: its shape was not foreseen")
            table = HostTable.empty(emb.num_embeddings, emb.embedding_dim, torch.bfloat16)
            tables.append(table)
            block = 97 if args.smoke_cpu else max(1, (256 << 20) // (emb.embedding_dim * 4))  # a smoke: many blocks
            for a in range(0, emb.num_embeddings, block):
                rows = table.tensor[a:a + block]
                draw = torch.empty(rows.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
                rows.copy_(draw.to(torch.bfloat16))  # cast where drawn: bf16 crosses the link, into the pinned rows
    except BaseException:
        for table in tables:
            table.close()
        raise
    sync(device)
    return model, tables


def serve_host_tables(model, tables, max_tokens) -> list:
    """Each PLE layer's module (its table still on the meta device) replaced by uvaple's, served from the host
    table built for it (attached, not copied); the originals' tables then alias the same bytes, so that
    :func:`hf_path` runs transformers' own path on them. Returns the originals."""
    from uvaple.integration.models.qwen4_exp import ngram_embedding_class

    cls = ngram_embedding_class()
    originals = []
    for ple, table in zip(ngram_children(model), tables, strict=True):
        orig = ple.ple_embedding
        new = cls.from_module(orig, max_tokens=max_tokens)  # a meta table: an empty drop-in, nothing copied
        new.ngram_embedding.attach_table(table, own=True)
        orig.ngram_embedding.weight = torch.nn.Parameter(table.tensor, requires_grad=False)
        ple.ple_embedding = new
        originals.append(orig)
    return originals


def table_bytes(model) -> int:
    return sum(p.ple_embedding.ngram_embedding.weight.numel() * 2 for p in ngram_children(model))


def phase_fp8(run, model, device, ids, ref_tokens):
    """Quantise each table from HBM straight into an fp8_row host table, serve it, check it, time it."""
    from uvaple.integration.encoded_embedding import HostEncodedEmbedding
    from uvaple.integration.models.qwen4_exp import ngram_embedding_class
    from uvaple.integration.quantize import fp8_row_table

    res, args = run.res.setdefault("fp8", {}), run.args
    t = time.perf_counter()
    source = 0
    for ple in ngram_children(model):
        hf = ple.ple_embedding
        w = hf.ngram_embedding.weight.detach()
        table, err = fp8_row_table(w)  # GPU blocks to the CPU, quantised on every core
        source += w.numel() * w.element_size()
        emb = HostEncodedEmbedding(w.shape[0], w.shape[1], table, encoding="fp8_row", out_dtype=torch.bfloat16,
                                   quant_error=err, max_tokens=run.max_tokens * hf.ngram_heads)
        ple.ple_embedding = new = ngram_embedding_class().from_module(hf, ngram_embedding=emb)  # lookup built
        new.free_source(hf)  # HBM freed
    sync(device)
    dt = time.perf_counter() - t
    res["quantise_from_hbm"] = {"seconds": dt, "source_gib": source / GiB, "gb_s": source / dt / 1e9,
                                "error": [p.ple_embedding.ngram_embedding.quant_error.summary()
                                          for p in ngram_children(model)], "memory": memory(device)}
    with run.step("fp8 rows against the formula"):
        emb = ngram_children(model)[0].ple_embedding.ngram_embedding
        sample = torch.randint(0, emb.num_embeddings, (min(4096, emb.max_tokens or 4096),), device=device)
        stored = emb.table.tensor[sample.cpu()]
        codes, scale = stored[:, :-4], stored[:, -4:].contiguous().view(torch.uint8).view(torch.float32)
        want = codes.to(torch.bfloat16) * scale.to(torch.bfloat16)
        got = emb(sample).cpu()
        res["rows_equal_formula"] = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
    with run.step("fp8 greedy tokens"):
        got = greedy(model, ids, args.new_tokens)
        n = ids.shape[1]
        res["tokens"] = got[:, n:].tolist()
        res["greedy_agreement_with_bf16"] = float((got[:, n:] == ref_tokens[:, n:]).float().mean())
        if device.type == "cuda":
            cap = greedy(model, ids, args.new_tokens, **compiled_kw(device))
            res["captured_tokens_equal_eager"] = bool(torch.equal(cap, got))
            res["captured_counters"] = inductor_counters()
    decode_and_ple_steps(run, model, device, res, "fp8")
    for n in args.prefill:
        with run.step(f"fp8 prefill {n}"):
            res.setdefault("prefill_ms", {})[n] = prefill_ms(model, n, device)[0]


def decode_and_ple_steps(run, model, device, res, tag, originals=None):
    """Decode tokens/s and one PLE layer's decode step at each batch: uvaple eager and captured, and with
    ``originals`` transformers' own path (eager) too."""
    args, cuda = run.args, device.type == "cuda"
    for b in args.batches:
        with run.step(f"{tag} decode b={b}"):
            d = res.setdefault("decode_tok_s", {})
            if originals is not None:
                with hf_path(model, originals):
                    d.setdefault("transformers_eager", {})[b] = decode_rate(model, b, args, device)
            d.setdefault("uvaple_eager", {})[b] = decode_rate(model, b, args, device)
            if cuda:
                d.setdefault("uvaple_captured", {})[b] = decode_rate(model, b, args, device, **compiled_kw(device))
    for b in args.batches:
        with run.step(f"{tag} PLE layer step b={b}"):
            p = res.setdefault("ple_layer_step_us", {})
            layer = ngram_children(model)[0]  # its ple_embedding: transformers' inside hf_path, ours outside
            if originals is not None:
                with hf_path(model, originals):
                    p.setdefault("transformers_eager", {})[b] = ple_step_us(layer, b, model, device, compiled=False)
            p.setdefault("uvaple_eager", {})[b] = ple_step_us(layer, b, model, device, compiled=False)
            if cuda:
                p.setdefault("uvaple_captured", {})[b] = ple_step_us(layer, b, model, device, compiled=True)


def phase_bf16(run, model, device, ids, ref_tokens, originals=None):
    """Swap the live model's tables into host memory (``originals`` given: a host build, already served from
    its host tables); transformers' CPU-table path against uvaple's."""
    from uvaple.integration.models.qwen4_exp import apply_uvaple_to_qwen4_exp

    res, args = run.res.setdefault("bf16", {}), run.args
    if originals is None:
        originals = [ple.ple_embedding for ple in ngram_children(model)]
        before = memory(device)
        t = time.perf_counter()
        apply_uvaple_to_qwen4_exp(model, max_tokens=run.max_tokens)
        sync(device)
        res["swap"] = {"seconds": time.perf_counter() - t, "before": before, "after": memory(device)}
        alias_tables(originals, model)  # transformers' modules read our host tables' bytes on the CPU
    with run.step("bf16 correctness"):
        with hf_path(model, originals), torch.no_grad():
            ref = greedy(model, ids, args.new_tokens)
            ref_logits = model(ids).logits
        got = greedy(model, ids, args.new_tokens)
        with torch.no_grad():
            logits = model(ids).logits
        if run.res.get("build_kind") == "host":  # ref_tokens came from the same path: does it repeat itself
            res["transformers_cpu_path_repeats"] = bool(torch.equal(ref, ref_tokens))
        else:
            res["transformers_cpu_path_equals_its_hbm_path"] = bool(torch.equal(ref, ref_tokens))
        res["tokens_equal_transformers"] = bool(torch.equal(got, ref))
        res["prefill_logits_bit_identical"] = bool(torch.equal(logits.view(torch.int16), ref_logits.view(torch.int16)))
        res["prefill_logits_finite"] = bool(torch.isfinite(ref_logits).all())  # bits equal on NaN would prove nothing
        if device.type == "cuda":
            cap = greedy(model, ids, args.new_tokens, **compiled_kw(device))
            res["captured_tokens_equal"] = bool(torch.equal(cap, ref))
            res["captured_counters"] = inductor_counters()
    decode_and_ple_steps(run, model, device, res, "bf16", originals)
    for n in args.prefill:
        with run.step(f"bf16 prefill {n}"):
            with hf_path(model, originals):
                hf_ms, hf_out = prefill_ms(model, n, device)
            ms, out = prefill_ms(model, n, device)
            res.setdefault("prefill_ms", {})[n] = {"transformers": hf_ms, "uvaple": ms,
                                                   "logits_equal": bool(torch.equal(out, hf_out))}


def phase_ceiling(run, device):
    """A table small enough for HBM: the device placement (the ceiling) against uva on the same table."""
    from uvaple.integration.models.qwen4_exp import apply_uvaple_to_qwen4_exp

    args = run.args
    model = build(args, device, args.ceiling_base)
    res = run.res.setdefault("ceiling", {"table_gib": table_bytes(model) / GiB})
    apply_uvaple_to_qwen4_exp(model, max_tokens=run.max_tokens)
    for backend in ("device", "uva"):
        for ple in ngram_children(model):
            ple.ple_embedding.ngram_embedding.set_backend(backend)
        for b in args.batches:
            with run.step(f"ceiling {backend} b={b}"):
                r = res.setdefault(backend, {})
                r.setdefault("eager", {})[b] = decode_rate(model, b, args, device)
                if device.type == "cuda":
                    r.setdefault("captured", {})[b] = decode_rate(model, b, args, device, **compiled_kw(device))
        torch._dynamo.reset()
    for ple in ngram_children(model):
        ple.ple_embedding.close()


def _disk_stats(model) -> dict:
    """The disk lookups' counts summed over the PLE layers: steps, hits, misses, pages read."""
    out = {"steps": 0, "hits": 0, "misses": 0, "evictions": 0, "pages_read": 0}
    for ple in ngram_children(model):
        for lk in ple.ple_embedding.ngram_embedding.lookups:
            st = lk.stats()
            for k in ("steps", "hits", "misses", "evictions"):
                out[k] += st["cache"][k]
            out["pages_read"] += st["pages_read"]
    out["hit_rate"] = out["hits"] / max(1, out["hits"] + out["misses"])
    return out


def phase_disk(run, device):
    """The disk placement in the model: a table of ``--disk-base`` rows a head served from host memory (``uva``,
    the ceiling of a host table) and from table files under row caches of ``--disk-fractions`` of it (the
    live tables written to ``--scratch``), eager: greedy tokens against ``uva``'s, decode tokens/s and one PLE
    layer's decode step at each batch, the caches' hit rates. The prompts and each step's tokens are random
    ids: nearly every n-gram is new, so the caches miss about as much as they can (real text repeats)."""
    from uvaple.integration.models.qwen4_exp import apply_uvaple_to_qwen4_exp

    args = run.args
    model = build(args, device, args.disk_base)
    res = run.res.setdefault("disk", {"table_gib": table_bytes(model) / GiB, "fractions": args.disk_fractions})
    ids = prompts(4, args.prompt_len, model.config.vocab_size, device, 1)
    folder = os.path.join(args.scratch, f"uvaple_disk_phase_{os.getpid()}")
    ngram = ngram_children(model)[0].ple_embedding
    rows = ngram.ngram_embedding.num_embeddings  # each layer's table, and its cache
    least = run.max_tokens * ngram.ngram_heads  # the rows of a forward's tokens: a cache holds them at least
    ref = None
    try:
        for name, frac in [("uva", None), *((f"disk_{f:g}", f) for f in args.disk_fractions)]:
            slots = None if frac is None else max(math.ceil(rows * frac), least)
            opts = {} if frac is None else dict(backend="disk", backend_options={"table_dir": folder, "slots": slots})
            with run.step(f"disk phase {name}"):
                r = res.setdefault(name, {} if frac is None else {"slots": slots, "of_rows": rows})
                patch = None
                try:
                    t = time.perf_counter()
                    patch = apply_uvaple_to_qwen4_exp(model, max_tokens=run.max_tokens, **opts)
                    r["swap_s"] = time.perf_counter() - t
                    got = greedy(model, ids, args.new_tokens)
                    if ref is None:
                        ref = got
                    r["tokens_equal_uva"] = bool(torch.equal(got, ref))
                    layer = ngram_children(model)[0]
                    for b in args.batches:
                        r.setdefault("decode_tok_s", {})[b] = decode_rate(model, b, args, device)
                        r.setdefault("ple_layer_step_us", {})[b] = ple_step_us(layer, b, model, device, compiled=False)
                    if frac is not None:
                        r["cache"] = _disk_stats(model)
                finally:  # the model's own tables back, the files gone, whatever failed
                    if patch is not None:
                        patch.revert()
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        del model
        gc.collect()


def phase_startup(run):
    """Startup stage by stage from a sharded checkpoint of ``--startup-gib`` (one table, 512 shards)."""
    from safetensors.torch import save_file

    from uvaple.integration.models import ngram_tables
    from uvaple.integration.quantize import fp8_row_table
    from uvaple.uva import HostTable

    args = run.args
    res = run.res.setdefault("startup", {})
    cols = args.ple_dim // 16
    rows = int(args.startup_gib * GiB) // (cols * 2)
    base = max(2, rows // 16)
    cfg = make_config(argparse.Namespace(**{**vars(args), "ple_layers": 1}), base)
    lay = ngram_tables.ngram_layout(cfg)[0]
    path = os.path.join(args.scratch, "qwen4_exp_startup")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    cfg.save_pretrained(path)
    parts = torch.chunk(torch.arange(lay.rows), cfg.split_ngram_parts)
    t = time.perf_counter()
    per_file = -(-len(parts) // 8)
    g = torch.Generator().manual_seed(1)
    for f in range(0, len(parts), per_file):
        tensors = {f"model.layers.{lay.layer_idx}.ple.ple_embedding.ngram_embedding.shard_{k}.weight":
                   (torch.randn(len(parts[k]), cols, generator=g) * 0.05).to(torch.bfloat16)
                   for k in range(f, min(f + per_file, len(parts)))}
        save_file(tensors, os.path.join(path, f"model-{f // per_file:05d}.safetensors"), metadata={"format": "pt"})
    src_bytes = lay.rows * cols * 2
    real = run.res.get("real_table_gib", 0.0) * GiB
    res.update(table_gib=src_bytes / GiB, shards=len(parts), write_s=time.perf_counter() - t)

    def stage(name, seconds, nbytes=src_bytes):
        res[name] = {"seconds": seconds, "gb_s": nbytes / seconds / 1e9,
                     "real_table_seconds": real / (nbytes / seconds) if real else None}

    t = time.perf_counter()
    (src,) = ngram_tables.find_shards(path, [lay])
    stage("check_shards", time.perf_counter() - t)
    t = time.perf_counter()
    table = HostTable.from_safetensors(path, [p.name for p in src.parts])
    stage("load_bf16", time.perf_counter() - t)
    res["load_bf16"]["timings"] = dict(table.timings)
    t = time.perf_counter()
    q, err = fp8_row_table(table.tensor)
    stage("quantise_host_table", time.perf_counter() - t)
    res["quantise_host_table"]["error"] = err.summary()
    q.close()
    table.close()
    t = time.perf_counter()
    tables = ngram_tables.load_ngram_tables(path, {"backend_options": {"quantize": "fp8_row", "keep_source": False}})
    stage("quantise_from_shards", time.perf_counter() - t)
    tables.close()
    shutil.rmtree(path, ignore_errors=True)


def main_plan(args, device, table: int, rest: int) -> tuple[str, str]:
    """(build, table precision) for the main phase: ``--build`` and ``--table``, ``auto`` resolved from the GPU's
    free memory and the host's; a combination that cannot run is named on stderr before anything is built (exit 2)."""
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    build_kind = args.build
    if build_kind == "auto":
        build_kind = "gpu" if free is None or table + rest + 8 * GiB <= free else "host"
    kind = args.table
    if kind == "auto":  # bf16 where host memory holds it with room to spare, else fp8
        kind = "bf16" if _mem_available() > table + 16 * GiB else "fp8"
    if build_kind == "host" and kind == "fp8":
        gpu = "?" if free is None else f"{free / GiB:.1f}"
        print(f"qwen4_exp_e2e.py: --table {args.table} resolved to fp8, which is quantised from the tables in HBM, "
              f"and --build {args.build} resolved to host ({table / GiB:.1f} GiB of tables and {rest / GiB:.1f} GiB "
              f"of the rest against {gpu} GiB free on the GPU): pass --table bf16 on a host with "
              f"{(table + 16 * GiB) / GiB:.0f} GiB available, or a smaller --ngram-base", file=sys.stderr)
        raise SystemExit(2)
    return build_kind, kind


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where the results go ('-': stdout)")
    ap.add_argument("--smoke-cpu", action="store_true", help="a toy config on the CPU, to check the script")
    ap.add_argument("--table", default="auto", choices=["auto", "bf16", "fp8"],
                    help="the real-size table's precision (auto: bf16 where host memory holds it, else fp8); one a "
                         "run: a captured graph keeps its host table until the process exits")
    ap.add_argument("--phases", default="main,ceiling,startup")
    ap.add_argument("--build", default="auto", choices=["auto", "gpu", "host"],
                    help="where the main phase's n-gram tables are built: gpu (in HBM, then swapped), host (never "
                         "on the GPU: bf16 only); auto: gpu where they fit beside the model with 8 GiB to spare")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ple-layers", type=int, default=1)
    ap.add_argument("--ple-dim", type=int, default=2560, help="values a token's 16 heads give (160 a head)")
    ap.add_argument("--ngram-base", type=int, default=20_000_000, help="rows a head (transformers' default)")
    ap.add_argument("--ceiling-base", type=int, default=2_000_000, help="rows a head of the HBM table (0: skip)")
    ap.add_argument("--disk-base", type=int, default=2_000_000,
                    help="rows a head of the disk phase's table (9.5 GiB bf16 by default; 0: skip)")
    ap.add_argument("--disk-fractions", default="0.25,0.125",
                    help="the disk phase's row caches, as fractions of its table")
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--short", type=int, default=8, help="generate lengths whose difference is timed")
    ap.add_argument("--long", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--startup-gib", type=float, default=8.0, help="the startup checkpoint's size (0: skip)")
    ap.add_argument("--scratch", default="/tmp")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    if not args.smoke_cpu and cuda_missing("qwen4_exp_e2e.py (pass --smoke-cpu for a CPU check of the script)"):
        return 2
    if args.smoke_cpu:
        args.ngram_base, args.ceiling_base, args.ple_dim, args.experts = 50, 40, 32, 4
        args.disk_base = min(args.disk_base, 4000)
        args.batches = "1,2" if args.batches == BATCHES else args.batches  # a smoke keeps batches it is given
        args.prefill = "16"
        args.new_tokens, args.short, args.long, args.repeats, args.prompt_len = 3, 1, 2, 1, 6
        args.startup_gib = min(args.startup_gib, 1 / 1024)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.disk_fractions = [float(f) for f in args.disk_fractions.split(",") if f]
    if not all(0 < f <= 1 for f in args.disk_fractions):
        ap.error(f"--disk-fractions: each must be in (0, 1], got {args.disk_fractions}")
    args.prefill = [int(n) for n in args.prefill.split(",") if n]
    device = torch.device("cpu" if args.smoke_cpu else "cuda")
    run = Run(args)
    # tokens in one forward at most: a prefill, or a batch of prompts (4 in the correctness checks)
    run.max_tokens = max(max(args.prefill), max([*args.batches, 4]) * (args.prompt_len + args.long))
    import transformers

    run.res["env"] = {"torch": torch.__version__, "transformers": transformers.__version__, "python":
                      platform.python_version(), "host_cpus": os.cpu_count(), "args": vars(args),
                      "fla": importlib.util.find_spec("fla") is not None,
                      "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
                      "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()}
    phases = [p for p in args.phases.split(",") if p]
    if "main" in phases:
        table, rest, shapes = planned_bytes(args, args.ngram_base)
        build_kind, kind = main_plan(args, device, table, rest)
        run.res.update(real_table_gib=table / GiB, other_weights_gib=rest / GiB, build_kind=build_kind, table=kind)
        print(f"[plan] n-gram tables {table / GiB:.1f} GiB, the rest {rest / GiB:.1f} GiB: {build_kind} build, "
              f"{kind} table", file=sys.stderr)
        model = originals = tables = None
        with run.step("build"):
            t = time.perf_counter()
            run.res["memory_empty"] = memory(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if build_kind == "host":
                model, tables = build_host_tables(args, device, args.ngram_base, shapes)
                originals = serve_host_tables(model, tables, run.max_tokens)
                pick = torch.randint(0, tables[0].rows, (4096,), generator=torch.Generator().manual_seed(0))
                run.res["table_sample_std"] = float(tables[0].tensor[pick].float().std())  # the fill: ~init_std
            else:
                model = build(args, device, args.ngram_base)
            run.res["build"] = {"seconds": time.perf_counter() - t, "memory": memory(device)}
            if device.type == "cuda":  # a host build's peak stays below the tables' size: they never were there
                run.res["build"]["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        ref_tokens = None
        if model is not None and (build_kind == "gpu" or originals is not None):  # a host build served, or none
            ids = prompts(4, args.prompt_len, model.config.vocab_size, device, 1)
            with run.step("reference tokens"), \
                    hf_path(model, originals) if originals is not None else contextlib.nullcontext():
                # transformers' own path: the tables in HBM (a GPU build) or read on the CPU (a host build)
                ref_tokens = greedy(model, ids, args.new_tokens)
        if ref_tokens is not None:
            with run.step(f"{kind} phase"):
                if kind == "fp8":
                    phase_fp8(run, model, device, ids, ref_tokens)
                else:
                    phase_bf16(run, model, device, ids, ref_tokens, originals)
        # the host tables go with the last reference, unless a captured graph holds them (to the process's exit)
        del model, originals, tables
        torch._dynamo.reset()
        gc.collect()
        run.res["memory_after_main"] = memory(device)
    if "ceiling" in phases and args.ceiling_base:
        with run.step("ceiling phase"):
            phase_ceiling(run, device)
    if "disk" in phases and args.disk_base:
        with run.step("disk phase"):
            phase_disk(run, device)
    if "startup" in phases and args.startup_gib:
        with run.step("startup phase"):
            phase_startup(run)
    run.res["elapsed_s"] = time.monotonic() - run.t0
    if args.json == "-":
        print(json.dumps(run.res, indent=1, default=str))
    else:
        run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

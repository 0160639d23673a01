"""Qwen4Exp (the n-gram PLE model) with its n-gram tables in host memory: the HF transformers entry points.

What transformers does. Each PLE layer (``config.ple_layer_ids``, linear-attention layers) holds a
``Qwen4ExpTextNGramEmbedding``: an ``nn.Embedding`` of ``padded_vocab x head_dim`` rows (one prime-sized
range per hashed n-gram head, ~20 M rows each) that the model keeps off the device map
(``_no_placement_params``). Its forward hashes the last ``ngram_size`` tokens on the GPU, copies the ids to
the CPU, looks the rows up there and copies them back: a synchronous host round trip in every forward, so
no decode step can be captured in a CUDA graph. Loading concatenates the table's ``split_ngram_parts``
checkpoint shards into one tensor in RAM.

What this module does instead. :class:`HostNGramEmbedding` (built by :func:`ngram_embedding_class`, a
subclass of transformers' class, so ``isinstance`` checks and HF's ``_init_weights`` still see it) keeps
every attribute and buffer of the original and replaces two things:

* ``ngram_embedding`` is a :class:`~uvaple.integration.embedding.HostScaledEmbedding` (scale 1) over one
  :class:`~uvaple.uva.HostTable` per PLE layer, exactly ``padded_vocab x head_dim`` (one table per layer:
  each module owns its table, the state dict keeps ``...ngram_embedding.weight`` per layer, and a layer's
  rows are one contiguous range the lookup windows naturally).
* ``forward`` computes the same ids as transformers on the ids' device and gathers the rows through the
  module's lookup in the caller's stream. The ids are :func:`ngram_ids` (the definition, in torch, our
  formulation: each shifted token is taken while no end-of-sequence token lies between it and the position,
  one comparison per shift instead of a running maximum; the same hash, bit for bit, checked against
  transformers' forward on the same inputs and cache), hashed inside the gather: one kernel launch a forward
  (``HostScaledEmbedding.forward_ngrams``, :mod:`uvaple.kernels.gather_ngram`; the hash's steps are
  :mod:`uvaple.kernels.ngram`'s, checked bit for bit against :func:`ngram_ids`) instead of the tens of small
  operations the definition takes and the table read they feed. Under ``torch.compile``, with a hot set, or for a
  call the lookup sorts, the hash is its own launch before the gather (same bits). No ``.to(device)``, no host
  synchronisation: with a static cache the whole decode step is device work, so ``torch.compile(fullgraph=True)``
  and CUDA graphs capture it.

The cache protocol is transformers': the last ``ngram_size - 1`` tokens live in the linear-attention layer's
conv state 2 (``get_conv_state`` in 5.24, ``has_previous_state`` / ``layers[i].conv_states`` in 5.17),
padded with the end-of-sequence token on a short first call.

Overlap: none, by measurement. Each PLE layer gathers its rows inside its own forward, in stream order;
nothing is issued ahead on a side branch. On the H200 (transformers 5.17, real-size 95 GiB table, fp8 rows)
the whole PLE layer's decode step, hash and gather and projection, is 372 / 528 us captured in a CUDA graph at
batch 1 / 8: 0.19% / 0.28% of the model's decode step; eager 1.2% / 1.1%; the prefill's read is smaller
still (``perf/results/h200_2026-12-03/run17_qwen4_exp_e2e_fp8_real_table/``). That is under the 2% at which
gathering every layer's rows at the start of the forward would pay for its events. (The step there runs
transformers' PyTorch reference of the gated delta rule; a step several times faster would still leave the
captured layer near 1%: measure again before building the branch.) With no branch, the rows a forward
gathers are written and read by that forward alone, in one stream, so a later forward cannot overwrite rows
an earlier one still reads (seed 004).

Loading (:func:`load_qwen4_exp_with_host_ple`, :mod:`uvaple.integration.models.ngram_tables`): every shard of
every layer is located and checked first (presence, shape, dtype), then free host memory, then each table is
filled straight from the shards (``pread`` into its rows, or quantised by the kernel of
:mod:`uvaple.integration.quantize`) before transformers builds the model, so a bad checkpoint is a named
error before anything is allocated on the GPU. fp8 checkpoints: transformers (5.17 - 5.24) stores a
quantised n-gram table as ``FP8Embedding`` (``FineGrainedFP8Config(modules_to_convert=["ngram_embedding"])``):
fp8 e4m3 shards and one ``weight_scale`` per table; such a table is loaded as stored into an ``fp8_global``
table (:class:`~uvaple.integration.encoded_embedding.HostEncodedEmbedding`) and served with the formula
``codes.to(dtype) * scale.to(dtype)``.

Options, as for Gemma 3n: ``backend`` (placement), ``oob`` (default ``"zero"``: hashed ids never leave the
table), ``backend_options`` (hot set, ``order`` / ``dedup``, ``quantize``; with ``keep_source=False`` the
``fp8_row`` table is made straight from the source, the loader's shards or a live model's table, block by block,
and no table of the source's dtype is kept: a live model's ``revert()`` then gives back the rows as served),
``max_tokens`` (tokens per forward; the lookup's static output holds ``max_tokens * ngram_heads`` rows).

Tables larger than host memory (``backend="disk"``, :mod:`uvaple.integration.file_embedding`): each PLE layer's
table is a table file in ``backend_options["table_dir"]`` (written once from the checkpoint's shards or the live
table, :mod:`uvaple.integration.models.ngram_tables`), read through a host row cache. The disk placement plans a
call on the host from host ids, so no CUDA graph captures it. The entry points give the model one read round a
forward (:mod:`uvaple.integration.models.step_reads`): the first PLE layer's forward hashes every layer's ids,
copies them to the host and waits once, and reads every layer's misses together; each layer's forward then looks
its rows up from those host ids. A layer whose ids are not the round's (called on its own, a ``device_map``
across devices) copies its own hashed ids to the host and waits for them, as every layer does without a round.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ..embedding import HostScaledEmbedding, TooManyIds, quantize_format
from ..encoded_embedding import HostEncodedEmbedding
from ..file_embedding import LOADER_OPTIONS, FileEmbedding
from ..quantize import fp8_row_table
from .hf import apply_uvaple, from_pretrained_with_host_tables
from .ngram_tables import NoPleLayersError, check_file_options, table_file_path
from .step_reads import StepReads

__all__ = ["apply_uvaple_to_qwen4_exp", "revert_uvaple_to_qwen4_exp", "load_qwen4_exp_with_host_ple",
           "ngram_embedding_class", "ngram_ids", "layer_multipliers", "NoPleLayersError"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / the golden ratio, odd
_LAYER_SEED_STEP = 10007  # each PLE layer's seed is the config's seed plus this prime times its index


def _splitmix64(z: int) -> int:
    """One step of the splitmix64 generator (Steele, Lea, Flood 2014) on a 64-bit state."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The odd hash multiplier of each n-gram position of PLE layer ``ple_index``: below
    ``(2^63 - 1) / vocab_size``, so a token id times its multiplier never overflows int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_SEED_STEP * ple_index
    return [2 * (_splitmix64((base + _GOLDEN * (k + 1)) & _MASK64) % half) + 1 for k in range(ngram_size)]


def ngram_ids(history: torch.Tensor, *, eos: int, multipliers: torch.Tensor, sizes: torch.Tensor,
              offsets: torch.Tensor, heads_per_ngram: int, last: int) -> torch.Tensor:
    """Table rows of the n-grams ending at the last ``last`` positions of ``history``.

    ``history [B, L]`` int64: the cached context tokens, then this call's. ``multipliers [n]`` (``n`` =
    ``ngram_size``), ``sizes`` / ``offsets [(n - 1) * heads_per_ngram]``: the layer's buffers, on the ids'
    device. Returns ``[B, last, (n - 1) * heads_per_ngram]`` int64: for order ``k`` (2..n) and head ``h``,
    ``(t0*m0 ^ t1*m1 ^ ... ^ t_{k-1}*m_{k-1}) mod size + offset``, where ``t_s`` is the token ``s`` places back,
    or ``eos`` where an end-of-sequence token lies between (or the history starts before it).
    """
    n, length = multipliers.shape[0], history.shape[1]
    tokens = [history]
    clean = None  # no eos strictly between position p - s and p
    for s in range(1, n):
        back = F.pad(history, (s, 0), value=eos)[:, :length]  # [B, L]: the token s places back
        tokens.append(back if clean is None else torch.where(clean, back, eos))
        clean = back != eos if clean is None else clean & (back != eos)
    tokens = [t[:, length - last:] for t in tokens]  # [B, last] each
    mixed = tokens[0] * multipliers[0]
    rows = []
    for k in range(1, n):  # n-grams of order k + 1
        mixed = mixed ^ (tokens[k] * multipliers[k])
        h = slice((k - 1) * heads_per_ngram, k * heads_per_ngram)
        size = sizes[h]  # a size <= 0 has no remainder: its rows are -1, outside every table (the kernel's too)
        row = torch.remainder(mixed.unsqueeze(-1), size.clamp(min=1)) + offsets[h]
        rows.append(torch.where(size > 0, row, -1))  # [B, last, heads_per_ngram]
    return torch.cat(rows, dim=-1)


def _cached_context(cache, layer_idx: int) -> torch.Tensor | None:
    """The layer's stored last tokens (conv state 2), or None before its first update."""
    if cache is None:
        return None
    get = getattr(cache, "get_conv_state", None)  # transformers >= 5.24
    if get is not None:
        return get(layer_idx, state_idx=2)
    if cache.has_previous_state(layer_idx, state_idx=2):  # 5.17 - 5.23
        return cache.layers[layer_idx].conv_states[2]
    return None


def _embedding_options(opts: dict, heads: int) -> dict:
    """The :class:`HostScaledEmbedding` arguments of the module options (``max_tokens`` counts tokens, the
    lookup rows: ``heads`` per token; ``keep_source`` and ``table_dir`` are the loader's)."""
    options = {k: v for k, v in (opts.get("backend_options") or {}).items() if k not in LOADER_OPTIONS}
    max_tokens = opts.get("max_tokens")
    return dict(backend=opts.get("backend", "uva"), oob=opts.get("oob") or "zero", backend_options=options,
                register=opts.get("register", "auto"), max_tokens=None if max_tokens is None else max_tokens * heads)


def _quantize_from_source(backend_options: dict | None) -> bool:
    """``backend_options`` ask for an ``fp8_row`` table made from the source with none of the source's dtype kept
    (``quantize`` with ``keep_source=False``)."""
    options = backend_options or {}
    return options.get("quantize") is not None and not options.get("keep_source", True)


def _quantized_embedding(emb: nn.Embedding, options: dict) -> HostEncodedEmbedding:
    """``emb``'s table (any device) quantised block by block straight into a new ``fp8_row`` host table (no host
    copy in its own dtype), served as :class:`HostEncodedEmbedding`; ``options`` are :func:`_embedding_options`'."""
    backend_options = dict(options["backend_options"])
    fmt = quantize_format(options["backend"], backend_options)  # the value and the placement, named as the module does
    backend_options.pop("quantize")
    weight = emb.weight.detach()
    table, err = fp8_row_table(weight, fmt, register=options["register"])  # a bf16, fp16 or fp32 table
    try:
        return HostEncodedEmbedding(emb.num_embeddings, emb.embedding_dim, table, encoding="fp8_row",
                                    out_dtype=weight.dtype, quant_error=err, backend=options["backend"],
                                    oob=options["oob"], backend_options=backend_options,
                                    register=options["register"], max_tokens=options["max_tokens"])
    except BaseException:
        table.close()
        raise


def _file_embedding(rows: int, dim: int, dtype: torch.dtype, folder: str, layer_idx: int, options: dict,
                    **kw) -> FileEmbedding:
    """A layer's :class:`FileEmbedding`, its file in ``folder`` (named by the layer and the encoding a weight
    assigned to it is written in)."""
    form = options["backend_options"].get("quantize") or "raw"
    return FileEmbedding(rows, dim, out_dtype=dtype, table_path=table_file_path(folder, layer_idx, form),
                         **options, **kw)


class _HostNGram:
    """The n-gram embedding with its table in host memory (see the module docstring). Mixed into transformers'
    ``Qwen4ExpTextNGramEmbedding`` by :func:`ngram_embedding_class`."""

    #: the class patch's ``{"opts": ...}`` (set on the subclass it binds; None: options come as arguments)
    _uvaple_state: dict | None = None
    #: how :class:`~uvaple.integration.models.ngram_tables.NGramTables` finds the modules to give tables to
    uvaple_ngram_table = True
    #: the model's read round over its disk-served layers (:func:`_wire_step_reads`; None: this layer reads alone)
    _step_reads: StepReads | None = None

    def __init__(self, config, embedding_dim: int, layer_idx: int, ple_layer_index: int = 0, **options):
        opts = dict(self._uvaple_state["opts"]) if self._uvaple_state else {}
        opts.update(options)
        device = torch.get_default_device()
        with torch.device("meta"):  # transformers' __init__ would allocate the whole table as a parameter
            super().__init__(config, embedding_dim, layer_idx, ple_layer_index)
        if device.type != "meta":
            self._set_constants(device)
        emb = self.ngram_embedding
        options = _embedding_options(opts, self.ngram_heads)
        folder = check_file_options(options["backend"], opts.get("backend_options"), opts.get("max_tokens"))
        if folder is not None:  # its rows are written to its file when transformers assigns the weight
            self.ngram_embedding = _file_embedding(emb.num_embeddings, emb.embedding_dim, torch.get_default_dtype(),
                                                   folder, layer_idx, options)
            return
        self.ngram_embedding = HostScaledEmbedding(
            emb.num_embeddings, emb.embedding_dim, None, 1.0, dtype=torch.get_default_dtype(),
            init_std=getattr(config, "initializer_range", 0.02), materialize=device.type != "meta", **options)

    def _set_constants(self, device: torch.device) -> None:
        """The hash buffers, computed here (transformers' ``_init_weights`` writes the same values)."""
        self.layer_multipliers = torch.tensor(
            layer_multipliers(self.unigram_vocab_size, self.ngram_size, self.ple_layer_index, self.seed),
            dtype=torch.long, device=device)
        self.ngram_heads_vocab_sizes = torch.tensor(self.head_vocab_sizes, dtype=torch.long, device=device)
        self.ngram_heads_offsets = torch.tensor(self.head_offsets, dtype=torch.long, device=device)

    @classmethod
    def from_module(cls, child: nn.Module, *, backend: str = "uva", oob: str | None = None,
                    backend_options: dict | None = None, register="auto", max_tokens: int | None = None,
                    ngram_embedding: HostScaledEmbedding | None = None):
        """A drop-in for the live module ``child``: its attributes and buffers, its table copied to host memory
        (or ``ngram_embedding``, a host embedding of the same rows built by the caller, e.g. an fp8 one)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for key, value in vars(child).items():
            if not key.startswith("_"):  # transformers' plain attributes (sizes, offsets, eos, ...) and training
                setattr(new, key, value)
        for key, buf in child.named_buffers(recurse=False):
            new.register_buffer(key, buf, persistent=key not in child._non_persistent_buffers_set)
        opts = dict(backend=backend, oob=oob, backend_options=backend_options, register=register, max_tokens=max_tokens)
        source = child.ngram_embedding.weight
        new._source_place = (source.device, source.dtype)
        options = _embedding_options(opts, child.ngram_heads)
        folder = check_file_options(backend, backend_options, max_tokens)
        if ngram_embedding is None and folder is not None:  # the live table written to its file, block by block
            emb = child.ngram_embedding
            ngram_embedding = _file_embedding(emb.num_embeddings, emb.embedding_dim, source.dtype, folder,
                                              child.layer_idx, options)
            try:
                ngram_embedding.load_weight_(source)
                if source.device.type == "cuda":
                    ngram_embedding._lookup_for(source.device)
            except BaseException:
                ngram_embedding.close()
                raise
        if ngram_embedding is None and _quantize_from_source(backend_options):
            ngram_embedding = _quantized_embedding(child.ngram_embedding, options)
        new.ngram_embedding = ngram_embedding if ngram_embedding is not None else HostScaledEmbedding.from_embedding(
            child.ngram_embedding, **options)
        if source.device.type == "cuda":
            new.ngram_embedding._lookup_for(source.device)  # built now, not inside a compiled or captured forward
        return new

    def free_source(self, child: nn.Module) -> None:
        """Drop ``child``'s own table (wherever it lived)."""
        device, dtype = self._source_place
        child.ngram_embedding.weight.data = torch.empty(0, dtype=dtype, device=device)

    def restore_source(self, child: nn.Module) -> None:
        """Give ``child`` its table back, copied from the host table (an encoded table, such as the ``fp8_row``
        one made from the source with ``keep_source=False``, gives its rows as served: its entry's reference)."""
        device, dtype = self._source_place
        rows = self.ngram_embedding.read_table(dtype)  # as served: an encoded or file table's through its reference
        host = self.ngram_embedding.weight  # the host table's own rows are copied, never aliased
        child.ngram_embedding.weight.data = rows.to(device=device, dtype=dtype, copy=rows.data_ptr() == host.data_ptr())

    def host_embeddings(self) -> list[HostScaledEmbedding]:
        return [self.ngram_embedding]

    def close(self) -> None:
        reads, self._step_reads = self._step_reads, None
        if reads is not None:
            reads.close()
        self.ngram_embedding.close()

    def forward(self, input_ids: torch.Tensor, cache=None, past_key_values=None) -> torch.Tensor:
        """``input_ids [B, S]`` -> ``[B, S, ngram_heads * head_dim]`` on the ids' device; updates ``cache``."""
        cache = cache if cache is not None else past_key_values
        ids = input_ids.long()
        ctx = self.context_len
        stored = _cached_context(cache, self.layer_idx)
        reads, host_ids = self._step_reads, None
        if reads is not None and not torch.compiler.is_compiling():  # (compiled: each layer reads alone)
            # before the update below: the round hashes over every layer's stored context
            reads.read_ahead(self, input_ids, cache)
            host_ids = reads.take(self, input_ids, stored)
        before = ids.new_full((ids.shape[0], ctx), self.eos_token_id) if stored is None else stored
        history = torch.cat([before, ids], dim=1)  # a copy: the update below overwrites the cache's tensor
        if cache is not None:
            keep = ids
            if stored is None and ids.shape[1] < ctx:  # the cache would pad with zeros: pad with eos
                keep = F.pad(ids, (ctx - ids.shape[1], 0), value=self.eos_token_id)
            cache.update_conv_state(keep, self.layer_idx, state_idx=2, conv_kernel_size=ctx)
        try:
            if host_ids is not None:  # hashed and read ahead by the forward's read round: looked up from the host
                rows = self.ngram_embedding.forward_host_ids(host_ids, ids.device)
            else:  # the rows of ngram_ids's ids: hash and gather in one launch
                rows = self.ngram_embedding.forward_ngrams(
                    history, eos=self.eos_token_id, multipliers=self.layer_multipliers,
                    sizes=self.ngram_heads_vocab_sizes, offsets=self.ngram_heads_offsets, last=ids.shape[1])
        except TooManyIds:  # its max_tokens counts rows, ngram_heads a token: say it in the entry points' tokens
            raise ValueError(f"{ids.numel()} tokens in one forward, but this model's n-gram layers were built for "
                             f"max_tokens={self.ngram_embedding.max_tokens // self.ngram_heads}; load or patch it "
                             "with a larger max_tokens") from None
        return rows.flatten(-2)  # [B, S, heads * dim]


@functools.cache
def ngram_embedding_class() -> type:
    """``HostNGramEmbedding``: transformers' ``Qwen4ExpTextNGramEmbedding`` with its table in host memory
    (imports transformers on first use)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp

    base = modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding
    if issubclass(base, _HostNGram):  # a class patch is active: its class derives from the original
        base = next(c for c in base.__mro__ if not issubclass(c, _HostNGram) and c.__name__ == base.__name__)
    return type("HostNGramEmbedding", (_HostNGram, base), {"__module__": __name__, "__doc__": _HostNGram.__doc__})


def __getattr__(name: str):
    if name == "HostNGramEmbedding":
        return ngram_embedding_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def apply_uvaple_to_qwen4_exp(model: nn.Module | None = None, *, backend: str = "uva", oob: str = "zero",
                              backend_options: dict | None = None, register="auto", max_tokens: int | None = None):
    """Put Qwen4Exp's n-gram tables in host memory.

    With ``model``: replace every PLE layer's ``ple_embedding`` of the live model by a
    :class:`HostNGramEmbedding` holding a host copy of its table and free the original table (GPU or CPU).
    Without: bind transformers' ``Qwen4ExpTextNGramEmbedding`` name to it, so models built afterwards never
    allocate the tables as parameters. Returns a :class:`uvaple.integration.models.hf.UvaplePatch` (``revert()``,
    context manager). A model whose config has no ``ple_layer_ids`` is a :class:`NoPleLayersError`.

    ``backend="disk"`` (a live model only): each table is written to a table file in ``backend_options
    ["table_dir"]`` (quantised on the way with ``quantize``, which needs ``keep_source=False``: the model's own
    tables are freed, so ``revert()`` gives back the rows as served), served through a host row cache of
    ``budget_bytes`` (or ``slots``) per PLE layer; ``max_tokens`` is required. ``revert()`` reads the tables back
    from the files. The tables are freed only once every layer is served from its file.
    """
    folder = check_file_options(backend, backend_options, max_tokens)  # named before any module is touched
    if folder is not None and model is not None and (backend_options or {}).get("quantize") is not None \
            and (backend_options or {}).get("keep_source", True):
        raise ValueError(f"backend={backend!r} with quantize writes each table's fp8_row rows to its file and frees "
                         "the model's own: revert() then gives back the rows as served, not the originals. Pass "
                         "backend_options['keep_source']=False to say so, or write the files raw (no quantize)")
    if model is not None:
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not getattr(text, "ple_layer_ids", None):
            raise NoPleLayersError(f"{type(model).__name__}'s config has no ple_layer_ids: it has no n-gram table "
                                   "to put in host memory")
    patch = apply_uvaple(model, model_type="qwen4_exp_text", backend=backend, oob=oob,
                         backend_options=backend_options, register=register, max_tokens=max_tokens)
    if folder is not None and model is not None:
        _wire_step_reads(model)
    return patch


def _wire_step_reads(model: nn.Module) -> None:
    """One read round a forward (:class:`StepReads`) over ``model``'s n-gram layers served from table files."""
    mods = [m for m in model.modules() if isinstance(m, _HostNGram) and isinstance(m.ngram_embedding, FileEmbedding)]
    if mods:
        reads = StepReads(mods, _cached_context)
        for m in mods:
            m._step_reads = reads


def revert_uvaple_to_qwen4_exp(handle) -> None:
    """Undo :func:`apply_uvaple_to_qwen4_exp` (same as ``handle.revert()``)."""
    handle.revert()


def load_qwen4_exp_with_host_ple(path, *, model_class=None, backend: str = "uva", oob: str = "zero",
                                 backend_options: dict | None = None, register="auto", max_tokens: int | None = None,
                                 **from_pretrained_kw):
    """``from_pretrained`` a local Qwen4Exp checkpoint with every n-gram table streamed into host memory.

    The checkpoint's shards are checked and the tables filled first (see the module docstring; named errors:
    :class:`NoPleLayersError`, :class:`~uvaple.integration.models.ngram_tables.ShardMissingError`,
    :class:`~uvaple.integration.models.ngram_tables.ShardShapeError`, :class:`~uvaple.uva.HostMemoryError`), then
    transformers builds the model with the class patch (no table becomes a parameter) and loads every other
    tensor as usual (``device_map=``, ``dtype=`` ... pass through); the tables never touch the GPU.
    ``model_class`` defaults to ``Qwen4ExpForCausalLM``.

    ``backend="disk"``: the tables larger than host memory. Each PLE layer's table is a table file in
    ``backend_options["table_dir"]``, written once from the shards (block by block, quantised on the way with
    ``quantize``; an fp8 checkpoint's codes as stored), reused while the checkpoint's files are the same files,
    unchanged (their path, inode, size and times, in the file's header; a copy or a move writes it again), and
    served through a host row cache of ``backend_options["budget_bytes"]`` (or ``slots``) per PLE layer;
    ``max_tokens`` is required. The free space of the folder's disk is checked before the first file is written.
    """
    if model_class is None:
        from transformers import Qwen4ExpForCausalLM as model_class
    model = from_pretrained_with_host_tables(model_class, path, model_type="qwen4_exp_text", backend=backend,
                                             oob=oob, backend_options=backend_options, register=register,
                                             max_tokens=max_tokens, **from_pretrained_kw)
    if check_file_options(backend, backend_options, max_tokens) is not None:
        _wire_step_reads(model)
    return model

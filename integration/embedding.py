"""A scaled word embedding whose table lives in pinned, mapped host memory: the PLE drop-in module.

``HostScaledEmbedding`` is a drop-in for HF transformers' ``Gemma3nTextScaledWordEmbedding`` (an
``nn.Embedding`` whose output is multiplied by ``embed_scale`` cast to the weight dtype) when that module
is ``embed_tokens_per_layer``: vocab 262,144 x (num_layers * 256), 3.75 GiB for E2B in bf16. The table
lives in a :class:`uvaple.uva.HostTable`; rows are gathered in the caller's stream through a lookup
(placement ``uva`` by default, ``copy`` or ``device`` on request: :func:`uvaple.integration.make_lookup`).
The Gemma 3n entry points are :mod:`uvaple.integration.models.gemma3n`.

Static output. Built with ``max_tokens=N``, the module preallocates its output (``[N, embedding_dim]``
on each device it serves) and every forward writes into it: no allocation per step, the same buffer in
every CUDA-graph replay. A forward's result is then valid until the next forward (how a model's
embedding output is used); without ``max_tokens`` each forward allocates its result.

Matching the reference
----------------------
* Output: ``[*ids.shape, embedding_dim]`` in the weight dtype, on the device of the ids, equal bit for
  bit to ``embedding(ids) * embed_scale.to(weight.dtype)``: ``gather_rows(..., scale=s)`` is defined as
  ``rows * torch.tensor(s).to(dtype)``, and ``s`` is the module's own scale already cast to the weight
  dtype, so it is exact in float32.
* Ids outside ``[0, num_embeddings)`` read row 0 (``oob="row0"``): transformers >= 5.24's
  ``Gemma3nTextModel.get_per_layer_inputs`` maps them to 0, and the multimodal ``Gemma3nModel`` masks
  them to 0 in every 5.x release. Older text models (5.17-5.23) raise an IndexError (CPU) or a device
  assert (CUDA) for them; we return the 5.24 answer instead of failing.
* ``model.to(dtype)``: the host table keeps its dtype; the module casts its output to the new dtype
  (``out_dtype``). That equals HF's ``weight.to(dtype) * scale.to(dtype)`` whenever the scale is a power of
  two (Gemma 3n: sqrt(256) = 16) except for fp16 subnormals.

Rows quantised to fp8
---------------------
``backend_options={"quantize": "fp8_row"}`` (``uva`` or ``device`` placement) serves the table as fp8 codes
with a float32 scale per row (:mod:`uvaple.integration.quantize`): about half the bytes per row across
PCIe (or in HBM). The quantised table is built once, block by block, from the host table's rows times the
module's scale (the values HF's module returns), when the first lookup is built; the host table itself
stays as it is (the state dict, ``revert()`` and the lossless placements read it). The output keeps the
model's dtype (``compute_dtype``): ``codes.to(dtype) * row_scale.to(dtype)``, vLLM's formula. The
quantisation error, per 256-value slice (one Gemma 3n layer), is :attr:`HostScaledEmbedding.quant_error`
(``.summary()``: largest absolute and relative error). ``"fp8_row_e5m2"`` uses e5m2 codes instead of e4m3fn.

State dict
----------
The table is not a parameter or buffer (``model.to("cuda")`` would copy it to the GPU): it is a plain
attribute. ``state_dict()`` still carries ``<prefix>weight`` (a CPU tensor aliasing the host table) and
``load_state_dict()`` writes ``<prefix>weight`` into the host table, so checkpoints keep their keys.
Assigning ``module.weight = tensor`` (what transformers' loader does) also writes into the table.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from uvaple.dtypes import fmt_bytes
from uvaple.kernels.ngram import check_history

from .devices import resolve_device
from .factory import make_lookup, model_placements, placement
from .placements.hot import hot_set_from_options
from .spec import TableSpec

__all__ = ["HostScaledEmbedding", "host_state_dict_excluded", "QUANTIZE", "quantize_format"]

#: the placements a module serves (the factory's entries without a refusal for model layers)
BACKENDS = model_placements()
#: those that serve a table in host memory (the others serve a table file: ``file_embedding.FileEmbedding``)
HOST_BACKENDS = tuple(name for name in BACKENDS if not placement(name).reads_file)
OOB_RULES = ("row0", "zero")
#: ``backend_options["quantize"]`` values: the fp8 format of the ``fp8_row`` table served instead of the rows
QUANTIZE = {"fp8_row": torch.float8_e4m3fn, "fp8_row_e5m2": torch.float8_e5m2}

# Rows initialised per block when a fresh table is filled with random values: 64 MiB of fp32 normals at a
# time keeps the transient small next to a 3.75 GiB table.
_INIT_BLOCK_BYTES = 64 << 20

_local = threading.local()


class TooManyIds(ValueError):
    """More ids in one forward than the module's ``max_tokens`` holds (a module counting in other units, such as
    Qwen4Exp's n-gram layer in tokens, restates it)."""


def _excluded() -> bool:
    return getattr(_local, "exclude", 0) > 0


@contextmanager
def host_state_dict_excluded() -> Iterator[None]:
    """Inside this block ``state_dict()`` of every :class:`HostScaledEmbedding` omits ``weight``.

    Used while transformers' ``from_pretrained`` runs, so that the loader treats the checkpoint's table as
    an unexpected key (never read, never put on the GPU) and :func:`load_gemma3n_with_host_ple` streams it
    into the host table itself.
    """
    _local.exclude = getattr(_local, "exclude", 0) + 1
    try:
        yield
    finally:
        _local.exclude -= 1


def quantize_format(backend: str, options: dict) -> torch.dtype | None:
    """The fp8 format ``options["quantize"]`` asks for (None: rows as stored), checked against the placement."""
    q = options.get("quantize")
    if q is None:
        return None
    if not isinstance(q, str) or q not in QUANTIZE:
        raise ValueError(f"backend_options['quantize'] must be one of {sorted(QUANTIZE)} or None, got {q!r}")
    if not placement(backend).reads("fp8_row"):
        readers = tuple(name for name in BACKENDS if placement(name).reads("fp8_row"))
        raise ValueError(f"backend_options['quantize']={q!r} serves the {readers} placements, not {backend!r} (it "
                         "reads the rows as stored)")
    return QUANTIZE[q]


def _exact_scale(value: float, dtype: torch.dtype, *, source_dtype: torch.dtype | None = None) -> float:
    """The scale HF multiplies by: ``torch.tensor(value)`` (default dtype) cast to ``dtype``, as a float."""
    src = torch.tensor(value, dtype=source_dtype or torch.get_default_dtype(), device="cpu")
    return float(src.to(dtype).item())


class HostScaledEmbedding(nn.Module):
    """Scaled word embedding whose table lives in host memory the GPU reads directly.

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        Table shape ``[num_embeddings, embedding_dim]`` (Gemma 3n PLE: ``[vocab_size_per_layer_input,
        num_hidden_layers * hidden_size_per_layer_input]``).
    padding_idx : int, optional
        Kept for parity with ``nn.Embedding`` (it only matters for gradients there; the row is read as is).
    embed_scale : float
        The output scale as HF configures it (``hidden_size_per_layer_input ** 0.5``).
    table : HostTable, optional
        The table. Without it the module allocates one (random normal, ``init_std``) unless it is built
        under ``torch.device("meta")`` (transformers' ``from_pretrained``): then it stays empty until a
        state dict, ``module.weight = ...`` or :meth:`attach_table` fills it.
    backend : {"uva", "device", "copy"}
        The lookup's placement: how rows are read (see :func:`uvaple.integration.make_lookup`).
    oob : {"row0", "zero"}
        What ids outside ``[0, num_embeddings)`` read (``row0``: as transformers does).
    dtype : torch.dtype, optional
        Table dtype (default: ``table.dtype`` or the current default dtype).
    scale_value : float, optional
        The exact scale already cast to the table dtype (set when taken from a live HF module).
    backend_options : dict, optional
        Extra keyword arguments for ``make_lookup``; and, for the ``uva`` placement, a hot set of the most
        frequent rows in HBM (:class:`uvaple.integration.HotSet`, one per device): ``cache_gb`` or
        ``hot_fraction`` (its size), ``hot_profile`` (counts per row, or token ids / a file of them, to
        rank the rows held) and ``count_ids`` (count the served ids; :meth:`hot_sets`' ``refresh()``);
        and, for ``uva`` or ``device``, ``quantize``: ``"fp8_row"`` (or ``"fp8_row_e5m2"``) serves the rows
        quantised to fp8 with a scale per row (see the module docstring; a hot set then holds fp8 rows).
    max_tokens : int, optional
        Most ids per forward: the output is preallocated and written in place (see the module docstring).
    own_table : bool
        Whether :meth:`close` releases the given ``table`` (default False; tables the module allocates
        itself are always released).
    materialize : bool, optional
        Allocate a random table now (default: unless the default device is ``meta``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 embed_scale: float = 1.0, *, table=None, backend: str = "uva", oob: str = "row0",
                 dtype: torch.dtype | None = None, scale_value: float | None = None,
                 init_std: float = 0.02, backend_options: dict | None = None, register="auto",
                 own_table: bool | None = None, materialize: bool | None = None, max_tokens: int | None = None):
        super().__init__()
        self._check_backend(backend)
        if oob not in OOB_RULES:
            raise ValueError(f"oob must be one of {OOB_RULES}, got {oob!r}")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.padding_idx = padding_idx
        self.scalar_embed_scale = embed_scale
        self.backend_kind = backend
        self.oob = oob
        self.backend_options = dict(backend_options or {})
        quantize_format(backend, self.backend_options)  # a bad value is named here, not at the first forward
        self.register_mode = register
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        self.max_tokens = max_tokens
        if table is not None:
            if (table.rows, table.cols) != (self.num_embeddings, self.embedding_dim):
                raise ValueError(f"table is {table.rows}x{table.cols}, module expects "
                                 f"{self.num_embeddings}x{self.embedding_dim}")
            dtype = table.dtype
        self.table_dtype = dtype or torch.get_default_dtype()
        # Compute dtype of the output; follows model.to(dtype) (see _apply).
        self.compute_dtype = self.table_dtype
        self.scale_value = (scale_value if scale_value is not None
                            else _exact_scale(embed_scale, self.table_dtype))
        self._table = None
        self._own_table = False
        self._backends: dict = {}  # (device type, index, output dtype) -> (lookup, static output or None)
        self._last_device: torch.device | None = None
        self._last = None  # the (lookup, static output) of _last_device
        self._quant = None  # (fp8 format, fp8_row HostTable, QuantError) while backend_options quantize
        if table is not None:
            self.attach_table(table, own=bool(own_table))
        elif materialize or (materialize is None and torch.get_default_device().type != "meta"):
            self._allocate_random(init_std)

    def _check_backend(self, backend: str) -> None:
        """Refuse a placement this module cannot serve its table through (by name)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if placement(backend).reads_file:
            raise ValueError(f"the {backend} placement serves a table file, and this embedding's table is in host "
                             "memory: serve it with 'uva', or build a FileEmbedding over a table file "
                             "(uvaple.integration.file_embedding; Qwen4Exp's entry points write one per PLE layer)")

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_embedding(cls, emb: nn.Embedding, *, backend: str = "uva", oob: str = "row0",
                       backend_options: dict | None = None, register="auto",
                       max_tokens: int | None = None) -> HostScaledEmbedding:
        """Copy a live (HF) scaled embedding's table into a new host table; the scale is the module's own.

        ``emb`` needs ``weight`` and, for HF's scaled embedding, ``embed_scale`` (a 0-d buffer) or
        ``scalar_embed_scale``. A module on the meta device gives an empty drop-in (filled by loading).
        """
        weight = emb.weight
        dtype = weight.dtype
        scalar = float(getattr(emb, "scalar_embed_scale", 1.0))
        buf = getattr(emb, "embed_scale", None)
        if isinstance(buf, torch.Tensor) and buf.device.type != "meta":
            scale_value = float(buf.detach().to(dtype).float().item())  # HF: embed_scale.to(weight.dtype)
        else:
            scale_value = _exact_scale(scalar, dtype)
        mod = cls(emb.num_embeddings, emb.embedding_dim, emb.padding_idx, scalar, backend=backend, oob=oob,
                  dtype=dtype, scale_value=scale_value, backend_options=backend_options, register=register,
                  materialize=False, max_tokens=max_tokens)
        if weight.device.type != "meta":
            mod.load_weight_(weight.detach())
        return mod

    def _allocate_random(self, std: float) -> None:
        """A fresh table, normal(0, std) like HF's ``_init_weights`` for embeddings, padding row zero."""
        from uvaple.uva import HostTable

        table = HostTable.empty(self.num_embeddings, self.embedding_dim, self.table_dtype,
                                register=self.register_mode)
        t = table.tensor
        block = max(1, _INIT_BLOCK_BYTES // max(1, self.embedding_dim * 4))
        for a in range(0, self.num_embeddings, block):
            rows = t[a:a + block]
            rows.copy_(torch.empty(rows.shape, dtype=torch.float32, device="cpu").normal_(0.0, std))
        if self.padding_idx is not None and 0 <= self.padding_idx < self.num_embeddings:
            t[self.padding_idx].zero_()
        self.attach_table(table, own=True)

    # ------------------------------------------------------------------ table
    @property
    def table(self):
        """The :class:`uvaple.uva.HostTable` (None until loaded when built on the meta device)."""
        return self._table

    @property
    def materialized(self) -> bool:
        return self._table is not None

    def attach_table(self, table, *, own: bool = False) -> None:
        """Use ``table`` from now on (backends are rebuilt); ``own``: :meth:`close` releases it."""
        if (table.rows, table.cols) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table is {table.rows}x{table.cols}, module expects "
                             f"{self.num_embeddings}x{self.embedding_dim}")
        old, old_own = self._table, self._own_table
        self._close_backends()
        if self.table_dtype != table.dtype:
            if self.compute_dtype == self.table_dtype:
                self.compute_dtype = table.dtype
            # from the configured scale, as HF rounds it (not from the scale already rounded to the old dtype)
            self.scale_value = _exact_scale(self.scalar_embed_scale, table.dtype)
            self.table_dtype = table.dtype
        self._table, self._own_table = table, own
        if old is not None and old is not table and old_own:
            old.close()

    @property
    def weight(self) -> torch.Tensor:
        """CPU tensor aliasing the host table (a meta tensor while the table is not loaded). Read-only use."""
        if self._table is None:
            return torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.table_dtype, device="meta")
        return self._table.tensor

    def __setattr__(self, name, value):
        if name == "weight":  # transformers' loader assigns nn.Parameter(tensor): keep it on the host
            self.load_weight_(value)
            return
        super().__setattr__(name, value)

    @torch.no_grad()
    def load_weight_(self, weight: torch.Tensor) -> None:
        """Write ``weight [num_embeddings, embedding_dim]`` (any device) into the host table."""
        from uvaple.uva import HostTable

        if not self._checked_weight(weight):
            return
        weight = weight.detach()
        if self._table is not None and self._table.tensor.data_ptr() == weight.data_ptr():
            return  # our own view (state_dict round trip within one module)
        if self._table is None:
            table = HostTable.from_tensor(weight, dtype=self.table_dtype, register=self.register_mode)
            self.attach_table(table, own=True)
        else:
            self._close_backends()  # a device copy would be stale
            self._table.write_rows(weight)

    def read_table(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The table's values as a CPU tensor: here the host table's own rows as stored (no copy; ``dtype`` is for
        the encoded and file tables, which make them)."""
        return self.weight

    def _checked_weight(self, weight) -> bool:
        """Whether ``weight`` holds rows to load: a tensor of this module's shape (a named error otherwise), not on
        the meta device."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be a tensor, got {type(weight).__name__}")
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected "
                             f"({self.num_embeddings}, {self.embedding_dim})")
        return weight.device.type != "meta"

    # ------------------------------------------------------------------ state dict
    def _state_weight(self) -> torch.Tensor:
        w = self.weight
        return w if w.is_contiguous() else w.contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not _excluded():
            destination[prefix + "weight"] = self._state_weight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key in state_dict:
            try:
                self.load_weight_(state_dict[key])
            except (ValueError, TypeError) as e:
                error_msgs.append(f"{key}: {e}")
        elif strict:
            missing_keys.append(key)
        if strict:
            for k in state_dict:
                if k.startswith(prefix) and k != key and "." not in k[len(prefix):]:
                    unexpected_keys.append(k)

    # ------------------------------------------------------------------ device / dtype moves
    def _apply(self, fn, recurse=True):
        # nn.Module.to / .cuda / .half only visit parameters and buffers; the host table is neither. Probe
        # what fn does to a floating tensor to follow dtype changes, and build the backend of a new device
        # now rather than inside a compiled or captured forward.
        probe = fn(torch.empty(0, dtype=self.compute_dtype, device="cpu"))
        if isinstance(probe, torch.Tensor):
            if probe.dtype.is_floating_point and probe.dtype != self.compute_dtype:
                self.compute_dtype = probe.dtype
                self._close_backends()  # lookups (an HBM copy for 'device') of the old output dtype go
            if probe.device.type not in ("meta", "cpu") and self._table is not None:
                self._lookup_for(probe.device)
        return super()._apply(fn, recurse)

    def set_backend(self, backend: str, backend_options: dict | None = None) -> None:
        """Read rows through ``backend`` from now on (the current backends are closed; the table stays)."""
        self._check_backend(backend)
        options = dict(backend_options or {})
        fmt = quantize_format(backend, options)
        devices = {torch.device(t, i) if i is not None else torch.device(t) for t, i, _ in self._backends}
        old = (self._backends, self.backend_kind, self.backend_options, self._last_device, self._last)
        old_quant = self._quant
        self._backends, self._last_device, self._last = {}, None, None
        self.backend_kind, self.backend_options = backend, options
        try:  # build the new lookups first: a failure leaves the module as it was
            for d in devices:
                self._lookup_for(d)
        except BaseException:
            new, self._backends = self._backends, {}
            for lookup, _ in new.values():
                lookup.close()
            if self._quant is not None and self._quant is not old_quant:
                self._quant[1].close()
            self._quant = old_quant
            self._backends, self.backend_kind, self.backend_options, self._last_device, self._last = old
            raise
        for lookup, _ in old[0].values():
            lookup.close()
        if old_quant is not None and old_quant is not self._quant:
            old_quant[1].close()  # lookups still reading it hold its memory (a view outlives close)
        if self._quant is not None and self._quant[0] != fmt:
            self._drop_quantized()  # no lookup was built: the new options' table is made on first use

    # ------------------------------------------------------------------ lookup
    def _lookup_for(self, device: torch.device):
        """The (lookup, static output) serving ``device`` at the current output dtype (built once)."""

        if self._table is None:
            raise RuntimeError(
                "HostScaledEmbedding has no table yet: it was built on the meta device and never loaded. "
                "Load a state dict, assign `.weight`, call attach_table(), or use load_gemma3n_with_host_ple()")
        device = resolve_device(device)  # a bare "cuda" is the current device, as for every lookup
        key = (device.type, device.index, self.compute_dtype)
        entry = self._backends.get(key)
        if entry is None:
            options = dict(self.backend_options)
            table, spec = self._served(options, device)
            hot = hot_set_from_options(table, device, options, placement(self.backend_kind))
            if hot is not None:
                options["hot"] = hot
            if self.max_tokens is not None:
                options.setdefault("max_rows", self.max_tokens)  # the copy placement sizes its slots from it
            lookup = make_lookup(self.backend_kind, table, device=device, spec=spec, **options)
            static = None
            if self.max_tokens is not None:
                static = torch.empty(self.max_tokens, self.embedding_dim, dtype=spec.output_dtype, device=device)
            entry = self._backends[key] = (lookup, static)
        self._last_device, self._last = device, entry
        return entry

    def _served(self, options: dict, device: torch.device) -> tuple:
        """(the table a lookup on ``device`` reads, its spec) at the current output dtype; takes from ``options``
        what it consumes (``quantize``). A subclass serving another table overrides this."""
        fmt = quantize_format(self.backend_kind, options)
        options.pop("quantize", None)
        if fmt is None:
            out_dtype = None if self.compute_dtype == self.table_dtype else self.compute_dtype
            return self._table, TableSpec.of(self._table, scale=self.scale_value, oob=self.oob, out_dtype=out_dtype)
        table = self._quantized(fmt)  # the module's scale is in the quantised rows: the lookup only dequantises
        return table, TableSpec.of(table, encoding="fp8_row", oob=self.oob, out_dtype=self.compute_dtype)

    def _quantized(self, fmt: torch.dtype):
        """The ``fp8_row`` table of this module's rows times its scale, in ``fmt`` (built once, block by block)."""
        from .quantize import fp8_row_table

        if self._quant is None or self._quant[0] != fmt:
            table, err = fp8_row_table(self._table.tensor, fmt, out_dtype=self.compute_dtype, scale=self.scale_value,
                                       register=self.register_mode)
            self._quant = (fmt, table, err)
        return self._quant[1]

    def _drop_quantized(self) -> None:
        quant, self._quant = self._quant, None
        if quant is not None:
            quant[1].close()

    @property
    def quant_error(self):
        """The :class:`~uvaple.integration.quantize.QuantError` of the rows served quantised (``quantize``
        in ``backend_options``; ``.summary()`` for the largest errors), measured against this module's
        unquantised output in ``compute_dtype``; None until such a lookup is built, and without ``quantize``."""
        return None if self._quant is None else self._quant[2]

    @property
    def quantized_table(self):
        """The ``fp8_row`` :class:`~uvaple.uva.HostTable` served (``quantize``), or None."""
        return None if self._quant is None else self._quant[1]

    @property
    def lookups(self) -> list:
        """The lookups built so far (one per device and output dtype), e.g. for their ``stats()``."""
        return [lookup for lookup, _ in self._backends.values()]

    @property
    def hot_sets(self) -> list:
        """The hot sets of the lookups built so far (``backend_options`` with ``cache_gb``/``hot_fraction``)."""
        return [lk.hot for lk in self.lookups if getattr(lk, "hot", None) is not None]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [*]`` (int) -> ``[*, embedding_dim]`` in ``compute_dtype`` on ``input_ids.device``.

        With ``max_tokens`` the result is a view of the module's static output (valid until the next
        forward); more than ``max_tokens`` ids is an error.
        """
        lookup, out = self._serve(input_ids.device, input_ids.shape)
        return lookup.lookup(input_ids, out)

    def forward_ngrams(self, history: torch.Tensor, *, multipliers: torch.Tensor, sizes: torch.Tensor,
                       offsets: torch.Tensor, eos: int, last: int) -> torch.Tensor:
        """The rows of an n-gram PLE layer's hashed ids: ``forward(ngram_rows(history, ...))``,
        ``[B, last, heads, embedding_dim]``, in one launch where the placement hashes inside its gather
        (:meth:`uvaple.integration.Lookup.lookup_ngrams`; the arguments are its). ``max_tokens`` bounds the ids,
        ``B * last * heads``, as :meth:`forward` does."""
        check_history(history, last)
        heads = sizes.numel() if isinstance(sizes, torch.Tensor) else None  # None: the lookup's named error
        lookup, out = self._serve(history.device, None if heads is None else (history.shape[0], last, heads))
        return lookup.lookup_ngrams(history, multipliers=multipliers, sizes=sizes, offsets=offsets, eos=eos, last=last,
                                    out=out)

    def _serve(self, device: torch.device, shape) -> tuple:
        """(the lookup serving ``device``, the static output viewed as ``shape`` ids' rows, or None)."""
        entry = self._last
        if entry is None or device != self._last_device:
            entry = self._lookup_for(device)
        lookup, static = entry
        if static is None or shape is None:
            return lookup, None  # no static output, or a call its lookup refuses by name
        n = 1
        for d in shape:
            n *= d
        if n > static.shape[0]:
            raise TooManyIds(f"{n} ids in one forward, but this embedding was built with max_tokens="
                             f"{static.shape[0]}; build it with a larger max_tokens")
        return lookup, static[:n].view(*shape, self.embedding_dim)

    # ------------------------------------------------------------------ lifetime
    def __deepcopy__(self, memo):
        # The host table owns a mapping and backends may own threads: copy the rows into a new table.
        new = type(self)(self.num_embeddings, self.embedding_dim, self.padding_idx, self.scalar_embed_scale,
                         backend=self.backend_kind, oob=self.oob, dtype=self.table_dtype,
                         scale_value=self.scale_value, backend_options=dict(self.backend_options),
                         register=self.register_mode, materialize=False, max_tokens=self.max_tokens)
        memo[id(self)] = new
        new.compute_dtype = self.compute_dtype
        new.training = self.training
        if self._table is not None:
            new.load_weight_(self.weight)
        return new

    def __getstate__(self):
        raise TypeError("HostScaledEmbedding holds a host-memory mapping and cannot be pickled; save its "
                        "state_dict() (or the model's, e.g. save_pretrained) instead")

    def _close_backends(self) -> None:
        """Close every lookup and drop the quantised table (the rows or the output dtype change)."""
        backends, self._backends = self._backends, {}
        self._last_device, self._last = None, None
        for lookup, _ in backends.values():
            lookup.close()
        self._drop_quantized()

    def close(self) -> None:
        """Release the backends and (when owned) the host table. The module is unusable afterwards."""
        self._close_backends()
        table, self._table = self._table, None
        if table is not None and self._own_table:
            table.close()

    def extra_repr(self) -> str:
        if self._table is None:
            where = "table=not loaded (host)"
        else:
            t = self._table
            state = "registered" if t.registered else "unregistered"
            shared = f", shared {t.name!r}" if t.name else ""
            where = (f"table=host {str(t.dtype).replace('torch.', '')} {fmt_bytes(t.nbytes)} "
                     f"({t.nbytes} B, {state}{shared})")
        dt = "" if self.compute_dtype == self.table_dtype else f", out_dtype={self.compute_dtype}"
        q = self.backend_options.get("quantize")
        if q is not None:
            served = "" if self._quant is None else f" ({fmt_bytes(self._quant[1].nbytes)} host)"
            dt += f", quantize={q}{served}"
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"scale={self.scale_value:g}, oob={self.oob}, backend={self.backend_kind}, {where}{dt}")

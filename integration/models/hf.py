"""HF transformers patching for per-layer-embedding (PLE) models, driven by a table keyed by model type.

One :class:`PleSpec` per ``config.model_type`` says which attribute holds the PLE table, which HF class
builds it, which HF class owns it, how its constructor arguments identify the PLE role, and what ids
outside the table read. :func:`apply_uvaple` then either swaps the modules of a live model or patches the
owner class so that models built afterwards never hold the table as a parameter. The next PLE model is a
new entry in :data:`SPECS`.

Gemma 3n's table is a module of its own, replaced by a :class:`HostScaledEmbedding`. Qwen4Exp's sits in a
module that also hashes the ids: its spec names a ``replacement`` (a subclass of that module), swapped in
whole on a live model and bound to the module's name in HF's modeling module by the class patch (as Liger
swaps classes); its ``loader`` fills the tables from the checkpoint before transformers builds the model.

Nothing here imports transformers at import time.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..embedding import HostScaledEmbedding, host_state_dict_excluded
from ..factory import PLACEMENTS

log = logging.getLogger("uvaple.integration.models.hf")

__all__ = [
    "PleSpec",
    "SPECS",
    "UvaplePatch",
    "apply_uvaple",
    "from_pretrained_with_host_tables",
    "supported_model_types",
]


@dataclass(frozen=True)
class PleSpec:
    """How one model family holds its PLE table.

    Attributes
    ----------
    attr : str
        Attribute name of the PLE module on its owner (``embed_tokens_per_layer``).
    module_class : str
        Dotted path of the HF module class that holds the table (identifies modules to swap).
    owner_class : str
        Dotted path of the HF class whose ``__init__`` builds that module (patched for class-level use).
    ctor_args : callable
        ``config -> dict`` of the constructor arguments ``(num_embeddings, embedding_dim, embed_scale)``
        that mark a ``module_class`` construction inside ``owner_class.__init__`` as the PLE table.
    oob : str
        What ids outside the table read (``row0``: transformers maps them to 0).
    replacement : str, optional
        Dotted path of a function returning the drop-in subclass of ``module_class`` (``from_module(child,
        **opts)``, ``free_source`` / ``restore_source(child)``, ``host_embeddings()``, ``close()``).
    loader : str, optional
        Dotted path of ``load(path, opts, from_pretrained_kw) -> tables`` (``attach(model)``, ``close()``).
    checkpoint_keys : tuple of str
        Regexes of the checkpoint keys transformers' loader must skip (default: ``attr``'s weight).
    table_files : bool
        Its modules serve a placement that reads table files (``disk``), writing them from the checkpoint.
    """

    attr: str
    module_class: str
    owner_class: str
    ctor_args: Callable[[object], dict]
    oob: str = "row0"
    init_std: Callable[[object], float] = field(default=lambda cfg: getattr(cfg, "initializer_range", 0.02))
    replacement: str | None = None
    loader: str | None = None
    checkpoint_keys: tuple[str, ...] = ()
    table_files: bool = False


def _gemma3n_ctor_args(cfg) -> dict:
    return {
        "num_embeddings": cfg.vocab_size_per_layer_input,
        "embedding_dim": cfg.num_hidden_layers * cfg.hidden_size_per_layer_input,
        "embed_scale": cfg.hidden_size_per_layer_input ** 0.5,
    }


_GEMMA3N = PleSpec(
    attr="embed_tokens_per_layer",
    module_class="transformers.models.gemma3n.modeling_gemma3n.Gemma3nTextScaledWordEmbedding",
    owner_class="transformers.models.gemma3n.modeling_gemma3n.Gemma3nTextModel",
    ctor_args=_gemma3n_ctor_args,
    oob="row0",
)

_QWEN4_EXP_NGRAM = "transformers.models.qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextNGramEmbedding"
_QWEN4_EXP = PleSpec(
    attr="ple_embedding",
    module_class=_QWEN4_EXP_NGRAM,
    owner_class=_QWEN4_EXP_NGRAM,
    ctor_args=lambda cfg: {},
    oob="zero",  # hashed ids are always inside the table; a zero row is the neutral answer
    replacement="uvaple.integration.models.qwen4_exp.ngram_embedding_class",
    loader="uvaple.integration.models.ngram_tables.load_ngram_tables",
    checkpoint_keys=(r"(^|\.)ngram_embedding\.weight$", r"(^|\.)ngram_embedding\.weight_scale$"),
    table_files=True,
)

#: ``config.model_type`` -> spec. ``gemma3n`` / ``qwen4_exp`` are the multimodal configs, ``*_text`` the text ones.
SPECS: dict[str, PleSpec] = {
    "gemma3n": _GEMMA3N,
    "gemma3n_text": _GEMMA3N,
    "qwen4_exp": _QWEN4_EXP,
    "qwen4_exp_text": _QWEN4_EXP,
}


def supported_model_types() -> list[str]:
    return sorted(SPECS)


def _resolve(dotted: str):
    mod, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def _check_backend(spec: PleSpec, model_type: str | None, backend) -> None:
    """Refuse, before any work, a placement reading table files for a model whose spec writes none."""
    entry = PLACEMENTS.get(backend) if isinstance(backend, str) else None
    if entry is not None and entry.reads_file and not spec.table_files:
        writers = sorted(t for t, sp in SPECS.items() if sp.table_files)
        raise ValueError(f"backend={backend!r} serves table files, which uvaple writes for the PLE tables of "
                         f"{writers}; this model's ({model_type or spec.attr}) is served from host memory: use 'uva'")


def _spec_for(model: nn.Module | None, model_type: str | None) -> PleSpec:
    if model_type is None:
        if model is None:
            raise ValueError("apply_uvaple needs a model or a model_type (one of "
                             f"{supported_model_types()})")
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SPECS:
        raise ValueError(f"no uvaple PLE spec for model_type {model_type!r}; supported: "
                         f"{supported_model_types()}. Add a PleSpec to uvaple.integration.models.hf.SPECS")
    return SPECS[model_type]


class UvaplePatch:
    """What :func:`apply_uvaple` changed; ``revert()`` (or leaving a ``with`` block) undoes it.

    ``modules`` lists the :class:`HostScaledEmbedding` modules swapped into a live model.
    """

    def __init__(self, kind: str):
        self.kind = kind  # "model" or "class"
        self.modules: list[HostScaledEmbedding] = []
        self._undo: list[Callable[[], None]] = []
        self.reverted = False

    def revert(self) -> None:
        """Undo the patch (idempotent). A live model gets its original modules back with their table. Every step
        is tried: one that fails (a table file that cannot be read back) leaves its module in place, and the first
        such error is raised once the others are undone."""
        if self.reverted:
            return
        self.reverted = True
        first = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as e:  # the other modules are still given back
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> UvaplePatch:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()

    def __repr__(self) -> str:
        state = "reverted" if self.reverted else "active"
        return f"UvaplePatch({self.kind}, {len(self.modules)} module(s), {state})"


def apply_uvaple(model: nn.Module | None = None, *, model_type: str | None = None, backend: str = "uva",
                 oob: str | None = None, backend_options: dict | None = None,
                 register="auto", max_tokens: int | None = None) -> UvaplePatch:
    """Put a PLE model's per-layer embedding table in host memory.

    Parameters
    ----------
    model : nn.Module, optional
        A live model: its PLE modules are replaced by :class:`HostScaledEmbedding` (table copied to a
        host table, the original table freed). Without a model the owner class is patched instead, so
        models built afterwards create the host-table module directly (until ``revert()``).
    model_type : str, optional
        ``config.model_type`` (default: ``model.config.model_type``); see :data:`SPECS`.
    backend : {"uva", "device", "copy", "disk"}
        How rows are read (``disk``: the model's spec writes table files, :attr:`PleSpec.table_files`).
    oob : {"row0", "zero"}, optional
        Rule for ids outside the table (default: the spec's, i.e. what transformers does).
    backend_options : dict, optional
        Passed to ``make_lookup``.
    register : bool or "auto"
        ``HostTable`` registration (``auto``: when CUDA is usable).
    max_tokens : int, optional
        Most ids per forward: the modules write into a preallocated output (no allocation per step).
    """
    spec = _spec_for(model, model_type)
    _check_backend(spec, model_type or getattr(getattr(model, "config", None), "model_type", None), backend)
    if model is None and backend in PLACEMENTS and PLACEMENTS[backend].reads_file:
        raise ValueError(f"backend={backend!r} is not served by the class patch: transformers' loader would build "
                         "each table whole in memory first. Load the model with its loader (for Qwen4Exp "
                         f"load_qwen4_exp_with_host_ple(path, backend={backend!r}, ...), which writes the table files "
                         "from the checkpoint's shards block by block), or apply it to a built model (model=...)")
    opts = dict(backend=backend, oob=oob or spec.oob, backend_options=backend_options, register=register,
                max_tokens=max_tokens)
    if model is not None:
        return _swap_live(model, spec, opts)
    return _patch_class(spec, opts)


# ---------------------------------------------------------------------- live model
def _swap_live(model: nn.Module, spec: PleSpec, opts: dict) -> UvaplePatch:
    if spec.replacement is not None:
        return _swap_replacement(model, spec, opts)
    module_class = _resolve(spec.module_class)
    patch = UvaplePatch("model")
    targets = [(parent, name, child)
               for parent in model.modules()
               for name, child in parent.named_children()
               if name == spec.attr and isinstance(child, module_class)]
    if not targets:
        _no_targets(model, spec, module_class, HostScaledEmbedding)
    for parent, name, child in targets:
        weight = child.weight
        device, dtype = weight.device, weight.dtype
        new = HostScaledEmbedding.from_embedding(child, **opts)
        if device.type == "cuda":
            new._lookup_for(device)  # build now, not inside a compiled / captured forward
        setattr(parent, name, new)
        # Free the original table wherever it lived; revert() copies it back from the host table.
        weight.data = torch.empty(0, dtype=dtype, device=device)
        patch.modules.append(new)

        def undo(parent=parent, name=name, child=child, new=new, device=device, dtype=dtype):
            if getattr(parent, name) is new:
                child.weight.data = new.weight.to(device=device, dtype=dtype, copy=True)
                setattr(parent, name, child)
            new.close()

        patch._undo.append(undo)
    return patch


def _no_targets(model: nn.Module, spec: PleSpec, module_class, drop_in) -> None:
    """The error of a live model with no PLE module left to swap: none at all, or uvaple's drop-ins already."""
    if any(isinstance(m, drop_in) for m in model.modules()):
        raise ValueError(f"{type(model).__name__}'s {spec.attr!r} modules are uvaple's already (a patch applied "
                         "before, or a model built or loaded with uvaple): to serve them another way call each "
                         "module's set_backend(...), or revert() the patch that put them there and apply again")
    raise ValueError(f"{type(model).__name__} has no {spec.attr!r} module of type {module_class.__name__}")


def _swap_replacement(model: nn.Module, spec: PleSpec, opts: dict) -> UvaplePatch:
    """Replace every ``spec.attr`` module of ``module_class`` by the spec's drop-in (a subclass), built from it."""
    module_class, drop_in = _resolve(spec.module_class), _resolve(spec.replacement)()
    patch = UvaplePatch("model")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if name == spec.attr and isinstance(child, module_class) and not isinstance(child, drop_in)]
    if not targets:
        _no_targets(model, spec, module_class, drop_in)
    swapped = []  # (child, new, freed): the sources are freed once every module is swapped
    try:
        for parent, name, child in targets:
            new = drop_in.from_module(child, **opts)
            setattr(parent, name, new)
            state = [child, new, False]
            swapped.append(state)
            patch.modules.extend(new.host_embeddings())

            def undo(parent=parent, name=name, state=state):
                child, new, freed = state
                if getattr(parent, name) is new:
                    if freed:
                        new.restore_source(child)  # a failure here leaves the drop-in serving (revert() names it)
                    setattr(parent, name, child)
                new.close()

            patch._undo.append(undo)
    except BaseException:
        patch.revert()  # the modules swapped so far give way to the originals, their tables never freed
        raise
    for state in swapped:
        state[1].free_source(state[0])  # revert() copies the rows back from the host table (or file)
        state[2] = True
    return patch


# ---------------------------------------------------------------------- class-level patch
_build = threading.local()


def _stack() -> list:
    if not hasattr(_build, "stack"):
        _build.stack = []
    return _build.stack


@dataclass
class _BuildContext:
    spec: PleSpec
    config: object
    opts: dict
    want: dict
    meta_modules: list = field(default_factory=list)


_class_patches: dict[str, dict] = {}  # owner_class -> {"opts": options the patched __init__ uses}
_class_lock = threading.Lock()


def _patch_class(spec: PleSpec, opts: dict) -> UvaplePatch:
    if spec.replacement is not None:
        return _bind_replacement(spec, opts)
    owner = _resolve(spec.owner_class)
    module_class = _resolve(spec.module_class)
    patch = UvaplePatch("class")
    with _class_lock:
        if spec.owner_class in _class_patches:
            raise RuntimeError(f"{owner.__name__} is already patched by uvaple; revert() that patch first")
        owner_init, module_init = owner.__init__, module_class.__init__
        state = {"opts": opts}

        def patched_owner_init(self, config, *args, **kwargs):
            ctx = _BuildContext(spec, config, state["opts"], spec.ctor_args(config))
            _stack().append(ctx)
            try:
                owner_init(self, config, *args, **kwargs)
            finally:
                _stack().pop()
            emb = getattr(self, spec.attr, None)
            if emb is not None and any(emb is m for m in ctx.meta_modules):
                new = HostScaledEmbedding(emb.num_embeddings, emb.embedding_dim, emb.padding_idx,
                                          emb.scalar_embed_scale, dtype=emb.weight.dtype,
                                          init_std=spec.init_std(config), **ctx.opts)
                setattr(self, spec.attr, new)
            # Any other module built on meta by a coincidental match (same shape and scale) is made real.
            for m in ctx.meta_modules:
                if m is not emb:
                    raise RuntimeError(
                        f"uvaple: a {module_class.__name__} other than {spec.attr!r} matched the PLE "
                        "table's shape and scale; apply the patch to a built model instead (model=...)")

        def patched_module_init(self, *args, **kwargs):
            stack = _stack()
            ctx = stack[-1] if stack else None
            if ctx is not None and not ctx.meta_modules and _ctor_matches(ctx.want, args, kwargs):
                with torch.device("meta"):  # the drop-in replaces it right after the owner's __init__
                    module_init(self, *args, **kwargs)
                ctx.meta_modules.append(self)
                return
            module_init(self, *args, **kwargs)

        patched_owner_init.__wrapped__ = owner_init
        patched_module_init.__wrapped__ = module_init
        owner.__init__ = patched_owner_init
        module_class.__init__ = patched_module_init
        _class_patches[spec.owner_class] = state

    def undo():
        with _class_lock:
            owner.__init__ = owner_init
            module_class.__init__ = module_init
            _class_patches.pop(spec.owner_class, None)

    patch._undo.append(undo)
    return patch


def _bind_replacement(spec: PleSpec, opts: dict) -> UvaplePatch:
    """Bind ``module_class``'s name in its modeling module to a subclass of the drop-in that builds with
    ``opts`` (read at each construction from the patch's state), until ``revert()``."""
    where, _, name = spec.module_class.rpartition(".")
    modeling = importlib.import_module(where)
    patch = UvaplePatch("class")
    with _class_lock:
        if spec.owner_class in _class_patches:
            raise RuntimeError(f"{name} is already patched by uvaple; revert() that patch first")
        original = getattr(modeling, name)
        state = {"opts": opts}
        drop_in = _resolve(spec.replacement)()
        bound = type(drop_in.__name__, (drop_in,), {"_uvaple_state": state, "__module__": drop_in.__module__})
        setattr(modeling, name, bound)
        _class_patches[spec.owner_class] = state

    def undo():
        with _class_lock:
            if getattr(modeling, name) is bound:
                setattr(modeling, name, original)
            _class_patches.pop(spec.owner_class, None)

    patch._undo.append(undo)
    return patch


def _ctor_matches(want: dict, args: tuple, kwargs: dict) -> bool:
    names = ("num_embeddings", "embedding_dim", "padding_idx", "embed_scale")
    got = dict(zip(names, args, strict=False))
    got.update(kwargs)
    return all(k in got and got[k] == v for k, v in want.items())


# ---------------------------------------------------------------------- loading
def _checkpoint_keys(path: str) -> list[str]:
    from uvaple.uva.loading import checkpoint_files

    return list(checkpoint_files(path))


def _match_key(wanted: str, keys: list[str], attr: str) -> str:
    if wanted in keys:
        return wanted
    suffix = f"{attr}.weight"
    cands = [k for k in keys if k == suffix or k.endswith("." + suffix)]
    if len(cands) == 1:
        return cands[0]
    if not cands:
        raise KeyError(f"the checkpoint has no '*{suffix}' tensor (looked for {wanted!r})")

    def common(k: str) -> int:
        a, b = k.split(".")[::-1], wanted.split(".")[::-1]
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    best = max(cands, key=common)
    if sum(common(k) == common(best) for k in cands) > 1:
        raise KeyError(f"several checkpoint tensors could be {wanted!r}: {cands}")
    return best


class _IgnoreUnexpected:
    """Temporarily tell ``model_class.from_pretrained`` that the PLE key is expected to be skipped."""

    def __init__(self, model_class, patterns: tuple[str, ...]):
        self.cls, self.patterns = model_class, set(patterns)

    def __enter__(self):
        self.had = "_keys_to_ignore_on_load_unexpected" in self.cls.__dict__
        self.old = self.cls.__dict__.get("_keys_to_ignore_on_load_unexpected")
        cur = getattr(self.cls, "_keys_to_ignore_on_load_unexpected", None) or set()
        self.cls._keys_to_ignore_on_load_unexpected = set(cur) | self.patterns

    def __exit__(self, *exc):
        if self.had:
            self.cls._keys_to_ignore_on_load_unexpected = self.old
        else:
            del self.cls._keys_to_ignore_on_load_unexpected


def from_pretrained_with_host_tables(model_class, path, *, model_type: str | None = None,
                                     backend: str = "uva", oob: str | None = None,
                                     backend_options: dict | None = None, register="auto",
                                     max_tokens: int | None = None, **from_pretrained_kw):
    """``model_class.from_pretrained(path, ...)`` with every PLE table streamed into a host table.

    ``path`` is a local checkpoint directory (``model.safetensors`` or an index with shards) or one
    ``.safetensors`` file's directory. The PLE tensor is skipped by transformers' loader (so it is never
    placed on any device) and read by :meth:`HostTable.from_safetensors` instead.
    """
    from uvaple.uva import HostTable

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} is not a local checkpoint; download it first (e.g. "
                                "`hf download <repo> --local-dir DIR`; huggingface_hub before 1.0 names it "
                                "`huggingface-cli`)")
    if model_type is None:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            model_type = json.load(f).get("model_type")
    spec = _spec_for(None, model_type)
    _check_backend(spec, model_type, backend)
    opts = dict(backend=backend, oob=oob or spec.oob, backend_options=backend_options, register=register,
                max_tokens=max_tokens)
    # a loader checks the checkpoint and fills the tables first: a bad one fails before the GPU is touched
    tables = _resolve(spec.loader)(path, opts, from_pretrained_kw) if spec.loader is not None else None
    state = _class_patches.get(spec.owner_class)
    patch = _patch_class(spec, opts) if state is None else None
    saved = None if state is None else state["opts"]
    if state is not None:  # the user's class patch is active: build with this call's options
        state["opts"] = opts
    ignore = spec.checkpoint_keys or (rf"(^|\.){spec.attr}\.weight$",)
    try:
        with host_state_dict_excluded(), _IgnoreUnexpected(model_class, ignore):
            model = model_class.from_pretrained(path, **from_pretrained_kw)
        if tables is not None:
            tables.attach(model)
    except BaseException:
        if tables is not None:
            tables.close()  # tables already handed to modules are theirs: close() releases only the rest
        raise
    finally:
        if patch is not None:
            patch.revert()
        else:
            state["opts"] = saved
    if tables is not None:
        return model
    keys = _checkpoint_keys(path)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    for name, mod in model.named_modules():
        if isinstance(mod, HostScaledEmbedding) and not mod.materialized:
            key = _match_key(f"{name}.weight", keys, spec.attr)
            table = HostTable.from_safetensors(path, key, dtype=mod.table_dtype, register=register)
            mod.attach_table(table, own=True)
            if device.type == "cuda":
                mod._lookup_for(device)
            log.info("uvaple: %s.weight <- %s (%s) in host memory", name, key, table)
    return model

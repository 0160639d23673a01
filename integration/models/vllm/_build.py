"""Model construction with uvaple tables: the plugin's settings for one model, and the scoped class swap.

vLLM's model code picks its PLE layer classes by module-level names (``Qwen4ExpPLEDeviceEmbedding`` in the
Qwen4Exp n-gram module, ``VocabParallelEmbedding`` in ``gemma3n``). The plugin's model classes construct
their vLLM parent with those names bound to uvaple's layer for the duration of ``__init__`` only, under a
lock, and restore them in ``finally``: other models, built before, after or by another path, see vLLM's
classes unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from uvaple.integration.factory import placement

from .config import PluginConfig, check_engine, from_sources
from .disk_shard import DiskShard
from .tables import ShardTable, model_identity

_BUILD_LOCK = threading.RLock()
UNSET: str = "\0unset"  # an omitted ``prefix`` argument (the parent class's default applies)
_state = threading.local()


@dataclass(frozen=True)
class BuildContext:
    """What a uvaple layer needs from the model being built."""

    cfg: PluginConfig
    identity: str
    device: torch.device
    check_loaded: bool
    max_tokens: int
    cuda_graphs: bool = False  # the engine captures its forward in CUDA graphs (our calls among it)


def plugin_config(vllm_config) -> PluginConfig | None:
    """The plugin's settings for this engine (None: not enabled, build vLLM's model as is)."""
    return from_sources(getattr(vllm_config, "additional_config", None) or {})


def _device(vllm_config) -> torch.device:
    dev = torch.device(vllm_config.device_config.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cuda_graphs(vllm_config) -> bool:
    """Whether vLLM captures the model's forward in CUDA graphs: its ``cudagraph_mode`` (final once the engine
    has resolved ``enforce_eager`` and the platform's limits) is not NONE. Piecewise graphs count: they leave
    out attention only, and the PLE lookups are captured with the rest."""
    mc = getattr(vllm_config, "model_config", None)
    if getattr(mc, "enforce_eager", False):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", mode) != "NONE"


def context_for(vllm_config, cfg: PluginConfig, graphs: bool) -> BuildContext:
    mc = vllm_config.model_config
    return BuildContext(
        cfg=cfg,
        identity=model_identity(mc.model, getattr(mc, "revision", None), mc.dtype, getattr(mc, "quantization", None)),
        device=_device(vllm_config),
        check_loaded=str(getattr(vllm_config.load_config, "load_format", "auto")) != "dummy",
        max_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        cuda_graphs=graphs,
    )


def shard_table(cfg: PluginConfig, **kw) -> ShardTable:
    """The shard of the configured placement: a :class:`~uvaple.integration.models.vllm.tables.ShardTable` in host
    memory, or for a placement that reads table files a
    :class:`~uvaple.integration.models.vllm.disk_shard.DiskShard` (``kw``: ShardTable's)."""
    return DiskShard(cfg, **kw) if placement(cfg.placement).reads_file else ShardTable(cfg, **kw)


def current() -> BuildContext:
    """The context of the model being built (a uvaple layer outside a plugin build is an error)."""
    ctx = getattr(_state, "ctx", None)
    if ctx is None:
        raise RuntimeError("uvaple's vLLM layers are built by the plugin's model classes (enable the plugin "
                           'with --additional-config \'{"uvaple": {}}\'), not on their own')
    return ctx


@contextlib.contextmanager
def building(ctx: BuildContext, swaps: list[tuple[object, str, object]]) -> Iterator[None]:
    """Within: ``current()`` is ``ctx`` and each ``(module, name, replacement)`` is bound; restored after."""
    with _BUILD_LOCK:
        saved = [(m, n, getattr(m, n)) for m, n, _ in swaps]
        prev = getattr(_state, "ctx", None)
        _state.ctx = ctx
        try:
            for m, n, r in swaps:
                setattr(m, n, r)
            yield
        finally:
            for m, n, v in reversed(saved):
                setattr(m, n, v)
            _state.ctx = prev


class PluginModel:
    """Mixin of the plugin's model classes (before vLLM's class in the bases).

    Construction: vLLM's model exactly when the plugin is not enabled; else the parent is built inside
    :func:`building` with the subclass's ``_uvaple_swaps()`` (a subclass must define it: checked when the
    class is made), after :func:`~uvaple.integration.models.vllm.config.check_engine` (the settings against the
    engine's mode) and ``_uvaple_refuse(cfg)`` have had their say. After vLLM's own
    ``process_weights_after_loading`` (if the parent has one), every uvaple shard of the model is
    finished (:func:`finish_all`).
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if not callable(getattr(cls, "_uvaple_swaps", None)):
            raise TypeError(f"{cls.__name__} must define _uvaple_swaps(): the module names its model's PLE "
                            "layers are picked by")

    @staticmethod
    def _uvaple_refuse(cfg) -> None:
        """Raise a named error where this model cannot be served by the plugin (default: never)."""

    # vLLM passes (vllm_config=, prefix=) by name when the signature names both; an omitted prefix keeps
    # the parent's own default
    def __init__(self, *, vllm_config, prefix: str = UNSET) -> None:
        kw = {} if prefix is UNSET else {"prefix": prefix}
        cfg = plugin_config(vllm_config)
        if cfg is None:  # not enabled: vLLM's model exactly
            super().__init__(vllm_config=vllm_config, **kw)
            return
        graphs = cuda_graphs(vllm_config)
        check_engine(cfg, cuda_graphs=graphs)
        self._uvaple_refuse(cfg)
        with building(context_for(vllm_config, cfg, graphs), self._uvaple_swaps()):
            super().__init__(vllm_config=vllm_config, **kw)

    def process_weights_after_loading(self) -> None:
        parent = getattr(super(), "process_weights_after_loading", None)
        if callable(parent):
            parent()
        finish_all(self)


def finish_all(model: torch.nn.Module) -> None:
    """After weight loading: every uvaple layer's shard is marked ready (creator) or waited for (attacher),
    and its lookup is built."""
    for module in model.modules():
        for owner in (module, getattr(module, "quant_method", None)):
            finish = getattr(owner, "uvaple_finish_loading", None)
            if callable(finish):
                finish(module)

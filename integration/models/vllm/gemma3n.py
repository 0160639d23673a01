"""Gemma 3n: ``embed_tokens_per_layer`` (``vocab_size_per_layer_input`` x ``layers * 256``) in uvaple host memory.

While the plugin's model classes build their vLLM parent, the ``VocabParallelEmbedding`` of the layer
whose prefix ends in ``per_layer_embed_tokens`` gets :class:`UvapleEmbeddingMethod` as its quantisation
method. The layer itself stays vLLM's: its TP sharding, id masking, all-reduce, parameter name and
loader contract are unchanged, and so are ``get_per_layer_input_embeddings`` (ids < 0 or >= the per-layer
vocabulary read row 0, then ``* embed_scale_per_layer``) and ``Gemma3nForConditionalGeneration.
embed_input_ids`` (the rows copied into its preallocated buffer). The method stores the rank's shard as
a :class:`~uvaple.integration.models.vllm.tables.ShardTable` (one copy per node) and ``embedding()`` reads it
with ``uvaple::gather_rows`` in the model's stream. It is not an ``UnquantizedEmbeddingMethod``, so vLLM's
fused CUDA embedding, which reads the weight as a device tensor, is never chosen for it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
from vllm.model_executor.models.gemma3n import Gemma3nForCausalLM
from vllm.model_executor.models.gemma3n_mm import Gemma3nForConditionalGeneration
from vllm.model_executor.utils import set_weight_attrs

from uvaple.integration.spec import TableSpec

from . import _build
from .config import PluginConfigError
from .tables import PluginLoadError, ShardTable

__all__ = ["UvapleEmbeddingMethod", "UvapleGemma3nForCausalLM", "UvapleGemma3nForConditionalGeneration",
           "PLE_PREFIX_SUFFIX"]

#: the prefix vLLM's Gemma 3n gives its per-layer embedding
PLE_PREFIX_SUFFIX = "per_layer_embed_tokens"


class UvapleEmbeddingMethod(QuantizeMethodBase):
    """An unquantised embedding whose weight is a uvaple host table (see the module docstring)."""

    # the table is host memory by design: vLLM must not move it to the GPU to post-process it
    requires_device_loading = False

    def __init__(self, ctx: _build.BuildContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.shard: ShardTable | None = None
        self.lookup = None

    def create_weights(self, layer: VocabParallelEmbedding, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        si = layer.shard_indices
        if si.added_vocab_end_index != si.added_vocab_start_index:
            raise PluginConfigError(f"{layer.prefix}: uvaple serves PLE tables without added vocabulary rows")
        rows = sum(output_partition_sizes)
        self.shard = _build.shard_table(self.ctx.cfg, layer=layer.prefix, rows=rows, cols=input_size_per_partition,
                                dtype=params_dtype, loaded_rows=si.org_vocab_end_index - si.org_vocab_start_index,
                                rank=layer.tp_rank, size=layer.tp_size, identity=self.ctx.identity,
                                device=self.ctx.device, check_loaded=self.ctx.check_loaded)
        weight = torch.nn.Parameter(self.shard.tensor, requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        extra = dict(extra_weight_attrs, weight_loader=self._loader_for(layer))
        set_weight_attrs(weight, extra)
        layer.register_parameter("weight", weight)

    def _loader_for(self, layer: VocabParallelEmbedding):
        shard = self.shard

        def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
            # VocabParallelEmbedding.weight_loader's rows: this rank's part of the original vocabulary
            if loaded_weight.dim() != 2 or loaded_weight.shape[0] != layer.org_vocab_size:
                raise PluginLoadError(f"{layer.prefix}: the checkpoint's table has shape {tuple(loaded_weight.shape)}"
                                      f", this layer expects [{layer.org_vocab_size}, {layer.embedding_dim}]")
            if not loaded_weight.dtype.is_floating_point or loaded_weight.element_size() < 2:
                raise PluginLoadError(f"{layer.prefix}: the checkpoint stores this table as {loaded_weight.dtype}; "
                                      "uvaple serves Gemma 3n's PLE table from bf16/fp16/fp32 weights")
            start = layer.shard_indices.org_vocab_start_index
            count = layer.shard_indices.org_vocab_end_index - start
            shard.write(loaded_weight.narrow(0, start, count), 0)

        return weight_loader

    def uvaple_finish_loading(self, layer: VocabParallelEmbedding) -> None:
        """After loading: the shard is ready (or waited for) and the lookup built. Idempotent."""
        if self.lookup is not None:
            return
        self.shard.finish()
        self.lookup = self.shard.lookup(TableSpec.of(self.shard.table), max_rows=self.ctx.max_tokens,
                                        id_start=layer.shard_indices.org_vocab_start_index)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.uvaple_finish_loading(layer)

    def apply(self, layer, x, bias=None):
        # QuantizeMethodBase.apply is what a tied LM head calls (x @ weight.T); a per-layer-embedding table is
        # never one, and this one lives in host memory: say so instead of computing over it
        name = getattr(layer, "prefix", "the per-layer-embedding table")
        raise RuntimeError(f"{name}: uvaple serves this per-layer-embedding table for lookups only; it cannot "
                           "be used as a linear layer (a tied LM head). Serve this model without the uvaple "
                           "plugin if it ties its per-layer table to a head")

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight)`` for local ids (vLLM masked them to this rank's shard already)."""
        if self.lookup is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{layer.prefix}: the uvaple table was not finished before CUDA-graph capture")
            self.uvaple_finish_loading(layer)
        return self.lookup.lookup(input_)


def _ple_embedding(*args, **kwargs):
    """``VocabParallelEmbedding(...)`` in ``gemma3n`` during a plugin build: the PLE layer gets the uvaple method."""
    if str(kwargs.get("prefix", "")).endswith(PLE_PREFIX_SUFFIX):
        quant_config = kwargs.pop("quant_config", None)
        if quant_config is not None:
            _refuse_quantised(quant_config, kwargs["prefix"])
        kwargs["quant_method"] = UvapleEmbeddingMethod(_build.current())
    return VocabParallelEmbedding(*args, **kwargs)


def _refuse_quantised(quant_config, prefix: str) -> None:
    """A quantisation config that would quantise this embedding is refused (uvaple serves it unquantised)."""
    get = getattr(quant_config, "get_quant_method", None)
    try:  # what get_quant_method inspects is the layer's type and its prefix: an unbuilt layer will do
        method = get(VocabParallelEmbedding.__new__(VocabParallelEmbedding), prefix) if get else None
    except Exception:  # noqa: BLE001 - a config that needs a built layer: the loader's dtype check decides
        method = None
    if method is not None and not isinstance(method, UnquantizedEmbeddingMethod):
        raise PluginConfigError(f"{prefix}: the {type(quant_config).__name__} config quantises this embedding "
                                f"({type(method).__name__}); uvaple serves Gemma 3n's PLE table unquantised")


def _swaps():
    import vllm.model_executor.models.gemma3n as gemma3n

    return [(gemma3n, "VocabParallelEmbedding", _ple_embedding)]


class _UvapleGemma3nMixin(_build.PluginModel):
    _uvaple_swaps = staticmethod(_swaps)

    @staticmethod
    def _uvaple_refuse(cfg) -> None:
        if cfg.quantize != "none":
            raise PluginConfigError(f"quantize {cfg.quantize!r}: the plugin quantises Qwen4Exp's n-gram tables; Gemma "
                                    "3n's per-layer table is served as the checkpoint stores it (bf16): set quantize "
                                    "'none' (its levers are dedup and the hot set)")


class UvapleGemma3nForCausalLM(_UvapleGemma3nMixin, Gemma3nForCausalLM):
    """vLLM's ``Gemma3nForCausalLM`` with ``embed_tokens_per_layer`` in uvaple host memory when enabled."""


class UvapleGemma3nForConditionalGeneration(_UvapleGemma3nMixin, Gemma3nForConditionalGeneration):
    """vLLM's ``Gemma3nForConditionalGeneration`` with ``embed_tokens_per_layer`` in uvaple host memory."""

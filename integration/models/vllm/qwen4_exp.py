"""Qwen4Exp (the n-gram PLE model): its per-layer n-gram table in uvaple host memory.

:class:`UvaplePLEEmbedding` takes the place of vLLM's ``Qwen4ExpPLEDeviceEmbedding`` (and of
``Qwen4ExpPLEPinnedHostEmbedding`` when ``engram_config.cpu_offload`` is set) while the plugin's model
classes build their vLLM parent. It is vLLM's ``Qwen4ExpPLEEmbedding``: the same ETP sharding, parameter
names, quantisation methods (unquantised, fp8 with one global scale) and checkpoint-shard loader; only
the storage and the lookup differ.

* Storage: the rank's padded vocabulary shard as a :class:`~uvaple.integration.models.vllm.tables.ShardTable`,
  exact size, never on the GPU, one copy per node. The ``weight`` parameter is its CPU tensor.
* Lookup: ``uvaple::gather_rows`` in the model's stream, with global ids (``id_offset`` is the shard's
  first id, ids of other shards give zero rows), then vLLM's data-parallel id gather, ETP all-reduce and
  slot selection, unchanged. No side stream and no prefetch: the call is captured in vLLM's CUDA graphs
  like any other op, so ``eager_break_during_capture`` and its graph break are gone.
* ``quantize: fp8_row`` (bf16/fp16 checkpoints): the shard is stored as fp8 codes and a scale per row,
  quantised as vLLM's loader hands the rows over (:class:`~uvaple.integration.models.vllm.tables.ShardTable`), and
  the kernel returns ``params_dtype`` rows (codes x their row's scale); vLLM's unquantised method then has
  nothing left to do. At ETP > 1 the rows of other shards are -0.0, as below.
* fp8: the kernel dequantises with vLLM's formula ``rows.to(dtype) * weight_scale.to(dtype)`` (the scale
  parameter is read on the device at every call), and ``dequantize()`` returns the rows as they are. At
  ETP > 1 the rows of other shards are -0.0: ``x + (-0.0) == x`` for every ``x``, so the sum over ranks
  has the owner's bits, as vLLM's sum of fp8 codes followed by the dequantisation has. (The collective
  then carries bf16 rather than fp8 bytes.) The ``copy`` placement returns fp8 rows and leaves the
  dequantisation to vLLM's method.

Ids outside the table (vLLM's device table faults on them) give zero rows.
"""

from __future__ import annotations

import torch
from vllm.models.qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLEUnquantizedEmbeddingMethod,
)

from uvaple.integration.factory import placement
from uvaple.integration.spec import TableSpec

from . import _build
from .config import PluginConfigError

__all__ = ["UvaplePLEEmbedding", "UvapleQwen4ExpForCausalLM", "UvapleQwen4ExpForConditionalGeneration"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class UvaplePLEEmbedding(Qwen4ExpPLEEmbedding):
    """vLLM's ETP-sharded Qwen4Exp PLE table, stored in uvaple host memory (see the module docstring)."""

    supports_prefetch = False

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype, padding_size: int,
                 prefix: str, embedding_method, num_ngram_heads: int = 1, max_total_tokens: int = 0,
                 data_parallel_rank: int = 0, reduce_results: bool = True) -> None:
        if not isinstance(embedding_method, (Qwen4ExpPLEUnquantizedEmbeddingMethod, Qwen4ExpPLEFp8EmbeddingMethod)):
            raise PluginConfigError(f"{prefix}: uvaple serves unquantised and fp8 (global scale) PLE tables; "
                                    f"{type(embedding_method).__name__} is not supported yet. Serve this model "
                                    "without the uvaple plugin")
        ctx = _build.current()
        if ctx.cfg.quantize == "fp8_row" and not isinstance(embedding_method, Qwen4ExpPLEUnquantizedEmbeddingMethod):
            raise PluginConfigError(f"{prefix}: quantize fp8_row quantises a bf16/fp16 table on load; this checkpoint "
                                    f"stores it with {type(embedding_method).__name__} already: set quantize 'none' "
                                    "to serve it as stored")
        super().__init__(num_embeddings, embedding_dim, params_dtype=params_dtype, padding_size=padding_size,
                         prefix=prefix, embedding_method=embedding_method, num_ngram_heads=num_ngram_heads,
                         max_total_tokens=max_total_tokens, data_parallel_rank=data_parallel_rank,
                         reduce_results=reduce_results)
        # ids per call: every token's heads, over the data-parallel ranks that share this ETP group
        self._uvaple_max_rows = max(1, (max_total_tokens or ctx.max_tokens) * num_ngram_heads
                                    * self.etp_data_parallel_size)
        self._uvaple_lookup = None
        self._uvaple_dequant = False
        if self._uvaple_shard.encoding == "fp8_row":  # vLLM's dummy loader: one code, no fp16 temporary
            from .tables import DUMMY_CODE

            self.weight.dummy_weight_value = DUMMY_CODE

    # ------------------------------------------------------------------ storage and loading
    def allocate_embedding_weight(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The rank's shard as a host table (called by the embedding method's ``create_weights``)."""
        ctx = _build.current()
        si = self.shard_indices
        shard = _build.shard_table(ctx.cfg, layer=self.prefix, rows=num_embeddings, cols=embedding_dim, dtype=dtype,
                           loaded_rows=si.org_vocab_end_index - si.org_vocab_start_index, rank=self.tp_rank,
                           size=self.tp_size, identity=ctx.identity, device=ctx.device,
                           check_loaded=ctx.check_loaded, cuda_graphs=ctx.cuda_graphs,
                           encoding="fp8_row" if ctx.cfg.quantize == "fp8_row" else "raw")
        self._uvaple_shard = shard
        return shard.tensor

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, checkpoint_start: int | None = None):
        """vLLM's loader for this layer; the table's rows go straight into the shard (scales as vLLM loads
        them)."""
        shard = self.__dict__.get("_uvaple_shard")
        if shard is None or param is not self._parameters.get("weight"):
            return super().weight_loader(param, loaded_weight, checkpoint_start)
        if checkpoint_start is None:  # the whole table: this rank's rows, as VocabParallelEmbedding narrows
            start = self.shard_indices.org_vocab_start_index
            count = self.shard_indices.org_vocab_end_index - start
            if loaded_weight.dim() != 2 or loaded_weight.shape[0] != self.org_vocab_size:
                raise_shape(self.prefix, loaded_weight, f"[{self.org_vocab_size}, {self.embedding_dim}]")
            shard.write(loaded_weight.narrow(0, start, count), 0)
            return
        overlap = self._compute_shard_overlap(checkpoint_start=checkpoint_start,
                                              checkpoint_rows=loaded_weight.shape[0])
        if overlap is not None:
            shard.write(loaded_weight.narrow(0, overlap.source_start, overlap.row_count),
                        overlap.destination_start)

    def uvaple_finish_loading(self, module=None) -> None:
        """After loading: the shard is ready (or waited for), and the lookup is built. Idempotent."""
        if self._uvaple_lookup is not None:
            return
        shard = self._uvaple_shard
        shard.finish()
        si = self.shard_indices
        start, count = si.org_vocab_start_index, si.org_vocab_end_index - si.org_vocab_start_index
        # how the kernel reads the rows: quantised on load (each row's scale), an fp8 checkpoint (the global scale
        # parameter; a placement that reads rows as stored, the copy one, leaves it to vLLM's method), or as stored
        if shard.encoding == "fp8_row":
            encoding = "fp8_row"
        elif self.weight.dtype in _FP8 and placement(shard.placement).reads("fp8_global"):
            encoding = "fp8_global"
        else:
            encoding = "raw"
        dequant = encoding != "raw"
        spec = TableSpec.of(shard.table, row_window=(0, count), id_offset=start, encoding=encoding,
                            out_dtype=self.params_dtype if dequant else None,
                            oob="neg_zero" if dequant and self.tp_size > 1 else "zero")
        scale = None
        if encoding == "fp8_global":
            scale = self.weight_scale.data.reshape(1)
            if scale.device != shard.device or scale.dtype != torch.float32:
                raise PluginConfigError(f"{self.prefix}: the fp8 scale is a {scale.dtype} on {scale.device}; the "
                                        f"lookup runs on {shard.device} and reads a float32 scale there")
        self._uvaple_dequant = dequant
        self._uvaple_lookup = shard.lookup(spec, dequant_scale=scale, max_rows=self._uvaple_max_rows, token_ids=False)

    # ------------------------------------------------------------------ lookup
    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """No prefetch: the lookup runs in the model's stream at ``forward``."""
        return None

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        raise RuntimeError("uvaple's PLE embedding has no prefetch; call it directly")

    def forward(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``[tokens, heads]`` n-gram ids: ``[tokens, heads, dim]``, as vLLM's device table gives."""
        lookup = self._uvaple_lookup
        if lookup is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.prefix}: the uvaple table was not finished before CUDA-graph capture; "
                                   "the plugin's model class finishes it after weight loading")
            self.uvaple_finish_loading()
            lookup = self._uvaple_lookup
        slot_size, slot_offset = self._get_dp_gather_slot(ngram_ids.shape[0])
        ids = self._gather_dp_ids(ngram_ids, slot_size)
        rows = lookup.lookup(ids)
        if self.reduce_results and self.tp_size > 1:
            if rows.dtype in _FP8:  # each row has one owner: the fp8 bytes sum exactly as int8
                rows = self.parallel_group.all_reduce(rows.view(torch.int8)).view(rows.dtype)
            else:
                rows = self.parallel_group.all_reduce(rows)
        return self._select_embeddings(rows, ngram_ids.shape[0], slot_offset)

    def dequantize(self, embeddings: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        """Rows in ``output_dtype``: dequantised already by the kernel, or by vLLM's method (copy placement)."""
        if not self._uvaple_dequant:
            return super().dequantize(embeddings, output_dtype)
        if output_dtype != embeddings.dtype:
            raise RuntimeError(f"{self.prefix}: rows were dequantised to {embeddings.dtype}, asked for "
                               f"{output_dtype}; vLLM's formula rounds in the output dtype, so this would differ")
        return embeddings

    def extra_repr(self) -> str:
        shard = self.__dict__.get("_uvaple_shard")
        where = f", uvaple={shard.placement}:{shard.name or 'private'}" if shard is not None else ""
        return super().extra_repr() + where


def raise_shape(prefix: str, got: torch.Tensor, want: str):
    from .tables import PluginLoadError

    raise PluginLoadError(f"{prefix}: the checkpoint's table has shape {tuple(got.shape)}, this layer expects {want}")


def _swaps():
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as ngram

    return [(ngram, "Qwen4ExpPLEDeviceEmbedding", UvaplePLEEmbedding),
            (ngram, "Qwen4ExpPLEPinnedHostEmbedding", UvaplePLEEmbedding)]


class _UvapleQwen4ExpMixin(_build.PluginModel):
    _uvaple_swaps = staticmethod(_swaps)

    @staticmethod
    def _uvaple_refuse(cfg) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_rocm():
            raise PluginConfigError("uvaple's Qwen4Exp tables run on CUDA (vLLM's ROCm Qwen4Exp builds its PLE "
                                    "layers elsewhere); serve this model without the uvaple plugin on ROCm")


class UvapleQwen4ExpForCausalLM(_UvapleQwen4ExpMixin, Qwen4ExpForCausalLM):
    """vLLM's ``Qwen4ExpForCausalLM`` with its n-gram PLE tables in uvaple host memory when enabled."""


class UvapleQwen4ExpForConditionalGeneration(_UvapleQwen4ExpMixin, Qwen4ExpForConditionalGeneration):
    """vLLM's ``Qwen4ExpForConditionalGeneration`` with uvaple PLE tables when enabled."""

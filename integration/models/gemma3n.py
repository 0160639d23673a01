"""Gemma 3n with its per-layer embedding (PLE) table in host memory: the HF transformers entry points.

``embed_tokens_per_layer`` (vocab 262,144 x num_layers * 256; 3.75 GiB for E2B, 4.4 GiB for E4B in bf16)
becomes a :class:`~uvaple.integration.embedding.HostScaledEmbedding`: the table in a
:class:`~uvaple.uva.HostTable`, rows gathered in the model's stream. What matches HF bit for bit and
why is in that module's docstring; the patching machinery (keyed by ``config.model_type``) is
:mod:`uvaple.integration.models.hf`.
"""

from __future__ import annotations

from torch import nn

from ..embedding import HostScaledEmbedding
from .hf import apply_uvaple, from_pretrained_with_host_tables

__all__ = ["HostScaledEmbedding", "apply_uvaple_to_gemma3n", "revert_uvaple_to_gemma3n", "load_gemma3n_with_host_ple"]


def apply_uvaple_to_gemma3n(model: nn.Module | None = None, *, backend: str = "uva", oob: str = "row0",
                            backend_options: dict | None = None, register="auto", max_tokens: int | None = None):
    """Put Gemma 3n's ``embed_tokens_per_layer`` table in host memory.

    With ``model``: swap every ``embed_tokens_per_layer`` module of the live model for a
    :class:`HostScaledEmbedding` holding a host copy of its table and free the original table (GPU or
    CPU). Without: patch ``Gemma3nTextModel`` so models built afterwards create the drop-in directly and
    never allocate the table as a parameter. Returns a :class:`uvaple.integration.models.hf.UvaplePatch`
    (``revert()``, context manager). ``max_tokens``: the modules write into a static output of that many
    rows (see :mod:`uvaple.integration.embedding`).
    """
    return apply_uvaple(model, model_type="gemma3n", backend=backend, oob=oob,
                        backend_options=backend_options, register=register, max_tokens=max_tokens)


def revert_uvaple_to_gemma3n(handle) -> None:
    """Undo :func:`apply_uvaple_to_gemma3n` (same as ``handle.revert()``)."""
    handle.revert()


def load_gemma3n_with_host_ple(path, *, model_class=None, backend: str = "uva", oob: str = "row0",
                               backend_options: dict | None = None, register="auto", **from_pretrained_kw):
    """``from_pretrained`` a local Gemma 3n checkpoint with the PLE table streamed into host memory.

    The model is built with the class patch (the table never becomes a parameter), transformers loads
    every other tensor as usual (``device_map=``, ``dtype=`` ... pass through), and the table is read
    from the safetensors shard(s) straight into a :class:`HostTable`; it never touches the GPU.

    ``model_class`` defaults to ``Gemma3nForCausalLM`` (``Gemma3nForConditionalGeneration`` works too).
    """
    if model_class is None:
        from transformers import Gemma3nForCausalLM as model_class
    return from_pretrained_with_host_tables(model_class, path, model_type="gemma3n", backend=backend,
                                            oob=oob, backend_options=backend_options, register=register,
                                            **from_pretrained_kw)

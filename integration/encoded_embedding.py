"""An embedding over a host table stored encoded: fp8 codes, served as values of the model's dtype.

:class:`HostEncodedEmbedding` is a :class:`~uvaple.integration.embedding.HostScaledEmbedding` (same module
API: lookups per device, ``max_tokens``, the placements' options, ``close()``) whose table is not rows of the
model's dtype but one of the registry's encodings (:mod:`uvaple.kernels.encodings`):

* ``fp8_global``: ``[rows, dim]`` fp8 codes and one float32 ``weight_scale`` (a buffer), returned as
  ``codes.to(dtype) * weight_scale.to(dtype)``: transformers' ``FP8Embedding`` layout and formula (its scale
  is loaded in the model's dtype), so a checkpoint quantised that way is served as stored. The state dict
  carries ``weight`` (the codes) and ``weight_scale``, as transformers' module does.
* ``fp8_row``: ``[rows, dim + 4]``, each row its codes then its float32 scale (quantised on load from a
  checkpoint's shards with no table of the source dtype: :mod:`uvaple.integration.models.ngram_tables`). A serving
  copy only: the state dict has no ``weight`` for it (save from the source checkpoint), and its
  :attr:`quant_error` is the quantiser's report.

The ``copy`` placement and ``backend_options["quantize"]`` are refused: the rows are encoded already.
"""

from __future__ import annotations

import torch
from torch import nn

from uvaple.kernels.encodings import ENCODINGS, FP8_FORMATS, ROW_SCALE_BYTES
from uvaple.uva import HostTable

from .embedding import BACKENDS, HOST_BACKENDS, HostScaledEmbedding
from .factory import placement
from .spec import TableSpec

__all__ = ["HostEncodedEmbedding", "ENCODED"]

#: the encodings a :class:`HostEncodedEmbedding` serves, and the columns of its table for ``dim`` values
ENCODED = {"fp8_global": lambda dim: dim, "fp8_row": lambda dim: dim + ROW_SCALE_BYTES}


class HostEncodedEmbedding(HostScaledEmbedding):
    """An embedding whose host table holds fp8 codes (see the module docstring).

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        The values a lookup returns: ``[num_embeddings, embedding_dim]``.
    table : HostTable
        fp8 codes, ``[num_embeddings, embedding_dim]`` (``fp8_global``) or ``[.., embedding_dim + 4]`` (``fp8_row``).
    encoding : {"fp8_global", "fp8_row"}
    out_dtype : torch.dtype
        The model's dtype (follows ``model.to(dtype)``).
    weight_scale : tensor, optional
        ``fp8_global``: the table's scale (one value).
    quant_error : QuantError, optional
        ``fp8_row``: the report of the quantisation that made the table.
    own_table : bool
        Whether :meth:`close` releases ``table`` (default True).
    backend, oob, backend_options, register, max_tokens :
        As for :class:`HostScaledEmbedding` (``backend`` ``uva`` or ``device``).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, table: HostTable, *, encoding: str,
                 out_dtype: torch.dtype, weight_scale: torch.Tensor | None = None, quant_error=None,
                 own_table: bool = True, backend: str = "uva", oob: str = "zero", backend_options: dict | None = None,
                 register="auto", max_tokens: int | None = None):
        if encoding not in ENCODED:
            raise ValueError(f"encoding must be one of {sorted(ENCODED)}, got {encoding!r}")
        if backend in BACKENDS and not placement(backend).reads(encoding):  # (another name: refused below)
            readers = [name for name in HOST_BACKENDS if placement(name).reads(encoding)]
            raise ValueError(f"the {backend} placement reads rows as stored; an {encoding} table is served by "
                             f"{readers}")
        if (backend_options or {}).get("quantize") is not None:
            raise ValueError(f"this table is {encoding} already: drop backend_options['quantize']")
        if (encoding == "fp8_global") != (weight_scale is not None):
            raise ValueError("an fp8_global table needs its weight_scale (and only it does)")
        super().__init__(num_embeddings, embedding_dim, None, 1.0, backend=backend, oob=oob, dtype=out_dtype,
                         backend_options=backend_options, register=register, materialize=False, max_tokens=max_tokens)
        self.encoding = encoding
        self._load_error = quant_error
        if weight_scale is not None:
            self.register_buffer("weight_scale", torch.as_tensor(weight_scale, dtype=torch.float32).reshape(1).clone())
        self.attach_table(table, own=own_table)

    # ------------------------------------------------------------------ table
    def attach_table(self, table, *, own: bool = False) -> None:
        """Use ``table`` (fp8 codes in this module's encoding) from now on; ``own``: :meth:`close` releases it."""
        cols = ENCODED[self.encoding](self.embedding_dim)
        if (table.rows, table.cols) != (self.num_embeddings, cols) or table.dtype not in FP8_FORMATS:
            raise ValueError(f"table is {table.rows}x{table.cols} {table.dtype}; an {self.encoding} table of this "
                             f"module is {self.num_embeddings}x{cols} fp8")
        old, old_own = self._table, self._own_table
        self._close_backends()
        self._table, self._own_table = table, own
        if old is not None and old is not table and old_own:
            old.close()

    @torch.no_grad()
    def load_weight_(self, weight: torch.Tensor) -> None:
        """Write fp8 codes ``[num_embeddings, embedding_dim]`` into an ``fp8_global`` table."""
        if self.encoding != "fp8_global":
            raise TypeError("an fp8_row table is quantised on load; it cannot be written from a weight")
        if not isinstance(weight, torch.Tensor) or weight.dtype != self._table.dtype \
                or tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight must be {self._table.dtype} [{self.num_embeddings}, {self.embedding_dim}], got "
                             f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
        if weight.device.type == "meta" or weight.data_ptr() == self._table.tensor.data_ptr():
            return
        self._close_backends()
        self._table.write_rows(weight.detach())

    # ------------------------------------------------------------------ lookups
    def _served(self, options: dict, device: torch.device) -> tuple:
        if options.pop("quantize", None) is not None:
            raise ValueError(f"this table is {self.encoding} already: drop backend_options['quantize']")
        if self.encoding == "fp8_global":  # read on the device by every call
            options["dequant_scale"] = self.weight_scale.to(device=device, dtype=torch.float32)
        return self._table, TableSpec.of(self._table, encoding=self.encoding, oob=self.oob,
                                         out_dtype=self.compute_dtype)

    def read_table(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rows as served, in ``dtype`` (default the output dtype): the codes through the entry's reference."""
        return ENCODINGS[self.encoding].dequantise(self.weight, dtype or self.compute_dtype,
                                                   getattr(self, "weight_scale", None))

    @property
    def quant_error(self):
        """``fp8_row``: the :class:`~uvaple.integration.quantize.QuantError` of the quantisation on load."""
        return self._load_error

    # ------------------------------------------------------------------ state dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.encoding == "fp8_global":
            super()._save_to_state_dict(destination, prefix, keep_vars)  # weight (the codes) and weight_scale
        else:
            nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight_scale"
        if self.encoding == "fp8_global" and key in state_dict:
            self.weight_scale.copy_(state_dict[key].reshape(1))
            self._close_backends()  # a lookup holds the scale on its device
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        elif self.encoding == "fp8_global" and strict:
            missing_keys.append(key)
        if self.encoding == "fp8_row":  # no weight in the state dict: nothing to read
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # ------------------------------------------------------------------ lifetime
    def __deepcopy__(self, memo):
        scale = getattr(self, "weight_scale", None)
        new = type(self)(self.num_embeddings, self.embedding_dim, HostTable.from_tensor(self._table.tensor),
                         encoding=self.encoding, out_dtype=self.compute_dtype,
                         weight_scale=None if scale is None else scale.detach().cpu(), quant_error=self._load_error,
                         backend=self.backend_kind, oob=self.oob, backend_options=dict(self.backend_options),
                         register=self.register_mode, max_tokens=self.max_tokens)
        memo[id(self)] = new
        new.training = self.training
        return new

    def extra_repr(self) -> str:
        return f"encoding={self.encoding}, " + super().extra_repr()

"""PLE backends behind one interface: ``uva``, ``device`` and ``copy``.

* ``uva``: the Triton gather reading a registered :class:`~uvaple.uva.HostTable` over PCIe, in the
  caller's stream. No thread, no queue, no event: stream order is the only synchronisation.
* ``device``: the same kernel over a copy of the table in HBM: the speed and memory reference.
* ``copy``: the classic copy-based path (worker thread, CPU gather, staged host-to-device copies),
  built correctly: the baseline and the fallback where UVA is unavailable
  (:mod:`uvaple.integration.copy_backend`).

Every backend's ``lookup`` has the semantics of :func:`uvaple.kernels.gather_rows` and gives the same
bits for the same ids (``tests/test_equivalence.py``).
"""

from __future__ import annotations

import abc

import torch

from ..kernels import gather_rows
from ..uva import HostTable

__all__ = ["Backend", "UvaBackend", "DeviceBackend", "make_backend", "BACKENDS", "default_device"]


def default_device() -> torch.device:
    """The current CUDA device, or the CPU where there is none (kernels then run interpreted)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile the table never moves: CUDA graphs must not copy it in before each replay."""
    if t.is_cuda:
        try:
            torch._dynamo.mark_static_address(t)
        except Exception:  # noqa: BLE001 - an optimisation hint only; absent on some torch builds
            pass
    return t


class Backend(abc.ABC):
    """A table lookup: ``lookup(ids) -> rows`` on ``device`` (see :func:`uvaple.kernels.gather_rows`)."""

    kind = "base"

    def __init__(self, table: HostTable, device: torch.device | str | None, owns_table: bool):
        self.table = table
        self.device = torch.device(device) if device is not None else default_device()
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._owns_table = owns_table
        self._closed = False

    @property
    def rows(self) -> int:
        return self.table.rows

    @property
    def cols(self) -> int:
        return self.table.cols

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @abc.abstractmethod
    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None, *, scale: float | None = None,
               columns=None, oob: str = "zero", out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``table[ids, columns]`` (optionally scaled) in ``out`` ``[*ids.shape, ncols]``."""

    def device_bytes(self) -> int:
        """Bytes of device memory this backend holds for the table."""
        return 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_table:
            self.table.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.table!r}, device={self.device})"


class UvaBackend(Backend):
    """Gather straight from a registered host table in the caller's stream."""

    kind = "uva"

    def __init__(self, table: HostTable, device=None, *, owns_table: bool = False, view: str = "cuda"):
        super().__init__(table, device, owns_table)
        if self.device.type == "cuda" and not table.registered:
            raise ValueError("the uva backend needs a registered HostTable (build it with register=True on a "
                             "CUDA machine), or use the 'copy' backend")
        if view not in ("host", "cuda"):
            raise ValueError(f"view must be 'host' or 'cuda', got {view!r}")
        # Triton reads the table through either a CPU tensor over the registered pages (the host pointer
        # is valid on the device) or a CUDA tensor aliasing the same memory; both are the same bytes. The
        # CUDA view is the default: torch.compile then sees only CUDA inputs and keeps CUDA graphs on.
        if view == "cuda" and self.device.type == "cuda":
            self._arg = _static(table.cuda_view(self.device.index))
        else:
            self._arg = table

    def lookup(self, ids, out=None, *, scale=None, columns=None, oob="zero", out_dtype=None):
        return gather_rows(self._arg, ids, out, scale=scale, columns=columns, oob=oob, out_dtype=out_dtype)


class DeviceBackend(Backend):
    """The table resident in device memory (HBM), same kernel."""

    kind = "device"

    def __init__(self, table: HostTable, device=None, *, owns_table: bool = False):
        super().__init__(table, device, owns_table)
        self.weight = _static(table.tensor.to(self.device, copy=True).contiguous())

    def lookup(self, ids, out=None, *, scale=None, columns=None, oob="zero", out_dtype=None):
        return gather_rows(self.weight, ids, out, scale=scale, columns=columns, oob=oob, out_dtype=out_dtype)

    def device_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() if self.device.type == "cuda" else 0

    def close(self) -> None:
        self.weight = None
        super().close()


def _copy_backend(table, device=None, *, owns_table=False, **options):
    from .copy_backend import CopyBackend

    return CopyBackend(table, device=device, owns_table=owns_table, **options)


BACKENDS = {"uva": UvaBackend, "device": DeviceBackend, "copy": _copy_backend}


def make_backend(kind: str, table, *, device=None, **options) -> Backend:
    """Build backend ``kind`` ("uva", "device" or "copy") over ``table``.

    ``table`` is a :class:`HostTable` (shared, not closed by the backend) or a 2-D tensor/ndarray, which
    is copied into a new HostTable that the backend owns and closes.
    """
    if kind not in BACKENDS:
        raise ValueError(f"unknown backend {kind!r}; choose one of {sorted(BACKENDS)}")
    owns = False
    if not isinstance(table, HostTable):
        table = HostTable.from_tensor(table) if isinstance(table, torch.Tensor) else HostTable.from_numpy(table)
        owns = True
    try:
        return BACKENDS[kind](table, device, owns_table=owns, **options)
    except BaseException:
        if owns:
            table.close()
        raise

"""Placements: where a lookup's rows come from, siblings behind the one :class:`~uvaple.integration.lookup.Lookup`.

* :mod:`.copy`: the classic copy-based path (worker thread, CPU gather into pinned staging, staged
  host-to-device copy), built so that it cannot wedge: the baseline, and the fallback where host memory
  cannot be mapped into the GPU.
* :mod:`.host_gather`: the CPU gathers of table rows into pinned staging (numba or ``torch.index_select``),
  shared by the copy placement and the split lookup's CPU share.
"""

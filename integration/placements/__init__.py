"""Placements: where a lookup's rows come from, siblings behind the one :class:`~uvaple.integration.lookup.Lookup`.

* :mod:`.gather`: ``GatherLookup``, the Triton gather over the table in pinned, mapped host memory (``uva``,
  read over PCIe) or over an HBM copy (``device``: the speed and memory reference).
* :mod:`.split`: ``SplitLookup``, a gather lookup that also takes host ids and has the calling thread gather
  a share of the rows on the CPU (with the split's measured plan).
* :mod:`.hot`: ``HotSet``, the most frequent rows of a host table in HBM, read by a gather lookup's kernel
  in the same launch as the others.
* :mod:`.copy`: the classic copy-based path (worker thread, CPU gather into pinned staging, staged
  host-to-device copy), built so that it cannot wedge: the baseline, and the fallback where host memory
  cannot be mapped into the GPU.
* :mod:`.host_gather`: the CPU gathers of table rows into pinned staging (numba or ``torch.index_select``),
  shared by the copy placement and the split lookup's CPU share.
"""

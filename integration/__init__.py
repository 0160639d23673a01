"""The library over host tables: the lookup object and its placements, the layers over them; model adapters in
:mod:`.models` (transformers, vLLM).

Heavy or optional pieces (transformers, vLLM) are imported lazily by their own modules.
"""

from . import errors
from .factory import KINDS, make_lookup
from .lookup import Lookup, default_device
from .placements.copy import CopyBackend, CopyJob
from .placements.disk import DiskLookup, DiskStepTimeout
from .placements.gather import GatherLookup
from .placements.hot import HotSet, counts_of_ids, rank_rows
from .placements.split import SplitLookup
from .spec import TableSpec

__all__ = ["TableSpec", "Lookup", "GatherLookup", "SplitLookup", "CopyBackend", "CopyJob", "DiskLookup",
           "DiskStepTimeout", "make_lookup", "KINDS",
           "default_device", "errors", "HotSet", "rank_rows", "counts_of_ids"]

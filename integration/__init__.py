"""Adapters: the lookup object and its placements, model swap-ins, the HF transformers patch.

Heavy or optional pieces (transformers, vLLM) are imported lazily by their own modules.
"""

from . import errors
from .copy import CopyBackend, CopyJob
from .factory import KINDS, make_lookup
from .hotset import HotSet, counts_of_ids, rank_rows
from .lookup import GatherLookup, Lookup, default_device
from .spec import TableSpec

__all__ = ["TableSpec", "Lookup", "GatherLookup", "CopyBackend", "CopyJob", "make_lookup", "KINDS",
           "default_device", "errors", "HotSet", "rank_rows", "counts_of_ids"]

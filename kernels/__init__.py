"""Triton gather kernels, their launchers and launch heuristics, and the ``uvaple::gather_rows`` op."""

from . import (
    _runtime,  # noqa: F401  (selects GPU or interpreter before any kernel is defined)
    ops,  # noqa: F401  (registers torch.ops.uvaple.gather_rows)
)
from .gather import OOB_POLICIES, gather_rows
from .heuristics import launch_config
from .reference import reference_gather

INTERPRETED = _runtime.INTERPRETED

__all__ = ["gather_rows", "reference_gather", "launch_config", "OOB_POLICIES", "INTERPRETED"]

"""Triton gather kernels, their launchers and launch heuristics, and the ``uvaple::gather_rows`` op."""

import sys

if __name__ != "uvaple.kernels":
    # Run from the source tree (``python -m`` puts the current folder on sys.path), this folder is also
    # importable as the top-level ``kernels``, a name a PyPI package owns and transformers probes for.
    # Stand in for ``uvaple.kernels`` rather than running the kernels a second time under another name.
    import importlib

    sys.modules[__name__] = importlib.import_module("uvaple.kernels")
else:
    from . import ops  # noqa: F401  (registers torch.ops.uvaple.gather_rows)
    from .gather import OOB_POLICIES, gather_rows
    from .heuristics import launch_config
    from .reference import reference_gather

    __all__ = ["gather_rows", "reference_gather", "launch_config", "OOB_POLICIES"]

"""Device code and how it is launched: the gather kernels, their launchers and plans, their operators.

``gather`` (direct), ``gather_sorted`` and ``gather_hot`` each hold one operator (``torch.ops.uvaple.*``,
registered on import) with its kernel, launcher and fake, and so does ``ngram``, the n-gram hash that makes a
PLE layer's table rows from its tokens; ``plan`` makes a lookup's launchers once;
``encodings`` is the registry of row encodings; ``tuning`` holds the measured launch tables; ``reference``
is the definition every kernel path is compared against. Takes tensors and ints only.
"""

import sys

if __name__ != "uvaple.kernels":
    # Run from the source tree (``python -m`` puts the current folder on sys.path), this folder is also
    # importable as the top-level ``kernels``, a name a PyPI package owns and transformers probes for.
    # Stand in for ``uvaple.kernels`` rather than running the kernels a second time under another name.
    import importlib

    sys.modules[__name__] = importlib.import_module("uvaple.kernels")
else:
    from . import (
        gather_hot,  # noqa: F401  (registers torch.ops.uvaple.gather_rows_hot)
        ngram,  # noqa: F401  (registers torch.ops.uvaple.ngram_rows)
    )
    from .checks import OOB_POLICIES
    from .encodings import ENCODINGS, Encoding
    from .gather import gather_rows
    from .plan import GatherPlan
    from .reference import reference_gather
    from .tuning import launch_config

    __all__ = ["gather_rows", "reference_gather", "launch_config", "OOB_POLICIES", "GatherPlan", "ENCODINGS",
               "Encoding"]

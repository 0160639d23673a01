"""uvaple: huge embedding tables in pinned, mapped host memory, gathered in the model's CUDA stream.

Subpackages: ``uvaple.uva`` (host tables), ``uvaple.kernels`` (Triton gathers), ``uvaple.integration``
(backends, model swap-ins), ``uvaple.perf`` (benchmarks). Importing ``uvaple`` imports none of them.
"""

__version__ = "0.1.0"

"""Where kernels run: the GPU, or Triton's interpreter on CPU tensors when no GPU is present.

Must run before any ``@triton.jit`` function is defined: Triton decides interpreter or compiler at
decoration time from ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os


def select_backend() -> bool:
    """Set ``TRITON_INTERPRET=1`` where CUDA is absent (unless the user chose); True when interpreting."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


INTERPRETED = select_backend()

"""Adapters: PLE backends behind one interface, model swap-ins, the HF transformers patch.

Heavy or optional pieces (transformers, vLLM) are imported lazily by their own modules.
"""

from . import errors  # copy_backend: the named backend errors live in uvaple.integration.errors
from .backends import BACKENDS, Backend, DeviceBackend, UvaBackend, make_backend
from .copy_backend import CopyBackend, CopyJob  # copy_backend

__all__ = ["Backend", "UvaBackend", "DeviceBackend", "make_backend", "BACKENDS"]
__all__ += ["CopyBackend", "CopyJob", "errors"]  # copy_backend

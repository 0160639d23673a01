"""Adapters: PLE backends behind one interface, model swap-ins, the HF transformers patch.

Heavy or optional pieces (transformers, vLLM) are imported lazily by their own modules.
"""

from .backends import BACKENDS, Backend, DeviceBackend, UvaBackend, make_backend

__all__ = ["Backend", "UvaBackend", "DeviceBackend", "make_backend", "BACKENDS"]

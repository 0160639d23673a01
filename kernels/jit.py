"""Compiled or interpreted Triton kernels, chosen per call by where the tensors are: no global switch.

Triton picks compiler or interpreter when a function is decorated, from ``TRITON_INTERPRET``. Setting
that variable on import would change every other Triton user of the process, so each kernel module is
loaded twice instead: as itself (``triton.jit``: compiled for CUDA tensors, or interpreted everywhere
when the user set ``TRITON_INTERPRET=1``) and, on first use with CPU tensors, as a second module object
from the same source whose functions are Triton ``InterpretedFunction`` objects. Inside a kernel, helper
functions resolve through the module's globals, so each variant calls its own helpers.

Kernel modules decorate with ``jit = kernel_decorator(__name__)``; launchers take
``variant(module, interpret)``. A kernel module that also registers operators does so only as itself
(``is_interpreted_copy(__name__)`` is false): its interpreted copy holds the kernels' twins and nothing else
that counts.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from types import ModuleType

_SUFFIX = "__interpreted"
_lock = threading.RLock()  # loading one variant may load another (a helper module it imports)


def kernel_decorator(module_name: str):
    """The decorator a kernel module uses: ``triton.jit``, or the interpreter in the interpreted copy."""
    import triton

    if not module_name.endswith(_SUFFIX):
        return triton.jit
    from triton.runtime.interpreter import InterpretedFunction

    def interpreted(fn=None, **kwargs):
        if fn is None:
            return lambda f: InterpretedFunction(f, **kwargs)
        return InterpretedFunction(fn, **kwargs)

    return interpreted


@functools.cache
def _interpreted(module_name: str) -> ModuleType:
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find the kernel module {module_name}")
    name = module_name + _SUFFIX
    copy = importlib.util.spec_from_file_location(name, spec.origin)
    module = importlib.util.module_from_spec(copy)
    module.__package__ = module_name.rpartition(".")[0]
    copy.loader.exec_module(module)
    return module


def variant(module: ModuleType, interpret: bool) -> ModuleType:
    """``module`` itself, or its interpreted copy (loaded once, on first use)."""
    if not interpret:
        return module
    with _lock:
        return _interpreted(module.__name__)


def same_variant(module_name: str, module: ModuleType) -> ModuleType:
    """``module`` as the variant a kernel module named ``module_name`` is (so its kernels may call the
    other module's ``@jit`` helpers: compiled from compiled, interpreted from interpreted)."""
    return variant(module, module_name.endswith(_SUFFIX))


def is_interpreted_copy(module_name: str) -> bool:
    """Whether ``module_name`` names the interpreted copy of a kernel module."""
    return module_name.endswith(_SUFFIX)


def running_on_cpu(*tensors) -> bool:
    """True when a launch over these tensors must use the interpreter (no CUDA tensor among them)."""
    return not any(t.is_cuda for t in tensors)


__all__ = ["kernel_decorator", "variant", "same_variant", "is_interpreted_copy", "running_on_cpu"]

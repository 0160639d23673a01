"""CUDA runtime calls for host registration, through cuda-python (``cuda.bindings.runtime``).

Every call's return code is checked and turned into a named exception. The import is lazy: a machine
without cuda-python or without a GPU can still build, load and share host tables (unregistered).
"""

from __future__ import annotations

import functools

from .errors import DeviceCapabilityError, RegistrationError

# cudaHostRegister flags (driver_types.h)
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_MAPPED = 0x02
HOST_REGISTER_READ_ONLY = 0x08


@functools.lru_cache(maxsize=1)
def runtime():
    """The ``cuda.bindings.runtime`` module, or None where cuda-python is not importable."""
    try:
        from cuda.bindings import runtime as rt  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart as rt  # older cuda-python layout
        except ImportError:
            return None
    return rt


def _name(err) -> str:
    return getattr(err, "name", str(err))


def _ok(err) -> bool:
    return int(err) == 0


def in_bad_fork() -> bool:
    """True in a child forked after CUDA was initialised in its parent: CUDA cannot be used here."""
    import torch

    return torch.cuda._is_in_bad_fork()


def cuda_available() -> bool:
    """True when torch sees a CUDA device and cuda-python can talk to it (never in a child forked after its
    parent initialised CUDA: no CUDA call can succeed there)."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available() or in_bad_fork():
        return False
    rt = runtime()
    if rt is None:
        return False
    err, n = rt.cudaGetDeviceCount()
    return _ok(err) and n > 0


def _unpack(result) -> tuple:
    """A cuda-python result as (error, the values after it)."""
    return (result[0], result[1:]) if isinstance(result, tuple) else (result, ())


def check(result, what: str, exc=RegistrationError, hint: str = ""):
    """Unpack a cuda-python result tuple, raising ``exc`` with the error's name if it failed."""
    err, rest = _unpack(result)
    if not _ok(err):
        msg = f"{what} failed: {_name(err)} ({int(err)})"
        if hint:
            msg += f". {hint}"
        raise exc(msg)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def copy_async(dst: int, src: int, nbytes: int, stream: int, what: str) -> bool:
    """``cudaMemcpyAsync`` of ``nbytes`` from address ``src`` to ``dst`` (UVA: the runtime infers the
    direction) on the stream whose handle is ``stream``: a few µs on the host, a third of torch's
    ``copy_``. False where cuda-python is missing (the caller copies through torch); a failed copy raises
    ``RuntimeError`` naming ``what``. Nothing tells torch's caching allocators about the copy: the caller
    keeps both buffers alive until it has completed."""
    rt = runtime()
    if rt is None:
        return False
    result = rt.cudaMemcpyAsync(dst, src, nbytes, _memcpy_default(), stream)
    if not _ok(_unpack(result)[0]):  # the message built only on failure
        check(result, f"cudaMemcpyAsync of {what}", exc=RuntimeError)
    return True


@functools.lru_cache(maxsize=1)
def _memcpy_default():
    return runtime().cudaMemcpyKind.cudaMemcpyDefault


def device_attribute(attr_name: str, device: int) -> int:
    rt = runtime()
    attr = getattr(rt.cudaDeviceAttr, attr_name)
    return int(check(rt.cudaDeviceGetAttribute(attr, device), f"cudaDeviceGetAttribute({attr_name})",
                     DeviceCapabilityError))


def ensure_context(device: int) -> None:
    """Make ``device`` current and its primary context live (the one torch and Triton use)."""
    import torch

    torch.cuda.set_device(device)
    torch.cuda.init()
    rt = runtime()
    check(rt.cudaSetDevice(device), f"cudaSetDevice({device})", DeviceCapabilityError)
    check(rt.cudaFree(0), "creating the CUDA primary context (cudaFree(0))", DeviceCapabilityError)


def require_host_pointer_access(device: int) -> None:
    """Fail clearly where the GPU cannot dereference registered host memory through the host pointer."""
    checks = [
        ("cudaDevAttrUnifiedAddressing", "unified virtual addressing"),
        ("cudaDevAttrCanMapHostMemory", "mapping host memory"),
        ("cudaDevAttrCanUseHostPointerForRegisteredMem", "using the host pointer of registered memory"),
    ]
    for attr, what in checks:
        if device_attribute(attr, device) != 1:
            raise DeviceCapabilityError(
                f"GPU {device} does not support {what} ({attr} = 0); the UVA path cannot read a host table "
                f"there. Use the 'copy' placement (make_lookup('copy', table)) on this machine.")


def read_only_register_supported(device: int) -> bool:
    try:
        return device_attribute("cudaDevAttrHostRegisterReadOnlySupported", device) == 1
    except (AttributeError, DeviceCapabilityError):
        return False


def host_register(ptr: int, nbytes: int, flags: int) -> None:
    rt = runtime()
    err = _unpack(rt.cudaHostRegister(ptr, nbytes, flags))[0]
    if not _ok(err):
        # cudaHostRegister leaves a sticky last error; clear it so later launches are not blamed.
        rt.cudaGetLastError()
        raise RegistrationError(f"{_name(err)} ({int(err)})")


def host_unregister(ptr: int) -> None:
    rt = runtime()
    err = _unpack(rt.cudaHostUnregister(ptr))[0]
    if not _ok(err):
        rt.cudaGetLastError()
        raise RegistrationError(f"cudaHostUnregister failed: {_name(err)} ({int(err)})")


def host_device_pointer(ptr: int) -> int:
    rt = runtime()
    return int(check(rt.cudaHostGetDevicePointer(ptr, 0), "cudaHostGetDevicePointer"))



def _context_active(device: int) -> bool:
    """Whether ``device``'s primary context exists (no kernel can run on a device without one)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return True
    try:
        err, dev = driver.cuDeviceGet(device)
        if int(err) != 0:
            return True
        err, _flags, active = driver.cuDevicePrimaryCtxGetState(dev)
        return bool(active) if int(err) == 0 else True
    except Exception:  # noqa: BLE001 - when in doubt, synchronise
        return True


def synchronize_devices() -> None:
    """``cudaDeviceSynchronize`` on every GPU with a live context, then restore the current device.

    Host registration is portable, so kernels on any GPU may be reading a table that is about to be released.
    """
    rt = runtime()
    current = int(check(rt.cudaGetDevice(), "cudaGetDevice"))
    count = int(check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount"))
    try:
        for d in range(count):
            if d != current and not _context_active(d):
                continue
            check(rt.cudaSetDevice(d), f"cudaSetDevice({d})")
            check(rt.cudaDeviceSynchronize(), f"cudaDeviceSynchronize on GPU {d}")
    finally:
        rt.cudaSetDevice(current)


def current_device() -> int:
    rt = runtime()
    return int(check(rt.cudaGetDevice(), "cudaGetDevice", DeviceCapabilityError))


def is_registered(ptr: int) -> bool:
    """Whether CUDA knows ``ptr`` as registered (or pinned) host memory."""
    rt = runtime()
    err, attrs = rt.cudaPointerGetAttributes(ptr)
    if not _ok(err):
        rt.cudaGetLastError()
        return False
    return int(attrs.type) == 1  # cudaMemoryTypeHost

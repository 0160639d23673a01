"""``HostTable``: one 2-D table in pinned, mapped host memory that a GPU reads through UVA.

Design
------
Memory. The table is an anonymous private mapping (``mmap`` through libc, 2 MiB aligned, transparent
huge pages advised) or, when it has a ``name``, a POSIX shared-memory segment under ``/dev/shm`` that
other processes (tensor-parallel ranks on one host) attach without a second copy. The mapping is exactly
the table's size rounded up to a page: ``torch.empty(pin_memory=True)`` rounds pinned blocks up to a power
of two (a 100 GiB table would pin 128 GiB; see ../shared/DESIGN.md), this does not.

Row stride. Rows start on 16-byte boundaries so a GPU thread can read a row with aligned 16-byte loads.
Rows of 128 bytes or more are padded to a multiple of 128 bytes: EMOGI/PyTorch-Direct measured that
zero-copy reads reach the PCIe peak only with 128-byte-aligned requests, and every real PLE row
(15,360 B, 17,920 B, 128 KiB) is already a multiple of 128, so this costs nothing there. Shorter rows
are padded to the next power of two (16, 32, 64 bytes), so a row never straddles a 128-byte line.

Population. Pages are committed up front by several threads at once (``MADV_POPULATE_WRITE`` on
disjoint ranges; ctypes drops the GIL), so a shortage fails here with ``HostMemoryError`` rather than as
an OOM kill later, and registration does not fault 25 million pages single-threaded. Shared segments
are reserved with ``posix_fallocate`` (also in parallel), which turns "tmpfs is full" into ENOSPC
instead of a SIGBUS on first touch.

Registration. ``cudaHostRegister(Portable | Mapped [| ReadOnly])`` through cuda-python, in chunks below
the driver's per-call limit (one call of >= 512 GiB fails). The kernels use the host pointer itself
(``cudaDevAttrCanUseHostPointerForRegisteredMem`` is required and checked), so the chunks form one
contiguous device range.

Lifetime. ``close()`` (or leaving a ``with`` block, or interpreter exit) first synchronises the device,
so no kernel can still be reading, then unregisters, unmaps and (for the creator of a named segment)
unlinks. It is idempotent. Tensor and array views taken from the table are invalid after ``close()``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from . import _cuda, _sys
from ._lifetime import ExitRegistry
from .errors import (
    DeviceCapabilityError,
    HostMemoryError,
    RegistrationError,
    SharedSegmentError,
    TableClosedError,
    UvapleError,
)

log = logging.getLogger("uvaple.uva")

__all__ = ["HostTable", "row_stride_bytes", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_BY_NAME = {v: k for k, v in SUPPORTED_DTYPES.items()}

# One cudaHostRegister call of >= 512 GiB fails (vLLM PR 51081); 128 GiB chunks stay far below that and
# keep the count of registrations small for ~100 GiB tables (one call).
REGISTER_CHUNK_BYTES = 128 << 30

# Shared segments: a header page block, then the rows. The data starts 2 MiB in so it stays aligned for
# huge pages where tmpfs has them enabled.
_SHM_DIR = "/dev/shm"
_SHM_PREFIX = "uvaple."
_SHM_MAGIC = b"UVAPLE01"
_SHM_DATA_OFFSET = _sys.HUGE_PAGE_SIZE
_SHM_HEADER_FMT = "<8sQ"  # magic, json length
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")

# Ranges handed to one populate/fallocate call: large enough that syscall overhead is nil, small enough
# that 16 threads share a 1 GiB table evenly.
_POPULATE_CHUNK_BYTES = 64 << 20

ctypes_char = ctypes.c_ubyte



def row_stride_bytes(row_bytes: int) -> int:
    """Bytes between row starts for a row of ``row_bytes`` (see the module docstring)."""
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes}")
    if row_bytes >= 128:
        return _sys.round_up(row_bytes, 128)
    return max(16, 1 << (row_bytes - 1).bit_length())


def default_threads() -> int:
    """Threads for populate/load: 16 measured best for 32 GiB on the H200 host (DESIGN.md)."""
    return max(1, min(16, os.cpu_count() or 1))


def _close_all_at_exit() -> None:
    for table in _live_tables.items():
        try:
            if table._leases:
                # A CPU thread (a copy backend's worker) may still be reading it: unregister (after a device
                # sync) but leave the pages mapped; the OS frees them when the process ends.
                table._release_device_side()
                continue
            table.close()
        except Exception as e:  # noqa: BLE001 - never raise from atexit
            log.warning("closing a host table at exit failed: %s", e)


_live_tables = ExitRegistry(_close_all_at_exit)


@dataclass(frozen=True)
class _Layout:
    rows: int
    cols: int
    dtype: torch.dtype
    stride_bytes: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        return self.cols * self.itemsize

    @property
    def data_bytes(self) -> int:
        return self.rows * self.stride_bytes


def _check_shape(rows: int, cols: int, dtype: torch.dtype) -> _Layout:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"HostTable dtype {dtype} is not supported; use one of {names}")
    if not (isinstance(rows, int) and isinstance(cols, int)) or rows <= 0 or cols <= 0:
        raise ValueError(f"HostTable needs a positive integer shape, got rows={rows!r}, cols={cols!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _Layout(rows, cols, dtype, row_stride_bytes(cols * itemsize))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _parallel(fn, ranges, threads: int) -> None:
    """Run ``fn(start, length)`` over ``ranges`` on ``threads`` threads; re-raise the first failure."""
    if threads <= 1 or len(ranges) <= 1:
        for r in ranges:
            fn(*r)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="uvaple-populate") as pool:
        futures = [pool.submit(fn, *r) for r in ranges]
        first = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - collect, then raise the first
                first = first or e
        if first is not None:
            raise first


def _chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


class HostTable:
    """A ``[rows, cols]`` table in host memory that the GPU can read (see the module docstring).

    Build one with :meth:`empty`, :meth:`from_tensor`, :meth:`from_numpy`, :meth:`from_safetensors`, or
    :meth:`attach` (a named segment another process created). Use it as a context manager or call
    :meth:`close`.
    """

    # ------------------------------------------------------------------ construction
    def __init__(self, *, _layout: _Layout, _base: int, _map_bytes: int, _data_offset: int,
                 _name: str | None, _owner: bool, _fd: int | None):
        self._layout = _layout
        self._base = _base
        self._map_bytes = _map_bytes
        self._data_offset = _data_offset
        self._name = _name
        self._owner = _owner
        self._fd = _fd
        self._registered_chunks: list[tuple[int, int]] = []
        self._device: int | None = None
        self._read_only_registered = False
        self._closed = False
        self._lock = threading.Lock()
        self._tensor: torch.Tensor | None = None
        self._buffer = None
        self.timings: dict[str, float] = {}  # seconds spent in populate / fill / register
        self._leases = 0  # host-side readers (copy backends) that must stop before the memory is unmapped
        _live_tables.add(self)

    @classmethod
    def empty(cls, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, *, name: str | None = None,
              register: bool | str = "auto", read_only: bool = False, device: int | None = None,
              threads: int | None = None, check_memory: bool = True) -> HostTable:
        """Allocate, pre-fault and (optionally) register a table; its contents are zero.

        Parameters
        ----------
        rows, cols : int
            Table shape: ``rows`` embeddings of ``cols`` values.
        dtype : torch.dtype
            Element type (bf16, fp16, fp32, int8, uint8, fp8).
        name : str, optional
            Create a named POSIX shared segment other processes can :meth:`attach`.
        register : bool or "auto"
            ``cudaHostRegister`` the memory so GPU kernels can read it. ``"auto"`` registers when CUDA
            is usable; ``True`` requires it.
        read_only : bool
            Register with ``cudaHostRegisterReadOnly`` where the device supports it.
        device : int, optional
            GPU whose context registers the memory (default: the current device).
        threads : int, optional
            Threads for pre-faulting (default ``min(16, cpu_count)``).
        check_memory : bool
            Refuse up front when the table exceeds ``MemAvailable`` (set False where memory grows on
            demand, e.g. ballooned VMs).
        """
        table = cls._allocate(rows, cols, dtype, name=name, threads=threads, check_memory=check_memory)
        try:
            table._register(register, read_only=read_only, device=device)
            if name is not None:
                table._mark_ready()
        except BaseException:
            table.close()
            raise
        return table

    @classmethod
    def _allocate(cls, rows, cols, dtype, *, name, threads, check_memory) -> HostTable:
        layout = _check_shape(rows, cols, dtype)
        threads = threads or default_threads()
        data_bytes = layout.data_bytes
        if name is None:
            map_bytes = _sys.round_up(data_bytes, _sys.PAGE_SIZE)
            _check_free_memory(map_bytes, check_memory)
            try:
                base = _sys.map_anonymous_aligned(map_bytes)
            except OSError as e:
                raise HostMemoryError(
                    f"mmap of {_gib(map_bytes)} for a {rows}x{cols} {dtype} table failed: {e.strerror}. "
                    f"Free host memory or check `ulimit -v`.") from e
            table = cls(_layout=layout, _base=base, _map_bytes=map_bytes, _data_offset=0, _name=None,
                        _owner=True, _fd=None)
            try:
                _sys.madvise(base, map_bytes, _sys.MADV_HUGEPAGE)  # a hint: ignored where THP is off
                table._populate(threads)
            except BaseException:
                table.close()
                raise
            return table
        return cls._create_shared(layout, name, threads, check_memory)

    # ------------------------------------------------------------------ shared segments
    @staticmethod
    def _segment_path(name: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise SharedSegmentError(
                f"shared table name {name!r} is not valid: use 1-200 letters, digits, '_', '-' or '.'")
        return os.path.join(_SHM_DIR, _SHM_PREFIX + name)

    @classmethod
    def _create_shared(cls, layout: _Layout, name: str, threads: int, check_memory: bool) -> HostTable:
        path = cls._segment_path(name)
        map_bytes = _SHM_DATA_OFFSET + _sys.round_up(layout.data_bytes, _sys.PAGE_SIZE)
        _check_free_memory(map_bytes, check_memory)
        if check_memory:
            st = os.statvfs(_SHM_DIR)
            free = st.f_bavail * st.f_frsize
            if map_bytes > free:
                raise HostMemoryError(
                    f"shared table {name!r} needs {_gib(map_bytes)} in {_SHM_DIR} but only {_gib(free)} is "
                    f"free there; enlarge it (mount -o remount,size=... {_SHM_DIR}) or drop name= to use "
                    f"private memory")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError as e:
            raise SharedSegmentError(
                f"a shared table named {name!r} already exists ({path}); attach to it with "
                f"HostTable.attach({name!r}), pick another name, or remove the stale file") from e
        except OSError as e:
            raise SharedSegmentError(f"creating shared table {name!r} at {path} failed: {e.strerror}") from e
        table = None
        try:
            os.ftruncate(fd, map_bytes)

            def reserve(off: int, length: int) -> None:
                try:
                    os.posix_fallocate(fd, off, length)
                except OSError as e:
                    raise HostMemoryError(
                        f"reserving {_gib(map_bytes)} for shared table {name!r} in {_SHM_DIR} failed: "
                        f"{e.strerror}; free space there or use a private table") from e

            _parallel(reserve, _chunks(map_bytes, _POPULATE_CHUNK_BYTES), threads)
            try:
                base = _sys.mmap(map_bytes, _sys.PROT_READ | _sys.PROT_WRITE, _sys.MAP_SHARED, fd)
            except OSError as e:
                raise HostMemoryError(f"mapping shared table {name!r} failed: {e.strerror}") from e
            table = cls(_layout=layout, _base=base, _map_bytes=map_bytes, _data_offset=_SHM_DATA_OFFSET,
                        _name=name, _owner=True, _fd=fd)
            _sys.madvise(base, map_bytes, _sys.MADV_HUGEPAGE)
            table._write_header(ready=False)
            table._populate(threads)
            return table
        except BaseException:
            if table is not None:
                table.close()
            else:
                os.close(fd)
                _unlink_quietly(path)
            raise

    def _header_dict(self, ready: bool) -> dict:
        lay = self._layout
        return {"rows": lay.rows, "cols": lay.cols, "dtype": SUPPORTED_DTYPES[lay.dtype],
                "stride_bytes": lay.stride_bytes, "data_offset": self._data_offset, "ready": ready,
                "creator_pid": os.getpid()}

    def _write_header(self, ready: bool) -> None:
        payload = json.dumps(self._header_dict(ready)).encode()
        head = struct.pack(_SHM_HEADER_FMT, _SHM_MAGIC, len(payload)) + payload
        buf = (ctypes_char * len(head)).from_address(self._base)
        buf[:] = head

    def _mark_ready(self) -> None:
        self._write_header(ready=True)

    @classmethod
    def attach(cls, name: str, *, rows: int | None = None, cols: int | None = None,
               dtype: torch.dtype | None = None, register: bool | str = "auto", read_only: bool = False,
               device: int | None = None, threads: int | None = None) -> HostTable:
        """Map a named table another process created with ``empty(..., name=name)`` (or a loader).

        ``rows``/``cols``/``dtype``, when given, must match the segment or ``SharedSegmentError`` is
        raised. The attaching process registers its own mapping (registration is per process).
        """
        path = cls._segment_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as e:
            raise SharedSegmentError(
                f"no shared table named {name!r} ({path} does not exist); create it first with "
                f"HostTable.empty(..., name={name!r}) or a loader with name=") from e
        table = None
        try:
            size = os.fstat(fd).st_size
            hsize = struct.calcsize(_SHM_HEADER_FMT)
            raw = os.pread(fd, 4096, 0)
            if size < _SHM_DATA_OFFSET or len(raw) < hsize:
                raise SharedSegmentError(f"{path} is not a uvaple shared table (too small: {size} bytes)")
            magic, n = struct.unpack_from(_SHM_HEADER_FMT, raw)
            if magic != _SHM_MAGIC or n > 4096 - hsize:
                raise SharedSegmentError(f"{path} is not a uvaple shared table (bad header)")
            try:
                meta = json.loads(raw[hsize:hsize + n])
                layout = _Layout(int(meta["rows"]), int(meta["cols"]), _DTYPE_BY_NAME[meta["dtype"]],
                                 int(meta["stride_bytes"]))
            except (ValueError, KeyError, TypeError) as e:
                raise SharedSegmentError(f"{path} has a corrupt uvaple header: {e}") from e
            if not meta.get("ready"):
                raise SharedSegmentError(
                    f"shared table {name!r} exists but its creator (pid {meta.get('creator_pid')}) has not "
                    f"finished filling it; attach after it is ready")
            want = {"rows": rows, "cols": cols, "dtype": dtype}
            have = {"rows": layout.rows, "cols": layout.cols, "dtype": layout.dtype}
            bad = [f"{k}: expected {want[k]}, segment has {have[k]}" for k in want
                   if want[k] is not None and want[k] != have[k]]
            if bad:
                raise SharedSegmentError(f"shared table {name!r} does not match: " + "; ".join(bad))
            map_bytes = _SHM_DATA_OFFSET + _sys.round_up(layout.data_bytes, _sys.PAGE_SIZE)
            if size < map_bytes:
                raise SharedSegmentError(
                    f"shared table {name!r} is truncated: {size} bytes, header says {map_bytes}")
            try:
                base = _sys.mmap(map_bytes, _sys.PROT_READ | _sys.PROT_WRITE, _sys.MAP_SHARED, fd)
            except OSError as e:
                raise SharedSegmentError(f"mapping shared table {name!r} failed: {e.strerror}") from e
            table = cls(_layout=layout, _base=base, _map_bytes=map_bytes, _data_offset=_SHM_DATA_OFFSET,
                        _name=name, _owner=False, _fd=fd)
            # Map the existing pages into this process's page tables now, not on the GPU's first reads.
            table._populate(threads or default_threads(), write=False)
            table._register(register, read_only=read_only, device=device)
            return table
        except BaseException:
            if table is not None:
                table.close()
            else:
                os.close(fd)
            raise

    # ------------------------------------------------------------------ population and registration
    def _populate(self, threads: int, write: bool = True) -> None:
        t0 = time.perf_counter()
        try:
            self._populate_ranges(threads, write)
        finally:
            self.timings["populate"] = time.perf_counter() - t0

    def _populate_ranges(self, threads: int, write: bool) -> None:
        advice = _sys.MADV_POPULATE_WRITE if write else _sys.MADV_POPULATE_READ
        base, total = self._base, self._map_bytes

        def touch(off: int, length: int) -> None:
            err = _sys.madvise(base + off, length, advice)
            if err == 0:
                return
            if err in (22, 1):  # EINVAL/EPERM: kernel without MADV_POPULATE_*; touch pages instead
                if write:
                    _sys.memset(base + off, 0, length)
                else:
                    buf = (ctypes_char * length).from_address(base + off)
                    sum(memoryview(buf).cast("B")[:: _sys.PAGE_SIZE])
                return
            raise HostMemoryError(
                f"pre-faulting {_gib(total)} of host memory failed ({os.strerror(err)}): not enough free "
                f"memory for this table. Free memory, use a smaller table, or quantise it")

        _parallel(touch, _chunks(total, _POPULATE_CHUNK_BYTES), threads)

    def _register(self, register: bool | str, *, read_only: bool, device: int | None) -> None:
        if register not in (True, False, "auto"):
            raise ValueError(f"register must be True, False or 'auto', got {register!r}")
        if register is False:
            return
        if not _cuda.cuda_available():
            if register == "auto":
                return
            raise DeviceCapabilityError(
                "register=True needs a CUDA GPU visible to torch and cuda-python (`pip install cuda-python`); "
                "none is usable here. Use register='auto' to build an unregistered table")
        t0 = time.perf_counter()
        try:
            self._register_chunks(read_only=read_only, device=device)
        finally:
            self.timings["register"] = time.perf_counter() - t0

    def _register_chunks(self, *, read_only: bool, device: int | None) -> None:
        previous = torch.cuda.current_device()
        try:
            self._register_on(read_only=read_only, device=previous if device is None else device)
        finally:
            if torch.cuda.current_device() != previous:
                torch.cuda.set_device(previous)  # registering on another GPU must not move the caller

    def _register_on(self, *, read_only: bool, device: int) -> None:
        _cuda.ensure_context(device)
        _cuda.require_host_pointer_access(device)
        flags = _cuda.HOST_REGISTER_PORTABLE | _cuda.HOST_REGISTER_MAPPED
        if read_only and _cuda.read_only_register_supported(device):
            flags |= _cuda.HOST_REGISTER_READ_ONLY
            self._read_only_registered = True
        self._device = device
        for off, length in _chunks(self._map_bytes, REGISTER_CHUNK_BYTES):
            try:
                _cuda.host_register(self._base + off, length, flags)
            except RegistrationError as e:
                soft, _hard = _sys.memlock_limit()
                limit = "unlimited" if soft < 0 else _gib(soft)
                self._unregister()
                raise RegistrationError(
                    f"cudaHostRegister failed for {_gib(length)} at offset {_gib(off)} of a "
                    f"{_gib(self._map_bytes)} table: {e}. Raise `ulimit -l` (RLIMIT_MEMLOCK is {limit}), "
                    f"free host memory, or use the 'copy' backend with register=False") from None
            self._registered_chunks.append((off, length))
            dev_ptr = _cuda.host_device_pointer(self._base + off)
            if dev_ptr != self._base + off:
                self._unregister()
                raise DeviceCapabilityError(
                    f"the device pointer of registered memory ({dev_ptr:#x}) differs from its host pointer "
                    f"({self._base + off:#x}); uvaple's kernels need them equal. Use the 'copy' backend")

    def _unregister(self) -> None:
        self._read_only_registered = False
        while self._registered_chunks:
            off, _ = self._registered_chunks.pop()
            try:
                _cuda.host_unregister(self._base + off)
            except UvapleError as e:
                log.warning("unregistering host table chunk at offset %d failed: %s", off, e)

    # ------------------------------------------------------------------ properties
    def _live(self) -> None:
        if self._closed:
            raise TableClosedError("this HostTable was closed; build or attach a new one")

    @property
    def rows(self) -> int:
        return self._layout.rows

    @property
    def cols(self) -> int:
        return self._layout.cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self._layout.rows, self._layout.cols)

    @property
    def dtype(self) -> torch.dtype:
        return self._layout.dtype

    @property
    def itemsize(self) -> int:
        return self._layout.itemsize

    @property
    def row_bytes(self) -> int:
        return self._layout.row_bytes

    @property
    def stride_bytes(self) -> int:
        return self._layout.stride_bytes

    @property
    def stride(self) -> int:
        return self._layout.stride_bytes // self._layout.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes mapped for this table (header and page rounding included)."""
        return self._map_bytes

    @property
    def ptr(self) -> int:
        self._live()
        return self._base + self._data_offset

    @property
    def registered(self) -> bool:
        return bool(self._registered_chunks)

    @property
    def read_only_registered(self) -> bool:
        return self._read_only_registered

    @property
    def device_index(self) -> int | None:
        return self._device if self.registered else None

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self.registered else "unregistered")
        where = f"shared {self._name!r}" if self._name else "private"
        return (f"HostTable({self.rows}x{self.cols} {str(self.dtype).replace('torch.', '')}, "
                f"{_gib(self._map_bytes)} {where}, {state})")

    # ------------------------------------------------------------------ views
    def _raw_buffer(self):
        if self._buffer is None:
            # A subclass of the ctypes array type so the buffer can hold the table: any tensor or array view
            # keeps the buffer, hence the table, alive, so garbage collection never unmaps under a view.
            kind = type("_TableBuffer", (ctypes_char * self._layout.data_bytes,), {})
            buf = kind.from_address(self._base + self._data_offset)
            buf.owner = self
            self._buffer = buf
        return self._buffer

    @property
    def tensor(self) -> torch.Tensor:
        """CPU tensor ``[rows, cols]`` (strides ``(stride, 1)``) aliasing the table: Triton's argument."""
        self._live()
        if self._tensor is None:
            flat = torch.frombuffer(self._raw_buffer(), dtype=torch.uint8)
            typed = flat.view(self.dtype)
            self._tensor = typed.as_strided((self.rows, self.cols), (self.stride, 1))
        return self._tensor

    def bytes_view(self) -> np.ndarray:
        """numpy ``uint8`` array ``[rows, stride_bytes]`` over the table (for CPU gathers)."""
        self._live()
        arr = np.frombuffer(self._raw_buffer(), dtype=np.uint8)
        return arr.reshape(self.rows, self.stride_bytes)

    def cuda_view(self, device: int | None = None) -> torch.Tensor:
        """CUDA tensor ``[rows, cols]`` aliasing the registered host memory (for torch ops).

        Built through ``__cuda_array_interface__``; Triton kernels do not need it (``tensor`` suffices).
        """
        self._live()
        if not self.registered:
            raise DeviceCapabilityError("cuda_view() needs a registered table (build it where CUDA is usable)")
        itemsize = self.itemsize
        typestr = {1: "|u1", 2: "<i2", 4: "<i4"}[itemsize]
        holder = _CudaArrayHolder(self, (self.rows, self.stride), typestr)
        dev = torch.device("cuda", self._device if device is None else device)
        with torch.cuda.device(dev):
            raw = torch.as_tensor(holder, device=dev)
        return raw[:, : self.cols].view(self.dtype)

    # ------------------------------------------------------------------ filling
    def write_rows(self, src, row_start: int = 0, *, threads: int | None = None) -> None:
        """Copy ``src`` (tensor or ndarray ``[n, cols]``) into rows ``row_start .. row_start+n``.

        Runs in row blocks on several threads (torch's CPU copy drops the GIL); casts when dtypes differ.
        """
        self._live()
        t = _as_cpu_tensor(src)
        if t.dim() != 2 or t.shape[1] != self.cols:
            raise ValueError(f"write_rows expects [n, {self.cols}] rows, got shape {tuple(t.shape)}")
        n = t.shape[0]
        if row_start < 0 or row_start + n > self.rows:
            raise ValueError(f"rows {row_start}..{row_start + n} do not fit a table of {self.rows} rows")
        dst = self.tensor[row_start: row_start + n]
        block = max(1, (64 << 20) // max(1, self.stride_bytes))  # 64 MiB per copy call

        def copy(a: int, b: int) -> None:
            dst[a:a + b].copy_(t[a:a + b])

        _parallel(copy, _chunks(n, block), threads or default_threads())

    @classmethod
    def from_tensor(cls, src: torch.Tensor, *, dtype: torch.dtype | None = None, **kw) -> HostTable:
        """A table holding a copy of the 2-D tensor ``src`` (any device; cast to ``dtype`` if given)."""
        t = _as_cpu_tensor(src)
        if t.dim() != 2:
            raise ValueError(f"from_tensor expects a 2-D tensor [rows, cols], got shape {tuple(t.shape)}")
        return cls._filled(t.shape[0], t.shape[1], dtype or t.dtype, lambda table: table.write_rows(t), kw)

    @classmethod
    def from_numpy(cls, src: np.ndarray, *, dtype: torch.dtype | None = None, **kw) -> HostTable:
        """A table holding a copy of the 2-D array ``src``."""
        if not isinstance(src, np.ndarray):
            raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(src).__name__}")
        return cls.from_tensor(_as_cpu_tensor(src), dtype=dtype, **kw)

    @classmethod
    def from_safetensors(cls, path: str | os.PathLike, tensor_name: str, *, dtype: torch.dtype | None = None,
                         threads: int | None = None, **kw) -> HostTable:
        """Stream one named 2-D tensor of a safetensors file (or checkpoint directory) into a new table.

        Rows are read straight from the file into the table in blocks by several threads: no second
        full copy in RAM and nothing staged through the GPU. See :mod:`uvaple.uva.loading`.
        """
        from .loading import locate_tensor, stream_into

        info = locate_tensor(path, tensor_name)
        target = dtype or info.dtype
        return cls._filled(info.shape[0], info.shape[1], target,
                           lambda table: stream_into(table, info, threads=threads or default_threads()),
                           dict(kw, threads=threads))

    @classmethod
    def _filled(cls, rows: int, cols: int, dtype: torch.dtype, fill, kw: dict) -> HostTable:
        register = kw.pop("register", "auto")
        read_only = kw.pop("read_only", False)
        device = kw.pop("device", None)
        name = kw.pop("name", None)
        threads = kw.pop("threads", None)
        check_memory = kw.pop("check_memory", True)
        if kw:
            raise TypeError(f"unexpected arguments: {', '.join(kw)}")
        table = cls._allocate(rows, cols, dtype, name=name, threads=threads, check_memory=check_memory)
        try:
            t0 = time.perf_counter()
            fill(table)
            table.timings["fill"] = time.perf_counter() - t0
            table._register(register, read_only=read_only, device=device)
            if name is not None:
                table._mark_ready()
        except BaseException:
            table.close()
            raise
        return table

    # ------------------------------------------------------------------ lifetime
    def acquire(self) -> None:
        """Declare a host-side reader (e.g. a copy backend's worker). Until the matching :meth:`release`,
        interpreter exit leaves the mapping in place instead of unmapping it under that reader."""
        self._live()
        with self._lock:
            self._leases += 1

    def release(self) -> None:
        """End a lease taken with :meth:`acquire`."""
        with self._lock:
            self._leases = max(0, self._leases - 1)

    def _release_device_side(self) -> None:
        """Synchronise the devices and unregister, keeping the mapping (exit with a host reader alive)."""
        with self._lock:
            self._sync_and_unregister_locked()

    def _sync_and_unregister_locked(self) -> None:
        if self._registered_chunks:
            try:
                # Registration is portable: kernels on any GPU may be reading, not only the current one.
                _cuda.synchronize_devices()
            except UvapleError as e:
                log.warning("device synchronise before releasing a host table failed: %s", e)
            self._unregister()

    def close(self) -> None:
        """Wait until the device cannot be reading, then unregister, unmap and (owner) unlink. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tensor = None
            self._buffer = None
            self._sync_and_unregister_locked()
            try:
                _sys.munmap(self._base, self._map_bytes)
            except OSError as e:
                log.warning("munmap of a host table failed: %s", e)
            if self._fd is not None:
                try:
                    os.close(self._fd)
                except OSError as e:
                    log.warning("closing a shared table's descriptor failed: %s", e)
                self._fd = None
            if self._name is not None and self._owner:
                _unlink_quietly(self._segment_path(self._name))
            _live_tables.discard(self)

    def unlink(self) -> None:
        """Remove a named segment's name now (mappings stay valid until each process closes)."""
        if self._name is not None:
            _unlink_quietly(self._segment_path(self._name))

    def __enter__(self) -> HostTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


class _CudaArrayHolder:
    """Exposes a registered table's rows through ``__cuda_array_interface__`` (keeps the table alive)."""

    def __init__(self, table: HostTable, shape: tuple[int, int], typestr: str):
        self._table = table
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (table.ptr, False),
            "version": 3,
            "strides": None,
        }


def _as_cpu_tensor(src) -> torch.Tensor:
    if isinstance(src, np.ndarray):
        if src.dtype == np.float64:
            raise TypeError("float64 arrays are not supported; cast to float32 first")
        return torch.from_numpy(np.ascontiguousarray(src))
    if isinstance(src, torch.Tensor):
        return src.detach().to("cpu")
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(src).__name__}")


def _check_free_memory(nbytes: int, check: bool) -> None:
    if not check:
        return
    avail = _sys.mem_available_bytes()
    if avail is not None and nbytes > avail:
        raise HostMemoryError(
            f"a host table of {_gib(nbytes)} does not fit: only {_gib(avail)} of host memory is available "
            f"(MemAvailable). Free memory, shard or quantise the table, or pass check_memory=False where "
            f"memory grows on demand")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def table_gib(rows: int, cols: int, dtype: torch.dtype) -> float:
    """Bytes of a table as GiB, with its padded row stride."""
    lay = _check_shape(rows, cols, dtype)
    return lay.data_bytes / (1 << 30)


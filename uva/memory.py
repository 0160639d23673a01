"""The memory behind a host table: its geometry, the private mapping, pages committed, CUDA registration.

Design
------
What it owns. A table's geometry (:class:`Layout`, checked by :func:`check_shape`), the private mapping
of one (:func:`open_private` maps it, fills it through the caller's ``fill`` and registers it), and
:class:`Pages`: which pages of one mapping (private, or a shared segment's) are committed, committing
them, and their registration. It opens no shared segment and knows nothing of readiness
(:mod:`.sharing`), and it releases nothing itself: what it maps and registers is a
:class:`~uvaple.uva._region.Region`, released by the region when no view can read it.

Size. A mapping is exactly the table's size rounded up to a page (an anonymous private mapping through
libc, 2 MiB aligned, transparent huge pages advised). Not ``torch.empty(pin_memory=True)``: torch's
pinned allocator rounds each block up to a power of two, so a 100 GiB table would pin 128 GiB.

Row stride. Rows start on 16-byte boundaries, so a GPU thread reads a row with aligned 16-byte loads; the
stride is the row rounded up to 16 bytes and no more. Big PLE rows (15,360 B, 17,920 B, 128 KiB) are
multiples of 128 bytes already, so their requests stay 128-byte aligned (what EMOGI/PyTorch-Direct
found zero-copy reads need for the PCIe peak). For small rows a wider stride buys nothing: 160-byte
n-gram rows span two 128-byte lines at any 16-byte offset, and on the H200 their random-read rate was
the same at a 256-byte stride, which cost 60% more host memory (a 48 GiB fp8 table took 77 GiB).

Population. Pages are committed by several threads at once (``MADV_POPULATE_WRITE`` on disjoint
ranges; ctypes drops the GIL), so a shortage fails with ``HostMemoryError`` rather than as an OOM kill
later, and registration does not fault 25 million pages single-threaded. A shared segment's pages are
allocated by that same populate call (a full tmpfs makes it fail with EFAULT, named here, not a SIGBUS
later). Where the kernel lacks ``MADV_POPULATE_WRITE`` the pages are touched by hand (and a shared
segment's reserved first, :mod:`.sharing`).

Writers commit. When the table's own writers fill it (``HostTable.write_rows``, the safetensors loader),
nothing is pre-faulted up front: each writer thread commits the block it is about to write (the same
populate call, so the same named errors) and then copies into it, and registration follows the fill. The
fill allocates the pages while it writes them, instead of a separate pass zeroing all of them first: on
the H200 host, 48 GiB in a ``huge=always`` tmpfs took 1.4 s to pre-fault plus 1.8 s to fill, and 1.8 s to
fill unpopulated (``perf/studies/ready_probe.py``,
``perf/results/h200_2026-12-01/ready_probe/fill_allocates_48gib/``). Whatever the fill left untouched is
committed after it, before registration. A ``fill`` that may write any way it likes (``HostTable.shared``'s)
gets a pre-faulted table, as does ``HostTable.empty``.

Registration. ``cudaHostRegister(Portable | Mapped [| ReadOnly])`` through cuda-python, one call per
``REGISTER_CHUNK_BYTES`` (the driver's per-call limit: one call of >= 512 GiB fails), chunks registered by
several threads at once. Not in smaller pieces: the runtime refuses a copy whose host range spans two
registrations (``REGISTER_MIN_PIECE_BYTES``). The kernels use the host pointer itself
(``cudaDevAttrCanUseHostPointerForRegisteredMem`` is required and checked for every piece), so the pieces
form one contiguous device range. A piece refused rolls back every piece registered. A registration may
be deferred until the pages are written (:meth:`Pages.defer_registration`); it is then tried on one page
at once, so a GPU that cannot read this memory is an error before any filling.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass

import torch

from uvaple.dtypes import TABLE_DTYPES, dtype_name, fmt_bytes

from . import _region, cuda_runtime, segments, system
from .errors import DeviceCapabilityError, HostMemoryError, RegistrationError
from .workers import chunks, parallel

__all__ = ["Layout", "Pages", "SUPPORTED_DTYPES", "check_shape", "open_private", "row_stride_bytes",
           "register_piece_bytes", "check_free_memory",
           "check_register_arg", "wants_cuda", "check_device_pointer", "REGISTER_CHUNK_BYTES",
           "REGISTER_MIN_PIECE_BYTES", "POPULATE_CHUNK_BYTES"]

#: dtype -> its name in a shared table's header (safetensors' names)
SUPPORTED_DTYPES = {d: dtype_name(d) for d in TABLE_DTYPES}

# One cudaHostRegister call of >= 512 GiB fails (vLLM PR 51081); 128 GiB chunks stay far below that and
# keep the count of registrations small for ~100 GiB tables (one call).
REGISTER_CHUNK_BYTES = 128 << 30
# The smallest piece one registering thread takes. As large as a chunk: the CUDA runtime refuses a copy
# (cudaMemcpy, torch's copy_) whose host range spans two registrations (cudaErrorInvalidValue, seen on the
# H200 with 1 GiB pieces), and pieces bought nothing for shared segments (48 GiB: 3.4 s in 16 pieces,
# 2.4 s in one call; private 1.1 s vs 2.1 s). Tables above REGISTER_CHUNK_BYTES are registered in chunks
# by several threads.
REGISTER_MIN_PIECE_BYTES = REGISTER_CHUNK_BYTES

# Ranges handed to one populate/fallocate call: large enough that syscall overhead is nil, small enough
# that 16 threads share a 1 GiB table evenly.
POPULATE_CHUNK_BYTES = 64 << 20


# ---------------------------------------------------------------------------------------- sizing
def row_stride_bytes(row_bytes: int) -> int:
    """Bytes between row starts for a row of ``row_bytes`` (see Row stride in the module docstring)."""
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes}")
    return system.round_up(row_bytes, 16)


def register_piece_bytes(total: int, threads: int) -> int:
    """Bytes per ``cudaHostRegister`` call for a ``total``-byte mapping registered by ``threads`` threads:
    an even share (2 MiB granular), no smaller than ``REGISTER_MIN_PIECE_BYTES``, no larger than
    ``REGISTER_CHUNK_BYTES``."""
    share = system.round_up(-(-total // max(1, threads)), 2 << 20)
    return max(min(share, REGISTER_CHUNK_BYTES), min(REGISTER_MIN_PIECE_BYTES, REGISTER_CHUNK_BYTES), 1)


@dataclass(frozen=True)
class Layout:
    """A table's geometry: ``rows`` rows of ``cols`` values of ``dtype``, ``stride_bytes`` apart."""

    rows: int
    cols: int
    dtype: torch.dtype
    stride_bytes: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.cols * self.itemsize

    @property
    def data_bytes(self) -> int:
        return self.rows * self.stride_bytes


def check_shape(rows: int, cols: int, dtype: torch.dtype) -> Layout:
    """The layout of a new ``[rows, cols]`` table of ``dtype``, or a named error."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"HostTable dtype {dtype} is not supported; use one of {names}")
    if not (isinstance(rows, int) and isinstance(cols, int)) or isinstance(rows, bool) or rows <= 0 or cols <= 0:
        raise ValueError(f"HostTable needs a positive integer shape, got rows={rows!r}, cols={cols!r}")
    itemsize = dtype.itemsize
    return Layout(rows, cols, dtype, row_stride_bytes(cols * itemsize))


def check_free_memory(nbytes: int, check: bool) -> None:
    if not check:
        return
    avail = system.mem_available_bytes()
    if avail is not None and nbytes > avail:
        raise HostMemoryError(
            f"a host table of {fmt_bytes(nbytes)} does not fit: only {fmt_bytes(avail)} of host memory is available "
            f"(MemAvailable). Free memory, shard or quantise the table, or pass check_memory=False where "
            f"memory grows on demand")


# ---------------------------------------------------------------------------------------- private tables
def open_private(table_class, layout: Layout, fill, *, register: bool | str, read_only: bool, device: int | None,
                 threads: int, check_memory: bool):
    """A new private table of ``table_class`` (``HostTable``, passed in: its module imports this one),
    written by ``fill(table)`` (one of the table's own writers, which commit the pages they write; None
    for zeros, pre-faulted), its remaining pages committed, then registered (see the module docstring).
    A failure at any step releases the mapping before the error propagates."""
    _region.drain_deferred()
    writers_commit = fill is not None and system.populate_write_supported()
    map_bytes = system.round_up(layout.data_bytes, system.PAGE_SIZE)
    check_free_memory(map_bytes, check_memory)
    try:
        base = system.map_anonymous_aligned(map_bytes)
    except OSError as e:
        raise HostMemoryError(
            f"mmap of {fmt_bytes(map_bytes)} for a {layout.rows}x{layout.cols} {layout.dtype} table failed: "
            f"{e.strerror}. Free host memory or check `ulimit -v`.") from e
    pages = Pages(_region.Region(base, map_bytes, private=True))
    table = table_class(_layout=layout, _pages=pages, _data_offset=0, _name=None)  # holds the region from here
    try:
        system.madvise(base, map_bytes, system.MADV_HUGEPAGE)  # a hint: ignored where THP is off
        if not writers_commit:
            pages.populate(threads)
        if fill is not None:
            pages.writers_commit = writers_commit
            pages.timed("fill", fill, table)
            if writers_commit:
                pages.populate(threads)  # what the fill did not write; quick over written pages
        pages.register(register, read_only=read_only, device=device, threads=threads)
    except BaseException as e:
        _region.drop_views_of_failure(e)
        table.close()
        raise
    return table


# ---------------------------------------------------------------------------------------- registration checks
def check_register_arg(register) -> None:
    if register not in (True, False, "auto"):
        raise ValueError(f"register must be True, False or 'auto', got {register!r}")


def wants_cuda(register: bool | str) -> bool:
    """Whether ``register`` asks for a registration here; ``True`` without CUDA is an error."""
    check_register_arg(register)
    if register is False:
        return False
    if not cuda_runtime.cuda_available():
        if register == "auto":
            return False
        if cuda_runtime.in_bad_fork():
            raise DeviceCapabilityError(
                "register=True in a process forked after its parent initialised CUDA: CUDA cannot be used in "
                "such a child. Start it with the 'spawn' method, or build the table with register=False")
        raise DeviceCapabilityError(
            "register=True needs a CUDA GPU visible to torch and cuda-python (`pip install cuda-python`); "
            "none is usable here. Use register='auto' to build an unregistered table")
    return True


def check_device_pointer(ptr: int) -> None:
    """The kernels read registered memory at its host address: its device pointer must be that address."""
    dev_ptr = cuda_runtime.host_device_pointer(ptr)
    if dev_ptr != ptr:
        raise DeviceCapabilityError(
            f"the device pointer of registered memory ({dev_ptr:#x}) differs from its host pointer ({ptr:#x}); "
            "uvaple's kernels need them equal. Use the 'copy' backend")


# ---------------------------------------------------------------------------------------- pages
class Pages:
    """The pages of one mapping (``region``): which are committed, committing them, registering them.

    ``name``: the shared table's name, for errors (None: private). ``timings``: seconds spent in
    ``populate``, ``fill`` and ``register`` (the table hands out this dict as its own ``timings``).
    """

    def __init__(self, region: _region.Region, name: str | None = None) -> None:
        self.region = region
        self.name = name
        self.timings: dict[str, float] = {}
        self.committed = False  # every page faulted in (populated)
        self.writers_commit = False  # writers commit their pages (rows may be present before committed)
        self.deferred: dict | None = None  # a deferred registration: register, read_only, device, threads
        self._commits: list[tuple[int, int]] = []  # byte ranges the writers committed
        self._lock = threading.Lock()

    def timed(self, what: str, fn, *args) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
        finally:
            self.timings[what] = time.perf_counter() - t0

    # ------------------------------------------------------------------ commit
    def populate(self, threads: int, write: bool = True) -> None:
        """Commit every page no writer has committed, on ``threads`` threads (``write=False``: map the
        pages of a segment another process wrote, without writing)."""
        self.timed("populate", self._populate_ranges, threads, write)
        self.committed = True
        self.writers_commit = False
        self._commits = []

    def _populate_ranges(self, threads: int, write: bool) -> None:
        ranges = [(lo + off, n) for lo, hi in self._uncommitted() for off, n in chunks(hi - lo, POPULATE_CHUNK_BYTES)]
        parallel(lambda off, n: self.commit(off, n, write), ranges, threads)

    def _uncommitted(self) -> list[tuple[int, int]]:
        """Byte ranges ``(lo, hi)`` of the mapping no writer has committed (all of it when none has)."""
        with self._lock:
            done = sorted(self._commits)
        gaps, at = [], 0
        for lo, hi in done:
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < self.region.length:
            gaps.append((at, self.region.length))
        return gaps

    def commit(self, off: int, length: int, write: bool = True) -> None:
        """Fault bytes ``off .. off+length`` of the mapping in (allocating them), or a named error. Never
        changes a written row (the no-populate fallback zeroes pages only before any write)."""
        base, total = self.region.base, self.region.length
        err = system.madvise(base + off, length, system.MADV_POPULATE_WRITE if write else system.MADV_POPULATE_READ)
        if err == 0:
            return
        if err in (22, 1):  # EINVAL/EPERM: kernel without MADV_POPULATE_*; touch pages instead
            view = memoryview((ctypes.c_ubyte * length).from_address(base + off)).cast("B")
            if write and not self.writers_commit:  # nothing written yet: the pages hold zeros
                system.memset(base + off, 0, length)
            else:
                sum(view[:: system.PAGE_SIZE])
            return
        if not self.region.private and err == 14:  # EFAULT: shmem refused a page (the tmpfs is full)
            where = self.region.segment.directory if self.region.segment else segments.SHM_DIR
            raise HostMemoryError(
                f"allocating {fmt_bytes(total)} for shared table {self.name!r} in {where} failed: "
                f"the filesystem is full. Free space there (`uvaple shm` lists uvaple's segments), enlarge "
                f"it (mount -o remount,size=... {where}) or drop name= to use private memory")
        raise HostMemoryError(
            f"pre-faulting {fmt_bytes(total)} of host memory failed ({os.strerror(err)}): not enough free "
            f"memory for this table. Free memory, use a smaller table, or quantise it")

    def commit_written(self, lo: int, hi: int) -> None:
        """A writer is about to write bytes ``lo .. hi``: commit their pages (see Writers commit); the
        populate after the fill skips them. Nothing to do unless the writers commit."""
        if not self.writers_commit or hi <= lo:
            return
        lo -= lo % system.PAGE_SIZE
        hi = min(system.round_up(hi, system.PAGE_SIZE), self.region.length)
        self.commit(lo, hi - lo)
        with self._lock:
            self._commits.append((lo, hi))

    # ------------------------------------------------------------------ registration
    def register(self, register: bool | str, *, read_only: bool, device: int | None, threads: int = 1) -> None:
        """Register the whole mapping where ``register`` asks for it (see Registration)."""
        if wants_cuda(register):
            self.timed("register", self._register_chunks, read_only, device, threads)

    def defer_registration(self, register: bool | str, *, read_only: bool, device: int | None,
                           threads: int) -> None:
        """Register once the pages are written (:meth:`finish_deferred`); check now, on the first page,
        that registering works here."""
        self._check_registration(register, read_only=read_only, device=device)
        self.deferred = dict(register=register, read_only=read_only, device=device, threads=threads)

    def finish_deferred(self, write: bool) -> None:
        """The pages are written: commit what was not, then make the deferred registration (if any)."""
        deferred, self.deferred = self.deferred, None
        if deferred is None:
            return
        try:
            if not self.committed:
                self.populate(deferred["threads"], write=write)
        except BaseException:
            self.deferred = deferred
            raise
        self.register(deferred["register"], read_only=deferred["read_only"], device=deferred["device"],
                      threads=deferred["threads"])

    def _check_registration(self, register: bool | str, *, read_only: bool, device: int | None) -> None:
        """Register the mapping's first page and release it, so that a GPU or driver that cannot read
        this memory is an error now, not after the fill."""
        if not wants_cuda(register):
            return
        previous = torch.cuda.current_device()
        dev = previous if device is None else device
        base = self.region.base
        try:
            cuda_runtime.ensure_context(dev)
            cuda_runtime.require_host_pointer_access(dev)
            try:
                cuda_runtime.host_register(base, system.PAGE_SIZE,
                                           cuda_runtime.HOST_REGISTER_PORTABLE | cuda_runtime.HOST_REGISTER_MAPPED)
            except RegistrationError as e:
                raise RegistrationError(f"cudaHostRegister of this table's memory failed: {e}. Use the 'copy' "
                                        "backend with register=False") from None
            try:
                check_device_pointer(base)
            finally:
                cuda_runtime.host_unregister(base)
        finally:
            if torch.cuda.current_device() != previous:
                torch.cuda.set_device(previous)

    def _register_chunks(self, read_only: bool, device: int | None, threads: int = 1) -> None:
        previous = torch.cuda.current_device()
        try:
            self._register_on(read_only=read_only, device=previous if device is None else device, threads=threads)
        finally:
            if torch.cuda.current_device() != previous:
                torch.cuda.set_device(previous)  # registering on another GPU must not move the caller

    def _register_on(self, *, read_only: bool, device: int, threads: int = 1) -> None:
        region = self.region
        cuda_runtime.ensure_context(device)
        cuda_runtime.require_host_pointer_access(device)
        flags = cuda_runtime.HOST_REGISTER_PORTABLE | cuda_runtime.HOST_REGISTER_MAPPED
        if read_only and cuda_runtime.read_only_register_supported(device):
            flags |= cuda_runtime.HOST_REGISTER_READ_ONLY
            region.read_only = True
        region.device = device
        pieces = chunks(region.length, register_piece_bytes(region.length, threads))
        lock = threading.Lock()
        main = threading.get_ident()

        def register_piece(off: int, length: int) -> None:
            if threading.get_ident() != main:
                cuda_runtime.ensure_context(device)  # the runtime's current device is per thread
            try:
                cuda_runtime.host_register(region.base + off, length, flags)
            except RegistrationError as e:
                soft, _hard = system.memlock_limit()
                limit = "unlimited" if soft < 0 else fmt_bytes(soft)
                raise RegistrationError(
                    f"cudaHostRegister failed for {fmt_bytes(length)} at offset {fmt_bytes(off)} of a "
                    f"{fmt_bytes(region.length)} table: {e}. Raise `ulimit -l` (RLIMIT_MEMLOCK is {limit}), "
                    f"free host memory, or use the 'copy' backend with register=False") from None
            with lock:
                region.chunks.append((off, length))
            check_device_pointer(region.base + off)

        try:
            parallel(register_piece, pieces, min(threads, len(pieces)), name="uvaple-register")
        except BaseException:
            region.unregister()  # every piece that was registered, whichever thread failed
            raise
        region.chunks.sort()

"""``HostTable``: one 2-D table in pinned, mapped host memory that a GPU reads through UVA.

Design
------
Memory. The table is an anonymous private mapping (``mmap`` through libc, 2 MiB aligned, transparent
huge pages advised) or, when it has a ``name``, a POSIX shared-memory segment under ``/dev/shm`` that
other processes (tensor-parallel ranks, data-parallel replicas on one host) attach without a second copy
(:mod:`uvaple.uva.segments`: create-or-attach, bounded waits, dead creators detected, the last process
out unlinks). The mapping is exactly the table's size rounded up to a page: ``torch.empty(pin_memory=True)``
rounds pinned blocks up to a power of two (a 100 GiB table would pin 128 GiB; see ../shared/DESIGN.md),
this does not.

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
later); only where the kernel lacks ``MADV_POPULATE_WRITE`` are they reserved first with
``posix_fallocate``, because the fallback then touches them by hand. (Reserving first as well cost 8 s for
48 GiB on the H200 host, more than populating: the pages were allocated twice over.)

When the table's own writers fill it (``from_tensor``, ``from_safetensors``, and the creator of a
``defer_ready`` shared table writing with :meth:`HostTable.write_rows`), nothing is pre-faulted up front:
each writer thread commits the block it is about to write (the same populate call, so the same named
errors) and then copies into it, and registration follows the fill. The fill allocates the pages while it
writes them, instead of a separate pass zeroing all of them first: on the H200 host, 48 GiB in a
``huge=always`` tmpfs took 1.4 s to pre-fault plus 1.8 s to fill, and 1.8 s to fill unpopulated
(``perf/ready_probe.py``). Whatever the fill left untouched is committed after it, before registration.
A ``fill`` callable given to :meth:`HostTable.shared` may write any way it likes, so that table is
pre-faulted first, as is :meth:`HostTable.empty`.

Registration. ``cudaHostRegister(Portable | Mapped [| ReadOnly])`` through cuda-python, one call per
``REGISTER_CHUNK_BYTES`` (the driver's per-call limit: one call of >= 512 GiB fails), chunks registered by
several threads at once. Not in smaller pieces: the runtime refuses a copy whose host range spans two
registrations (``REGISTER_MIN_PIECE_BYTES``). The kernels use the host pointer itself
(``cudaDevAttrCanUseHostPointerForRegisteredMem`` is required and checked for every piece), so the pieces
form one contiguous device range. A piece refused rolls back every piece registered.

Lifetime (:mod:`uvaple.uva._region`). The memory is released when nothing can read it any more, never
before: every view handed out (``tensor``, ``bytes_view()``, ``cuda_view()``, and what is built from them,
such as state-dict tensors and the backends' arguments) holds the mapping, and so does the table.
``close()`` lets go of the table's hold: with no view left the device is synchronised, the memory
unregistered, unmapped and (last process out) unlinked at once; otherwise that happens when the last
view is gone, and until then a view reads the table's bytes. A table dropped without ``close()`` is
released the same way. The table object itself refuses use after ``close()``
(:class:`~uvaple.uva.errors.TableClosedError`) and in a forked child
(:class:`~uvaple.uva.errors.TableForkedError`).

Fork. A private table is advised ``MADV_WIPEONFORK``: a ``fork()`` after registration neither shares the
parent's pinned pages copy-on-write (which could leave the device reading a page the parent no longer
owns) nor copies the table. A forked child sees zeros through any view it inherited, and its copy of the
table object raises ``TableForkedError``. A shared table's pages stay shared: a child's inherited views
read the table, and while the child keeps that mapping the segment counts as attached (closing the
child's copy of the table object lets go of it). A child that needs to use the table attaches it itself
(``HostTable.attach`` / ``HostTable.shared``), registering in its own CUDA context. A child forked after
the parent registered a shared table also inherits the GPU driver's device descriptors, and with them the
parent's registration, which references the segment: it then counts as attached until that child exits
as well, even if the parent is gone (``uvaple shm clean`` removes it after that).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from uvaple._util import SAFETENSORS_DTYPES, TABLE_DTYPES, dtype_name, fmt_bytes

from . import _cuda, _region, _sys, segments
from .errors import (
    DeviceCapabilityError,
    HostMemoryError,
    RegistrationError,
    SharedSegmentError,
    TableClosedError,
    TableForkedError,
)

log = logging.getLogger("uvaple.uva")

__all__ = ["HostTable", "row_stride_bytes", "SUPPORTED_DTYPES"]

#: dtype -> its name in a shared table's header (safetensors' names)
SUPPORTED_DTYPES = {d: dtype_name(d) for d in TABLE_DTYPES}
_DTYPE_BY_NAME = {k: v for k, v in SAFETENSORS_DTYPES.items() if v in TABLE_DTYPES}

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
_POPULATE_CHUNK_BYTES = 64 << 20

# Default bound of HostTable.shared's wait for another process to fill the table (seconds): a 100 GB
# fill from the page cache takes tens of seconds, from a cold disk minutes; pass timeout= for those.
DEFAULT_SHARED_TIMEOUT_S = 30.0

ctypes_char = ctypes.c_ubyte


def row_stride_bytes(row_bytes: int) -> int:
    """Bytes between row starts for a row of ``row_bytes`` (see the module docstring)."""
    if row_bytes <= 0:
        raise ValueError(f"row_bytes must be positive, got {row_bytes}")
    return _sys.round_up(row_bytes, 16)


def default_threads() -> int:
    """Threads for populate/load: 16 measured best for 32 GiB on the H200 host (DESIGN.md)."""
    return max(1, min(16, os.cpu_count() or 1))


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

    def header(self) -> dict:
        return {"rows": self.rows, "cols": self.cols, "dtype": SUPPORTED_DTYPES[self.dtype],
                "stride_bytes": self.stride_bytes, "data_offset": segments.DATA_OFFSET}


def _check_shape(rows: int, cols: int, dtype: torch.dtype) -> _Layout:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"HostTable dtype {dtype} is not supported; use one of {names}")
    if not (isinstance(rows, int) and isinstance(cols, int)) or isinstance(rows, bool) or rows <= 0 or cols <= 0:
        raise ValueError(f"HostTable needs a positive integer shape, got rows={rows!r}, cols={cols!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _Layout(rows, cols, dtype, row_stride_bytes(cols * itemsize))


def _layout_of(meta: dict, path: str) -> _Layout:
    try:
        layout = _Layout(int(meta["rows"]), int(meta["cols"]), _DTYPE_BY_NAME[meta["dtype"]],
                         int(meta["stride_bytes"]))
        offset = int(meta["data_offset"])
    except (KeyError, TypeError, ValueError) as e:
        raise SharedSegmentError(f"{path} has a corrupt uvaple header: {e!r}") from None
    if offset != segments.DATA_OFFSET or layout.rows <= 0 or layout.cols <= 0 or \
            layout.stride_bytes < layout.row_bytes or layout.stride_bytes % 16:
        raise SharedSegmentError(f"{path} has a header this uvaple cannot map (data offset {offset}, "
                                 f"{layout.rows}x{layout.cols}, stride {layout.stride_bytes} B)")
    return layout




def _parallel(fn, ranges, threads: int, name: str = "uvaple-populate") -> None:
    """Run ``fn(start, length)`` over ``ranges`` on ``threads`` threads; re-raise the first failure (every
    range started has finished by then)."""
    if threads <= 1 or len(ranges) <= 1:
        for r in ranges:
            fn(*r)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name) as pool:
        futures = [pool.submit(fn, *r) for r in ranges]
        first = None
        for f in futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - collect, then raise the first
                first = first or e
        if first is not None:
            raise first


def register_piece_bytes(total: int, threads: int) -> int:
    """Bytes per ``cudaHostRegister`` call for a ``total``-byte mapping registered by ``threads`` threads:
    an even share (2 MiB granular), no smaller than ``REGISTER_MIN_PIECE_BYTES``, no larger than
    ``REGISTER_CHUNK_BYTES``."""
    share = _sys.round_up(-(-total // max(1, threads)), 2 << 20)
    return max(min(share, REGISTER_CHUNK_BYTES), min(REGISTER_MIN_PIECE_BYTES, REGISTER_CHUNK_BYTES), 1)


def _chunks(total: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


@functools.lru_cache(maxsize=64)
def _buffer_type(nbytes: int) -> type:
    # A subclass of the ctypes array type, so that an instance can carry the anchor: every tensor or array
    # built over the buffer keeps it, hence the mapping, alive.
    return type("_TableBuffer", (ctypes_char * nbytes,), {"__slots__": ("anchor",)})


class HostTable:
    """A ``[rows, cols]`` table in host memory that the GPU can read (see the module docstring).

    Build one with :meth:`empty`, :meth:`from_tensor`, :meth:`from_numpy`, :meth:`from_safetensors`,
    :meth:`shared` (create-or-attach a named table from several processes) or :meth:`attach` (a named
    table another process made). Use it as a context manager or call :meth:`close`; a table dropped
    without ``close()`` is released all the same.
    """

    # ------------------------------------------------------------------ construction
    def __init__(self, *, _layout: _Layout, _region: _region.Region, _data_offset: int, _name: str | None,
                 _created: bool = True):
        self._layout = _layout
        self._region = _region
        self._anchor: _region.Anchor | None = _anchor_of(_region)
        self._data_offset = _data_offset
        self._name = _name
        self._created = _created
        self._closed = False
        self._lock = threading.RLock()
        self._tensor: torch.Tensor | None = None
        self._buffer = None
        self.timings: dict[str, float] = {}  # seconds spent in populate / fill / register
        self._committed = False  # every page faulted in (populated)
        self._writers_commit = False  # writers commit their pages (rows may be present before _committed)
        self._commits: list[tuple[int, int]] = []  # byte ranges the writers committed
        self._pending: dict | None = None  # a deferred registration: (register, read_only, device, threads)

    @classmethod
    def empty(cls, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, *, name: str | None = None,
              register: bool | str = "auto", read_only: bool = False, device: int | None = None,
              threads: int | None = None, check_memory: bool = True, directory: str | None = None) -> HostTable:
        """Allocate, pre-fault and (optionally) register a table; its contents are zero.

        Parameters
        ----------
        rows, cols : int
            Table shape: ``rows`` embeddings of ``cols`` values.
        dtype : torch.dtype
            Element type (bf16, fp16, fp32, int8, uint8, fp8).
        name : str, optional
            Create a named shared table other processes can :meth:`attach`. A live table of that name is
            an error (:meth:`shared` attaches to it instead); one whose creator died is replaced.
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
        return cls._filled(rows, cols, dtype, None, dict(name=name, register=register, read_only=read_only,
                                                         device=device, threads=threads,
                                                         check_memory=check_memory, directory=directory))

    @classmethod
    def shared(cls, name: str, rows: int, cols: int, dtype: torch.dtype = torch.bfloat16, *,
               timeout: float = DEFAULT_SHARED_TIMEOUT_S, fill: Callable[[HostTable], None] | None = None,
               tag: str | None = None, register: bool | str = "auto", read_only: bool = False,
               device: int | None = None, threads: int | None = None, check_memory: bool = True,
               defer_ready: bool = False, directory: str | None = None) -> HostTable:
        """Create-or-attach the named shared table ``name``: the node holds it once, whoever asks first.

        Any number of processes (tensor-parallel ranks, data-parallel replicas) may call this at the same
        moment. Exactly one creates the segment and runs ``fill(table)`` on it (then it is marked ready);
        the others wait, at most ``timeout`` seconds, and attach when it is ready. Each process registers
        its own mapping. ``table.created`` tells which one this process was.

        * A segment whose creator died before it was ready is detected (its build lock was released by
          the kernel) and created again, not waited on. One left ready by a dead creator is attached.
        * ``fill`` raising: the half-built segment is removed and waiting processes get that error.
        * A ready segment of another shape, dtype or ``tag`` is an error if some process has it open, and
          replaced if none has (an orphan of an earlier run).

        Parameters
        ----------
        name : str
            1-200 letters, digits, ``_``, ``-`` or ``.`` (the file is ``/dev/shm/uvaple.<name>``).
        directory : str, optional
            A tmpfs directory for the segment instead of ``/dev/shm`` (e.g. a ``huge=always`` mount, for
            2 MiB pages); every process sharing the table gives the same one.
        rows, cols, dtype :
            The table, as in :meth:`empty`.
        timeout : float
            Seconds to wait for another process's fill (> 0).
        fill : callable, optional
            ``fill(table)`` writes the rows (e.g. ``lambda t: t.write_rows(weights)``), run by the creator
            only, before registration. Without it the table is zeros.
        tag : str, optional
            What the table holds (a checkpoint's path and size, say): attaching requires the same tag.
        register, read_only, device, threads, check_memory :
            As in :meth:`empty`.
        defer_ready : bool
            For fills that happen after construction (a serving engine's weight loader): the creator
            gets its table at once, still ``building``, fills it with :meth:`write_rows` and calls
            :meth:`mark_ready` (or :meth:`mark_failed`); the others map it at once, without waiting, and
            call :meth:`wait_ready` before the first read. No process waits during construction, so
            ranks that meet in a collective before the fill ends cannot deadlock on it. Such a table is
            registered when it is ready (in :meth:`mark_ready` / :meth:`wait_ready`), after its pages
            were written; construction checks at once that registration works here (one page is
            registered and released), so a GPU that cannot read host memory is still an error before
            any loading.

        Raises
        ------
        SharedSegmentTimeout
            The creator (named, alive or not) did not finish within ``timeout``.
        SharedSegmentError
            A mismatch, the creator's fill failure, or a file of that name that is not uvaple's.
        """
        layout = _check_shape(rows, cols, dtype)
        meta = dict(layout.header(), tag=tag)
        want = dict(layout.header(), tag=tag)
        if defer_ready and fill is not None:
            raise TypeError("defer_ready and fill exclude each other: with defer_ready the creator fills the "
                            "table itself and calls mark_ready()")
        return cls._open_shared(layout, name, meta, want, fill=fill, timeout=timeout,
                                mode="deferred" if defer_ready else "shared", register=register,
                                read_only=read_only, device=device, threads=threads, check_memory=check_memory,
                                directory=directory)

    @classmethod
    def attach(cls, name: str, *, rows: int | None = None, cols: int | None = None,
               dtype: torch.dtype | None = None, tag: str | None = None, register: bool | str = "auto",
               read_only: bool = False, device: int | None = None, threads: int | None = None,
               directory: str | None = None) -> HostTable:
        """Map the ready named table ``name`` another process created (:meth:`empty`, a loader, :meth:`shared`).

        ``rows``/``cols``/``dtype``/``tag``, when given, must match the segment or ``SharedSegmentError``
        is raised. A segment still being filled is an error (:meth:`shared` waits for it instead). The
        attaching process registers its own mapping (registration is per process).
        """
        want = {"rows": rows, "cols": cols, "dtype": SUPPORTED_DTYPES.get(dtype, dtype) if dtype else None,
                "tag": tag}
        return cls._open_shared(None, name, {}, want, fill=None, timeout=None, mode="attach",
                                register=register, read_only=read_only, device=device, threads=threads,
                                check_memory=True, directory=directory)

    @classmethod
    def _open_shared(cls, layout: _Layout | None, name: str, meta: dict, want: dict, *, fill, timeout,
                     mode: str, register, read_only: bool, device, threads, check_memory: bool,
                     directory: str | None = None, fill_commits: bool = False) -> HostTable:
        """``fill_commits``: ``fill`` writes through :meth:`write_rows` / the loader, which commit the pages
        they write, so the creator does not pre-fault first."""
        _region.drain_deferred()
        _check_register_arg(register)
        threads = threads or default_threads()
        path = segments.segment_path(name, directory)
        directory = os.path.dirname(path)
        if layout is not None:
            map_bytes = segments.DATA_OFFSET + _sys.round_up(layout.data_bytes, _sys.PAGE_SIZE)
            _check_free_memory(map_bytes, check_memory)
            _check_shm_space(name, map_bytes, check_memory, directory)
        else:
            map_bytes = 0
        if mode == "attach":
            seg = segments.attach(name, want, directory=directory)
        elif mode == "create":
            seg = segments.create(name, meta, map_bytes, directory=directory)
        else:
            seg = segments.create_or_attach(name, meta, want, map_bytes, timeout=timeout,
                                            attach_building=mode == "deferred", directory=directory)
        table = None
        try:
            if not seg.created:
                layout = _layout_of(seg.header() or {}, path)
                map_bytes = segments.DATA_OFFSET + _sys.round_up(layout.data_bytes, _sys.PAGE_SIZE)
            elif not _sys.populate_write_supported():  # the populate fallback below touches pages by hand
                _parallel(lambda off, n: _reserve(seg.fd, off, n, name, map_bytes, directory),
                          _chunks(map_bytes, _POPULATE_CHUNK_BYTES), threads)
            try:
                base = _sys.mmap(map_bytes, _sys.PROT_READ | _sys.PROT_WRITE, _sys.MAP_SHARED, seg.fd)
            except OSError as e:
                raise SharedSegmentError(f"mapping shared table {name!r} ({fmt_bytes(map_bytes)}) failed: "
                                         f"{e.strerror}") from e
            region = _region.Region(base, map_bytes, private=False, segment=seg)
            table = cls(_layout=layout, _region=region, _data_offset=segments.DATA_OFFSET, _name=name,
                        _created=seg.created)
            _sys.madvise(base, map_bytes, _sys.MADV_HUGEPAGE)
            writers_commit = seg.created and _sys.populate_write_supported()
            if mode == "deferred" and (seg.created or not seg.is_ready):
                # Filled after construction: the writes commit their pages; registered once ready.
                table._check_registration(register, read_only=read_only, device=device)
                if writers_commit:
                    table._writers_commit = True
                elif seg.created:
                    table._populate(threads)
                table._pending = dict(register=register, read_only=read_only, device=device, threads=threads)
                return table
            fill_commits = fill_commits and fill is not None and writers_commit
            # Map the pages into this process's page tables now, not on the GPU's first reads.
            if fill_commits:
                table._writers_commit = True
            else:
                table._populate(threads, write=seg.created)
            if seg.created:
                if fill is not None:
                    table._timed("fill", fill, table)
                    if fill_commits:
                        table._populate(threads)  # what the fill did not write; quick over written pages
                seg.ready()
            table._register(register, read_only=read_only, device=device, threads=threads)
            return table
        except BaseException as e:
            # each step on its own: one failing must not skip the others
            try:
                if seg.created and seg.fd is not None and (seg.header() or {}).get("state") != "ready":
                    seg.fail(e)  # waiters get this error; the half-built file is removed
            except Exception as cleanup:  # noqa: BLE001
                log.warning("failing shared table %r: %s", name, cleanup)
            _drop_views_of_failure(e)
            try:
                if table is not None:
                    table.close()
                else:
                    seg.detach()
            except Exception as cleanup:  # noqa: BLE001
                log.warning("releasing shared table %r after an error: %s", name, cleanup)
            raise

    @classmethod
    def _allocate_private(cls, layout: _Layout, threads: int, check_memory: bool,
                          populate: bool = True) -> HostTable:
        map_bytes = _sys.round_up(layout.data_bytes, _sys.PAGE_SIZE)
        _check_free_memory(map_bytes, check_memory)
        try:
            base = _sys.map_anonymous_aligned(map_bytes)
        except OSError as e:
            raise HostMemoryError(
                f"mmap of {fmt_bytes(map_bytes)} for a {layout.rows}x{layout.cols} {layout.dtype} table failed: "
                f"{e.strerror}. Free host memory or check `ulimit -v`.") from e
        region = _region.Region(base, map_bytes, private=True)
        table = cls(_layout=layout, _region=region, _data_offset=0, _name=None)
        try:
            _sys.madvise(base, map_bytes, _sys.MADV_HUGEPAGE)  # a hint: ignored where THP is off
            if populate:
                table._populate(threads)
        except BaseException:
            table.close()
            raise
        return table

    # ------------------------------------------------------------------ population and registration
    def _timed(self, what: str, fn, *args) -> None:
        t0 = time.perf_counter()
        try:
            fn(*args)
        finally:
            self.timings[what] = time.perf_counter() - t0

    def _populate(self, threads: int, write: bool = True) -> None:
        self._timed("populate", self._populate_ranges, threads, write)
        self._committed = True
        self._writers_commit = False
        self._commits = []

    def _populate_ranges(self, threads: int, write: bool) -> None:
        ranges = [(lo + off, n) for lo, hi in self._uncommitted() for off, n in _chunks(hi - lo, _POPULATE_CHUNK_BYTES)]
        _parallel(lambda off, n: self._commit(off, n, write), ranges, threads)

    def _uncommitted(self) -> list[tuple[int, int]]:
        """Byte ranges ``(lo, hi)`` of the mapping no writer has committed (all of it when none has)."""
        with self._lock:
            done = sorted(self._commits)
        gaps, at = [], 0
        for lo, hi in done:
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < self._region.length:
            gaps.append((at, self._region.length))
        return gaps

    def _commit(self, off: int, length: int, write: bool = True) -> None:
        """Fault bytes ``off .. off+length`` of the mapping in (allocating them), or a named error. Never
        changes a written row (the no-populate fallback zeroes pages only before any write)."""
        base, total = self._region.base, self._region.length
        err = _sys.madvise(base + off, length, _sys.MADV_POPULATE_WRITE if write else _sys.MADV_POPULATE_READ)
        if err == 0:
            return
        if err in (22, 1):  # EINVAL/EPERM: kernel without MADV_POPULATE_*; touch pages instead
            view = memoryview((ctypes_char * length).from_address(base + off)).cast("B")
            if write and not self._writers_commit:  # nothing written yet: the pages hold zeros
                _sys.memset(base + off, 0, length)
            else:
                sum(view[:: _sys.PAGE_SIZE])
            return
        if not self._region.private and err == 14:  # EFAULT: shmem refused a page (the tmpfs is full)
            where = self._region.segment.directory if self._region.segment else segments.SHM_DIR
            raise HostMemoryError(
                f"allocating {fmt_bytes(total)} for shared table {self._name!r} in {where} failed: "
                f"the filesystem is full. Free space there (`uvaple shm` lists uvaple's segments), enlarge "
                f"it (mount -o remount,size=... {where}) or drop name= to use private memory")
        raise HostMemoryError(
            f"pre-faulting {fmt_bytes(total)} of host memory failed ({os.strerror(err)}): not enough free "
            f"memory for this table. Free memory, use a smaller table, or quantise it")

    def _commit_rows(self, row: int, n: int) -> None:
        """Commit the pages of rows ``row .. row+n`` before a writer copies into them (see Population)."""
        if not self._writers_commit or n <= 0:
            return
        lo = self._data_offset + row * self.stride_bytes
        hi = self._data_offset + (row + n) * self.stride_bytes
        lo -= lo % _sys.PAGE_SIZE
        hi = min(_sys.round_up(hi, _sys.PAGE_SIZE), self._region.length)
        self._commit(lo, hi - lo)
        with self._lock:
            self._commits.append((lo, hi))  # the populate after the fill skips these

    def _check_registration(self, register: bool | str, *, read_only: bool, device: int | None) -> None:
        """Before a deferred registration: register this table's first page and release it, so that a GPU
        or driver that cannot read this memory is an error now, not after the fill."""
        if not self._wants_cuda(register):
            return
        previous = torch.cuda.current_device()
        dev = previous if device is None else device
        base = self._region.base
        try:
            _cuda.ensure_context(dev)
            _cuda.require_host_pointer_access(dev)
            try:
                _cuda.host_register(base, _sys.PAGE_SIZE, _cuda.HOST_REGISTER_PORTABLE | _cuda.HOST_REGISTER_MAPPED)
            except RegistrationError as e:
                raise RegistrationError(f"cudaHostRegister of this table's memory failed: {e}. Use the 'copy' "
                                        "backend with register=False") from None
            try:
                _check_device_pointer(base)
            finally:
                _cuda.host_unregister(base)
        finally:
            if torch.cuda.current_device() != previous:
                torch.cuda.set_device(previous)

    def _finish_pending(self, write: bool) -> None:
        """A deferred table is ready: commit what was not written, then register (see ``defer_ready``)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            if not self._committed:
                self._populate(pending["threads"], write=write)
        except BaseException:
            self._pending = pending
            raise
        self._register(pending["register"], read_only=pending["read_only"], device=pending["device"],
                       threads=pending["threads"])

    def _register(self, register: bool | str, *, read_only: bool, device: int | None, threads: int = 1) -> None:
        if self._wants_cuda(register):
            self._timed("register", self._register_chunks, read_only, device, threads)

    @staticmethod
    def _wants_cuda(register: bool | str) -> bool:
        """Whether ``register`` asks for a registration here; ``True`` without CUDA is an error."""
        _check_register_arg(register)
        if register is False:
            return False
        if not _cuda.cuda_available():
            if register == "auto":
                return False
            if _cuda.in_bad_fork():
                raise DeviceCapabilityError(
                    "register=True in a process forked after its parent initialised CUDA: CUDA cannot be used in "
                    "such a child. Start it with the 'spawn' method, or build the table with register=False")
            raise DeviceCapabilityError(
                "register=True needs a CUDA GPU visible to torch and cuda-python (`pip install cuda-python`); "
                "none is usable here. Use register='auto' to build an unregistered table")
        return True

    def _register_chunks(self, read_only: bool, device: int | None, threads: int = 1) -> None:
        previous = torch.cuda.current_device()
        try:
            self._register_on(read_only=read_only, device=previous if device is None else device, threads=threads)
        finally:
            if torch.cuda.current_device() != previous:
                torch.cuda.set_device(previous)  # registering on another GPU must not move the caller

    def _register_on(self, *, read_only: bool, device: int, threads: int = 1) -> None:
        region = self._region
        _cuda.ensure_context(device)
        _cuda.require_host_pointer_access(device)
        flags = _cuda.HOST_REGISTER_PORTABLE | _cuda.HOST_REGISTER_MAPPED
        if read_only and _cuda.read_only_register_supported(device):
            flags |= _cuda.HOST_REGISTER_READ_ONLY
            region.read_only = True
        region.device = device
        pieces = _chunks(region.length, register_piece_bytes(region.length, threads))
        lock = threading.Lock()
        main = threading.get_ident()

        def register_piece(off: int, length: int) -> None:
            if threading.get_ident() != main:
                _cuda.ensure_context(device)  # the runtime's current device is per thread
            try:
                _cuda.host_register(region.base + off, length, flags)
            except RegistrationError as e:
                soft, _hard = _sys.memlock_limit()
                limit = "unlimited" if soft < 0 else fmt_bytes(soft)
                raise RegistrationError(
                    f"cudaHostRegister failed for {fmt_bytes(length)} at offset {fmt_bytes(off)} of a "
                    f"{fmt_bytes(region.length)} table: {e}. Raise `ulimit -l` (RLIMIT_MEMLOCK is {limit}), "
                    f"free host memory, or use the 'copy' backend with register=False") from None
            with lock:
                region.chunks.append((off, length))
            _check_device_pointer(region.base + off)

        try:
            _parallel(register_piece, pieces, min(threads, len(pieces)), name="uvaple-register")
        except BaseException:
            region.unregister()  # every piece that was registered, whichever thread failed
            raise
        region.chunks.sort()

    # ------------------------------------------------------------------ properties
    def _live(self) -> None:
        if self._closed:
            raise TableClosedError("this HostTable was closed; build or attach a new one")
        if self._region.foreign:
            raise TableForkedError(
                f"this HostTable belongs to process {self._region.pid}, and this is a forked child "
                f"(pid {os.getpid()}); a private table's pages are not inherited (views read zeros here). "
                "Build the table in the child, or attach a shared one there (HostTable.attach / .shared)")

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
        return self._region.length

    @property
    def ptr(self) -> int:
        self._live()
        return self._region.base + self._data_offset

    @property
    def registered(self) -> bool:
        return self._region.registered and not self._region.foreign

    @property
    def read_only_registered(self) -> bool:
        return self._region.read_only

    @property
    def device_index(self) -> int | None:
        return self._region.device if self.registered else None

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def created(self) -> bool:
        """True when this process created (and filled) the table; False when it attached to it."""
        return self._created

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def released(self) -> bool:
        """True once the memory itself is gone (closed, or dropped, and no view left)."""
        return self._region.released

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("registered" if self.registered else "unregistered")
        where = f"shared {self._name!r}" if self._name else "private"
        return (f"HostTable({self.rows}x{self.cols} {str(self.dtype).replace('torch.', '')}, "
                f"{fmt_bytes(self.nbytes)} {where}, {state})")

    # ------------------------------------------------------------------ views
    def _hold(self) -> _region.Anchor:
        """The anchor for a new view, taken under the lock: a concurrent close() cannot slip in between
        the check and the view (a view without the anchor would read unmapped memory)."""
        self._live()
        with self._lock:
            self._live()
            if self._anchor is None:
                raise TableClosedError("this HostTable was closed; build or attach a new one")
            return self._anchor

    def _raw_buffer(self):
        buf = self._buffer
        if buf is None:  # built once; an existing buffer holds the anchor itself
            anchor = self._hold()
            buf = _buffer_type(self._layout.data_bytes).from_address(self._region.base + self._data_offset)
            buf.anchor = anchor
            with self._lock:
                if self._buffer is None and not self._closed:
                    self._buffer = buf
        return buf

    @property
    def tensor(self) -> torch.Tensor:
        """CPU tensor ``[rows, cols]`` (strides ``(stride, 1)``) aliasing the table: Triton's argument.

        The tensor (and every view of it) keeps the memory mapped, also after :meth:`close`.
        """
        self._live()
        t = self._tensor
        if t is None:  # a cached tensor holds the memory through its buffer: safe to hand out as is
            flat = torch.frombuffer(self._raw_buffer(), dtype=torch.uint8)
            t = flat.view(self.dtype).as_strided((self.rows, self.cols), (self.stride, 1))
            with self._lock:
                if self._tensor is None and not self._closed:
                    self._tensor = t
        return t

    def bytes_view(self) -> np.ndarray:
        """numpy ``uint8`` array ``[rows, stride_bytes]`` over the table (for CPU gathers); keeps it mapped."""
        arr = np.frombuffer(self._raw_buffer(), dtype=np.uint8)
        return arr.reshape(self.rows, self.stride_bytes)

    def cuda_view(self, device: int | None = None) -> torch.Tensor:
        """CUDA tensor ``[rows, cols]`` aliasing the registered host memory (for torch ops).

        Built through ``__cuda_array_interface__``; it keeps the memory mapped and registered while it
        lives. Triton kernels do not need it (``tensor`` suffices).
        """
        self._live()
        if not self.registered:
            if self._pending is not None:
                raise DeviceCapabilityError("cuda_view(): this shared table is registered when it is ready; call "
                                            "mark_ready() (its creator) or wait_ready() first")
            raise DeviceCapabilityError("cuda_view() needs a registered table (build it where CUDA is usable)")
        itemsize = self.itemsize
        typestr = {1: "|u1", 2: "<i2", 4: "<i4"}[itemsize]
        holder = _CudaArrayHolder(self._hold(), self.ptr, (self.rows, self.stride), typestr)
        dev = torch.device("cuda", self._region.device if device is None else device)
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
            self._commit_rows(row_start + a, b)
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
        from .loading import locate_tensor

        info = locate_tensor(path, tensor_name)
        return cls._filled(info.shape[0], info.shape[1], dtype or info.dtype,
                           safetensors_fill(info, threads=threads), dict(kw, threads=threads))

    @classmethod
    def _filled(cls, rows: int, cols: int, dtype: torch.dtype, fill, kw: dict) -> HostTable:
        """A new table (named or private) written by ``fill``, one of this module's writers: they commit the
        pages they write, so nothing is pre-faulted before the fill (see Population)."""
        register = kw.pop("register", "auto")
        read_only = kw.pop("read_only", False)
        device = kw.pop("device", None)
        name = kw.pop("name", None)
        threads = kw.pop("threads", None) or default_threads()
        check_memory = kw.pop("check_memory", True)
        directory = kw.pop("directory", None)
        if kw:
            raise TypeError(f"unexpected arguments: {', '.join(kw)}")
        _check_register_arg(register)
        layout = _check_shape(rows, cols, dtype)
        if name is not None:
            return cls._open_shared(layout, name, layout.header(), {}, fill=fill, timeout=None, mode="create",
                                    register=register, read_only=read_only, device=device, threads=threads,
                                    check_memory=check_memory, directory=directory, fill_commits=True)
        if directory is not None:
            raise TypeError("directory= is for named (shared) tables; give name= too")
        _region.drain_deferred()
        writers_commit = fill is not None and _sys.populate_write_supported()
        table = cls._allocate_private(layout, threads, check_memory, populate=not writers_commit)
        try:
            if fill is not None:
                table._writers_commit = writers_commit
                table._timed("fill", fill, table)
                if writers_commit:
                    table._populate(threads)  # what the fill did not write; quick over written pages
            table._register(register, read_only=read_only, device=device, threads=threads)
        except BaseException as e:
            _drop_views_of_failure(e)
            table.close()
            raise
        return table

    # ------------------------------------------------------------------ lifetime
    # ------------------------------------------------------------------ deferred readiness (shared tables)
    @property
    def ready(self) -> bool:
        """A private table is always ready; a shared one once its creator marked it ready."""
        seg = self._region.segment
        return seg is None or seg.is_ready

    def mark_ready(self) -> None:
        """The creator of a ``defer_ready`` shared table has filled it: processes waiting may read it.

        Commits the pages the fill did not write (a shortage fails the table for every process, named),
        marks it ready, then registers this process's mapping."""
        seg = self._creator_segment("mark_ready")
        pending = self._pending
        if pending is not None and not self._committed:
            try:
                self._populate(pending["threads"])
            except BaseException as e:
                seg.fail(e)
                raise
        seg.ready()
        self._finish_pending(write=True)

    def mark_failed(self, error: BaseException) -> None:
        """The creator of a ``defer_ready`` shared table could not fill it: waiters get ``error``, and the
        name is removed (the table object stays usable here until closed)."""
        self._creator_segment("mark_failed").fail(error)

    def wait_ready(self, timeout: float = DEFAULT_SHARED_TIMEOUT_S) -> None:
        """Wait (bounded) until a ``defer_ready`` table's creator marks it ready (at once when it is), then
        map its pages and register them here if that was deferred."""
        self._live()
        seg = self._region.segment
        if seg is not None:
            seg.wait_ready(timeout)
        self._finish_pending(write=False)

    def _creator_segment(self, what: str):
        self._live()
        seg = self._region.segment
        if seg is None or not self._created or seg.fd is None:
            raise SharedSegmentError(f"{what}() is for the process that created a shared table with "
                                     "defer_ready=True")
        return seg

    def close(self) -> None:
        """Let go of the table: released now if no view is alive, else when the last view is gone.

        Releasing synchronises every GPU (so no kernel can still be reading), unregisters, unmaps and,
        for a shared table nobody else has open, unlinks its name. Idempotent. In a forked child it only
        drops the child's copy of the mapping.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tensor = None
            self._buffer = None
            anchor, self._anchor = self._anchor, None
        del anchor  # the region's finalizer runs here when no view holds it
        _region.drain_deferred()

    def unlink(self) -> None:
        """Remove a named table's name now, if the name is still this table's segment (every mapping stays
        valid until released). A closed table, or one whose name another segment took since, unlinks nothing."""
        seg = self._region.segment
        if seg is not None and not self._closed and not self._region.foreign:
            seg.unlink()

    def __enter__(self) -> HostTable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        raise TypeError("a HostTable maps host memory and cannot be pickled; share it by name "
                        "(HostTable.shared / HostTable.attach) instead")


def _anchor_of(region: _region.Region) -> _region.Anchor:
    return _region.Anchor(region)


def _drop_views_of_failure(exc: BaseException) -> None:
    """A table that failed to build must not stay mapped because the traceback's finished frames (a
    loader's, a ``fill``'s) still hold views of it: clear their locals (the trace itself is kept)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _check_device_pointer(ptr: int) -> None:
    """The kernels read registered memory at its host address: its device pointer must be that address."""
    dev_ptr = _cuda.host_device_pointer(ptr)
    if dev_ptr != ptr:
        raise DeviceCapabilityError(
            f"the device pointer of registered memory ({dev_ptr:#x}) differs from its host pointer ({ptr:#x}); "
            "uvaple's kernels need them equal. Use the 'copy' backend")


def _check_register_arg(register) -> None:
    if register not in (True, False, "auto"):
        raise ValueError(f"register must be True, False or 'auto', got {register!r}")


def _reserve(fd: int, off: int, length: int, name: str, total: int, directory: str) -> None:
    try:
        os.posix_fallocate(fd, off, length)
    except OSError as e:
        raise HostMemoryError(
            f"reserving {fmt_bytes(total)} for shared table {name!r} in {directory} failed: {e.strerror}; "
            f"free space there or use a private table") from e


def _check_shm_space(name: str, nbytes: int, check: bool, directory: str) -> None:
    if not check:
        return
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise HostMemoryError(
            f"shared table {name!r} needs {fmt_bytes(nbytes)} in {directory} but only {fmt_bytes(free)} is "
            f"free there; enlarge it (mount -o remount,size=... {directory}) or drop name= to use "
            f"private memory")


def safetensors_fill(info, *, threads: int | None = None) -> Callable[[HostTable], None]:
    """A ``fill`` for :meth:`HostTable.shared` that streams ``info`` (``loading.locate_tensor``) in."""
    from .loading import stream_into

    def fill(table: HostTable) -> None:
        stream_into(table, info, threads=threads or default_threads())

    return fill


class _CudaArrayHolder:
    """Exposes a registered table's rows through ``__cuda_array_interface__`` (holds the mapping)."""

    def __init__(self, anchor: _region.Anchor, ptr: int, shape: tuple[int, int], typestr: str):
        self._anchor = anchor
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
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
            f"a host table of {fmt_bytes(nbytes)} does not fit: only {fmt_bytes(avail)} of host memory is available "
            f"(MemAvailable). Free memory, shard or quantise the table, or pass check_memory=False where "
            f"memory grows on demand")

"""``HostTable``: one 2-D table in pinned, mapped host memory that a GPU reads through UVA.

Design
------
What it owns. The table object: its shape and stride, the views it hands out (built by :mod:`.views`),
its fills (:meth:`HostTable.write_rows` and the ``from_*`` constructors) and its lifetime. The memory
behind it is built elsewhere and only held here: a private mapping by :mod:`.memory`, which also commits
and registers the pages of every table (:class:`~uvaple.uva.memory.Pages`); a named segment that several
processes share without a second copy by :mod:`.sharing`, which also keeps the ready protocol that
``mark_ready`` / ``mark_failed`` / ``wait_ready`` delegate to. The constructors stay classmethods here.

Rules it keeps.

* The table and every view hold the mapping (a :class:`~uvaple.uva._region.Region`) through its anchor,
  so the memory is released when nothing can read it any more, never before (:mod:`._region`).
  ``close()`` lets go of the table's hold: with no view left the device is synchronised, the memory
  unregistered, unmapped and (last process out) unlinked at once; otherwise when the last view is gone,
  and until then a view reads the table's bytes. A table dropped without ``close()`` is released the
  same way.
* The object refuses use after ``close()`` (:class:`~uvaple.uva.errors.TableClosedError`) and in a forked
  child (:class:`~uvaple.uva.errors.TableForkedError`); it cannot be pickled (share it by name).
* Fills write through the table's own writers, which commit the pages they write first (:mod:`.memory`,
  Writers commit); a table that fails to build is released before its error propagates, also when the
  error's traceback still holds views of it.

Fork. A private table is advised ``MADV_WIPEONFORK``: a ``fork()`` after registration neither shares the
parent's pinned pages copy-on-write nor copies the table, and a child's inherited views read zeros
(:mod:`._region`). A shared table's pages stay shared (:mod:`.sharing`). A child that needs the table
attaches it itself (``HostTable.attach`` / ``HostTable.shared``), registering in its own CUDA context.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import torch

from uvaple.dtypes import fmt_bytes

from . import _region, memory, sharing, views, workers
from .errors import DeviceCapabilityError, SharedSegmentError, TableClosedError, TableForkedError

__all__ = ["HostTable"]


class HostTable:
    """A ``[rows, cols]`` table in host memory that the GPU can read (see the module docstring).

    Build one with :meth:`empty`, :meth:`from_tensor`, :meth:`from_numpy`, :meth:`from_safetensors`,
    :meth:`shared` (create-or-attach a named table from several processes) or :meth:`attach` (a named
    table another process made). Use it as a context manager or call :meth:`close`; a table dropped
    without ``close()`` is released all the same.
    """

    # ------------------------------------------------------------------ construction
    def __init__(self, *, _layout: memory.Layout, _pages: memory.Pages, _data_offset: int, _name: str | None,
                 _created: bool = True):
        self._layout = _layout
        self._pages = _pages
        self._region = _pages.region
        self._anchor: _region.Anchor | None = _region.Anchor(_pages.region)
        self._data_offset = _data_offset
        self._name = _name
        self._created = _created
        self._closed = False
        self._lock = threading.RLock()
        self._tensor: torch.Tensor | None = None
        self._buffer = None
        self.timings: dict[str, float] = _pages.timings  # seconds spent in populate / fill / register

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
               timeout: float = sharing.DEFAULT_SHARED_TIMEOUT_S, fill: Callable[[HostTable], None] | None = None,
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
        layout = memory.check_shape(rows, cols, dtype)
        meta = dict(sharing.header(layout), tag=tag)
        want = dict(sharing.header(layout), tag=tag)
        if defer_ready and fill is not None:
            raise TypeError("defer_ready and fill exclude each other: with defer_ready the creator fills the "
                            "table itself and calls mark_ready()")
        return sharing.open_shared(cls, layout, name, meta, want, fill=fill, timeout=timeout,
                                   mode="deferred" if defer_ready else "shared", register=register,
                                   read_only=read_only, device=device, threads=threads,
                                   check_memory=check_memory, directory=directory)

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
        want = {"rows": rows, "cols": cols, "dtype": memory.SUPPORTED_DTYPES.get(dtype, dtype) if dtype else None,
                "tag": tag}
        return sharing.open_shared(cls, None, name, {}, want, fill=None, timeout=None, mode="attach",
                                   register=register, read_only=read_only, device=device, threads=threads,
                                   check_memory=True, directory=directory)

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
    def from_safetensors(cls, path: str | os.PathLike, tensor_name: str | list[str], *,
                         dtype: torch.dtype | None = None, threads: int | None = None, **kw) -> HostTable:
        """Stream one named 2-D tensor of a safetensors file (or checkpoint directory) into a new table; or,
        given a list of names, the tensors stacked on rows (a table saved as shards: same columns and
        dtype, each read at its row offset, never concatenated in RAM).

        Rows are read straight from the file into the table in blocks by several threads: no second
        full copy in RAM and nothing staged through the GPU. See :mod:`uvaple.uva.loading`.
        """
        from .loading import check_parts, locate_tensor, locate_tensors, safetensors_fill

        if isinstance(tensor_name, str):
            info = locate_tensor(path, tensor_name)
            return cls._filled(info.shape[0], info.shape[1], dtype or info.dtype,
                               safetensors_fill(info, threads=threads), dict(kw, threads=threads))
        parts = locate_tensors(path, list(tensor_name))
        first = parts[0].shape if parts else ()
        rows, cols = sum(p.shape[0] if p.shape else 0 for p in parts), first[1] if len(first) == 2 else 0
        check_parts(parts, rows, cols)  # every part [*, cols] of one dtype
        return cls._filled(rows, cols, dtype or parts[0].dtype, safetensors_fill(parts, threads=threads),
                           dict(kw, threads=threads))

    @classmethod
    def _filled(cls, rows: int, cols: int, dtype: torch.dtype, fill, kw: dict) -> HostTable:
        """A new table (named or private) written by ``fill``, one of the table's own writers: they commit
        the pages they write, so nothing is pre-faulted before the fill (:mod:`.memory`, Writers commit)."""
        register = kw.pop("register", "auto")
        read_only = kw.pop("read_only", False)
        device = kw.pop("device", None)
        name = kw.pop("name", None)
        threads = kw.pop("threads", None) or workers.default_threads()
        check_memory = kw.pop("check_memory", True)
        directory = kw.pop("directory", None)
        if kw:
            raise TypeError(f"unexpected arguments: {', '.join(kw)}")
        memory.check_register_arg(register)
        layout = memory.check_shape(rows, cols, dtype)
        if name is not None:
            return sharing.open_shared(cls, layout, name, sharing.header(layout), {}, fill=fill, timeout=None,
                                       mode="create", register=register, read_only=read_only, device=device,
                                       threads=threads, check_memory=check_memory, directory=directory,
                                       fill_commits=True)
        if directory is not None:
            raise TypeError("directory= is for named (shared) tables; give name= too")
        return memory.open_private(cls, layout, fill, register=register, read_only=read_only, device=device,
                                   threads=threads, check_memory=check_memory)

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
    def forked(self) -> bool:
        """True in a forked child of the process that mapped this table: the mapping is the parent's."""
        return self._region.foreign

    @property
    def owner_pid(self) -> int:
        """The process that mapped this table."""
        return self._region.pid

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
            buf = views.buffer(self._hold(), self._region.base + self._data_offset, self._layout.data_bytes)
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
            t = views.cpu_tensor(self._raw_buffer(), self._layout)
            with self._lock:
                if self._tensor is None and not self._closed:
                    self._tensor = t
        return t

    def bytes_view(self) -> np.ndarray:
        """numpy ``uint8`` array ``[rows, stride_bytes]`` over the table (for CPU gathers); keeps it mapped."""
        return views.byte_array(self._raw_buffer(), self._layout)

    def cuda_view(self, device: int | None = None) -> torch.Tensor:
        """CUDA tensor ``[rows, cols]`` aliasing the registered host memory (for torch ops).

        Built through ``__cuda_array_interface__``; it keeps the memory mapped and registered while it
        lives. Triton kernels do not need it (``tensor`` suffices).
        """
        self._live()
        if not self.registered:
            if self._pages.deferred is not None:
                raise DeviceCapabilityError("cuda_view(): this shared table is registered when it is ready; call "
                                            "mark_ready() (its creator) or wait_ready() first")
            raise DeviceCapabilityError("cuda_view() needs a registered table (build it where CUDA is usable)")
        dev = torch.device("cuda", self._region.device if device is None else device)
        return views.cuda_tensor(self._hold(), self.ptr, self._layout, dev)

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

        workers.parallel(copy, workers.chunks(n, block), threads or workers.default_threads())

    def writable_bytes(self, row_start: int, n: int) -> np.ndarray:
        """numpy ``uint8`` ``[n, stride_bytes]`` over rows ``row_start .. row_start+n``, their pages committed
        first: where a writer encodes rows itself (a quantiser writing codes and scales) rather than copying
        them with :meth:`write_rows`. Keeps the table mapped while it lives."""
        self._live()
        if isinstance(row_start, bool) or isinstance(n, bool) or not (0 <= row_start and 0 <= n
                                                                      and row_start + n <= self.rows):
            raise ValueError(f"rows {row_start}..{row_start + n} do not fit a table of {self.rows} rows")
        self._commit_rows(row_start, n)
        return self.bytes_view()[row_start:row_start + n]

    def _commit_rows(self, row: int, n: int) -> None:
        """Commit the pages of rows ``row .. row+n`` before a writer copies into them (:mod:`.memory`)."""
        lo = self._data_offset + row * self.stride_bytes
        self._pages.commit_written(lo, lo + n * self.stride_bytes)

    # ------------------------------------------------------------------ readiness (shared tables)
    @property
    def ready(self) -> bool:
        """A private table is always ready; a shared one once its creator marked it ready."""
        seg = self._region.segment
        return seg is None or seg.is_ready

    def mark_ready(self) -> None:
        """The creator of a ``defer_ready`` shared table has filled it: processes waiting may read it.

        Commits the pages the fill did not write (a shortage fails the table for every process, named),
        marks it ready, then registers this process's mapping."""
        sharing.mark_ready(self._creator_segment("mark_ready"), self._pages)

    def mark_failed(self, error: BaseException) -> None:
        """The creator of a ``defer_ready`` shared table could not fill it: waiters get ``error``, and the
        name is removed (the table object stays usable here until closed)."""
        self._creator_segment("mark_failed").fail(error)

    def wait_ready(self, timeout: float = sharing.DEFAULT_SHARED_TIMEOUT_S) -> None:
        """Wait (bounded) until a ``defer_ready`` table's creator marks it ready (at once when it is), then
        map its pages and register them here if that was deferred."""
        self._live()
        sharing.wait_ready(self._region.segment, self._pages, timeout)

    def _creator_segment(self, what: str):
        self._live()
        seg = self._region.segment
        if seg is None or not self._created or seg.fd is None:
            raise SharedSegmentError(f"{what}() is for the process that created a shared table with "
                                     "defer_ready=True")
        return seg

    # ------------------------------------------------------------------ lifetime
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


def _as_cpu_tensor(src) -> torch.Tensor:
    if isinstance(src, np.ndarray):
        if src.dtype == np.float64:
            raise TypeError("float64 arrays are not supported; cast to float32 first")
        return torch.from_numpy(np.ascontiguousarray(src))
    if isinstance(src, torch.Tensor):
        return src.detach().to("cpu")
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(src).__name__}")

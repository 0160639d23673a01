"""Named host tables that several processes share: create-or-attach, the creator's fill, readiness.

Design
------
What it owns. Opening a named table (``HostTable.shared``, ``HostTable.attach``, and ``name=`` given to
``HostTable.empty`` or a loader): the segment (:mod:`.segments`), this process's mapping of it, the
creator's fill, and the ready protocol of a ``defer_ready`` table (:func:`mark_ready`,
:func:`wait_ready`). The segment file's own protocol (header, locks, bounded waits, dead creators
detected, the last process out unlinks) is :mod:`.segments`'; committing and registering pages is
:class:`~uvaple.uva.memory.Pages`'; releasing the mapping, and detaching the segment with it, is the
region's (:mod:`._region`). The table is built here through the class the caller passes in (this module
does not import the table's module, which imports this one).

Rules it keeps.

* One copy per node: every process maps the same pages (``MAP_SHARED``), from ``segments.DATA_OFFSET``
  on, and registers its own mapping (registration is per process, never shared).
* The creator alone fills, and before the segment is marked ready: a fill that raises marks it failed
  (waiters get that error) and removes the file; nothing half-written is ever ``ready``. A process that
  attaches a ready segment maps its pages into its page tables at once (``MADV_POPULATE_READ``), not on
  the GPU's first reads.
* A creator's pages are allocated by the populate call (a full tmpfs fails it with EFAULT, named, not a
  SIGBUS later). Only where the kernel lacks ``MADV_POPULATE_WRITE`` are they reserved first with
  ``posix_fallocate``, because the fallback then touches them by hand. (Reserving first as well cost 8 s
  for 48 GiB on the H200 host, more than populating: the pages were allocated twice over.)
* ``defer_ready``: no process waits during construction. The creator gets its table at once, still
  ``building``, writes it and calls ``mark_ready`` (or ``mark_failed``); the others map it at once and
  call ``wait_ready``, a bounded wait, before the first read; so ranks that meet in a collective before
  the fill ends cannot deadlock on it. Such a table is registered when it is ready, after its pages were
  written, and registration is tried on one page at construction, so a GPU that cannot read host memory
  is an error before any loading.

Fork. A shared table's pages stay shared: a child's inherited views read the table, and while the child
keeps that mapping the segment counts as attached (closing the child's copy of the table object lets go
of it). A child forked after the parent registered a shared table also inherits the GPU driver's device
descriptors, and with them the parent's registration, which references the segment: it then counts as
attached until that child exits as well, even if the parent is gone; the parent's watcher
(:mod:`.reaper`) removes it after both, if the parent was killed.
"""

from __future__ import annotations

import logging
import os

import torch

from uvaple.dtypes import SAFETENSORS_DTYPES, TABLE_DTYPES, fmt_bytes

from . import _region, memory, segments, system, workers
from .errors import HostMemoryError, SharedSegmentError
from .memory import Layout, Pages

log = logging.getLogger("uvaple.uva")

__all__ = ["DEFAULT_SHARED_TIMEOUT_S", "header", "layout_of", "open_shared", "mark_ready", "wait_ready"]

# Default bound of HostTable.shared's wait for another process to fill the table (seconds): a 100 GB
# fill from the page cache takes tens of seconds, from a cold disk minutes; pass timeout= for those.
DEFAULT_SHARED_TIMEOUT_S = 30.0

_DTYPE_BY_NAME: dict[str, torch.dtype] = {k: v for k, v in SAFETENSORS_DTYPES.items() if v in TABLE_DTYPES}


def header(layout: Layout) -> dict:
    """The fields of a segment's header that describe the table laid out as ``layout``."""
    return {"rows": layout.rows, "cols": layout.cols, "dtype": memory.SUPPORTED_DTYPES[layout.dtype],
            "stride_bytes": layout.stride_bytes, "data_offset": segments.DATA_OFFSET}


def layout_of(meta: dict, path: str) -> Layout:
    """The layout a segment's header ``meta`` describes, or a named error for one this uvaple cannot map."""
    try:
        layout = Layout(int(meta["rows"]), int(meta["cols"]), _DTYPE_BY_NAME[meta["dtype"]],
                        int(meta["stride_bytes"]))
        offset = int(meta["data_offset"])
    except (KeyError, TypeError, ValueError) as e:
        raise SharedSegmentError(f"{path} has a corrupt uvaple header: {e!r}") from None
    if offset != segments.DATA_OFFSET or layout.rows <= 0 or layout.cols <= 0 or \
            layout.stride_bytes < layout.row_bytes or layout.stride_bytes % 16:
        raise SharedSegmentError(f"{path} has a header this uvaple cannot map (data offset {offset}, "
                                 f"{layout.rows}x{layout.cols}, stride {layout.stride_bytes} B)")
    return layout


def _map_bytes(layout: Layout) -> int:
    return segments.DATA_OFFSET + system.round_up(layout.data_bytes, system.PAGE_SIZE)


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


def _reserve(fd: int, off: int, length: int, name: str, total: int, directory: str) -> None:
    try:
        os.posix_fallocate(fd, off, length)
    except OSError as e:
        raise HostMemoryError(
            f"reserving {fmt_bytes(total)} for shared table {name!r} in {directory} failed: {e.strerror}; "
            f"free space there or use a private table") from e


def open_shared(table_class, layout: Layout | None, name: str, meta: dict, want: dict, *, fill, timeout,
                mode: str, register, read_only: bool, device, threads, check_memory: bool,
                directory: str | None = None, fill_commits: bool = False):
    """Open the named table ``name`` as a ``table_class`` (``HostTable``).

    ``mode``: ``"create"`` (a live table of that name is an error), ``"shared"`` (create-or-attach,
    waiting at most ``timeout`` for another creator's fill), ``"deferred"`` (create-or-attach without
    waiting: ``defer_ready``) or ``"attach"`` (a ready table; ``layout`` None, read from its header).
    ``meta``: the header a creator writes; ``want``: what an attached segment must match.
    ``fill(table)`` runs in the creator only; ``fill_commits``: it writes through the table's own writers,
    which commit the pages they write, so the creator does not pre-fault first.
    """
    _region.drain_deferred()
    memory.check_register_arg(register)
    threads = threads or workers.default_threads()
    path = segments.segment_path(name, directory)
    directory = os.path.dirname(path)
    if layout is not None:
        map_bytes = _map_bytes(layout)
        memory.check_free_memory(map_bytes, check_memory)
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
            layout = layout_of(seg.header() or {}, path)
            map_bytes = _map_bytes(layout)
        elif not system.populate_write_supported():  # the populate fallback below touches pages by hand
            workers.parallel(lambda off, n: _reserve(seg.fd, off, n, name, map_bytes, directory),
                            workers.chunks(map_bytes, memory.POPULATE_CHUNK_BYTES), threads)
        try:
            base = system.mmap(map_bytes, system.PROT_READ | system.PROT_WRITE, system.MAP_SHARED, seg.fd)
        except OSError as e:
            raise SharedSegmentError(f"mapping shared table {name!r} ({fmt_bytes(map_bytes)}) failed: "
                                     f"{e.strerror}") from e
        pages = Pages(_region.Region(base, map_bytes, private=False, segment=seg), name)
        table = table_class(_layout=layout, _pages=pages, _data_offset=segments.DATA_OFFSET, _name=name,
                            _created=seg.created)
        system.madvise(base, map_bytes, system.MADV_HUGEPAGE)
        writers_commit = seg.created and system.populate_write_supported()
        if mode == "deferred" and (seg.created or not seg.is_ready):
            # Filled after construction: the writes commit their pages; registered once ready.
            pages.defer_registration(register, read_only=read_only, device=device, threads=threads)
            if writers_commit:
                pages.writers_commit = True
            elif seg.created:
                pages.populate(threads)
            return table
        fill_commits = fill_commits and fill is not None and writers_commit
        # Map the pages into this process's page tables now, not on the GPU's first reads.
        if fill_commits:
            pages.writers_commit = True
        else:
            pages.populate(threads, write=seg.created)
        if seg.created:
            if fill is not None:
                pages.timed("fill", fill, table)
                if fill_commits:
                    pages.populate(threads)  # what the fill did not write; quick over written pages
            seg.ready()
        pages.register(register, read_only=read_only, device=device, threads=threads)
        return table
    except BaseException as e:
        # each step on its own: one failing must not skip the others
        try:
            if seg.created and seg.fd is not None and (seg.header() or {}).get("state") != "ready":
                seg.fail(e)  # waiters get this error; the half-built file is removed
        except Exception as cleanup:  # noqa: BLE001
            log.warning("failing shared table %r: %s", name, cleanup)
        _region.drop_views_of_failure(e)
        try:
            if table is not None:
                table.close()
            else:
                seg.detach()
        except Exception as cleanup:  # noqa: BLE001
            log.warning("releasing shared table %r after an error: %s", name, cleanup)
        raise


def mark_ready(seg: segments.Segment, pages: Pages) -> None:
    """The creator of a ``defer_ready`` table has filled it: commit the pages the fill did not write (a
    shortage fails the table for every process, named), mark it ready, then register this mapping."""
    deferred = pages.deferred
    if deferred is not None and not pages.committed:
        try:
            pages.populate(deferred["threads"])
        except BaseException as e:
            seg.fail(e)
            raise
    seg.ready()
    pages.finish_deferred(write=True)


def wait_ready(seg: segments.Segment | None, pages: Pages, timeout: float) -> None:
    """Wait (bounded) until the creator marks the table ready (at once when it is; ``seg`` None: a private
    table), then map its pages and register them here if that was deferred."""
    if seg is not None:
        seg.wait_ready(timeout)
    pages.finish_deferred(write=False)

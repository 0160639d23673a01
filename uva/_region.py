"""The lifetime of host memory that views and the GPU may read: released once, when nothing can read it.

A :class:`Region` is one mapping (private anonymous memory, or a shared segment's file) of this process,
plus what was done to it that must be undone: CUDA registration chunks and, for a segment, the open file
and its locks. Every view handed out of a table (CPU tensors, numpy arrays, CUDA tensors over registered
pages, state-dict tensors) holds the region's :class:`Anchor`; so does the table itself. When the last
holder is gone, a ``weakref.finalize`` on the anchor releases the region:

1. synchronise every GPU with a live context (registration is portable: a kernel on any GPU may still be
   reading), then ``cudaHostUnregister`` each chunk;
2. ``munmap``;
3. for a shared segment: unlink its name if no other process has it attached (:mod:`.segments`) and
   close the file.

So ``HostTable.close()`` (which drops the table's own anchor) releases at once when no view is alive and
otherwise when the last view goes; a view read after ``close()`` reads the table's bytes, never an
unmapped page. A table dropped without ``close()`` is released the same way, by reference counting,
because nothing in a region or an anchor points back at the table (no cycle for the collector to miss).
A table that fails to build is closed before its error propagates, and :func:`drop_views_of_failure`
clears the locals of the error's finished frames (a loader's, a ``fill``'s), so that no view held there
keeps the half-built mapping alive.

Three situations make the release wait or shrink:

* **Inside a CUDA graph capture** a device synchronisation would invalidate the capture: the release is
  put off to the next table operation or to exit. (Memory a captured graph reads is never released
  before exit at all: the kernel layer keeps every host table tensor read under capture alive, hence
  its anchor, because a graph may be replayed at any time and nothing tells when it is destroyed.)
* **At interpreter exit**, nothing is unmapped or unregistered: a daemon thread (a copy backend's worker)
  may still be reading, and the OS frees the pages. Shared segments are detached (unlinked when this
  process was the last to have one open), so no name is left in ``/dev/shm``. Exit runs this through
  ``atexit`` and, in a ``multiprocessing`` child, through ``multiprocessing``'s own exit finalizers too: a
  child started by fork (vLLM's engine core and workers, by default) ends with ``os._exit`` after its
  target, which runs no ``atexit`` handler, and a table a captured graph reads lives until that exit, so
  without it every stopped engine would leave its table's pages in ``/dev/shm``. A process killed
  (``SIGKILL``, or a signal it does not handle) runs none of it: its watcher (:mod:`.reaper`) removes what
  it held. Where the watcher dies too or could not start (:mod:`.reaper` says when) a segment stays; the
  next ``HostTable.shared`` of that name attaches or replaces it, and ``uvaple shm clean`` removes it.
* **In a forked child** the region belongs to the parent: the child's copy of a table refuses use
  (:class:`~uvaple.uva.errors.TableForkedError`) and its release only unmaps this address space's
  range and closes inherited descriptors: no CUDA call, no unlink. A private mapping is advised
  ``MADV_WIPEONFORK`` (fallback ``MADV_DONTFORK``), so the parent never shares its pinned pages
  copy-on-write with a child and the device never reads a page the parent no longer owns; the child's
  range is re-mapped as fresh zero pages, so a view the child inherited reads zeros instead of faulting.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import traceback
import weakref

from . import cuda_runtime, system
from .errors import UvapleError

log = logging.getLogger("uvaple.uva")

__all__ = ["Region", "Anchor", "live_regions", "drain_deferred", "drop_views_of_failure"]

# Re-entrant: a garbage collection may run a region's finalizer (which takes this lock) on a thread that
# already holds it, inside any allocation.
_lock = threading.RLock()
_live: dict[int, weakref.ref] = {}  # id(region) -> region, every unreleased region of this process
_deferred: list[Region] = []  # releases put off (capture in progress, device sync failed)
_hooks_installed = False
_exit_finalizer_pid: int | None = None  # the multiprocessing child whose exit finalizers hold _at_exit
_exiting = False
# This process's pid, kept by the fork hook (a plain int: torch.compile traces through the table's checks,
# and os.getpid() would break its graph). The hook is installed with the first region, so every region
# alive at a fork sees the child's pid change.
_pid = os.getpid()


def _install_hooks() -> None:
    """Exit and fork hooks, installed at the first region (importing uvaple installs nothing).

    A ``multiprocessing`` child also gets ``_at_exit`` among ``multiprocessing``'s exit finalizers, at its
    own first region: the registry it inherited was emptied when it started, and ``atexit`` does not run
    there when it was forked (the module docstring).
    """
    global _hooks_installed, _exit_finalizer_pid
    with _lock:
        first = not _hooks_installed
        _hooks_installed = True
        pid = os.getpid()
        child = multiprocessing.parent_process() is not None and _exit_finalizer_pid != pid
        if child:
            _exit_finalizer_pid = pid
    if first:
        atexit.register(_at_exit)
        os.register_at_fork(after_in_child=_after_fork_in_child)
    if child:
        multiprocessing.util.Finalize(None, _at_exit, exitpriority=0)


class Region:
    """One mapping of this process and the resources tied to it (see the module docstring).

    Parameters
    ----------
    base, length : int
        Address and size of the mapping (``munmap(base, length)`` releases it).
    private : bool
        An anonymous private mapping (fork-protected and re-mapped as zeros in a forked child).
    segment : uvaple.uva.segments.Segment, optional
        The shared segment the mapping is of; detached (maybe unlinked) at release.
    """

    def __init__(self, base: int, length: int, *, private: bool, segment=None) -> None:
        _install_hooks()
        self.base = base
        self.length = length
        self.private = private
        self.segment = segment
        self.pid = _pid
        self.chunks: list[tuple[int, int]] = []  # registered (offset, length)
        self.device: int | None = None
        self.read_only = False
        self.released = False
        self._lock = threading.RLock()
        with _lock:
            _live[id(self)] = weakref.ref(self)
        if private:
            self._protect_from_fork()

    # ------------------------------------------------------------------ fork
    def _protect_from_fork(self) -> None:
        if system.madvise(self.base, self.length, system.MADV_WIPEONFORK) == 0:
            return
        if system.madvise(self.base, self.length, system.MADV_DONTFORK) != 0:
            log.warning("neither MADV_WIPEONFORK nor MADV_DONTFORK was accepted for a host table: a forked "
                        "child shares its pages copy-on-write")

    @property
    def foreign(self) -> bool:
        """True in a forked child: the region belongs to the parent process."""
        return _pid != self.pid

    # ------------------------------------------------------------------ registration
    @property
    def registered(self) -> bool:
        return bool(self.chunks)

    def unregister(self) -> None:
        """``cudaHostUnregister`` every chunk (the caller has synchronised the devices)."""
        self.read_only = False
        while self.chunks:
            off, _ = self.chunks.pop()
            try:
                cuda_runtime.host_unregister(self.base + off)
            except UvapleError as e:
                log.warning("unregistering host table chunk at offset %d failed: %s", off, e)

    # ------------------------------------------------------------------ release
    def release(self) -> None:
        """Give everything back, once, if and when that is safe (see the module docstring)."""
        with self._lock:
            if self.released:
                return
            if self.foreign:
                self._release_foreign()
                return
            if _exiting:
                self._detach_segment(at_exit=True)
                return
            if self.chunks:
                if _capturing():
                    _defer(self)
                    return
                try:
                    cuda_runtime.synchronize_devices()
                except UvapleError as e:
                    log.warning("device synchronise before releasing a host table failed (%s); the table "
                                "stays mapped and registered until the next try or the process ends", e)
                    _defer(self)
                    return
                self.unregister()
            self.released = True
            try:
                system.munmap(self.base, self.length)
            except OSError as e:
                log.warning("munmap of a host table failed: %s", e)
            self._detach_segment(at_exit=False)
            _forget(self)

    def _release_foreign(self) -> None:
        self.released = True
        self.chunks = []  # the parent's registration: not ours to undo
        try:
            system.munmap(self.base, self.length)
        except OSError:
            pass
        if self.segment is not None:
            self.segment.close_descriptor()
        _forget(self)

    def _detach_segment(self, *, at_exit: bool) -> None:
        if self.segment is None:
            return
        try:
            self.segment.detach()
        except Exception as e:  # noqa: BLE001 - a release never raises
            log.warning("detaching shared table %r %sfailed: %s", self.segment.name,
                        "at exit " if at_exit else "", e)

    def __repr__(self) -> str:
        state = "released" if self.released else ("registered" if self.chunks else "mapped")
        return f"Region({self.base:#x}+{self.length}, {state})"


class Anchor:
    """What every view of a table holds: the region is released when the last anchor holder is gone."""

    __slots__ = ("region", "__weakref__")

    def __init__(self, region: Region) -> None:
        self.region = region
        finalizer = weakref.finalize(self, region.release)
        finalizer.atexit = False  # exit is handled by _at_exit (nothing unmapped under a running thread)


def _forget(region: Region) -> None:
    with _lock:
        _live.pop(id(region), None)


def _defer(region: Region) -> None:
    with _lock:
        if region not in _deferred:
            _deferred.append(region)


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (a device sync would break it)."""
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - no CUDA build: nothing captures
        return False


def drain_deferred() -> None:
    """Retry the releases that were put off (called by table operations and at close)."""
    if not _deferred or _capturing():
        return
    with _lock:
        todo = list(_deferred)
        _deferred.clear()
    for region in todo:
        region.release()


def drop_views_of_failure(exc: BaseException) -> None:
    """A table that failed to build must not stay mapped because the traceback's finished frames (a
    loader's, a ``fill``'s) still hold views of it: clear their locals (the trace itself is kept)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def live_regions() -> list[Region]:
    """Every region of this process not yet released (for tests and ``uvaple shm``)."""
    with _lock:
        refs = list(_live.values())
    return [r for r in (ref() for ref in refs) if r is not None and not r.released]


def _at_exit() -> None:
    global _exiting
    _exiting = True
    for region in live_regions():
        if region.foreign:
            continue
        try:
            region.release()
        except Exception as e:  # noqa: BLE001 - never raise from atexit
            log.warning("releasing a host table at exit failed: %s", e)


def _after_fork_in_child() -> None:
    """Give a forked child zero pages where the parent's private tables are (never a fault on read).

    Only the forking thread exists in the child: locks another thread held at the fork are made anew.
    """
    global _lock, _pid
    _lock = threading.RLock()
    _pid = os.getpid()
    for region in live_regions():
        region._lock = threading.RLock()
        if region.segment is not None:
            # The child's copies of the parent's descriptors would keep the segment's locks (build, attach)
            # held after the parent is gone; closing them here releases nothing while the parent lives.
            region.segment.close_descriptor()
        if region.private:
            try:
                system.mmap(region.length, system.PROT_READ | system.PROT_WRITE,
                            system.MAP_PRIVATE | system.MAP_ANONYMOUS | system.MAP_NORESERVE | system.MAP_FIXED,
                            addr=region.base)
            except OSError:
                pass

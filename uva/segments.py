"""Named shared segments in ``/dev/shm``: create-or-attach with bounded waits, dead creators detected.

One file per table, ``/dev/shm/uvaple.<name>``: a header, then the rows from ``DATA_OFFSET`` on. Every
process that maps it (tensor-parallel ranks, data-parallel replicas) shares the same pages, so a node
holds the table once.

Directory. ``/dev/shm`` by default; any tmpfs directory may be given instead (``directory=``), and every
process sharing a table must give the same one. Where ``/dev/shm`` has 4 KiB pages (the kernel default,
``huge=never``), a tmpfs mounted with ``huge=always`` holds the table in 2 MiB pages: its pages are
allocated and registered several times faster (measured in ``perf/studies/ready_probe.py``). A directory that is
not on a tmpfs is refused: a table there would be written back to a disk.

Header: ``MAGIC`` (8 bytes), the JSON length (u64), then JSON: ``rows``, ``cols``, ``dtype``,
``stride_bytes``, ``data_offset``, ``tag`` (what the table holds, e.g. a checkpoint's identity),
``creator_pid``, ``created_unix``, ``state`` (``building`` → ``ready`` or ``failed``) and ``error``.

Locks. Two byte-range locks on the segment file, held through open-file-description locks
(``fcntl(F_OFD_SETLK)``): the kernel drops them when the last descriptor of the open file is closed,
which includes the death of the process, so a dead holder never leaves a lock behind.

* byte 0, **build** (exclusive): held by the creator from creation until the segment is ``ready`` or
  ``failed``, on a descriptor of its own that is never mapped (a mapping keeps its open file, and with it
  the file's locks, alive in a child forked while the creator fills; the build lock must die with the
  creator). A segment ``building`` whose build lock nobody holds has a dead creator: it is stale. Readers
  look at the lock before the header: the creator writes ``ready`` or ``failed`` before it lets go.
* byte 1, **attach** (shared): held by every process that has the segment open, for as long as it has.
  The process that finds nobody else holding it when it detaches unlinks the name. A process killed before
  it detaches has a watcher that does it then (:mod:`.reaper`, :func:`remove_unused`).

Decisions (create, remove a stale file, attach, unlink on the last detach) are made under one
**namespace lock**, ``flock`` on the ``/dev/shm`` directory, held for a few system calls and never across
a wait or a fill, so two processes never both create, never remove a file the other just made, and no
attach slips between a last-detach check and its unlink. Every wait (for the namespace lock, for a
creator to finish) is bounded and ends in :class:`SharedSegmentTimeout` naming who holds what.

What a caller finds, and what happens:

======================================  =========================================================
found                                   then
======================================  =========================================================
no file                                 create it (this process fills it)
``building``, build lock held           wait for ``ready`` / ``failed`` (bounded by the timeout)
``building``, build lock free           the creator died: remove the file, create it again
``failed``                              raise the creator's error (the creator removes the file)
``failed``, nobody holds it             its creator died before removing it: remove it, create it again
``ready``                               attach; shape, dtype, stride and tag must match
``ready``, mismatched, nobody attached  an orphan: replaced by ``create_or_attach``, an error else
not a uvaple file                       an error; nothing is removed
======================================  =========================================================
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from . import reaper, system
from .errors import SharedSegmentError, SharedSegmentTimeout

log = logging.getLogger("uvaple.uva")

__all__ = ["Segment", "SegmentInfo", "DATA_OFFSET", "segment_path", "segment_dir", "create",
           "create_or_attach", "attach", "list_segments", "clean", "remove_unused", "SHM_DIR", "PREFIX"]

SHM_DIR = "/dev/shm"
TMPFS_MAGIC = 0x01021994
PREFIX = "uvaple."
MAGIC = b"UVAPLE01"
_HEAD = struct.Struct("<8sQ")  # magic, JSON length
_HEADER_BYTES = 4096
# The rows start 2 MiB in, so they stay aligned for huge pages where tmpfs has them.
DATA_OFFSET = system.HUGE_PAGE_SIZE
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_BUILD_BYTE, _ATTACH_BYTE = 0, 1
# Polling while a creator fills: from 1 ms (a small table is ready in a few ms) up to 50 ms (a 100 GB
# fill takes tens of seconds; 20 polls a second cost nothing).
_POLL_MIN_S, _POLL_MAX_S = 1e-3, 50e-3
# Bound of the namespace-lock wait when releasing (no caller's timeout applies there): it is held for a
# few system calls at a time, so a second means a stopped process.
_DETACH_LOCK_TIMEOUT_S = 10.0
_FLOCK_STRUCT = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux


def segment_dir(directory: str | os.PathLike | None = None) -> str:
    """The directory segments live in: ``directory`` (checked: an existing directory on a tmpfs), or
    ``/dev/shm``."""
    if directory is None:
        return SHM_DIR
    try:
        d = os.fspath(directory)
    except TypeError:
        raise SharedSegmentError(f"a shared-table directory is a path, got {directory!r}") from None
    if not isinstance(d, str) or not os.path.isdir(d):
        raise SharedSegmentError(f"shared-table directory {d!r} is not an existing directory; create it and mount a "
                                 f"tmpfs on it (mkdir -p {d} && mount -t tmpfs -o huge=always,size=<table>G uvaple "
                                 f"{d}), or use the default {SHM_DIR}")
    fstype = system.filesystem_type(d)
    if fstype is not None and fstype != TMPFS_MAGIC:
        raise SharedSegmentError(
            f"shared-table directory {d!r} is not on a tmpfs (filesystem type {fstype:#x}): a table there "
            f"would be backed by a disk. Use the default {SHM_DIR}, or mount a tmpfs on a new empty directory (a "
            f"mount hides what {d!r} holds: mkdir /mnt/uvaple && mount -t tmpfs -o huge=always,size=<table>G uvaple "
            f"/mnt/uvaple) and give that")
    return os.path.abspath(d)


def segment_path(name: str, directory: str | os.PathLike | None = None) -> str:
    """``<directory>/uvaple.<name>`` (``/dev/shm`` by default); a name is 1-200 letters, digits, ``_``,
    ``-`` or ``.``."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise SharedSegmentError(
            f"shared table name {name!r} is not valid: use 1-200 letters, digits, '_', '-' or '.'")
    return os.path.join(segment_dir(directory), PREFIX + name)


# ---------------------------------------------------------------------------------------- locks
def _ofd(fd: int, ltype: int, byte: int) -> bool:
    """Set (or clear, ``F_UNLCK``) an open-file-description lock on one byte; False if another holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK_STRUCT.pack(ltype, os.SEEK_SET, byte, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _held_by_other(fd: int, byte: int, ltype: int = fcntl.F_WRLCK) -> bool:
    """Whether another open file holds a lock on ``byte`` that conflicts with ``ltype``."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK_STRUCT.pack(ltype, os.SEEK_SET, byte, 1, 0))
    return _FLOCK_STRUCT.unpack(res)[0] != fcntl.F_UNLCK


_held = threading.local()  # this thread's namespace-lock depth per directory (a finalizer may re-enter)
_ns_fds: set[int] = set()  # namespace-lock descriptors open in this process (closed in a forked child)
_open_segments: weakref.WeakSet = weakref.WeakSet()  # segments with descriptors open in this process
_fork_hook = False


def _close_inherited() -> None:
    """In a forked child: drop the copies of the parent's namespace-lock and segment descriptors (closing a
    copy never releases the parent's lock; keeping it would hold the lock after the parent is gone: a build
    lock kept so would make a killed creator look alive). A fork by C code that runs no Python fork hook and
    does not exec keeps them: only its exit lets go."""
    global _held
    for fd in list(_ns_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _ns_fds.clear()
    for seg in list(_open_segments):
        seg.close_descriptor()
    _held = threading.local()


@contextmanager
def _namespace(deadline: float, what: str, directory: str = SHM_DIR) -> Iterator[None]:
    """Hold the namespace lock (``flock`` on the segments' directory) until the block ends.

    Re-entrant on one thread: a finalizer that detaches a segment may run inside another decision."""
    global _fork_hook
    depth = getattr(_held, "depth", None)
    if depth is None:
        depth = _held.depth = {}
    if depth.get(directory, 0):
        depth[directory] += 1
        try:
            yield
        finally:
            depth[directory] -= 1
        return
    if not _fork_hook:
        _fork_hook = True
        os.register_at_fork(after_in_child=_close_inherited)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    _ns_fds.add(fd)
    try:
        delay = _POLL_MIN_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise SharedSegmentTimeout(
                        f"{what}: another process held the {directory} namespace lock (flock on the "
                        f"directory) for the whole wait; it is held for microseconds at a time, so that "
                        f"process is stopped or stuck: find it with `fuser {directory}`") from None
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        depth[directory] = 1
        try:
            yield
        finally:
            depth[directory] = 0
    finally:
        _ns_fds.discard(fd)
        os.close(fd)  # closing drops the flock


# ---------------------------------------------------------------------------------------- segment
# A header read may race with its rewrite (the state changes once or twice in a segment's life, and a
# read is not atomic against a write): a read with our magic but unparsable JSON is tried again.
_TORN_RETRIES = 50
_TORN_WAIT_S = 1e-3


def _read_header(fd: int) -> dict | None:
    """The header of an open segment file, or None when it is not a (complete) uvaple header."""
    meta = _read_header_or_torn(fd)
    return None if meta is _TORN else meta


_TORN = object()  # our magic, and JSON that did not parse in any of the retries


def _read_header_or_torn(fd: int):
    """The header of an open segment file; None when it is not a uvaple header; ``_TORN`` when it has our
    magic but its JSON stayed torn through every retry (its writer stopped between its two writes)."""
    for _ in range(_TORN_RETRIES):
        raw = os.pread(fd, _HEADER_BYTES, 0)
        if len(raw) < _HEAD.size:
            return None
        magic, n = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            return None
        if n <= _HEADER_BYTES - _HEAD.size:
            try:
                meta = json.loads(raw[_HEAD.size:_HEAD.size + n])
                return meta if isinstance(meta, dict) else None
            except (ValueError, UnicodeDecodeError):
                pass
        time.sleep(_TORN_WAIT_S)  # our magic, a torn header: its writer is mid-rewrite
    return _TORN


def _magic_of(fd: int) -> bytes:
    return os.pread(fd, len(MAGIC), 0)


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _unlink_if_same(path: str, fd: int) -> None:
    if _same_file(path, fd):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """One segment file open in this process: its descriptor (which is mapped and carries the attach lock) and
    header; a creator's build lock is on a second descriptor of the file, ``build_fd``, never mapped.

    The two locks live on two open files because a mapping keeps its open file alive: a child forked while the
    table is mapped holds the mapped file's locks until it unmaps or exits, even after it closed its copy of
    the descriptor. For the attach lock that is right (the child can read the table); the build lock must end
    with the creator, or a creator killed after forking its workers would look alive to every waiter until its
    last child exits."""

    def __init__(self, name: str, path: str, fd: int, created: bool) -> None:
        self.name = name
        self.path = path
        self.fd: int | None = fd
        self.build_fd: int | None = None  # the creator's, until ready or failed
        self.created = created
        self.pid = os.getpid()
        _open_segments.add(self)  # its descriptors are closed in a forked child (_close_inherited)

    @property
    def directory(self) -> str:
        return os.path.dirname(self.path)

    def header(self) -> dict | None:
        return _read_header(self.fd)

    def write_header(self, meta: dict) -> None:
        payload = json.dumps(meta, sort_keys=True).encode()
        if len(payload) > _HEADER_BYTES - _HEAD.size:
            raise SharedSegmentError(f"shared table {self.name!r}: header of {len(payload)} bytes is too long "
                                     "(shorten the tag)")
        # The JSON first, then the magic and length: a reader never sees a length for JSON not yet there.
        os.pwrite(self.fd, payload, _HEAD.size)
        os.pwrite(self.fd, _HEAD.pack(MAGIC, len(payload)), 0)

    def set_state(self, state: str, error: str | None = None) -> None:
        meta = self.header() or {}
        meta["state"] = state
        if error is not None:  # bounded in bytes as JSON writes it (escapes included)
            meta["error"] = error.encode("ascii", "backslashreplace")[:800].decode("ascii")
        self.write_header(meta)

    def ready(self) -> None:
        """The rows are complete: mark the header ``ready`` and let go of the build lock."""
        self.set_state("ready")
        self._let_go_of_build()

    def _let_go_of_build(self) -> None:
        fd = self.build_fd
        if fd is None:
            return
        try:
            _ofd(fd, fcntl.F_UNLCK, _BUILD_BYTE)  # explicitly: a forked child not yet exec'd shares the file
        finally:
            self.build_fd = None
            os.close(fd)

    def fail(self, error: BaseException) -> None:
        """The fill failed: waiters get ``error``; the file is removed (nobody can use it). Never raises."""
        try:
            self.set_state("failed", f"{type(error).__name__}: {error}")
        except Exception as e:  # noqa: BLE001 - the removal below must still happen
            log.warning("marking shared table %r failed did not work: %s", self.name, e)
        finally:
            try:
                with _namespace(time.monotonic() + _DETACH_LOCK_TIMEOUT_S, f"removing {self.name!r}",
                            self.directory):
                    _unlink_if_same(self.path, self.fd)
                reaper.forget(self.path, self.fd)
            except Exception as e:  # noqa: BLE001
                log.warning("removing the failed shared table %r did not work: %s", self.name, e)
            finally:
                self.close_descriptor()

    def unlink(self) -> None:
        """Remove the name now, if it is still this segment's (every mapping stays valid)."""
        if self.fd is None or self.pid != os.getpid():
            return
        with _namespace(time.monotonic() + _DETACH_LOCK_TIMEOUT_S, f"unlinking {self.name!r}",
                            self.directory):
            _unlink_if_same(self.path, self.fd)

    @property
    def is_ready(self) -> bool:
        return self.fd is not None and (self.header() or {}).get("state") == "ready"

    def wait_ready(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the creator marks the segment ready; raise its failure, a named
        timeout, or an error when it died before (the segment cannot become ready any more)."""
        if self.fd is None:
            raise SharedSegmentError(f"shared table {self.name!r} is detached")
        if self.build_fd is not None:
            raise SharedSegmentError(
                f"shared table {self.name!r}: this process created it and is to fill it; mark it ready when "
                "filled (HostTable.mark_ready()); wait_ready() is for the processes that attached to it")
        head = self.header() or {}
        if head.get("state") == "ready":
            return
        if not _wait_built(self.name, self.fd, head, time.monotonic() + timeout, timeout):
            raise SharedSegmentError(
                f"shared table {self.name!r}: its creator (pid {head.get('creator_pid')}) died before it was "
                "ready; this process mapped the unfinished segment and cannot use it: restart it (a new "
                "HostTable.shared creates the table again)")

    def others_attached(self) -> bool:
        return _held_by_other(self.fd, _ATTACH_BYTE)

    def detach(self) -> None:
        """Let go of the segment; unlink its name when no other process has it open. Idempotent."""
        if self.fd is None:
            return
        try:
            if self.pid == os.getpid():
                with _namespace(time.monotonic() + _DETACH_LOCK_TIMEOUT_S, f"detaching {self.name!r}",
                            self.directory):
                    try:
                        # Our locks go first, inside the namespace lock: of processes detaching at once the
                        # last then sees no one left and unlinks. Explicitly: a mapping of the file keeps
                        # its open file description, and with it the locks, alive after close() (at exit
                        # the table stays mapped).
                        _ofd(self.fd, fcntl.F_UNLCK, _ATTACH_BYTE)
                        self._let_go_of_build()
                        if not self.others_attached():
                            _unlink_if_same(self.path, self.fd)
                        reaper.forget(self.path, self.fd)  # last: killed before it, the reaper does the above
                    finally:
                        self.close_descriptor()
        finally:
            self.close_descriptor()

    def close_descriptor(self) -> None:
        """Close this process's descriptors of the file (a forked child's copies too: closing a copy releases
        nothing the parent holds)."""
        for attr in ("build_fd", "fd"):
            fd = getattr(self, attr)
            setattr(self, attr, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {'created' if self.created else 'attached'})"


def _new_file(name: str, path: str, meta: dict, total_bytes: int) -> Segment:
    """Create the file (namespace lock held): build and attach locks, size, header ``building``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise SharedSegmentError(f"creating shared table {name!r} at {path} failed: {e.strerror}") from e
    seg = Segment(name, path, fd, created=True)
    try:
        seg.build_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the same file, opened anew: never mapped
        if not (_ofd(seg.build_fd, fcntl.F_WRLCK, _BUILD_BYTE) and _ofd(fd, fcntl.F_RDLCK, _ATTACH_BYTE)):
            raise SharedSegmentError(f"locking the new shared table {name!r} failed")
        os.ftruncate(fd, total_bytes)
        seg.write_header(dict(meta, state="building", creator_pid=os.getpid(), created_unix=time.time()))
    except BaseException:
        os.unlink(path)
        seg.close_descriptor()
        raise
    return seg


def _classify(fd: int) -> tuple[str, dict | None]:
    """What an existing segment file is: ``ready``, ``failed``, ``building`` (creator alive), ``stale``
    (creator dead before ready) or ``foreign`` (not a uvaple file).

    The build lock is read before the header. A creator writes ``ready`` (or ``failed``) and only then lets
    go of the lock, outside the namespace lock: read the other way round, a header read just before that
    write and a lock read just after it would call a live creator's finished table stale, and the caller
    would remove it and build a second copy."""
    building = _held_by_other(fd, _BUILD_BYTE)
    meta = _read_header_or_torn(fd)
    if meta is _TORN:
        # Our magic, the JSON mid-rewrite for longer than the retries: a creator stopped between its two
        # writes (preempted on a loaded machine) is still building; one that died there left a stale file.
        return ("building", {}) if building else ("stale", None)
    if meta is None:
        # A creator dies between creating the file and writing the header only inside the namespace lock,
        # and leaves an all-zero head; anything else there is somebody else's file.
        if building or _magic_of(fd).strip(b"\0"):
            return "foreign", None
        return "stale", None
    state = meta.get("state")
    if state == "ready":
        return "ready", meta
    if state == "failed":
        return "failed", meta
    # Free before the header said "building": a dead creator, or (outside the namespace lock: `shm list`) one
    # that created the file and took the lock between the two reads.
    return ("building" if building or _held_by_other(fd, _BUILD_BYTE) else "stale"), meta


def _mismatch(meta: dict, want: dict, size: int) -> list[str]:
    bad = [f"{k}: expected {v!r}, segment has {meta.get(k)!r}" for k, v in want.items()
           if v is not None and meta.get(k) != v]
    try:
        need = int(meta["data_offset"]) + system.round_up(int(meta["rows"]) * int(meta["stride_bytes"]),
                                                          system.PAGE_SIZE)
    except (KeyError, TypeError, ValueError):
        return bad + ["the header lacks rows/stride_bytes/data_offset"]
    if size < need:
        bad.append(f"the file is truncated: {size} bytes, the header says {need}")
    return bad


def _open_existing(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SharedSegmentError(f"opening shared table {path} failed: {e.strerror}") from e
    if not _stat_is_file(fd):
        os.close(fd)
        raise SharedSegmentError(f"{path} is not a regular file; it is not a uvaple shared table")
    return fd


def _stat_is_file(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


def _failed_error(name: str, meta: dict) -> SharedSegmentError:
    return SharedSegmentError(
        f"shared table {name!r}: its creator (pid {meta.get('creator_pid')}) failed while filling it: "
        f"{meta.get('error', 'unknown error')}")


def _step(name: str, path: str, meta: dict, want: dict, total_bytes: int, deadline: float, *,
          create_ok: bool, attach_ok: bool, replace_orphan: bool,
          attach_building: bool = False) -> Segment | tuple[int, dict]:
    """One decision under the namespace lock: a Segment (created or attached), or (fd, header) of a
    segment still being built, to wait on outside the lock."""
    with _namespace(deadline, f"shared table {name!r}", os.path.dirname(path)):
        while True:
            fd = _open_existing(path)
            if fd is None:
                if not create_ok:
                    raise SharedSegmentError(
                        f"no shared table named {name!r} ({path} does not exist); create it with "
                        f"HostTable.shared({name!r}, ...) or HostTable.empty(..., name={name!r})")
                return _new_file(name, path, meta, total_bytes)
            keep = False
            try:
                kind, head = _classify(fd)
                if kind == "foreign":
                    raise SharedSegmentError(
                        f"{path} exists but is not a uvaple shared table (bad header); it was left alone: "
                        f"remove it yourself if it is stale, or pick another name")
                if kind == "stale":
                    _unlink_if_same(path, fd)  # namespace lock held: this is the file we classified
                    continue
                if kind == "failed":
                    if not _held_by_other(fd, _ATTACH_BYTE):  # its creator died before removing it
                        _unlink_if_same(path, fd)
                        continue
                    raise _failed_error(name, head)
                if kind == "building":
                    if not attach_ok:
                        raise SharedSegmentError(
                            f"a shared table named {name!r} is being created by pid {head.get('creator_pid')}; "
                            f"attach to it with HostTable.shared({name!r}, ...), which waits, or pick another name")
                    if attach_building and head:  # map it now, wait for it later (Segment.wait_ready)
                        bad = _mismatch(head, want, os.fstat(fd).st_size)
                        if bad:
                            raise SharedSegmentError(f"shared table {name!r} does not match: " + "; ".join(bad) +
                                                     " (its creator is still filling it)")
                        if not _ofd(fd, fcntl.F_RDLCK, _ATTACH_BYTE):
                            raise SharedSegmentError(f"taking the attach lock of shared table {name!r} failed")
                        keep = True
                        return Segment(name, path, fd, created=False)
                    keep = True
                    return fd, head  # (a header mid-rewrite, {}: the state is changing, so wait for it)
                # ready
                if not attach_ok:
                    raise SharedSegmentError(
                        f"a shared table named {name!r} already exists ({path}); attach to it with "
                        f"HostTable.attach({name!r}) or HostTable.shared({name!r}, ...), or pick another name")
                bad = _mismatch(head, want, os.fstat(fd).st_size)
                if bad:
                    if replace_orphan and not _held_by_other(fd, _ATTACH_BYTE):
                        _unlink_if_same(path, fd)  # nobody has it open, and it is not what was asked for
                        continue
                    raise SharedSegmentError(f"shared table {name!r} does not match: " + "; ".join(bad) +
                                             (" (other processes have it open)" if replace_orphan else
                                              "; remove it with `uvaple shm clean` when no one uses it"))
                if not _ofd(fd, fcntl.F_RDLCK, _ATTACH_BYTE):
                    raise SharedSegmentError(f"taking the attach lock of shared table {name!r} failed")
                keep = True
                return Segment(name, path, fd, created=False)
            finally:
                if not keep:
                    os.close(fd)


def _wait_built(name: str, fd: int, head: dict, deadline: float, timeout: float) -> bool:
    """Poll a segment being built until it is ready (True) or its creator is gone (False: start over)."""
    delay = _POLL_MIN_S
    while True:
        kind, meta = _classify(fd)
        if kind == "ready":
            return True
        if kind == "failed":
            raise _failed_error(name, meta)
        if kind != "building":
            return False
        now = time.monotonic()
        if now >= deadline:
            pid = (meta or head or {}).get("creator_pid")
            age = time.time() - float((meta or head or {}).get("created_unix", time.time()))
            alive = "alive" if _pid_alive(pid) else "not found"
            raise SharedSegmentTimeout(
                f"HostTable.shared({name!r}): waited {timeout:.3g} s for pid {pid} ({alive}) to fill the "
                f"table; it still holds the build lock, {age:.1f} s after creating it. Give a longer "
                f"timeout= (a 100 GB fill takes tens of seconds) or check that process")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, _POLL_MAX_S)


def create_or_attach(name: str, meta: dict, want: dict, total_bytes: int, *, timeout: float,
                     create_ok: bool = True, attach_ok: bool = True, replace_orphan: bool = True,
                     attach_building: bool = False, directory: str | os.PathLike | None = None) -> Segment:
    """Create segment ``name`` (``seg.created``: this process must fill it and call ``seg.ready()``) or
    attach to the ready one, waiting at most ``timeout`` seconds for a live creator to finish.

    ``attach_building``: attach to one a live creator is still filling at once (the caller waits later,
    with :meth:`Segment.wait_ready`)."""
    path = segment_path(name, directory)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    deadline = time.monotonic() + timeout
    reaper.start()  # before there is a segment to leave behind
    while True:
        got = _step(name, path, meta, want, total_bytes, deadline, create_ok=create_ok, attach_ok=attach_ok,
                    replace_orphan=replace_orphan, attach_building=attach_building)
        if isinstance(got, Segment):
            reaper.watch(got.path, got.fd)
            return got
        fd, head = got
        try:
            _wait_built(name, fd, head, deadline, timeout)
        finally:
            os.close(fd)
        # ready, or the creator died: decide again under the namespace lock (the file may be gone)


def create(name: str, meta: dict, total_bytes: int, *, timeout: float = _DETACH_LOCK_TIMEOUT_S,
           directory: str | os.PathLike | None = None) -> Segment:
    """Create segment ``name``; a live one of that name is an error, a stale one is replaced."""
    return create_or_attach(name, meta, {}, total_bytes, timeout=timeout, attach_ok=False, directory=directory)


def attach(name: str, want: dict, *, timeout: float = _DETACH_LOCK_TIMEOUT_S,
           directory: str | os.PathLike | None = None) -> Segment:
    """Attach to the ready segment ``name`` (no wait for a creator: that is ``create_or_attach``)."""
    path = segment_path(name, directory)
    deadline = time.monotonic() + timeout
    reaper.start()  # before there is a segment to leave behind
    got = _step(name, path, {}, want, 0, deadline, create_ok=False, attach_ok=True, replace_orphan=False)
    if isinstance(got, Segment):
        reaper.watch(got.path, got.fd)
        return got
    fd, head = got
    os.close(fd)
    raise SharedSegmentError(
        f"shared table {name!r} exists but its creator (pid {head.get('creator_pid')}) has not finished "
        f"filling it; attach after it is ready, or use HostTable.shared({name!r}, ...), which waits")


def remove_unused(path: str, file_id: tuple[int, int], deadline: float) -> bool:
    """A dead process's last detach, made by its reaper (:mod:`.reaper`): remove ``path`` if it is still
    the file ``file_id`` (``st_dev``, ``st_ino``) and no process holds its attach lock or fills it. True when
    nothing is left to do (removed, gone, another file now, not ours); False while a lock is still held."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(file_id):
            return True
        with _namespace(deadline, f"removing the shared table {path} of a process that died",
                        os.path.dirname(path)):
            kind, _ = _classify(fd)
            if kind == "foreign":
                return True
            if kind == "building" or _held_by_other(fd, _ATTACH_BYTE):
                return False
            _unlink_if_same(path, fd)
            return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- inspection
@dataclass(frozen=True)
class SegmentInfo:
    """What ``uvaple shm list`` shows of one segment."""

    name: str
    path: str
    size_bytes: int  # the file: header, rows and page rounding (what the segment maps)
    state: str  # ready / building / failed / stale / foreign
    creator_pid: int | None
    rows: int | None
    cols: int | None
    dtype: str | None
    tag: str | None
    attached: bool  # some process holds the attach lock
    pids: tuple[int, ...]  # processes that have it mapped (from /proc/*/maps; same-user processes)
    stride_bytes: int | None = None  # bytes between row starts (the header's)

    @property
    def table_bytes(self) -> int | None:
        """The table's bytes: rows x row stride, as the table holds them (None without a uvaple header)."""
        if self.rows is None or self.stride_bytes is None:
            return None
        return int(self.rows) * int(self.stride_bytes)

    @property
    def in_use(self) -> bool:
        return self.attached or self.state == "building" or bool(self.pids)


def _mapped_by(path: str) -> tuple[int, ...]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                if any(line.rstrip().endswith(path) or line.rstrip().endswith(path + " (deleted)") for line in f):
                    pids.append(int(entry))
        except OSError:
            continue
    return tuple(sorted(pids))


def _info(path: str) -> SegmentInfo | None:
    name = os.path.basename(path)[len(PREFIX):]
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if not _stat_is_file(fd):
            return None
        kind, meta = _classify(fd)
        meta = meta or {}
        attached = kind != "foreign" and _held_by_other(fd, _ATTACH_BYTE)
        return SegmentInfo(name, path, os.fstat(fd).st_size, kind, meta.get("creator_pid"), meta.get("rows"),
                           meta.get("cols"), meta.get("dtype"), meta.get("tag"), attached, _mapped_by(path),
                           meta.get("stride_bytes"))
    finally:
        os.close(fd)


def list_segments(directory: str | os.PathLike | None = None) -> list[SegmentInfo]:
    """Every ``uvaple.*`` file of the directory (``/dev/shm``), with its state and who has it open."""
    d = segment_dir(directory)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    infos = [_info(os.path.join(d, n)) for n in names if n.startswith(PREFIX)]
    return [i for i in infos if i is not None]


def clean(names: list[str] | None = None, *, dry_run: bool = False, timeout: float = _DETACH_LOCK_TIMEOUT_S,
          directory: str | os.PathLike | None = None) -> list[SegmentInfo]:
    """Remove segments nobody uses (stale, failed, or ready with no process attached); returns them.

    ``names`` limits it to those segments. Files that are not uvaple's are never removed. The scan of
    ``/proc`` runs outside the namespace lock; each candidate is checked again under it before removal.
    """
    d = segment_dir(directory)
    candidates = [i for i in list_segments(d) if (names is None or i.name in names)
                  and i.state != "foreign" and not i.in_use]
    removed = []
    with _namespace(time.monotonic() + timeout, "uvaple shm clean", d):
        for info in candidates:
            try:
                fd = os.open(info.path, os.O_RDONLY)
            except OSError:
                continue
            try:
                kind, _ = _classify(fd)
                if kind in ("foreign", "building") or _held_by_other(fd, _ATTACH_BYTE):
                    continue  # changed since the scan: in use now
                if not dry_run:
                    _unlink_if_same(info.path, fd)
                removed.append(info)
            finally:
                os.close(fd)
    return removed

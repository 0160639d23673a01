"""The segments of a killed process: a small watcher removes their names when it is gone.

A process lets go of a shared segment through :meth:`Segment.detach <.segments.Segment.detach>`: at close,
and at its end through ``atexit`` and ``multiprocessing``'s exit finalizers (:mod:`._region`). A process
killed with ``SIGKILL`` runs none of them, and that is how ``vllm serve`` stops its engine core ("force
killing remaining processes", no grace period). The segment's name then stays in ``/dev/shm`` and its pages,
the whole table, stay in host memory until ``uvaple shm clean``.

So the first segment a process creates or attaches starts its **reaper**: a Python process started with
``exec`` (not a fork: no lock, thread or CUDA state of the model's process goes with it; it imports the
segment protocol only, not torch) in a session of its own (a signal to the model's process group does not
reach it), holding no descriptor of its parent's but its end of one pipe (its output goes to ``/dev/null``:
a harness reading the parent's output is not kept waiting by it). The parent writes a line on the pipe
for each segment it opens and each it lets go; it holds the pipe's only write end (closed in forked children
at once, and close-on-exec). When the pipe reads end-of-file the parent is gone, however it ended, and the
reaper does what the parent's last detach would have done, for each segment it still held: under the
namespace lock, remove the name if it still names the same file and no process holds the attach lock.

The dead parent's own locks drop as its last references to the file go, a moment after the pipe closes, so
the reaper tries again for a bounded time (``_LOCKS_DROP_S``). A segment that another process still holds
after that is left to that process, whose own detach (or reaper) removes it. A process that ends normally has
detached its segments and said so; its reaper finds nothing to do and exits.

Nothing here is on a lookup's path: a process writes to the pipe when it opens or lets go of a segment.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

log = logging.getLogger("uvaple.uva")

__all__ = ["watch", "forget", "reaper_pid"]

# How long a reaper waits for a dead parent's locks on a segment to drop before it leaves the segment to
# whoever holds it (a live process: another replica, a forked child).
_LOCKS_DROP_S = 10.0
_RETRY_S = 0.02

# The reaper's entry: the package ``uvaple.uva`` is made a bare namespace at this module's directory, so that
# its ``__init__`` (which imports torch) does not run; the descriptors it may have inherited are closed.
_BOOT = (
    "import os, sys, types\n"
    "os.closerange(3, os.sysconf('SC_OPEN_MAX'))\n"
    "os.chdir('/')\n"
    "for n, p in (('uvaple', []), ('uvaple.uva', [sys.argv[1]])):\n"
    "    m = types.ModuleType(n); m.__path__ = p; sys.modules[n] = m\n"
    "from uvaple.uva import reaper\n"
    "reaper.serve(sys.stdin.buffer)\n"
)

_lock = threading.Lock()
_pid: int | None = None  # the reaper of this process
_fd: int | None = None  # the pipe's write end
_owner: int | None = None  # the process that started it (a forked child has none until it starts its own)
_hook = False
_warned = False


def _after_fork_in_child() -> None:
    """A forked child drops its copy of the parent's pipe (else the parent's death would not be seen while the
    child lives) and starts a reaper of its own if it opens a segment itself."""
    global _pid, _fd, _owner, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    if _fd is not None:
        try:
            os.close(_fd)
        except OSError:
            pass
    _pid = _fd = _owner = None


def _start() -> None:
    """Start this process's reaper (lock held)."""
    global _pid, _fd, _owner, _hook
    if not _hook:
        _hook = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
    if not sys.executable:
        raise OSError("this interpreter has no sys.executable to start the reaper with")
    read_end, write_end = os.pipe()  # both close-on-exec
    try:
        pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", "-c", _BOOT,
                                              os.path.dirname(os.path.abspath(__file__))],
                             dict(os.environ), setsid=True,
                             file_actions=[(os.POSIX_SPAWN_DUP2, read_end, 0),
                                           (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                                           (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    _pid, _fd, _owner = pid, write_end, os.getpid()


def _send(message: dict) -> None:
    line = (json.dumps(message) + "\n").encode()
    os.write(_fd, line)  # one line, far under PIPE_BUF: written whole or not at all


def _tell(op: str, path: str, fd: int) -> None:
    global _warned
    st = os.fstat(fd)
    with _lock:
        try:
            if _owner != os.getpid():
                if op != "open":
                    return
                _start()
            _send({"op": op, "path": path, "dev": st.st_dev, "ino": st.st_ino})
        except OSError as e:
            if not _warned:
                _warned = True
                log.warning("the watcher that removes this process's shared segments if it is killed could not "
                            "be started or reached (%s); if it is killed, remove what it leaves with "
                            "`uvaple shm clean`", e)


def watch(path: str, fd: int) -> None:
    """This process has segment ``path`` (open as ``fd``): remove its name if the process dies holding it."""
    _tell("open", path, fd)


def forget(path: str, fd: int) -> None:
    """This process let go of segment ``path`` (still open as ``fd``)."""
    _tell("close", path, fd)


def reaper_pid() -> int | None:
    """The pid of this process's reaper, or None before it opened a segment."""
    return _pid if _owner == os.getpid() else None


# ---------------------------------------------------------------------------------------- the reaper
def serve(pipe) -> None:
    """The reaper's loop: follow the parent's segments until its pipe ends, then remove what it held."""
    from . import segments  # (segments imports this module)

    held: dict[tuple[int, int], str] = {}
    for line in pipe:
        try:
            m = json.loads(line)
            key = (int(m["dev"]), int(m["ino"]))
            if m["op"] == "open":
                held[key] = str(m["path"])
            else:
                held.pop(key, None)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a parent killed mid-write
    deadline = time.monotonic() + _LOCKS_DROP_S
    while held:
        for key, path in list(held.items()):
            try:
                done = segments.remove_unused(path, key, deadline)
            except Exception:  # noqa: BLE001 - one segment's failure must not keep the others
                done = True  # (an unreadable file, the namespace lock held past the deadline: left alone)
            if done:
                del held[key]
        if held and time.monotonic() >= deadline:
            return  # held by a live process now: its own detach removes it
        if held:
            time.sleep(_RETRY_S)

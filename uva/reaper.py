"""The segments of a killed process: a watcher removes their names when it is gone.

A process lets go of a shared segment through :meth:`Segment.detach <.segments.Segment.detach>`: at close,
and at its end through ``atexit`` and ``multiprocessing``'s exit finalizers (:mod:`._region`). A process
killed with ``SIGKILL`` runs none of them, and that is how ``vllm serve`` stops its engine core (vLLM's
``kill_process_tree``: every descendant first, then the process, no grace period). The segment's name then
stays in ``/dev/shm`` and its pages, the whole table, stay in host memory until ``uvaple shm clean``.

So the first segment a process creates or attaches starts its **reaper**, a watcher process:

* **Out of the process's tree.** Started with ``exec`` (not a bare fork: no lock, thread or CUDA state of
  the model's process goes with it), it forks once more and the middle process exits, so the reaper is
  adopted by init (or the nearest child subreaper; if that is the model's process itself, a warning says so):
  a kill of the model's process and all its descendants (vLLM's) does not reach it. Its own session, and it
  ignores ``SIGTERM``, ``SIGINT``, ``SIGHUP`` and ``SIGQUIT``: a stop signalled to a whole process group or
  cgroup before it kills them does not end it first. It imports the segment protocol only, not torch
  (``python -I -S``), closes every descriptor it inherited but its end of one socket, writes to
  ``/dev/null``, and tells its pid back once it has imported what it runs (the start's handshake, bounded
  by ``_START_S``: no pid, no reaper, a warning). It is started before the process's first segment is made.
* **Told what the process holds.** The process writes a line on the socket for each segment it opens and
  each it lets go (path, device and inode; a let-go after the name's removal), counted: a segment opened
  twice is held until let go of twice. It holds the socket's only end (close-on-exec; closed at once in a
  forked child); a write never blocks it and never raises ``SIGPIPE`` (a non-blocking socket,
  ``MSG_NOSIGNAL``); a reaper that cannot be reached is a warning, once, and is not written to again.
* **Waiting for the process to be gone.** End-of-file on the socket means the process is ending; the reaper
  then waits (at most ``_EXIT_WAIT_S``) on a pidfd of the process, readable once its exit is complete, so that
  a first try seldom finds the dead process's own locks. Then it does what the process's last detach would
  have done, for each segment it still held (:func:`.segments.remove_unused`): under the namespace lock,
  remove the name if it still names the same file and no process holds the attach lock. A segment still
  held (a replica; a child the process forked, which shares its mapping or, on a GPU, its registration; a
  driver's deferred release) is tried again, less and less often (up to every ``_RETRY_MAX_S``), until that
  holder lets go (its own detach removes the name, or it dies and this reaper removes it) or the name names
  another file. The retries, not the pidfd, are what make the removal certain.

What it cannot help: the reaper killed too (a stop of the whole cgroup with ``SIGKILL``, ``pkill -9
python``; a container whose PID 1 is the server, whose end kills every process of its PID namespace at once,
while ``/dev/shm`` is the host's or the pod's: ``--ipc=host``), a reaper that could not start (warned), a
process killed in the microseconds between making a segment and telling its reaper. Such a segment stays,
for the next ``HostTable.shared`` of that name to attach or replace, or for ``uvaple shm clean``. A process
that ends normally has let go of its segments itself; its reaper finds nothing held and exits. Nothing here is
on a lookup's path: the process writes to the socket when it opens or lets go of a segment.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import sys
import threading
import time

from .errors import SharedSegmentTimeout

log = logging.getLogger("uvaple.uva")

__all__ = ["start", "watch", "forget", "reaper_pid"]

_START_S = 10.0  # for the reaper's pid to come back at its start
_EXIT_WAIT_S = 120.0  # for a dead process's exit to complete (a large registered table's release)
_RETRY_MIN_S, _RETRY_MAX_S = 0.02, 5.0  # trying a segment another process holds again
_NAMESPACE_WAIT_S = 10.0  # for the namespace lock, at each try

# The reaper's start. Run as ``python -I -S -c _BOOT <uvaple.uva's directory> <parent pid>``, the socket on
# descriptor 0 and the handshake's pipe on 1. The first process ignores the signals a stop sends a whole group
# or cgroup (the reaper ends by itself), closes what it inherited (the descriptors ``/proc`` lists: a limit of
# 2^30 descriptors makes a loop over all of them minutes long), opens a pidfd of its parent (which is checked
# to be the model's process: a pid reused in between is not waited on), makes the package ``uvaple.uva`` a bare
# namespace at its directory (its ``__init__`` imports torch) and imports this module and the protocol; only
# then does it fork the reaper and hand its pid back, and exit.
_BOOT = (
    "import os, signal, sys, types\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"
    "for fd in [int(f) for f in os.listdir('/proc/self/fd')]:\n"
    "    if fd > 2:\n"
    "        try: os.close(fd)\n"
    "        except OSError: pass\n"
    "parent = int(sys.argv[2])\n"
    "try: exited = os.pidfd_open(parent) if os.getppid() == parent else None\n"
    "except (AttributeError, OSError): exited = None\n"
    "for n, p in (('uvaple', []), ('uvaple.uva', [sys.argv[1]])):\n"
    "    m = types.ModuleType(n); m.__path__ = p; sys.modules[n] = m\n"
    "from uvaple.uva import reaper, segments\n"
    "child = os.fork()\n"
    "if child:\n"
    "    os.write(1, b'%d\\n' % child)\n"
    "    os._exit(0)\n"
    "os.setsid()\n"
    "null = os.open(os.devnull, os.O_RDWR)\n"
    "os.dup2(null, 1); os.dup2(null, 2); os.close(null)\n"
    "os.chdir('/')\n"
    "reaper.serve(0, exited, segments.remove_unused)\n"
)

_lock = threading.RLock()  # re-entrant: a finalizer that detaches a segment may run inside a call here
_sock: socket.socket | None = None  # this process's end
_pid: int | None = None  # its reaper
_owner: int | None = None  # the process that started it (a forked child starts its own)
_starting = False
_failed = False  # the reaper could not be started or reached: warned once, not tried (or written to) again
_hook = False


def _after_fork_in_child() -> None:
    """A forked child closes its copy of the parent's socket (else the parent's end would not be seen while
    the child lives) and starts a reaper of its own if it opens a segment itself."""
    global _sock, _pid, _owner, _lock, _starting, _failed
    _lock = threading.RLock()  # another thread of the parent may have held it at the fork
    if _sock is not None:
        try:
            _sock.close()
        except OSError:
            pass
    _sock = _pid = _owner = None
    _starting = _failed = False


def _python() -> str:
    exe = sys.executable
    if getattr(sys, "frozen", False) or not exe or not os.path.basename(exe).startswith(("python", "pypy")):
        raise OSError(f"this process's executable ({exe or 'none'}) is not a Python interpreter to start it with")
    return exe


def _start() -> None:
    """Start this process's reaper (``_lock`` held)."""
    global _sock, _pid, _owner, _hook
    if not _hook:
        _hook = True
        os.register_at_fork(after_in_child=_after_fork_in_child)
    exe = _python()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # close-on-exec, both
    _sock = ours  # set at once: a fork from another thread from here on closes it in the child
    hand_r, hand_w = os.pipe()
    middle = None
    try:
        middle = os.posix_spawn(exe, [exe, "-I", "-S", "-c", _BOOT, os.path.dirname(os.path.abspath(__file__)),
                                      str(os.getpid())], dict(os.environ),
                                file_actions=[(os.POSIX_SPAWN_DUP2, theirs.fileno(), 0),
                                              (os.POSIX_SPAWN_DUP2, hand_w, 1),
                                              (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)])
        theirs.close()
        os.close(hand_w)
        hand_w = None
        pid = _read_pid(hand_r, middle)
    except BaseException:
        _sock = None
        ours.close()
        raise
    finally:
        theirs.close()
        if hand_w is not None:
            os.close(hand_w)
        os.close(hand_r)
        if middle is not None:
            _collect(middle)
    ours.setblocking(False)
    _pid, _owner = pid, os.getpid()
    if _parent_of(pid) == _owner:
        log.warning("this process is a child subreaper: the watcher of its shared segments (pid %d) is its child, "
                    "and a kill of its whole tree kills the watcher too (then `uvaple shm clean` removes what it "
                    "leaves)", pid)


def _read_pid(fd: int, middle: int) -> int:
    got = b""
    deadline = time.monotonic() + _START_S
    ready = select.poll()
    ready.register(fd, select.POLLIN)
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not ready.poll(left * 1000):
            os.kill(middle, 9)
            raise OSError(f"it did not start within {_START_S:g} s")
        chunk = os.read(fd, 32)
        if not chunk:
            raise OSError("it ended at its start (its interpreter could not import this module)")
        got += chunk
    return int(got)


def _collect(pid: int) -> None:
    """Collect the middle process (it exits as soon as it has forked the reaper), waiting a bounded time."""
    deadline = time.monotonic() + _START_S
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] or time.monotonic() > deadline:
                return  # (one stuck past the deadline is left a zombie: never a wait without end)
        except ChildProcessError:
            return
        time.sleep(0.001)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def start() -> None:
    """Start this process's reaper now if it has none (before a segment is made: the start's wait, or an
    interrupt in it, then comes before there is anything to leave behind). Never raises an ``Exception``."""
    global _starting, _failed
    try:
        with _lock:
            if _owner == os.getpid() or _starting or _failed:
                return  # (running; a finalizer inside the start; could not start)
            _starting = True
            try:
                _start()
            finally:
                _starting = False
    except Exception as e:  # noqa: BLE001 - the segment works without it
        _give_up(e)


def _give_up(e: Exception) -> None:
    global _failed
    if not _failed:
        _failed = True
        log.warning("the watcher that removes this process's shared segments if it is killed could not be "
                    "started or reached (%s); if this process is killed, remove what it leaves with "
                    "`uvaple shm clean`", e)


def _tell(op: str, path: str, fd: int) -> None:
    """Tell this process's reaper, if it has one (:func:`start`); never raises an ``Exception``."""
    try:
        st = os.fstat(fd)
        line = (json.dumps({"op": op, "path": path, "dev": st.st_dev, "ino": st.st_ino}) + "\n").encode()
        with _lock:
            if _owner != os.getpid() or _failed:
                return
            sent = 0
            while sent < len(line):
                sent += _sock.send(line[sent:], socket.MSG_NOSIGNAL)
    except Exception as e:  # noqa: BLE001 - a detach must go on
        _give_up(e)  # (and no more lines: one torn by a partial send would swallow the next)


def watch(path: str, fd: int) -> None:
    """This process has segment ``path`` (open as ``fd``): remove its name if the process dies holding it
    (the reaper started with :func:`start` before the segment was made)."""
    _tell("open", path, fd)


def forget(path: str, fd: int) -> None:
    """This process let go of segment ``path`` (still open as ``fd``)."""
    _tell("close", path, fd)


def reaper_pid() -> int | None:
    """The pid of this process's reaper, or None before it opened a segment (or when it could not start)."""
    return _pid if _owner == os.getpid() else None


# ---------------------------------------------------------------------------------------- the reaper
def serve(fd: int, exited: int | None, remove) -> None:
    """The reaper's loop: follow the parent's segments on ``fd`` until it ends and the parent's exit is complete
    (``exited``, a pidfd of it, readable then; None: not waited on), then remove what it held with ``remove``
    (:func:`.segments.remove_unused`, passed in: the protocol imports this module)."""
    held: dict[tuple[int, int], list] = {}  # (dev, ino) -> [path, times opened]
    with os.fdopen(fd, "rb") as f:
        for line in f:
            try:
                m = json.loads(line)
                key = (int(m["dev"]), int(m["ino"]))
                if m["op"] == "open":
                    held.setdefault(key, [str(m["path"]), 0])[1] += 1
                elif key in held:
                    held[key][1] -= 1
                    if held[key][1] <= 0:
                        del held[key]
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by the parent's death
    if not held:
        return
    if exited is not None:
        gone = select.poll()
        gone.register(exited, select.POLLIN)
        gone.poll(_EXIT_WAIT_S * 1000)  # readable once the exit is complete
        os.close(exited)
    delay = _RETRY_MIN_S
    while held:
        for key, (path, _) in list(held.items()):
            try:
                done = remove(path, key, time.monotonic() + _NAMESPACE_WAIT_S)
            except SharedSegmentTimeout:
                done = False  # the namespace lock was held the whole wait: later
            except Exception:  # noqa: BLE001 - a file it cannot read: left alone, as `shm clean` would
                done = True
            if done:
                del held[key]
        if held:
            time.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

"""Locks a forked child finds unlocked, and forks that never split a critical section they gate.

Only the forking thread exists in a forked child. A ``threading.Lock`` another thread held at the fork
stays held there for ever: the child's first use of it (a scrape, a metrics push, ``close()`` at exit)
would wait for ever. :class:`ForkSafeLock` is made anew in every forked child. Where the state a lock
guards must also be whole in the child (a metrics push: its own locks, ``prometheus_client``'s and the
lookups' are taken inside it), :func:`gate_fork` makes ``fork()`` take the lock first, waiting at most
:data:`FORK_WAIT_S`: the fork then falls between two critical sections, never inside one, and the lock
is given back in the parent. A section that overruns the wait is not waited for (a fork is never
wedged); the child still gets a fresh lock.

Objects that hold the parent's CUDA resources (pinned staging, events, streams, CUDA graphs) are registered
with :func:`keep_in_child`: in a forked child they are never freed, not at ``close()``, not at a drop, not at
the interpreter's exit. Freeing them there makes a CUDA call (torch's pinned-memory cache records events on
the streams that used a block), which cannot succeed in a child and aborts it.

A lock the *forking* thread holds is made anew too: code holding one must not fork (uvaple never does).
Locks of other libraries are theirs: ``prometheus_client`` keeps one lock for all of a process's
multiprocess values, held in a child for ever if another thread was updating a metric at the fork.

The ``os.register_at_fork`` hooks are installed at the first acquisition of any such lock or the first
gate (a lock never taken before a fork is free in the child anyway): importing uvaple installs nothing.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref

__all__ = ["ForkSafeLock", "gate_fork", "keep_in_child", "FORK_WAIT_S"]

# The longest a fork waits for one gated section (a push writes a few metric files: milliseconds).
FORK_WAIT_S = 2.0

_LOCKS: weakref.WeakSet = weakref.WeakSet()  # every ForkSafeLock of this process
_GATES: weakref.WeakSet = weakref.WeakSet()  # those a fork takes first
_KEEP: weakref.WeakSet = weakref.WeakSet()  # objects a forked child never frees (keep_in_child)
_registry_lock = threading.Lock()  # guards the two sets (made anew in a child, with them)
_held = threading.local()  # the gates the forking thread took (before and after hooks run on it)
_hooks = False


class ForkSafeLock:
    """A non-reentrant lock (``with``, ``acquire``, ``release``, ``locked``) that a forked child gets back
    unlocked, whoever held it at the fork."""

    __slots__ = ("_lock", "__weakref__")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        with _registry_lock:
            _LOCKS.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not _hooks:
            _install_hooks()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        if not _hooks:
            _install_hooks()
        return self._lock.acquire()

    def __exit__(self, *exc) -> None:
        self._lock.release()


def gate_fork(lock: ForkSafeLock) -> ForkSafeLock:
    """Make every later ``fork()`` of this process wait (at most :data:`FORK_WAIT_S`) until ``lock`` is free
    and hold it across the fork. Returns ``lock``. For a lock whose sections nest no other gate."""
    if not isinstance(lock, ForkSafeLock):
        raise TypeError(f"gate_fork takes a ForkSafeLock, got {type(lock).__name__}")
    _install_hooks()
    with _registry_lock:
        _GATES.add(lock)
    return lock


def keep_in_child(obj) -> None:
    """Never free ``obj`` (a weak-referenceable object holding CUDA resources of this process) in a child
    forked while it lives: the child takes one reference to it that it never gives back."""
    _install_hooks()
    with _registry_lock:
        _KEEP.add(obj)


def _install_hooks() -> None:
    global _hooks
    with _registry_lock:
        if not _hooks:  # registered under the lock: no lock is taken before its hooks exist
            os.register_at_fork(before=_before, after_in_parent=_after_in_parent,
                                after_in_child=_after_in_child)
            _hooks = True


def _before() -> None:
    with _registry_lock:
        gates = list(_GATES)
    # the list is the thread's before the first wait: an exception in the wait (a signal's handler; the fork
    # then goes on without this hook) leaves every lock taken so far where the parent's hook gives it back
    _held.taken = taken = []
    for lock in gates:
        if lock._lock.acquire(timeout=FORK_WAIT_S):
            taken.append(lock)


def _after_in_parent() -> None:
    taken, _held.taken = getattr(_held, "taken", []), []
    for lock in taken:
        lock._lock.release()


def _after_in_child() -> None:
    global _registry_lock, _held
    _registry_lock = threading.Lock()
    _held = threading.local()
    for lock in list(_LOCKS):
        lock._lock = threading.Lock()
    for obj in list(_KEEP):  # a reference never given back: not freed by a drop or at the exit
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

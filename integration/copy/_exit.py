"""Objects to clean up at interpreter exit, one registry per kind (host tables, copy backends).

The ``atexit`` hook is registered at the first ``add``: hooks run last-in first-out, so a kind whose first
object is made later (a backend, built over an existing table) is cleaned up first.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable


class ExitRegistry:
    """A weak set of live objects plus a hook that runs once at interpreter exit."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook = hook
        self._items: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered = False

    def add(self, obj) -> None:
        with self._lock:
            if not self._registered:
                atexit.register(self._hook)
                self._registered = True
            self._items.add(obj)

    def discard(self, obj) -> None:
        self._items.discard(obj)

    def items(self) -> list:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

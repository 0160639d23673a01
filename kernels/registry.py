"""Plans by handle: how an operator call finds the plan of the lookup that made it.

A compiled model calls the operators (``torch.ops.uvaple.*``) with tensors and integers; a lookup passes its
plan's handle too (``plan=``), so the operator's body launches that plan's kernels (made once) after
checking only what the call brings, instead of checking and choosing everything again. A handle names a
live plan only: the registry holds plans weakly, and a plan serves a call only when the call's table is the
plan's (same address and shape); anything else takes the operator's full path.
"""

from __future__ import annotations

import itertools
import threading
import weakref

__all__ = ["register", "find"]

_lock = threading.Lock()
_plans: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_next = itertools.count(1)


def register(plan) -> int:
    """A new handle for ``plan`` (held weakly)."""
    with _lock:
        handle = next(_next)
        _plans[handle] = plan
    return handle


def find(handle: int, table):
    """The live plan of ``handle`` if it reads ``table``, else None."""
    if handle < 0:
        return None
    plan = _plans.get(handle)
    if plan is None or plan.table_ptr != table.data_ptr() or plan.table_shape != table.shape:
        return None
    return plan

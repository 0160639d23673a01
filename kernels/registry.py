"""Plans by handle: how an operator call finds the plan of the lookup that made it.

A compiled model calls the operators (``torch.ops.uvaple.*``) with tensors and integers; a lookup passes its
plan's handle too (``plan=``), so the operator's body launches that plan's kernels (made once) after
checking only what the call brings, instead of checking and choosing everything again. A handle names a
live plan only: the registry holds plans weakly, and a plan serves a call only when the call's table is the
plan's (same address and shape), its ids are on the plan's device and its ``out`` of the plan's output dtype;
anything else takes the operator's full path.
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


def find(handle: int, table, ids, out):
    """The live plan of ``handle`` if it serves this call: it reads ``table``, on the ids' device, into ``out``'s
    dtype (what its kernels were made for: an ``out`` of narrower items would be written past its end); else
    None, and the operator's full path checks the call."""
    if handle < 0:
        return None
    plan = _plans.get(handle)
    if plan is None or plan.table_ptr != table.data_ptr() or plan.table_shape != table.shape \
            or ids.device != plan.device or out.dtype != plan.out_dtype:
        return None
    return plan

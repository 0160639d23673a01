"""Fork: locks a child finds free, forks that wait for a gated section to end (``integration.fork``), and
lookups a child refuses to use (their table, streams and threads are the parent's).

Each fork's child reports through its exit status and ends with ``os._exit``; a child that would hang is
bounded by ``faulthandler`` (exit status 1 after a stack dump) and the parent's bounded wait.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from helpers import CHILD_LIMIT_S, fork_and_wait, rand

from uvaple.integration import CopyBackend, GatherLookup, TableSpec, fork
from uvaple.integration.errors import BackendClosed, LookupForkedError
from uvaple.integration.fork import ForkSafeLock, gate_fork
from uvaple.uva import HostTable

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def held_by_a_thread(*locks):
    """Start a thread holding ``locks`` until the returned event is set; returns (event, thread)."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        for lk in locks:
            lk.acquire()
        taken.set()
        release.wait(60)
        for lk in reversed(locks):
            lk.release()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(10)
    return release, t


def test_a_child_finds_a_lock_another_thread_held_at_the_fork_free():
    plain, safe = threading.Lock(), ForkSafeLock()
    release, t = held_by_a_thread(plain, safe)
    try:
        # the child: the plain lock stays held for ever (the hazard), the fork-safe one is free
        code = fork_and_wait(lambda: 0 if not plain.acquire(timeout=0.2) and safe.acquire(timeout=5) else 1)
        assert code == 0
        assert safe.locked() and plain.locked()  # the parent's thread still holds both
    finally:
        release.set()
        t.join(10)
    assert not safe.locked()


def test_the_lock_is_a_plain_non_reentrant_lock():
    lk = ForkSafeLock()
    with lk:
        assert lk.locked()
        assert not lk.acquire(blocking=False)
        assert not lk.acquire(timeout=0.01)
    assert not lk.locked()
    assert lk.acquire()
    lk.release()
    with pytest.raises(RuntimeError):
        lk.release()
    with pytest.raises(TypeError, match="ForkSafeLock"):
        gate_fork(threading.Lock())


def test_a_fork_never_splits_a_gated_section():
    """A thread spends most of its time inside a gated section that leaves state half-written while it runs;
    every child sees the state whole. Without the gate about three forks in four land inside."""
    lock = gate_fork(ForkSafeLock())
    state = {"inside": False, "sections": 0}
    stop = threading.Event()

    def work():
        while not stop.is_set():
            with lock:
                state["inside"] = True
                time.sleep(0.015)
                state["inside"] = False
                state["sections"] += 1
            time.sleep(0.003)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        for _ in range(12):
            time.sleep(0.004)
            assert fork_and_wait(lambda: 0 if not state["inside"] and lock.acquire(timeout=5) else 1) == 0
    finally:
        stop.set()
        t.join(10)
    assert state["sections"] > 0 and not lock.locked()


def test_a_section_longer_than_the_wait_does_not_hold_the_fork(monkeypatch):
    monkeypatch.setattr(fork, "FORK_WAIT_S", 0.2)
    lock = gate_fork(ForkSafeLock())
    release, t = held_by_a_thread(lock)
    try:
        t0 = time.monotonic()
        assert fork_and_wait(lambda: 0 if lock.acquire(timeout=5) else 1) == 0  # fresh in the child
        assert 0.2 <= time.monotonic() - t0 < CHILD_LIMIT_S / 2
        assert lock.locked()  # still the parent thread's: the parent gave back nothing it did not take
    finally:
        release.set()
        t.join(10)
    assert not lock.locked()
    # the gate taken and given back: free in the parent after a fork that did not wait
    assert fork_and_wait(lambda: 0) == 0
    assert not lock.locked() and lock.acquire(blocking=False)
    lock.release()


def test_a_fork_interrupted_in_its_wait_gives_back_every_gate_it_took(monkeypatch):
    """A signal's handler raises while the fork waits for a busy gate (the fork goes on without the hook):
    the gates taken before it are given back in the parent all the same."""
    free, busy = ForkSafeLock(), ForkSafeLock()
    monkeypatch.setattr(fork, "_GATES", [free, busy])  # this order: the free one is taken first
    release, t = held_by_a_thread(busy)

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        assert fork_and_wait(lambda: 0 if free.acquire(timeout=5) and busy.acquire(timeout=5) else 1) == 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()
        t.join(10)
    assert not free.locked() and not busy.locked()


# ------------------------------------------------------------------ lookups in a forked child
def _refused(fn) -> bool:
    try:
        fn()
    except LookupForkedError as e:
        return "forked child" in str(e) and "in the child" in str(e)
    return False


@pytest.mark.parametrize("kind", ["uva", "copy"])
def test_a_lookup_refuses_calls_in_a_forked_child_and_stays_exact_in_the_parent(kind):
    t = rand(97, 24, torch.bfloat16, seed=5)
    ids = torch.tensor([3, 96, 0, 41, 3])
    with HostTable.from_tensor(t) as h:
        lk = GatherLookup(h, TableSpec.of(h), "cpu") if kind == "uva" else CopyBackend(h, "cpu")
        want = t[ids]
        assert torch.equal(lk.lookup(ids), want)

        def child():
            out = torch.empty(5, 24, dtype=t.dtype)
            ok = _refused(lambda: lk.lookup(ids)) and _refused(lambda: lk.lookup(ids, out))
            if kind == "copy":
                ok = ok and _refused(lambda: lk.submit(ids))
            lk.stats(), lk.progress()  # answer, never wait
            lk.close()
            ok = ok and lk.closed
            with pytest.raises(BackendClosed):
                lk.lookup(ids)
            return 0 if ok else 1

        assert fork_and_wait(child) == 0
        out = torch.full((5, 24), float("nan"), dtype=t.dtype)
        assert lk.lookup(ids, out) is out and torch.equal(out, want)  # the parent's lookup is untouched
        lk.close()


def test_a_copy_backend_whose_lock_was_held_at_the_fork_closes_in_the_child():
    """The backend's lock and its events' locks held by another thread at the fork (its worker, a scrape):
    in the child, stats() and close() answer at once, and the parent's job refuses wait() and cancel()."""
    t = rand(50, 8, torch.float32, seed=2)
    with HostTable.from_tensor(t) as h:
        b = CopyBackend(h, "cpu")
        ids = torch.tensor([1, 49])
        assert torch.equal(b.lookup(ids), t[ids])
        job = b.submit(torch.tensor([7]))  # a job of the parent's
        job.wait()
        # the backend's lock and its events' own locks (the worker takes them every turn), held at the fork
        release, th = held_by_a_thread(b._cond, b._wake._cond, job._host_done._cond)
        try:
            def child():
                t0 = time.monotonic()
                b.stats()
                ok = _refused(lambda: job.wait()) and _refused(lambda: job.cancel())
                b.close()
                return 0 if ok and b.closed and time.monotonic() - t0 < 5 else 1

            assert fork_and_wait(child) == 0
        finally:
            release.set()
            th.join(10)
        assert torch.equal(b.lookup(ids), t[ids])
        b.close()


def _cuda_fork_child(monkeypatch) -> None:
    """This process as a child forked after its parent initialised CUDA (torch's own flag, as a fork sets it)."""
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)


def test_tables_in_a_child_forked_after_cuda_are_unregistered_or_refused_by_name(monkeypatch):
    """CUDA cannot be used in a child forked after its parent initialised it: ``register="auto"`` builds an
    unregistered table there (a CPU lookup of it is exact), ``register=True`` is a named error, not torch's
    "Cannot re-initialize CUDA" from deep inside the registration."""
    from uvaple.uva import errors

    _cuda_fork_child(monkeypatch)
    data = rand(9, 8)
    with HostTable.from_tensor(data) as t:
        assert not t.registered
        with GatherLookup(t, TableSpec.of(t), "cpu") as lk:
            ids = torch.tensor([3, 0, 8])
            assert torch.equal(lk.lookup(ids), data[ids])
    with pytest.raises(errors.DeviceCapabilityError, match="forked after its parent initialised CUDA.*spawn"):
        HostTable.from_tensor(data, register=True)


def test_a_child_never_frees_what_keep_in_child_holds():
    """An object registered with keep_in_child is not freed in a forked child (not by a drop, not by the
    garbage collector; its finaliser never runs there), while an unregistered one is; the parent frees it
    as usual."""
    import gc
    import weakref

    class Holder:
        pass

    kept, plain = Holder(), Holder()
    kept.cycle = kept  # only the collector would free it
    fork.keep_in_child(kept)
    ran = []
    weakref.finalize(kept, ran.append, "kept")
    weakref.finalize(plain, ran.append, "plain")

    def child():
        nonlocal kept, plain
        kept = plain = None
        gc.collect()
        return 0 if ran == ["plain"] else 1

    assert fork_and_wait(child) == 0
    assert ran == []  # the child's drops are its own
    kept = plain = None
    gc.collect()
    assert sorted(ran) == ["kept", "plain"]


"""Named shared tables: create-or-attach by many processes, dead creators, bad input, ``uvaple shm``.

Processes here are real (``subprocess``), killed with real signals; every test ends with nothing of its
name left in ``/dev/shm``.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
from shm_workers import COLS, REAPER_WAIT_S, ROWS, Worker, expected, fresh_name, path_of, shm_name, wait_until, want_sum

from uvaple.uva import (
    HostMemoryError,
    HostTable,
    SharedSegmentError,
    SharedSegmentTimeout,
    _region,
    segments,
    system,
)


@pytest.fixture
def name():
    yield from fresh_name()


# ------------------------------------------------------------------ many processes, one table
def let_go_at_once(mode: str, rounds: int) -> None:
    """``rounds`` times: four processes open one table (one creates it) and let go of it at once."""
    for _ in range(rounds):
        n = shm_name()
        workers = [Worker(n, mode) for _ in range(4)]
        for w in workers:
            w.start()
        lines = [w.line() for w in workers]
        lines = [w.line() if "filling" in first else first for w, first in zip(workers, lines, strict=True)]
        assert sum(r["created"] for r in lines) == 1, lines
        for w in workers:  # all told at once
            w.p.stdin.write("go\n")
        for w in workers:
            w.p.stdin.flush()
        for w in workers:
            assert w.p.wait(60) == 0, w.p.stderr.read()
        left = os.path.exists(path_of(n))
        if left:
            os.unlink(path_of(n))
        assert not left, f"{path_of(n)} was left behind after every process let go ({mode})"


# four processes a round, each importing torch: 8-10 s a round on 2 cores
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["hold", "exit"])
def test_processes_letting_go_at_the_same_moment_leave_nothing(mode):
    """The last process out unlinks the name, also when all go at once (close() or exit without it)."""
    let_go_at_once(mode, 1)


@pytest.mark.extended
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["hold", "exit"])
def test_processes_letting_go_at_the_same_moment_again(mode):
    """Three more rounds of the race above (four in all)."""
    let_go_at_once(mode, 3)


@pytest.mark.extended  # one creator among processes starting at once: the four above, by default
@pytest.mark.timeout(300)
def test_eight_processes_at_once_create_exactly_one(name):
    workers = [Worker(name, "hold", fill_s=0.5) for _ in range(8)]
    for w in workers:
        w.start()
    results = []
    for w in workers:
        first = w.line()
        results.append(w.line() if "filling" in first else first)
    try:
        assert sum(r["created"] for r in results) == 1, results
        assert {r["sum"] for r in results} == {want_sum()}
        info = {i.name: i for i in segments.list_segments()}[name]
        assert info.state == "ready" and info.attached and len(info.pids) == 8
        assert info.size_bytes == segments.DATA_OFFSET + -(-ROWS * 640 // 4096) * 4096  # once, for 8 processes
    finally:
        for w in workers:
            w.finish()
    assert not os.path.exists(path_of(name))  # the last one out unlinked it


def test_create_then_attach_in_one_process(name):
    src = expected(3)
    a = HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: t.write_rows(src), tag="ckpt-1")
    b = HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: pytest.fail("filled twice"),
                         tag="ckpt-1")
    assert a.created and not b.created
    assert torch.equal(b.tensor, src) and a.tensor.data_ptr() != b.tensor.data_ptr()
    b.tensor[0, 0] = 42.0  # one copy of the memory
    assert a.tensor[0, 0].item() == 42.0
    a.close()
    assert os.path.exists(path_of(name))  # b still has it open
    b.close()
    assert not os.path.exists(path_of(name))


# ------------------------------------------------------------------ dead creators
@pytest.mark.timeout(120)
def test_creator_killed_before_ready_is_detected_and_replaced(name):
    a = Worker(name, fill_s=3600)
    a.start()
    assert "filling" in a.line()
    a.kill_with_its_reaper()
    info = {i.name: i for i in segments.list_segments()}[name]
    assert info.state == "stale" and not info.in_use
    t0 = time.monotonic()
    t = HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: t.write_rows(expected()), timeout=10)
    assert time.monotonic() - t0 < 5 and t.created
    assert torch.equal(t.tensor, expected())
    t.close()


@pytest.mark.timeout(120)
def test_creator_killed_after_ready_is_attached(name):
    a = Worker(name, "hold")
    a.start()
    a.line()  # filling
    r = a.line()
    assert r["created"]
    a.kill_with_its_reaper()
    info = {i.name: i for i in segments.list_segments()}[name]
    assert info.state == "ready" and not info.attached and info.pids == ()
    t0 = time.monotonic()
    t = HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: pytest.fail("refilled"), timeout=10)
    assert time.monotonic() - t0 < 5 and not t.created
    assert torch.equal(t.tensor, expected())
    t.close()  # the last one out: unlinked


@pytest.mark.timeout(120)
def test_empty_with_a_name_replaces_a_stale_segment(name):
    a = Worker(name, fill_s=3600)
    a.start()
    a.line()
    a.kill_with_its_reaper()
    with HostTable.empty(10, 16, torch.float16, name=name) as t:
        assert t.created and t.tensor.shape == (10, 16)
    with pytest.raises(SharedSegmentError, match="no shared table"):
        HostTable.attach(name)


@pytest.mark.timeout(120)
def test_waiters_get_the_creators_fill_error_not_a_timeout(name):
    a = Worker(name, "raise")
    b = Worker(name, env={"T": "60"})
    a.start()
    assert "filling" in a.line()
    b.start()
    deadline = time.monotonic() + 60
    while not b.has_open(path_of(name)):  # b found the segment and waits on its creator
        assert time.monotonic() < deadline and b.p.poll() is None
        time.sleep(0.01)
    a.say("raise")
    rb = b.line()
    ra = a.line()
    assert ra["error"] == "ValueError" and "unreadable" in ra["msg"]
    assert rb["error"] == "SharedSegmentError" and "unreadable" in rb["msg"] and rb["s"] < 30, rb
    a.finish()
    b.finish()


@pytest.mark.timeout(120)
def test_wait_for_a_live_slow_creator_is_bounded_and_named(name):
    a = Worker(name, fill_s=3600)
    a.start()
    a.line()
    try:
        t0 = time.monotonic()
        with pytest.raises(SharedSegmentTimeout, match=rf"pid {a.p.pid} \(alive\)"):
            HostTable.shared(name, ROWS, COLS, torch.float32, timeout=1.0)
        assert time.monotonic() - t0 < 3
    finally:
        a.kill()
    segments.clean([name])


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("bad", ["a/b", "../etc/passwd", "x" * 300, "", ".", "..", "sp ace", 7, None])
def test_bad_names_are_named(bad, tmpfs_dir):
    """Refused by name, in the default directory and in one of this test's own, where nothing may appear (the
    default one is shared with whatever else runs on the machine)."""
    for where in ({}, {"directory": tmpfs_dir}):
        with pytest.raises(SharedSegmentError, match="not valid"):
            HostTable.shared(bad, 4, 4, torch.float32, **where)
        with pytest.raises(SharedSegmentError, match="not valid"):
            HostTable.attach(bad, **where)
    assert os.listdir(tmpfs_dir) == []


@pytest.mark.parametrize("timeout", [0, 0.0, -1, -0.5, True, "5", None, float("nan")])
def test_bad_timeouts_are_named(name, timeout):
    live = len(_region.live_regions())
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        HostTable.shared(name, 4, 4, torch.float32, timeout=timeout)
    assert len(_region.live_regions()) == live


def test_mismatches_are_named_while_in_use(name):
    with HostTable.shared(name, 10, 8, torch.float32, tag="a") as t:
        for kw, what in [(dict(rows=11, cols=8, dtype=torch.float32, tag="a"), "rows: expected 11"),
                         (dict(rows=10, cols=9, dtype=torch.float32, tag="a"), "cols: expected 9"),
                         (dict(rows=10, cols=8, dtype=torch.float16, tag="a"), "dtype"),
                         (dict(rows=10, cols=8, dtype=torch.float32, tag="b"), "tag: expected 'b'")]:
            with pytest.raises(SharedSegmentError, match=what):
                HostTable.shared(name, kw["rows"], kw["cols"], kw["dtype"], tag=kw["tag"])
        with pytest.raises(SharedSegmentError, match="cols: expected 9"):
            HostTable.attach(name, cols=9)
        assert t.tensor.shape == (10, 8)


@pytest.mark.timeout(120)
def test_orphan_of_another_shape_is_replaced_by_shared(name):
    a = Worker.holding(name)
    a.kill_with_its_reaper()  # a ready orphan of shape ROWS x COLS
    with HostTable.shared(name, 7, 3, torch.float32, fill=lambda t: t.write_rows(torch.ones(7, 3))) as t:
        assert t.created and torch.equal(t.tensor, torch.ones(7, 3))


def test_a_file_that_is_not_ours_is_refused_and_left_alone(name):
    with open(path_of(name), "wb") as f:
        f.write(b"NOTOURS!" + b"x" * 5000)
    try:
        with pytest.raises(SharedSegmentError, match="not a uvaple shared table"):
            HostTable.shared(name, 4, 4, torch.float32)
        with pytest.raises(SharedSegmentError, match="already exists|not a uvaple"):
            HostTable.empty(4, 4, torch.float32, name=name)
        assert os.path.exists(path_of(name))
        assert segments.clean([name]) == []  # clean never removes a foreign file
    finally:
        os.unlink(path_of(name))


@pytest.mark.timeout(120)
def test_a_truncated_segment_is_named_on_attach_and_replaced_when_orphaned(name):
    a = Worker.holding(name)
    a.kill_with_its_reaper()
    os.truncate(path_of(name), segments.DATA_OFFSET + 4096)
    with pytest.raises(SharedSegmentError, match="truncated"):
        HostTable.attach(name)
    with HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: t.write_rows(expected())) as t:
        assert t.created and torch.equal(t.tensor, expected())


def test_fill_raising_leaves_nothing(name):
    live = len(_region.live_regions())

    def bad_fill(t):
        keep = t.tensor  # a view in the failing frame: must not keep the memory mapped
        keep[0, 0] = 1.0
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        HostTable.shared(name, 100, 40, torch.float32, fill=bad_fill)
    assert len(_region.live_regions()) == live
    assert not os.path.exists(path_of(name))


def test_use_after_close_and_double_close(name):
    t = HostTable.shared(name, 4, 4, torch.float32)
    t.close()
    t.close()
    from uvaple.uva import TableClosedError

    with pytest.raises(TableClosedError):
        _ = t.tensor
    with pytest.raises(TableClosedError):
        t.write_rows(torch.zeros(1, 4))
    assert t.released


# ------------------------------------------------------------------ uvaple shm
@pytest.mark.timeout(120)
def test_shm_list_and_clean_commands(name, capsys):
    from uvaple.commands.cli import main

    a = Worker.holding(name)
    assert main(["shm", "list"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(name))
    assert "ready" in row and str(a.p.pid) in row and f"{ROWS}x{COLS}" in row
    assert main(["shm", "clean", name]) == 0  # in use: not removed
    assert "nothing to remove" in capsys.readouterr().out and os.path.exists(path_of(name))
    a.kill_with_its_reaper()  # an orphan for `shm clean` to find
    assert main(["shm", "list", "--json"]) == 0
    info = {i["name"]: i for i in json.loads(capsys.readouterr().out)}[name]
    assert info["state"] == "ready" and info["pids"] == [] and not info["attached"]
    assert main(["shm", "clean", "--dry-run", name]) == 0
    assert "would remove" in capsys.readouterr().out and os.path.exists(path_of(name))
    assert main(["shm", "clean", name]) == 0
    assert "removed" in capsys.readouterr().out and not os.path.exists(path_of(name))


# ------------------------------------------------------------------ edges found in review
def test_unlink_never_removes_another_segment_of_the_same_name(name):
    a = HostTable.shared(name, 4, 4, torch.float32)
    a.close()
    b = HostTable.shared(name, 4, 4, torch.float32)
    a.unlink()  # closed: the name now belongs to b
    assert os.path.exists(path_of(name))
    b.unlink()
    assert not os.path.exists(path_of(name)) and torch.equal(b.tensor, torch.zeros(4, 4))
    b.close()


def test_a_torn_header_read_is_retried_not_called_foreign(name, monkeypatch):
    """A header caught mid-rewrite (our magic, JSON not parseable yet) is read again."""
    monkeypatch.setattr(segments, "_TORN_RETRIES", 10_000)  # 10 s of retries: the writer's 10 ms on any load
    seg = segments.create(name, {"rows": 4, "cols": 4, "dtype": "F32", "stride_bytes": 16,
                                 "data_offset": segments.DATA_OFFSET}, segments.DATA_OFFSET + 4096)
    try:
        good = os.pread(seg.fd, 4096, 0)
        os.pwrite(seg.fd, b'\x00{{[[', 16)  # the JSON half rewritten

        def finish():
            time.sleep(0.01)
            os.pwrite(seg.fd, good, 0)

        import threading

        th = threading.Thread(target=finish)
        th.start()
        meta = seg.header()
        th.join()
        assert meta is not None and meta["state"] == "building"
    finally:
        seg.fail(RuntimeError("test"))



def test_a_creator_finishing_between_a_waiters_two_reads_is_attached_not_replaced(name, monkeypatch):
    """The creator marks the table ready and lets go of its build lock outside the namespace lock. A waiter
    that reads the header just before that and the lock just after must attach, not call the table stale,
    remove it and build a second copy (seen as two creators among four processes on a loaded machine)."""
    meta = {"rows": 4, "cols": 4, "dtype": "F32", "stride_bytes": 16, "data_offset": segments.DATA_OFFSET}
    creator = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    assert creator.created
    read_header, finished = segments._read_header_or_torn, []

    def header_then_the_creator_finishes(fd):
        got = read_header(fd)
        if fd != creator.fd and not finished:  # the waiter's first read: the creator finishes right after it
            finished.append(got and got.get("state"))
            creator.ready()
        return got

    monkeypatch.setattr(segments, "_read_header_or_torn", header_then_the_creator_finishes)
    waiter = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    try:
        assert finished == ["building"]  # the interleaving happened
        assert not waiter.created
        assert os.fstat(waiter.fd).st_ino == os.fstat(creator.fd).st_ino == os.stat(path_of(name)).st_ino
    finally:
        waiter.detach()
        creator.detach()
    assert not os.path.exists(path_of(name))

@pytest.mark.parametrize("attach_building", [False, True], ids=["shared", "deferred"])
def test_a_header_torn_for_longer_than_the_retries_by_a_live_creator_is_waited_for(name, monkeypatch,
                                                                                   attach_building):
    """A creator preempted between the header's two writes (a loaded machine) leaves it torn for longer than
    a reader retries: with the build lock held that is a creator at work, not somebody else's file (and a
    deferred attacher, which checks the header before it maps, waits for it to read whole)."""
    monkeypatch.setattr(segments, "_TORN_RETRIES", 2)
    meta = {"rows": 4, "cols": 4, "dtype": "F32", "stride_bytes": 16, "data_offset": segments.DATA_OFFSET}
    creator = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    good = os.pread(creator.fd, 4096, 0)
    os.pwrite(creator.fd, b'\x00{{[[', 16)  # the JSON half rewritten; the creator stopped there
    read, seen = segments._read_header_or_torn, []

    def read_then_the_creator_resumes(fd):
        got = read(fd)
        if fd != creator.fd and got is segments._TORN and not seen:  # the waiter saw it torn: resume
            seen.append(fd)
            os.pwrite(creator.fd, good, 0)
            creator.ready()
        return got

    monkeypatch.setattr(segments, "_read_header_or_torn", read_then_the_creator_resumes)
    waiter = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10,
                                       attach_building=attach_building)
    try:
        assert seen and not waiter.created
        assert os.fstat(waiter.fd).st_ino == os.fstat(creator.fd).st_ino
    finally:
        waiter.detach()
        creator.detach()


def test_a_failed_table_whose_creator_died_before_removing_it_is_replaced(name):
    meta = {"rows": 4, "cols": 4, "dtype": "F32", "stride_bytes": 16, "data_offset": segments.DATA_OFFSET}
    dead = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    dead.set_state("failed", "ValueError: the checkpoint is unreadable")
    with pytest.raises(SharedSegmentError, match="checkpoint is unreadable"):  # its creator alive: its error
        segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    dead.close_descriptor()  # killed between marking it failed and removing it: its locks go, the file stays
    assert os.path.exists(path_of(name))
    new = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    try:
        assert new.created and new.header()["state"] == "building"
    finally:
        new.fail(RuntimeError("test"))


def test_a_build_lock_taken_between_the_two_reads_is_a_creator_at_work(name, monkeypatch):
    """Outside the namespace lock (``shm list``) a reader can find the lock free and then the header of a
    creator that took it meanwhile: the lock is looked at again before the table is called stale."""
    meta = {"rows": 4, "cols": 4, "dtype": "F32", "stride_bytes": 16, "data_offset": segments.DATA_OFFSET}
    creator = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    fd = os.open(path_of(name), os.O_RDONLY)
    try:
        assert segments._ofd(creator.build_fd, fcntl.F_UNLCK, segments._BUILD_BYTE)  # not taken yet
        read = segments._read_header_or_torn

        def read_then_the_creator_locks(f):
            got = read(f)
            assert segments._ofd(creator.build_fd, fcntl.F_WRLCK, segments._BUILD_BYTE)
            return got

        monkeypatch.setattr(segments, "_read_header_or_torn", read_then_the_creator_locks)
        assert segments._classify(fd)[0] == "building"
    finally:
        os.close(fd)
        creator.fail(RuntimeError("test"))


def test_a_header_left_torn_by_a_creator_that_died_is_replaced(name, monkeypatch):
    monkeypatch.setattr(segments, "_TORN_RETRIES", 2)
    meta = {"rows": 4, "cols": 4, "dtype": "F32", "stride_bytes": 16, "data_offset": segments.DATA_OFFSET}
    dead = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    os.pwrite(dead.fd, b'\x00{{[[', 16)
    dead._let_go_of_build()  # its build lock gone with it, between the header's two writes
    new = segments.create_or_attach(name, meta, {}, segments.DATA_OFFSET + 4096, timeout=10)
    try:
        assert new.created and os.fstat(new.fd).st_ino != os.fstat(dead.fd).st_ino
        assert os.stat(path_of(name)).st_ino == os.fstat(new.fd).st_ino
    finally:
        dead.close_descriptor()
        new.detach()


def test_a_fill_error_too_long_for_the_header_still_cleans_up(name):
    live = len(_region.live_regions())
    with pytest.raises(ValueError, match="é" * 50):
        HostTable.shared(name, 10, 4, torch.float32, fill=lambda t: (_ for _ in ()).throw(ValueError("é" * 1200)))
    assert len(_region.live_regions()) == live and not os.path.exists(path_of(name))


@pytest.mark.timeout(120)
def test_a_forked_child_that_lets_go_keeps_no_lock_of_a_dead_parent(name):
    """A forked child's inherited table, once closed in the child, holds nothing of the segment: when the
    parent is killed the segment is no longer attached (its reaper removes it) though the child lives on. (A
    child that keeps the inherited mapping keeps the segment attached: it can still read it.)

    Where the parent registered the table with a GPU, the child also inherited the GPU driver's device
    descriptors, and through them the parent's registration, which references the segment: then the
    segment stays attached until the child exits too, and the parent's reaper removes it after that."""
    code = textwrap.dedent(f"""
        import os, sys, time, torch
        from uvaple.uva import HostTable
        t = HostTable.shared({name!r}, 4, 4, torch.float32)
        print("registered" if t.registered else "unregistered", flush=True)
        pid = os.fork()
        if pid == 0:
            assert t._region.segment.fd is None  # the fork hook closed the child's descriptor copy
            t.close()  # the child's copy of the mapping goes
            os.write(1, b"child let go\\n")  # one write each: the two processes' lines never interleave
            time.sleep(600)
            os._exit(0)
        os.write(1, f"child {{pid}}\\n".encode())
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        registered = p.stdout.readline().strip() == "registered"
        lines: list[str] = []
        while (child is None or "child let go" not in lines) and len(lines) < 20:  # whatever else is printed
            lines.append(p.stdout.readline().strip())
            if lines[-1].startswith("child ") and lines[-1] != "child let go":
                child = int(lines[-1].split()[1])
        assert child is not None and "child let go" in lines, lines
        _a_child_that_let_go_holds_nothing(p, child, registered, name)
    finally:
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.wait(30)
        p.stdout.close()


def _a_child_that_let_go_holds_nothing(p, child: int, registered: bool, name: str) -> None:
    assert {i.name: i for i in segments.list_segments()}[name].attached
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    if registered:
        driver = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
        assert any(d.startswith("/dev/nvidia") for d in driver), driver  # what keeps it referenced
        os.kill(child, signal.SIGKILL)
    # the parent's reaper removes a segment only when no process holds its attach lock: the living
    # (unregistered) or dead (registered) child holds none
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"


# ------------------------------------------------------------------ the end of a multiprocessing child
_KEPT: list = []  # a multiprocessing child's tables, alive to its end


def _child_opens(name: str, rows: torch.Tensor, keep: bool) -> None:
    """A ``multiprocessing`` child's target: open ``name`` and end with the table alive (as the tables a
    captured CUDA graph reads live to the end of vLLM's engine core) or closed.

    Its rows are few: a copy that small runs on the calling thread, and a child forked after the parent
    used torch's OpenMP threads must not start them (libgomp is not fork-safe; vLLM releases its threads
    before it forks)."""
    t = HostTable.shared(name, *rows.shape, torch.float32, fill=lambda t: t.write_rows(rows))
    if keep:
        _KEPT.append(t)
    else:
        t.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("keep", [True, False], ids=["alive_to_the_end", "closed"])
def test_a_multiprocessing_child_that_ends_leaves_no_segment(name, method, keep):
    """vLLM's engine core and workers are ``multiprocessing`` children, forked by default, and a forked one
    ends with ``os._exit``: no ``atexit`` handler runs there. Its tables are detached all the same, and the
    parent's table, which a forked child inherits, is not the child's to let go of."""
    src = expected(4)
    mine = HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: t.write_rows(src))
    theirs = shm_name()
    p = multiprocessing.get_context(method).Process(target=_child_opens, args=(theirs, src[:40].clone(), keep))
    try:
        p.start()
        p.join(90)
        assert p.exitcode == 0
        assert not os.path.exists(path_of(theirs)), f"the child's table was left in /dev/shm ({method})"
        info = {i.name: i for i in segments.list_segments()}[name]
        assert info.state == "ready" and info.attached and os.getpid() in info.pids
        assert torch.equal(mine.tensor, src)
    finally:
        if p.is_alive():
            p.kill()
            p.join(30)
        if os.path.exists(path_of(theirs)):
            os.unlink(path_of(theirs))
        mine.close()


# ------------------------------------------------------------------ deferred readiness (an engine's loader fills)
def test_deferred_ready_maps_at_once_and_waits_later(name):
    a = HostTable.shared(name, 50, 8, torch.float32, defer_ready=True)
    b = HostTable.shared(name, 50, 8, torch.float32, defer_ready=True, timeout=5)  # no wait: still building
    assert a.created and not b.created and not a.ready and not b.ready
    with pytest.raises(SharedSegmentTimeout, match="to fill the table"):
        b.wait_ready(0.2)
    with pytest.raises(SharedSegmentError, match="mark_ready"):
        b.mark_ready()  # only the creator marks it
    src = expected(5)[:50, :8].contiguous()
    a.write_rows(src)  # the engine's loader writes the rows after construction
    a.mark_ready()
    b.wait_ready(1.0)
    assert b.ready and torch.equal(b.tensor, src)
    c = HostTable.shared(name, 50, 8, torch.float32, timeout=1)  # a plain shared() attaches the ready one
    assert not c.created and torch.equal(c.tensor, src)
    for t in (a, b, c):
        t.close()
    with pytest.raises(TypeError, match="exclude each other"):
        HostTable.shared(name, 4, 4, torch.float32, defer_ready=True, fill=lambda t: None)


def test_the_creator_waiting_for_its_own_table_is_told_to_mark_it_ready(name):
    a = HostTable.shared(name, 10, 4, torch.float32, defer_ready=True)
    try:
        with pytest.raises(SharedSegmentError, match=r"this process created it .*mark_ready\(\)"):
            a.wait_ready(5)
        a.write_rows(expected(6)[:10, :4].contiguous())
        a.mark_ready()
        a.wait_ready(0.1)  # ready: at once
        assert a.ready
    finally:
        a.close()


_CREATORS = {  # a creator that has mapped its table, and one forking before it maps it
    "mapped": "from uvaple.uva import HostTable\n"
              "t = HostTable.shared({name!r}, 10, 4, torch.float32, defer_ready=True)",
    "not_yet_mapped": "from uvaple.uva import segments\n"
                      "meta = dict(rows=10, cols=4, dtype='F32', stride_bytes=16, data_offset=segments.DATA_OFFSET)\n"
                      "t = segments.create_or_attach({name!r}, meta, {{}}, segments.DATA_OFFSET + 4096, timeout=10)",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("creator", list(_CREATORS))
def test_a_creator_killed_after_forking_a_worker_is_replaced_at_once(name, creator):
    """A child forked while the creator fills keeps the table mapped, and a mapping keeps its open file, with
    that file's locks, alive: the build lock is on a descriptor of its own, never mapped and closed in a forked
    child, so it dies with the creator and the next process replaces the stale table instead of waiting for
    the child to exit."""
    code = textwrap.dedent("""
        import os, sys, time, torch
        {creator}
        if os.fork() == 0:  # a worker forked before the fill ends: it keeps the mapping
            os.write(1, b"forked\\n")
            time.sleep(600)
            os._exit(0)
        time.sleep(600)
    """).format(creator=_CREATORS[creator].format(name=name))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "forked"
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        t0 = time.monotonic()
        t = HostTable.shared(name, 10, 4, torch.float32, fill=lambda t: t.write_rows(expected(7)[:10, :4]),
                             timeout=20)
        assert t.created and time.monotonic() - t0 < 10
        t.close()
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the forked worker too
        p.stdout.close()


def test_deferred_ready_delivers_the_creators_failure(name):
    a = HostTable.shared(name, 10, 4, torch.float32, defer_ready=True)
    b = HostTable.shared(name, 10, 4, torch.float32, defer_ready=True)
    a.mark_failed(RuntimeError("the checkpoint shard is missing"))
    with pytest.raises(SharedSegmentError, match="shard is missing"):
        b.wait_ready(5)
    assert not os.path.exists(path_of(name))  # removed: a fresh shared() creates it again
    a.close()
    b.close()


@pytest.mark.timeout(120)
def test_deferred_ready_after_the_creator_died_is_a_named_error(name):
    code = textwrap.dedent(f"""
        import time, torch
        from uvaple.uva import HostTable
        t = HostTable.shared({name!r}, 10, 4, torch.float32, defer_ready=True)
        print("created", flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "created"
        b = HostTable.shared(name, 10, 4, torch.float32, defer_ready=True)
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        t0 = time.monotonic()
        with pytest.raises(SharedSegmentError, match="died before it was ready"):
            b.wait_ready(30)
        assert time.monotonic() - t0 < 5
        b.close()
        segments.clean([name])
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()


# ------------------------------------------------------------------ pages committed by the writes
def _allocated(path: str) -> int:
    """Bytes a tmpfs file holds (its pages allocated so far)."""
    return os.stat(path).st_blocks * 512


def test_deferred_creator_commits_pages_as_it_writes_and_the_rest_when_ready(name):
    """Nothing is pre-faulted before the loader writes: each write commits its own pages, mark_ready the
    rest; the attacher maps and reads the same bytes after wait_ready."""
    rows, cols = 4096, 4096  # 16 MiB of uint8
    src = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    a = HostTable.shared(name, rows, cols, torch.uint8, defer_ready=True)
    b = HostTable.shared(name, rows, cols, torch.uint8, defer_ready=True)
    try:
        assert _allocated(path_of(name)) < (1 << 20)  # the header only
        a.write_rows(src[: rows // 4], 0)
        got = _allocated(path_of(name))
        assert rows // 4 * cols <= got < rows // 4 * cols + (1 << 20)
        a.mark_ready()
        assert _allocated(path_of(name)) >= segments.DATA_OFFSET + rows * cols - (1 << 20)
        b.wait_ready(5)
        want = src.clone()
        want[rows // 4:] = 0  # never written: zeros
        assert torch.equal(a.tensor, want) and torch.equal(b.tensor, want)
    finally:
        a.close()
        b.close()
    assert not os.path.exists(path_of(name))


def test_a_full_tmpfs_during_a_deferred_fill_is_named_and_fails_the_table(name, monkeypatch):
    """The writer's own commit meets the full tmpfs: a named error, not a SIGBUS in the copy; mark_ready
    then fails the table for every process, and nothing is left."""
    real = system.madvise

    def full(addr, length, advice):  # shmem refuses pages once the tmpfs is full: EFAULT
        return 14 if advice == system.MADV_POPULATE_WRITE and length > system.PAGE_SIZE else real(addr, length, advice)

    a = HostTable.shared(name, 2048, 1024, torch.uint8, defer_ready=True)
    b = HostTable.shared(name, 2048, 1024, torch.uint8, defer_ready=True)
    monkeypatch.setattr(system, "madvise", full)
    src = torch.randint(0, 256, (2048, 1024), dtype=torch.uint8)
    with pytest.raises(HostMemoryError, match=rf"shared table '{name}'.*filesystem is full"):
        a.write_rows(src)
    with pytest.raises(HostMemoryError, match="filesystem is full"):
        a.mark_ready()
    with pytest.raises(SharedSegmentError, match="filesystem is full"):
        b.wait_ready(5)
    a.close()
    b.close()
    assert not os.path.exists(path_of(name))


def test_named_tables_filled_by_their_writers_are_not_prefaulted_first(name, monkeypatch):
    """from_tensor(name=...) and from_safetensors(name=...): the segment holds nothing when the write
    starts, and all of it after."""
    rows, cols = 2048, 4096
    src = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    seen = []
    real = HostTable.write_rows

    def spy(self, rows_, row_start=0, **kw):
        seen.append(_allocated(path_of(name)))
        return real(self, rows_, row_start, **kw)

    monkeypatch.setattr(HostTable, "write_rows", spy)
    with HostTable.from_tensor(src, name=name) as t:
        assert seen and seen[0] < (1 << 20)
        assert _allocated(path_of(name)) >= rows * cols and torch.equal(t.tensor, src)
    assert not os.path.exists(path_of(name))


# ------------------------------------------------------------------ another tmpfs directory
@pytest.fixture
def tmpfs_dir():
    d = f"/dev/shm/uvaple-test-dir-{uuid.uuid4().hex[:8]}"  # a directory on a tmpfs, as a mount would be
    os.mkdir(d)
    yield d
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    os.rmdir(d)


def test_segments_live_in_the_directory_given(name, tmpfs_dir, capsys):
    src = expected(7)
    t = HostTable.shared(name, ROWS, COLS, torch.float32, fill=lambda t: t.write_rows(src), directory=tmpfs_dir)
    try:
        assert os.path.exists(os.path.join(tmpfs_dir, f"uvaple.{name}")) and not os.path.exists(path_of(name))
        with HostTable.attach(name, directory=tmpfs_dir) as b:
            assert not b.created and torch.equal(b.tensor, src)
        with pytest.raises(SharedSegmentError, match="no shared table named"):
            HostTable.attach(name)  # not in /dev/shm
        assert [i.name for i in segments.list_segments(tmpfs_dir)] == [name]
        assert name not in [i.name for i in segments.list_segments()]
        from uvaple.commands import shm

        assert shm.main(["list", "--dir", tmpfs_dir]) == 0 and name in capsys.readouterr().out
    finally:
        t.close()
    assert os.listdir(tmpfs_dir) == []


def test_deferred_tables_in_another_directory(name, tmpfs_dir):
    a = HostTable.shared(name, 64, 16, torch.float32, defer_ready=True, directory=tmpfs_dir)
    b = HostTable.shared(name, 64, 16, torch.float32, defer_ready=True, directory=tmpfs_dir)
    src = expected(8)[:64, :16].contiguous()
    a.write_rows(src)
    a.mark_ready()
    b.wait_ready(5)
    assert not b.created and torch.equal(b.tensor, src)
    a.close()
    b.close()
    assert os.listdir(tmpfs_dir) == []


def test_directories_that_cannot_hold_a_table_are_named(name, tmp_path):
    assert system.filesystem_type("/dev/shm") == segments.TMPFS_MAGIC
    with pytest.raises(SharedSegmentError, match="not on a tmpfs"):
        HostTable.shared(name, 4, 4, torch.float32, directory="/proc")  # procfs: not a tmpfs
    with pytest.raises(SharedSegmentError, match="not an existing directory"):
        HostTable.shared(name, 4, 4, torch.float32, directory=str(tmp_path / "missing"))
    with pytest.raises(SharedSegmentError, match="is a path"):
        HostTable.shared(name, 4, 4, torch.float32, directory=3)
    with pytest.raises(TypeError, match="give name= too"):
        HostTable.empty(4, 4, torch.float32, directory="/dev/shm")
    from uvaple.commands import shm

    with pytest.raises(SystemExit):
        shm.main(["list", "--dir", "/proc"])
    assert not os.path.exists(path_of(name))


def test_huge_page_option_of_a_tmpfs_mount_is_read():
    mounts = [line.split() for line in open("/proc/self/mounts")]
    shm = [m for m in mounts if m[1] == "/dev/shm" and m[2] == "tmpfs"]
    want = next((o[5:] for o in shm[-1][3].split(",") if o.startswith("huge=")), "never") if shm else None
    assert system.huge_pages_in("/dev/shm") == want
    assert system.huge_pages_in("/dev/shm/some/file") == want  # below the mount point: the same mount
    assert system.huge_pages_in("/proc") is None  # not a tmpfs


def test_the_commit_after_the_fill_covers_only_what_no_write_committed(name, monkeypatch):
    rows, cols = 4096, 4096
    a = HostTable.shared(name, rows, cols, torch.uint8, defer_ready=True)
    try:
        a.write_rows(torch.randint(0, 256, (rows // 2, cols), dtype=torch.uint8), rows // 4)  # the middle half
        calls = []
        real = system.madvise
        monkeypatch.setattr(system, "madvise", lambda ad, n, adv: (calls.append((ad - a._region.base, n, adv)),
                                                                 real(ad, n, adv))[1])
        a.mark_ready()
        done = sorted((o, o + n) for o, n, adv in calls if adv == system.MADV_POPULATE_WRITE)
        head, quarter = segments.DATA_OFFSET, rows // 4 * cols
        assert done[0][0] == 0 and done[-1][1] == a._region.length  # header and both unwritten quarters...
        assert sum(hi - lo for lo, hi in done) <= head + 2 * quarter + 2 * system.PAGE_SIZE  # ...not the written half
        page = system.PAGE_SIZE
        assert all(hi <= head + quarter + page or lo >= head + 3 * quarter - page for lo, hi in done)
    finally:
        a.close()

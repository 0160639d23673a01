"""A killed process's shared segments: its reaper removes them (``uva/reaper.py``).

Processes here are real, killed as a server's stop kills them (``SIGKILL`` to every descendant, then the
process); every test ends with nothing of its name left in ``/dev/shm``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from shm_workers import REAPER_WAIT_S, Worker, descendants_of, expected, fresh_name, path_of, running, wait_until

from uvaple.uva import HostTable, reaper, segments


@pytest.fixture
def name():
    yield from fresh_name()




@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["ready", "filling"])
def test_a_killed_process_leaves_no_segment(name, when):
    """Killed as `vllm serve` kills its engine core (every descendant, then the process, with SIGKILL: no
    exit code runs): the process's reaper, out of its tree, removes the name, ready or half filled, and ends."""
    a = Worker(name, "hold", fill_s=3600 if when == "filling" else 0)
    a.start()
    assert "filling" in a.line()
    if when == "ready":
        assert a.line()["created"]
    assert a.reaper and a.reaper not in descendants_of(a.p.pid) and running(a.reaper)
    assert os.path.exists(path_of(name))
    a.kill_tree()
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"
    assert wait_until(lambda: not running(a.reaper), 10)


@pytest.mark.timeout(120)
def test_a_killed_process_leaves_what_another_still_holds(name):
    a = Worker.holding(name)
    b = HostTable.attach(name)
    a.kill_tree()
    time.sleep(1.0)  # the reaper has seen a's end and found b holding the table
    assert os.path.exists(path_of(name)) and torch.equal(b.tensor, expected())
    assert running(a.reaper)  # waiting for b to let go
    b.close()  # the last one out (or, if a's locks outlive its exit for a moment, a's reaper after it)
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"
    assert wait_until(lambda: not running(a.reaper), REAPER_WAIT_S)  # nothing left to it


@pytest.mark.timeout(120)
def test_a_process_ending_normally_ends_its_reaper(name):
    a = Worker.holding(name)
    a.finish()  # closes its table and exits
    assert not os.path.exists(path_of(name))
    assert wait_until(lambda: not running(a.reaper), 10)


def run_and_kill(script: str, name: str) -> list[int]:
    """Start ``script`` (argv[1]: ``name``), read the pids it prints on its first line, SIGKILL it."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), name], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert pids, "the script printed nothing"
    finally:
        p.kill()
        p.wait(30)
        p.stdout.close()
    return pids


@pytest.mark.timeout(120)
def test_a_segment_opened_twice_is_held_until_let_go_of_twice(name):
    (reaper_pid,) = run_and_kill("""
        import os, sys, time, torch
        from uvaple.uva import HostTable, reaper
        a = HostTable.shared(sys.argv[1], 8, 8, torch.float32)
        b = HostTable.shared(sys.argv[1], 8, 8, torch.float32)
        assert a.created and not b.created
        a.close()
        print(reaper.reaper_pid(), flush=True)
        time.sleep(120)
    """, name)
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"
    assert wait_until(lambda: not running(reaper_pid), 10)


@pytest.mark.timeout(120)
def test_a_forked_child_does_not_hide_its_parents_death_from_the_reaper(name):
    """A forked child inherits the parent's descriptors; it must not hold the reaper's socket open."""
    (child,) = run_and_kill("""
        import os, sys, time, torch
        from uvaple.uva import HostTable
        # unregistered: a child forked after a GPU registration would hold the segment through the driver
        HostTable.shared(sys.argv[1] + "-first", 8, 8, torch.float32, register=False).close()  # the reaper starts
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        t = HostTable.shared(sys.argv[1], 8, 8, torch.float32, register=False)
        print(child, flush=True)
        time.sleep(120)
    """, name)
    try:
        assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), "the reaper missed the death"
        assert running(child)
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_forked_child_sharing_the_table_keeps_it_until_it_ends(name):
    """The child's inherited mapping holds the segment (it reads the table): the reaper waits for it."""
    child, reaper_pid = run_and_kill("""
        import os, sys, time, torch
        from uvaple.uva import HostTable, reaper
        t = HostTable.shared(sys.argv[1], 8, 8, torch.float32)
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        print(child, reaper.reaper_pid(), flush=True)
        time.sleep(120)
    """, name)
    try:
        time.sleep(1.0)
        assert os.path.exists(path_of(name)) and running(reaper_pid)
    finally:
        os.kill(child, signal.SIGKILL)
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"
    assert wait_until(lambda: not running(reaper_pid), 10)


@pytest.mark.timeout(120)
def test_a_process_with_many_descriptors_open_starts_its_reaper(name):
    """Descriptors past 1,023 (a busy engine's) break a select(); the start polls, and the reaper closes them."""
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, resource, sys, time, torch
        from uvaple.uva import HostTable, reaper
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < 1200:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(1200, hard), hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        t = HostTable.shared(sys.argv[1], 8, 8, torch.float32, register=False)
        print(reaper.reaper_pid(), max(held), flush=True)
        time.sleep(120)
    """), name], stdout=subprocess.PIPE, text=True)
    try:
        reaper_pid, fds = (int(x) for x in p.stdout.readline().split())
        assert fds >= 1024 and running(reaper_pid)
        kept = {int(f): os.readlink(f"/proc/{reaper_pid}/fd/{f}") for f in os.listdir(f"/proc/{reaper_pid}/fd")}
        assert all(fd <= 2 or "pidfd" in what for fd, what in kept.items()), kept  # nothing inherited kept
    finally:
        p.kill()
        p.wait(30)
        p.stdout.close()
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"


@pytest.mark.timeout(120)
def test_the_reaper_outlives_the_stop_signals_of_its_process_group(name):
    """A stop that signals the whole group (or cgroup) first, then kills the process: the reaper stays for it."""
    a = Worker.holding(name)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        os.kill(a.reaper, sig)
    time.sleep(0.2)
    assert running(a.reaper)
    a.kill_tree()
    assert wait_until(lambda: not os.path.exists(path_of(name)), REAPER_WAIT_S), f"{path_of(name)} was left"


@pytest.mark.parametrize("executable", ["/usr/bin/env", ""])
def test_a_process_that_cannot_start_a_reaper_says_so_and_works(name, executable):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import logging, sys, torch
        logging.basicConfig(level=logging.WARNING)
        sys.executable = sys.argv[2]
        from uvaple.uva import HostTable, reaper
        src = torch.randn(8, 8)
        with HostTable.shared(sys.argv[1], 8, 8, torch.float32, fill=lambda t: t.write_rows(src)) as t:
            assert torch.equal(t.tensor, src) and reaper.reaper_pid() is None
        with HostTable.shared(sys.argv[1], 8, 8, torch.float32) as t:  # warned once
            pass
        print("ok")
    """), name, executable], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert out.stderr.count("could not be started or reached") == 1, out.stderr
    assert "not a Python interpreter" in out.stderr and "uvaple shm clean" in out.stderr


def orphan(name: str) -> tuple[int, int]:
    """A ready segment that no process holds (created here, its descriptor closed without a detach): its id."""
    seg = segments.create(name, {"rows": 1, "cols": 4, "dtype": "float32", "stride_bytes": 16,
                                 "data_offset": segments.DATA_OFFSET}, segments.DATA_OFFSET + 4096)
    seg.ready()
    st = os.fstat(seg.fd)
    seg.close_descriptor()
    return (st.st_dev, st.st_ino)


def serve(data: bytes) -> None:
    """Run a reaper's loop over ``data`` as its socket's bytes, its process gone."""
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    reaper.serve(r, None, segments.remove_unused)  # (it closes r)


def test_the_reaper_removes_only_the_file_it_was_told_of(name):
    file_id = orphan(name)
    line = lambda op, ino: json.dumps({"op": op, "path": path_of(name), "dev": file_id[0],  # noqa: E731
                                       "ino": ino}).encode() + b"\n"
    serve(line("open", file_id[1] + 1) + b'{"op": "open", "pa')  # another file; a torn last line
    assert os.path.exists(path_of(name))
    serve(line("open", file_id[1]) + line("close", file_id[1]))
    assert os.path.exists(path_of(name))  # let go of before the end: not the reaper's
    serve(line("open", file_id[1]) + line("open", file_id[1]) + line("close", file_id[1]))
    assert not os.path.exists(path_of(name))  # opened twice, let go of once


def test_the_reaper_leaves_a_file_that_is_not_ours(name):
    with open(path_of(name), "wb") as f:
        f.write(b"NOTOURS!" + b"x" * 5000)
    try:
        st = os.stat(path_of(name))
        assert segments.remove_unused(path_of(name), (st.st_dev, st.st_ino), time.monotonic() + 5)
        assert os.path.exists(path_of(name))
    finally:
        os.unlink(path_of(name))



"""Shared-table tests' workers: processes that create or attach a named table on cue, and what finds them.

Processes here are real (``subprocess``); :func:`fresh_name` gives a test a fresh segment name, kills every
worker it started, and fails it if it left its segment in ``/dev/shm``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import torch

ROWS, COLS = 1000, 160  # 160 fp32 columns: 640-byte rows


def shm_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def path_of(name: str) -> str:
    return f"/dev/shm/uvaple.{name}"


def expected(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, COLS, generator=g)


_WORKERS: list = []  # every worker a test started: killed at its end, whatever happened


def fresh_name():
    """A fresh segment name for a test (a generator: a test module's ``name`` fixture yields from it); at the
    test's end every worker it started is killed, and a segment of that name left behind fails it."""
    n = shm_name()
    yield n
    while _WORKERS:
        w = _WORKERS.pop()
        if w.p.poll() is None:
            w.p.kill()
        w.p.wait(30)
        for stream in (w.p.stdin, w.p.stdout, w.p.stderr):
            stream.close()
    leftover = os.path.exists(path_of(n))
    if leftover:
        os.unlink(path_of(n))
    assert not leftover, f"{path_of(n)} was left behind"


# A worker process: loads, says "loaded", waits for "start" on stdin (so that several call shared() at
# the same moment), then does what its mode says and prints one JSON line.
WORKER = textwrap.dedent("""
    import json, os, sys, time, torch
    from uvaple.uva import HostTable, SharedSegmentError, reaper
    name, mode, fill_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rows, cols = int(sys.argv[4]), int(sys.argv[5])
    def fill(t):
        print(json.dumps({"filling": os.getpid(), "reaper": reaper.reaper_pid()}), flush=True)
        time.sleep(fill_s)
        if mode == "raise":
            sys.stdin.readline()  # raise when told (once another process is waiting on this one)
            raise ValueError("the checkpoint is unreadable")
        g = torch.Generator().manual_seed(0)
        t.write_rows(torch.randn(rows, cols, generator=g))
    print("loaded", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    try:
        t = HostTable.shared(name, rows, cols, torch.float32, fill=fill, timeout=float(os.environ.get("T", 60)))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "msg": str(e), "s": time.monotonic() - t0}), flush=True)
        sys.exit(0)
    s = int(t.tensor.view(torch.int32).to(torch.int64).sum())
    print(json.dumps({"created": t.created, "sum": s, "pid": os.getpid(), "s": time.monotonic() - t0,
                      "reaper": reaper.reaper_pid()}), flush=True)
    if mode in ("hold", "exit"):
        sys.stdin.readline()  # keep it open until told
    if mode == "exit":
        sys.exit(0)  # without close(): the exit hook lets go of it
    t.close()
""")


class Worker:
    def __init__(self, name, mode="normal", fill_s=0.0, rows=ROWS, cols=COLS, env=None):
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, name, mode, str(fill_s), str(rows), str(cols)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, **(env or {})))
        _WORKERS.append(self)
        self.reaper = None  # its reaper's pid, once a line named it
        assert self.p.stdout.readline().strip() == "loaded", self.p.stderr.read()

    @classmethod
    def holding(cls, name, **kw) -> Worker:
        """A ``hold`` worker that has opened and filled the table (its two lines read), holding it until told."""
        w = cls(name, "hold", **kw)
        w.start()
        w.line()  # filling
        w.line()  # ready
        return w

    def start(self):
        self.say("start")

    def say(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def has_open(self, path: str) -> bool:
        """Whether the worker holds a descriptor of ``path`` (e.g. it is waiting on that segment)."""
        fds = f"/proc/{self.p.pid}/fd"
        try:
            return any(os.readlink(os.path.join(fds, fd)) == path for fd in os.listdir(fds))
        except OSError:
            return False

    def line(self) -> dict:
        out = self.p.stdout.readline()
        assert out, self.p.stderr.read()
        got = json.loads(out)
        self.reaper = got.get("reaper") or self.reaper
        return got

    def finish(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("go\n")
                self.p.stdin.flush()
            except BrokenPipeError:
                pass
        assert self.p.wait(60) == 0, self.p.stderr.read()

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        assert self.p.wait(30) == -signal.SIGKILL

    def kill_tree(self) -> None:
        """Kill the worker as vLLM stops its engine core (``kill_process_tree``): every descendant, then it."""
        for pid in descendants_of(self.p.pid):
            os.kill(pid, signal.SIGKILL)
        self.kill()

    def kill_with_its_reaper(self) -> None:
        """Kill the worker and the reaper that would remove its segments (as a stop of the whole container
        would): what it held stays behind, for the protocol's own recovery to find."""
        assert self.reaper
        os.kill(self.reaper, signal.SIGKILL)
        self.kill()


def descendants_of(pid: int) -> list[int]:
    """The running descendants of ``pid`` (from ``/proc``)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent_of[int(entry)] = int(fields[1])
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent_of.items() if pp in frontier}
        out += sorted(frontier)
    return out


def want_sum() -> int:
    return int(expected().view(torch.int32).to(torch.int64).sum())



# ------------------------------------------------------------------ waiting on processes
def wait_until(cond, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


REAPER_WAIT_S = 30  # for a reaper to see its process gone and act

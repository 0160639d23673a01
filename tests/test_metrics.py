"""Progress, not liveness: counters read without a host synchronisation, the copy placement's stall check,
and the Prometheus export.

CPU here: the lookups' counters (interpreter), the double-buffered snapshot protocol against a device whose
copies complete only when the test says, and the copy backend's health with the fake asynchronous device
operations of ``test_copy_backend`` (a gather held by a fault hook, a device copy that never completes, a
worker blocked while holding the backend's lock). GPU-marked tests check that no read synchronises or
allocates and that the snapshot advances while captured graphs replay.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import rand
from test_copy_backend import FakeAsyncOps, fake_backend, until
from torch.profiler import ProfilerActivity, profile

from uvaple.integration import CopyBackend, GatherLookup, HotSet, TableSpec, make_lookup, telemetry
from uvaple.integration.errors import CopyTimeout
from uvaple.integration.telemetry import CounterSnapshots, Health, Progress, register_prometheus
from uvaple.integration.telemetry.exporter import _push_metrics
from uvaple.kernels import capture
from uvaple.uva import HostTable

HAS_CUDA = torch.cuda.is_available()
STALL_S = 0.3  # the tests' stall threshold: long against a fake job (µs), short for the suite
ANSWER_S = 0.25  # a health check must answer within this, whatever the worker is doing


@pytest.fixture(scope="module")
def table():
    t = rand(301, 24, torch.bfloat16, seed=11)
    with HostTable.from_tensor(t) as h:
        yield t, h


def cpu_allocations(fn) -> int:
    """Bytes the torch CPU allocator handed out while ``fn`` ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def counted(st: dict) -> tuple:
    return st["lookups"], st["rows"], st["out_of_range_ids"]


def timed(fn):
    """``(fn(), seconds)``, with the garbage collector paused: a full collection of the suite's heap
    (0.3 s on a loaded 2-core machine) is not the call's time."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.monotonic()
        out = fn()
        return out, time.monotonic() - t0
    finally:
        if gc_was:
            gc.enable()


# ------------------------------------------------------------------ the gather lookups' snapshots (CPU)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["uva", "device"])
def test_progress_equals_stats_on_cpu(table, kind):
    _, h = table
    with make_lookup(kind, h, device="cpu", oob="row0") as lk:
        p0 = lk.progress()
        assert (p0.lookups, p0.rows, p0.out_of_range_ids, p0.bytes) == (0, 0, 0, 0)
        g = torch.Generator().manual_seed(5)
        for n in (1, 17, 0, 64):
            lk.lookup(torch.randint(-4, h.rows + 4, (n,), generator=g))
        st, p = lk.stats(), lk.progress()
        assert (p.lookups, p.rows, p.out_of_range_ids) == counted(st) and st["lookups"] == 3
        assert p.bytes == st["rows"] * h.cols * h.itemsize
        assert p.kind == kind and not p.closed and p.hot_hits is None and p.outstanding is None
        assert 0.0 <= p.age_s < 5.0  # a plain read on the CPU: current
    assert lk.progress().closed


@pytest.mark.timeout(120)
def test_progress_counts_hot_set_hits(table):
    _, h = table
    hs = HotSet(h, 20, "cpu", rows=torch.arange(20))
    with GatherLookup(h, TableSpec.of(h), "cpu", hot=hs) as lk:
        lk.lookup(torch.tensor([1, 2, 250, -1, 19, 19]))
        st, p = lk.stats(), lk.progress()
        assert p.hot_hits == st["hot_hits"] == 4 and (p.lookups, p.rows, p.out_of_range_ids) == counted(st)


@pytest.mark.timeout(120)
def test_progress_of_a_lookup_built_and_used_in_inference_mode_read_from_another_thread(table):
    _, h = table
    with torch.inference_mode():
        lk = make_lookup("uva", h, device="cpu")
        lk.lookup(torch.tensor([1, 2]))
    got = []
    reader = threading.Thread(target=lambda: got.append(lk.progress()))  # not in inference mode
    reader.start()
    reader.join(60)
    with torch.inference_mode():
        got.append(lk.progress())
    assert [p.rows for p in got] == [2, 2]
    lk.close()


@pytest.mark.timeout(300)
def test_progress_of_a_lookup_built_inside_a_compiled_forward():
    """A module builds its lookup at its first forward, here traced by torch.compile: no snapshot buffers
    can be made while tracing, so the first progress() makes them."""
    from uvaple.integration.embedding import HostScaledEmbedding

    emb = torch.nn.Embedding(53, 32).to(torch.bfloat16)
    mod = HostScaledEmbedding.from_embedding(emb)
    ids = torch.randint(0, 60, (2, 5))
    torch._dynamo.reset()
    compiled = torch.compile(mod, backend="aot_eager", fullgraph=True)
    compiled(ids)
    (lk,) = mod.lookups
    st, p = lk.stats(), lk.progress()
    assert (p.lookups, p.rows, p.out_of_range_ids) == counted(st) and p.rows == 10
    mod.close()


def test_progress_without_counters(table):
    _, h = table
    with make_lookup("uva", h, device="cpu", count=False) as lk:
        p = lk.progress()
        assert p == Progress(kind="uva") and p.lookups is None and p.age_s is None


@pytest.mark.timeout(120)
def test_progress_reuses_its_two_buffers_and_allocates_nothing(table):
    _, h = table
    with make_lookup("uva", h, device="cpu") as lk:
        snaps = lk._snapshots
        ptrs = [b.data_ptr() for b in snaps.buffers]
        ids = torch.tensor([3, 4, 5])
        published = []
        for _ in range(6):
            lk.lookup(ids)
            lk.progress()
            published.append(snaps._published)
        assert published == [1, 0, 1, 0, 1, 0]  # each read copies into the buffer not being returned
        assert [b.data_ptr() for b in snaps.buffers] == ptrs
        lk.progress()
        assert cpu_allocations(lambda: [lk.progress() for _ in range(20)]) == 0
        assert cpu_allocations(lambda: torch.zeros(4, dtype=torch.int64)) > 0  # the check can see one
        assert lk.progress().lookups == lk.stats()["lookups"] == 6


class DelayedDevice(CounterSnapshots):
    """The snapshot protocol as on CUDA, against a device whose copies run only when the test says."""

    def __init__(self, counters: torch.Tensor) -> None:
        super().__init__(counters)
        self._synchronous = False  # take the CUDA path of read()
        self.queue: list[int] = []  # buffers with a copy enqueued, not yet run
        self.done = [True, True]
        self.enqueued = 0

    def _start_copy(self, k: int) -> None:
        assert k != self._published, "a copy must never write the buffer read() returns"
        assert not self.queue, "only one copy in flight"
        self.done[k] = False
        self.queue.append(k)
        self.enqueued += 1

    def _copy_done(self, k: int) -> bool:
        return self.done[k]

    def run_device(self) -> None:
        while self.queue:
            k = self.queue.pop(0)
            self._bufs[k].copy_(self._src)
            self.done[k] = True


@pytest.fixture
def delayed(monkeypatch):
    monkeypatch.setattr(capture, "_driver", lambda: None)  # no CUDA driver here: no capture mode to set
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    counters = torch.zeros(4, dtype=torch.int64)
    return counters, DelayedDevice(counters)


def test_snapshot_returns_the_newest_completed_copy_and_never_waits(delayed):
    counters, snaps = delayed
    counters += torch.tensor([1, 5, 1, 0])
    time.sleep(0.02)  # the construction snapshot is 20 ms older than any the reads below take
    t1 = time.monotonic()
    values, age0 = snaps.read()
    assert values == [0, 0, 0, 0] and snaps.enqueued == 1  # the construction snapshot; a copy enqueued
    time.sleep(0.02)
    values, age1 = snaps.read()
    assert values == [0, 0, 0, 0] and snaps.enqueued == 1  # still in flight: no second copy, no wait
    assert age1 >= age0 + 0.015  # the age grows while nothing completes
    snaps.run_device()  # the copy runs: it sees the counters as they are now
    counters += torch.tensor([2, 2, 0, 1])  # work after the copy ran: not in that snapshot
    values, age2 = snaps.read()
    # the snapshot enqueued by the first read (at t1 or later), not the construction one
    assert values == [1, 5, 1, 0] and snaps.enqueued == 2 and age2 <= time.monotonic() - t1
    snaps.run_device()
    assert snaps.read()[0] == [3, 7, 1, 1]  # eventually the counters
    for _ in range(5):  # read, device, read...: the two buffers alternate and the values never go back
        last = snaps.read()[0]
        snaps.run_device()
        assert snaps.read()[0] >= last


def test_snapshot_under_capture_enqueues_nothing(delayed, monkeypatch):
    counters, snaps = delayed
    counters += 4
    snaps.read()
    snaps.run_device()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = snaps.enqueued
    for _ in range(3):
        values, _ = snaps.read()
        assert values == [0, 0, 0, 0]  # the last completed snapshot, even with a completed copy pending
    assert snaps.enqueued == before and snaps._inflight is not None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert snaps.read()[0] == [4, 4, 4, 4]


def test_snapshot_refuses_other_tensors():
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int64),
                torch.zeros(8, dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="int64"):
            CounterSnapshots(bad)


# ------------------------------------------------------------------ the copy placement: progress and health
@pytest.fixture
def fake():
    return FakeAsyncOps()


@pytest.mark.timeout(60)
def test_copy_progress_equals_stats_and_names_the_oldest_job(fake):
    b = fake_backend(fake, max_in_flight=3)
    j1 = b.submit(torch.tensor([1, -1, 99]))
    j2 = b.submit(torch.tensor([2]))
    until(lambda: j1.done and j2.done)
    p = b.progress()
    assert (p.lookups, p.rows, p.out_of_range_ids) == counted(b.stats()) == (2, 4, 2)
    assert p.bytes == 4 * 9 * 2 and p.age_s == 0.0 and p.kind == "copy"
    assert (p.outstanding, p.oldest_job, p.oldest_stage) == (2, j1.seq, "copy") and p.oldest_age_s >= 0
    fake.run()  # the device copies complete: nothing is outstanding (before any reclaim)
    p = b.progress()
    assert (p.outstanding, p.oldest_job, p.oldest_stage, p.oldest_age_s) == (0, None, None, None)
    b.close()


def health_until(b, pred, stall_s=STALL_S, timeout=5.0) -> Health:
    """Poll ``b.health`` until ``pred`` holds; every call must answer within ANSWER_S."""
    deadline = time.monotonic() + timeout
    while True:
        hl, took = timed(lambda: b.health(stall_s=stall_s))
        assert took < ANSWER_S, f"health() took {took:.3f} s"
        if pred(hl):
            return hl
        if time.monotonic() > deadline:
            raise AssertionError(f"health never reached the expected verdict; last: {hl}")
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_health_names_a_gather_that_stalls_and_recovers(fake):
    b = fake_backend(fake, max_in_flight=3)
    assert b.health(stall_s=STALL_S) == Health(True, "no copy job outstanding")
    gate, entered = threading.Event(), threading.Event()

    def hook(job):
        if job.seq == 2:
            entered.set()
            gate.wait(20)

    b._fault_hook = hook
    first = b.submit(torch.tensor([1]))
    until(lambda: first.done)
    fake.run()  # job 1 completes entirely
    job = b.submit(torch.tensor([4, 5]))
    assert entered.wait(5)
    hl = b.health(stall_s=60)  # outstanding, not yet stalled (whatever pause this machine took since submit)
    assert hl.healthy and hl.oldest_job == job.seq and hl.stage == "gather"
    t0 = time.monotonic()
    hl = health_until(b, lambda h: not h.healthy)
    assert time.monotonic() - t0 < STALL_S + 1.0  # reported soon after the threshold
    assert (hl.oldest_job, hl.stage, hl.outstanding) == (2, "gather", 1) and hl.age_s > STALL_S
    assert "copy job 2" in hl.reason and "'gather'" in hl.reason and "stalled" in hl.reason
    assert "no job finished since" in hl.reason
    assert b.progress().oldest_stage == "gather"
    gate.set()
    until(lambda: job.done)
    assert b.health(stall_s=STALL_S).stage == "copy"  # launched; its device copy has not run
    fake.run()
    hl = health_until(b, lambda h: h.healthy)
    assert hl.outstanding == 0 and hl.oldest_job is None
    b.close()


@pytest.mark.timeout(60)
def test_health_names_a_device_copy_that_never_completes(fake):
    b = fake_backend(fake, max_in_flight=2)
    job = b.submit(torch.tensor([7]))
    until(lambda: job.done)  # launched; the fake device never runs it
    hl = health_until(b, lambda h: not h.healthy)
    assert (hl.oldest_job, hl.stage) == (job.seq, "copy") and "'copy'" in hl.reason
    fake.run()
    assert health_until(b, lambda h: h.healthy).outstanding == 0
    b.close()


class LockedInLaunch(FakeAsyncOps):
    """Fake ops whose device allocation blocks until ``go`` is set: the worker is then stuck inside a
    "CUDA call" made under the backend's lock (``_launch`` allocates conversion buffers under it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside, self.go = threading.Event(), threading.Event()

    def alloc_device(self, numel, dtype, stream):
        self.inside.set()
        self.go.wait(20)
        return super().alloc_device(numel, dtype, stream)


@pytest.mark.timeout(60)
def test_health_answers_while_the_worker_is_stuck_holding_the_lock():
    ops = LockedInLaunch()
    b = fake_backend(ops, max_in_flight=2, out_dtype=torch.float32, close_timeout=10.0)
    job = b.submit(torch.tensor([3, 4]))
    assert ops.inside.wait(5)
    stats_done = threading.Event()
    reader = threading.Thread(target=lambda: (b.stats(), stats_done.set()), daemon=True)
    reader.start()
    assert not stats_done.wait(0.2)  # stats() takes the lock: it cannot answer now
    hl = health_until(b, lambda h: not h.healthy)
    assert (hl.oldest_job, hl.stage) == (job.seq, "launch") and "'launch'" in hl.reason
    p, took = timed(b.progress)
    assert took < ANSWER_S and p.oldest_stage == "launch" and p.rows == 2
    ops.go.set()
    assert stats_done.wait(5)
    until(lambda: job.done)
    ops.run()
    assert health_until(b, lambda h: h.healthy).outstanding == 0
    b.close()


@pytest.mark.timeout(60)
def test_health_names_a_head_of_line_job_while_later_jobs_finish(fake):
    """A job whose CUDA ids never reach the host, behind which later jobs complete: the oldest outstanding
    job is stalled although completions advance."""
    b = fake_backend(fake, max_in_flight=3, ids_timeout=30.0)
    ids = torch.tensor([5, 6])
    fake.device_ids.append(ids)
    stuck = b.submit(ids)  # its ids copy waits for the caller's stream, which the test never runs
    later = [b.submit(torch.tensor([i])) for i in (1, 2)]
    until(lambda: all(j.done for j in later))
    # the later jobs' submit points are reached (in the fake, the caller's stream is one queue: running it
    # would release the stuck ids copy too), then their device copies run
    for j in later:
        j._slot.submit_event.latest.done = True
    while fake.step(b._copy_stream):
        pass
    hl = health_until(b, lambda h: not h.healthy)
    assert (hl.oldest_job, hl.stage, hl.outstanding) == (stuck.seq, "ids", 1)
    assert "2 later job(s) finished since" in hl.reason
    fake.run()
    until(lambda: stuck.done)
    fake.run()
    assert health_until(b, lambda h: h.healthy).outstanding == 0
    b.close()


@pytest.mark.timeout(60)
def test_health_names_a_failed_job_whose_device_work_never_completes(fake):
    """A job failed on the host (its CUDA ids timed out) keeps its slot while the ids copy recorded for it
    has not run: outstanding, in stage 'failed', until the device gets there."""
    b = fake_backend(fake, max_in_flight=1, ids_timeout=0.05)
    ids = torch.tensor([1, 2])
    fake.device_ids.append(ids)
    job = b.submit(ids)
    with pytest.raises(CopyTimeout, match="CUDA ids"):
        job.wait(timeout=5)
    hl = health_until(b, lambda h: not h.healthy)
    assert (hl.oldest_job, hl.stage) == (job.seq, "failed")
    fake.run()
    assert health_until(b, lambda h: h.healthy).outstanding == 0
    b.close()


@pytest.mark.timeout(60)
def test_health_of_a_dead_worker_and_of_a_closed_backend(fake):
    b = fake_backend(fake)
    b._run = lambda job: (_ for _ in ()).throw(SystemExit("worker bug"))
    b.submit(torch.tensor([1]))
    hl = health_until(b, lambda h: not h.healthy)
    assert "worker died" in hl.reason
    b.close()
    c = fake_backend(fake)
    c.close()
    assert c.health() == Health(False, "the CopyBackend is closed")
    with pytest.raises(ValueError, match="stall_s"):
        c.health(stall_s=0)


@pytest.mark.timeout(60)
def test_real_cpu_copy_backend_is_healthy_and_counts(table):
    _, h = table
    with CopyBackend(h, device="cpu", max_rows=64, max_in_flight=2) as b:
        for k in range(5):
            b.lookup(torch.tensor([k, -3, 400]))
        hl, p = b.health(), b.progress()
        assert hl.healthy and hl.outstanding == 0 and p.outstanding == 0
        assert (p.lookups, p.rows, p.out_of_range_ids) == counted(b.stats()) == (5, 15, 10)


# ------------------------------------------------------------------ Prometheus
def samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.mark.timeout(120)
def test_prometheus_export_reads_progress_at_scrape_time(table, fake):
    prom = pytest.importorskip("prometheus_client")
    _, h = table
    registry = prom.CollectorRegistry()
    hs = HotSet(h, 10, "cpu", rows=torch.arange(10))
    lk = GatherLookup(h, TableSpec.of(h), "cpu", hot=hs)
    cb = fake_backend(fake, max_in_flight=2)
    collector = register_prometheus({"ple": lk, "copy": cb}, registry=registry)
    lk.lookup(torch.tensor([1, 2, 3, 200, -1]))
    job = cb.submit(torch.tensor([1, 2]))
    until(lambda: job.done)  # its device copy stays outstanding
    got = samples(prom.generate_latest(registry).decode())
    ple = (("lookup", "ple"), ("placement", "uva"))
    cp = (("lookup", "copy"), ("placement", "copy"))
    st = lk.stats()
    assert got[("uvaple_lookups_total", ple)] == st["lookups"] == 1
    assert got[("uvaple_rows_total", ple)] == st["rows"] == 5
    assert got[("uvaple_bytes_total", ple)] == 5 * h.cols * h.itemsize
    assert got[("uvaple_out_of_range_ids_total", ple)] == st["out_of_range_ids"] == 1
    assert got[("uvaple_hot_hits_total", ple)] == st["hot_hits"] == 3
    assert 0 <= got[("uvaple_snapshot_age_seconds", ple)] < 5
    assert ("uvaple_copy_outstanding_jobs", ple) not in got and ("uvaple_hot_hits_total", cp) not in got
    assert got[("uvaple_rows_total", cp)] == 2 and got[("uvaple_copy_outstanding_jobs", cp)] == 1
    assert got[("uvaple_copy_oldest_job_age_seconds", (*cp, ("stage", "copy")))] >= 0
    fake.run()
    got = samples(prom.generate_latest(registry).decode())
    assert got[("uvaple_copy_outstanding_jobs", cp)] == 0
    assert not any(name == "uvaple_copy_oldest_job_age_seconds" for name, _ in got)
    with pytest.raises(ValueError):  # one collector per registry: the names are declared
        register_prometheus({"other": lk}, registry=registry)
    with pytest.raises(ValueError, match="already exported"):
        collector.add("ple", lk)
    cb.close()  # closed: gone from the next scrape
    del lk
    gc.collect()  # dropped: gone too (the collector holds lookups weakly)
    got = samples(prom.generate_latest(registry).decode())
    assert not any(dict(labels).get("lookup") in ("ple", "copy") for _, labels in got)
    registry.unregister(collector)


_RANK = textwrap.dedent("""
    import json, os, sys, time
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]  # as vLLM sets it for its engine processes
    import torch
    from uvaple.integration import GatherLookup, TableSpec
    from uvaple.integration.telemetry import MultiprocessExporter, multiprocess_dir
    from uvaple.uva import HostTable
    assert multiprocess_dir() == sys.argv[1]
    rank = int(sys.argv[2])
    with HostTable.from_tensor(torch.randn(100, 8)) as h:
        lk = GatherLookup(h, TableSpec.of(h), "cpu")
        ex = MultiprocessExporter(interval_s=0.02)
        ex.add("ple", lk)
        lk.lookup(torch.tensor([1, 2, 500] + [3] * rank))  # one id out of range
        seen = ex.pushes
        deadline = time.monotonic() + 30
        while ex.pushes < seen + 3 and time.monotonic() < deadline:  # pushes from the thread, after the call
            time.sleep(0.01)
        pushed_by_thread = ex.pushes >= seen + 3
        lk.lookup(torch.tensor([4]))  # pushed by close()
        ex.close()
        print(json.dumps({"pushed_by_thread": pushed_by_thread, "running": ex.running, "kind": lk.kind,
                          "stats": lk.stats()}), flush=True)
        lk.close()
""")


def test_multiprocess_export_reaches_the_aggregating_process(tmp_path):
    """vLLM's metrics path: each engine process pushes its lookups' progress into prometheus_client's
    multiprocess files (MultiprocessExporter's thread, then close()); the API server's aggregation of that
    directory gives the totals over the processes, counters summed."""
    prom = pytest.importorskip("prometheus_client")
    import json

    from prometheus_client import multiprocess

    runs = [subprocess.run([sys.executable, "-c", _RANK, str(tmp_path), str(rank)], capture_output=True, text=True,
                           timeout=120) for rank in (0, 1)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    outs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert all(o["pushed_by_thread"] and not o["running"] for o in outs)
    registry = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    got = samples(prom.generate_latest(registry).decode())
    ple = (("lookup", "ple"), ("placement", outs[0]["kind"]))
    assert got[("uvaple_lookups_total", ple)] == sum(o["stats"]["lookups"] for o in outs) == 4
    assert got[("uvaple_rows_total", ple)] == sum(o["stats"]["rows"] for o in outs) == (3 + 1) + (4 + 1)
    assert got[("uvaple_out_of_range_ids_total", ple)] == 2
    assert got[("uvaple_bytes_total", ple)] == 9 * 8 * 4


def test_concurrent_pushes_never_count_twice(table):
    """push() from the thread, from close() and from callers at once: each lookup's deltas are read, added
    and stored together, so the pushed counters equal the lookup's."""
    pytest.importorskip("prometheus_client")
    _, h = table
    lk = GatherLookup(h, TableSpec.of(h), "cpu")
    ex = telemetry.MultiprocessExporter(interval_s=0.01)
    ex.add("twice", lk)
    for _ in range(10):
        lk.lookup(torch.tensor([1, 2, 3]))
    threads = [threading.Thread(target=lambda: [ex.push() for _ in range(40)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ex.close()
    counter = _push_metrics()["lookups"].labels("twice", lk.kind)
    assert counter._value.get() == lk.stats()["lookups"] == 10


_FORKED = textwrap.dedent("""
    import faulthandler, os, signal, sys, threading, time, torch
    from uvaple.integration import GatherLookup, TableSpec
    from uvaple.integration.telemetry import MultiprocessExporter, Progress
    from uvaple.uva import HostTable

    class Slow:  # a lookup whose progress() takes a while: a push spends most of its time inside it
        kind = "uva"
        inside = False

        def progress(self):
            Slow.inside = True
            time.sleep(0.01)
            Slow.inside = False
            return Progress(kind="uva", lookups=1, rows=1, bytes=16, out_of_range_ids=0, age_s=0.0)

    h = HostTable.from_tensor(torch.randn(50, 8))
    lk = GatherLookup(h, TableSpec.of(h), "cpu")  # its progress() takes the snapshot's lock
    slow = Slow()
    ex = MultiprocessExporter(interval_s=0.01)
    ex.add("forked", lk)
    ex.add("slow", slow)
    lk.lookup(torch.tensor([1]))
    results = []
    for i in range(int(sys.argv[1])):
        time.sleep(0.001 * (i % 7))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a whole state, free locks; it exports only its own lookups, from its thread
            faulthandler.dump_traceback_later(40, exit=True)
            split = Slow.inside
            ex.push()  # forgets the parent's lookups
            mine = HostTable.from_tensor(torch.randn(5, 8))
            own_lk = GatherLookup(mine, TableSpec.of(mine), "cpu")  # held: the exporter holds it weakly
            ex.add("child", own_lk)
            n = ex.pushes
            deadline = time.monotonic() + 20
            while ex.pushes < n + 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            own = sorted(ex._refs) == ["child"]
            os.write(w, b"split" if split else b"theirs" if not own else
                     b"ok" if ex.running and ex.pushes >= n + 3 else b"stalled")
            os._exit(0)
        os.close(w)
        got, deadline = b"", time.monotonic() + 60
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                got = os.read(r, 16)
                break
            time.sleep(0.005)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            got = b"hung"
        os.close(r)
        results.append(got.decode() or "died")
    ex.close()
    print(" ".join(sorted(set(results))), ex.running, flush=True)
""")


def test_forked_children_push_from_their_own_thread():
    """Forks land while the parent's thread is pushing (most of its time is inside a slow progress(), and
    a real lookup's snapshot lock is taken in every push): every child finds whole state and free locks,
    forgets the parent's lookups and pushes its own on its own thread. Without the fork gate most children
    see a push split and some hang."""
    pytest.importorskip("prometheus_client")
    r = subprocess.run([sys.executable, "-c", _FORKED, "25"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "ok False", (r.stdout, r.stderr)


def test_multiprocess_exporter_checks_its_arguments_and_stops(table):
    pytest.importorskip("prometheus_client")
    _, h = table
    with pytest.raises(ValueError, match="interval_s"):
        telemetry.MultiprocessExporter(interval_s=0)
    ex = telemetry.MultiprocessExporter(interval_s=0.01)
    assert not ex.running  # no thread before a lookup is added
    lk = GatherLookup(h, TableSpec.of(h), "cpu")
    with pytest.raises(TypeError, match="progress"):
        ex.add("x", object())
    with pytest.raises(ValueError, match="name"):
        ex.add("", lk)
    ex.add("a", lk)
    assert ex.running
    with pytest.raises(ValueError, match="already exported"):
        ex.add("a", lk)
    del lk
    gc.collect()
    n = ex.pushes
    until(lambda: ex.pushes > n + 2)  # a dropped lookup is skipped, the thread goes on
    ex.close()
    assert not ex.running
    ex.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ex.add("b", GatherLookup(h, TableSpec.of(h), "cpu"))


def test_importing_uvaple_imports_no_prometheus_client_and_registering_says_what_is_missing():
    code = textwrap.dedent("""
        import sys
        import uvaple, uvaple.integration, uvaple.integration.telemetry
        assert "prometheus_client" not in sys.modules, "imported at import time"
        sys.modules["prometheus_client"] = None  # as if not installed
        from uvaple.integration.telemetry import register_prometheus
        try:
            register_prometheus({})
        except ImportError as e:
            assert "pip install prometheus_client" in str(e), e
        else:
            raise AssertionError("no ImportError")
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ------------------------------------------------------------------ GPU
DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_table():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    t = rand(3001, 35 * 256, seed=7)  # Gemma 3n E4B rows (17,920 B)
    with HostTable.from_tensor(t, register=True) as h:
        yield h


@pytest.mark.gpu
def test_progress_never_synchronises_or_allocates_on_gpu(gpu_table):
    h = gpu_table
    with make_lookup("uva", h, max_rows=4096, order="direct") as lk, \
            CopyBackend(h, max_rows=64, max_in_flight=2) as cb:
        ids = torch.randint(0, h.rows, (4096,), device=DEV)
        out = torch.empty(4096, h.cols, dtype=h.dtype, device=DEV)
        host_ids = torch.randint(0, h.rows, (64,))
        lk.lookup(ids, out)
        cb.lookup(host_ids)
        lk.progress(), cb.progress(), cb.health()
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        host_before = torch.cuda.host_memory_stats().get("active_requests.allocated", 0)  # pinned handouts
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(50):
                lk.lookup(ids, out)
                p = lk.progress()
                cb.progress(), cb.health()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        assert torch.cuda.host_memory_stats().get("active_requests.allocated", 0) == host_before
        assert p.lookups <= 51
        torch.cuda.synchronize()
        until(lambda: lk.progress().lookups == lk.stats()["lookups"] == 51)


@pytest.mark.gpu
def test_snapshot_advances_while_captured_graphs_replay(gpu_table):
    """Replays queued on the model's stream take a while; the snapshots, on their own stream, show the
    counters moving through them, without any synchronisation, and end at stats()."""
    h = gpu_table
    n, replays = 8192, 60  # 147 MB over PCIe per replay: milliseconds each
    with make_lookup("uva", h, max_rows=n, order="direct") as lk:
        ids = torch.randint(0, h.rows, (n,), device=DEV)
        out = torch.empty(n, h.cols, dtype=h.dtype, device=DEV)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lk.lookup(ids, out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            lk.lookup(ids, out)
        torch.cuda.synchronize()
        base = lk.stats()["lookups"]
        until(lambda: lk.progress().lookups == base)
        for _ in range(replays):
            graph.replay()
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen.append(lk.progress().lookups - base)
            if seen[-1] == replays:
                break
            time.sleep(0.0005)
        assert seen[-1] == replays and seen == sorted(seen)
        assert any(0 < v < replays for v in seen), "no snapshot landed while the replays ran"
        torch.cuda.synchronize()
        assert lk.stats()["lookups"] - base == replays


@pytest.mark.gpu
def test_progress_during_a_capture_on_this_and_another_thread(gpu_table):
    """On the capturing thread a read returns the last snapshot and enqueues nothing; another thread's
    reads during the (global-mode) capture, the copy placement's event queries included, do not
    invalidate it."""
    h = gpu_table
    with make_lookup("uva", h, max_rows=256) as lk, CopyBackend(h, max_rows=64, max_in_flight=2) as cb:
        ids = torch.randint(0, h.rows, (256,), device=DEV)
        out = torch.empty(256, h.cols, dtype=h.dtype, device=DEV)
        lk.lookup(ids, out)
        cb.lookup(torch.randint(0, h.rows, (64,)))  # its slot holds a launched job: health() queries its events
        torch.cuda.synchronize()
        until(lambda: lk.progress().lookups == 1)
        capturing, polled, errors = threading.Event(), threading.Event(), []

        def poll():
            capturing.wait(10)
            try:
                for _ in range(50):
                    lk.progress()
                    assert cb.health().healthy and cb.progress().rows == 64
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
            polled.set()

        poller = threading.Thread(target=poll)
        poller.start()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lk.lookup(ids, out)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            lk.lookup(ids, out)
            inflight = lk._snapshots._inflight
            p = lk.progress()  # this thread's stream is capturing: nothing enqueued
            assert lk._snapshots._inflight == inflight
            capturing.set()
            assert polled.wait(10)
        poller.join(10)
        assert not errors, errors
        assert p.lookups >= 1
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        until(lambda: lk.progress().lookups == lk.stats()["lookups"] == 5)

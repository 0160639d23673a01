"""Every placement and lookup path gives the same bits under random overlapped schedules, never hangs, leaks nothing.

A schedule (``make_plan(seed)``, drawn up front from the seed) is a table, a mode, a depth ``k`` of 1-8
passes in flight and ``k + 0..6`` passes; the consumer keeps up to ``k`` passes submitted and consumes them
in order. Each pass draws:

* ids: int32 or int64; 0-d, 1-D of 0-40 ids, 2-D (some a non-contiguous view); uniform, all equal, a few
  distinct, sorted runs; 60% with out-of-range ids (-1, one past the end, +-2**31, and for int64 2**40
  and +-2**63);
* a policy (scale, ``oob`` zero / row0 / neg_zero, output dtype) and a column range;
* the paths: the ``copy`` placement (``submit``, or for some passes the inline ``lookup``), ``uva`` in id
  order, ``uva`` sorted with de-duplication through a ``HotSet`` (``order="sorted", dedup=True, hot=``),
  ``device`` and, with CUDA, ``split`` (``lookup_split`` of the host ids, a share of 0 to all of them
  gathered by the GPU and the rest by the calling thread, where the pass reads every column; else its
  ``lookup``). The fp8 tables (``fp8_row``, ``fp8_global`` encodings) have the gather paths only: the
  copy placement serves raw rows;
* its ``out`` buffers: reused from a consumed pass (poisoned again first) or fresh (poisoned);
* whether its ids are rewritten in place right after the submit (with CUDA the device ids, on the
  caller's stream; the CPU ids handed to the copy backend everywhere: the backend snapshots them);
* a hot-set change after it (``set_rows`` with other rows, or ``refresh`` from the served-id counts);
* a cancellation of its copy job (``CopyJob.cancel()``) right after the submit or just before the wait:
  ``True`` means the job raises ``CopyJobCancelled`` and never writes ``out``; ``False`` (already being
  gathered or launched) means it completes as it would have;
* consumer delays: a host sleep before the wait and, with CUDA, a sleep kernel on the caller's stream
  after it, so that a buffer being reused is still being read when the next pass is submitted
  (write-after-read, seed 004). The copy worker is slowed before some gathers, so jobs queue up.

Modes (raw tables). ``pipeline``: the shared copy backends, built with ``max_in_flight=8`` so that depth 8 is
admitted (a submit may wait, bounded, for the GPU to free a slot). ``admission``: a fresh backend whose
``max_in_flight`` is below the depth, with a short ``admission_timeout`` and its first gather stalled: a
submit either gets a slot (possibly after a wait) or raises ``CopyBackendOverloaded`` within its bound having
touched nothing; the consumer then consumes its oldest pass and submits again (seed 000: deliberate
overload, never ``queue.Full``, never a hang). ``close``: a fresh backend (1-8 slots) closed in the middle
of the schedule, on the test's thread or on another one racing the waits, the submits and admissions waiting
for a slot: every job ends in bounded time with its rows (launched before the close), ``CopyJobCancelled``
or ``BackendClosed``; later submits raise ``BackendClosed``; the worker is gone and the slots are released.

Checks. Every pass is compared bit for bit with ``reference_gather`` on every path; an ``out`` a copy job
never wrote (cancelled, closed, refused at admission) must still hold the poison. Every wait is bounded (job
waits, admission, close, joins, and the GPU by polling an event); the test's pytest-timeout backstop dumps
the stacks and fails. At the end every lookup, backend and table is closed and host memory and registrations
are back to their baseline: each host table's region is released (unmapped, unregistered:
``uvaple.uva._region.live_regions()``), no copy worker thread is left, and the backends, their pinned staging
blocks and the tables are garbage collected (on CUDA the staging goes back to torch's pinned-memory cache).

On CPU (CI) the tensors stay on the CPU (``uva``/``device`` run the Triton kernels interpreted; the copy
backend's device operations are synchronous, so its stream ordering, the write-after-read on reused buffers
and the ordering of rewritten CUDA ids are exercised only with CUDA). With CUDA, ids and ``out`` live on the
GPU, half the schedules run on a non-default stream, and the copy backend gets CPU ids for some passes.

``UVAPLE_EQUIV_SCHEDULES``: the number of schedules ``test_random_schedules_agree`` runs (default 6, about 5 s
on two idle CPU cores; the GPU run passes 1000, the soak 10000 split over processes by ``perf/studies/soak.py``).
Unset, the extended set (``-m extended``) also runs ``test_random_schedules_agree_in_full``: 60 schedules from seed
0, about 45 s. ``UVAPLE_EQUIV_FIRST_SEED``: the first schedule's seed (default 0). ``UVAPLE_EQUIV_DEADLINE_S``: no
schedule starts after this many seconds (a soak's bound; the summary says how many ran). From 40 schedules on,
every feature above must have happened at least once (``EXERCISED``).
``UVAPLE_EQUIV_SUMMARY``: where to write a JSON summary of what ran (schedules, passes, lookups compared,
depths reached, copy jobs, cancellations, refused and waiting admissions, closes and how their jobs ended,
ids rewritten, outs reused, hot-set changes, seconds); it is also printed (``pytest -rA`` shows it) and
attached to the junit report (``record_property``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import threading
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from uvaple.integration import HotSet, TableSpec, make_lookup
from uvaple.integration.errors import BackendClosed, CopyBackendOverloaded, CopyJobCancelled
from uvaple.integration.placements.copy import worker as copy_worker
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable, _region

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")
# The default set's schedules; the extended set's (test_random_schedules_agree_in_full), enough for every feature
# to have happened (EXERCISED), unless UVAPLE_EQUIV_SCHEDULES says how many to run
N_SCHEDULES = int(os.environ.get("UVAPLE_EQUIV_SCHEDULES", "6"))
FULL_SCHEDULES = 60
# The first schedule's seed: a soak splits its seeds over processes running side by side (perf/studies/soak.py).
FIRST_SEED = int(os.environ.get("UVAPLE_EQUIV_FIRST_SEED", "0"))
# A soak's time bound: no schedule starts after this many seconds (the summary says how many ran); unset: none.
DEADLINE_S = float(os.environ.get("UVAPLE_EQUIV_DEADLINE_S", "inf"))
SUMMARY_PATH = os.environ.get("UVAPLE_EQUIV_SUMMARY")
MAX_DEPTH = 8  # passes in flight (async schedulers keep 2; pipelined prefetch more)
MAX_IDS = 40  # ids per pass
MAX_ROWS = 64  # the lookups' max_rows (staging slots, sort workspaces)
# The bound of every wait: far above a healthy pass (ms), even on a loaded CI machine; reaching it is a hang.
WAIT_S = 30.0
# Slack for a bounded wait that must end by its own deadline (a loaded 2-core CI machine schedules late).
SLACK_S = 10.0
SLOW_GATHER_S = 0.004  # the longest delay the copy worker is given before a gather
# An admission or close schedule stalls its backend's first gather this long (one of), so that jobs queue up
# behind it: a few passes' time (interpreted kernels on CPU take ~0.1 s a lookup, compiled ones microseconds).
STALLS_S = (0.3, 1.0) if not HAS_CUDA else (0.005, 0.02)


def backstop_s(schedules: int) -> int:
    """The backstop of a whole test (pytest-timeout): generous, the bounded waits fail first."""
    return 600 + int(schedules * (0.5 if HAS_CUDA else 20))


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
POISON = {2: 0x7F0F, 4: 0x7F80F0F0}  # NaN payloads the data never has
FLOATS = [torch.bfloat16, torch.float16, torch.float32]


@dataclass(frozen=True)
class TableKind:
    rows: int
    cols: int  # stored columns (an fp8_row row's 4 scale bytes included)
    dtype: torch.dtype
    encoding: str = "raw"


# small tables keep the interpreted kernels fast on CPU; the first three go through every placement
TABLES = [TableKind(193, 24, torch.bfloat16), TableKind(64, 7, torch.float16), TableKind(300, 5, torch.float32),
          TableKind(150, 21, torch.float8_e5m2, "fp8_row"), TableKind(120, 24, torch.float8_e4m3fn, "fp8_global")]
TABLE_WEIGHTS = [3, 3, 3, 1, 1]
DQ_SCALE = 0.0173  # fp8_global's scale: not exact in bf16 (the kernel rounds it to the output dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(BITS[t.element_size()])


def poison(out: torch.Tensor) -> torch.Tensor:
    out.view(BITS[out.element_size()]).fill_(POISON[out.element_size()])
    return out


def is_poisoned(t: torch.Tensor) -> bool:
    b = bits(t)
    return bool((b == POISON[t.element_size()]).all())


def random_table(kind: TableKind, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind.encoding == "raw":
        t = (torch.randn(kind.rows, kind.cols, generator=g) * 3).to(kind.dtype)
        t[t == 0] = 1.25  # random data, never zeros
        return t
    ncodes = kind.cols - (4 if kind.encoding == "fp8_row" else 0)
    codes = torch.randint(0, 256, (kind.rows, ncodes), generator=g, dtype=torch.uint8)
    # no zeros, no infinities, no NaNs (e4m3fn: 0x7F/0xFF; e5m2: the all-ones exponent)
    bad = (codes & 0x7F) == 0
    bad |= (codes & 0x7F) == 0x7F if kind.dtype == torch.float8_e4m3fn else (codes & 0x7C) == 0x7C
    codes[bad] = 0x3C
    if kind.encoding == "fp8_row":
        scales = (torch.rand(kind.rows, generator=g) + 0.01).to(torch.float32) * 0.2
        codes = torch.cat([codes, scales.view(-1, 1).view(torch.uint8)], dim=1)
    return codes.view(kind.dtype)


def settle(what: str, timeout: float = WAIT_S) -> None:
    """Wait, bounded, for the current stream's work (CUDA): poll an event, so that a GPU hang fails here
    instead of blocking a synchronisation forever. Nothing to wait for on CPU."""
    if not HAS_CUDA:
        return
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.monotonic() + timeout
    while not ev.query():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: the GPU work did not complete within {timeout} s (a hang)")
        time.sleep(1e-4)


class WorkerDelays:
    """The copy workers' fault hook: before a gather, sleep with the current schedule's probability (its own
    random stream: the schedule's draws never depend on the worker's timing), and ``stall`` seconds before the
    first gather of a backend built for one schedule."""

    def __init__(self) -> None:
        self.p = 0.0
        self.stall = 0.0
        self.stalled: weakref.WeakSet = weakref.WeakSet()  # the backends built for one schedule
        self._rng = random.Random(7)

    def __call__(self, job) -> None:
        if job.seq == 1 and self.stall and job._backend in self.stalled:
            time.sleep(self.stall)
        elif self.p and self._rng.random() < self.p:
            time.sleep(self._rng.random() * SLOW_GATHER_S)


class Table:
    """One host table, its hot set, and for each policy a lookup of every path over it (built on first use)."""

    def __init__(self, index: int, kind: TableKind, delays: WorkerDelays) -> None:
        self.index = index
        self.kind = kind
        self.data = random_table(kind, seed=index)
        self.table = HostTable.from_tensor(self.data)
        self.capacity = kind.rows // 3
        first = torch.randperm(kind.rows, generator=torch.Generator().manual_seed(100 + index))[: self.capacity]
        # the hot set holds a third of the rows; tables 0, 2 and 4 count the served ids (refresh() ranks them)
        self.hot = HotSet(self.table, self.capacity, DEVICE, rows=first.to(DEVICE), count_ids=index % 2 == 0)
        self.dq = (torch.tensor([DQ_SCALE], dtype=torch.float32, device=DEVICE)
                   if kind.encoding == "fp8_global" else None)
        self.delays = delays
        self._made: dict = {}
        self.fresh: list = []  # copy backends built for one schedule (admission, close modes), until closed
        self.refs: list = []  # weak references to every copy backend built and its pinned staging block

    @property
    def has_copy(self) -> bool:
        return self.kind.encoding == "raw"

    def spec(self, key: tuple) -> TableSpec:
        scale, oob, out_dtype = key
        return TableSpec.of(self.table, encoding=self.kind.encoding, scale=scale, oob=oob, out_dtype=out_dtype,
                            column_block=1)

    def paths(self, key: tuple) -> dict:
        """``{path: lookup}`` with this policy: copy (raw tables), uva direct, uva sorted+dedup+hot, device, and
        with CUDA split."""
        if key not in self._made:
            spec = self.spec(key)
            extra = {} if self.dq is None else {"dequant_scale": self.dq}
            made = {}
            if self.has_copy:
                made["copy"] = self.new_copy(key, max_in_flight=MAX_DEPTH, admission_timeout=WAIT_S, fresh=False)
            made["uva"] = make_lookup("uva", self.table, device=DEVICE, spec=spec, order="direct", **extra)
            made["uva_sorted_dedup_hot"] = make_lookup("uva", self.table, device=DEVICE, spec=spec,
                                                       max_rows=MAX_ROWS, order="sorted", dedup=True, hot=self.hot,
                                                       **extra)
            made["device"] = make_lookup("device", self.table, device=DEVICE, spec=spec, **extra)
            if HAS_CUDA:  # the split lookup gathers on the GPU and stages through pinned memory: CUDA only
                made["split"] = make_lookup("split", self.table, device=DEVICE, spec=spec, max_rows=MAX_ROWS, **extra)
            self._made[key] = made
        return self._made[key]

    def new_copy(self, key: tuple, *, max_in_flight: int, admission_timeout: float, fresh: bool = True):
        b = make_lookup("copy", self.table, device=DEVICE, spec=self.spec(key), max_rows=MAX_ROWS,
                        max_in_flight=max_in_flight, admission_timeout=admission_timeout, wait_timeout=WAIT_S,
                        ids_timeout=WAIT_S, close_timeout=WAIT_S)
        b._fault_hook = self.delays
        self.refs += [weakref.ref(b), weakref.ref(b._host_block)]
        if fresh:
            self.fresh.append(b)
            self.delays.stalled.add(b)
        return b

    def reference(self, ids: torch.Tensor, key: tuple, columns) -> torch.Tensor:
        scale, oob, out_dtype = key
        return reference_gather(self.data, ids, scale=scale, columns=columns, oob=oob, out_dtype=out_dtype,
                                dequant_scale=self.dq, row_scale=self.kind.encoding == "fp8_row")

    def lookups(self) -> list:
        return [lk for made in self._made.values() for lk in made.values()] + self.fresh

    def copies(self) -> list:
        return [made["copy"] for made in self._made.values() if "copy" in made]

    def close(self) -> None:
        for lk in self.lookups():
            lk.close()
        self.table.close()


# ------------------------------------------------------------------ the plan of a schedule
@dataclass
class PassPlan:
    ids: torch.Tensor  # CPU, possibly a non-contiguous view: the ids as submitted
    junk: torch.Tensor  # what the ids are rewritten to after the submit (when rewrite)
    key: tuple  # (scale, oob, out_dtype)
    columns: object
    reuse: float  # < 0.7: take a consumed pass's out buffers when there are any
    copy_cpu_ids: bool  # CUDA: the copy backend gets CPU ids (the server case)
    inline: bool  # copy: lookup() (gathered on the caller's thread) instead of submit()
    rewrite: bool
    cancel: str | None  # "submit" | "wait"
    host_delay: float
    gpu_sleep: int  # cycles of a sleep kernel after the wait (CUDA)
    hot: tuple | None  # ("set", rows) | ("refresh",)


@dataclass
class SchedulePlan:
    seed: int
    table: int
    mode: str  # pipeline | admission | close
    depth: int
    side_stream: bool
    slow: float  # probability that the copy worker sleeps before a gather
    stall: float = 0.0  # admission/close: the backend's first gather waits this long
    max_in_flight: int = MAX_DEPTH
    admission_timeout: float = WAIT_S
    close_after: int = -1  # close mode: closed after this many submits
    close_on_thread: bool = False
    passes: list[PassPlan] = field(default_factory=list)

    def describe(self) -> str:
        return (f"seed {self.seed}: table {self.table}, mode {self.mode}, depth {self.depth}, "
                f"{len(self.passes)} passes, max_in_flight {self.max_in_flight}, admission_timeout "
                f"{self.admission_timeout}, close_after {self.close_after} (thread {self.close_on_thread}), "
                f"side stream {self.side_stream}, slow {self.slow}, stall {self.stall}")


def draw_ids(rng: random.Random, rows: int) -> torch.Tensor:
    shape = rng.choice([(rng.randint(0, MAX_IDS),), (rng.randint(1, 5), rng.randint(1, 6)), (1,), ()])
    ids_dtype = rng.choice([torch.int32, torch.int64])
    n = 1
    for s in shape:
        n *= s
    pattern = rng.choice(["uniform", "uniform", "uniform", "equal", "few", "runs"])
    if pattern == "equal":
        vals = [rng.randrange(rows)] * n
    elif pattern == "few":
        few = [rng.randrange(rows) for _ in range(3)]
        vals = [rng.choice(few) for _ in range(n)]
    else:
        vals = [rng.randrange(rows) for _ in range(n)]
        if pattern == "runs":
            vals.sort()
    if rng.random() < 0.6 and n:
        bad = [-1, rows, rows + 3, -(2**31), 2**31 - 1]
        if ids_dtype == torch.int64:
            bad += [2**40, -(2**63), 2**63 - 1]
        for _ in range(rng.randint(1, 3)):
            vals[rng.randrange(n)] = rng.choice(bad)
    ids = torch.tensor(vals, dtype=ids_dtype).reshape(shape)
    if len(shape) == 2 and rng.random() < 0.3:  # a non-contiguous view (a transposed buffer)
        ids = ids.t().contiguous().t()
    return ids


def make_plan(seed: int) -> SchedulePlan:
    rng = random.Random(1000 + seed)
    ti = rng.choices(range(len(TABLES)), weights=TABLE_WEIGHTS)[0]
    kind = TABLES[ti]
    mode = rng.choices(["pipeline", "admission", "close"], weights=[5, 2, 2])[0] if kind.encoding == "raw" \
        else "pipeline"
    depth = rng.randint(2 if mode == "admission" else 1, MAX_DEPTH)
    plan = SchedulePlan(seed, ti, mode, depth, side_stream=HAS_CUDA and rng.random() < 0.5,
                        slow=rng.choice([0.0, 0.3, 0.8]))
    if mode == "admission":
        plan.max_in_flight = rng.randint(1, depth - 1)
        plan.admission_timeout = rng.choice([0.0, 0.002, 0.05, 1.0])
        plan.slow = rng.choice([0.5, 1.0])
        plan.stall = rng.choice(STALLS_S)
    total = depth + rng.randint(0, 6)
    if mode == "close":
        # mostly while the stalled first job and the passes behind it are still in flight
        plan.close_after = rng.randint(1, min(total, depth)) if rng.random() < 0.7 else rng.randint(0, total)
        plan.close_on_thread = rng.random() < 0.5
        # admissions may be waiting for a slot when the close comes (refused: BackendClosed, at once)
        plan.max_in_flight = rng.randint(1, MAX_DEPTH)
        plan.admission_timeout = rng.choice([0.05, 1.0, WAIT_S])
        plan.slow = rng.choice([0.5, 1.0])
        plan.stall = rng.choice(STALLS_S)  # jobs still queued when the close comes
    fixed_key = None
    for _ in range(total):
        # one backend per admission/close schedule: one policy for all its passes
        key = draw_policy_for(rng, ti) if mode == "pipeline" or fixed_key is None else fixed_key
        fixed_key = key
        ids = draw_ids(rng, kind.rows)
        cols = kind.cols - (4 if kind.encoding == "fp8_row" else 0)
        c0 = rng.randrange(cols)
        columns = rng.choice([None, (c0, rng.randint(c0 + 1, cols)), slice(c0, None)])
        hot = None
        if rng.random() < 0.15:
            if ti % 2 == 0 and rng.random() < 0.5:
                hot = ("refresh",)
            else:
                k = rng.randint(0, kind.rows // 3)
                hot = ("set", rng.sample(range(kind.rows), k))
        plan.passes.append(PassPlan(
            ids=ids, junk=torch.randint(0, kind.rows, ids.shape, dtype=ids.dtype,
                                        generator=torch.Generator().manual_seed(rng.randrange(2**31))),
            key=key, columns=columns, reuse=rng.random(), copy_cpu_ids=HAS_CUDA and rng.random() < 0.3,
            inline=rng.random() < 0.15, rewrite=rng.random() < 0.4,
            cancel=rng.choices([None, "submit", "wait"], weights=[6, 1, 1])[0],
            host_delay=rng.random() * 0.003 if rng.random() < 0.5 else 0.0,
            gpu_sleep=rng.randint(10_000, 2_000_000) if HAS_CUDA and rng.random() < 0.4 else 0, hot=hot))
    return plan


def draw_policy_for(rng: random.Random, ti: int) -> tuple:
    oob = rng.choice(["zero", "row0", "neg_zero"])
    if TABLES[ti].encoding != "raw":
        return None, oob, rng.choice([None, None, rng.choice(FLOATS)])
    return rng.choice([None, None, 16.0, -0.75, 3.3]), oob, rng.choice([None, None, rng.choice(FLOATS)])


# ------------------------------------------------------------------ running a schedule
@dataclass
class InFlight:
    plan: PassPlan
    ids: torch.Tensor  # the ids as submitted (a contiguous copy, never rewritten): the reference's
    key: tuple
    outs: dict
    job: object = None
    copy: str = "absent"  # absent | job | rows | inline | cancelled | closed | refused_closed
    cancelled: bool | None = None
    snaps: dict = field(default_factory=dict)


class Runner:
    """Runs schedules, keeps the out-buffer pool across them and counts what happened."""

    def __init__(self, tables: list[Table], delays: WorkerDelays) -> None:
        self.tables = tables
        self.delays = delays
        self.pool: dict = {}
        self.count: Counter = Counter()
        self.depths: Counter = Counter()
        self.side = torch.cuda.Stream(DEVICE) if HAS_CUDA else None

    # ---- one schedule
    def run(self, plan: SchedulePlan) -> None:
        self.delays.p, self.delays.stall = plan.slow, plan.stall
        table = self.tables[plan.table]
        self.plan, self.table = plan, table
        self.copy = None  # the copy backend of an admission/close schedule
        if plan.mode != "pipeline":
            self.copy = table.new_copy(plan.passes[0].key, max_in_flight=plan.max_in_flight,
                                       admission_timeout=plan.admission_timeout)
        self.in_flight: list[InFlight] = []
        self.done: list[InFlight] = []
        self.untouched: list[torch.Tensor] = []  # outs of refused submits, snapshotted: still poison
        self.close_begun = False
        self.closer: threading.Thread | None = None
        self.close_error: list = []
        refused = self.count["admission_refused"]
        ctx = torch.cuda.stream(self.side) if plan.side_stream else contextlib.nullcontext()
        with ctx:
            submitted = 0
            while submitted < len(plan.passes) or self.in_flight:
                if plan.mode == "close" and not self.close_begun and submitted == plan.close_after:
                    self.begin_close()
                if submitted < len(plan.passes) and len(self.in_flight) < plan.depth:
                    self.submit(plan.passes[submitted])
                    submitted += 1
                    self.depths[len(self.in_flight)] += 1
                    continue
                self.consume(self.in_flight.pop(0))
            if plan.mode == "close":
                self.finish_close()
            settle(plan.describe())
        self.verify()
        self.count["schedules"] += 1
        self.count[f"mode_{plan.mode}"] += 1
        if self.copy is not None:
            assert self.copy.stats().get("overloaded", 0) == self.count["admission_refused"] - refused
            self.copy.close(timeout=WAIT_S)
            table.fresh.remove(self.copy)
            self.copy = None

    def take_out(self, key, shape, dtype, reuse: bool) -> torch.Tensor:
        free = self.pool.get(key)
        if free and reuse:
            self.count["outs_reused"] += 1
            return poison(free.pop())  # poisoned in stream order before the new pass is submitted
        return poison(torch.empty(shape, dtype=dtype, device=DEVICE))

    def submit(self, p: PassPlan) -> None:
        t = self.table
        paths = t.paths(p.key)
        names = list(paths) if self.copy is None else ["copy"] + [n for n in paths if n != "copy"]
        spec = paths["uva"].spec
        c0, c1 = spec.columns(p.columns)
        shape = (*p.ids.shape, c1 - c0)
        outs = {n: self.take_out((t.index, shape, spec.output_dtype, n), shape, spec.output_dtype, p.reuse < 0.7)
                for n in names}
        f = InFlight(p, p.ids.contiguous().clone(), p.key, outs)
        # the ids each path gets, with the planned strides (clone and to() keep them), rewritten after the submit
        dev_ids = p.ids.to(DEVICE) if HAS_CUDA else p.ids.clone()
        copy_ids = p.ids.clone() if (not HAS_CUDA or p.copy_cpu_ids) else dev_ids
        copy = self.copy if self.copy is not None else paths.get("copy")
        if copy is not None:
            self.submit_copy(f, copy, copy_ids, outs["copy"], p)
            if p.cancel == "submit" and f.job is not None:
                self.cancel(f)
        split_ids = p.ids.clone()  # the scheduler's host ids, as lookup_split takes them
        for name in names:
            if name == "split" and p.columns is None:
                # host ids, the GPU's share of them (from the pass's reuse draw: 0, 1/4 .. all) gathered on the
                # GPU, the rest by this thread into pinned staging; a column range is lookup()'s alone
                paths[name].lookup_split(split_ids, outs[name], gpu_share=round(p.reuse * 4) / 4)
                self.count["lookups_split_host_ids"] += 1
            elif name != "copy":
                paths[name].lookup(dev_ids, outs[name], columns=p.columns)
                self.count[f"lookups_{name}"] += 1
        if p.rewrite:  # the next pass reusing the ids buffers, right after the submit
            dev_ids.copy_(p.junk.to(dev_ids.device))
            if copy_ids is not dev_ids:
                copy_ids.copy_(p.junk)
            split_ids.copy_(p.junk)
            self.count["ids_rewritten"] += 1
        if p.hot is not None:
            if p.hot[0] == "refresh":
                t.hot.refresh()
            else:
                t.hot.set_rows(torch.tensor(p.hot[1], dtype=torch.int64, device=DEVICE))
            self.count[f"hot_{p.hot[0]}"] += 1
        self.in_flight.append(f)

    def submit_copy(self, f: InFlight, copy, ids, out, p: PassPlan) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            t0 = time.monotonic()
            try:
                if p.inline:
                    got = copy.lookup(ids, out, columns=p.columns)
                    assert got is out
                    f.copy = "inline"
                    self.count["copy_inline"] += 1
                else:
                    f.job = copy.submit(ids, out, columns=p.columns)
                    f.copy = "job"
                    self.count["copy_jobs"] += 1
                took = time.monotonic() - t0
                if not p.inline:  # admitted within the bound (a refusal comes at its end)
                    assert took < copy.admission_timeout + SLACK_S, f"admitted after {took:.3g} s"
                if took > 0.001 and self.plan.mode == "admission":
                    self.count["submit_waited_over_1ms"] += 1
                return
            except CopyBackendOverloaded:
                waited = time.monotonic() - t0
                assert waited < copy.admission_timeout + SLACK_S, f"refused after {waited:.3g} s"
                self.count["admission_refused"] += 1
                self.untouched.append(out.clone())  # stream order: what the refused submit left in out
                if self.in_flight:  # the documented remedy: finish an earlier pass, then submit again
                    self.consume(self.in_flight.pop(0))
                elif time.monotonic() > deadline:
                    raise AssertionError(f"no copy slot came free within {WAIT_S} s with nothing in flight") \
                        from None
                else:
                    time.sleep(1e-3)  # consumed passes' copies still running on the GPU
            except BackendClosed:
                assert self.close_begun, "BackendClosed before the close"
                f.copy = "refused_closed"
                self.count["copy_refused_closed"] += 1
                return

    def cancel(self, f: InFlight) -> None:
        f.cancelled = f.job.cancel()
        self.count["cancel_true" if f.cancelled else "cancel_false"] += 1

    def consume(self, f: InFlight) -> None:
        p = f.plan
        if p.host_delay:
            time.sleep(p.host_delay)
        if p.cancel == "wait" and f.job is not None and f.cancelled is None:
            self.cancel(f)
        if f.job is not None:
            try:
                got = f.job.wait(timeout=WAIT_S)  # a CopyTimeout here is a hang: it fails the test
                assert f.cancelled is not True, f"copy job {f.job.seq}: cancel() said True, wait() returned rows"
                assert got is f.outs["copy"]
                f.copy = "rows"
            except CopyJobCancelled:
                assert f.cancelled is True, f"copy job {f.job.seq}: CopyJobCancelled, but cancel() said False"
                f.copy = "cancelled"
            except BackendClosed:
                assert self.close_begun and f.cancelled is not True, f"copy job {f.job.seq}: BackendClosed"
                f.copy = "closed"
                self.count["copy_closed"] += 1
            assert f.job.done
        if HAS_CUDA and p.gpu_sleep:
            torch.cuda._sleep(p.gpu_sleep)  # a slow consumer: its reads land late
        # the model's reads, in stream order (asynchronous on CUDA); the buffers go back to the pool at once,
        # so a pass submitted next may reuse them while these reads are still queued (WAR)
        f.snaps = {name: out.clone() for name, out in f.outs.items()}
        for name, out in f.outs.items():
            self.pool.setdefault((self.table.index, tuple(out.shape), out.dtype, name), []).append(out)
        f.job = None  # the job holds the backend: let it go
        self.done.append(f)
        self.count["passes"] += 1

    # ---- closing in the middle
    def begin_close(self) -> None:
        self.close_begun = True
        self.count["closes"] += 1
        if self.plan.close_on_thread:
            def close() -> None:
                try:
                    self.copy.close(timeout=WAIT_S)
                except BaseException as e:  # noqa: BLE001 - reported by finish_close
                    self.close_error.append(e)

            self.closer = threading.Thread(target=close, name="equivalence-closer")
            self.closer.start()
        else:
            t0 = time.monotonic()
            self.copy.close(timeout=WAIT_S)
            assert time.monotonic() - t0 < WAIT_S + SLACK_S

    def finish_close(self) -> None:
        if not self.close_begun:  # closing after the last submit found nothing in flight
            self.begin_close()
        b = self.copy
        if self.closer is not None:
            self.closer.join(WAIT_S + SLACK_S)
            assert not self.closer.is_alive(), "close() on another thread did not return"
            assert not self.close_error, self.close_error
        assert b.closed and not b._worker.is_alive()
        st = b.stats()
        assert st["pending"] == 0 and st["inline_running"] == 0 and st["slots_busy"] == 0, st
        assert b._host_block is None and b._slots == []
        assert not b.health().healthy and b.progress().closed
        with pytest.raises(BackendClosed):
            b.submit(torch.zeros(1, dtype=torch.int64))
        self.count["close_jobs_closed"] += sum(1 for f in self.done if f.copy in ("closed", "refused_closed"))
        self.count["close_jobs_kept_rows"] += sum(1 for f in self.done if f.copy in ("rows", "inline"))

    # ---- the bits
    def verify(self) -> None:
        plan = self.plan
        for f in self.done:
            want = self.table.reference(f.ids, f.key, f.plan.columns)
            for name, snap in f.snaps.items():
                if name == "copy" and f.copy not in ("rows", "inline"):
                    assert is_poisoned(snap), f"{plan.describe()}: copy job ended {f.copy} but wrote its out"
                    continue
                g, w = bits(snap), bits(want)
                assert g.shape == w.shape and torch.equal(g, w), (
                    f"{plan.describe()}: {name} differs from the reference at {(g != w).nonzero()[:4].tolist()} "
                    f"(ids {f.ids.tolist()}, policy {f.key}, columns {f.plan.columns}, copy {f.copy})")
                self.count["compared"] += 1
            if f.copy == "cancelled":
                self.count["copy_cancelled"] += 1
        for snap in self.untouched:
            assert is_poisoned(snap), f"{plan.describe()}: a submit refused at admission wrote its out"
        self.count["max_depth"] = max(self.count["max_depth"], plan.depth)


def host_state() -> dict:
    """What holds host memory, registrations or threads in this process, by the library's own accounting."""
    return {"regions": set(_region.live_regions()),  # mapped host tables (and their registrations)
            "workers": {t for t in threading.enumerate() if t.name == "uvaple-copy-worker"},
            "backends": {id(b) for b in copy_worker.live_backends.items()}}  # not yet closed


def leftovers(before: dict) -> dict:
    """What was made since ``before`` and is still there (the regions with their registered chunks)."""
    now = host_state()
    left = {k: now[k] - before[k] for k in now}
    return {k: v for k, v in left.items() if v}


# what the schedules must have done at least once (timing-dependent ones included: a cancel that comes in
# time, a refused admission, a job failed by a close, a job launched before it)
EXERCISED = ["cancel_true", "cancel_false", "copy_cancelled", "admission_refused", "submit_waited_over_1ms",
             "closes", "copy_closed", "copy_refused_closed", "close_jobs_kept_rows", "copy_inline", "ids_rewritten",
             "outs_reused", "hot_set", "hot_refresh", "mode_pipeline", "mode_admission", "mode_close"]


def check_shared_backends(tables: list[Table]) -> None:
    """The shared copy backends: every slot back, none leaked, nothing failed but the cancelled jobs."""
    for t in tables:
        for copy in t.copies():
            st = copy.stats()
            assert st["pending"] == 0 and st["slots_busy"] == 0 and st.get("slots_leaked", 0) == 0, st
            assert st.get("failed", 0) == st.get("cancelled", 0), st
            assert st.get("launched", 0) + st.get("failed", 0) == st.get("submitted", 0), st
            health = copy.health()
            assert health.healthy and health.outstanding == 0 and copy.progress().outstanding == 0, health


def wait_for(cond, what: str, detail=lambda: "", timeout: float = WAIT_S) -> None:
    """Poll ``cond()`` (collecting garbage in between) until it is true, bounded; else fail with ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s {detail()}")
        gc.collect()
        time.sleep(0.01)


def run_schedules(first_seed: int, schedules: int, record_property) -> None:
    """``schedules`` schedules from ``first_seed``, each checked; then everything back to the baseline."""
    gc.collect()
    before = host_state()
    t_start = time.monotonic()
    delays = WorkerDelays()
    tables = [Table(i, kind, delays) for i, kind in enumerate(TABLES)]
    regions = [t.table._region for t in tables]
    table_refs = [weakref.ref(t.table) for t in tables]
    runner = Runner(tables, delays)
    try:
        for seed in range(first_seed, first_seed + schedules):
            if time.monotonic() - t_start > DEADLINE_S:
                break
            plan = make_plan(seed)
            try:
                runner.run(plan)
            except Exception as e:
                raise AssertionError(f"schedule {plan.describe()}: {e!r}") from e
        settle("the last schedules")
        check_shared_backends(tables)
    finally:
        refs = table_refs + [r for t in tables for r in t.refs]
        count, depths = runner.count, runner.depths
        for t in tables:
            t.close()
        del t, tables, runner
    summary = dict(count, depths={str(k): v for k, v in sorted(depths.items())}, device=str(DEVICE),
                   seconds=round(time.monotonic() - t_start, 1), requested=schedules,
                   first_seed=first_seed)
    line = json.dumps(summary, sort_keys=True)
    print(f"equivalence summary: {line}")
    record_property("equivalence", line)
    if SUMMARY_PATH:
        with open(SUMMARY_PATH, "w") as fh:
            fh.write(line + "\n")
    wait_for(lambda: all(r() is None for r in refs), "the tables, copy backends and their staging were not collected")
    assert all(r.released and not r.chunks for r in regions), regions  # unmapped and unregistered
    wait_for(lambda: not leftovers(before), "host memory, registrations and workers did not return to the baseline",
             lambda: leftovers(before))
    ran = count["schedules"]
    assert ran == schedules or (DEADLINE_S < float("inf") and ran > 0), (ran, schedules)
    if ran >= 40:  # enough schedules for every feature to have happened: none may be dead code
        dead = [k for k in EXERCISED if not count[k]] + ([] if depths[MAX_DEPTH] else [f"depth {MAX_DEPTH}"])
        assert not dead, f"never exercised: {dead}"


@pytest.mark.timeout(backstop_s(N_SCHEDULES), method="thread")
def test_random_schedules_agree(record_property):
    run_schedules(FIRST_SEED, N_SCHEDULES, record_property)


@pytest.mark.extended
@pytest.mark.skipif("UVAPLE_EQUIV_SCHEDULES" in os.environ, reason="test_random_schedules_agree runs the schedules "
                    "UVAPLE_EQUIV_SCHEDULES asks for")
@pytest.mark.timeout(backstop_s(FULL_SCHEDULES), method="thread")
def test_random_schedules_agree_in_full(record_property):
    """Today's CI count: 60 schedules from seed 0, every feature exercised (the default set runs the first 6)."""
    run_schedules(0, FULL_SCHEDULES, record_property)


@pytest.mark.timeout(300)
def test_wide_rows_agree():
    data = (torch.randn(9, 8960, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16)
    data[data == 0] = 1.25
    with HostTable.from_tensor(data) as table:
        ids = torch.tensor([[4, -1], [9, 0]], dtype=torch.int64)
        for kw in (dict(oob="zero"), dict(oob="row0", scale=16.0, columns=(256, 8960 - 1))):
            policy = {k: v for k, v in kw.items() if k != "columns"}
            want = reference_gather(data, ids, **kw)
            for k in ("copy", "uva", "device"):
                with make_lookup(k, table, device=DEVICE, max_rows=8, column_block=1, **policy) as b:
                    got = b.lookup(ids.to(DEVICE), columns=kw.get("columns"))
                    assert torch.equal(bits(got), bits(want)), b.kind

"""CopyBackend on CPU: exact results, and the job protocol (seed 000's five rules, seed 004's WAR rule).

Numerics run the real worker with the synchronous CPU device operations. The protocol tests swap in
``FakeAsyncOps``: streams are queues whose work (copies, event records, waits) runs only when the test
says, in an order that respects every wait — so slot ownership, the WAR wait, failure delivery, admission
and shutdown are checked deterministically, without a GPU.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from uvaple.integration.errors import (
    BackendClosed,
    BackendError,
    CopyBackendOverloaded,
    CopyJobCancelled,
    CopyJobFailed,
    CopyRequestTooLarge,
    CopyTimeout,
)
from uvaple.integration.placements import host_gather as cpu_gather
from uvaple.integration.placements.copy import CopyBackend
from uvaple.integration.placements.copy.device_ops import DeviceOps
from uvaple.integration.spec import TableSpec
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable
from uvaple.uva.errors import UvapleError

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {2: torch.int16, 4: torch.int32, 1: torch.uint8}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    g, w = bits(got.cpu()), bits(want.cpu())
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:5].tolist()
        raise AssertionError(f"bits differ at {bad} ({(g != w).sum().item()} elements)")


def random_table(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g, dtype=torch.float32) * 3
    t = t.to(dtype)
    t[t == 0] = 1.5  # never zeros: a zero row must come from the oob policy, not the data
    return t


def random_ids(shape, rows: int, dtype: torch.dtype, seed: int, oob: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, shape, generator=g, dtype=torch.int64)
    if oob and ids.numel():
        flat = ids.view(-1)
        bad = [-1, rows, rows + 7, -(2**31)] + ([2**40, -(2**62), 2**63 - 1] if dtype == torch.int64 else [])
        for k, pos in enumerate(torch.randperm(flat.numel(), generator=g)[: len(bad)].tolist()):
            flat[pos] = bad[k % len(bad)]
    return ids.to(dtype)


def poisoned(shape, dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    bits(out).fill_({1: 0x7F, 2: 0x7F0F, 4: 0x7F80F0F0}[out.element_size()])  # NaN-ish garbage
    return out


# ------------------------------------------------------------------------------ fake device operations
class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: collections.deque = collections.deque()

    def __repr__(self) -> str:
        return f"FakeStream({self.name}, {len(self.ops)} ops)"


class FakeRecord:
    def __init__(self) -> None:
        self.done = False


class FakeEvent:
    def __init__(self) -> None:
        self.latest: FakeRecord | None = None


class FakeAsyncOps(DeviceOps):
    """Asynchronous stand-in for CUDA: work queued on streams runs only in ``run``/``step``."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.streams: list[FakeStream] = []
        self.caller = self.new_stream("caller")
        self.device_ids: list[torch.Tensor] = []  # ids tensors to treat as living on the device

    def current_stream(self):
        return self.caller

    def new_stream(self, name: str | None = None):
        with self.lock:
            s = FakeStream(name or f"s{len(self.streams)}")
            self.streams.append(s)
            return s

    def new_event(self):
        return FakeEvent()

    def record(self, event, stream) -> None:
        with self.lock:
            rec = FakeRecord()
            event.latest = rec
            stream.ops.append(("record", rec))

    def query(self, event) -> bool:
        with self.lock:
            return event.latest is None or event.latest.done

    def wait_event(self, stream, event) -> None:
        with self.lock:
            if event.latest is not None:
                stream.ops.append(("wait", event.latest))

    def enqueue(self, stream, fn) -> None:
        with self.lock:
            stream.ops.append(("fn", fn))

    def needs_d2h(self, ids) -> bool:
        return any(t is ids for t in self.device_ids)

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def alloc_device(self, numel, dtype, stream) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    # test control
    def step(self, stream: FakeStream) -> bool:
        with self.lock:
            if not stream.ops:
                return False
            kind, arg = stream.ops[0]
            if kind == "wait" and not arg.done:
                return False
            stream.ops.popleft()
            if kind == "record":
                arg.done = True
            elif kind == "fn":
                arg()
            return True

    def run(self, *order: FakeStream) -> None:
        """Run everything runnable; streams in ``order`` first and as far as they go (eager copies)."""
        streams = list(order) + [s for s in self.streams if s not in order]
        progress = True
        while progress:
            progress = False
            for s in streams:
                while self.step(s):
                    progress = True

    def pending(self) -> int:
        with self.lock:
            return sum(len(s.ops) for s in self.streams)


def until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


@pytest.fixture
def fake():
    return FakeAsyncOps()


class PausedCallerRecord(FakeAsyncOps):
    """Fake ops that hold thread ``thread_name`` inside its event record on the caller's stream: ``in_window``
    is set once it is there, and it goes on when the test sets ``go``."""

    def __init__(self, thread_name: str):
        super().__init__()
        self.thread_name = thread_name
        self.in_window, self.go = threading.Event(), threading.Event()

    def record(self, event, stream):
        if stream is self.caller and threading.current_thread().name == self.thread_name:
            self.in_window.set()
            self.go.wait(10)
        super().record(event, stream)


def fake_backend(fake: FakeAsyncOps, rows=64, cols=9, dtype=torch.bfloat16, **kw) -> CopyBackend:
    kw.setdefault("max_in_flight", 2)
    kw.setdefault("max_rows", 32)
    kw.setdefault("admission_timeout", 0.0)
    kw.setdefault("close_timeout", 5.0)
    return CopyBackend(random_table(rows, cols, dtype, seed=rows + cols), _ops=fake, **kw)


# ------------------------------------------------------------------------------ numerics (CPU ops)
@pytest.fixture(scope="module")
def cpu_backends():
    made = {}

    def get(dtype, cols, rows=97, **policy):
        """A backend over one table per (dtype, cols, rows), one per policy (scale, oob, out_dtype, ...)."""
        key = (dtype, cols, rows)
        if key not in made:
            made[key] = CopyBackend(random_table(rows, cols, dtype, seed=cols), device="cpu", max_rows=64,
                                    max_in_flight=3, owns_table=True)
        base = made[key]
        if not policy:
            return base
        pkey = key + tuple(sorted(policy.items(), key=lambda kv: kv[0]))
        if pkey not in made:
            made[pkey] = CopyBackend(base.table, device="cpu", max_rows=64, max_in_flight=3, column_block=1,
                                     **policy)
        return made[pkey]

    yield get
    for b in made.values():
        b.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 7, 255])
@pytest.mark.parametrize("oob", ["zero", "row0"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_exact_rows(cpu_backends, dtype, cols, oob, ids_dtype):
    b = cpu_backends(dtype, cols, oob=oob)
    for k, shape in enumerate([(), (1,), (13,), (3, 5), (2, 1, 4), (0,)]):
        ids = random_ids(shape, b.rows, ids_dtype, seed=k)
        out = poisoned((*shape, cols), dtype)
        got = b.lookup(ids, out)
        assert got is out
        assert_bits_equal(got, reference_gather(b.table.tensor, ids, oob=oob))
        assert_bits_equal(b.lookup(ids), reference_gather(b.table.tensor, ids, oob=oob))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [16.0, -0.5, 3.3, 1e-30, -0.0, float("inf"), 2.0**0.5 * 1e38])
@pytest.mark.parametrize("oob", ["zero", "row0"])
def test_scale_exact(cpu_backends, dtype, scale, oob):
    ids = random_ids((4, 6), 97, torch.int64, seed=3)
    for out_dtype in (None, torch.float32, torch.bfloat16, torch.float16):
        b = cpu_backends(dtype, 7, scale=scale, oob=oob, out_dtype=out_dtype)
        want = reference_gather(b.table.tensor, ids, scale=scale, oob=oob, out_dtype=out_dtype)
        out = poisoned(want.shape, want.dtype)
        got = b.lookup(ids, out)
        assert_bits_equal(got, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [(0, 1), (3, 7), slice(2, 5), slice(None, 4), (6, 7)])
def test_column_ranges(cpu_backends, dtype, columns):
    ids = random_ids((9,), 97, torch.int32, seed=5)
    for scale, out_dtype in [(None, None), (16.0, None), (-2.5, torch.float32)]:
        b = cpu_backends(dtype, 7, scale=scale, out_dtype=out_dtype)
        want = reference_gather(b.table.tensor, ids, scale=scale, columns=columns, out_dtype=out_dtype)
        got = b.lookup(ids, poisoned(want.shape, want.dtype), columns=columns)
        assert_bits_equal(got, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_rows_8960(cpu_backends, dtype):
    ids = torch.tensor([[3, -1, 10], [11, 0, 2**33]], dtype=torch.int64)
    for oob in ("zero", "row0"):
        b = cpu_backends(dtype, 8960, rows=11, scale=16.0, oob=oob)
        want = reference_gather(b.table.tensor, ids, scale=16.0, oob=oob, columns=(256, 8960 - 3))
        got = b.lookup(ids, poisoned(want.shape, dtype), columns=(256, 8960 - 3))
        assert_bits_equal(got, want)
        plain = cpu_backends(dtype, 8960, rows=11, oob=oob)
        assert_bits_equal(plain.lookup(ids), reference_gather(b.table.tensor, ids, oob=oob))


@pytest.mark.timeout(60)
def test_parallel_gather_path(cpu_backends):
    """A request above the serial threshold goes through the parallel numba kernel."""
    b = cpu_backends(torch.float32, 255, rows=300)
    ids = random_ids((64,), 300, torch.int64, seed=9)
    with CopyBackend(b.table, device="cpu", max_rows=512) as big:
        ids = random_ids((512,), 300, torch.int64, seed=9)  # 512 * 1020 B > the 8 KiB threshold
        assert_bits_equal(big.lookup(ids), reference_gather(b.table.tensor, ids))
    assert not b.table.closed  # shared table, not owned


# ------------------------------------------------------------------------------ the gather's torch path
# Gathered row sizes the torch path must copy exactly: odd byte counts through uint8 tables (padded rows
# in the host table), 160 bytes (the n-gram PLE rows) as bf16, fp32 and fp8 elements.
ROW_SHAPES = [(torch.uint8, 1), (torch.uint8, 15), (torch.uint8, 17), (torch.bfloat16, 80), (torch.float32, 40),
              (torch.float8_e4m3fn, 160), (torch.uint8, 161)]


def byte_table(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random rows of any table dtype, no zero bytes (a zero row must come from the oob policy)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 120, (rows, cols * itemsize), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def oob_ids(n: int, rows: int, id_base: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` ids of table rows (``id_base`` is row 0's id) with every kind of out-of-range id mixed in."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g, dtype=torch.int64) + id_base
    bad = [id_base - 1, id_base + rows, id_base + rows + 7, -1, -(2**31), 2**31 - 1]
    if dtype == torch.int64:
        bad += [2**40, -(2**62), 2**63 - 1, -(2**63), id_base - 2**63 + 5]
    bad = [b for b in bad if not id_base <= b < id_base + rows]
    for k, pos in enumerate(torch.randperm(n, generator=g)[: len(bad)].tolist()):
        ids[pos] = bad[k]
    return ids.to(dtype)


def zero_element(dtype: torch.dtype, negative: bool) -> np.ndarray:
    """The zero element the backend stages: +0.0, or -0.0 (sign bit) for float dtypes."""
    z = np.zeros(torch.empty((), dtype=dtype).element_size(), dtype=np.uint8)
    if negative and dtype.is_floating_point:
        z[-1] = 0x80
    return z


class IndexSelectCalls:
    """``torch.index_select`` patched to count its calls (the torch path's copy)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = torch.index_select

        def counting(*args, **kw):
            self.calls += 1
            return real(*args, **kw)

        monkeypatch.setattr(torch, "index_select", counting)


def gather_bytes(path: str, table: np.ndarray, ids: np.ndarray, nbytes: int, byte_start: int, oob_row0: bool,
                 zero: np.ndarray, id_base: int) -> tuple[int, np.ndarray]:
    out = np.full((len(ids), nbytes), 0xA5, dtype=np.uint8)  # poisoned staging
    row_ids = np.full(len(ids) + 3, -7, dtype=np.int64)  # a slot's buffer, longer than the call
    bad = cpu_gather.cpu_gather(table, ids, out, byte_start, oob_row0, zero, id_base=id_base,
                                row_ids=row_ids, path=path)
    return bad, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,cols", ROW_SHAPES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("oob", ["zero", "neg_zero", "row0"])
def test_torch_path_stages_the_numba_bytes(monkeypatch, dtype, cols, ids_dtype, oob):
    """The torch path writes exactly the bytes of the numba kernels (and of an independent numpy
    gather), returns the same count, and does its copy with index_select: under oob='row0' also with
    out-of-range ids; under oob='zero' those calls are numba's."""
    calls = IndexSelectCalls(monkeypatch)
    rows = 37
    t = byte_table(rows, cols, dtype, seed=cols)
    table = HostTable.from_tensor(t)
    try:
        tb = table.bytes_view()  # padded rows, as the backend reads them
        isz = t.element_size()
        zero = zero_element(dtype, oob == "neg_zero")
        oob_row0 = oob == "row0"
        cases = 0
        for id_base in (0, 5, 2**40):
            for c0, c1 in [(0, cols), (cols // 3, cols), (0, max(1, cols - 2)), (cols - 1, cols)]:
                byte_start, nbytes = c0 * isz, (c1 - c0) * isz
                for n, with_oob in [(0, False), (1, False), (53, False), (53, True), (2, True)]:
                    ids_t = (oob_ids(n, rows, id_base, ids_dtype, seed=n + c0) if with_oob else
                             (torch.randint(0, rows, (n,), dtype=torch.int64) + id_base).to(ids_dtype))
                    if ids_dtype == torch.int32 and id_base >= 2**31:
                        continue  # int32 ids cannot name these rows
                    ids = ids_t.numpy()
                    r = ids.astype(np.int64) - id_base
                    valid = (r >= 0) & (r < rows)
                    want = tb[np.where(valid, r, 0), byte_start:byte_start + nbytes].copy()
                    if not oob_row0:
                        want[~valid] = np.resize(zero, nbytes)
                    before = calls.calls
                    got = {p: gather_bytes(p, tb, ids, nbytes, byte_start, oob_row0, zero, id_base)
                           for p in ("serial", "parallel", "prefetch", "torch")}
                    assert calls.calls - before == (1 if oob_row0 or valid.all() else 0)
                    for p, (bad, out) in got.items():
                        assert bad == int((~valid).sum()), p
                        np.testing.assert_array_equal(out, want, err_msg=f"{p} path, ids {ids}")
                    cases += 1
        assert cases >= 40
    finally:
        table.close()


def torch_path_everywhere(m: pytest.MonkeyPatch) -> None:
    """Every gather with a row_ids buffer takes the torch path (whatever its size or row length)."""
    m.setattr(cpu_gather, "TORCH_MIN_BYTES", 0)
    m.setattr(cpu_gather, "TORCH_MAX_ROW_BYTES", 1 << 40)
    m.setattr(cpu_gather, "_numba_threads", lambda: 1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,cols", ROW_SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_torch_path_lookups_equal_numba_lookups(monkeypatch, dtype, cols):
    """Backend lookups through the torch path equal those through numba and the reference, for every oob
    policy, scale, column range, a row window with an id offset, int32/int64 ids, out-of-range ids of
    every kind, poisoned outputs and empty calls."""
    rows = 41
    t = byte_table(rows, cols, dtype, seed=cols + 1)
    table = HostTable.from_tensor(t)
    policies = [dict(oob="zero"), dict(oob="row0")]
    if dtype in DTYPES:
        policies += [dict(oob="neg_zero"), dict(oob="zero", scale=-2.0), dict(oob="neg_zero", scale=-0.5),
                     dict(oob="row0", scale=3.3), dict(oob="zero", scale=float("inf"))]
    calls = IndexSelectCalls(monkeypatch)
    try:
        for policy in policies:
            for base, lo, hi in [(0, 0, rows), (1000, 3, 30)]:
                window = {} if base == 0 else dict(row_window=(lo, hi), id_offset=base)
                spec = TableSpec.of(table, column_block=1, **policy, **window)
                with (CopyBackend(table, device="cpu", spec=spec, max_rows=300, max_in_flight=2) as numba_b,
                      CopyBackend(table, device="cpu", spec=spec, max_rows=300, max_in_flight=2) as torch_b):
                    for k, (shape, ids_dtype) in enumerate([((0,), torch.int64), ((1,), torch.int32),
                                                            ((7, 3), torch.int64), ((300,), torch.int32),
                                                            ((2, 150), torch.int64)]):
                        ids = oob_ids(int(np.prod(shape)), rows, base, ids_dtype, seed=k).reshape(shape)
                        clean = (torch.randint(lo, hi, shape, dtype=torch.int64) + base).to(ids_dtype)
                        for cols_arg in (None, (cols // 2, cols)):
                            for id_set in (ids, clean):
                                want = reference_gather(t, id_set, columns=cols_arg, rows=(lo, hi), id_base=base,
                                                        **policy)
                                before = calls.calls
                                # the module's thresholds: numba (these calls are small)
                                got = numba_b.lookup(id_set, poisoned(want.shape, want.dtype), columns=cols_arg)
                                assert_bits_equal(got, want)
                                assert calls.calls == before
                                with monkeypatch.context() as m:
                                    torch_path_everywhere(m)
                                    got = torch_b.lookup(id_set, poisoned(want.shape, want.dtype),
                                                         columns=cols_arg)
                                assert_bits_equal(got, want)
                                r = id_set.to(torch.int64) - base
                                takes_torch = id_set.numel() and (policy["oob"] == "row0" or
                                                                  bool(((r >= lo) & (r < hi)).all()))
                                assert calls.calls - before == (1 if takes_torch else 0)
                    assert numba_b.stats()["out_of_range_ids"] == torch_b.stats()["out_of_range_ids"] > 0
    finally:
        table.close()


@pytest.mark.timeout(60)
def test_torch_path_taken_above_its_threshold(monkeypatch):
    """The backend's gather takes the torch path exactly from TORCH_MIN_BYTES, for rows up to
    TORCH_MAX_ROW_BYTES, while torch has as many threads as numba."""
    calls = IndexSelectCalls(monkeypatch)
    monkeypatch.setattr(cpu_gather, "_numba_threads", lambda: 1)
    monkeypatch.setattr(cpu_gather, "TORCH_MIN_BYTES", 64 * 160)
    monkeypatch.setattr(cpu_gather, "TORCH_MAX_ROW_BYTES", 160)
    t = byte_table(500, 80, torch.bfloat16, seed=3)  # 160-byte rows
    wide = byte_table(500, 81, torch.bfloat16, seed=4)  # 162-byte rows: above the row bound
    with (CopyBackend(t, device="cpu", max_rows=256, column_block=40) as b,
          CopyBackend(wide, device="cpu", max_rows=256) as w):
        for n, taken in [(63, 0), (64, 1), (256, 1)]:
            ids = torch.randint(0, 500, (n,))
            before = calls.calls
            assert_bits_equal(b.lookup(ids), reference_gather(t, ids))
            assert calls.calls - before == taken, n
            assert cpu_gather.gather_path(n, 160) == ("torch" if taken else "parallel")
            before = calls.calls
            assert_bits_equal(w.lookup(ids), reference_gather(wide, ids))
            assert calls.calls == before  # long rows stay on numba
        before = calls.calls
        b.lookup(torch.randint(0, 500, (127,)), columns=(0, 40))  # 127 * 80 bytes: below the threshold
        assert calls.calls == before
        # torch on fewer threads than numba (OMP_NUM_THREADS=1 under numba's pool): numba, the prefetching
        # gather from PREFETCH_MIN_BYTES (whole rows; a column range on the parallel one)
        monkeypatch.setattr(cpu_gather, "_numba_threads", lambda: torch.get_num_threads() + 1)
        monkeypatch.setattr(cpu_gather, "PREFETCH_MIN_BYTES", 200 * 160)
        real, runs = cpu_gather._prefetch_kernel(), []
        monkeypatch.setattr(cpu_gather, "_prefetch_kernel", lambda: lambda *a: (runs.append(1), real(*a))[1])
        for n, kernel in [(199, "parallel"), (256, "prefetch")]:
            ids = torch.randint(-3, 503, (n,))
            assert cpu_gather.gather_path(n, 160) == kernel
            assert_bits_equal(b.lookup(ids), reference_gather(t, ids))
            assert_bits_equal(b.lookup(ids, columns=(40, 80)), reference_gather(t, ids, columns=(40, 80)))
            assert calls.calls == before and len(runs) == (kernel == "prefetch"), n


def test_torch_path_bounds_follow_the_tuning_log():
    """The shipped bounds: 160-byte rows from 1 MiB on torch (where it won on the H200 host, its fixed cost
    included), rows above the bound (17,920-byte E4B rows among them) on numba, the serial kernel below
    PARALLEL_MIN_BYTES."""
    assert cpu_gather.TORCH_MIN_BYTES >= cpu_gather.PARALLEL_MIN_BYTES
    assert 160 <= cpu_gather.TORCH_MAX_ROW_BYTES < 17920
    same_threads = torch.get_num_threads() >= cpu_gather._numba_threads()
    big = cpu_gather.TORCH_MIN_BYTES // 160 + 1
    assert cpu_gather.gather_path(big, 160) == ("torch" if same_threads else "parallel")
    assert cpu_gather.gather_path(big - 2, 160) == "parallel"
    assert cpu_gather.TORCH_MIN_BYTES < cpu_gather.PREFETCH_MIN_BYTES  # where both numba gathers were timed
    assert cpu_gather.gather_path(4096, 17920) == "prefetch"  # 70 MiB of E4B rows
    assert cpu_gather.gather_path(cpu_gather.PREFETCH_MIN_BYTES // 17920 - 1, 17920) == "parallel"
    assert cpu_gather.gather_path(1, 160) == "serial"
    with pytest.raises(ValueError, match="path must be"):
        cpu_gather.cpu_gather(np.zeros((2, 16), np.uint8), np.zeros(1, np.int64), np.zeros((1, 16), np.uint8),
                              0, False, np.zeros(1, np.uint8), path="gpu")


@pytest.mark.timeout(60)
def test_cpu_ids_are_snapshotted(cpu_backends):
    b = cpu_backends(torch.bfloat16, 7)
    ids = random_ids((10,), b.rows, torch.int64, seed=1, oob=False)
    want = reference_gather(b.table.tensor, ids)
    job = b.submit(ids)
    ids.fill_(0)  # the caller reuses its ids buffer at once
    assert_bits_equal(job.wait(timeout=5), want)


@pytest.mark.timeout(60)
def test_argument_errors_mutate_nothing(fake):
    b = fake_backend(fake)
    ids = torch.tensor([1, 2])
    bad = [
        dict(ids=ids.float()),
        dict(ids=[1, 2]),
        dict(ids=ids, columns=(5, 3)),
        dict(ids=ids, columns=(0, 10)),
        dict(ids=ids, columns=(2, 5)),  # a range the spec does not allow (whole rows only)
        dict(ids=ids, out=torch.empty(2, 8, dtype=torch.bfloat16)),
        dict(ids=ids, out=torch.empty(2, 9, dtype=torch.float32)),
        dict(ids=ids, out=torch.empty(9, 2, dtype=torch.bfloat16).t()),
    ]
    for kw in bad:
        with pytest.raises((TypeError, ValueError)):
            b.submit(**kw)
    table = b.table
    for policy in [dict(oob="clamp"), dict(out_dtype=torch.int8), dict(scale="2"), dict(column_block=0)]:
        with pytest.raises((TypeError, ValueError)):  # a bad policy is refused once, at construction
            CopyBackend(table, _ops=fake, **policy)
    with pytest.raises(CopyRequestTooLarge, match="max_rows"):
        b.submit(torch.zeros(33, dtype=torch.int64))
    assert fake.pending() == 0 and b.stats()["slots_free"] == 2 and b.stats().get("submitted", 0) == 0
    b.close()


def test_error_hierarchy():
    for e in (CopyBackendOverloaded, CopyTimeout, BackendClosed, CopyJobFailed, CopyJobCancelled,
              CopyRequestTooLarge):
        assert issubclass(e, BackendError) and issubclass(BackendError, UvapleError)


# ------------------------------------------------------------------------------ protocol (fake async ops)
@pytest.mark.timeout(30)
def test_admission_overload_is_deliberate_and_mutates_nothing(fake):
    b = fake_backend(fake, max_in_flight=2)
    j1 = b.submit(torch.tensor([1, 2]))
    j2 = b.submit(torch.tensor([3]))
    until(lambda: j1.done and j2.done)
    queued = fake.pending()
    with pytest.raises(CopyBackendOverloaded, match="max_in_flight"):
        b.submit(torch.tensor([4]))
    assert fake.pending() == queued  # no event recorded, nothing queued by the refused job
    assert b.stats()["overloaded"] == 1 and b.stats()["slots_busy"] == 2
    fake.run()
    j3 = b.submit(torch.tensor([4]))  # slots reclaimed once the copies completed
    until(lambda: j3.done)
    fake.run()
    for job, ids in ((j1, [1, 2]), (j2, [3]), (j3, [4])):
        assert_bits_equal(job.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor(ids)))
    b.close()


@pytest.mark.timeout(30)
def test_admission_waits_bounded_for_a_slot(fake):
    b = fake_backend(fake, max_in_flight=1, admission_timeout=5.0)
    j1 = b.submit(torch.tensor([1]))
    until(lambda: j1.done)
    timer = threading.Timer(0.2, fake.run)
    t0 = time.monotonic()  # before the timer starts: its slot cannot free sooner than 0.2 s after this
    timer.start()
    j2 = b.submit(torch.tensor([2]))  # waits for j1's copy to complete, then gets its slot
    assert 0.15 < time.monotonic() - t0 < 4.0
    timer.join()
    until(lambda: j2.done)
    fake.run()
    assert_bits_equal(j2.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([2])))
    b.admission_timeout = 0.2
    j3 = b.submit(torch.tensor([3]))
    t0 = time.monotonic()
    with pytest.raises(CopyBackendOverloaded):
        b.submit(torch.tensor([4]))
    assert time.monotonic() - t0 < 2.0
    until(lambda: j3.done)
    fake.run()
    b.close()


@pytest.mark.timeout(30)
def test_slot_owned_until_its_copy_completes(fake):
    """Staging of job A is not reused while A's copy has not run, even when B, C... come along."""
    b = fake_backend(fake, max_in_flight=2)
    ref = lambda ids: reference_gather(b.table.tensor, torch.tensor(ids))  # noqa: E731
    outs = [poisoned((3, 9), torch.bfloat16) for _ in range(4)]
    ja = b.submit(torch.tensor([1, 2, 3]), outs[0])
    jb = b.submit(torch.tensor([4, 5, 6]), outs[1])
    until(lambda: ja.done and jb.done)
    assert ja._slot is not jb._slot
    with pytest.raises(CopyBackendOverloaded):
        b.submit(torch.tensor([7, 8, 9]), outs[2])
    # complete A's copy only: A's slot comes back, B's stays owned by B
    copy = b._copy_stream
    assert fake.step(fake.caller)  # A's submit point
    for _ in range(3):  # wait(S_A), A's copy, record(D_A)
        assert fake.step(copy)
    assert fake.query(ja._slot.done_event) and not fake.query(jb._slot.done_event)
    slot_a, slot_b = ja._slot, jb._slot
    jc = b.submit(torch.tensor([7, 8, 9]), outs[2])
    assert jc._slot is slot_a and jb._slot is slot_b
    until(lambda: jc.done)
    fake.run()
    assert_bits_equal(outs[0], ref([1, 2, 3]))
    assert_bits_equal(outs[1], ref([4, 5, 6]))
    assert_bits_equal(outs[2], ref([7, 8, 9]))
    b.close()


@pytest.mark.timeout(30)
def test_each_job_has_its_own_event(fake):
    b = fake_backend(fake, max_in_flight=3)
    jobs = [b.submit(torch.tensor([i])) for i in range(3)]
    until(lambda: all(j.done for j in jobs))
    events = [j._slot.done_event for j in jobs]
    assert len({id(e) for e in events}) == 3
    recs = [e.latest for e in events]
    assert len({id(r) for r in recs}) == 3 and not any(r.done for r in recs)
    fake.run()
    b.close()


@pytest.mark.timeout(30)
def test_war_copy_waits_for_readers_enqueued_before_submit(fake):
    """Seed 004: a reused ``out`` is not overwritten while the model stream still reads it."""
    b = fake_backend(fake, max_in_flight=2)
    out = poisoned((2, 9), torch.bfloat16)
    ids_a, ids_b = torch.tensor([1, 2]), torch.tensor([3, 4])
    seen = []
    ja = b.submit(ids_a, out)
    ja.wait(timeout=5)  # the caller stream now waits on A's copy
    fake.enqueue(fake.caller, lambda: seen.append(out.clone()))  # a slow reader of A's rows
    jb = b.submit(ids_b, out)  # pass B reuses the buffer
    until(lambda: jb.done)
    fake.run(b._copy_stream)  # copies as eager as they can be: B's copy must still wait for the reader
    fake.run(b._copy_stream)
    jb.wait(timeout=5)
    fake.enqueue(fake.caller, lambda: seen.append(out.clone()))
    fake.run(b._copy_stream)
    assert len(seen) == 2
    assert_bits_equal(seen[0], reference_gather(b.table.tensor, ids_a))
    assert_bits_equal(seen[1], reference_gather(b.table.tensor, ids_b))
    b.close()


@pytest.mark.timeout(30)
def test_failure_delivered_to_its_job_while_earlier_job_is_stuck(fake):
    b = fake_backend(fake, max_in_flight=3)
    ja = b.submit(torch.tensor([1]))
    until(lambda: ja.done)  # A launched; its copy never completes (stuck GPU)

    def hook(job):
        if job.seq == 2:
            raise RuntimeError("injected gather failure")

    b._fault_hook = hook
    jb = b.submit(torch.tensor([2]))
    t0 = time.monotonic()
    with pytest.raises(CopyJobFailed, match="injected") as ei:
        jb.wait(timeout=5)
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert time.monotonic() - t0 < 4.0
    assert not fake.query(ja._slot.done_event)  # A still stuck
    out_a = ja.wait(timeout=5)  # A's own result is fine
    jc = b.submit(torch.tensor([3]))
    until(lambda: jc.done)
    fake.run()
    assert_bits_equal(out_a, reference_gather(b.table.tensor, torch.tensor([1])))
    assert_bits_equal(jc.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([3])))
    until(lambda: b.stats()["slots_free"] == 3)  # B's slot was released too
    b.close()


@pytest.mark.timeout(30)
def test_launch_failure_delivered_and_slot_released(fake):
    b = fake_backend(fake, max_in_flight=1)
    real = b._launch

    def broken(job, *a):
        if job.seq == 1:
            raise RuntimeError("injected launch failure")
        return real(job, *a)

    b._launch = broken
    with pytest.raises(CopyJobFailed, match="launch"):
        b.submit(torch.tensor([1])).wait(timeout=5)
    fake.run()
    j2 = b.submit(torch.tensor([2]))
    until(lambda: j2.done)
    fake.run()
    assert_bits_equal(j2.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([2])))
    b.close()


@pytest.mark.timeout(30)
def test_device_ids_stuck_do_not_block_later_jobs(fake):
    """A job whose (device) ids have not reached the host does not hold up later jobs' failures/results."""
    b = fake_backend(fake, max_in_flight=3, ids_timeout=30.0)
    ids_a = torch.tensor([5, -1, 6])
    fake.device_ids.append(ids_a)
    ja = b.submit(ids_a)
    b._fault_hook = lambda job: (_ for _ in ()).throw(RuntimeError("boom")) if job.seq == 2 else None
    jb = b.submit(torch.tensor([1]))
    jc = b.submit(torch.tensor([2]))
    with pytest.raises(CopyJobFailed, match="boom"):
        jb.wait(timeout=5)
    until(lambda: jc.done)
    assert not ja.done
    fake.run()  # caller stream reaches the submit point: A's ids arrive
    until(lambda: ja.done)
    fake.run()
    assert_bits_equal(ja.wait(timeout=5), reference_gather(b.table.tensor, ids_a))
    assert_bits_equal(jc.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([2])))
    b.close()


@pytest.mark.timeout(30)
def test_device_ids_timeout_is_bounded_and_slot_kept_until_copy_done(fake):
    b = fake_backend(fake, max_in_flight=1, ids_timeout=0.2)
    ids = torch.tensor([1, 2])
    fake.device_ids.append(ids)
    job = b.submit(ids)
    with pytest.raises(CopyTimeout, match="CUDA ids"):
        job.wait(timeout=5)
    assert b.stats()["slots_busy"] == 1  # the pending ids copy still owns the slot's ids buffer
    fake.run()
    until(lambda: b.stats()["slots_free"] == 1)
    b.close()


@pytest.mark.timeout(30)
def test_wait_is_bounded(fake):
    b = fake_backend(fake)
    gate = threading.Event()
    b._fault_hook = lambda job: gate.wait(10)
    job = b.submit(torch.tensor([1]))
    t0 = time.monotonic()
    with pytest.raises(CopyTimeout, match="not launched"):
        job.wait(timeout=0.2)
    assert time.monotonic() - t0 < 2.0
    gate.set()
    until(lambda: job.done)
    fake.run()
    assert_bits_equal(job.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([1])))
    b.close()


@pytest.mark.timeout(30)
def test_cancel(fake):
    b = fake_backend(fake, max_in_flight=3)
    gate, entered = threading.Event(), threading.Event()

    def hook(job):
        if job.seq == 1:
            entered.set()
            gate.wait(10)

    b._fault_hook = hook
    out1 = poisoned((1, 9), torch.bfloat16)
    j1 = b.submit(torch.tensor([1]), out1)  # held in the gather
    j2 = b.submit(torch.tensor([2]))  # pending
    assert entered.wait(5)
    assert j2.cancel() is True
    with pytest.raises(CopyJobCancelled):
        j2.wait(timeout=5)
    # being gathered: too late to cancel (only jobs not yet started can be); it completes normally
    assert j1.cancel() is False
    gate.set()
    until(lambda: j1.done)
    j3 = b.submit(torch.tensor([3]))
    until(lambda: j3.done)
    assert j3.cancel() is False  # launched: too late
    fake.run()
    assert_bits_equal(j1.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([1])))
    assert j1.wait(timeout=5) is out1
    until(lambda: b.stats()["slots_free"] == 3)
    assert b.stats()["cancelled"] == 1
    b.close()


@pytest.mark.timeout(30)
def test_close_with_pending_jobs_releases_everything(fake):
    b = fake_backend(fake, max_in_flight=4)
    gate, entered = threading.Event(), threading.Event()
    want0 = reference_gather(b.table.tensor, torch.tensor([7]))
    j0 = b.submit(torch.tensor([7]))
    until(lambda: j0.done)  # launched, copy pending

    def hook(job):
        if job.seq == 2:
            entered.set()
            gate.wait(10)

    b._fault_hook = hook
    j1 = b.submit(torch.tensor([1]))  # will be in the gather at close
    j2 = b.submit(torch.tensor([2]))
    j3 = b.submit(torch.tensor([3]))
    assert entered.wait(5)
    closer = threading.Thread(target=b.close)
    closer.start()
    for j in (j2, j3):
        with pytest.raises(BackendClosed):
            j.wait(timeout=5)
    gate.set()
    with pytest.raises(BackendClosed):
        j1.wait(timeout=5)
    time.sleep(0.05)
    fake.run()  # j0's copy completes: its slot can be released
    closer.join(10)
    assert not closer.is_alive()
    st = b.stats()
    assert st["closed"] and not st["worker_alive"] and st["slots_busy"] == 0 and st["abandoned_at_close"] == 0
    assert b._host_block is None and b.table.closed  # the backend owned its table
    assert_bits_equal(j0.wait(timeout=5), want0)  # launched before close: keeps its result
    with pytest.raises(BackendClosed):
        b.submit(torch.tensor([1]))
    b.close()  # idempotent


@pytest.mark.timeout(30)
def test_close_is_bounded_when_gpu_or_worker_is_stuck(fake):
    b = fake_backend(fake, max_in_flight=2)
    j0 = b.submit(torch.tensor([1]))
    until(lambda: j0.done)
    gate = threading.Event()
    b._fault_hook = lambda job: gate.wait(10)
    j1 = b.submit(torch.tensor([2]))
    until(lambda: j1.state == "running")
    t0 = time.monotonic()
    with pytest.raises(CopyTimeout, match="did not stop"):
        b.close(timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    assert not b.table.closed  # the stuck worker may still read it
    gate.set()
    with pytest.raises(BackendClosed):
        j1.wait(timeout=5)
    b._worker.join(5)
    assert not b._worker.is_alive()
    b.table.close()


@pytest.mark.timeout(30)
def test_close_gives_up_on_copies_that_never_complete(fake):
    b = fake_backend(fake, max_in_flight=2)
    j0 = b.submit(torch.tensor([1]))
    until(lambda: j0.done)
    t0 = time.monotonic()
    b.close(timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    assert b.stats()["abandoned_at_close"] == 1 and b.closed
    fake.run()  # the stuck copy finishes later: its job still holds what it reads and writes
    assert j0._out is not None


@pytest.mark.timeout(30)
def test_worker_crash_fails_jobs_instead_of_hanging(fake):
    b = fake_backend(fake, max_in_flight=2)

    def crash(job):
        raise SystemExit("worker bug")  # not an Exception: escapes the per-job handler's intent

    b._run = crash
    job = b.submit(torch.tensor([1]))
    with pytest.raises(CopyJobFailed, match="worker died"):
        job.wait(timeout=5)
    with pytest.raises(BackendClosed, match="died"):
        b.submit(torch.tensor([1]))
    b.close()


@pytest.mark.timeout(60)
def test_make_lookup_copy():
    from uvaple.integration import make_lookup

    t = random_table(50, 7, torch.float16, seed=4)
    with make_lookup("copy", t, device="cpu", max_rows=16, scale=16.0) as b:
        assert b.kind == "copy" and b.rows == 50 and b.cols == 7 and b.dtype == torch.float16
        ids = random_ids((4, 4), 50, torch.int32, seed=1)
        assert_bits_equal(b.lookup(ids), reference_gather(t, ids, scale=16.0))
        st = b.stats()
        bad = int(((ids < 0) | (ids >= 50)).sum())
        assert st["lookups"] == 1 and st["rows"] == 16 and st["out_of_range_ids"] == bad
    assert b.table.closed


@pytest.mark.timeout(30)
def test_inline_lookup_keeps_the_protocol(fake):
    """Small CPU-ids lookups run on the caller's thread: still no GPU wait, own slot, WAR wait."""
    b = fake_backend(fake, max_in_flight=2)
    out = poisoned((2, 9), torch.bfloat16)
    ids_a, ids_b = torch.tensor([1, 2]), torch.tensor([3, -4])
    seen = []
    got = b.lookup(ids_a, out)  # returns with the copy still queued (no host wait on the "GPU")
    assert got is out and fake.pending() > 0
    fake.enqueue(fake.caller, lambda: seen.append(out.clone()))
    b.lookup(ids_b, out)
    fake.enqueue(fake.caller, lambda: seen.append(out.clone()))
    with pytest.raises(CopyBackendOverloaded):  # both slots owned until their copies complete
        b.lookup(ids_a)
    fake.run(b._copy_stream)
    assert_bits_equal(seen[0], reference_gather(b.table.tensor, ids_a))
    assert_bits_equal(seen[1], reference_gather(b.table.tensor, ids_b))
    b._fault_hook = lambda job: (_ for _ in ()).throw(RuntimeError("inline boom"))
    with pytest.raises(CopyJobFailed, match="inline boom"):
        b.lookup(ids_a)
    assert b.stats()["launched"] == 2
    fake.run()
    b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("big", [False, True], ids=["inline", "worker"])
def test_inference_mode_outputs(big):
    """Under torch.inference_mode an inference-tensor ``out`` is written by the worker thread too."""
    t = random_table(300, 255, torch.float32, seed=6)
    table = HostTable.from_tensor(t)
    with (CopyBackend(table, device="cpu", max_rows=512, scale=16.0) as b16,
          CopyBackend(table, device="cpu", max_rows=512, scale=-2.0) as bneg,
          CopyBackend(table, device="cpu", max_rows=512, out_dtype=torch.bfloat16) as bbf):
        n = 400 if big else 5  # 400 * 1020 B: above the inline limit, gathered by the worker
        ids = random_ids((n,), 300, torch.int64, seed=2)
        with torch.inference_mode():
            out = torch.empty(n, 255)
            assert_bits_equal(b16.lookup(ids, out), reference_gather(t, ids, scale=16.0))
            assert_bits_equal(bneg.submit(ids).wait(timeout=10), reference_gather(t, ids, scale=-2.0))
            got = bbf.lookup(ids)
            assert got.is_inference()
            assert_bits_equal(got, reference_gather(t, ids, out_dtype=torch.bfloat16))
    table.close()


# ------------------------------------------------------------------------------ concurrency regressions
@pytest.mark.timeout(30)
def test_cuda_ids_rewritten_after_submit_are_gathered_as_submitted(fake):
    """WAR on CUDA ids: the next pass rewriting a persistent input_ids buffer on the caller's stream
    (after submit) must not change the rows the job gathers, however far the caller's stream runs ahead."""
    b = fake_backend(fake, max_in_flight=2, ids_timeout=30.0)
    ids = torch.tensor([5, 6, 7])  # "CUDA" ids: a persistent input_ids buffer
    fake.device_ids.append(ids)
    want = reference_gather(b.table.tensor, ids.clone())
    job = b.submit(ids)
    fake.enqueue(fake.caller, lambda: ids.copy_(torch.tensor([1, 1, 1])))  # the next pass's input_ids
    fake.run(fake.caller)  # the caller's stream as eager as it can be: its rewrite must wait for the copy
    assert torch.equal(ids, torch.tensor([1, 1, 1]))  # the rewrite did run (nothing blocks the caller)
    until(lambda: job.done)
    fake.run()
    assert_bits_equal(job.wait(timeout=5), want)
    b.close()
    assert b.closed


@pytest.mark.timeout(30)
def test_close_waits_for_an_inline_lookup_and_can_be_retried(fake):
    """close() must not release (unmap) the table under a running inline gather: bounded wait, then
    CopyTimeout with everything left in place; a later close() finishes."""
    table = HostTable.from_tensor(random_table(64, 9, torch.bfloat16, seed=3))  # shared: never unmapped here
    b = CopyBackend(table, _ops=fake, max_in_flight=2, max_rows=32, admission_timeout=0.0)
    entered, gate = threading.Event(), threading.Event()

    def hook(job):
        if threading.current_thread().name == "inline-caller":
            entered.set()
            gate.wait(10)

    b._fault_hook = hook
    res = {}

    def caller():
        try:
            res["out"] = b.lookup(torch.tensor([1, 2]))
        except BaseException as e:  # noqa: BLE001
            res["exc"] = e

    th = threading.Thread(target=caller, name="inline-caller")
    th.start()
    try:
        assert entered.wait(5)
        t0 = time.monotonic()
        with pytest.raises(CopyTimeout, match="inline"):
            b.close(timeout=0.3)
        assert time.monotonic() - t0 < 3.0
        assert not b.closed and b._host_block is not None and not table.closed  # nothing released
        assert b.stats()["inline_running"] == 1
        with pytest.raises(BackendClosed):  # an inline lookup starting after closing began
            b.lookup(torch.tensor([3]))
    finally:
        gate.set()
        th.join(5)
    assert isinstance(res.get("exc"), BackendClosed), res  # its gather ended after closing began
    fake.run()
    b.close()  # retry: nothing runs any more, the release completes
    assert b.closed and b._host_block is None
    assert not table.closed  # shared table: released, not closed
    table.close()


@pytest.mark.timeout(30)
def test_inline_lookup_admitted_while_closing_fails_with_backend_closed(fake):
    """A submitter between admission and the start of its inline gather when close() runs: it must not
    gather (the table may be gone), its job fails with BackendClosed."""

    ops = PausedCallerRecord("late")
    b = fake_backend(ops, max_in_flight=2)
    gathered = []
    b._fault_hook = gathered.append
    res = {}

    def late():
        try:
            res["out"] = b.lookup(torch.tensor([1]))
        except BaseException as e:  # noqa: BLE001
            res["exc"] = e

    th = threading.Thread(target=late, name="late")
    th.start()
    try:
        assert ops.in_window.wait(5)
        b.close(timeout=0.3)  # nothing gathers: releases (the in-window slot is abandoned at the deadline)
        assert b.closed
    finally:
        ops.go.set()
        th.join(5)
    assert isinstance(res.get("exc"), BackendClosed) and gathered == [], res


EXIT_SCRIPT = textwrap.dedent("""
    import torch
    from uvaple.integration.placements.copy import CopyBackend
    torch.manual_seed(0)
    t = torch.randn(20000, 2048).to(torch.bfloat16)
    b = CopyBackend(t, device="cpu", max_rows=8192)  # owns its table
    for _ in range(4):
        b.submit(torch.randint(0, 20000, (8192,)))  # big gathers still running/pending at exit
    print("main exits", flush=True)
""")


@pytest.mark.extended  # ~20 s on 2 cores (the child compiles every numba gather); exits: tests/test_lifetime.py
@pytest.mark.timeout(180)
def test_interpreter_exit_without_close_is_clean():
    """Exit with the worker in a big gather: the table must not be unmapped under it (was a segfault)."""
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", EXIT_SCRIPT], capture_output=True,
                       text=True, timeout=150)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "main exits" in r.stdout
    assert "Traceback" not in r.stderr and "Fatal Python error" not in r.stderr, r.stderr[-3000:]


@pytest.mark.timeout(30)
def test_close_after_a_timeout_finishes_the_release(fake):
    b = fake_backend(fake, max_in_flight=2)
    gate = threading.Event()
    b._fault_hook = lambda job: gate.wait(10)
    j1 = b.submit(torch.tensor([2]))
    until(lambda: j1.state == "running")
    try:
        with pytest.raises(CopyTimeout, match="did not stop"):
            b.close(timeout=0.2)
        assert not b.closed and not b.table.closed
    finally:
        gate.set()
    b._worker.join(5)
    assert not b._worker.is_alive()
    with pytest.raises(BackendClosed):
        j1.wait(timeout=5)
    fake.run()
    b.close()  # the worker stopped: the retry releases everything
    st = b.stats()
    assert b.closed and st["closed"] and st["slots_busy"] == 0 and st["abandoned_at_close"] == 0
    assert b._host_block is None and b.table.closed  # owned table: closed
    b.close()  # idempotent


@pytest.mark.timeout(30)
def test_close_on_the_worker_thread_does_not_deadlock_or_raise(fake):
    b = fake_backend(fake, max_in_flight=2)
    res = {}

    def hook(job):
        fake.run()  # the job's submit point: its slot can be released at once
        try:
            res["ret"] = b.close(timeout=5.0)  # e.g. from a callback running on the worker
        except BaseException as e:  # noqa: BLE001
            res["exc"] = e

    b._fault_hook = hook
    job = b.submit(torch.tensor([1]))
    with pytest.raises(BackendClosed):
        job.wait(timeout=5)
    assert "exc" not in res, res
    until(lambda: b.closed)  # the worker finished the release when it stopped
    assert not b._worker.is_alive() or b._worker is not threading.current_thread()
    b._worker.join(5)
    assert b.table.closed and b._host_block is None
    b.close()  # idempotent


@pytest.mark.timeout(30)
def test_submit_overlapping_worker_death_fails_at_once():
    """The worker dies while a submitter is between admission and queueing its job: the job must fail
    with BackendClosed (cause: the worker's error) at once, not wait out wait_timeout."""

    ops = PausedCallerRecord("submitter")
    b = fake_backend(ops, max_in_flight=2, wait_timeout=2.0)

    def run(job):
        ops.in_window.wait(10)  # the worker dies while the submitter is in its window
        raise SystemExit("worker bug")

    b._run = run
    j1 = b.submit(torch.tensor([1]))
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("job", b.submit(torch.tensor([2]))), name="submitter")
    th.start()
    until(lambda: b._broken is not None)
    ops.go.set()
    th.join(5)
    with pytest.raises(CopyJobFailed, match="worker died"):
        j1.wait(timeout=5)
    t0 = time.monotonic()
    with pytest.raises(BackendClosed, match="died") as ei:
        res["job"].wait(timeout=1.5)
    assert time.monotonic() - t0 < 1.0
    assert isinstance(ei.value.__cause__, SystemExit)
    assert b.stats()["pending"] == 0
    ops.run()
    until(lambda: b.stats()["slots_free"] == 2)  # the slot was released
    b.close()
    assert b.closed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["ids", "done"])
def test_failed_event_record_after_queued_work_keeps_the_slot(which):
    """If recording a job's event fails after its device work was queued, nothing says when that work
    ends: the slot must stay owned (never reused under a copy that may still run)."""

    class Ops(FakeAsyncOps):
        fail_on: FakeStream | None = None

        def record(self, event, stream):
            if stream is self.fail_on:
                self.fail_on = None
                raise RuntimeError("injected record failure")
            super().record(event, stream)

    ops = Ops()
    b = fake_backend(ops, max_in_flight=2, ids_timeout=30.0)
    ids = torch.tensor([1, 2])
    if which == "ids":
        ops.device_ids.append(ids)
        ops.fail_on = b._d2h_stream
        with pytest.raises(RuntimeError, match="injected"):
            b.submit(ids)
    else:
        ops.fail_on = b._copy_stream
        with pytest.raises(CopyJobFailed, match="launch"):
            b.submit(ids).wait(timeout=5)
    ops.run()  # the queued work completes; the slot must still not come back
    time.sleep(0.05)
    st = b.stats()
    assert st["slots_free"] == 1 and st["slots_leaked"] == 1, st
    for k in range(3):  # the other slot keeps working
        j = b.submit(torch.tensor([k]))
        until(lambda j=j: j.done)
        ops.run()
        assert_bits_equal(j.wait(timeout=5), reference_gather(b.table.tensor, torch.tensor([k])))
    t0 = time.monotonic()
    b.close(timeout=5.0)  # does not wait out the timeout for the leaked slot
    assert time.monotonic() - t0 < 2.0
    assert b.closed and b.stats()["abandoned_at_close"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_in_inline_gather_propagates_as_itself(fake, exc):
    b = fake_backend(fake, max_in_flight=2)

    def hook(job):
        raise exc("interrupted")

    b._fault_hook = hook
    with pytest.raises(exc):
        b.lookup(torch.tensor([1]))
    b._fault_hook = None
    fake.run()
    until(lambda: b.stats()["slots_free"] == 2)  # the interrupted job's slot was released
    assert b.stats()["inline_running"] == 0
    got = b.lookup(torch.tensor([4]))
    fake.run()
    assert_bits_equal(got, reference_gather(b.table.tensor, torch.tensor([4])))
    b.close()
    assert b.closed


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("row0", [False, True])
def test_split_rows_maps_a_cpu_share_as_the_policy_says(id_dtype, row0):
    """The split lookup's one pass over its CPU share: the row to stage (the id's, or ``lo`` outside the
    window) and the staged id the device kernel reads (``j``, or -1 outside under zero rows)."""
    from uvaple.integration.placements.host_gather import split_rows

    lo, hi, base = 7, 900, 50
    info = torch.iinfo(id_dtype)
    ids = torch.randint(-100, 1100, (5000,), dtype=torch.int64)
    ids[:6] = torch.tensor([info.min, info.max, base + lo - 1, base + lo, base + hi - 1, base + hi])
    ids = ids.to(id_dtype)
    rows = torch.full((5000,), -7, dtype=torch.int64)
    staged = torch.full((5000,), -7, dtype=torch.int64)
    bad = split_rows(ids.numpy(), base, lo, hi, row0, rows.numpy(), staged.numpy())
    local = ids.to(torch.int64) - base
    ok = (local >= lo) & (local < hi)
    assert bad == int((~ok).sum()) > 0  # counted whatever the policy: row0's staged ids look valid
    assert torch.equal(rows, torch.where(ok, local, lo))
    j = torch.arange(5000)
    assert torch.equal(staged, torch.where(ok | row0, j, -1))
    assert ok[3] and ok[4] and not ok[2] and not ok[5]  # the window's edges are in the data


@pytest.mark.parametrize("host_shape,dev_shape,dtype", [
    ((10, 160), (9, 160), torch.uint8),  # fewer device rows than ids
    ((9, 160), (10, 160), torch.uint8),  # fewer staging rows than ids
    ((10, 160), (10, 176), torch.uint8),  # strides differ
    ((10, 80), (10, 80), torch.int16),  # not byte rows
])
def test_gather_up_refuses_staging_that_cannot_take_the_rows(host_shape, dev_shape, dtype):
    """``gather_up`` copies staged rows by address: staging too small, of another stride or not bytes is
    refused (named) before any row is read or copied."""
    from uvaple.integration.placements.host_gather import gather_up

    table = torch.randint(0, 256, (50, 160), dtype=torch.int32).to(torch.uint8)
    host = torch.full(host_shape, 7, dtype=dtype)
    dev = torch.full(dev_shape, 7, dtype=dtype)
    with pytest.raises(ValueError, match="byte rows of the same stride, at least 10"):
        gather_up(table, torch.arange(10), host, dev, None, 160, 4)
    assert bool((host == 7).all()) and bool((dev == 7).all())


@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_torch_path_takes_in_range_ids_as_they_are(monkeypatch, ids_dtype):
    """No id offset and every id a row: index_select gets the ids themselves, the serial ids pass does
    not run; an offset or one out-of-range id brings the pass back, with the same bytes."""
    table = np.random.default_rng(3).integers(0, 256, (500, 160), dtype=np.uint8)
    zero = np.zeros(160, dtype=np.uint8)
    ids = np.random.default_rng(4).integers(0, 500, 3000).astype(ids_dtype)
    ids[:2] = (0, 499)
    passes = []
    real = cpu_gather._rows_kernel()
    monkeypatch.setattr(cpu_gather, "_rows_kernel", lambda: lambda *a: (passes.append(1), real(*a))[1])
    bad, out = gather_bytes("torch", table, ids, 160, 0, False, zero, 0)
    assert bad == 0 and not passes and np.array_equal(out, table[ids.astype(np.int64)])
    bad, out = gather_bytes("torch", table, ids + 5, 160, 0, False, zero, 5)  # an offset: the pass maps them
    assert bad == 0 and passes == [1] and np.array_equal(out, table[ids.astype(np.int64)])
    ids[7] = 500  # == rows: out of range
    bad, out = gather_bytes("torch", table, ids, 160, 0, True, zero, 0)
    want = table[np.where(ids == 500, 0, ids).astype(np.int64)]
    assert bad == 1 and passes == [1, 1] and np.array_equal(out, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("oob_row0", [False, True])
def test_word_gather_gives_the_byte_gathers_bytes(itemsize, oob_row0):
    """Aligned rows go through the 8-byte word kernels, unaligned ones through the byte kernels: the same
    bytes (and count) as a numpy gather either way, every zero-element size, serial and parallel."""
    rows, stride = 41, 96
    rng = np.random.default_rng(itemsize)
    table = rng.integers(0, 256, (rows, stride), dtype=np.uint8)
    zero = rng.integers(0, 256, itemsize, dtype=np.uint8)  # a recognisable "zero" element
    ids = rng.integers(-5, rows + 5, 300).astype(np.int64)
    ids[:3] = [np.iinfo(np.int64).max, np.iinfo(np.int64).min, rows]
    valid = (ids >= 0) & (ids < rows)
    for byte_start, nbytes, words in [(0, 96, True), (8, 80, True), (16, 8, True), (3, 80, False), (0, 92, False)]:
        want = table[np.where(valid, ids, 0), byte_start:byte_start + nbytes].copy()
        if not oob_row0:
            want[~valid] = np.resize(zero, nbytes)
        probe = np.empty((len(ids), nbytes), dtype=np.uint8)
        assert (cpu_gather._as_words(table, probe, byte_start, zero) is not None) == words
        for path in ("serial", "parallel", "prefetch"):
            out = np.full((len(ids), nbytes), 0xA5, dtype=np.uint8)
            bad = cpu_gather.cpu_gather(table, ids, out, byte_start, oob_row0, zero, path=path)
            assert bad == int((~valid).sum())
            np.testing.assert_array_equal(out, want, err_msg=f"{path} at byte {byte_start}, {nbytes} bytes")
    assert cpu_gather._as_words(table[:, 1:], np.empty((1, 8), np.uint8), 0, zero) is None  # a misaligned table


@pytest.mark.timeout(120)
def test_warm_up_compiles_what_the_first_gathers_use():
    """After warm_up, neither a word-aligned nor a byte gather compiles anything more (a first lookup
    compiling for a second while holding the gather lock would stall every other gather)."""
    table = np.random.default_rng(5).integers(0, 256, (50, 160), dtype=np.uint8)
    zero = np.zeros(2, dtype=np.uint8)
    cpu_gather.warm_up(table, zero)
    kernels = [*cpu_gather._gather_kernels(), cpu_gather._prefetch_kernel(), cpu_gather._zero_rows()]
    before = [len(k.signatures) for k in kernels]
    ids = np.arange(7, dtype=np.int64)
    for path in ("serial", "parallel", "prefetch"):
        for byte_start, nbytes in ((0, 160), (3, 80)):  # words, then bytes
            out = np.empty((7, nbytes), dtype=np.uint8)
            cpu_gather.cpu_gather(table, ids, out, byte_start, False, zero, path=path)
            cpu_gather.cpu_gather(table, ids.astype(np.int32), out, byte_start, True, zero, path=path)
    assert [len(k.signatures) for k in kernels] == before


@pytest.mark.timeout(120)
def test_prefetch_gather_compiles_and_falls_back_where_it_cannot():
    """The prefetching gather compiles with this numba (LLVM's prefetch intrinsic under one of its two
    names); where it cannot, path='prefetch' is the parallel kernel's, same bytes and count; its threads'
    blocks meet exactly (more threads than ids, ids not a multiple of the threads)."""
    assert cpu_gather._prefetch_intrinsic() is not None and cpu_gather._prefetch_kernel() is not None
    rng = np.random.default_rng(11)
    table = rng.integers(0, 256, (1000, 40), dtype=np.uint8)
    zero = np.array([0x80], dtype=np.uint8)
    for n in (1, 3, 7, 1001):
        ids = rng.integers(-3, 1003, n).astype(np.int64)
        want = [np.full((n, 40), 0xA5, dtype=np.uint8) for _ in range(2)]
        counts = [cpu_gather.cpu_gather(table, ids, want[k], 0, k == 1, zero, path="parallel") for k in range(2)]
        for k in range(2):
            got = np.full((n, 40), 0x5A, dtype=np.uint8)
            assert cpu_gather.cpu_gather(table, ids, got, 0, k == 1, zero, path="prefetch") == counts[k]
            np.testing.assert_array_equal(got, want[k])
    cpu_gather._prefetch_kernel.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(cpu_gather, "_prefetch_intrinsic", lambda: None)
            assert cpu_gather._prefetch_kernel() is None
            got = np.full((1001, 40), 0x5A, dtype=np.uint8)
            assert cpu_gather.cpu_gather(table, ids, got, 0, True, zero, path="prefetch") == counts[1]
            np.testing.assert_array_equal(got, want[1])
    finally:
        cpu_gather._prefetch_kernel.cache_clear()

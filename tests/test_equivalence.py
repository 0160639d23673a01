"""``uva``, ``copy`` and ``device`` backends give the same bits under random pipelined schedules.

Each schedule puts 1-4 passes in flight on the copy backend (submit several, consume in order, with
consumer delays), reuses ``out`` buffers of consumed passes (poisoned again before reuse), and mixes
ids shapes, int widths, out-of-range ids, scales, column ranges, oob policies and output dtypes. Every
pass is compared bit for bit across the three backends and ``reference_gather``; every wait is bounded.

On CPU (CI) tensors stay on the CPU (``uva``/``device`` run the Triton kernel interpreted). With CUDA,
ids and ``out`` live on the GPU (the copy backend also gets CPU ids for some passes), part of the
schedules run on a non-default model stream, and some consumers are slowed by a sleep kernel so reused
buffers are still being read when the next pass is submitted. ``UVAPLE_EQUIV_SCHEDULES`` sets the number
of schedules (default 30; the GPU run uses 1000).
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from uvaple.integration import make_lookup
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")
N_SCHEDULES = int(os.environ.get("UVAPLE_EQUIV_SCHEDULES", "30"))
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
# (rows, cols, dtype): small tables keep the interpreted kernels fast on CPU
TABLES = [(193, 24, torch.bfloat16), (64, 7, torch.float16), (300, 5, torch.float32)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(BITS[t.element_size()])


def random_table(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    t[t == 0] = 1.25  # random data, never zeros
    return t


def poison(out: torch.Tensor) -> torch.Tensor:
    out.view(BITS[out.element_size()]).fill_(0x7F0F if out.element_size() == 2 else 0x7F80F0F0)
    return out


class Trio:
    """One table, and for each policy a lookup of every placement over it, built on first use."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, seed: int) -> None:
        self.data = random_table(rows, cols, dtype, seed)
        self.table = HostTable.from_tensor(self.data)
        self._made: dict = {}

    def get(self, scale, oob, out_dtype) -> tuple:
        """(copy, uva, device) lookups with this policy (any column range allowed: column_block=1)."""
        key = (scale, oob, out_dtype)
        if key not in self._made:
            kw = dict(device=DEVICE, scale=scale, oob=oob, out_dtype=out_dtype, column_block=1)
            self._made[key] = (
                make_lookup("copy", self.table, max_in_flight=4, max_rows=64, admission_timeout=30.0,
                            wait_timeout=30.0, **kw),
                make_lookup("uva", self.table, **kw),
                make_lookup("device", self.table, **kw),
            )
        return self._made[key]

    def copies(self) -> list:
        return [c for c, _, _ in self._made.values()]

    def close(self) -> None:
        for lookups in self._made.values():
            for b in lookups:
                b.close()
        self.table.close()


@pytest.fixture(scope="module")
def trios():
    made = [Trio(r, c, d, seed=i) for i, (r, c, d) in enumerate(TABLES)]
    yield made
    for t in made:
        t.close()


def make_pass(rng: random.Random, trio: Trio) -> dict:
    rows, cols = trio.table.rows, trio.table.cols
    shape = rng.choice([(rng.randint(0, 40),), (rng.randint(1, 5), rng.randint(1, 6)), (1,), ()])
    ids_dtype = rng.choice([torch.int32, torch.int64])
    n = 1
    for s in shape:
        n *= s
    vals = [rng.randrange(rows) for _ in range(n)]
    if rng.random() < 0.6:
        bad = [-1, rows, rows + 3, -(2**31), 2**31 - 1]
        if ids_dtype == torch.int64:
            bad += [2**40, -(2**63), 2**63 - 1]
        for _ in range(rng.randint(1, 3)):
            if n:
                vals[rng.randrange(n)] = rng.choice(bad)
    ids = torch.tensor(vals, dtype=ids_dtype).reshape(shape)
    c0 = rng.randrange(cols)
    columns = rng.choice([None, (c0, rng.randint(c0 + 1, cols)), slice(c0, None)])
    float_table = trio.table.dtype in FLOATS
    return dict(
        ids=ids,
        scale=rng.choice([None, None, 16.0, -0.75, 3.3]) if float_table else None,
        columns=columns,
        oob=rng.choice(["zero", "row0"]),
        out_dtype=rng.choice([None, None, rng.choice(FLOATS)]) if float_table else None,
    )


def take_out(pool: dict, key, shape, dtype, rng: random.Random) -> torch.Tensor:
    free = pool.get(key)
    if free and rng.random() < 0.7:
        return poison(free.pop())  # reused: poisoned in stream order before the new pass is submitted
    return poison(torch.empty(shape, dtype=dtype, device=DEVICE))


@pytest.mark.timeout(900)
def test_random_schedules_agree(trios):
    side = torch.cuda.Stream(DEVICE) if HAS_CUDA else None
    pool: dict = {}
    for seed in range(N_SCHEDULES):
        rng = random.Random(1000 + seed)
        trio = trios[seed % len(trios)]
        use_side = HAS_CUDA and rng.random() < 0.5
        ctx = torch.cuda.stream(side) if use_side else _nullcontext()
        with ctx:
            run_schedule(rng, trio, pool, seed)
    if HAS_CUDA:
        torch.cuda.synchronize()
    for t in trios:
        for copy in t.copies():
            st = copy.stats()
            assert st.get("failed", 0) == 0 and st["pending"] == 0, st


def run_schedule(rng: random.Random, trio: Trio, pool: dict, seed: int) -> None:
    """A rolling pipeline: keep up to k passes in flight; consuming one frees its buffers for the next."""
    k = rng.randint(1, 4)
    total = k + rng.randint(0, 4)
    in_flight: list = []
    snapshots = []
    submitted = 0
    while submitted < total or in_flight:
        if submitted < total and len(in_flight) < k:
            in_flight.append(submit_pass(rng, trio, pool))
            submitted += 1
            continue
        ids, p, key, outs, job = in_flight.pop(0)
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.003)  # consumer delay on the host
        got = job.wait(timeout=30)
        assert got is outs[0]
        if HAS_CUDA and rng.random() < 0.4:
            torch.cuda._sleep(rng.randint(10_000, 2_000_000))  # slow consumer: reads land late
        # the model's reads, in stream order (asynchronous on CUDA); the buffers go back to the pool at
        # once, so a pass submitted next may reuse them while these reads are still queued (WAR)
        snapshots.append((ids, p, [o.clone() for o in outs]))
        for name, out in zip(("copy", "uva", "dev"), outs, strict=True):
            pool.setdefault(key + (name,), []).append(out)
    for ids, p, snaps in snapshots:
        want = reference_gather(trio.data, ids, **p)
        for name, out in zip(("copy", "uva", "dev"), snaps, strict=True):
            g, w = bits(out), bits(want)
            assert torch.equal(g, w), (
                f"schedule {seed}: {name} differs from the reference at {(g != w).nonzero()[:4].tolist()} "
                f"(ids {ids.tolist()}, {p})")


def submit_pass(rng: random.Random, trio: Trio, pool: dict):
    p = make_pass(rng, trio)
    ids = p.pop("ids")
    c0, c1 = _cols(p["columns"], trio.table.cols)
    dtype = p["out_dtype"] or trio.table.dtype
    shape = (*ids.shape, c1 - c0)
    key = (id(trio), shape, dtype)
    outs = [take_out(pool, key + (name,), shape, dtype, rng) for name in ("copy", "uva", "dev")]
    ids_dev = ids.to(DEVICE)
    copy_ids = ids if (HAS_CUDA and rng.random() < 0.3) else ids_dev  # CPU ids are the server case
    copy, uva, dev = trio.get(p["scale"], p["oob"], p["out_dtype"])
    job = copy.submit(copy_ids, outs[0], columns=p["columns"])
    uva.lookup(ids_dev, outs[1], columns=p["columns"])
    dev.lookup(ids_dev, outs[2], columns=p["columns"])
    return ids, p, key, outs, job


@pytest.mark.timeout(300)
def test_wide_rows_agree():
    data = random_table(9, 8960, torch.bfloat16, seed=7)
    with HostTable.from_tensor(data) as table:
        ids = torch.tensor([[4, -1], [9, 0]], dtype=torch.int64)
        for kw in (dict(oob="zero"), dict(oob="row0", scale=16.0, columns=(256, 8960 - 1))):
            policy = {k: v for k, v in kw.items() if k != "columns"}
            want = reference_gather(data, ids, **kw)
            for k in ("copy", "uva", "device"):
                with make_lookup(k, table, device=DEVICE, max_rows=8, column_block=1, **policy) as b:
                    got = b.lookup(ids.to(DEVICE), columns=kw.get("columns"))
                    assert torch.equal(bits(got), bits(want)), b.kind


def _cols(columns, cols: int) -> tuple[int, int]:
    if columns is None:
        return 0, cols
    if isinstance(columns, slice):
        return columns.start or 0, cols if columns.stop is None else columns.stop
    return columns


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

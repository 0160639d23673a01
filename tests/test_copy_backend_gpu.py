"""CopyBackend on a real GPU: streams, events, pinned copies (skipped without CUDA).

The model stream is a non-default stream throughout; ``torch.cuda._sleep`` stands in for a slow model
kernel, so copies, reads and admission really overlap. Every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from uvaple.integration.errors import BackendClosed, CopyBackendOverloaded, CopyJobFailed
from uvaple.integration.placements.copy import CopyBackend
from uvaple.kernels import reference_gather
from uvaple.uva import HostTable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BITS = {2: torch.int16, 4: torch.int32}
# ~10-25 ms of GPU time on an H200 (1.5-2 GHz): long against a copy (us), short for a test
SLEEP_CYCLES = 40_000_000


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(BITS[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    g, w = bits(got), bits(want)
    assert g.shape == w.shape and got.dtype == want.dtype, (what, g.shape, w.shape, got.dtype, want.dtype)
    assert torch.equal(g, w), f"{what}: {(g != w).sum().item()} elements differ"


def assert_passes_gathered(jobs, stream, data, true_ids, *, scale) -> None:
    """Every pipelined job's rows, once the caller's stream is done, are the reference gather of its ids."""
    results = [j.wait(timeout=60) for j in jobs]
    stream.synchronize()
    for p, r in enumerate(results):
        assert_bits_equal(r, reference_gather(data, true_ids[p], scale=scale), f"pass {p}")


def random_table(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    t[t == 0] = 1.25
    return t


def random_ids(n: int, rows: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    """Random ids with out-of-range ones mixed in (negative, == rows, huge)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g)
    bad = [-1, rows, 2**40 if dtype == torch.int64 else 2**31 - 1]
    for k, v in enumerate(bad[: n // 4]):
        ids[(k * 7) % n] = v
    return ids.to(dtype)


@pytest.fixture
def stream():
    return torch.cuda.Stream()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_exact_on_side_stream(stream, dtype):
    data = random_table(1000, 8960, dtype, seed=1)
    table = HostTable.from_tensor(data)
    for kw in (dict(), dict(oob="row0"), dict(scale=16.0), dict(scale=-0.75, columns=(256, 8959)),
               dict(scale=3.3, out_dtype=torch.float32), dict(out_dtype=torch.bfloat16, oob="row0")):
        policy = {k: v for k, v in kw.items() if k != "columns"}
        with CopyBackend(table, device="cuda", max_rows=512, max_in_flight=3, column_block=1, **policy) as b, \
                torch.cuda.stream(stream):
            for k, (n, ids_dtype, on_gpu) in enumerate([(1, torch.int64, False), (7, torch.int32, True),
                                                       (300, torch.int64, True), (512, torch.int32, False)]):
                ids = random_ids(n, 1000, seed=k, dtype=ids_dtype)
                ids_arg = ids.cuda() if on_gpu else ids
                want = reference_gather(data, ids, **kw)
                out = torch.full(want.shape, float("nan"), dtype=want.dtype, device="cuda")
                got = b.lookup(ids_arg, out, columns=kw.get("columns"))
                assert got is out
                assert_bits_equal(got, want, f"n={n} {kw}")
    table.close()


@pytest.mark.timeout(300)
def test_gpu_war_reused_out_with_slow_consumer(stream):
    """Pass p+1 is submitted into ``out`` while pass p's reader still sits behind a sleep kernel."""
    data = random_table(4096, 1024, torch.bfloat16, seed=2)
    passes = 8
    with CopyBackend(data, device="cuda", max_rows=256, max_in_flight=3, admission_timeout=60) as b, \
            torch.cuda.stream(stream):
        out = torch.empty(256, 1024, dtype=torch.bfloat16, device="cuda")
        all_ids, snaps = [], []
        for p in range(passes):
            ids = random_ids(256, 4096, seed=100 + p)
            all_ids.append(ids)
            b.submit(ids, out).wait(timeout=60)
            torch.cuda._sleep(SLEEP_CYCLES)  # the model is slow to read this pass's rows
            snaps.append(out.clone())  # the model's read, in stream order
        stream.synchronize()
        for p in range(passes):
            assert_bits_equal(snaps[p], reference_gather(data, all_ids[p]), f"pass {p}")
        st = b.stats()
        assert st.get("failed", 0) == 0 and st["launched"] == passes


@pytest.mark.timeout(300)
def test_gpu_pipelined_passes_and_admission(stream):
    """Several passes in flight; with admission_timeout=0 the overload is a named error, then recovery."""
    data = random_table(2048, 512, torch.float16, seed=3)
    with CopyBackend(data, device="cuda", max_rows=128, max_in_flight=2, admission_timeout=0.0) as b, \
            torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES * 4)  # the model stream is busy: copies wait for the submit point
        ids = [random_ids(128, 2048, seed=s) for s in range(3)]
        outs = [torch.empty(128, 512, dtype=torch.float16, device="cuda") for _ in range(3)]
        j0 = b.submit(ids[0], outs[0])
        j1 = b.submit(ids[1], outs[1])
        t0 = time.monotonic()
        with pytest.raises(CopyBackendOverloaded):
            b.submit(ids[2], outs[2])
        assert time.monotonic() - t0 < 1.0  # fail fast, nothing waited on the GPU
        r0, r1 = j0.wait(timeout=30), j1.wait(timeout=30)  # no host sync: the stream waits
        b.admission_timeout = 60.0
        j2 = b.submit(ids[2], outs[2])  # waits (bounded) for a slot to come back from the GPU
        r2 = j2.wait(timeout=60)
        stream.synchronize()
        for i, r in enumerate((r0, r1, r2)):
            assert_bits_equal(r, reference_gather(data, ids[i]), f"pass {i}")


@pytest.mark.timeout(300)
def test_gpu_cuda_ids_wait_for_the_producer(stream):
    """CUDA ids written late on the model stream: the device->host ids copy must see the final values."""
    data = random_table(500, 256, torch.bfloat16, seed=4)
    with CopyBackend(data, device="cuda", max_rows=64, max_in_flight=4, scale=16.0) as b, \
            torch.cuda.stream(stream):
        jobs, true_ids = [], []
        for p in range(4):
            ids = random_ids(64, 500, seed=200 + p)
            true_ids.append(ids)
            ids_dev = (ids - 1000).cuda()  # wrong values until the producer kernel below runs
            torch.cuda._sleep(SLEEP_CYCLES)
            ids_dev.add_(1000)  # the producer: final ids only after the sleep, in stream order
            jobs.append(b.submit(ids_dev))
            del ids_dev  # the job owns the ids until its copy is done
        assert_passes_gathered(jobs, stream, data, true_ids, scale=16.0)


@pytest.mark.timeout(300)
def test_gpu_cuda_ids_rewritten_after_submit_are_gathered_as_submitted(stream):
    """Write-after-read on the ids: a pipelined caller rewrites its persistent ids buffer right after
    submit (the next pass). The job must gather the ids as they were at submit."""
    data = random_table(500, 256, torch.bfloat16, seed=5)
    with CopyBackend(data, device="cuda", max_rows=64, max_in_flight=4, scale=16.0) as b, \
            torch.cuda.stream(stream):
        ids_buf = torch.empty(64, dtype=torch.int64, device="cuda")  # one buffer reused by every pass
        jobs, true_ids = [], []
        for p in range(4):
            ids = random_ids(64, 500, seed=300 + p)
            true_ids.append(ids)
            torch.cuda._sleep(SLEEP_CYCLES)  # the ids copy of this pass lags behind the model stream
            ids_buf.copy_(ids.cuda(), non_blocking=True)
            jobs.append(b.submit(ids_buf))
        ids_buf.fill_(0)  # the next pass's write, after the last submit
        assert_passes_gathered(jobs, stream, data, true_ids, scale=16.0)


@pytest.mark.timeout(300)
def test_gpu_failure_delivered_while_earlier_copy_is_stuck(stream):
    data = random_table(300, 128, torch.bfloat16, seed=5)
    with CopyBackend(data, device="cuda", max_rows=32, max_in_flight=3) as b, torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES * 8)  # A's copy waits behind this
        ids_a = random_ids(32, 300, seed=6)
        ja = b.submit(ids_a)
        b._fault_hook = lambda job: (_ for _ in ()).throw(RuntimeError("injected")) if job.seq == 2 else None
        jb = b.submit(random_ids(8, 300, seed=7))
        t0 = time.monotonic()
        with pytest.raises(CopyJobFailed, match="injected"):
            jb.wait(timeout=30)
        assert time.monotonic() - t0 < 5.0
        ra = ja.wait(timeout=30)
        stream.synchronize()
        assert_bits_equal(ra, reference_gather(data, ids_a), "A")


@pytest.mark.timeout(300)
def test_gpu_close_with_pending_jobs(stream):
    data = random_table(400, 256, torch.bfloat16, seed=8)
    b = CopyBackend(data, device="cuda", max_rows=64, max_in_flight=4)
    with torch.cuda.stream(stream):
        # CUDA ids made before the sleep (a pageable .cuda() would wait for the stream)
        pending_ids = [random_ids(16, 400, seed=10 + i).cuda() for i in range(3)]
        # ~2 s: the pending jobs' ids must still be behind it when close() runs, however slow the host is
        # between here and there (a shorter sleep ran out first once, after other GPU tests)
        torch.cuda._sleep(SLEEP_CYCLES * 80)
        ids_launched = random_ids(64, 400, seed=9)
        j_launched = b.submit(ids_launched)  # CPU ids: launched, its copy waits on the stream
        until_done = time.monotonic() + 30
        while not j_launched.done and time.monotonic() < until_done:
            time.sleep(0.001)
        assert j_launched.done
        pending = [b.submit(ids) for ids in pending_ids]  # their ids reach the host only after the sleep
        t0 = time.monotonic()
        b.close(timeout=30)
        assert time.monotonic() - t0 < 30
        for j in pending:
            with pytest.raises(BackendClosed):
                j.wait(timeout=5)
        st = b.stats()
        assert st["closed"] and not st["worker_alive"] and st["abandoned_at_close"] == 0, st
        r = j_launched.wait(timeout=5)
        stream.synchronize()
        assert_bits_equal(r, reference_gather(data, ids_launched), "launched before close")
        with pytest.raises(BackendClosed):
            b.submit(ids_launched)


@pytest.mark.timeout(300)
def test_gpu_no_device_allocation_per_lookup(stream):
    data = random_table(1000, 512, torch.bfloat16, seed=11)
    table = HostTable.from_tensor(data)
    backends = {dt: CopyBackend(table, device="cuda", max_rows=128, max_in_flight=2, scale=16.0, out_dtype=dt)
                for dt in (torch.bfloat16, torch.float32)}
    with torch.cuda.stream(stream):
        ids = random_ids(128, 1000, seed=12)
        outs = {dt: torch.empty(128, 512, dtype=dt, device="cuda") for dt in backends}
        for _ in range(3):  # warm: per-slot conversion buffers are allocated once
            for dt, out in outs.items():
                backends[dt].lookup(ids, out)
        stream.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(10):
            for dt, out in outs.items():
                backends[dt].lookup(ids, out)
        stream.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        for dt, out in outs.items():
            assert_bits_equal(out, reference_gather(data, ids, scale=16.0, out_dtype=dt), str(dt))
    for b in backends.values():
        b.close()
    table.close()


@pytest.mark.timeout(300)
def test_gpu_two_threads_submitting(stream):
    """Two model threads (own streams) share one backend; each gets its own rows."""
    data = random_table(700, 384, torch.bfloat16, seed=13)
    errors = []
    with CopyBackend(data, device="cuda", max_rows=64, max_in_flight=4, admission_timeout=60) as b:
        def model(seed):
            try:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    for p in range(20):
                        ids = random_ids(64, 700, seed=seed * 100 + p)
                        r = b.lookup(ids.cuda() if p % 2 else ids)
                        torch.cuda._sleep(SLEEP_CYCLES // 20)
                        snap = r.clone()
                        s.synchronize()
                        assert torch.equal(bits(snap), bits(reference_gather(data, ids))), (seed, p)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=model, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors

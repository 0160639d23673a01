"""The UVA path on a real GPU: registered tables read by the Triton gather, in stream order.

Skipped where there is no CUDA (CI); run on the GPU machine (perf/gpu_check.sh) and its log committed.
"""

from __future__ import annotations

import pytest
import torch

from uvaple.integration import make_lookup
from uvaple.kernels import gather_rows, reference_gather
from uvaple.uva import HostTable, memory

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def rand(rows, cols, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 4).to(dtype)


@pytest.fixture(scope="module")
def e4b():
    """A Gemma 3n E4B-shaped slice: 17,920-byte rows (35 layers x 256 bf16)."""
    t = rand(4099, 35 * 256, seed=1)
    with HostTable.from_tensor(t, register=True) as h:
        yield t, h


def test_registered_and_capable(e4b):
    from uvaple.commands.doctor import capabilities

    _, h = e4b
    assert h.registered and h.device_index == torch.cuda.current_device()
    caps = capabilities(measure=False)
    assert caps.uva_usable, caps.reason


@pytest.mark.parametrize("n", [1, 8, 64, 1000, 4096])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_random_rows_bit_exact(e4b, n, id_dtype):
    t, h = e4b
    ids = torch.randint(-3, h.rows + 3, (n,), device=DEV, dtype=id_dtype)
    for oob, scale, cols in [("zero", None, None), ("row0", 16.0, None), ("zero", 16.0, (256 * 7, 256 * 8))]:
        out = torch.full((n, (cols[1] - cols[0]) if cols else h.cols), float("nan"), dtype=h.dtype, device=DEV)
        gather_rows(h.tensor, ids, out, scale=scale, oob=oob, columns=cols)
        ref = reference_gather(t, ids, scale=scale, oob=oob, columns=cols)
        assert torch.equal(bits(out), bits(ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 255, 8960, 65537])
def test_dtypes_and_odd_columns(dtype, cols):
    rows = 300 if cols < 60000 else 20
    t = rand(rows, cols, dtype, seed=cols)
    with HostTable.from_tensor(t, register=True) as h:
        ids = torch.randint(-2, rows + 2, (2, 17), device=DEV)
        for od in (None, torch.float32):
            got = gather_rows(h.tensor, ids, scale=1.7, out_dtype=od)
            assert torch.equal(bits(got), bits(reference_gather(t, ids, scale=1.7, out_dtype=od)))


def test_cuda_view_and_host_tensor_agree(e4b):
    t, h = e4b
    view = h.cuda_view()
    assert view.is_cuda and view.shape == (h.rows, h.cols) and view.dtype == h.dtype
    ids = torch.randint(0, h.rows, (333,), device=DEV)
    a = gather_rows(h.tensor, ids)
    b = gather_rows(view, ids)
    c = torch.nn.functional.embedding(ids, view)  # a torch op reading host memory through the view
    assert torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c))
    assert torch.equal(bits(a), bits(reference_gather(t, ids)))


def test_non_default_stream_orders_after_producer(e4b):
    """ids written by a slow producer on a side stream are read only after it, in that stream."""
    t, h = e4b
    s = torch.cuda.Stream()
    ids = torch.zeros(2048, dtype=torch.int64, device=DEV)
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # keep the stream busy so a misordered read would see old ids
        ids.copy_(torch.arange(2048, device=DEV).flip(0))
        out = gather_rows(h.tensor, ids)
    s.synchronize()
    assert torch.equal(bits(out), bits(reference_gather(t, torch.arange(2048).flip(0))))


def test_cuda_graph_capture_and_replay_with_new_ids(e4b):
    t, h = e4b
    ids = torch.randint(0, h.rows, (64,), device=DEV)
    out = torch.empty(64, h.cols, dtype=h.dtype, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gather_rows(h.tensor, ids, out, scale=16.0)  # warm up (compile) outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gather_rows(h.tensor, ids, out, scale=16.0)
    for seed in range(5):
        new = torch.randint(-5, h.rows + 5, (64,), generator=torch.Generator().manual_seed(seed))
        ids.copy_(new)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out), bits(reference_gather(t, new, scale=16.0)))


def test_close_under_pending_work_is_safe():
    """close() while a gather is queued behind a long kernel: it waits, nothing faults, result intact."""
    t = rand(1000, 8960, seed=5)
    h = HostTable.from_tensor(t, register=True)
    ids = torch.randint(0, 1000, (4096,), device=DEV)
    out = torch.empty(4096, 8960, dtype=torch.bfloat16, device=DEV)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the gather
    gather_rows(h.tensor, ids, out)
    h.close()  # must wait for the gather before unregistering and unmapping
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(reference_gather(t, ids)))
    # The context is healthy afterwards.
    assert torch.ones(4, device=DEV).sum().item() == 4


@pytest.mark.parametrize("threads", [1, 3])
def test_chunked_registration_reads_across_chunk_boundaries(monkeypatch, threads):
    monkeypatch.setattr(memory, "REGISTER_CHUNK_BYTES", 64 << 20)
    rows, cols = 9000, 8960  # 154 MiB: three chunks, registered by one thread or by three at once
    t = rand(rows, cols, seed=9)
    with HostTable.from_tensor(t, register=True, threads=threads) as h:
        assert len(h._region.chunks) == 3
        per_chunk = (64 << 20) // h.stride_bytes
        edge = [per_chunk - 1, per_chunk, per_chunk + 1, 2 * per_chunk - 1, 2 * per_chunk, rows - 1, 0]
        ids = torch.tensor(edge * 10, device=DEV)
        assert torch.equal(bits(gather_rows(h.tensor, ids)), bits(reference_gather(t, ids)))


def test_read_only_registration():
    t = rand(100, 256, seed=3)
    with HostTable.from_tensor(t, register=True, read_only=True) as h:
        ids = torch.arange(100, device=DEV)
        assert torch.equal(bits(gather_rows(h.tensor, ids)), bits(t))


def test_shared_segment_registered_in_two_processes(tmp_path):
    import subprocess
    import sys
    import textwrap
    import uuid

    name = f"gpu-{uuid.uuid4().hex[:10]}"
    t = rand(500, 7680, seed=4)
    with HostTable.from_tensor(t, name=name, register=True):
        code = textwrap.dedent(f"""
            import torch
            from uvaple.uva import HostTable
            from uvaple.kernels import gather_rows
            with HostTable.attach({name!r}, register=True) as h:
                ids = torch.arange(500, device="cuda").flip(0)
                out = gather_rows(h.tensor, ids, scale=16.0)
                print(int(out.view(torch.int16).to(torch.int64).sum().item()))
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        ref = reference_gather(t, torch.arange(500).flip(0), scale=16.0)
        assert int(r.stdout.strip()) == int(ref.view(torch.int16).to(torch.int64).sum())


@pytest.mark.parametrize("kind", ["uva", "device"])
def test_backends_on_gpu(e4b, kind):
    t, h = e4b
    with make_lookup(kind, h, scale=16.0, oob="row0") as b:
        ids = torch.randint(-1, h.rows + 1, (3, 50), device=DEV)
        got = b.lookup(ids)
        assert torch.equal(bits(got), bits(reference_gather(t, ids, scale=16.0, oob="row0")))
        if kind == "device":
            assert b.device_bytes() == h.rows * h.cols * 2


def test_uva_backend_host_view_mode(e4b):
    t, h = e4b
    with make_lookup("uva", h, view="host") as b:
        ids = torch.randint(0, h.rows, (77,), device=DEV)
        assert torch.equal(bits(b.lookup(ids)), bits(reference_gather(t, ids)))


def test_torch_compile_inductor_keeps_gather_opaque(e4b):
    t, h = e4b

    def f(ids):
        return gather_rows(h.tensor, ids, scale=16.0).float().sum(-1)

    compiled = torch.compile(f, fullgraph=True)
    ids = torch.randint(0, h.rows, (16,), device=DEV)
    ref = reference_gather(t, ids, scale=16.0).float().sum(-1)
    assert torch.allclose(compiled(ids).cpu(), ref, rtol=1e-5, atol=1e-3)
    ids2 = torch.randint(0, h.rows, (16,), device=DEV)
    ref2 = reference_gather(t, ids2, scale=16.0).float().sum(-1)
    assert torch.allclose(compiled(ids2).cpu(), ref2, rtol=1e-5, atol=1e-3)


def test_unregistered_cpu_tensor_is_refused_clearly():
    ids = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="ordinary CPU tensor"):
        gather_rows(torch.randn(4, 4), ids)


def test_deferred_shared_tables_register_when_ready():
    """defer_ready: registration waits for the fill (creator: mark_ready, attacher: wait_ready); the GPU
    then reads the rows through both mappings, bit-exact; construction already checked registration."""
    import uuid

    from uvaple.uva import DeviceCapabilityError, cuda_runtime

    name = f"gpu-deferred-{uuid.uuid4().hex[:8]}"
    src = rand(3001, 80, seed=9)
    a = HostTable.shared(name, 3001, 80, torch.bfloat16, defer_ready=True, register=True)
    b = HostTable.shared(name, 3001, 80, torch.bfloat16, defer_ready=True, register=True)
    try:
        assert not a.registered and not b.registered and not cuda_runtime.is_registered(a.ptr)  # the probe let go
        with pytest.raises(DeviceCapabilityError, match="registered when it is ready"):
            a.cuda_view()
        a.write_rows(src)
        a.mark_ready()
        b.wait_ready(5)
        assert a.registered and b.registered
        ids = torch.randint(0, 3001, (777,), device=DEV)
        for t in (a, b):
            out = torch.full((777, 80), float("nan"), dtype=torch.bfloat16, device=DEV)
            gather_rows(t.cuda_view(), ids, out=out)
            assert torch.equal(bits(out), bits(src[ids.cpu()]))
    finally:
        a.close()
        b.close()


def test_deferred_registration_refused_is_named_at_construction(monkeypatch):
    """The one-page check at construction: a registration the driver refuses is an error before the
    fill, and nothing is left mapped or named."""
    import os
    import uuid

    from uvaple.uva import RegistrationError, _region, cuda_runtime

    def refuse(ptr, nbytes, flags):
        raise RegistrationError("cudaHostRegister failed: operation not permitted")

    monkeypatch.setattr(cuda_runtime, "host_register", refuse)
    name = f"gpu-refused-{uuid.uuid4().hex[:8]}"
    n_live = len(_region.live_regions())
    with pytest.raises(RegistrationError, match="cudaHostRegister of this table's memory failed"):
        HostTable.shared(name, 100, 80, torch.bfloat16, defer_ready=True, register=True)
    assert not os.path.exists(f"/dev/shm/uvaple.{name}") and len(_region.live_regions()) == n_live

"""Host-table lifetime on a real GPU: release under pending kernels, finalizers, fork, graphs, sharing.

Skipped where there is no CUDA (CI); run on the GPU machine (perf/gpu_check.sh), log committed. The
full-size runs (an 8 GiB table released by its finalizer, 4 processes sharing 16 GiB) are
``perf/studies/lifetime_gpu.py``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from helpers import bits, rand

from uvaple.kernels import gather_rows, reference_gather
from uvaple.uva import HostTable
from uvaple.uva.cuda_runtime import is_registered as registered
from uvaple.uva.system import mapped

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def test_dropped_table_released_under_pending_kernels():
    """No close(): the last reference goes while a gather is queued behind a long kernel. The finalizer
    synchronises before unregistering; the gather's result is intact and the registration is gone."""
    t = rand(2000, 8960, seed=11)
    h = HostTable.from_tensor(t, register=True)
    ptr = h.ptr
    ids = torch.randint(0, 2000, (8192,), device=DEV)
    out = torch.empty(8192, 8960, dtype=torch.bfloat16, device=DEV)
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time ahead of the gather
    gather_rows(h.tensor, ids, out)
    assert registered(ptr)
    del h  # released here (synchronise, unregister, unmap)
    assert not registered(ptr) and not mapped(ptr)
    assert torch.equal(bits(out), bits(reference_gather(t, ids)))
    assert torch.ones(4, device=DEV).sum().item() == 4  # the context is healthy


def test_cuda_view_keeps_the_registration_after_close():
    t = rand(700, 256, seed=3)
    h = HostTable.from_tensor(t, register=True)
    ptr, view = h.ptr, h.cuda_view()
    h.close()
    assert registered(ptr) and not h.released
    ids = torch.arange(700, device=DEV).flip(0)
    assert torch.equal(bits(view[ids]), bits(t.flip(0)))
    del view
    gc.collect()
    assert h.released and not registered(ptr)


def test_captured_graph_keeps_its_table_until_exit():
    """A graph captured over a host table is replayed after the table was closed and dropped."""
    t = rand(512, 1024, seed=12)
    h = HostTable.from_tensor(t, register=True)
    ptr = h.ptr
    ids = torch.randint(0, 512, (256,), device=DEV)
    out = torch.empty(256, 1024, dtype=torch.bfloat16, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gather_rows(h.tensor, ids, out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gather_rows(h.tensor, ids, out)
    h.close()
    del h
    gc.collect()
    assert registered(ptr) and mapped(ptr)  # a graph reads it: kept
    new = torch.randint(0, 512, (256,))
    ids.copy_(new)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(bits(out), bits(t[new]))


def test_fork_after_registration_keeps_the_parent_exact():
    """fork() after registration, then the parent rewrites rows: the GPU reads the new rows (the pages
    were never shared copy-on-write with the child); the child's inherited view reads zeros."""
    t = rand(3000, 2048, seed=13)
    h = HostTable.from_tensor(t, register=True)
    ids = torch.randint(0, 3000, (4096,), device=DEV)
    assert torch.equal(bits(gather_rows(h.tensor, ids)), bits(reference_gather(t, ids)))
    view = h.tensor
    pid = os.fork()
    if pid == 0:  # the child: numpy only (no CUDA, no OpenMP after a fork), and always _exit
        code = 4
        try:
            code = 0 if not view.view(torch.int16).numpy().any() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    t2 = rand(3000, 2048, seed=14)
    h.write_rows(t2)  # the parent writes after the fork: no copy-on-write may move its pages
    got = gather_rows(h.tensor, ids)
    assert torch.equal(bits(got), bits(reference_gather(t2, ids)))
    h.close()


def test_fork_with_a_split_lookup_and_its_graphs():
    """A split lookup (its GPU share's CUDA graphs captured, its counters' pinned snapshots made) in a
    forked child: a call is a named error, and close(), drop, collection and the child's normal exit
    (the interpreter's teardown) free none of the parent's CUDA resources there, so the child exits
    cleanly; the parent's lookup goes on exact."""
    code = textwrap.dedent("""
        import gc, os, sys, torch
        from uvaple.uva import HostTable
        from uvaple.integration import SplitLookup, TableSpec
        from uvaple.integration.errors import LookupForkedError
        t = torch.randn(6000, 96, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16)
        h = HostTable.from_tensor(t, register=True)
        lk = SplitLookup(h, TableSpec.of(h), "cuda", max_rows=9000)
        assert lk._split.graphs
        ids = torch.randint(0, 6000, (9000,), generator=torch.Generator().manual_seed(2))
        out = torch.full((9000, 96), float("nan"), dtype=torch.bfloat16, device="cuda")
        lk.lookup_split(ids, out, gpu_share=0.5)
        lk.progress()
        torch.cuda.synchronize()
        pid = os.fork()
        if pid == 0:
            try:
                lk.lookup_split(ids, out, gpu_share=0.5)
                sys.exit(5)
            except LookupForkedError:
                pass
            lk.close()
            del lk
            gc.collect()
            sys.exit(0)  # a normal exit: the interpreter's teardown runs in the child
        _, status = os.waitpid(pid, 0)
        out2 = torch.full((9000, 96), float("nan"), dtype=torch.bfloat16, device="cuda")
        lk.lookup_split(ids, out2, gpu_share=0.5)
        torch.cuda.synchronize()
        ok = torch.equal(out.cpu(), t[ids]) and torch.equal(out2.cpu(), t[ids])
        lk.close()
        h.close()
        print("child", os.waitstatus_to_exitcode(status), "exact", int(ok), flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "child 0 exact 1" in r.stdout, (r.stdout, r.stderr[-3000:])


def test_shared_table_by_two_processes_on_one_gpu():
    name = f"gpu-{uuid.uuid4().hex[:10]}"
    code = textwrap.dedent(f"""
        import sys, torch
        from uvaple.uva import HostTable
        from uvaple.kernels import gather_rows
        def fill(t):
            g = torch.Generator().manual_seed(5)
            t.write_rows(torch.randn(4000, 1536, generator=g).to(torch.bfloat16))
        t = HostTable.shared({name!r}, 4000, 1536, torch.bfloat16, fill=fill, timeout=120, register=True)
        ids = torch.randint(-3, 4003, (5000,), generator=torch.Generator().manual_seed(int(sys.argv[1])))
        got = gather_rows(t.tensor, ids.cuda(), oob="row0").cpu()
        ok = torch.equal(got, t.tensor[torch.where((ids >= 0) & (ids < 4000), ids, 0)])
        print(int(t.created), int(ok), flush=True)
        sys.stdin.readline()
        t.close()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    lines = [p.stdout.readline().split() for p in procs]
    for p in procs:
        p.stdin.write("\n")
        p.stdin.flush()
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    assert sorted(int(a) for a, _ in lines) == [0, 1] and all(int(b) for _, b in lines), (lines, errs)
    assert not os.path.exists(f"/dev/shm/uvaple.{name}")

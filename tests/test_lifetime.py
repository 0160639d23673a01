"""Host tables cannot crash, leak or be corrupted by misuse: views after close, drops, exit, fork, import.

Each misuse runs in a fresh process where it could kill one: the exit code is checked, and a signal
(a negative return code) fails the test.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from uvaple.uva import HostTable, TableClosedError, TableForkedError, _region
from uvaple.uva.system import mapped


def run_py(code: str, timeout: float = 180) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode >= 0, f"killed by signal {-out.returncode}:\n{out.stderr[-3000:]}"
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def rand(rows, cols, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 3).to(dtype)


# ------------------------------------------------------------------ views outlive close()
def test_views_read_after_close_in_a_process():
    """tensor, bytes_view() and a state-dict tensor read after close(): the right bytes, no signal."""
    out = run_py("""
        import gc, torch, numpy as np
        from uvaple.uva import HostTable
        src = torch.randn(3001, 97)
        t = HostTable.from_tensor(src)
        view, arr, rows = t.tensor, t.bytes_view(), t.tensor[5:9]
        t.close()
        assert t.closed and not t.released          # views still hold the memory
        del t; gc.collect()
        for _ in range(3):
            assert torch.equal(view, src) and torch.equal(rows, src[5:9])
            assert np.array_equal(arr[:, :97 * 4].copy().view(np.float32), src.numpy())
        torch.save({"w": view}, "/dev/null")
        print("ok")
    """)
    assert out.stdout.strip() == "ok"


def test_close_releases_once_the_last_view_is_gone():
    t = HostTable.from_tensor(rand(100, 33, seed=1))
    base = t._region.base
    view = t.tensor[10]
    t.close()
    assert not t.released and mapped(base)
    with pytest.raises(TableClosedError):
        _ = t.tensor
    del view
    assert t.released and not mapped(base)


def test_close_without_views_releases_at_once():
    t = HostTable.empty(64, 64, torch.float16)
    _ = t.tensor.sum()  # a temporary view, gone by now
    base = t._region.base
    t.close()
    assert t.released and not mapped(base)
    t.close()  # idempotent


def test_copy_backend_lookup_after_its_table_was_closed_in_a_process():
    out = run_py("""
        import torch
        from uvaple.uva import HostTable
        from uvaple.integration import CopyBackend
        from uvaple.kernels import reference_gather
        src = torch.randn(500, 64)
        t = HostTable.from_tensor(src)
        # warmup=False: the lookup compiles the one gather it needs (warming up every one takes ~17 s on 2 cores)
        b = CopyBackend(t, device="cpu", warmup=False)
        t.close()                                   # closed under the backend
        ids = torch.randint(-2, 502, (300,))
        assert torch.equal(b.lookup(ids), reference_gather(src, ids))
        b.close()
        print("ok")
    """)
    assert out.stdout.strip() == "ok"


def test_gemma_state_dict_saved_after_revert_in_a_process(tmp_path):
    pytest.importorskip("transformers")
    out = run_py(f"""
        import copy, torch
        from transformers import Gemma3nForCausalLM, Gemma3nTextConfig
        from uvaple.integration.models.gemma3n import apply_uvaple_to_gemma3n
        cfg = Gemma3nTextConfig(vocab_size=301, vocab_size_per_layer_input=157, hidden_size=64,
            hidden_size_per_layer_input=16, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2,
            sliding_window=8, max_position_embeddings=128,
            layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
        torch.manual_seed(0)
        model = Gemma3nForCausalLM(cfg).eval()
        patch = apply_uvaple_to_gemma3n(model)
        sd = model.state_dict()
        key = "model.embed_tokens_per_layer.weight"
        want = sd[key].clone()
        patch.revert()                              # the host table is closed under the state dict
        torch.save(sd, {str(tmp_path / 'sd.pt')!r})
        back = torch.load({str(tmp_path / 'sd.pt')!r})
        assert torch.equal(back[key], want)
        print("ok")
    """)
    assert out.stdout.strip() == "ok"


# ------------------------------------------------------------------ dropped means freed
def test_dropped_tables_are_freed():
    """300 tables of 1 MiB dropped without close(): RSS grows by less than 60 MiB (it was ~600 MiB)."""
    proc = psutil.Process()
    src = rand(1024, 256, seed=2)  # 1 MiB of fp32 rows
    for _ in range(5):  # warm: allocator pools, lazily built types
        HostTable.from_tensor(src)
    gc.collect()
    before = proc.memory_info().rss
    live = len(_region.live_regions())
    for _ in range(300):
        t = HostTable.from_tensor(src)
        _ = t.tensor[0, 0].item(), t.bytes_view()[0, 0]  # views made and dropped with the table
        del t
    gc.collect()
    grown = proc.memory_info().rss - before
    assert grown < (60 << 20), f"RSS grew by {grown >> 20} MiB"
    assert len(_region.live_regions()) == live


def test_dropped_table_with_a_live_view_is_freed_when_the_view_goes():
    view = HostTable.from_tensor(rand(50, 50, seed=4)).tensor  # the table itself is gone at once
    region = next(r for r in _region.live_regions() if r.base == view.data_ptr())
    assert not region.released
    del view
    assert region.released


def test_dropped_copy_backend_stops_its_worker_and_frees_staging():
    import weakref

    from uvaple.integration import CopyBackend

    t = HostTable.from_tensor(rand(200, 64, seed=5))
    b = CopyBackend(t, device="cpu", max_rows=64)
    b.lookup(torch.tensor([1, 2, 3]))
    worker, staging = b._worker, weakref.ref(b._host_block)
    del b
    deadline = time.monotonic() + 5
    while worker.is_alive() and time.monotonic() < deadline:
        gc.collect()  # the backend sits in reference cycles (its jobs point back at it)
        worker.join(0.1)
    assert not worker.is_alive()
    assert staging() is None
    t.close()
    assert t.released


def test_interpreter_exit_with_live_tables_views_and_threads():
    """Exit with a table never closed, a view in a global and a thread reading it: exit code 0."""
    run_py("""
        import threading, time, torch
        from uvaple.uva import HostTable
        keep = HostTable.from_tensor(torch.randn(4000, 512)).bytes_view()
        t2 = HostTable.empty(100, 100, torch.bfloat16)
        threading.Thread(target=lambda: [int(keep.sum()) for _ in iter(int, 1)], daemon=True).start()
        time.sleep(0.1)
    """)


# ------------------------------------------------------------------ fork
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_fork_after_map_keeps_the_parent_table_and_gives_the_child_zeros():
    """The parent's table is untouched; the child's inherited view reads zeros and its table object
    refuses use with TableForkedError (documented in uvaple.uva.host_table)."""
    src = rand(2000, 96, seed=6)
    t = HostTable.from_tensor(src)
    view = t.tensor
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report, never run pytest machinery; numpy only (torch's OpenMP pool is not
        code = 1  # fork-safe); always _exit
        try:
            arr = view.numpy()
            zeros = not arr.any()
            try:
                _ = t.tensor
                refused = False
            except TableForkedError:
                refused = True
            arr[:] = 7.0  # writes land in the child's own zero pages, not the parent's table
            t.close()  # only the child's copy of the mapping goes
            code = 0 if (zeros and refused) else 3
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    res = os.read(r, 1)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert res == b"\x00", res
    assert torch.equal(t.tensor, src) and torch.equal(view, src)  # the parent's table is unchanged
    t.close()


def test_forked_child_exiting_normally_leaves_the_parent_segment(tmp_path):
    """A child that inherited a shared table and exits through atexit must not unlink the parent's name."""
    name = f"fork-{os.getpid()}-{time.monotonic_ns()}"
    run_py(f"""
        import os, torch
        from uvaple.uva import HostTable
        t = HostTable.from_tensor(torch.arange(40.).reshape(4, 10), name={name!r})
        pid = os.fork()
        if pid == 0:
            import sys
            sys.exit(0)  # atexit hooks run in the child
        os.waitpid(pid, 0)
        assert os.path.exists("/dev/shm/uvaple.{name}")
        assert t.tensor[3, 9].item() == 39.0
        t.close()
        assert not os.path.exists("/dev/shm/uvaple.{name}")
    """)


# ------------------------------------------------------------------ graph capture keeps tables
def test_release_during_a_capture_is_put_off(monkeypatch):
    """A table dropped while a CUDA graph is being captured is released after the capture, not during."""
    calls = []
    monkeypatch.setattr(_region, "_capturing", lambda: True)
    t = HostTable.empty(8, 8, torch.float32, register=False)  # never really registered, also on a GPU
    region = t._region
    region.chunks.append((0, region.length))  # pretend it is registered: a release must sync the devices
    monkeypatch.setattr(_region.cuda_runtime, "synchronize_devices", lambda: calls.append("sync"))
    monkeypatch.setattr(_region.cuda_runtime, "host_unregister", lambda ptr: calls.append("unregister"))
    try:
        t.close()
        assert not region.released and calls == [] and region in _region._deferred
        monkeypatch.setattr(_region, "_capturing", lambda: False)
        _region.drain_deferred()
        assert region.released and calls == ["sync", "unregister"]
    finally:  # never leave a fake-registered region behind for later tests
        region.chunks.clear()
        if region in _region._deferred:
            _region._deferred.remove(region)
        region.release()


# ------------------------------------------------------------------ import changes nothing
def test_import_changes_no_environment_variable():
    out = run_py("""
        import os, json
        before = dict(os.environ)
        import uvaple, uvaple.uva, uvaple.kernels, uvaple.integration, uvaple.integration.models.gemma3n
        import uvaple.integration.models.hf, uvaple.perf.bench, uvaple.perf.peers, uvaple.commands.cli
        import torch
        from uvaple.uva import HostTable
        with HostTable.empty(4, 4, torch.float32) as t:
            from uvaple.kernels import gather_rows
            gather_rows(t.tensor, torch.tensor([1, 2]))
        print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))
    """)
    assert out.stdout.strip() == "[]"


def test_import_installs_no_fork_or_exit_hook():
    """Fork and exit hooks come with the first table, the first lock taken or the first fork gate."""
    out = run_py("""
        import uvaple, uvaple.uva, uvaple.kernels, uvaple.integration, uvaple.integration.models.gemma3n
        import uvaple.integration.telemetry, uvaple.integration.models.vllm.tables, uvaple.commands.cli
        from uvaple.integration import fork
        from uvaple.uva import _region, segments
        print(fork._hooks, _region._hooks_installed, segments._fork_hook)
        with fork.ForkSafeLock():
            print(fork._hooks)
    """)
    assert out.stdout.split() == ["False", "False", "False", "True"], out.stdout


def test_kernels_interpret_cpu_tensors_without_the_environment_variable():
    assert "TRITON_INTERPRET" not in os.environ
    from uvaple.kernels import gather_rows

    src = rand(20, 12, seed=7)
    with HostTable.from_tensor(src) as h:
        out = gather_rows(h.tensor, torch.tensor([3, 0, 19]))
    assert torch.equal(out, src[[3, 0, 19]])


def test_reader_thread_and_close_race():
    """A thread reading a view while another closes the table: reads stay valid throughout."""
    src = rand(512, 128, seed=8)
    t = HostTable.from_tensor(src)
    view = t.bytes_view()
    want = int(np.frombuffer(src.numpy().tobytes(), dtype=np.uint8).astype(np.int64).sum())
    errors = []

    def reader(arr):
        for _ in range(50):
            got = int(arr[:, :512].astype(np.int64).sum())
            if got != want:
                errors.append(got)

    th = threading.Thread(target=reader, args=(view,))
    th.start()
    t.close()
    th.join()
    assert errors == []
    del view
    assert t.released


def test_a_finalizer_on_a_thread_that_holds_the_region_lock_does_not_deadlock():
    """A garbage collection may run a table's finalizer inside code that holds the lock of the region
    registry (any allocation there can trigger one): the lock is re-entrant."""
    with _region._lock:
        t = HostTable.empty(8, 8, torch.float32)
        region = t._region
        del t  # released here, on this thread, under the lock
    assert region.released


def test_views_taken_while_another_thread_closes_never_fault_in_a_process():
    out = run_py("""
        import threading, torch
        from uvaple.uva import HostTable, TableClosedError
        src = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
        for _ in range(300):
            t = HostTable.from_tensor(src)
            got = []
            def take():
                for _ in range(20):
                    try:
                        v = t.bytes_view() if len(got) % 2 else t.tensor
                    except TableClosedError:
                        return
                    got.append(v)
            th = threading.Thread(target=take)
            th.start()
            t.close()
            th.join()
            for v in got:  # every view handed out reads the table's bytes
                assert (torch.as_tensor(v).view(torch.float32).reshape(64, -1)[:, :64] == src).all()
        print("ok")
    """)
    assert out.stdout.strip() == "ok"

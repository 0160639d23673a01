"""Host tables on the CPU: allocation, layout, sharing, loading, lifetime and every bad input."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import save_file

from uvaple.uva import (
    CheckpointError,
    DeviceCapabilityError,
    HostMemoryError,
    HostTable,
    RegistrationError,
    SharedSegmentError,
    TableClosedError,
    _region,
    cuda_runtime,
    memory,
    row_stride_bytes,
    segments,
    system,
)

mapped = system.mapped

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.float8_e4m3fn]


def random_table(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int8, torch.uint8):
        lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
        return torch.randint(lo, hi, (rows, cols), generator=g, dtype=torch.int32).to(dtype)
    return (torch.randn(rows, cols, generator=g) * 3).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, for exact comparison (NaN-safe, -0.0 != +0.0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def shm_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


# ------------------------------------------------------------------ layout and allocation
@pytest.mark.parametrize("row_bytes,stride", [(1, 16), (2, 16), (15, 16), (16, 16), (17, 32), (64, 64),
                                              (100, 112), (128, 128), (129, 144), (160, 160), (161, 176),
                                              (2047, 2048), (15360, 15360), (17920, 17920), (131072, 131072),
                                              (130001, 130016)])
def test_row_stride_policy(row_bytes, stride):
    assert row_stride_bytes(row_bytes) == stride
    assert stride % 16 == 0
    assert stride - row_bytes < 16  # exact: never more than the 16-byte alignment


def test_an_fp8_ngram_table_takes_its_size_and_no_more():
    """160-B fp8 rows (the n-gram PLE table's): host memory is the rows' bytes, rounded to one page."""
    with HostTable.empty(100_003, 160, torch.float8_e4m3fn, register=False) as t:
        assert t.stride_bytes == 160
        assert t.nbytes == system.round_up(100_003 * 160, system.PAGE_SIZE)
        assert t.nbytes - 100_003 * 160 < system.PAGE_SIZE


@pytest.mark.parametrize("rows,cols,dtype", [(1, 1, torch.bfloat16), (1823, 781, torch.float16),
                                             (257, 8960, torch.bfloat16), (33, 7, torch.float32),
                                             (5, 3, torch.int8)])
def test_empty_exact_size_alignment_zeroed(rows, cols, dtype):
    with HostTable.empty(rows, cols, dtype) as t:
        itemsize = torch.empty((), dtype=dtype).element_size()
        stride_bytes = row_stride_bytes(cols * itemsize)
        assert t.shape == (rows, cols) and t.dtype == dtype
        assert t.stride_bytes == stride_bytes and t.stride * itemsize == stride_bytes
        # Exact: the table's bytes rounded to one page, never to a power of two.
        assert t.nbytes == system.round_up(rows * stride_bytes, system.PAGE_SIZE)
        assert t.ptr % system.HUGE_PAGE_SIZE == 0
        assert t.tensor.shape == (rows, cols) and t.tensor.stride() == (t.stride, 1)
        assert t.tensor.data_ptr() == t.ptr
        assert t.bytes_view().shape == (rows, stride_bytes)
        assert not t.bytes_view().any()
        assert t.registered == torch.cuda.is_available()  # "auto"


def test_large_table_is_exactly_sized_and_prefaulted_in_parallel():
    """A 768 MiB table is resident right after empty() and costs its size, not the next power of two."""
    proc = psutil.Process()
    before = proc.memory_info().rss
    rows, cols = 3 * (1 << 18), 512  # 768 MiB of uint8, not a power of two
    with HostTable.empty(rows, cols, torch.uint8, threads=4) as t:
        grown = proc.memory_info().rss - before
        assert t.nbytes == rows * cols
        # All pages are committed by the populate step (no lazy faults later)...
        assert grown >= 0.97 * t.nbytes
        # ...and no more than the table (1 GiB would be the power-of-two rounding).
        assert grown <= t.nbytes + (32 << 20)
    assert proc.memory_info().rss - before < (64 << 20)


def test_threads_touch_disjoint_ranges(monkeypatch):
    calls = []
    real = system.madvise

    def spy(addr, length, advice):
        calls.append((addr, length, advice))
        return real(addr, length, advice)

    monkeypatch.setattr(system, "madvise", spy)
    with HostTable.empty(1000, 256 * 1024, torch.uint8, threads=3) as t:
        populate = sorted((a, n) for a, n, adv in calls if adv == system.MADV_POPULATE_WRITE)
        assert len(populate) == -(-t.nbytes // memory.POPULATE_CHUNK_BYTES)
        covered = t.ptr
        for a, n in populate:
            assert a == covered
            covered += n
        assert covered == t.ptr + t.nbytes


def test_populate_fallback_when_madvise_populate_is_missing(monkeypatch):
    real = system.madvise
    monkeypatch.setattr(system, "madvise", lambda a, n, adv: 22 if adv in (22, 23) else real(a, n, adv))
    with HostTable.empty(64, 4096, torch.uint8) as t:
        assert not t.bytes_view().any()


@pytest.mark.parametrize("populate_works", [True, False])
def test_shared_creator_reserves_only_where_populate_cannot_allocate(monkeypatch, populate_works):
    """MADV_POPULATE_WRITE allocates a segment's pages itself; posix_fallocate only for the touch fallback."""
    real, reserved = system.madvise, []
    if not populate_works:
        monkeypatch.setattr(system, "madvise", lambda a, n, adv: 22 if adv in (22, 23) else real(a, n, adv))
    real_fallocate = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (reserved.append(n), real_fallocate(fd, off, n)))
    src = torch.randint(0, 256, (300, 1000), dtype=torch.uint8)
    with HostTable.shared(shm_name(), 300, 1000, torch.uint8, fill=lambda t: t.write_rows(src)) as t:
        assert torch.equal(t.tensor, src)
        assert (sum(reserved) >= t.nbytes) == (not populate_works) and (not reserved) == populate_works


def test_shared_segment_on_a_full_tmpfs_is_named_and_removed(monkeypatch):
    real = system.madvise

    def full(addr, length, advice):  # shmem refuses pages once the tmpfs is full: EFAULT (not the probe's page)
        return 14 if advice == system.MADV_POPULATE_WRITE and length > system.PAGE_SIZE else real(addr, length, advice)

    monkeypatch.setattr(system, "madvise", full)
    name = shm_name()
    n_live = len(_region.live_regions())
    with pytest.raises(HostMemoryError, match=rf"shared table '{name}'.*filesystem is full.*uvaple shm"):
        HostTable.shared(name, 300, 1000, torch.uint8, fill=lambda t: None)
    assert not os.path.exists(segments.segment_path(name)) and len(_region.live_regions()) == n_live


@pytest.mark.parametrize("bad", [(0, 4), (4, 0), (-1, 4), (3.0, 4)])
def test_bad_shape(bad):
    with pytest.raises(ValueError, match="positive integer shape"):
        HostTable.empty(*bad, torch.float32)


def test_bad_dtype():
    with pytest.raises(TypeError, match="not supported"):
        HostTable.empty(4, 4, torch.float64)


def test_table_bigger_than_free_memory_leaves_nothing_mapped():
    avail = system.mem_available_bytes()
    rows = (avail // 4096) * 2
    n_live = len(_region.live_regions())
    with pytest.raises(HostMemoryError, match="does not fit"):
        HostTable.empty(rows, 4096, torch.uint8)
    assert len(_region.live_regions()) == n_live


def test_populate_failure_unmaps(monkeypatch):
    """ENOMEM while pre-faulting: named error, mapping released, nothing tracked."""
    seen = []
    real = system.madvise

    def fail(addr, length, advice):
        if advice == system.MADV_POPULATE_WRITE:
            seen.append(addr)
            return 12  # ENOMEM
        return real(addr, length, advice)

    monkeypatch.setattr(system, "madvise", fail)
    with pytest.raises(HostMemoryError, match="not enough free memory"):
        HostTable.empty(256, 4096, torch.uint8)
    assert seen and not mapped(seen[0])


def test_mmap_refused_is_named(monkeypatch):
    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(system, "map_anonymous_aligned", refuse)
    with pytest.raises(HostMemoryError, match="mmap of"):
        HostTable.empty(16, 16, torch.uint8)


# ------------------------------------------------------------------ registration (simulated: no GPU here)
@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend a GPU exists; record host_register/unregister calls."""
    state = {"registered": {}, "fail_at": None, "calls": 0, "synced": 0}
    monkeypatch.setattr(cuda_runtime, "cuda_available", lambda: True)
    monkeypatch.setattr(cuda_runtime, "ensure_context", lambda dev: None)
    monkeypatch.setattr(cuda_runtime, "require_host_pointer_access", lambda dev: None)
    monkeypatch.setattr(cuda_runtime, "read_only_register_supported", lambda dev: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def register(ptr, n, flags):
        state["calls"] += 1
        if state["fail_at"] is not None and state["calls"] >= state["fail_at"]:
            raise RegistrationError("cudaErrorHostMemoryAlreadyRegistered (712)")
        state["registered"][ptr] = (n, flags)

    def unregister(ptr):
        del state["registered"][ptr]

    def sync():
        state["synced"] += 1

    monkeypatch.setattr(cuda_runtime, "host_register", register)
    monkeypatch.setattr(cuda_runtime, "host_unregister", unregister)
    monkeypatch.setattr(cuda_runtime, "host_device_pointer", lambda ptr: ptr)
    monkeypatch.setattr(cuda_runtime, "synchronize_devices", sync)
    return state


def test_registration_in_chunks_and_release(fake_cuda, monkeypatch):
    monkeypatch.setattr(memory, "REGISTER_CHUNK_BYTES", 1 << 20)
    t = HostTable.empty(40, 100_000, torch.uint8, register=True, read_only=True)
    assert t.registered and t.read_only_registered and t.device_index == 0
    chunks = sorted(fake_cuda["registered"].items())
    assert len(chunks) == -(-t.nbytes // (1 << 20))
    assert chunks[0][0] == t.ptr and sum(n for _, (n, _) in chunks) == t.nbytes
    assert all(flags == 0x01 | 0x02 | 0x08 for _, (_, flags) in chunks)
    t.close()
    assert fake_cuda["registered"] == {} and fake_cuda["synced"] == 1
    t.close()  # idempotent
    assert fake_cuda["synced"] == 1


def test_registration_pieces_cover_the_table_once(monkeypatch):
    gib = 1 << 30
    # default: one registration per 128 GiB chunk (a copy may not span two registrations)
    assert memory.register_piece_bytes(48 * gib, 16) == memory.REGISTER_CHUNK_BYTES
    assert memory.register_piece_bytes(600 * gib, 1) == memory.REGISTER_CHUNK_BYTES
    monkeypatch.setattr(memory, "REGISTER_MIN_PIECE_BYTES", gib)
    assert memory.register_piece_bytes(48 * gib, 16) == 3 * gib
    assert memory.register_piece_bytes(48 * gib + 1, 16) == 3 * gib + (2 << 20)  # 2 MiB granular
    assert memory.register_piece_bytes(4 * gib, 16) == gib


@pytest.mark.parametrize("threads", [1, 4])
def test_registration_by_several_threads(fake_cuda, monkeypatch, threads):
    monkeypatch.setattr(memory, "REGISTER_MIN_PIECE_BYTES", 1 << 20)
    seen = set()
    register = cuda_runtime.host_register
    together = threading.Barrier(threads, timeout=30)  # every piece waits for the others: one per thread

    def on_thread(ptr, n, flags):
        seen.add(threading.get_ident())
        together.wait()
        register(ptr, n, flags)

    monkeypatch.setattr(cuda_runtime, "host_register", on_thread)
    with HostTable.empty(40, 200_000, torch.uint8, register=True, threads=threads) as t:  # 7.6 MiB
        pieces = sorted((ptr - t.ptr, n) for ptr, (n, _) in fake_cuda["registered"].items())
        assert t._region.chunks == pieces and len(pieces) == threads  # one 2 MiB-granular share per thread
        assert pieces[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False))
        assert sum(n for _, n in pieces) == t.nbytes
        assert len(seen) == threads
    assert fake_cuda["registered"] == {}


@pytest.mark.parametrize("threads", [1, 4])
def test_registration_refused_on_one_thread_rolls_back_all(fake_cuda, monkeypatch, threads):
    monkeypatch.setattr(memory, "REGISTER_MIN_PIECE_BYTES", 1 << 20)
    register, mapped, bases = cuda_runtime.host_register, system.map_anonymous_aligned, []

    def map_and_record(n):
        bases.append(mapped(n))
        return bases[-1]

    def refuse_third(ptr, n, flags):
        if ptr - bases[-1] == (2 << 20 if threads > 1 else 0):
            raise RegistrationError("cudaErrorMemoryAllocation (2)")
        time.sleep(0.01)
        register(ptr, n, flags)

    monkeypatch.setattr(system, "map_anonymous_aligned", map_and_record)
    monkeypatch.setattr(cuda_runtime, "host_register", refuse_third)
    n_live = len(_region.live_regions())
    where = "2.00 MiB at offset 2.00 MiB" if threads > 1 else "7.63 MiB at offset 0 B"
    with pytest.raises(RegistrationError, match=rf"failed for {where}.*ulimit -l"):
        HostTable.empty(40, 200_000, torch.uint8, register=True, threads=threads)
    assert fake_cuda["registered"] == {}
    assert len(_region.live_regions()) == n_live


def test_registration_refused_rolls_back(fake_cuda, monkeypatch):
    monkeypatch.setattr(memory, "REGISTER_CHUNK_BYTES", 1 << 20)
    fake_cuda["fail_at"] = 3
    n_live = len(_region.live_regions())
    with pytest.raises(RegistrationError, match=r"ulimit -l.*copy"):
        HostTable.empty(40, 100_000, torch.uint8, register=True)
    assert fake_cuda["registered"] == {}
    assert len(_region.live_regions()) == n_live


def test_device_pointer_mismatch_is_refused(fake_cuda, monkeypatch):
    monkeypatch.setattr(cuda_runtime, "host_device_pointer", lambda ptr: ptr + 4096)
    with pytest.raises(DeviceCapabilityError, match="copy"):
        HostTable.empty(4, 64, torch.uint8, register=True)
    assert fake_cuda["registered"] == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error; CI has no GPU")
def test_register_true_without_gpu_is_named():
    with pytest.raises(DeviceCapabilityError, match="register=True needs a CUDA GPU"):
        HostTable.empty(4, 64, torch.uint8, register=True)


def test_register_argument_checked():
    with pytest.raises(ValueError, match="register must be"):
        HostTable.empty(4, 64, torch.uint8, register="yes")


# ------------------------------------------------------------------ loading from tensors and arrays
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (1823, 781), (97, 8960)])
def test_from_tensor_bit_exact(dtype, rows, cols):
    src = random_table(rows, cols, dtype, seed=rows + cols)
    with HostTable.from_tensor(src, threads=3) as t:
        assert t.dtype == dtype
        assert torch.equal(bits(t.tensor), bits(src))


def test_from_tensor_cast_and_noncontiguous():
    src = torch.randn(300, 64)[:, ::2]  # strided source
    with HostTable.from_tensor(src, dtype=torch.bfloat16) as t:
        assert torch.equal(bits(t.tensor), bits(src.to(torch.bfloat16)))


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16, np.int8, np.uint8])
def test_from_numpy_bit_exact(np_dtype):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((511, 33)) * 50).astype(np_dtype)
    with HostTable.from_numpy(a) as t:
        assert np.array_equal(t.tensor.numpy(), a)


def test_from_numpy_rejects_bad_input():
    with pytest.raises(TypeError, match="numpy.ndarray"):
        HostTable.from_numpy([[1, 2]])
    with pytest.raises(TypeError, match="float64"):
        HostTable.from_numpy(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="2-D"):
        HostTable.from_numpy(np.zeros(4, dtype=np.float32))


def test_write_rows_bounds():
    with HostTable.empty(10, 8, torch.float32) as t:
        rows = torch.randn(3, 8)
        t.write_rows(rows, row_start=7)
        assert torch.equal(t.tensor[7:], rows)
        with pytest.raises(ValueError, match="do not fit"):
            t.write_rows(rows, row_start=8)
        with pytest.raises(ValueError, match=r"\[n, 8\]"):
            t.write_rows(torch.randn(3, 9))


def test_writable_bytes_commits_and_exposes_exactly_the_rows_asked():
    """A writer that encodes rows itself (the fp8_row quantiser of a vLLM shard) writes into these bytes: the
    rows asked, at the table's stride, and nothing outside them; a range outside the table is refused."""
    name = f"wb{os.getpid()}_{time.monotonic_ns() % 10**9}"
    t = HostTable.shared(name, 10, 6, torch.bfloat16, defer_ready=True)  # writers commit their own pages
    try:
        v = t.writable_bytes(3, 4)
        assert v.shape == (4, t.stride_bytes) and v.dtype == np.uint8
        pattern = np.arange(4 * t.stride_bytes, dtype=np.uint64).astype(np.uint8).reshape(4, -1) | 1
        v[:] = pattern
        t.mark_ready()
        b = t.bytes_view()
        assert np.array_equal(b[3:7], pattern) and not b[:3].any() and not b[7:].any()
        assert t.writable_bytes(10, 0).shape == (0, t.stride_bytes)
        for start, n in ((8, 3), (-1, 2), (0, 11), (True, 1)):
            with pytest.raises(ValueError, match="do not fit a table of 10 rows"):
                t.writable_bytes(start, n)
    finally:
        t.close()


# ------------------------------------------------------------------ safetensors
@pytest.fixture
def ckpt(tmp_path):
    tensors = {
        "model.language_model.embed_tokens_per_layer.weight": random_table(1023, 7 * 48, torch.bfloat16, 3),
        "model.language_model.embed_tokens.weight": random_table(1023, 64, torch.bfloat16, 4),
        "odd": random_table(77, 7, torch.float16, 5),
        "vec": torch.randn(10),
        "wide": torch.randint(0, 10, (4, 4), dtype=torch.int64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("name", ["model.language_model.embed_tokens_per_layer.weight", "odd"])
def test_from_safetensors_bit_exact(ckpt, name):
    path, tensors = ckpt
    with HostTable.from_safetensors(path, name, threads=4) as t:
        assert torch.equal(bits(t.tensor), bits(tensors[name]))


def test_from_safetensors_cast(ckpt):
    path, tensors = ckpt
    with HostTable.from_safetensors(path, "odd", dtype=torch.float32) as t:
        assert torch.equal(t.tensor, tensors["odd"].float())


def test_from_safetensors_small_blocks(ckpt, monkeypatch):
    from uvaple.uva import loading

    monkeypatch.setattr(loading, "_BLOCK_BYTES", 1000)  # many blocks, several threads, partial reads
    path, tensors = ckpt
    name = "model.language_model.embed_tokens_per_layer.weight"
    with HostTable.from_safetensors(path, name, threads=5) as t:
        assert torch.equal(bits(t.tensor), bits(tensors[name]))


def test_from_safetensors_sharded_directory(tmp_path):
    a, b = random_table(300, 96, torch.bfloat16, 7), random_table(20, 8, torch.float32, 8)
    save_file({"x.weight": b}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"m.embed_tokens_per_layer.weight": a}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"x.weight": "model-00001-of-00002.safetensors",
                                            "m.embed_tokens_per_layer.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with HostTable.from_safetensors(tmp_path, "m.embed_tokens_per_layer.weight") as t:
        assert torch.equal(bits(t.tensor), bits(a))
    (tmp_path / "model.safetensors.index.json").unlink()  # no index: headers are searched
    with HostTable.from_safetensors(tmp_path, "m.embed_tokens_per_layer.weight") as t:
        assert torch.equal(bits(t.tensor), bits(a))


def test_from_safetensors_bounded_memory(tmp_path):
    """Loading a 384 MiB tensor grows RSS by the table only: no second full copy in RAM."""
    path = tmp_path / "big.safetensors"
    rows, cols = 3 * 8192, 8192  # 384 MiB bf16, stride == row bytes: straight from the page cache
    data = random_table(rows, cols, torch.bfloat16, 11)
    save_file({"t": data}, str(path))
    digest = int(data.view(torch.int16).sum())
    del data
    proc = psutil.Process()
    before = proc.memory_info().rss
    peak = [before]
    import threading

    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.005)

    w = threading.Thread(target=watch)
    w.start()
    try:
        t = HostTable.from_safetensors(path, "t", threads=4)
    finally:
        stop.set()
        w.join()
    with t:
        assert int(t.tensor.view(torch.int16).sum()) == digest
        assert peak[0] - before <= t.nbytes + (48 << 20)


def corrupt(path, how):
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(raw[: len(raw) - 100])
    elif how == "garbage_json":
        (n,) = struct.unpack("<Q", raw[:8])
        raw[8:8 + n] = b"{" * n
        path.write_bytes(raw)
    elif how == "huge_header":
        raw[:8] = struct.pack("<Q", 1 << 40)
        path.write_bytes(raw)
    elif how == "tiny":
        path.write_bytes(b"abc")
    elif how == "torch_save":  # a checkpoint in torch's own format under a safetensors name
        torch.save({"odd": torch.ones(3, 5)}, path)
    elif how == "bad_offsets":
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header["odd"]["data_offsets"][1] -= 2
        body = json.dumps(header).encode().ljust(n)
        raw[8:8 + n] = body[:n]
        path.write_bytes(raw)


@pytest.mark.parametrize("how,match", [("truncated", "truncated"), ("garbage_json", "corrupt"),
                                       ("huge_header", "corrupt or truncated"), ("tiny", "too short"),
                                       ("bad_offsets", "corrupt"),
                                       ("torch_save", "not a safetensors file \\(a zip archive: torch.save's format")])
def test_bad_checkpoints_are_named(ckpt, how, match):
    path, _ = ckpt
    corrupt(path, how)
    n_live = len(_region.live_regions())
    with pytest.raises(CheckpointError, match=match):
        HostTable.from_safetensors(path, "odd")
    assert len(_region.live_regions()) == n_live


def test_checkpoint_wrong_name_wrong_shape_missing(ckpt, tmp_path):
    path, _ = ckpt
    with pytest.raises(CheckpointError, match="similar name: model.language_model.embed_tokens_per_layer"):
        HostTable.from_safetensors(path, "model.embed_tokens_per_layer.weight")
    with pytest.raises(CheckpointError, match="a table is 2-D, with rows and columns"):
        HostTable.from_safetensors(path, "vec")
    with pytest.raises(TypeError, match="not supported"):
        HostTable.from_safetensors(path, "wide")  # int64 table
    with pytest.raises(CheckpointError, match="does not exist"):
        HostTable.from_safetensors(tmp_path / "nope.safetensors", "odd")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        HostTable.from_safetensors(empty, "odd")


def test_checkpoint_truncated_while_reading_leaves_nothing(ckpt, monkeypatch):
    """The file shrinks under the loader: named error, the half-written table is released."""
    from uvaple.uva import loading

    path, _ = ckpt
    monkeypatch.setattr(loading.os, "preadv", lambda fd, bufs, off: 0)
    n_live = len(_region.live_regions())
    with pytest.raises(CheckpointError, match="ended early"):
        HostTable.from_safetensors(path, "odd")
    assert len(_region.live_regions()) == n_live


# ------------------------------------------------------------------ shared segments
def test_shared_segment_between_processes(tmp_path):
    name = shm_name()
    src = random_table(1001, 257, torch.bfloat16, 21)
    with HostTable.from_tensor(src, name=name) as owner:
        expected = int(src.view(torch.int16).to(torch.int64).sum())
        code = textwrap.dedent(f"""
            import torch
            from uvaple.uva import HostTable
            with HostTable.attach({name!r}, rows=1001, cols=257, dtype=torch.bfloat16) as t:
                assert t.name == {name!r} and t.registered == torch.cuda.is_available()
                print(int(t.tensor.view(torch.int16).to(torch.int64).sum()))
                t.tensor[0, 0] = 7.0  # the owner sees writes: one copy of the table
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout.strip()) == expected
        assert owner.tensor[0, 0].item() == 7.0
    assert not os.path.exists(f"/dev/shm/uvaple.{name}")


def test_attach_errors():
    with pytest.raises(SharedSegmentError, match="no shared table named"):
        HostTable.attach(shm_name())
    with pytest.raises(SharedSegmentError, match="not valid"):
        HostTable.attach("../etc/passwd")
    name = shm_name()
    with HostTable.empty(10, 16, torch.float16, name=name):
        with pytest.raises(SharedSegmentError, match="cols: expected 17, segment has 16"):
            HostTable.attach(name, cols=17)
        with pytest.raises(SharedSegmentError, match="dtype"):
            HostTable.attach(name, dtype=torch.bfloat16)
        with pytest.raises(SharedSegmentError, match="already exists"):
            HostTable.empty(10, 16, torch.float16, name=name)
        with HostTable.attach(name, rows=10, cols=16, dtype=torch.float16) as a:
            assert a.shape == (10, 16)


def test_attach_not_ready_and_corrupt_segments():
    from uvaple.uva import segments

    name = shm_name()
    path = f"/dev/shm/uvaple.{name}"
    # A segment whose creator (this process, holding the build lock) has not finished.
    seg = segments.create(name, {"rows": 4, "cols": 16, "dtype": "F32", "stride_bytes": 64,
                                 "data_offset": segments.DATA_OFFSET}, segments.DATA_OFFSET + 4096)
    try:
        with pytest.raises(SharedSegmentError, match="has not finished"):
            HostTable.attach(name)
    finally:
        seg.fail(RuntimeError("test"))
    assert not os.path.exists(path)
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    try:
        with pytest.raises(SharedSegmentError, match="not a uvaple shared table"):
            HostTable.attach(name)
        assert os.path.exists(path)  # not ours: left alone
    finally:
        os.unlink(path)


def test_owner_close_keeps_attached_mapping_valid():
    """The name stays while another holder has the table open; the last one out unlinks it."""
    name = shm_name()
    src = random_table(50, 40, torch.float32, 2)
    owner = HostTable.from_tensor(src, name=name)
    other = HostTable.attach(name)
    owner.close()
    assert os.path.exists(f"/dev/shm/uvaple.{name}")
    assert torch.equal(other.tensor, src)
    other.close()
    assert not os.path.exists(f"/dev/shm/uvaple.{name}")


def test_shared_failure_while_loading_unlinks(tmp_path):
    name = shm_name()
    with pytest.raises(ValueError):
        HostTable._filled(10, 4, torch.float32, lambda t: (_ for _ in ()).throw(ValueError("boom")),
                          {"name": name})
    assert not os.path.exists(f"/dev/shm/uvaple.{name}")


# ------------------------------------------------------------------ lifetime
def test_close_idempotent_and_use_after_close():
    t = HostTable.empty(8, 8, torch.float32)
    addr = t.ptr
    with t:
        pass
    assert t.closed and not mapped(addr)
    t.close()
    with pytest.raises(TableClosedError):
        _ = t.tensor
    with pytest.raises(TableClosedError):
        t.bytes_view()
    with pytest.raises(TableClosedError):
        t.write_rows(torch.zeros(1, 8))
    assert "closed" in repr(t)


def test_interpreter_exit_releases_everything():
    name = shm_name()
    code = textwrap.dedent(f"""
        import torch
        from uvaple.uva import HostTable
        a = HostTable.empty(100, 64, torch.bfloat16, name={name!r})
        b = HostTable.empty(100, 64, torch.bfloat16)
        c = HostTable.empty(10, 4, torch.float32); c.close()
        print("exiting")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exiting" and "Traceback" not in out.stderr
    assert not os.path.exists(f"/dev/shm/uvaple.{name}")


def test_cuda_view_needs_registration():
    with HostTable.empty(4, 4, torch.float32, register=False) as t:
        with pytest.raises(DeviceCapabilityError, match="registered"):
            t.cuda_view()


# ------------------------------------------------------------------ lifetime hardening
def test_views_keep_the_table_alive():
    """A view outliving every reference to its table keeps the memory mapped (no use-after-unmap)."""
    import gc

    src = random_table(300, 40, torch.float32, 31)
    view = HostTable.from_tensor(src).tensor
    arr = HostTable.from_tensor(src).bytes_view()
    gc.collect()
    assert torch.equal(view, src)
    assert arr.shape == (300, 160) and arr.copy().view(np.float32).tolist() == src.tolist()


def test_host_reader_thread_during_exit_in_a_process():
    """A daemon thread still reading a table (no close) while the interpreter exits: clean exit, no fault."""
    code = textwrap.dedent("""
        import threading, time, torch
        from uvaple.uva import HostTable
        t = HostTable.from_tensor(torch.randn(2000, 256))
        view = t.bytes_view()
        def reader():
            while True:
                int(view.sum())  # a host thread still reading while the interpreter exits
        threading.Thread(target=reader, daemon=True).start()
        time.sleep(0.2)
        del t
        print("exiting")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exiting"


def test_synchronize_devices_covers_live_contexts_and_restores(monkeypatch):
    calls = []

    class FakeRuntime:
        current = 1

        def cudaGetDevice(self):
            return (0, self.current)

        def cudaGetDeviceCount(self):
            return (0, 3)

        def cudaSetDevice(self, d):
            calls.append(("set", d))
            self.current = d
            return (0,)

        def cudaDeviceSynchronize(self):
            calls.append(("sync", self.current))
            return (0,)

    rt = FakeRuntime()
    monkeypatch.setattr(cuda_runtime, "runtime", lambda: rt)
    monkeypatch.setattr(cuda_runtime, "_context_active", lambda d: d != 2)
    cuda_runtime.synchronize_devices()
    assert [c for c in calls if c[0] == "sync"] == [("sync", 0), ("sync", 1)]
    assert rt.current == 1


def test_attach_mmap_failure_is_named(monkeypatch):
    name = shm_name()
    with HostTable.empty(4, 16, torch.float32, name=name):
        def refuse(*a, **k):
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(system, "mmap", refuse)
        with pytest.raises(SharedSegmentError, match="mapping shared table"):
            HostTable.attach(name)


def test_private_tables_filled_by_their_writers_are_not_prefaulted_first(monkeypatch):
    """from_tensor: the copy commits the pages it writes; no pass zeroes the whole table before it."""
    rows, cols = 2048, 32768  # 64 MiB
    src = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    proc = psutil.Process()
    seen = []
    real = HostTable.write_rows

    def spy(self, rows_, row_start=0, **kw):
        seen.append(proc.memory_info().rss - before)
        return real(self, rows_, row_start, **kw)

    monkeypatch.setattr(HostTable, "write_rows", spy)
    before = proc.memory_info().rss
    with HostTable.from_tensor(src) as t:
        assert seen and seen[0] < (16 << 20)
        assert proc.memory_info().rss - before >= 0.97 * t.nbytes and torch.equal(t.tensor, src)

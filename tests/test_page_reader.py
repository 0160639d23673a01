"""The batched reader of a table file: many page reads in flight, each checked, rows copied into their slots by the
caller; rounds bounded by the buffer; a damaged page, a short file and a read that never returns each a named error
that writes no slot. Real files, real threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from helpers import rand

from uvaple.uva import PageReader, ReadTimeout, TableFile, TableFileError, page_reader, uring, write_table_file
from uvaple.uva.table_file import PAGE

POISON = 0xA5


def slots_for(n: int, row_bytes: int) -> torch.Tensor:
    return torch.full((n, row_bytes + 16), POISON, dtype=torch.uint8)  # wider than a row: the tail stays


URING = uring.unavailable()


@pytest.fixture(params=["uring", "threads, compiled", "threads, interpreted"])
def engine(request, monkeypatch):
    """How the reads are kept in flight: this thread's io_uring (where the kernel allows it), or threads, each with
    the compiled loop (zlib found) or the interpreted one (as without zlib's library)."""
    if request.param == "uring":
        if URING is not None:
            pytest.skip(f"io_uring cannot be used here: {URING}")
        return "uring"
    if request.param == "threads, compiled":
        if page_reader._compiled_reader() is None:
            pytest.skip("zlib's library is not found here: the compiled loop is not used")
    else:
        monkeypatch.setattr(page_reader, "_compiled_reader", lambda: None)
    return "threads"


@pytest.mark.parametrize("cols,dtype", [(16, torch.bfloat16), (7, torch.float32), (3000, torch.bfloat16)])
@pytest.mark.parametrize("depth,buffer_pages", [(1, 4096), (8, 3), (32, 4096)])
def test_rows_land_in_their_slots_whatever_the_depth_and_rounds(tmp_path, engine, cols, dtype, depth,
                                                                 buffer_pages):
    """Packed rows (many to a page) and rows of two pages; one thread or many; rounds of three pages (a two-page
    row is never split); rows sharing a page read it once."""
    t = rand(700, cols, dtype, seed=cols)
    write_table_file(tmp_path / "t.uvt", t)
    with TableFile.open(tmp_path / "t.uvt") as f, \
            PageReader(f, depth=depth, buffer_pages=buffer_pages, engine=engine) as r:
        assert r.engine == engine
        g = np.random.default_rng(depth)
        rows = g.choice(700, size=120, replace=False)
        slots = g.permutation(200)[:120]
        row_bytes = f.layout.row_bytes
        dst = slots_for(200, row_bytes)
        r.read_rows_into(rows, dst, slots)
        want = t[torch.from_numpy(rows)].contiguous().view(torch.uint8).reshape(120, row_bytes)
        assert torch.equal(dst[torch.from_numpy(slots), :row_bytes], want)
        assert bool((dst[:, row_bytes:] == POISON).all())  # nothing past a row
        untouched = np.setdiff1d(np.arange(200), slots)
        assert bool((dst[torch.from_numpy(untouched)] == POISON).all())  # no other slot
        lay = f.layout
        pages = len(np.unique(rows // lay.rows_per_page)) if lay.rows_per_page else 120 * lay.pages_per_row
        assert r.pages_read == pages


@pytest.mark.parametrize("fault", ["a page changed", "truncated"])
def test_a_damaged_file_is_the_files_named_error_and_no_slot_is_written(tmp_path, engine, fault):
    t = rand(2000, 16, torch.bfloat16, seed=3)
    path = tmp_path / "t.uvt"
    write_table_file(path, t)
    with TableFile.open(path) as f, PageReader(f, depth=8, engine=engine) as r:
        with open(path, "r+b") as raw:
            if fault == "a page changed":
                raw.seek((1 + 10) * PAGE + 7)  # rows 1,280 .. 1,407
                raw.write(b"\x00\xff")
            else:
                raw.truncate(8 * PAGE)
        rows = np.arange(0, 2000, 37)
        dst = slots_for(len(rows), 32)
        with pytest.raises(TableFileError, match="does not match its sum" if fault == "a page changed" else
                           "ended at byte"):
            r.read_rows_into(rows, dst, np.arange(len(rows)))
        assert bool((dst == POISON).all())  # the rows are copied out only when every read passed


def test_a_read_that_never_returns_is_named_in_time_and_its_late_bytes_go_nowhere(tmp_path, monkeypatch):
    t = rand(500, 16, torch.bfloat16, seed=4)
    write_table_file(tmp_path / "t.uvt", t)
    release = threading.Event()
    with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=4, timeout_s=0.3, engine="threads") as r:
        real = PageReader._read_share

        def stuck(self, pages, out):
            if 0 in np.asarray(pages):  # the read of page 0 hangs until released, then writes its buffer late
                release.wait(30)
                out.fill_(0x11)
                return None
            return real(self, pages, out)

        monkeypatch.setattr(PageReader, "_read_share", stuck)
        dst = slots_for(60, 32)
        t0 = time.monotonic()
        with pytest.raises(ReadTimeout, match="page reads .* had not completed after 0.3 s"):
            r.read_rows_into(np.arange(0, 500, 13), dst, np.arange(39))
        assert time.monotonic() - t0 < 5.0
        monkeypatch.undo()
        rows = np.arange(1, 500, 11)
        r.read_rows_into(rows, dst, np.arange(len(rows)))  # a new round: new buffer, new threads
        release.set()  # the stuck read now writes into the abandoned buffer
        time.sleep(0.1)
        want = t[torch.from_numpy(rows)].view(torch.uint8).reshape(len(rows), 32)
        assert torch.equal(dst[: len(rows), :32], want)


@pytest.mark.skipif(URING is not None, reason=f"io_uring cannot be used here: {URING}")
def test_an_io_uring_read_that_never_returns_is_named_in_time_and_its_late_bytes_go_nowhere(tmp_path, monkeypatch):
    """A read that does not complete (a FIFO with nothing written stands in for a disk that stopped answering): a
    ReadTimeout in about the timeout, the ring and buffer left to the read, the next call on a new ring exact; the
    late bytes land in the abandoned buffer only."""
    import os

    t = rand(500, 16, torch.bfloat16, seed=4)
    write_table_file(tmp_path / "t.uvt", t)
    os.mkfifo(tmp_path / "stuck")
    stuck = os.open(tmp_path / "stuck", os.O_RDWR)
    try:
        with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=4, timeout_s=0.3, engine="uring") as r:
            r.read_rows_into(np.array([3]), slots_for(1, 32), np.array([0]))  # compiled and warm
            monkeypatch.setattr(f, "fileno", lambda: stuck)
            dst = slots_for(60, 32)
            abandoned = len(uring._ABANDONED)
            t0 = time.monotonic()
            with pytest.raises(ReadTimeout, match="had not completed after 0.3 s"):
                r.read_rows_into(np.arange(0, 500, 13), dst, np.arange(39))
            assert time.monotonic() - t0 < 5.0
            assert len(uring._ABANDONED) == abandoned + 1 and r._ring is None
            old_buf = uring._ABANDONED[-1][1]
            monkeypatch.undo()
            rows = np.arange(1, 500, 11)
            r.read_rows_into(rows, dst, np.arange(len(rows)))  # a new ring and buffer
            os.write(stuck, b"\x11" * (4 * PAGE))  # the stuck reads complete now, into the abandoned buffer
            time.sleep(0.1)
            want = t[torch.from_numpy(rows)].view(torch.uint8).reshape(len(rows), 32)
            assert torch.equal(dst[: len(rows), :32], want)
            assert bool((old_buf[:4] == 0x11).all())
    finally:
        os.close(stuck)


class Interrupted(Exception):
    """What the test's SIGINT handler raises (as Python's default handler raises KeyboardInterrupt)."""


@pytest.mark.parametrize("which", ["uring", "threads"])
def test_ctrl_c_stops_a_round_held_by_a_silent_disk_at_once(tmp_path, monkeypatch, which):
    """A read that never completes, a 30 s timeout, and SIGINT 0.3 s in: the handler's exception comes out of the
    read within a second or two (io_uring: the loop hands the interpreter a turn every slice; threads: the wait for
    them is interruptible), the ring or threads and the buffer are left to the reads, and the next call reads on
    new ones, exact; the late bytes land in the abandoned buffer only."""
    if which == "uring" and URING is not None:
        pytest.skip(f"io_uring cannot be used here: {URING}")
    import os
    import signal

    t = rand(500, 16, torch.bfloat16, seed=6)
    write_table_file(tmp_path / "t.uvt", t)
    os.mkfifo(tmp_path / "stuck")
    stuck = os.open(tmp_path / "stuck", os.O_RDWR)
    release = threading.Event()

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGINT, handler)
    # a real SIGINT to the main thread, as a terminal's Ctrl-C (it interrupts a blocking wait there)
    timer = threading.Timer(0.3, signal.pthread_kill, args=(threading.main_thread().ident, signal.SIGINT))
    try:
        with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=4, timeout_s=30, engine=which) as r:
            r.read_rows_into(np.array([3]), slots_for(1, 32), np.array([0]))  # compiled and warm
            if which == "uring":  # (io_uring reads a FIFO; pread refuses one: the threads' read hangs by hand)
                monkeypatch.setattr(f, "fileno", lambda: stuck)
            else:
                def hangs(self, pages, out):  # until released, then writes its buffer late
                    release.wait(30)
                    out.fill_(0x22)
                monkeypatch.setattr(PageReader, "_read_share", hangs)
            abandoned, old_buf = len(uring._ABANDONED), r._buf
            dst = slots_for(60, 32)
            t0 = time.monotonic()
            with pytest.raises(Interrupted):
                timer.start()
                r.read_rows_into(np.arange(0, 500, 13), dst, np.arange(39))  # 4 pages, one a thread
            assert time.monotonic() - t0 < 3.0
            if which == "uring":
                assert len(uring._ABANDONED) == abandoned + 1 and r._ring is None
            assert r._buf is None  # never reused
            assert bool((dst == POISON).all())  # no slot written
            monkeypatch.undo()
            rows = np.arange(2, 500, 9)  # 56 rows
            r.read_rows_into(rows, dst, np.arange(len(rows)))
            want = t[torch.from_numpy(rows)].view(torch.uint8).reshape(len(rows), 32)
            assert torch.equal(dst[: len(rows), :32], want)
            os.write(stuck, b"\x22" * (4 * PAGE))  # the stuck reads complete now, into the abandoned buffer only
            release.set()
            time.sleep(0.2)
            assert torch.equal(dst[: len(rows), :32], want) and bool((old_buf[:4] == 0x22).all())
    finally:
        release.set()
        timer.cancel()
        signal.signal(signal.SIGINT, old)
        os.close(stuck)


@pytest.mark.skipif(URING is not None, reason=f"io_uring cannot be used here: {URING}")
def test_a_round_closed_from_another_thread_and_timed_out_leaves_its_own_buffer_to_its_reads(tmp_path, monkeypatch):
    """``close()`` from another thread while a round waits on a silent disk drops the reader's references; the round
    that then times out leaves the ring and the buffer its reads land in (not None) to them, so the kernel's late
    writes land in memory kept for them."""
    import os

    t = rand(500, 16, torch.bfloat16, seed=7)
    write_table_file(tmp_path / "t.uvt", t)
    os.mkfifo(tmp_path / "stuck")
    stuck = os.open(tmp_path / "stuck", os.O_RDWR)
    try:
        with TableFile.open(tmp_path / "t.uvt") as f:
            r = PageReader(f, depth=4, timeout_s=0.6, engine="uring")
            r.read_rows_into(np.array([3]), slots_for(1, 32), np.array([0]))
            buf, ring = r._buf, r._ring
            monkeypatch.setattr(f, "fileno", lambda: stuck)
            closer = threading.Timer(0.2, r.close)
            closer.start()
            with pytest.raises(ReadTimeout):
                r.read_rows_into(np.arange(0, 500, 13), slots_for(60, 32), np.arange(39))
            closer.join()
            assert uring._ABANDONED[-1][0] is ring and uring._ABANDONED[-1][1] is buf
            os.write(stuck, b"\x33" * (4 * PAGE))
            time.sleep(0.1)
            assert bool((buf[:4] == 0x33).all())  # the late reads, in the buffer kept for them
    finally:
        os.close(stuck)


@pytest.mark.skipif(URING is not None, reason=f"io_uring cannot be used here: {URING}")
def test_an_interrupt_after_every_read_completed_keeps_the_ring(tmp_path, monkeypatch):
    """An interrupt raised as the loop's last call returns, every read back: nothing is in flight, so the ring and
    the buffer stay the reader's (none left to the process), and the next call uses them."""
    t = rand(500, 16, torch.bfloat16, seed=8)
    write_table_file(tmp_path / "t.uvt", t)
    with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=4, engine="uring") as r:
        r.read_rows_into(np.array([3]), slots_for(1, 32), np.array([0]))
        ring, abandoned = r._ring, len(uring._ABANDONED)
        loop = uring.read_loop()

        def read_then_interrupted(*a):
            loop(*a)
            raise KeyboardInterrupt
        monkeypatch.setattr(uring, "read_loop", lambda: read_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            r.read_rows_into(np.arange(0, 500, 13), slots_for(60, 32), np.arange(39))
        monkeypatch.undo()
        assert r._ring is ring and len(uring._ABANDONED) == abandoned
        rows = np.arange(1, 500, 11)
        dst = slots_for(60, 32)
        r.read_rows_into(rows, dst, np.arange(len(rows)))
        want = t[torch.from_numpy(rows)].view(torch.uint8).reshape(len(rows), 32)
        assert torch.equal(dst[: len(rows), :32], want) and r._ring is ring


def test_where_the_kernel_gives_a_ring_the_io_uring_engine_can_be_used():
    """``uring.unavailable()`` turns a loop that fails to compile into "use threads": where this kernel sets up a
    ring and zlib is found, that must not be why (a broken loop would otherwise pass unseen, every io_uring test
    skipped)."""
    import ctypes.util

    if ctypes.util.find_library("z") is None:
        pytest.skip("zlib's library is not found here")
    try:
        uring.Ring(8).close()
    except OSError as e:
        pytest.skip(f"this kernel gives no io_uring ring here: {e}")
    assert URING is None


@pytest.mark.skipif(URING is not None, reason=f"io_uring cannot be used here: {URING}")
def test_a_forked_child_reads_through_a_ring_of_its_own(tmp_path):
    """A ring is one process's: a reader used before a fork makes the child a new ring (the parent's stays the
    parent's, and keeps working); both read the rows asked for."""
    import multiprocessing as mp

    t = rand(400, 16, torch.bfloat16, seed=5)
    write_table_file(tmp_path / "t.uvt", t)
    rows = np.arange(3, 400, 17)
    want = t[torch.from_numpy(rows)].view(torch.uint8).reshape(len(rows), 32)
    with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=4, engine="uring") as r:
        dst = slots_for(len(rows), 32)
        r.read_rows_into(rows, dst, np.arange(len(rows)))
        parent_ring = r._ring
        ctx = mp.get_context("fork")
        q = ctx.Queue()

        def child():
            d = slots_for(len(rows), 32)
            r.read_rows_into(rows, d, np.arange(len(rows)))
            q.put((r._ring is not parent_ring, bool(torch.equal(d[:, :32], want))))

        p = ctx.Process(target=child)
        p.start()
        p.join(60)
        assert p.exitcode == 0 and q.get(timeout=5) == (True, True)
        dst.fill_(POISON)
        r.read_rows_into(rows, dst, np.arange(len(rows)))  # the parent's ring, untouched by the child
        assert r._ring is parent_ring and torch.equal(dst[:, :32], want)


@pytest.mark.skipif(URING is not None, reason=f"io_uring cannot be used here: {URING}")
@pytest.mark.parametrize("how", ["no ring", "entries refused"])
def test_a_ring_that_cannot_be_had_or_fed_turns_the_reader_to_threads(tmp_path, monkeypatch, how):
    """No ring (a limit on rings or locked memory) or a ring whose entries the kernel stops taking: this round and
    the next are read by threads, exact; a refused ring is left to its reads (never reused)."""
    t = rand(300, 16, torch.bfloat16, seed=6)
    write_table_file(tmp_path / "t.uvt", t)
    rows = np.arange(2, 300, 9)
    want = t[torch.from_numpy(rows)].view(torch.uint8).reshape(len(rows), 32)
    with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=4, engine="uring") as r:
        abandoned = len(uring._ABANDONED)
        if how == "no ring":
            monkeypatch.setattr(uring, "Ring", lambda n: (_ for _ in ()).throw(OSError(12, "io_uring_setup: ENOMEM")))
        else:
            monkeypatch.setattr(uring, "read_loop", lambda: lambda *a: uring.REFUSED)
        for _ in range(2):
            dst = slots_for(len(rows), 32)
            r.read_rows_into(rows, dst, np.arange(len(rows)))
            assert r.engine == "threads" and torch.equal(dst[:, :32], want)
        assert len(uring._ABANDONED) == abandoned + (how == "entries refused")


@pytest.mark.skipif(URING is not None, reason=f"io_uring cannot be used here: {URING}")
def test_a_close_from_another_thread_during_a_read_leaves_the_ring_to_that_read(tmp_path, monkeypatch):
    t = rand(300, 16, torch.bfloat16, seed=7)
    write_table_file(tmp_path / "t.uvt", t)
    with TableFile.open(tmp_path / "t.uvt") as f:
        r = PageReader(f, depth=4, engine="uring")
        r.read_rows_into(np.array([1]), slots_for(1, 32), np.array([0]))  # the ring made
        ring, real, go = r._ring, uring.read_loop(), threading.Event()

        def slow(*args):
            go.wait(30)  # a read still out when close() comes
            return real(*args)

        monkeypatch.setattr(uring, "read_loop", lambda: slow)
        dst, done = slots_for(3, 32), []
        reader = threading.Thread(target=lambda: done.append(r.read_rows_into(np.array([5, 6, 7]), dst,
                                                                              np.arange(3))))
        reader.start()
        deadline = time.monotonic() + 10
        while not r._busy and time.monotonic() < deadline:
            time.sleep(0.001)
        r.close()
        assert ring.fd >= 0 and r._ring is ring  # not closed under the read
        go.set()
        reader.join(30)
        assert done == [None] and ring.fd == -1 and r._ring is None  # closed by the read, once it returned
        assert torch.equal(dst[:, :32], t[5:8].view(torch.uint8).reshape(3, 32))


def test_the_engine_is_chosen_and_checked(tmp_path, monkeypatch):
    write_table_file(tmp_path / "t.uvt", rand(10, 4, torch.float32))
    with TableFile.open(tmp_path / "t.uvt") as f:
        assert PageReader(f).engine == ("uring" if URING is None else "threads")  # auto
        assert PageReader(f, engine="threads").engine == "threads"
        with pytest.raises(ValueError, match="engine must be one of 'auto', 'uring', 'threads', got 'aio'"):
            PageReader(f, engine="aio")
        monkeypatch.setattr(uring, "unavailable", lambda: "io_uring_setup(8): Operation not permitted")
        assert PageReader(f).engine == "threads"
        with pytest.raises(ValueError, match=r"engine 'uring': io_uring cannot be used here \(io_uring_setup\(8\): "
                                             r"Operation not permitted\); use engine 'threads' or 'auto'"):
            PageReader(f, engine="uring")


def test_bad_settings_are_named(tmp_path):
    write_table_file(tmp_path / "t.uvt", rand(10, 4, torch.float32))
    with TableFile.open(tmp_path / "t.uvt") as f:
        for kw, match in [(dict(depth=0), "depth must be an int >= 1"), (dict(buffer_pages=True), "buffer_pages"),
                          (dict(timeout_s=0), "timeout_s must be a number of seconds > 0")]:
            with pytest.raises(ValueError, match=match):
                PageReader(f, **kw)
        r = PageReader(f)
        r.close()
        with pytest.raises(TableFileError, match="page reader of .* was closed"):
            r.read_rows_into(np.array([1]), slots_for(1, 16), np.array([0]))
    with pytest.raises(TypeError, match="a page reader reads a TableFile"):
        PageReader(str(tmp_path / "t.uvt"))


def test_a_bad_tensor_or_bad_slots_to_read_into_are_named_and_nothing_is_read(tmp_path):
    t = rand(300, 16, torch.bfloat16, seed=5)
    write_table_file(tmp_path / "t.uvt", t)
    with TableFile.open(tmp_path / "t.uvt") as f, PageReader(f, depth=2, engine="threads") as r:
        rows = np.array([3, 200])
        for bad in (torch.zeros(10, 32, dtype=torch.int8), torch.zeros(320, dtype=torch.uint8),
                    torch.zeros(10, 31, dtype=torch.uint8), np.zeros((10, 32), dtype=np.uint8)):
            with pytest.raises(ValueError, match=r"read into a host uint8 \[slots, >= 32\] tensor"):
                r.read_rows_into(rows, bad, np.array([0, 1]))
        dst = slots_for(10, 32)
        with pytest.raises(ValueError, match="2 rows were given 1 slots"):
            r.read_rows_into(rows, dst, np.array([0]))
        for slots in ([0, 10], [-1, 2]):
            with pytest.raises(ValueError, match=r"outside the 10 rows of the tensor read into"):
                r.read_rows_into(rows, dst, np.array(slots))
        assert r.pages_read == 0 and bool((dst == POISON).all())

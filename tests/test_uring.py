"""``uvaple.perf.uring`` on this machine's disk: io_uring reads from one thread land the bytes asked for, a read
past the end is a named error, and the rate figures are made (where the kernel allows io_uring)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from uvaple.perf import uring

PAGE = uring.PAGE
WHY = uring.unavailable()
needs_uring = pytest.mark.skipif(WHY is not None, reason=f"io_uring is not allowed here: {WHY}")


@pytest.fixture
def pages(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 37 * PAGE, dtype=np.uint8)
    path = tmp_path / "pages.bin"
    path.write_bytes(data.tobytes())
    return str(path), data.reshape(37, PAGE)


@needs_uring
@pytest.mark.parametrize("depth", [1, 3, 8])
def test_each_read_lands_the_page_asked_for(pages, depth):
    path, data = pages
    want = np.array([5, 0, 36, 17, 2, 2, 30, 11], dtype=np.int64)
    r = uring._Reader(path, len(want))  # a buffer page a read (read k lands in page k), ``depth`` in flight
    try:
        r.buf[:] = 0xEE  # poisoned
        lat, wall = r.reads(want * PAGE, len(want), depth, 5.0)
        for k in range(len(want)):
            assert np.array_equal(r.buf[k], data[want[k]]), k
    finally:
        r.close()
    assert lat.shape == (len(want),) and (lat > 0).all() and wall > 0


@needs_uring
def test_a_read_past_the_end_is_named_and_the_ring_closes(pages):
    path, _ = pages
    r = uring._Reader(path, 4)
    try:
        with pytest.raises(OSError, match=r"io_uring read 1 of .*pages.bin \(4 KiB at byte 155648\) was short"):
            r.reads(np.array([0, 38 * PAGE], dtype=np.int64), 2, 2, 5.0)
    finally:
        r.close()
    assert r.ring.fd == -1
    with pytest.raises(ValueError, match=r"a ring holds 1 to 4096 entries, got 0"):
        uring.Ring(0)


@needs_uring
def test_rate_figures(pages):
    path, _ = pages
    r = uring.rate(path, 0, 37, 4, 0.05)
    assert r["depth"] == 4 and r["reads"] >= 4 and r["reads_per_s"] > 0
    assert 0 < r["latency_us_median"] <= r["latency_us_p99"]
    assert len(os.listdir(os.path.dirname(path))) == 1  # nothing written beside the file

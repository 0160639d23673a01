"""Every lookup path, fuzzed: no read outside the table, no write outside ``out``, the reference's bits.

Paths: the ``uva`` placement in id order, sorted and sorted with de-duplication, each also through a hot
set (``HotSet`` passed as ``hot=``); the ``device`` placement in id order and sorted with
de-duplication; the ``copy`` placement; on CUDA also ``lookup_split``. Encodings: bf16, fp32, a scaled
bf16 table read as fp32, fp8 e4m3fn codes times a global scale (``fp8_global``), fp8 e5m2 codes with
their own row scale (``fp8_row``), and 2,053-column bf16 rows (several column tiles per row). Policies:
``zero``, ``row0``, ``neg_zero``. Ids: int32 and int64, of every class (negative, -1, the table's rows and
one past, the edges of a row window and of an id offset, +-2**31 and +-2**63 and their neighbours, huge,
all equal, runs, a mix, none, one, a 0-d id), in 1-, 2- and 3-D shapes.

How a stray read would show. Tables hold random finite values (fp8 tables: every code but the NaN and
infinity codes). Everything next to them holds a sentinel that is NaN with a payload the data cannot
produce, in the table's dtype (bf16/fp16 ``0xFFA5``, fp32 ``0xFFA5A5A5``, fp8 ``0x7F``, NaN in both fp8
formats): each row's padding up to the 16-byte row stride, the mapped bytes after the last row, the rows
of a row window's table outside the window (the rows a shard's neighbours own), and the unused slots of a
hot set; a hot set also holds rows outside the window, which no valid id reaches. So a read outside the
table is a NaN in the output, whatever encoding it went through (``test_a_stray_read_cannot_pass_unseen``
checks that). Every output is a window into a larger buffer poisoned with a second NaN payload (``0x7FBB``,
``0x7FBBBBBB``): an output element never written is NaN too, and the guard elements on both sides must
come back untouched. Results are compared bit for bit with a plain-torch reference (index the table with
the clamped ids, apply the encoding's formula, then the policy), and the lookup's counters (lookups,
rows, out-of-range ids; hits, misses and the served-id histogram of a hot set) with the ids' own count.

Runs on the CPU under Triton's interpreter (tables and lookups are built once per module and closed at
its end) and on CUDA through the ``device`` fixture. Examples per case of ``test_fuzz_lookup``:
``UVAPLE_FUZZ_EXAMPLES`` (default 3); unset, the extended set (``-m extended``) also runs
``test_fuzz_lookup_in_full``, 10 examples per case. On the GPU machine raise it, e.g.
``UVAPLE_FUZZ_EXAMPLES=300 pytest tests/test_fuzz.py``. The examples are derandomised (``tests/conftest.py``);
``--hypothesis-profile=explore`` draws fresh ones. By default ``test_every_id_class`` runs every path and each
encoding on each geometry, the rest of its cases under ``-m extended``.
"""

from __future__ import annotations

import ctypes
import math
import os
import random
import zlib
from dataclasses import dataclass

import pytest
import torch
from helpers import bits, cover, rand
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from uvaple.integration import HotSet, TableSpec, make_lookup
from uvaple.integration.placements.host_gather import gather_path
from uvaple.uva import HostTable

# examples per case: the default set's (unless UVAPLE_FUZZ_EXAMPLES says), the extended set's (test_fuzz_lookup_in_full)
EXAMPLES = int(os.environ.get("UVAPLE_FUZZ_EXAMPLES", "3"))
FULL_EXAMPLES = 10
# the most ids one call draws (sorted workspaces are sized from it): runs of repeats beyond one program's
# ids need more than the 64 a de-duplicating program of short rows holds (tuning.SORTED_MAX_ROWS)
MAX_IDS = 256
# a global fp8 scale that bf16 cannot hold exactly (the kernel rounds it to the output dtype first)
DQ_SCALE = 0.0173
OOBS = ("zero", "row0", "neg_zero")
ID_DTYPES = (torch.int32, torch.int64)
ID_RANGE = {torch.int32: (-(2**31), 2**31 - 1), torch.int64: (-(2**63), 2**63 - 1)}

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _signed(v: int, nbytes: int) -> int:
    return v - (1 << 8 * nbytes) if v >= 1 << (8 * nbytes - 1) else v


# NaN in every float dtype of the size (bf16 and fp16; fp8 e4m3fn and e5m2), payloads the data never has
SENTINEL = {1: 0x7F, 2: _signed(0xFFA5, 2), 4: _signed(0xFFA5A5A5, 4)}
POISON = {2: 0x7FBB, 4: 0x7FBBBBBB}  # NaN as bf16, fp16 and fp32, unlike the sentinel
GUARD = 64  # poisoned elements on each side of every output


def fill(t: torch.Tensor, pattern: dict[int, int]) -> None:
    t.view(_INT[t.element_size()]).fill_(pattern[t.element_size()])


def pattern_bytes(pattern: dict[int, int], itemsize: int, n: int) -> bytes:
    one = (pattern[itemsize] % (1 << 8 * itemsize)).to_bytes(itemsize, "little")
    return (one * (n // itemsize + 1))[:n]


# ------------------------------------------------------------------ what is fuzzed
@dataclass(frozen=True)
class Encoding:
    dtype: torch.dtype
    cols: int  # stored columns (an fp8_row row's 4 scale bytes included)
    block: int  # TableSpec.column_block
    encoding: str = "raw"
    scale: float | None = None
    out_dtype: torch.dtype | None = None

    @property
    def value_cols(self) -> int:
        return self.cols - 4 if self.encoding == "fp8_row" else self.cols

    @property
    def out(self) -> torch.dtype:
        return self.out_dtype or (self.dtype if self.encoding == "raw" else torch.bfloat16)


# widths with padding up to the 16-byte row stride
ENCODINGS = {
    "bf16": Encoding(torch.bfloat16, 13, 4),
    "fp32": Encoding(torch.float32, 6, 3),  # 24-byte rows: the copy placement moves them as 8-byte words
    "scaled": Encoding(torch.bfloat16, 19, 8, scale=-3.3, out_dtype=torch.float32),
    "fp8_global": Encoding(torch.float8_e4m3fn, 37, 16, encoding="fp8_global", out_dtype=torch.bfloat16),
    "fp8_row": Encoding(torch.float8_e5m2, 33, 8, encoding="fp8_row", out_dtype=torch.float16),
    "long": Encoding(torch.bfloat16, 2053, 1024),  # 4,106-byte rows: two tiles direct, five sorted
}


@dataclass(frozen=True)
class Geometry:
    rows: int  # rows the ids may reach
    pre: int = 0  # rows before and after them that no id may read (a row window of a bigger table)
    post: int = 0
    offset: int = 0  # TableSpec.id_offset: the id of physical row 0

    @property
    def physical(self) -> int:
        return self.pre + self.rows + self.post

    @property
    def window(self) -> tuple[int, int] | None:
        return (self.pre, self.pre + self.rows) if self.pre or self.post else None

    @property
    def valid_ids(self) -> tuple[int, int]:
        a = self.offset + self.pre
        return a, a + self.rows


GEOMETRIES = {
    "one": Geometry(1),
    "seven": Geometry(7),
    # a shard whose last valid id is 2**31 - 2: int32's largest id is the first one past it
    "seven_shard": Geometry(7, pre=3, post=4, offset=2**31 - 11),
    "wide": Geometry(700),
    # a shard near the largest id offset (2**62 - 1): only int64 ids reach it
    "wide_shard": Geometry(500, pre=100, post=100, offset=2**62 - 601),
}
# the long rows cost five interpreted programs per id sorted: one geometry, the one with every fence
GEOMETRIES_OF = {e: (("seven_shard",) if e == "long" else tuple(GEOMETRIES)) for e in ENCODINGS}

PATHS = {
    "uva": dict(kind="uva", order="direct"),
    "uva_sorted": dict(kind="uva", order="sorted"),
    "uva_dedup": dict(kind="uva", order="sorted", dedup=True),
    "hot": dict(kind="uva", order="direct", hot="counting"),
    "hot_sorted": dict(kind="uva", order="sorted", hot="plain"),
    "hot_dedup": dict(kind="uva", order="sorted", dedup=True, hot="counting"),
    "device": dict(kind="device", order="direct"),
    "device_dedup": dict(kind="device", order="sorted", dedup=True),
    "copy": dict(kind="copy"),
    "split": dict(kind="split", order="direct"),  # lookup_split: host ids, CUDA only
}


# paths whose calls cost little per id under the interpreter (a program holds many ids, or no kernel)
CHEAP = ("uva_dedup", "hot_dedup", "device_dedup", "copy")


def cheap(path: str, enc: str) -> bool:
    return path in CHEAP and enc != "long"  # a long row's de-duplicating program holds 4 ids


def supported(path: str, enc: str) -> bool:
    return not (path == "copy" and ENCODINGS[enc].encoding != "raw")  # test_copy_refuses_encoded_rows


def marks(path: str) -> list:
    return [pytest.mark.gpu] if path == "split" else []


# ------------------------------------------------------------------ tables and lookups, built once
def table_data(enc: Encoding, rows: int, seed: int) -> torch.Tensor:
    """Random finite rows: raw tables never hold NaN, fp8 tables every code but NaN/infinity."""
    g = torch.Generator().manual_seed(seed)
    if enc.encoding == "raw":
        return rand(rows, enc.cols, enc.dtype, seed=seed)
    if enc.dtype == torch.float8_e4m3fn:  # S.1111.111 is NaN
        allowed = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    else:  # e5m2: exponent 31 is infinity or NaN
        allowed = torch.tensor([c for c in range(256) if c & 0x7C != 0x7C], dtype=torch.uint8)
    codes = allowed[torch.randint(0, len(allowed), (rows, enc.value_cols), generator=g)]
    if enc.encoding == "fp8_row":
        scales = (torch.randn(rows, 1, generator=g) * 0.1).to(torch.float32)
        codes = torch.cat([codes, scales.view(torch.uint8)], dim=1)
    return codes.view(enc.dtype)


class Table:
    """A HostTable of ``enc`` and ``geom`` fenced with sentinels, its reference copy and its hot sets."""

    def __init__(self, name: str, enc: Encoding, geom: Geometry, device: torch.device) -> None:
        self.name, self.enc, self.geom, self.device = name, enc, geom, device
        self.seed = zlib.crc32(self.name.encode())
        self.h = h = HostTable.from_tensor(table_data(self.enc, self.geom.physical, self.seed))
        self.full = torch.as_strided(h.tensor, (h.rows, h.stride), (h.stride, 1))  # rows with their padding
        if h.stride > h.cols:
            fill(self.full[:, h.cols:], SENTINEL)
        g = self.geom
        fill(self.full[: g.pre], SENTINEL)
        fill(self.full[g.pre + g.rows:], SENTINEL)
        self.tail = h.nbytes - h.rows * h.stride_bytes  # mapped bytes after the last row (page rounding)
        if self.tail:
            ctypes.memmove(h.ptr + h.rows * h.stride_bytes, pattern_bytes(SENTINEL, h.itemsize, self.tail),
                           self.tail)
        self.data = h.tensor.clone()  # what the reference indexes
        self.snapshot = self.full.clone()
        self.dq = torch.tensor([DQ_SCALE], dtype=torch.float32, device=device) \
            if self.enc.encoding == "fp8_global" else None
        self._hot: dict[str, tuple[HotSet, set[int]]] = {}

    def hot_set(self, which: str) -> tuple[HotSet, set[int]]:
        """``counting``: a third of the physical rows (the window's first, the row ``row0`` reads, among
        them) with a served-id histogram; ``plain``: another third, without that row, no histogram. Both
        hold rows outside the window too, and keep two slots unused, filled with the sentinel."""
        if which not in self._hot:
            g = self.geom
            perm = torch.randperm(g.physical, generator=torch.Generator().manual_seed(self.seed + 1)).tolist()
            k = max(1, g.physical // 3)
            others = [r for r in perm if r != g.pre]
            held = [g.pre, *others[: k - 1]] if which == "counting" else others[:k]
            hs = HotSet(self.h, min(g.physical, len(held) + 2), self.device, count_ids=which == "counting",
                        rows=torch.tensor(held, dtype=torch.int64) if held else None)
            if hs.capacity > len(held):
                fill(hs.rows[len(held):], SENTINEL)
            self._hot[which] = (hs, set(held))
        return self._hot[which]

    def spec(self, oob: str) -> TableSpec:
        e, g = self.enc, self.geom
        return TableSpec.of(self.h, encoding=e.encoding, oob=oob, scale=e.scale, out_dtype=e.out_dtype,
                            column_block=e.block, row_window=g.window, id_offset=g.offset)

    def assert_unchanged(self) -> None:
        assert torch.equal(bits(self.full), bits(self.snapshot)), f"{self.name}: the table was written"
        if self.tail:
            end = self.h.ptr + self.h.rows * self.h.stride_bytes
            assert ctypes.string_at(end, self.tail) == pattern_bytes(SENTINEL, self.h.itemsize, self.tail)


class Built:
    """Tables and lookups of the module, by name, closed at its end."""

    def __init__(self) -> None:
        self.tables: dict[tuple, Table] = {}
        self.lookups: dict[tuple, object] = {}

    def table(self, enc: str, geom: str, device: torch.device) -> Table:
        key = (enc, geom, str(device))
        if key not in self.tables:
            self.tables[key] = Table(f"{enc}/{geom}", ENCODINGS[enc], GEOMETRIES[geom], device)
        return self.tables[key]

    def lookup(self, path: str, enc: str, geom: str, oob: str, device: torch.device):
        table = self.table(enc, geom, device)
        key = (path, enc, geom, oob, str(device))
        if key not in self.lookups:
            opts = dict(PATHS[path])
            kind, hot = opts.pop("kind"), opts.pop("hot", None)
            if kind == "copy":
                opts["max_in_flight"] = 2
            elif table.dq is not None:
                opts["dequant_scale"] = table.dq
            if hot is not None:
                opts["hot"] = table.hot_set(hot)[0]
            self.lookups[key] = make_lookup(kind, table.h, device=device, spec=table.spec(oob), max_rows=MAX_IDS,
                                            **opts)
        return self.lookups[key], table

    def close(self) -> None:
        for lk in self.lookups.values():
            lk.close()
        for t in self.tables.values():
            t.h.close()


@pytest.fixture(scope="module")
def built():
    b = Built()
    yield b
    b.close()


# ------------------------------------------------------------------ the reference and the checks
def formula(enc: Encoding, picked: torch.Tensor, columns) -> torch.Tensor:
    """Stored rows ``[n, cols]`` to the values a lookup returns: the encoding's formula, in plain torch."""
    c0, c1 = (0, enc.value_cols) if columns is None else columns
    out = enc.out
    if enc.encoding == "fp8_row":  # vLLM's: codes.to(out) * row_scale.to(out), the scale little-endian after
        scale = picked[:, -4:].reshape(-1).clone().view(torch.float32).view(-1, 1)
        return picked[:, c0:c1].to(out) * scale.to(out)
    if enc.encoding == "fp8_global":
        return picked[:, c0:c1].to(out) * torch.tensor([DQ_SCALE], dtype=torch.float32).to(out)
    vals = picked[:, c0:c1]
    if enc.scale is not None:  # HF's emb * embed_scale.to(weight.dtype)
        vals = vals * torch.tensor(enc.scale, dtype=torch.float32).to(enc.dtype)
    return vals.to(out)


def reference(table: Table, ids: list[int], shape: tuple, oob: str, columns) -> tuple[torch.Tensor, list[int]]:
    """(the rows a lookup of ``ids`` returns, the physical rows of its valid ids)."""
    g = table.geom
    lo, hi = g.pre, g.pre + g.rows
    rows = [i - g.offset for i in ids]  # Python ints: no wrap-around
    valid = [lo <= r < hi for r in rows]
    picked = table.data[torch.tensor([r if lo <= r < hi else lo for r in rows], dtype=torch.int64)]
    vals = formula(table.enc, picked, columns)
    if oob != "row0":
        zero = torch.tensor(-0.0 if oob == "neg_zero" else 0.0, dtype=vals.dtype)
        vals = torch.where(torch.tensor(valid, dtype=torch.bool).view(-1, 1), vals, zero)
    return vals.reshape(*shape, vals.shape[-1]), [r for r in rows if lo <= r < hi]


def foreign(out: torch.Tensor) -> str | None:
    """What is wrong with an output no correct lookup can hold a NaN in, or None."""
    nan = torch.isnan(out)
    if not bool(nan.any()):
        return None
    b = out.view(_INT[out.element_size()])
    poison = int((b == POISON[out.element_size()]).sum())
    sentinel = int((b == SENTINEL[out.element_size()]).sum())
    return (f"{int(nan.sum())} NaN in the output: {poison} never written (the poison), {sentinel} the sentinel's "
            f"bits (copied from outside the table), the rest a sentinel read through the encoding")


def guarded(shape: tuple, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a poisoned buffer, the ``shape`` output inside it with GUARD poisoned elements on either side)."""
    n = math.prod(shape)
    buf = torch.empty(n + 2 * GUARD, dtype=dtype, device=device)
    fill(buf, POISON)
    return buf, buf[GUARD: GUARD + n].view(shape)


def counters(lk) -> dict:
    st_ = lk.stats()
    got = {k: st_[k] for k in ("lookups", "rows", "out_of_range_ids", "hot_hits", "hot_misses") if k in st_}
    hot = getattr(lk, "hot", None)
    if hot is not None and hot.id_counts is not None:
        got["id_counts"] = hot.id_counts.cpu().clone()
    return got


def check(lk, table: Table, path: str, oob: str, ids: list[int], shape: tuple, id_dtype: torch.dtype,
          columns=None, share: float | None = None, strided: bool = False) -> None:
    """One call of ``lk`` on poisoned, guarded output: bits, no foreign element, guards, counters.
    ``strided``: the ids are every other element of a bigger tensor (not contiguous)."""
    ctx = (f"{path} {table.name} oob={oob} {id_dtype} shape={shape} columns={columns} share={share} "
           f"strided={strided} ids={ids}")
    host_ids = torch.tensor(ids, dtype=torch.int64).to(id_dtype).reshape(shape)
    if strided:
        wide = torch.full((*shape, 2), 3, dtype=id_dtype)
        wide[..., 0] = host_ids
        host_ids = wide[..., 0]
    want, rows = reference(table, ids, shape, oob, columns)
    buf, out = guarded(tuple(want.shape), want.dtype, table.device)
    before = counters(lk)
    if path == "split":
        got = lk.lookup_split(host_ids, out, gpu_share=share)
    else:
        got = lk.lookup(host_ids.to(table.device), out, columns=columns)
    assert got is out, ctx
    stray = foreign(out)
    assert stray is None, f"{stray}: {ctx}"
    n = len(ids)
    guards = torch.cat([buf[:GUARD], buf[GUARD + n * want.shape[-1]:]]).view(_INT[buf.element_size()])
    assert bool((guards == POISON[buf.element_size()]).all()), f"a write outside out: {ctx}"
    if not torch.equal(bits(out), bits(want)):
        flat_got, flat_want = bits(out).view(n, -1), bits(want).view(n, -1)
        bad = (flat_got != flat_want).any(dim=1).nonzero().view(-1).tolist()
        raise AssertionError(f"rows for ids {[ids[i] for i in bad[:8]]} differ from the reference: {ctx}")
    after = counters(lk)
    want_counts = {"rows": n}
    if path != "split":  # its counters: test_split_lookup_counts_* below
        want_counts.update(lookups=1 if n else 0, out_of_range_ids=n - len(rows))
    if "hot_hits" in after:
        held = table.hot_set(PATHS[path]["hot"])[1]
        hits = sum(r in held for r in rows)
        want_counts.update(hot_hits=hits, hot_misses=len(rows) - hits)
    delta = {k: after[k] - before[k] for k in want_counts}
    assert delta == want_counts, f"counters moved by {delta}, expected {want_counts}: {ctx}"
    if "id_counts" in after:
        served = torch.bincount(torch.tensor(rows, dtype=torch.int64), minlength=table.geom.physical)
        assert torch.equal(after["id_counts"] - before["id_counts"], served), f"served-id histogram: {ctx}"


# ------------------------------------------------------------------ ids
def edge_ids(geom: Geometry, id_dtype: torch.dtype) -> list[int]:
    """One of every id class this geometry and dtype can hold, valid and invalid, plus runs, shuffled."""
    a, b = geom.valid_ids
    p, o = geom.physical, geom.offset
    window = [a, b - 1, (a + b) // 2, a - 1, a - 2, b, b + 1]
    table = [0, 1, -1, -2, -7, p - 1, p, p + 1, geom.rows, geom.rows + 1, o - 1, o, o + p, -b]
    int32 = [2**31 - 1, 2**31 - 2, -(2**31), -(2**31) + 1, 2**31, 2**31 + 1, -(2**31) - 1, 2**32 - 1, 2**32]
    int64 = [2**63 - 1, 2**63 - 2, -(2**63), -(2**63) + 1, 2**62, 2**62 - 1, 2**62 + 1, -(2**62), 2**40, -(2**40)]
    lo, hi = ID_RANGE[id_dtype]
    ids = [v for v in dict.fromkeys(window + table + int32 + int64) if lo <= v <= hi]
    ids += [v for v in [a] * 4 + [b] * 3 + [-1] * 2 if lo <= v <= hi]  # runs of a valid and invalid id
    random.Random(len(ids) * 1000 + p).shuffle(ids)
    return ids


def shapes(n: int) -> list[tuple]:
    if n == 0:
        return [(0,), (0, 3), (2, 0)]
    if n == 1:
        return [(1,), (), (1, 1)]
    out = [(n,), (1, n), (n, 1)] + [(k, n // k) for k in (2, 3) if n % k == 0]
    return out + ([(2, 2, n // 4)] if n % 4 == 0 else [])


def column_ranges(enc: Encoding) -> list:
    v, b = enc.value_cols, enc.block
    stops = [*range(b, v, b), v]
    return [None] + [(s, e) for s in range(0, v, b) for e in stops if e > s]


def rotate(seq, k: int) -> list:
    seq = list(seq)
    k %= len(seq)
    return seq[k:] + seq[:k]


@dataclass(frozen=True)
class Call:
    geom: str
    oob: str
    id_dtype: torch.dtype
    ids: list
    shape: tuple
    columns: tuple | None
    share: float | None
    strided: bool


@st.composite
def calls(draw, path: str, enc_name: str, salt: int) -> Call:
    """A call: geometry, policy and id dtype (rotated by ``salt``, so that each parametrisation's
    derandomised examples start elsewhere), ids of a form, a shape, a column range."""
    geom_name = draw(st.sampled_from(rotate(GEOMETRIES_OF[enc_name], salt)))
    oob = draw(st.sampled_from(rotate(OOBS, salt)))
    id_dtype = draw(st.sampled_from(rotate(ID_DTYPES, salt)))
    geom = GEOMETRIES[geom_name]
    a, b = geom.valid_ids
    lo, hi = ID_RANGE[id_dtype]
    one = st.one_of(st.integers(a, b - 1), st.integers(a - 3, b + 3), st.sampled_from(edge_ids(geom, id_dtype)),
                    st.integers(lo, hi)).map(lambda v: min(max(v, lo), hi))
    forms = ["mixed", "equal", "one"] + ([] if path == "split" else ["none"])  # test_split_lookup_of_no_ids
    form = draw(st.sampled_from(rotate(forms, salt)))
    most = 200 if cheap(path, enc_name) else 40
    if form == "mixed":
        ids = draw(st.lists(one, min_size=2, max_size=most))
    elif form == "equal":
        ids = [draw(one)] * draw(st.integers(2, most))
    else:
        ids = [draw(one)] if form == "one" else []
    enc = ENCODINGS[enc_name]
    columns = None if path == "split" else draw(st.sampled_from(column_ranges(enc)))
    share = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])) if path == "split" else None
    shape = draw(st.sampled_from(shapes(len(ids))))
    return Call(geom_name, oob, id_dtype, ids, shape, columns, share, draw(st.booleans()))


# ------------------------------------------------------------------ the tests
CASES = [(p, e) for p in PATHS for e in ENCODINGS if supported(p, e)]


# by default every path, each encoding on each geometry (every path with every encoding: test_fuzz_lookup; the
# rest: -m extended)
@pytest.mark.parametrize("path,enc,geom", cover([pytest.param(p, e, g, marks=marks(p)) for p, e in CASES
                                                 for g in GEOMETRIES_OF[e]], (0,), (1, 2)))
def test_every_id_class(built, device, path, enc, geom):
    """Every id class in one call, one 0-d id, no ids (and, where calls are cheap, runs of five of each id,
    not contiguous): int64 ids under each policy, int32 ids under one (the policy applies once the id's
    row is found; which one rotates with the geometry and path)."""
    g = GEOMETRIES[geom]
    int32_oob = OOBS[(CASES.index((path, enc)) + list(GEOMETRIES).index(geom)) % len(OOBS)]
    share = 0.5 if path == "split" else None
    table = None
    for oob, id_dtype in [(oob, torch.int64) for oob in OOBS] + [(int32_oob, torch.int32)]:
        lk, table = built.lookup(path, enc, geom, oob, device)
        ids = edge_ids(g, id_dtype)
        check(lk, table, path, oob, ids, (len(ids),), id_dtype, share=share)
        lo, hi = ID_RANGE[id_dtype]
        check(lk, table, path, oob, [min(max(g.valid_ids[0], lo), hi)], (), id_dtype, share=share)
        if path != "split":  # test_split_lookup_of_no_ids
            check(lk, table, path, oob, [], (0,), id_dtype)
        if cheap(path, enc):  # runs of every id, spanning de-duplicating programs
            runs = [v for v in ids for _ in range(5)][:MAX_IDS]
            random.Random(len(runs)).shuffle(runs)
            check(lk, table, path, oob, runs, (len(runs),), id_dtype, strided=True)
    table.assert_unchanged()


def fuzz_one(built, device, path: str, enc: str, data) -> None:
    c = data.draw(calls(path, enc, CASES.index((path, enc))))
    lk, table = built.lookup(path, enc, c.geom, c.oob, device)
    check(lk, table, path, c.oob, c.ids, c.shape, c.id_dtype, columns=c.columns, share=c.share, strided=c.strided)


@pytest.mark.parametrize("path,enc", [pytest.param(p, e, marks=marks(p)) for p, e in CASES])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_lookup(built, device, path, enc, data):
    """Random ids of every class in random shapes, column ranges, policies and geometries."""
    fuzz_one(built, device, path, enc, data)


@pytest.mark.extended
@pytest.mark.skipif("UVAPLE_FUZZ_EXAMPLES" in os.environ, reason="test_fuzz_lookup draws the examples "
                    "UVAPLE_FUZZ_EXAMPLES asks for")
@pytest.mark.parametrize("path,enc", [pytest.param(p, e, marks=marks(p)) for p, e in CASES])
@settings(max_examples=FULL_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_lookup_in_full(built, device, path, enc, data):
    """``test_fuzz_lookup`` with CI's count of examples (10 a case)."""
    fuzz_one(built, device, path, enc, data)


@pytest.mark.parametrize("geom", ["wide", "wide_shard"])
@pytest.mark.parametrize("oob", OOBS)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_copy_placement_in_bulk(device, geom, oob, id_dtype):
    """Calls big enough for the copy placement's worker thread and its bulk gathers (``torch.index_select``
    where torch has as many threads as numba, else numba over every core) over 1,000-byte rows: every id
    class; only valid ids (index_select's direct case); valid ids and one past the end (no negative id)."""
    table = Table(f"bulk/{geom}", Encoding(torch.float32, 250, 250), GEOMETRIES[geom], device)
    n = 1100  # 1.1 MB of rows, above cpu_gather.TORCH_MIN_BYTES
    a, b = table.geom.valid_ids
    lo, hi = ID_RANGE[id_dtype]
    edges = edge_ids(table.geom, id_dtype)
    valid = torch.randint(a, b, (n,), generator=torch.Generator().manual_seed(n)).clamp(lo, hi).tolist()
    try:
        with make_lookup("copy", table.h, device=device, spec=table.spec(oob), max_rows=n, max_in_flight=2) as lk:
            past_end = [*valid[:-4], b, b, a, b]
            for ids in ((edges * (n // len(edges) + 1))[:n], valid, [min(max(v, lo), hi) for v in past_end]):
                check(lk, table, f"copy ({gather_path(n, table.h.row_bytes)} gather)", oob, ids, (n,), id_dtype)
        table.assert_unchanged()
    finally:
        table.h.close()


@pytest.mark.parametrize("enc", ["fp8_global", "fp8_row"])
def test_copy_refuses_encoded_rows(built, device, enc):
    """The copy placement serves rows as stored: an encoded table is refused by name, not misread."""
    table = built.table(enc, "seven", device)
    with pytest.raises(TypeError, match="copy placement serves rows as stored"):
        make_lookup("copy", table.h, device=device, spec=table.spec("zero"))


@pytest.mark.parametrize("enc", list(ENCODINGS))
def test_a_stray_read_cannot_pass_unseen(built, device, enc):
    """The fences are where a stray read lands and every one of them reads as foreign through the
    encoding's formula; the rows ids may reach never do. (Else the fuzzing above could pass by chance.)"""
    for geom in GEOMETRIES_OF[enc]:
        table = built.table(enc, geom, device)
        h, g, e = table.h, table.geom, table.enc
        lo, hi = g.pre, g.pre + g.rows
        every_row = formula(e, table.data[lo:hi], None)
        assert foreign(every_row) is None, table.name  # the data cannot look like a fence
        strays = {"the padding of every row": table.full[:, h.cols:], "rows before the window": table.full[:lo],
                  "rows after the window": table.full[hi:]}
        if table.tail:
            tail = ctypes.string_at(h.ptr + h.rows * h.stride_bytes, table.tail)
            strays["the bytes after the last row"] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
        hs, held = table.hot_set("plain")
        strays["the unused hot slots"] = hs.rows[len(held):].cpu()
        assert h.stride > h.cols and table.tail > 0, table.name  # both fences exist for every table here
        for where, raw in strays.items():
            if raw.numel() == 0:
                continue
            # read as the kernel would: whole rows of the table's dtype (a padding element shifted into a row)
            flat = raw.contiguous().view(torch.uint8).reshape(-1).view(h.dtype)
            stray = flat[: (flat.numel() // h.cols) * h.cols].reshape(-1, h.cols) if flat.numel() >= h.cols else \
                torch.cat([table.data[lo:lo + 1].reshape(-1)[flat.numel():], flat]).reshape(1, h.cols)
            assert foreign(formula(e, stray, None)) is not None, f"{table.name}: {where} would pass unseen"
        assert foreign(guarded((2, 3), e.out, device)[0]) is not None  # the poison is foreign too


def _split_lookup(built, oob: str):
    return built.lookup("split", "bf16", "wide", oob, torch.device("cuda"))


@pytest.mark.gpu
def test_split_lookup_of_no_ids(built):
    """A split call with no ids returns ``out`` (as ``lookup`` does), counting nothing."""
    lk, table = _split_lookup(built, "zero")
    check(lk, table, "split", "zero", [], (0,), torch.int64, share=0.5)


@pytest.mark.gpu
def test_split_lookup_counts_one_call(built):
    """One split call is one lookup in ``stats()``, however its ids are shared between GPU and CPU."""
    lk, _ = _split_lookup(built, "zero")
    before = lk.stats()["lookups"]
    lk.lookup_split(torch.arange(10), torch.empty(10, 13, dtype=torch.bfloat16, device="cuda"), gpu_share=0.5)
    assert lk.stats()["lookups"] - before == 1


@pytest.mark.gpu
def test_split_lookup_counts_out_of_range_ids_under_row0(built):
    """Under ``row0`` the CPU share's out-of-range ids are staged as valid rows; they are counted all the same."""
    lk, _ = _split_lookup(built, "row0")
    before = lk.stats()["out_of_range_ids"]
    ids = torch.tensor([1, 2, 3, 4, -1, 700, 2**40, -(2**63)])  # the out-of-range ids in the CPU share
    lk.lookup_split(ids, torch.empty(8, 13, dtype=torch.bfloat16, device="cuda"), gpu_share=0.5)
    assert lk.stats()["out_of_range_ids"] - before == 4

"""Quantise on load: a float table written block by block as a new ``fp8_row`` host table, with its error
report, by a compiled kernel on every core.

The encoding itself (its row layout, its quantiser and its torch reference) is an entry of
:data:`uvaple.kernels.encodings.ENCODINGS`; its torch quantiser ``quantize_fp8_rows`` is the definition.
This module computes the same bytes in one pass over the source: a numba kernel (``nogil``) per block of
rows, on ``threads`` Python threads, reads a row once (bf16, fp16 or fp32 bits), finds its largest
magnitude, writes its codes and its scale straight into the table, and measures the error of the lookup's
own formula against the source on the way. No temporary of the block's size is made.

Why a kernel. The torch version took 37 s for Gemma 3n E4B's 4.4 GiB on the H200 host (0.12 GB/s of
source). Timed stage by stage here (one torch thread, 16,384 E4B rows of 8,960 bf16 values, scale 16:
0.055 GB/s), 72% of its time was the error report (float64 copies of the block and of its dequantised form,
their difference and ``abs``: 58%; the torch dequantisation: 12%), 15% the fp32 copy and finiteness check,
10% ``abs``/``amax``/divide/clamp, 1.5% the fp8 conversion: about ten passes over memory a block. The kernel
makes one: 0.81 GB/s of source on one core on the same rows (15x), 1.2 GB/s with 1,024-value rows (2-core
VM shared with other jobs: its second thread could not be measured there). Sixteen cores at that rate give
13-19 GB/s if they scale; ``perf/studies/qwen4_exp_e2e.py`` (phase ``startup``) measures them on the H200
host, where the table's pre-fault (``HostTable.empty``, about 8-16 GB/s) is the next cost.

Bits. Every rounding is the one torch makes, written out on the fp32 bits: the scale ``amax / fmax`` (fp32
division) rounded to nearest-even bf16 and moved up one bf16 step where that is below; the codes from
``(x / scale)`` clamped to ``+-fmax``, rounded to nearest-even (subnormals through the fp32 adder, as
c10's conversion does); a scaled source (``scale=``) first as ``src * scale`` in the source dtype (fp32
product, rounded to bf16 / fp16). ``tests/test_qwen4_exp.py`` compares the kernel with
``quantize_fp8_rows`` byte for byte on hard rows (zeros, -0.0, subnormals, the extremes,
all-zero rows, every fp8 code and every rounding boundary between two codes); once, every fp32 value in
``[0, fmax]`` (both formats, their negatives near 0 and fmax) and every positive finite ``amax`` for the
scale were compared exhaustively.

Error report (:class:`QuantError`): per slice of ``slice_cols`` values (Gemma 3n: one layer's 256), the
largest absolute error and the largest error relative to that slice's largest magnitude, over all rows,
in the output dtype; computed in float64 from the same values as before (the source and the dequantised
value ``codes.to(out) * scale.to(out)``), inside the kernel.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch

from uvaple.kernels.encodings import FP8_MAX, ROW_SCALE_BYTES
from uvaple.uva import HostTable, RowSource
from uvaple.uva.workers import default_threads, parallel

__all__ = ["fp8_row_table", "fp8_row_source", "quantize_fp8_rows_into", "QuantError"]

# Source bytes per task: 8 MiB keeps 16 threads evenly busy on a 4 GiB table (512 tasks) and the per-call
# cost of the kernel (a few microseconds) below 0.1%.
_BLOCK_BYTES = 8 << 20
# The kernel's code of a float dtype (1 bf16 bits, 2 fp16 bits, 0 fp32): the sources it reads as they are
# (others go through fp32), and the dtypes its error report is computed in.
_KIND = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}
# (mantissa bits, exponent bias) of each fp8 format
_FP8_BITS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


@dataclass
class QuantError:
    """Quantisation error against the source, per slice of ``slice_cols`` values (see the module docstring)."""

    slice_cols: int
    max_abs: torch.Tensor  # float64 [slices]
    max_rel: torch.Tensor  # float64 [slices]: max |error| / max |source| of the slice, over rows
    rows: int = 0

    def combined(self, other: QuantError) -> QuantError:
        """One report over this one's rows and ``other``'s (the same slices): the larger errors, the rows summed."""
        return QuantError(self.slice_cols, torch.maximum(self.max_abs, other.max_abs),
                          torch.maximum(self.max_rel, other.max_rel), self.rows + other.rows)

    def summary(self) -> dict:
        return {"rows": self.rows, "slice_cols": self.slice_cols, "max_abs": float(self.max_abs.max()),
                "max_rel": float(self.max_rel.max()), "worst_slice": int(self.max_rel.argmax())}


@functools.lru_cache(maxsize=1)
def _kernel():
    """The numba kernel, compiled on first use (numba imports slowly) for each source array type it meets.

    Its inner loops are branch-free (both roundings computed, one selected) so that LLVM vectorises them:
    the fp32 -> fp8 rounding of the codes, the dequantised value (the rounded magnitude itself, times the
    row's scale in the output dtype) and the float64 error.
    """
    import numba

    jit = numba.njit(nogil=True, cache=False, inline="always", error_model="numpy")

    @jit
    def f32(bits):  # fp32 value of int bits
        return np.uint32(bits & 0xFFFFFFFF).view(np.float32)

    @jit
    def bits32(x):
        return np.int64(np.float32(x).view(np.uint32))

    @jit
    def bf16_bits(b):
        """fp32 bits (finite or inf) -> the nearest-even bf16, as fp32 bits (torch's rounding)."""
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16

    @jit
    def widen16(h):
        """fp16 bits -> fp32 value (exact)."""
        sign = (h & 0x8000) << 16
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        sub = np.float32(m) * np.float32(2.0 ** -24)
        normal = f32(sign | ((e + 112) << 23) | (m << 13))
        special = f32(sign | 0x7F800000 | (m << 13))
        v = normal if e != 0 else (-sub if sign else sub)
        return special if e == 31 else v

    @jit
    def fp16_round(x):
        """fp32 value -> the nearest-even fp16 value (inf past its range, NaN kept), as fp32."""
        if x != x:
            return x
        b = bits32(x)
        sign = b & 0x80000000
        a = b ^ sign
        sub = (f32(a) + np.float32(0.5)) - np.float32(0.5)  # below 2^-14: steps of 2^-24, by the fp32 adder
        r = (a + 0xFFF + ((a >> 13) & 1)) >> 13 << 13
        v = f32(r) if a < 0x477FF000 else np.float32(np.inf)  # 65520 rounds to inf
        v = sub if a < (113 << 23) else v
        return -v if sign else v

    @jit
    def encode(x, sb, fmax32, shift, rebias, min_normal, magic):
        """fp32 ``x`` -> (its fp8 code for scale ``sb``, the code's magnitude as fp32, the sign bit)."""
        q = min(max(x / sb, -fmax32), fmax32)
        b = bits32(q)
        sign = b & 0x80000000
        a = b ^ sign
        up = (a + (1 << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift  # nearest-even, fp32 exponent
        sub = f32(a) + magic  # below the smallest normal the fp32 adder rounds to the format's step
        small = a < min_normal
        code = (bits32(sub) - bits32(magic)) if small else up + (rebias >> shift)
        mag = (sub - magic) if small else f32(up << shift)
        return code | (sign >> 24), mag, sign

    @jit
    def error_bits(p, sign, x):
        """float64 bits of |(+-p) - x| and of |x| (ordered as the magnitudes are)."""
        deq = -np.float64(p) if sign else np.float64(p)
        d = np.int64(np.float64(abs(deq - np.float64(x))).view(np.uint64))
        return d, np.int64(np.float64(abs(np.float64(x))).view(np.uint64))

    @jit
    def slice_fast(row, out, j0, j1, sb, s_out, fmax32, shift, rebias, min_normal, magic, bf16):
        d_top = np.int64(0)
        m_top = np.int64(0)
        for j in range(j0, j1):
            x = row[j]
            code, mag, sign = encode(x, sb, fmax32, shift, rebias, min_normal, magic)
            out[j] = code
            p = mag * s_out
            pb = f32(bf16_bits(bits32(p)))
            d, m = error_bits(pb if bf16 else p, sign, x)
            d_top = max(d_top, d)
            m_top = max(m_top, m)
        return d_top, m_top

    @jit
    def slice_fp16(row, out, j0, j1, sb, s_out, fmax32, shift, rebias, min_normal, magic):
        d_top = np.int64(0)
        m_top = np.int64(0)
        for j in range(j0, j1):
            x = row[j]
            code, mag, sign = encode(x, sb, fmax32, shift, rebias, min_normal, magic)
            out[j] = code
            d, m = error_bits(fp16_round(mag * s_out), sign, x)
            d_top = max(d_top, d)
            m_top = max(m_top, m)
        return d_top, m_top

    @numba.njit(nogil=True, cache=False, error_model="numpy")
    def quantize_block(src, kind, factor, out, mant, bias, fmax, out_kind, slice_cols, max_abs, max_rel, row):
        # src [n, cols]: int16 (bf16/fp16 bits, ``kind`` 1/2) or float32 (kind 0); factor: fp32 value of the scale
        # in the source dtype, or 0 for none; out [n, >= cols + 4] uint8: the rows' codes then scale bytes;
        # mant, bias, fmax: the fp8 format; out_kind: the error report's dtype (0 fp32, 1 bf16, 2 fp16);
        # max_abs / max_rel [slices] float64, updated; row [cols] fp32 scratch. Returns the first row (in the
        # block) holding inf or NaN, or -1.
        n, cols = src.shape
        rowb = row.view(np.uint32)
        tiny = f32(1 << 16)  # 2^-133, the smallest positive bf16
        fmax32 = np.float32(fmax)
        shift = 23 - mant
        rebias = (bias - 127) << 23
        min_normal = (128 - bias) << 23  # fp32 bits of the format's smallest normal
        magic = f32((128 - bias - mant + 23) << 23)  # a float whose ulp is the format's subnormal step
        for i in range(n):
            # 1. the row as fp32: scaled and rounded to the source dtype where a factor is given
            if kind == 1:
                for j in range(cols):
                    rowb[j] = (np.int64(src[i, j]) & 0xFFFF) << 16
            elif kind == 2:
                for j in range(cols):
                    row[j] = widen16(np.int64(src[i, j]) & 0xFFFF)
            else:
                for j in range(cols):
                    row[j] = src[i, j]
            if factor != 0:
                if kind == 1:
                    for j in range(cols):
                        rowb[j] = bf16_bits(bits32(row[j] * factor))
                elif kind == 2:
                    for j in range(cols):
                        row[j] = fp16_round(row[j] * factor)
                else:
                    for j in range(cols):
                        row[j] = row[j] * factor
            # 2. the largest magnitude, on the bits (inf and NaN lie above every finite value)
            top = np.int64(0)
            for j in range(cols):
                top = max(top, np.int64(rowb[j]) & 0x7FFFFFFF)
            if top >= 0x7F800000:
                return i
            # 3. the scale: amax / fmax rounded up to a bf16 value, never below the smallest one; 1 for zeros
            if top > 0:
                s = f32(top) / fmax32
                sb = f32(bf16_bits(bits32(s)))
                if sb < s:
                    sb = f32(bits32(sb) + (1 << 16))
                sb = max(sb, tiny)
            else:
                sb = np.float32(1.0)
            sbits = bits32(sb)
            for k in range(4):
                out[i, cols + k] = (sbits >> (8 * k)) & 0xFF
            s_out = sb if out_kind != 2 else fp16_round(sb)  # exact in bf16 and fp32
            # 4. codes, and the error of codes.to(out) * scale.to(out) per slice. The maxima are taken on the
            # float64 bits (monotone for magnitudes, NaN above inf: it stays, as in torch's amax): integer
            # reductions vectorise, float ones do not without reordering.
            for j0 in range(0, cols, slice_cols):
                j1 = min(cols, j0 + slice_cols)
                if out_kind == 2:
                    d_top, m_top = slice_fp16(row, out[i], j0, j1, sb, s_out, fmax32, shift, rebias, min_normal, magic)
                else:
                    d_top, m_top = slice_fast(row, out[i], j0, j1, sb, s_out, fmax32, shift, rebias, min_normal, magic,
                                              out_kind == 1)
                d_max = np.uint64(d_top).view(np.float64)
                m_max = np.uint64(m_top).view(np.float64)
                rel = d_max / m_max if m_max > 0 else d_max
                s_i = j0 // slice_cols
                if d_max > max_abs[s_i] or d_max != d_max:
                    max_abs[s_i] = d_max
                if rel > max_rel[s_i] or rel != rel:
                    max_rel[s_i] = rel
        return -1

    return quantize_block


def _as_kernel_source(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """A CPU block as the kernel reads it: (array of bits or fp32, source kind)."""
    kind = _KIND[x.dtype]
    if kind:
        return x.view(torch.int16).numpy(), kind
    return x.numpy(), 0


def quantize_fp8_rows_into(src: torch.Tensor | list[torch.Tensor], out: np.ndarray,
                           fmt: torch.dtype = torch.float8_e4m3fn, *, out_dtype: torch.dtype | None = None,
                           slice_cols: int = 256, scale: float | None = None, row_start: int = 0,
                           threads: int | None = None) -> QuantError:
    """Write ``src [rows, cols]`` (any float dtype and device), or a list of such parts stacked on rows (a
    checkpoint's shards), as ``fp8_row`` rows into ``out`` (numpy ``uint8`` ``[rows, >= cols + 4]``, e.g. a
    table's :meth:`~uvaple.uva.HostTable.bytes_view`): the bytes of ``quantize_fp8_rows(src * scale, fmt)``.
    Every part's blocks share one pool of ``threads`` threads. Returns the error report in ``out_dtype``
    (default ``src``'s). ``row_start`` only names rows in errors. Raises ``ValueError`` naming the first row
    holding inf or NaN."""
    parts = [src] if isinstance(src, torch.Tensor) else list(src)
    if not parts or any(p.dim() != 2 or p.shape[1] != parts[0].shape[1] or p.dtype != parts[0].dtype for p in parts):
        raise TypeError("quantize_fp8_rows_into expects a 2-D float tensor or a list of them of one width and dtype")
    dtype, cols = parts[0].dtype, parts[0].shape[1]
    rows = sum(p.shape[0] for p in parts)
    out_dtype = out_dtype or dtype
    if out_dtype not in _KIND:
        raise TypeError(f"the error report is measured in bf16, fp16 or fp32, not {out_dtype}")
    if out.dtype != np.uint8 or out.ndim != 2 or out.shape[0] != rows or out.shape[1] < cols + ROW_SCALE_BYTES:
        raise ValueError(f"out must be uint8 [{rows}, >= {cols + ROW_SCALE_BYTES}], got {out.dtype} {out.shape}")
    mant, bias = _FP8_BITS[fmt]
    kernel = _kernel()
    factor_t = None if scale is None else torch.tensor(float(scale), dtype=torch.float32).to(dtype)
    slices = -(-cols // slice_cols)
    direct = dtype in _KIND
    factor = 0.0 if factor_t is None or not direct else float(factor_t.to(torch.float32))
    block = max(1, _BLOCK_BYTES // (cols * parts[0].element_size()))
    ranges, base = [], 0  # (part, first row of the part in out, first row in the part, rows)
    for part in parts:
        ranges += [(part, base, r, min(block, part.shape[0] - r)) for r in range(0, part.shape[0], block)]
        base += part.shape[0]
    results, lock = [], threading.Lock()

    def run(part: torch.Tensor, base: int, r: int, n: int) -> None:
        x = part[r:r + n].detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if not direct:  # another float dtype: its rounding of the scaled rows, then fp32 (the definition's view)
            x = (x * factor_t if factor_t is not None else x).to(torch.float32)
        arr, kind = _as_kernel_source(x)
        max_abs = np.zeros(slices, dtype=np.float64)
        max_rel = np.zeros(slices, dtype=np.float64)
        scratch = np.empty(cols, dtype=np.float32)
        bad = kernel(arr, kind, np.float32(factor), out[base + r:base + r + n], mant, bias, FP8_MAX[fmt],
                     _KIND[out_dtype], slice_cols, max_abs, max_rel, scratch)
        with lock:
            results.append((max_abs, max_rel, -1 if bad < 0 else base + r + bad))

    parallel(run, ranges, threads or default_threads(), name="uvaple-quantize")
    bad_rows = [b for _, _, b in results if b >= 0]
    if bad_rows:
        raise ValueError(f"row {min(bad_rows) + row_start} holds inf or NaN: an fp8 scale cannot represent it; fix "
                         "the weights or keep this table unquantised")
    max_abs = np.maximum.reduce([a for a, _, _ in results])
    max_rel = np.maximum.reduce([r for _, r, _ in results])
    return QuantError(slice_cols, torch.from_numpy(max_abs), torch.from_numpy(max_rel), rows)


def fp8_row_table(src: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn, *, out_dtype: torch.dtype | None = None,
                  slice_cols: int = 256, scale: float | None = None, threads: int | None = None,
                  **table_kw) -> tuple[HostTable, QuantError]:
    """A new ``fp8_row`` :class:`HostTable` holding ``src`` quantised (written block by block by the kernel: no
    quantised copy in RAM), and its error report against ``src`` in ``out_dtype`` (default ``src``'s).

    ``scale``: quantise ``src * torch.tensor(scale).to(src.dtype)`` (rounded to ``src``'s dtype, as HF's
    scaled embedding computes its output) instead, and measure the error against those values: the table
    then serves what the scaled embedding returns, with no second scale at lookup time. ``threads``: the
    quantising threads (default ``min(16, cores)``). ``table_kw`` go to :meth:`HostTable.empty` (``name=``,
    ``register=``, ...)."""
    rows, cols = src.shape if isinstance(src, torch.Tensor) and src.dim() == 2 else (0, 0)
    if not rows or not cols:
        raise TypeError(f"fp8_row_table expects a non-empty 2-D float tensor, got {src!r:.80}")
    if src.dtype not in _KIND:
        raise TypeError(f"backend_options['quantize'] (fp8_row_table) needs a bf16, fp16 or fp32 table, this one is "
                        f"{src.dtype}")
    if fmt not in _FP8_BITS:
        raise TypeError(f"fp8_row codes are float8_e4m3fn or float8_e5m2, not {fmt}")
    if isinstance(slice_cols, bool) or not isinstance(slice_cols, int) or slice_cols <= 0:
        raise ValueError(f"slice_cols must be a positive int, got {slice_cols!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a Python number, got {type(scale).__name__}")
    table = HostTable.empty(rows, cols + ROW_SCALE_BYTES, fmt, **table_kw)
    try:
        err = quantize_fp8_rows_into(src, table.bytes_view(), fmt, out_dtype=out_dtype, slice_cols=slice_cols,
                                     scale=scale, threads=threads)
    except BaseException:
        table.close()
        raise
    return table, err


def fp8_row_source(rows: RowSource, fmt: torch.dtype = torch.float8_e4m3fn) -> RowSource:
    """``rows`` (bf16, fp16 or fp32) as ``fp8_row`` rows, each block quantised as a table file's writer asks for
    it (by the kernel, on the writer's thread: the bytes of ``quantize_fp8_rows``); a table larger than host memory
    streams through. A row holding inf or NaN is a ValueError naming it."""
    if rows.dtype not in _KIND:
        raise TypeError(f"fp8_row quantises bf16, fp16 or fp32 rows, not {rows.dtype}: keep this table as stored")
    if fmt not in _FP8_BITS:
        raise TypeError(f"fp8_row codes are float8_e4m3fn or float8_e5m2, not {fmt}")

    def block(a: int, b: int) -> torch.Tensor:
        out = torch.empty(b - a, rows.cols + ROW_SCALE_BYTES, dtype=torch.uint8)
        quantize_fp8_rows_into(rows.block(a, b), out.numpy(), fmt, row_start=a, threads=1)
        return out.view(fmt)

    return RowSource(rows.rows, rows.cols + ROW_SCALE_BYTES, fmt, block)

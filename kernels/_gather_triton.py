"""Triton source of the row gather (launched by :mod:`uvaple.kernels.gather`; see its docstring).

Loaded twice by :mod:`uvaple.kernels._jit`: compiled (CUDA tensors) and interpreted (CPU tensors).
"""

import triton.language as tl

from ._jit import kernel_decorator

jit = kernel_decorator(__name__)


@jit
def safe_row(ids_ptr, pid, n_rows):
    """(row, valid) for program ``pid``: the id as int64, replaced by 0 when outside ``[0, n_rows)`` so
    that no address outside the table is ever formed, whatever the id."""
    row = tl.load(ids_ptr + pid).to(tl.int64)
    valid = (row >= 0) & (row < n_rows)
    return tl.where(valid, row, 0), valid


@jit
def _f32_to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even; NaN becomes the quiet NaN 0x7FC0 (as torch does)."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@jit
def _to_f32(x, DTYPE: tl.constexpr):
    """Widen to fp32 exactly. bf16 is the top half of an fp32, so it is widened with a shift: the
    interpreter's own bf16 conversion mangles subnormals."""
    if DTYPE == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@jit
def _round_f32(x, DTYPE: tl.constexpr):
    """Round an fp32 tile to ``DTYPE`` exactly as torch does (one RNE rounding)."""
    if DTYPE == tl.bfloat16:
        return _f32_to_bf16_rne(x)
    elif DTYPE == tl.float16:
        return x.to(tl.float16)
    else:
        return x


# n_ids changes from call to call (1 in decode, thousands in prefill) and only feeds the counters: not
# specialised, so a new batch size never compiles a new variant (perhaps inside a graph capture).
@jit(do_not_specialize=["scale_bits", "n_ids"])
def gather_rows_kernel(
    table_ptr,  # *Pointer* to row 0 of the table (host memory through UVA, or HBM)
    ids_ptr,  # *Pointer* to the flattened ids, int32 or int64
    out_ptr,  # *Pointer* to the output [n_ids, n_cols], contiguous
    counters_ptr,  # *Pointer* to int64 [3]: lookups, rows, out-of-range ids (read only when COUNT)
    n_ids,  # ids in this call
    n_rows,  # rows in the table: valid ids are 0 <= id < n_rows
    table_stride,  # elements between two table rows (>= the row length, padded)
    col_start,  # first column of the range to copy
    n_cols,  # columns to copy per row
    scale_bits,  # int32: the bits of the fp32 scale, already rounded to the table dtype (HAS_SCALE)
    HAS_SCALE: tl.constexpr,  # multiply by the scale with the model's rounding
    CONVERT: tl.constexpr,  # go through fp32 (scale or a different output dtype)
    OOB_ROW0: tl.constexpr,  # out-of-range ids read row 0 (else they give a zero row)
    COUNT: tl.constexpr,  # add to the counters (one atomic per call, one per out-of-range id)
    BLOCK: tl.constexpr,  # columns per program
):
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row, valid = safe_row(ids_ptr, pid, n_rows)
    if COUNT:
        if tile == 0:
            first = pid == 0
            tl.atomic_add(counters_ptr, 1, mask=first, sem="relaxed")
            tl.atomic_add(counters_ptr + 1, n_ids, mask=first, sem="relaxed")
            tl.atomic_add(counters_ptr + 2, 1, mask=valid == 0, sem="relaxed")
    if OOB_ROW0:
        limit = n_cols
    else:
        limit = tl.where(valid, n_cols, 0)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    load_mask = cols < limit
    x = tl.load(table_ptr + row * table_stride + col_start + cols, mask=load_mask, other=0)
    if CONVERT:
        v = _to_f32(x, table_ptr.dtype.element_ty)
        if HAS_SCALE:
            # The scale travels as its bits: no float argument conversion can touch -0.0 or a subnormal.
            scale = scale_bits.to(tl.int32).to(tl.float32, bitcast=True)
            v = _round_f32(v * scale, table_ptr.dtype.element_ty)
            v = _to_f32(v, table_ptr.dtype.element_ty)
        v = _round_f32(v, out_ptr.dtype.element_ty)
        if not OOB_ROW0:
            v = tl.where(load_mask, v, 0.0)  # +0.0 whatever the scale (negative, inf, NaN)
        y = v.to(out_ptr.dtype.element_ty)
    else:
        y = x
    tl.store(out_ptr + pid * n_cols + cols, y, mask=cols < n_cols)

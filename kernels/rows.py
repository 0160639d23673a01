"""Device code every gather kernel shares: the ids prologue, fp8 widening, rounding, the row policy.

``safe_row`` (``clamp_row`` for an id computed in the kernel) turns an id into a row that is always inside the
table; ``convert_rows`` turns loaded elements into the output's values (fp8 dequantisation with a global or the
row's own scale, the model's scale with its rounding, the output dtype, zero rows for out-of-range ids). Every
gather kernel (:mod:`.gather`, :mod:`.gather_sorted`, :mod:`.gather_ngram`) calls them, so all paths give the
same bits.

Rounding: with a scale, the result is bit-identical to HF Gemma 3n's ``emb * scale.to(weight.dtype)``: the
scale is rounded to the table dtype on the host (and passed as its fp32 bits, so -0.0 and subnormals arrive
intact), the product is formed in fp32 and rounded once to the table dtype with round-to-nearest-even,
then converted to the output dtype. NaN results are NaN; their sign and payload are the device's. bf16 is
widened with a shift and narrowed with integer ops (Triton's interpreter mangles bf16 subnormals and rounds
half away from zero; the GPU's own conversions give the same bits as these), so CPU and GPU agree.

Loaded twice by :mod:`uvaple.kernels.jit`: compiled (CUDA tensors) and interpreted (CPU tensors).
"""

import triton.language as tl

from .jit import kernel_decorator

jit = kernel_decorator(__name__)


@jit
def program_row(n_cols, BLOCK: tl.constexpr, ROW_TILES: tl.constexpr):
    """(output row, column tile) of this program: a 2-D grid (row on axis 0, tile on axis 1), or with
    ``ROW_TILES`` a 1-D grid whose programs take the tiles of a row side by side."""
    if ROW_TILES:
        n_tiles = (n_cols + BLOCK - 1) // BLOCK
        flat = tl.program_id(0).to(tl.int64)
        pid = flat // n_tiles
        tile = (flat - pid * n_tiles).to(tl.int32)
    else:
        pid = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
    return pid, tile


@jit
def tile_columns(valid, tile, n_cols, BLOCK: tl.constexpr, OOB_ROW0: tl.constexpr):
    """(the tile's columns, the mask of those a row loads): every column of the range, none for an id outside
    the table unless ``OOB_ROW0`` (it then reads the window's first row)."""
    if OOB_ROW0:
        limit = n_cols
    else:
        limit = tl.where(valid, n_cols, 0)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    return cols, cols < limit


@jit
def count_call(counters_ptr, pid, tile, n_ids, valid):
    """The counters of a call, from column tile 0 of each row: program 0 adds one lookup and its ``n_ids`` rows,
    each row outside the table one out-of-range id (relaxed atomics)."""
    if tile == 0:
        first = pid == 0
        tl.atomic_add(counters_ptr, 1, mask=first, sem="relaxed")
        tl.atomic_add(counters_ptr + 1, n_ids, mask=first, sem="relaxed")
        tl.atomic_add(counters_ptr + 2, 1, mask=valid == 0, sem="relaxed")


@jit
def safe_row(ids_ptr, pid, id_base, row_lo, n_rows):
    """(row, valid) for program ``pid``: its id (loaded) as a row inside the table, :func:`clamp_row`."""
    return clamp_row(tl.load(ids_ptr + pid).to(tl.int64), id_base, row_lo, n_rows)


@jit
def clamp_row(id, id_base, row_lo, n_rows):
    """(row, valid): the row ``id - id_base`` (int64), replaced by ``row_lo`` when outside ``[row_lo, n_rows)``
    so that no address outside the table (or its window) is ever formed. (``0 <= id_base < 2**62``: a wrapped
    difference of an extreme id is still far above ``n_rows``.)"""
    row = id - id_base
    valid = (row >= row_lo) & (row < n_rows)
    return tl.where(valid, row, row_lo), valid


@jit
def _zero_row(v, NEG: tl.constexpr):
    """Zeros shaped and typed like ``v`` (fp32, or a 16-bit float: mixing dtypes in ``tl.where`` would widen
    ``v`` through the interpreter's subnormal-mangling conversion); -0.0 when ``NEG``, made from its bits
    (a ``-0.0`` literal is folded to +0.0 by some Triton versions)."""
    if v.dtype == tl.float32:
        return tl.full(v.shape, -2147483648 if NEG else 0, tl.int32).to(tl.float32, bitcast=True)
    else:
        return tl.full(v.shape, -32768 if NEG else 0, tl.int16).to(v.dtype, bitcast=True)


@jit
def either(a, b, take_a):
    """``a`` where ``take_a``, else ``b``, for two loads masked so that where one was read the other is 0:
    integer rows (fp8 codes, plain copies) are or'ed, a word per several elements instead of a select each."""
    if a.dtype.is_int():
        return a | b
    else:
        return tl.where(take_a, a, b)


@jit
def _fp8_to_f32(x, FORMAT: tl.constexpr):
    """fp8 codes (uint8) to fp32, exactly, with a few integer ops and one multiply (the same bits on the GPU
    and the interpreter; this is the inner loop of every fp8 gather, so it is kept short).

    FORMAT 1: e4m3fn (bias 7, no infinities, S.1111.111 is NaN). The code's magnitude bits placed at the top
    of an fp32's exponent and mantissa read as the value times 2**-120 (an fp32 subnormal where the code is
    one), so one exact multiply by 2**120 gives the value, subnormal codes included (fp32 subnormals are
    kept by the GPU's plain multiply and by the interpreter's numpy). FORMAT 2: e5m2 is the top byte of an
    IEEE half (bias 15, infinities, NaNs): widened through fp16, exactly."""
    b = x.to(tl.uint32)
    if FORMAT == 1:
        mag = b & 0x7F
        v = (((b & 0x80) << 24) | (mag << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2**120
        v = tl.where(mag == 0x7F, float("nan"), v)
    else:
        v = (b << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return v


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


@jit
def convert_rows(x, keep, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE: tl.constexpr,
             CONVERT: tl.constexpr, KEEP_ALL: tl.constexpr, NEG_ZERO: tl.constexpr, FP8: tl.constexpr,
             SCALE: tl.constexpr):
    """Loaded elements ``x`` to the output's values: fp8 dequantisation (``FP8``: the codes' format, 0 none;
    ``SCALE`` 1: the global scale at ``dq_scale_ptr``, 2: ``row_scale``, each row's own: the encoding's
    constants, :meth:`~uvaple.kernels.encodings.Encoding.kernel_constants`), scale, dtype conversion; where
    ``keep`` is false (and not ``KEEP_ALL``) a zero (or -0.0) instead, whatever the scale."""
    if FP8 != 0:
        # vLLM's formula: rows.to(out_dtype) * scale.to(out_dtype); fp8 widens to any out dtype exactly
        v = _fp8_to_f32(x, FP8)
        if SCALE == 2:
            sc = row_scale
        else:
            sc = tl.load(dq_scale_ptr).to(tl.float32)
        s = _to_f32(_round_f32(sc, out_ptr.dtype.element_ty), out_ptr.dtype.element_ty)
        v = _round_f32(v * s, out_ptr.dtype.element_ty)
        if not KEEP_ALL:
            v = tl.where(keep, v, _zero_row(v, NEG_ZERO))
        y = v.to(out_ptr.dtype.element_ty)
    elif CONVERT:
        v = _to_f32(x, table_ptr.dtype.element_ty)
        if HAS_SCALE:
            # The scale travels as its bits: no float argument conversion can touch -0.0 or a subnormal.
            scale = scale_bits.to(tl.int32).to(tl.float32, bitcast=True)
            v = _round_f32(v * scale, table_ptr.dtype.element_ty)
            v = _to_f32(v, table_ptr.dtype.element_ty)
        v = _round_f32(v, out_ptr.dtype.element_ty)
        if not KEEP_ALL:
            v = tl.where(keep, v, _zero_row(v, NEG_ZERO))  # whatever the scale (negative, inf, NaN)
        y = v.to(out_ptr.dtype.element_ty)
    else:
        y = x
    return y


@jit
def row_scale_bits(p, mask, WORD: tl.constexpr):
    """The bits (uint32) of the float32 scale stored little-endian in the four bytes at ``p`` (a row's scale
    column of a 1-byte table or hot set). ``WORD``: ``p`` is 4-byte aligned, one 32-bit load (the GPU and the
    host are little-endian); else four byte loads, no alignment assumed. Where ``mask`` is false nothing is
    read (0)."""
    if WORD:
        return tl.load(p.to(tl.pointer_type(tl.uint32)), mask=mask, other=0)
    else:
        return tl.load(p, mask=mask, other=0).to(tl.uint32) | \
            (tl.load(p + 1, mask=mask, other=0).to(tl.uint32) << 8) | \
            (tl.load(p + 2, mask=mask, other=0).to(tl.uint32) << 16) | \
            (tl.load(p + 3, mask=mask, other=0).to(tl.uint32) << 24)


@jit
def leader_index(a, b):
    return tl.maximum(a, b)


@jit
def add(a, b):
    return a + b



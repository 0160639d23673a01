"""Triton source of the row gather (launched by :mod:`uvaple.kernels.gather`; see its docstring).

Loaded twice by :mod:`uvaple.kernels._jit`: compiled (CUDA tensors) and interpreted (CPU tensors).
"""

import triton.language as tl

from ._jit import kernel_decorator

jit = kernel_decorator(__name__)


@jit
def safe_row(ids_ptr, pid, id_base, row_lo, n_rows):
    """(row, valid) for program ``pid``: the row ``id - id_base`` as int64, replaced by ``row_lo`` when
    outside ``[row_lo, n_rows)`` so that no address outside the table (or its window) is ever formed.
    (``0 <= id_base < 2**62``: a wrapped difference of an extreme id is still far above ``n_rows``.)"""
    row = tl.load(ids_ptr + pid).to(tl.int64) - id_base
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
def _either(a, b, take_a):
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
def _convert(x, keep, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE: tl.constexpr,
             CONVERT: tl.constexpr, KEEP_ALL: tl.constexpr, NEG_ZERO: tl.constexpr, DEQUANT: tl.constexpr):
    """Loaded elements ``x`` to the output's values: fp8 dequantisation (``DEQUANT`` 1/2: the global scale
    at ``dq_scale_ptr``; 3/4: ``row_scale``, each row's own), scale, dtype conversion; where ``keep`` is false
    (and not ``KEEP_ALL``) a zero (or -0.0) instead, whatever the scale."""
    if DEQUANT != 0:
        # vLLM's formula: rows.to(out_dtype) * scale.to(out_dtype); fp8 widens to any out dtype exactly
        if DEQUANT == 1 or DEQUANT == 3:
            v = _fp8_to_f32(x, 1)
        else:
            v = _fp8_to_f32(x, 2)
        if DEQUANT >= 3:
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


# n_ids changes from call to call (1 in decode, thousands in prefill) and only feeds the counters: not
# specialised, so a new batch size never compiles a new variant (perhaps inside a graph capture).
@jit(do_not_specialize=["scale_bits", "n_ids"])
def gather_rows_kernel(
    table_ptr,  # *Pointer* to row 0 of the table (host memory through UVA, or HBM)
    ids_ptr,  # *Pointer* to the flattened ids, int32 or int64
    out_ptr,  # *Pointer* to the output [n_ids, n_cols], contiguous
    counters_ptr,  # *Pointer* to int64 [3]: lookups, rows, out-of-range ids (read only when COUNT)
    dq_scale_ptr,  # *Pointer* to the fp32 dequantisation scale [1] (read only when DEQUANT)
    hot_ptr,  # *Pointer* to row 0 of the hot set: device copies of table rows, the table's stride (HOT)
    slot_ptr,  # *Pointer* to int32 [n_rows]: the hot slot of each table row, or -1 (HOT)
    n_hot,  # slots in the hot set (a slot outside 0..n_hot is a miss, whatever the map holds)
    id_counts_ptr,  # *Pointer* to int64 [n_rows]: lookups of each table row, added to (COUNT_IDS)
    n_ids,  # ids in this call
    id_base,  # the id of table row 0 (a rank's vocabulary shard stored alone; 0 for a whole table)
    row_lo,  # valid rows are row_lo <= id - id_base < n_rows (a rank's shard of a full table; else 0)
    n_rows,  # one past the last valid row
    table_stride,  # elements between two table rows (>= the row length, padded)
    col_start,  # first column of the range to copy
    n_cols,  # columns to copy per row
    scale_bits,  # int32: the bits of the fp32 scale, already rounded to the table dtype (HAS_SCALE)
    scale_col,  # the column (byte) of a row's own float32 scale (DEQUANT 3/4)
    HAS_SCALE: tl.constexpr,  # multiply by the scale with the model's rounding
    CONVERT: tl.constexpr,  # go through fp32 (scale or a different output dtype)
    OOB_ROW0: tl.constexpr,  # out-of-range ids read row row_lo (else they give a zero row)
    NEG_ZERO: tl.constexpr,  # zero rows are -0.0 (a sum over ranks then keeps every owner's bits)
    DEQUANT: tl.constexpr,  # 0: as stored; 1/2: e4m3fn/e5m2 codes x the scale at dq_scale_ptr; 3/4: x the row's
    COUNT: tl.constexpr,  # add to the counters (one atomic per call, one per out-of-range id; HOT: per hit)
    HOT: tl.constexpr,  # rows in the hot set are read from it (HBM), the others from the table
    COUNT_IDS: tl.constexpr,  # count each valid id's lookup at id_counts_ptr (a hot set's profile)
    SCALE_WORD: tl.constexpr,  # DEQUANT 3/4: the row scale is a 4-byte aligned word in the table and the hot set
    BLOCK: tl.constexpr,  # columns per program
    ROW_TILES: tl.constexpr,  # a 1-D grid, the tiles of a row side by side (heuristics.LaunchConfig.row_tiles)
):
    if ROW_TILES:
        n_tiles = (n_cols + BLOCK - 1) // BLOCK
        flat = tl.program_id(0).to(tl.int64)
        pid = flat // n_tiles
        tile = (flat - pid * n_tiles).to(tl.int32)
    else:
        pid = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
    row, valid = safe_row(ids_ptr, pid, id_base, row_lo, n_rows)
    if OOB_ROW0:
        limit = n_cols
    else:
        limit = tl.where(valid, n_cols, 0)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    load_mask = cols < limit
    if HOT:
        # row is inside the table (valid or not), so its map entry is too; a slot outside the hot set is a
        # miss, so no address outside either buffer is formed, whatever the map holds
        slot = tl.load(slot_ptr + row).to(tl.int64)
        hit = (slot >= 0) & (slot < n_hot)
        if not OOB_ROW0:
            hit = hit & valid  # an out-of-range id reads nothing
        slot = tl.where(hit, slot, 0)
        hit_cols = (tl.full([BLOCK], 0, tl.int32) + hit.to(tl.int32)) != 0  # the masks as blocks of bool
        x_hot = tl.load(hot_ptr + slot * table_stride + col_start + cols, mask=load_mask & hit_cols, other=0)
        x = tl.load(table_ptr + row * table_stride + col_start + cols, mask=load_mask & (hit_cols == 0), other=0)
        x = _either(x_hot, x, hit_cols)
    else:
        hit = False
        x = tl.load(table_ptr + row * table_stride + col_start + cols, mask=load_mask, other=0)
    if COUNT:
        if tile == 0:
            first = pid == 0
            tl.atomic_add(counters_ptr, 1, mask=first, sem="relaxed")
            tl.atomic_add(counters_ptr + 1, n_ids, mask=first, sem="relaxed")
            tl.atomic_add(counters_ptr + 2, 1, mask=valid == 0, sem="relaxed")
            if HOT:
                tl.atomic_add(counters_ptr + 3, 1, mask=hit & valid, sem="relaxed")
    if COUNT_IDS:
        if tile == 0:
            tl.atomic_add(id_counts_ptr + row, 1, mask=valid, sem="relaxed")
    row_scale = 0.0
    if DEQUANT >= 3:
        if HOT:
            # one read of the scale, from wherever the row's codes came (slot and row are inside their buffers)
            src = tl.where(hit, hot_ptr + slot * table_stride, table_ptr + row * table_stride)
        else:
            src = table_ptr + row * table_stride  # row is inside the table
        row_scale = _row_scale_bits(src + scale_col, True, SCALE_WORD).to(tl.float32, bitcast=True)
    y = _convert(x, load_mask, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE, CONVERT,
                 OOB_ROW0, NEG_ZERO, DEQUANT)
    tl.store(out_ptr + pid * n_cols + cols, y, mask=cols < n_cols)


@jit
def _row_scale_bits(p, mask, WORD: tl.constexpr):
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
def _leader_index(a, b):
    return tl.maximum(a, b)


@jit
def _add(a, b):
    return a + b


# n changes from call to call: not specialised (see gather_rows_kernel).
@jit(do_not_specialize=["scale_bits", "n"])
def gather_sorted_kernel(
    table_ptr,  # *Pointer* to row 0 of the table
    sorted_ptr,  # *Pointer* to the ids in ascending order [n] (int32/int64, as the caller's), or (KEYS) row keys
    order_ptr,  # *Pointer* to int64 [n]: the output row of each sorted id (its position in the caller's ids)
    out_ptr,  # *Pointer* to the output [n, n_cols]
    counters_ptr,  # as gather_rows_kernel
    dq_scale_ptr,  # as gather_rows_kernel
    hot_ptr, slot_ptr, n_hot,  # as gather_rows_kernel (HOT)
    id_counts_ptr,  # as gather_rows_kernel (COUNT_IDS)
    n,  # ids in this call
    id_base, row_lo, n_rows, table_stride, col_start, n_cols, scale_bits, scale_col,  # as gather_rows_kernel
    HAS_SCALE: tl.constexpr, CONVERT: tl.constexpr, OOB_ROW0: tl.constexpr, NEG_ZERO: tl.constexpr,
    DEQUANT: tl.constexpr, COUNT: tl.constexpr, HOT: tl.constexpr, COUNT_IDS: tl.constexpr, SCALE_WORD: tl.constexpr,
    DEDUP: tl.constexpr,  # read each distinct id of a tile once; its repeats copy the first one's output row
    KEYS: tl.constexpr,  # sorted_ptr holds row keys (row_keys_kernel: row - row_lo + 1, 0 for an out-of-range id)
    BLOCK_R: tl.constexpr,  # sorted ids per program
    BLOCK_C: tl.constexpr,  # columns per program
):
    """Program ``(p, j)``: column tile ``j`` of sorted ids ``p*BLOCK_R ...``, each written to its own output
    row (``order``): rows are read in ascending id order, so one program's reads cluster in the table.

    De-duplication: only the first of equal ids in the whole sorted order (a "leader") reads the table,
    so each distinct id is read once. After a barrier, the repeats whose leader is in this program copy
    its output row, which this program has just written. The repeats whose run began in an earlier
    program (at most one run per program: the one its first id continues) are left to
    :func:`dedup_tail_kernel`, launched next in the same stream. With a hot set every hit reads its row
    from the set, repeat or not (HBM: no PCIe read to save; fp8 rows move half the bytes of a copy of
    the leader's output), so only the repeats of misses copy.
    """
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    local = tl.arange(0, BLOCK_R)
    r = pid * BLOCK_R + local
    in_n = r < n
    raw = tl.load(sorted_ptr + r, mask=in_n, other=0)
    if KEYS:  # keys past the table (none come from row_keys_kernel) are out of range too
        row = raw.to(tl.int64) - 1 + row_lo
        valid = (raw > 0) & (row < n_rows) & in_n
    else:
        row = raw.to(tl.int64) - id_base
        valid = (row >= row_lo) & (row < n_rows) & in_n
    row = tl.where(valid, row, row_lo)  # no address outside the table, whatever the id
    pos = tl.load(order_ptr + r, mask=in_n, other=0)
    if HOT:  # as in gather_rows_kernel: a slot outside the hot set is a miss
        slot = tl.load(slot_ptr + row, mask=in_n, other=-1).to(tl.int64)
        hit = (slot >= 0) & (slot < n_hot) & in_n
        if not OOB_ROW0:
            hit = hit & valid
        # a miss's slot is clamped into the set (its loads are masked off). No tl.where on `hit` in this kernel:
        # Triton 3.6's TritonGPURemoveLayoutConversions fails on such a select beside the tile's 2-D masks
        # (fp8 rows with their own scale, oob row0 or -0.0, 8- and 16-column tiles)
        slot = tl.maximum(tl.minimum(slot, n_hot - 1), 0)
    if COUNT:
        if tile == 0:
            first = pid == 0
            tl.atomic_add(counters_ptr, 1, mask=first, sem="relaxed")
            tl.atomic_add(counters_ptr + 1, n, mask=first, sem="relaxed")
            # tl.reduce with our own combine: tl.sum's is a triton.jit of the standard library, which the
            # interpreted copy of this module (kernels/_jit.py) cannot call
            bad = tl.reduce((in_n & (valid == 0)).to(tl.int64), 0, _add)
            tl.atomic_add(counters_ptr + 2, bad, mask=bad > 0, sem="relaxed")
            if HOT:
                hits = tl.reduce((hit & valid).to(tl.int64), 0, _add)
                tl.atomic_add(counters_ptr + 3, hits, mask=hits > 0, sem="relaxed")
    if COUNT_IDS:
        if tile == 0:
            tl.atomic_add(id_counts_ptr + row, tl.full([BLOCK_R], 1, tl.int64), mask=valid, sem="relaxed")
    if DEDUP:
        prev = tl.load(sorted_ptr + r - 1, mask=in_n & (r > 0), other=0)
        leader = in_n & ((r == 0) | (raw != prev))
    else:
        leader = in_n
    # The ids that read their row: the leaders and, with a hot set, every hit. De-duplication saves PCIe reads;
    # a repeat of a hot row reads the set's bytes from HBM (fp8 rows: half of a copy of the leader's output).
    if HOT:
        reads = leader | hit
    else:
        reads = leader
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    if OOB_ROW0:
        keep = reads[:, None] & col_ok[None, :]
    else:
        keep = (reads & valid)[:, None] & col_ok[None, :]
    if HOT:
        hot2 = hit[:, None] & col_ok[None, :]
        x_hot = tl.load(hot_ptr + slot[:, None] * table_stride + col_start + cols[None, :], mask=keep & hot2, other=0)
        x = tl.load(table_ptr + row[:, None] * table_stride + col_start + cols[None, :], mask=keep & (hot2 == 0),
                    other=0)
        x = _either(x_hot, x, hot2)
    else:
        x = tl.load(table_ptr + row[:, None] * table_stride + col_start + cols[None, :], mask=keep, other=0)
    row_scale = 0.0
    if DEQUANT >= 3:
        if HOT:
            # the scale's bits from the set or the table, each load masked: the other gives 0 (no select)
            bits = _row_scale_bits(hot_ptr + slot * table_stride + scale_col, hit, SCALE_WORD) | \
                _row_scale_bits(table_ptr + row * table_stride + scale_col, leader & (hit == 0), SCALE_WORD)
        else:
            bits = _row_scale_bits(table_ptr + row * table_stride + scale_col, leader, SCALE_WORD)  # repeats: none
        row_scale = bits.to(tl.float32, bitcast=True)[:, None]
    y = _convert(x, keep, dq_scale_ptr, row_scale, scale_bits, table_ptr, out_ptr, HAS_SCALE, CONVERT, OOB_ROW0,
                 NEG_ZERO, DEQUANT)
    tl.store(out_ptr + pos[:, None] * n_cols + cols[None, :], y, mask=reads[:, None] & col_ok[None, :])
    if DEDUP:
        tl.debug_barrier()  # the leaders' rows are written and visible to the whole program
        lead = tl.associative_scan(tl.where(leader, local, -1), 0, _leader_index)  # -1: led from before
        has_lead = lead >= 0
        lead_pos = tl.load(order_ptr + pid * BLOCK_R + lead, mask=in_n & has_lead, other=0)
        dup = (in_n & (reads == 0) & has_lead)[:, None] & col_ok[None, :]
        v = tl.load(out_ptr + lead_pos[:, None] * n_cols + cols[None, :], mask=dup, other=0)
        tl.store(out_ptr + pos[:, None] * n_cols + cols[None, :], v, mask=dup)


# n changes from call to call: not specialised (see gather_rows_kernel).
@jit(do_not_specialize=["n"])
def row_keys_kernel(
    ids_ptr,  # *Pointer* to the ids [n] (int32 or int64)
    keys_ptr,  # *Pointer* to the keys written [n] (int32: the table has fewer than 2**31 - 1 rows past row_lo)
    n,  # ids in this call
    id_base, row_lo, n_rows,  # as gather_rows_kernel
    BLOCK: tl.constexpr,
):
    """The sort key of each id: ``row - row_lo + 1`` for a row inside the table (or its window), 0 for an
    out-of-range id. Sorting these 4-byte keys instead of the caller's (often 8-byte) ids halves the radix
    sort's passes, and every out-of-range id sorts into one run at the front (one leader under ``dedup``:
    they all give the same output row)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row = tl.load(ids_ptr + i, mask=m, other=0).to(tl.int64) - id_base
    valid = (row >= row_lo) & (row < n_rows)
    key = tl.where(valid, row - row_lo + 1, 0)
    tl.store(keys_ptr + i, key.to(keys_ptr.dtype.element_ty), mask=m)


@jit(do_not_specialize=["n"])
def dedup_tail_kernel(
    sorted_ptr,  # *Pointer* to the sorted ids [n] (as gather_sorted_kernel's)
    order_ptr,  # *Pointer* to int64 [n]: the output row of each sorted id
    out_ptr,  # *Pointer* to the output [n, n_cols], every leader's row already written
    n,  # ids in this call
    n_cols,  # columns per output row
    STEPS: tl.constexpr,  # binary-search steps: at least n.bit_length()
    BLOCK_R: tl.constexpr,  # sorted ids per program of the gather it follows
    BLOCK_C: tl.constexpr,  # columns per program
):
    """Program ``(p, j)``: column tile ``j`` of the repeats at the start of gather program ``p`` whose run of
    equal ids began in an earlier program. Each copies the output row of its run's leader (the first equal
    id: a binary search of the sorted ids), which the gather launched before this kernel wrote. A program
    whose first id starts a run copies nothing. (A hot-set hit's repeats read their row in the gather; the
    copy here writes them the same bits again.)
    """
    pid = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    first = pid * BLOCK_R
    in_run = (first > 0) & (first < n)
    v0 = tl.load(sorted_ptr + first, mask=in_run, other=0)
    before = tl.load(sorted_ptr + first - 1, mask=in_run, other=0)
    in_run = in_run & (v0 == before)
    if in_run:
        lo = first * 0  # the first position holding v0: in [0, first), sorted[first - 1] is v0
        hi = first
        for _ in range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(sorted_ptr + mid, mask=active, other=0)
            less = active & (v < v0)
            lo, hi = tl.where(less, mid + 1, lo), tl.where(active & (less == 0), mid, hi)
        lead_pos = tl.load(order_ptr + lo)
        r = first + tl.arange(0, BLOCK_R)
        raw = tl.load(sorted_ptr + r, mask=r < n, other=0)
        rep = (r < n) & (raw == v0)  # a prefix of the program: its ids are sorted
        pos = tl.load(order_ptr + r, mask=rep, other=0)
        cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
        m = rep[:, None] & (cols < n_cols)[None, :]
        v = tl.load(out_ptr + lead_pos * n_cols + cols[None, :] + pos[:, None] * 0, mask=m, other=0)
        tl.store(out_ptr + pos[:, None] * n_cols + cols[None, :], v, mask=m)

"""Compiled kernel of com.microsoft::MatMulNBits for a few rows (a decoder step): a GEMV that
reads the 4-bit packed weights directly, split over output columns among the run's threads.

The weight B is (N, k_blocks, block_size / 2) bytes, byte j of a block holding code 2j in its
low nibble and code 2j + 1 in its high one. The activations are split once per call into their
even and odd elements (`split_activations`), so that the low and high nibbles of 16 consecutive
bytes multiply 16 consecutive activations each: the chunk loop below is then plain vector code.
Each 16-byte chunk of a column is dequantised in registers once for up to ROWS rows, w =
(q - zero point) * scale in float32 (the very value the numpy kernel's dequantised weight
holds), and multiplied into each row's 16 lane sums (fused multiply-adds, chunk after chunk);
at the column's end a row's lanes are summed in a fixed order. The loop is vector code written
as LLVM IR (`_emit_column_rows`): numba's loops over scalars summed every chunk across its
lanes, twice as slow. A column is computed by one thread with the same expression whatever
the split, so any thread count gives the same bits. Reading 4 bits a weight instead of a kept
float32 copy's 32 is what makes it fast: a GEMV is bound by the weight's bytes.

Blocks of 16 codes (8 bytes) put two blocks in a chunk, each half with its own scale and zero
point; their rows are padded to whole chunks once (`chunked_codes`).
"""
from __future__ import annotations

import numpy as np

from ember.ops.cpu import compiled as _compiled
from ember.ops.cpu import tuning

LANES = 16  # bytes of codes a chunk: 32 codes, one vector of 16 float32 per nibble


def serves() -> bool:
    """Whether the compiled kernel runs (numba installed, compiled kernels on)."""
    return kernel() is not None


def chunked_codes(b: np.ndarray) -> np.ndarray:
    """B (N, k_blocks, half) as (N, bytes) rows of whole chunks: a free view, or for an odd
    number of 16-code blocks a copy padded with one zero block."""
    n = b.shape[0]
    flat = b.reshape(n, -1)
    pad = -flat.shape[1] % LANES
    if pad:
        flat = np.concatenate([flat, np.zeros((n, pad), np.uint8)], axis=1)
    return np.ascontiguousarray(flat)


def split_activations(a, ae, ao):
    """a (M, K) float32 into its even and odd elements ae / ao (M, bytes), zeros past K: the
    activations the low and the high nibbles of B's bytes multiply."""
    k = a.shape[1]
    for m in range(a.shape[0]):
        for i in range(ae.shape[1]):
            ae[m, i] = a[m, 2 * i] if 2 * i < k else np.float32(0)
            ao[m, i] = a[m, 2 * i + 1] if 2 * i + 1 < k else np.float32(0)


_NO_BIAS = np.zeros(1, np.float32)


def gemv(compiled, a, codes, scales, zero_points, block_size, bias):
    """a (M, K) float32 @ dequantised(B).T (+ bias): (M, N) float32, by `compiled` (the
    `kernel()`). `codes` from chunked_codes, `scales` and `zero_points` (N, k_blocks) float32
    (C-ordered), `block_size` a power of 2 from 16, `bias` (N,) float32 or None."""
    m = a.shape[0]
    n, chunk_bytes = codes.shape
    ae = np.empty((m, chunk_bytes), np.float32)
    ao = np.empty((m, chunk_bytes), np.float32)
    _compiled.jit(split_activations)(a, ae, ao)
    out = np.empty((m, n), np.float32)
    has_bias = bias is not None
    shift = (block_size // 2).bit_length() - 1  # a byte's block: its index >> shift
    _compiled.split_rows(compiled, n, ae, ao, codes, scales, zero_points,
                         bias if has_bias else _NO_BIAS, has_bias, shift,
                         out, ns_per_row=tuning.NBITS_GEMV_NS_PER_BYTE * chunk_bytes * m,
                         piece=_nbits4_piece)
    return out


def _nbits4_piece(block, n0, n1):  # pragma: no cover - numba
    """`_nbits4_columns`' piece function (ops/cpu/compiled.py: the helpers run its pieces
    without Python), its arguments rebuilt from the block `split_rows` made."""
    v = _compiled.array_at(block, (22,), np.int64)
    _nbits4_columns(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                    _compiled.array_at(v[3], (v[4], v[5]), np.float32),
                    _compiled.array_at(v[6], (v[7], v[8]), np.uint8),
                    _compiled.array_at(v[9], (v[10], v[11]), np.float32),
                    _compiled.array_at(v[12], (v[13], v[14]), np.float32),
                    _compiled.array_at(v[15], (v[16],), np.float32), v[17] != 0, v[18],
                    _compiled.array_at(v[19], (v[20], v[21]), np.float32), n0, n1)


@_compiled.kernel_math
def _nbits4_columns(ae, ao, codes, scales, zps, bias, has_bias, shift, out, n0, n1):
    """out[:, n] for the columns n in [n0, n1): the rows' dot products with the column's
    dequantised codes (`column_rows`, up to ROWS rows at a time), plus the bias."""
    m_rows = ae.shape[0]
    for n in range(n0, n1):
        row, sc, zp = codes[n], scales[n], zps[n]
        m = 0
        while m < m_rows:
            r = min(ROWS, m_rows - m)
            xe, xo, y = ae[m:m + r], ao[m:m + r], out[m:m + r]
            if r == 4:
                column_rows(4, row, xe, xo, sc, zp, shift, y, n)
            elif r == 3:
                column_rows(3, row, xe, xo, sc, zp, shift, y, n)
            elif r == 2:
                column_rows(2, row, xe, xo, sc, zp, shift, y, n)
            else:
                column_rows(1, row, xe, xo, sc, zp, shift, y, n)
            m += r
        if has_bias:
            for m in range(m_rows):
                out[m, n] += bias[n]


ROWS = 4  # rows a column's codes are dequantised for at once: 8 vector sums in registers


def column_rows(rows, codes, xe, xo, sc, zp, shift, out, n):
    """out[r, n] = sum over the column's bytes i of xe[r, i] * wl[i] + xo[r, i] * wh[i] for
    the `rows` (1 to ROWS) rows r, wl / wh the dequantised low / high nibbles of codes[i]
    ((q - zp) * sc of block i >> shift): 16 bytes a chunk, dequantised once for all rows,
    into two vectors of 16 lane sums a row (low and high nibbles), added lane by lane at the
    end and the 16 lanes summed in halves (8 + 8, 4 + 4, ...). Compiled code only
    (`_register`)."""
    raise NotImplementedError("compiled code only")


def _emit_column_rows(R, context, builder, sig, args):
    """`column_rows`' IR for R rows: the loop over the column's 16-byte chunks, written as
    vector code (numba's scalar loops summed each chunk across its lanes, or gathered byte
    by byte)."""
    from llvmlite import ir
    from numba.core import cgutils
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec, ints = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES)
    bytes_vec = ir.VectorType(ir.IntType(8), LANES)
    codes, xe, xo, sc, zp = (context.make_array(t)(context, builder, a)
                             for t, a in zip(sig.args[1:6], args[1:6]))
    shift = args[6]
    out = context.make_array(sig.args[7])(context, builder, args[7])
    n = args[8]
    n_bytes = builder.extract_value(codes.shape, 0)
    x_stride = builder.extract_value(xe.shape, 1)  # C-ordered rows
    out_stride = builder.extract_value(out.shape, 1)
    last_block = builder.sub(builder.extract_value(sc.shape, 0), ir.Constant(i64, 1))
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                         f"llvm.fma.v{LANES}f32")
    zero = ir.Constant(vec, [0.0] * LANES)
    first_half = ir.Constant(ir.VectorType(ir.IntType(1), LANES),
                             [1] * (LANES // 2) + [0] * (LANES // 2))
    splat_mask = ir.Constant(ints, [0] * LANES)
    row_at = [builder.mul(ir.Constant(i64, r), x_stride) for r in range(R)]

    def splat(value):
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), value, ir.Constant(i32, 0))
        return builder.shuffle_vector(one, one, splat_mask)

    def vector_at(data, index, vtype, align):
        return builder.load(builder.bitcast(builder.gep(data, [index]), vtype.as_pointer()),
                            align=align)

    def step(c, acc, one_block):
        """The chunk of 16 bytes at c into the rows' accumulators; `one_block`: the chunk
        lies in one block (blocks of 32 codes or more), else in two."""
        q = builder.zext(vector_at(codes.data, c, bytes_vec, 1), ints)
        low = builder.uitofp(builder.and_(q, ir.Constant(ints, [15] * LANES)), vec)
        high = builder.uitofp(builder.lshr(q, ir.Constant(ints, [4] * LANES)), vec)
        g0 = builder.ashr(c, shift)
        s = splat(builder.load(builder.gep(sc.data, [g0])))
        z = splat(builder.load(builder.gep(zp.data, [g0])))
        if not one_block:
            g1 = builder.ashr(builder.add(c, ir.Constant(i64, LANES // 2)), shift)
            g1 = builder.select(builder.icmp_signed(">", g1, last_block), last_block, g1)
            s = builder.select(first_half, s, splat(builder.load(builder.gep(sc.data, [g1]))))
            z = builder.select(first_half, z, splat(builder.load(builder.gep(zp.data, [g1]))))
        w_lo = builder.fmul(builder.fsub(low, z), s)
        w_hi = builder.fmul(builder.fsub(high, z), s)
        for r in range(R):
            at = builder.add(row_at[r], c)
            lo_sum, hi_sum = acc[r]
            builder.store(builder.call(fma, [vector_at(xe.data, at, vec, 4), w_lo,
                                             builder.load(lo_sum)]), lo_sum)
            builder.store(builder.call(fma, [vector_at(xo.data, at, vec, 4), w_hi,
                                             builder.load(hi_sum)]), hi_sum)

    acc = [(cgutils.alloca_once_value(builder, zero), cgutils.alloca_once_value(builder, zero))
           for _ in range(R)]
    one_block = builder.icmp_signed(">=", shift, ir.Constant(i64, 4))
    with builder.if_else(one_block) as (whole, halves):
        for is_whole in (True, False):
            with whole if is_whole else halves:
                with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n_bytes,
                                             ir.Constant(i64, LANES), i64) as (c, _):
                    step(c, acc, is_whole)
    for r in range(R):
        total = builder.fadd(builder.load(acc[r][0]), builder.load(acc[r][1]))
        width = LANES
        while width > 1:  # halves added lane by lane: a fixed order
            width //= 2
            upper = builder.shuffle_vector(total, total, ir.Constant(
                ints, list(range(width, 2 * width)) + [0] * (LANES - width)))
            total = builder.fadd(total, upper)
        target = builder.gep(out.data, [builder.add(builder.mul(ir.Constant(i64, r),
                                                                out_stride), n)])
        builder.store(builder.extract_element(total, ir.Constant(i32, 0)), target)
    return context.get_dummy_value()


@_compiled.Once
def _register(numba) -> None:
    """`column_rows` as numba intrinsics for 1 to ROWS rows, once per process."""
    from numba.extending import intrinsic, overload
    types = numba.types

    def rows_intrinsic(R):
        @intrinsic
        def column_rows_intrinsic(typingctx, rows, codes, xe, xo, sc, zp, shift, out, n):
            sig = types.void(rows, codes, xe, xo, sc, zp, types.int64, out, types.int64)
            return sig, (lambda context, builder, s, args:
                         _emit_column_rows(R, context, builder, s, args))
        return column_rows_intrinsic

    by_rows = {R: rows_intrinsic(R) for R in range(1, ROWS + 1)}

    @overload(column_rows)
    def _column_rows(rows, codes, xe, xo, sc, zp, shift, out, n):
        R = getattr(rows, "literal_value", None)
        arrays = ((codes, 1), (xe, 2), (xo, 2), (sc, 1), (zp, 1), (out, 2))
        if R not in by_rows or not all(isinstance(a, types.Array) and a.ndim == d
                                       and a.layout == "C" for a, d in arrays):
            return None
        emit = by_rows[R]
        return lambda rows, codes, xe, xo, sc, zp, shift, out, n: emit(
            rows, codes, xe, xo, sc, zp, np.int64(shift), out, np.int64(n))


def kernel():
    """`_nbits4_columns` compiled with `column_rows` registered, or None without numba."""
    numba = _compiled._numba() if _compiled.enabled() else None
    if numba is None:
        return None
    _register(numba)
    return _compiled.jit(_nbits4_columns)

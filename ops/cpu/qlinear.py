"""Compiled loops of the quantised element-wise ops: QLinearAdd / QLinearMul, QuantizeLinear /
DequantizeLinear / DynamicQuantizeLinear (ONNX and com.microsoft), the table lookups of
QLinearSigmoid / QLinearLeakyRelu and QLinearGlobalAveragePool, on the run's threads.

Each computes an element with the numpy kernel's operations, in its order and rounding, so the
bits are the numpy kernel's (tests/ops/test_qlinear_compiled.py compares them):
- float32 arithmetic stays float32 (numba compiles without contraction or reassociation), and
  np.rint rounds half to even as numpy's does;
- the fused multiply-add onnxruntime's QLinearAdd rounds with (MLAS's FMA) is `fma32`, the
  CPU's own (compiled.fma_float32), whose bits quantized.py's numpy `_fma32` emulates;
- values are clipped to the output type's range before the cast, which is then exact; a NaN
  never reaches a cast: the callers send non-finite scales to numpy, and QuantizeLinear maps a
  NaN the way its numpy kernel does.

Operands are cut into (P, Q, R) blocks (`broadcast_blocks`): R the innermost, contiguous run,
an operand either full along an axis or broadcast (extent 1). The threads share rows of
`chunk` values of R (`chunked_rows`), so one long flat tensor is split too.
"""
from __future__ import annotations

import numpy as np

from ember.ops._layout import in_memory_order
from ember.ops.cpu import compiled as _compiled
from ember.ops.cpu import tuning


def serves(size: int, minimum: int | None = None) -> bool:
    """Whether a compiled loop runs for a tensor of `size` values: numba serves (compiled
    kernels on, numba installed) and the tensor is large enough (`minimum`, by default
    QLINEAR_COMPILED_MIN) to repay a call."""
    least = tuning.QLINEAR_COMPILED_MIN if minimum is None else minimum
    return size >= least and _compiled.enabled() \
        and _compiled.jit(_lookup_rows) is not None


def broadcast_blocks(a_shape, b_shape):
    """The numpy broadcast of shapes a and b as three axes (P, Q, R), each a run of
    consecutive axes over which each operand is either full or broadcast: (out, a's, b's)
    shapes, an operand's extent 1 where it broadcasts. None where that takes more than three
    runs, the shapes do not broadcast, or the result is empty (numpy serves those)."""
    n = max(len(a_shape), len(b_shape))
    a = (1,) * (n - len(a_shape)) + tuple(a_shape)
    b = (1,) * (n - len(b_shape)) + tuple(b_shape)
    runs = []   # [extent, a full, b full]
    for da, db in zip(a, b):
        d = max(da, db)
        if min(da, db) not in (1, d) or d == 0:
            return None
        if d == 1:
            continue
        key = [da == d, db == d]
        if runs and runs[-1][1:] == key:
            runs[-1][0] *= d
        else:
            runs.append([d] + key)
    if len(runs) > 3:
        return None
    runs = [[1, True, True]] * (3 - len(runs)) + runs
    return (tuple(r[0] for r in runs), tuple(r[0] if r[1] else 1 for r in runs),
            tuple(r[0] if r[2] else 1 for r in runs))


def chunked_rows(shape, ns_per_value):
    """(rows, chunk, ns_per_row) of a (P, Q, R) loop whose rows are P x Q x pieces of R of at
    most `chunk` values."""
    P, Q, R = shape
    chunk = min(R, tuning.QLINEAR_CHUNK)
    rows = P * Q * (-(-R // chunk))
    return rows, chunk, ns_per_value * P * Q * R / rows


def _blocks(x, shape):
    return np.ascontiguousarray(x).reshape(shape)


# ------------------------------------------------------------------ QLinearAdd, QLinearMul


def add(a, b, ra, rb, fixed, lo, hi, plan):
    """QLinearAdd's fma32(A, rA, fma32(B, rB, fixed)), rounded and saturated, A and B in
    `plan`'s blocks (broadcast_blocks); ra, rb, fixed finite float32."""
    out_shape, a_shape, b_shape = plan
    out = np.empty(out_shape, a.dtype)
    rows, chunk, ns = chunked_rows(out_shape, tuning.QLINEAR_ADD_NS)
    _compiled.split_rows(_compiled.jit(_add_rows), rows, _blocks(a, a_shape), _blocks(b, b_shape),
                         out, np.float32(ra), np.float32(rb), np.float32(fixed), chunk,
                         np.float32(lo), np.float32(hi), ns_per_row=ns)
    return out


def mul(a, b, za, zb, zc, multiplier, lo, hi, plan):
    """QLinearMul's float32((A - za)(B - zb)) * multiplier, rounded, plus zc (float64, as
    numpy promotes the int32 zero point), saturated."""
    out_shape, a_shape, b_shape = plan
    out = np.empty(out_shape, a.dtype)
    rows, chunk, ns = chunked_rows(out_shape, tuning.QLINEAR_MUL_NS)
    _compiled.split_rows(_compiled.jit(_mul_rows), rows, _blocks(a, a_shape), _blocks(b, b_shape),
                         out, np.int32(za), np.int32(zb), np.float64(zc), np.float32(multiplier),
                         chunk, np.float64(lo), np.float64(hi), ns_per_row=ns)
    return out


fma32 = _compiled.fma_float32


def _add_rows(a, b, out, ra, rb, fixed, chunk, lo, hi, row0, row1):  # pragma: no cover
    P, Q, R = out.shape
    pieces = (R + chunk - 1) // chunk
    for row in range(row0, row1):
        p, q, r0, r1 = _row_span(row, pieces, Q, R, chunk)
        ar = _run(a, p, q, r0, r1)
        br = _run(b, p, q, r0, r1)
        o = out[p, q, r0:r1]
        if b.shape[2] == 1:   # the inner fma is one value for the row
            inner = fma32(np.float32(br[0]), rb, fixed)
            for r in range(o.size):
                o[r] = min(max(np.rint(fma32(np.float32(ar[r]), ra, inner)), lo), hi)
        elif a.shape[2] == 1:
            ac = np.float32(ar[0])
            for r in range(o.size):
                o[r] = min(max(np.rint(fma32(ac, ra, fma32(np.float32(br[r]), rb, fixed))),
                               lo), hi)
        else:
            for r in range(o.size):
                o[r] = min(max(np.rint(fma32(np.float32(ar[r]), ra,
                                             fma32(np.float32(br[r]), rb, fixed))), lo), hi)


@_compiled.kernel_math
def _row_span(row, pieces, Q, R, chunk):
    """Row `row` of a (P, Q, R) loop cut in `pieces` pieces of R: (p, q, r0, r1)."""
    pq = row // pieces
    r0 = (row % pieces) * chunk
    return pq // Q, pq % Q, r0, min(R, r0 + chunk)


@_compiled.kernel_math
def _run(x, p, q, r0, r1):
    """Values [r0, r1) of x's run (p, q), x broadcast (extent 1) along any of its axes.
    Loops index the slice from 0: numba's wrap-around of negative indices, for an index it
    cannot prove non-negative, keeps a loop from vectorising."""
    row = x[p if x.shape[0] > 1 else 0, q if x.shape[1] > 1 else 0]
    return row[r0:r1] if row.size > 1 else row


@_compiled.kernel_math
def _mul_value(x, y, za, zb, zc, m, lo, hi):
    v = np.float32((np.int32(x) - za) * (np.int32(y) - zb)) * m
    return min(max(np.float64(np.rint(v)) + zc, lo), hi)


def _mul_rows(a, b, out, za, zb, zc, m, chunk, lo, hi, row0, row1):  # pragma: no cover
    P, Q, R = out.shape
    pieces = (R + chunk - 1) // chunk
    for row in range(row0, row1):
        p, q, r0, r1 = _row_span(row, pieces, Q, R, chunk)
        ar = _run(a, p, q, r0, r1)
        br = _run(b, p, q, r0, r1)
        o = out[p, q, r0:r1]
        if b.shape[2] == 1:
            bc = br[0]
            for r in range(o.size):
                o[r] = _mul_value(ar[r], bc, za, zb, zc, m, lo, hi)
        elif a.shape[2] == 1:
            ac = ar[0]
            for r in range(o.size):
                o[r] = _mul_value(ac, br[r], za, zb, zc, m, lo, hi)
        else:
            for r in range(o.size):
                o[r] = _mul_value(ar[r], br[r], za, zb, zc, m, lo, hi)


# ------------------------------------------------------------------ QuantizeLinear and kin


def axis_blocks(shape, axis):
    """(P, C, R) of a tensor whose parameters run along `axis` (None: per tensor)."""
    if axis is None:
        return 1, 1, int(np.prod(shape, dtype=np.int64))
    return (int(np.prod(shape[:axis], dtype=np.int64)), shape[axis],
            int(np.prod(shape[axis + 1:], dtype=np.int64)))


def in_memory_layout(x, axis):
    """x (per tensor: axis None) as its memory in C order where x is a permutation of a
    C-contiguous array (a channels-last image), and that permutation's inverse, as
    in_memory_order gives them: an element-wise op then reads x where it lies and its result
    keeps x's layout for the next op. Otherwise x itself and None."""
    if axis is not None or x.flags.c_contiguous:
        return x, None
    (moved,), back = in_memory_order((x,))
    return (x, None) if back is None else (moved, back)


def _restored(out, back):
    return out if back is None else out.transpose(back)


def quantize(x, scale, zero_point, dtype, axis, nan_at_zero_point):
    """rint(x / scale) (float32) plus the zero point (float32), saturated to int8 / uint8,
    per tensor (axis None: scale and zero_point one value) or along `axis`. A NaN quotient
    gives 0 (ONNX's kernel) or the zero point (com.microsoft's: NaN is zeroed before the zero
    point is added). A per-tensor result has x's layout (in_memory_layout)."""
    x, back = in_memory_layout(x, axis)
    blocks = axis_blocks(x.shape, axis)
    out = np.empty(blocks, dtype)
    info = np.iinfo(dtype)
    rows, chunk, ns = chunked_rows(blocks, tuning.QUANTIZE_NS)
    _compiled.split_rows(_compiled.jit(_quantize_rows), rows, _blocks(x, blocks),
                         np.ascontiguousarray(scale, np.float32).reshape(-1),
                         np.ascontiguousarray(zero_point, np.float32).reshape(-1), out,
                         nan_at_zero_point, chunk, np.float32(info.min), np.float32(info.max),
                         ns_per_row=ns)
    return _restored(out.reshape(x.shape), back)


def _quantize_rows(x, scale, zp, out, nan_at_zero_point, chunk, lo, hi,
                   row0, row1):  # pragma: no cover
    P, C, R = out.shape
    pieces = (R + chunk - 1) // chunk
    for row in range(row0, row1):
        p, c, r0, r1 = _row_span(row, pieces, C, R, chunk)
        s = scale[c if scale.size > 1 else 0]
        z = zp[c if zp.size > 1 else 0]
        nan_code = z if nan_at_zero_point else np.float32(0)
        xr = x[p, c, r0:r1]
        o = out[p, c, r0:r1]
        for r in range(o.size):
            q = np.rint(xr[r] / s)
            o[r] = nan_code if q != q else min(max(q + z, lo), hi)


def dequantize(x, scale, zero_point, axis):
    """(float32(x) - zero_point) * scale in float32, per tensor or along `axis`; a
    per-tensor result has x's layout (in_memory_layout)."""
    x, back = in_memory_layout(x, axis)
    blocks = axis_blocks(x.shape, axis)
    out = np.empty(blocks, np.float32)
    rows, chunk, ns = chunked_rows(blocks, tuning.DEQUANTIZE_NS)
    _compiled.split_rows(_compiled.jit(_dequantize_rows), rows, _blocks(x, blocks),
                         np.ascontiguousarray(scale, np.float32).reshape(-1),
                         np.ascontiguousarray(zero_point, np.float32).reshape(-1), out, chunk,
                         ns_per_row=ns)
    return _restored(out.reshape(x.shape), back)


def _dequantize_rows(x, scale, zp, out, chunk, row0, row1):  # pragma: no cover
    P, C, R = out.shape
    pieces = (R + chunk - 1) // chunk
    for row in range(row0, row1):
        p, c, r0, r1 = _row_span(row, pieces, C, R, chunk)
        s = scale[c if scale.size > 1 else 0]
        z = zp[c if zp.size > 1 else 0]
        xr = x[p, c, r0:r1]
        o = out[p, c, r0:r1]
        for r in range(o.size):
            o[r] = (np.float32(xr[r]) - z) * s


# ------------------------------------------------------------------ lookups, average pool


def lookup(x, table):
    """table[x] for int8 / uint8 x and a 256-entry table indexed by x's byte."""
    flat = np.ascontiguousarray(x).reshape(1, 1, -1).view(np.uint8)
    out = np.empty(flat.shape, np.uint8)
    rows, chunk, ns = chunked_rows(flat.shape, tuning.LOOKUP_NS)
    _compiled.split_rows(_compiled.jit(_lookup_rows), rows, flat,
                         np.ascontiguousarray(table).view(np.uint8), out, chunk, ns_per_row=ns)
    return out.view(table.dtype).reshape(x.shape)


def _lookup_rows(x, table, out, chunk, row0, row1):  # pragma: no cover
    R = out.shape[2]
    xr = x[0, 0]
    o = out[0, 0]
    for row in range(row0, row1):
        xs = xr[row * chunk:min(R, (row + 1) * chunk)]
        os = o[row * chunk:min(R, (row + 1) * chunk)]
        for r in range(os.size):
            os[r] = table[xs[r]]


def global_average(x, channels_last, zx, scale, zy, lo, hi):
    """QLinearGlobalAveragePool: per image and channel, the exact integer sum over the pixels
    less size * zx, as float32 times `scale` (float32), rounded, plus zy (float64, as numpy
    promotes the int32 zero point), saturated. x (N, C, pixels...) or (N, pixels..., C)."""
    n = x.shape[0]
    c = x.shape[-1] if channels_last else x.shape[1]
    size = x.size // max(n * c, 1)
    blocks = (n, size, c) if channels_last else (n * c, 1, size)
    out = np.empty((n, c), x.dtype)
    args = (_blocks(x, blocks), out, np.int64(zx) * size, np.float32(scale), np.float64(zy),
            np.float64(lo), np.float64(hi))
    if channels_last:
        _compiled.split_rows(_compiled.jit(_pixel_sums_last), n, *args,
                             ns_per_row=tuning.QLINEAR_POOL_NS * size * c)
    else:
        _compiled.split_rows(_compiled.jit(_pixel_sums_first), n * c, *args,
                             ns_per_row=tuning.QLINEAR_POOL_NS * size)
    return out


@_compiled.kernel_math
def _average_code(total, scale, zy, lo, hi):
    return min(max(np.float64(np.rint(np.float32(total) * scale)) + zy, lo), hi)


def _pixel_sums_first(x, out, offset, scale, zy, lo, hi, row0, row1):  # pragma: no cover
    flat = out.reshape(-1)
    for row in range(row0, row1):
        xr = x[row, 0]
        total = np.int64(0)
        for r in range(xr.size):
            total += xr[r]
        flat[row] = _average_code(total - offset, scale, zy, lo, hi)


def _pixel_sums_last(x, out, offset, scale, zy, lo, hi, row0, row1):  # pragma: no cover
    N, S, C = x.shape
    for n in range(row0, row1):
        totals = np.zeros(C, np.int64)
        for s in range(S):
            xr = x[n, s]
            for c in range(C):
                totals[c] += xr[c]
        for c in range(C):
            out[n, c] = _average_code(totals[c] - offset, scale, zy, lo, hi)

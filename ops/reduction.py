"""Reductions (ReduceSum .. ReduceLogSumExp, ArgMax/ArgMin) and Softmax/LogSoftmax/Hardmax.

Reductions keep the input dtype; narrow floats (float16, bfloat16, ...) are accumulated in
float32 and cast back. A reduction over an empty set gives the identity of the reduction
(0 for sums, 1 for products, -inf/+inf or the dtype's extreme for max/min, -inf for log sums).

Axes come from the `axes` attribute up to opset 13 (18 for most ops; ReduceSum moved at 13),
and from the optional `axes` input afterwards, where `noop_with_empty_axes` decides whether an
empty/absent axes list means "all axes" or "identity".
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops import _xp
from ember.ops.cpu.compiled import exp_float32
from ember.ops._dtypes import widen
from ember.ops._lowering import compiled_rows
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register


def _normalize_axes(axes, rank: int, fail) -> tuple[int, ...]:
    out = []
    for a in axes:
        a = int(a)
        if not -rank <= a < max(rank, 1):
            raise fail(f"axis {a} is out of range for a tensor of rank {rank}")
        out.append(a % rank if rank else 0)
    return tuple(sorted(set(out)))


# --------------------------------------------------------------------------------------------
# Reductions

class _Reduce(OpImpl):
    """Base: subclasses implement `reduce(x, axes, keepdims)` on the original-dtype array
    (computing over `self.xp`),
    `axes` a sorted tuple of non-negative ints; () reduces nothing (a scalar input, or
    noop_with_empty_axes) but still applies the op's elementwise steps."""

    axes_from_input = False

    def setup(self):
        self.keepdims = bool(self.keepdims)
        if not self.axes_from_input:
            self.noop = False
        else:
            self.noop = bool(getattr(self, "noop_with_empty_axes", 0) or 0)

    def reduced_axes(self, rank: int, axes=None) -> tuple[int, ...]:
        """The axes to reduce, from the attribute (old opsets) or the `axes` input; where
        they are fixed for the plan (the attribute, or a constant input), worked out once per
        rank and kept as one (rank, axes) pair, which racing threads at worst both make."""
        fixed = not self.axes_from_input or (axes is not None and 1 in self.constant_inputs)
        if fixed:
            kept = self.__dict__.get("_kept_axes")
            if kept is not None and kept[0] == rank:
                return kept[1]
        found = self._reduced_axes(rank, axes)
        if fixed:
            self._kept_axes = (rank, found)
        return found

    def _reduced_axes(self, rank: int, axes) -> tuple[int, ...]:
        if self.axes_from_input:
            if axes is None or np.size(axes) == 0:
                # empty axes: all axes, or (noop) a reduction over the empty set of axes,
                # which still applies the non-reducing steps (square, log, abs ...)
                return () if self.noop else tuple(range(rank))
            return _normalize_axes(np.asarray(axes).reshape(-1).tolist(), rank, self.fail)
        if not self.axes:
            return tuple(range(rank))
        return _normalize_axes(self.axes, rank, self.fail)

    def run(self, data, axes=None):
        xp = self.xp
        rank = data.ndim
        axes = self.reduced_axes(rank, axes)
        if rank == 0:
            out = xp.asarray(self.reduce(data, (), True)).reshape(())
        else:
            out = self.reduce(data, axes, self.keepdims)
        return xp.asarray(out).astype(data.dtype, copy=False)

    def reduce(self, x, axes, keepdims):  # pragma: no cover
        raise NotImplementedError


def _sum(xp, x, axes, keepdims):
    if x.dtype.kind in "iub":
        return xp.sum(x, axis=axes, keepdims=keepdims, dtype=x.dtype if x.dtype != bool
                      else np.int64)
    return xp.sum(x, axis=axes, keepdims=keepdims)


class _ReduceSum(_Reduce):
    def reduce(self, x, axes, keepdims):
        return _sum(self.xp, widen(x), axes, keepdims)


@register("ReduceSum", versions=[1, 11])
class ReduceSum1(_ReduceSum):
    pass


@register("ReduceSum", versions=[13])
class ReduceSum13(_ReduceSum):
    shape_inputs = (1,)

    axes_from_input = True


class _ReduceSumSquare(_Reduce):
    def reduce(self, x, axes, keepdims):
        x = widen(x)
        return _sum(self.xp, x * x, axes, keepdims)


@register("ReduceSumSquare", versions=[1, 11, 13])
class ReduceSumSquare1(_ReduceSumSquare):
    pass


@register("ReduceSumSquare", versions=[18])
class ReduceSumSquare18(_ReduceSumSquare):
    shape_inputs = (1,)

    axes_from_input = True


_SPATIAL_MEAN = Lowering("cpu.compiled", "the mean over a channels-last image's pixels: each "
                         "thread sums the rows its core wrote")


class _ReduceMean(_Reduce):
    def lower(self, inputs):
        x = inputs[0]
        if x is not None and x.dtype == np.float32 and x.ndim == 4:
            return Lowering("by layout", "over the pixels of a channels-last image: compiled "
                            "sums per thread; else numpy")
        return PORTABLE

    def reduce(self, x, axes, keepdims):
        xp = self.xp
        mean = _spatial_mean(x) if xp is np and axes == (2, 3) and x.ndim == 4 else None
        self._chosen = PORTABLE if mean is None else _SPATIAL_MEAN
        if mean is not None:
            return mean if keepdims else mean.reshape(mean.shape[:2])
        x = widen(x)
        count = math.prod([x.shape[a] for a in axes]) if axes else 1
        if x.dtype.kind in "iu":
            total = xp.sum(x, axis=axes, keepdims=keepdims, dtype=np.int64 if x.dtype.kind == "i"
                           else np.uint64)
            if count == 0:
                return xp.zeros(total.shape, x.dtype)
            # integer mean rounds toward zero, like C integer division
            q = xp.abs(total) // count
            return xp.where(total < 0, -q, q) if x.dtype.kind == "i" else q
        # np.sum's own reduction, without its Python wrapper (a few microseconds a call)
        total = np.add.reduce(x, axis=axes, keepdims=keepdims) if xp is np \
            else xp.sum(x, axis=axes, keepdims=keepdims)
        if count == 0:
            return xp.full(total.shape, np.nan, x.dtype)
        return total / x.dtype.type(count)


# The mean over the pixels of a channels-last image (N, C, H, W) (a network's global average
# pool, after a 1x1 convolution whose rows both cores wrote): each thread sums the rows its
# core wrote (the caller the first, a helper the last: ops/cpu/blas.py's board), then the caller
# adds the pieces' sums in order, where numpy's sum over the view reads half of its input
# from the other core's cache, a value at a time. At most SPATIAL_MEAN_MAX_PIXELS pixels
# (ops/cpu/tuning.py): more rows summed one by one in float32 lose what numpy's pairwise sums
# keep.


def _spatial_mean(x):
    """The mean over axes 2, 3 of float32 x (keepdims) by `_pixel_sums`, where x is a
    channels-last view (not also C-ordered: numpy reads those in order) and the compiled
    kernel serves; else None. The pixels are cut in pieces of at most
    SPATIAL_MEAN_MAX_PIXELS, each summed in order, then the pieces' sums in order: longer
    runs summed in order would lose what numpy's pairwise sums keep."""
    N, C, H, W = x.shape
    xt = x.transpose(0, 2, 3, 1)
    sums = _compiled.jit(_pixel_sums)
    if sums is None or x.dtype != np.float32 or x.flags.c_contiguous or x.size == 0 \
            or not xt.flags.c_contiguous:
        return None
    pieces = max(len(_compiled.row_bounds(H * W, N * C * tuning.SPATIAL_MEAN_NS_PER_VALUE))
                 - 1, -(-H * W // tuning.SPATIAL_MEAN_MAX_PIXELS))
    cuts = np.array([H * W * i // pieces for i in range(pieces + 1)], np.int64)
    partial = np.empty((cuts.size - 1, N, C), np.float32)
    _compiled.run_rows(sums, list(range(cuts.size)), xt.reshape(N, H * W, C), cuts, partial,
                       piece=_pixel_sums_piece)
    total = partial[0].copy()
    for p in range(1, partial.shape[0]):   # in order: the same bits from any thread
        total += partial[p]
    return (total / np.float32(H * W)).reshape(N, C, 1, 1)


@_compiled.kernel_math
def _pixel_sums(x, cuts, partial, p0, p1):  # pragma: no cover
    """partial[p, n] = the sum of x[n, cuts[p]:cuts[p + 1]] over its rows, for p in [p0, p1):
    x (N, pixels, C) float32, summed row by row in order."""
    N, _, C = x.shape
    for p in range(p0, p1):
        for n in range(N):
            acc = partial[p, n]
            for c in range(C):
                acc[c] = 0.0
            for r in range(cuts[p], cuts[p + 1]):
                row = x[n, r]
                for c in range(C):
                    acc[c] += row[c]


def _pixel_sums_piece(block, p0, p1):  # pragma: no cover
    """_pixel_sums' piece function (ops/cpu/compiled.py), its arguments from the block."""
    v = _compiled.array_at(block, (10,), np.int64)
    _pixel_sums(_compiled.array_at(v[0], (v[1], v[2], v[3]), np.float32),
                _compiled.array_at(v[4], (v[5],), np.int64),
                _compiled.array_at(v[6], (v[7], v[8], v[9]), np.float32), p0, p1)


@register("ReduceMean", versions=[1, 11, 13])
class ReduceMean1(_ReduceMean):
    pass


@register("ReduceMean", versions=[18])
class ReduceMean18(_ReduceMean):
    shape_inputs = (1,)

    axes_from_input = True


class _ReduceProd(_Reduce):
    def reduce(self, x, axes, keepdims):
        xp = self.xp
        x = widen(x)
        if x.dtype.kind in "iu":
            return xp.prod(x, axis=axes, keepdims=keepdims, dtype=x.dtype)
        return xp.prod(x, axis=axes, keepdims=keepdims)


@register("ReduceProd", versions=[1, 11, 13])
class ReduceProd1(_ReduceProd):
    pass


@register("ReduceProd", versions=[18])
class ReduceProd18(_ReduceProd):
    shape_inputs = (1,)

    axes_from_input = True


def _extreme(dtype: np.dtype, largest: bool):
    """+inf/-inf for floats, the dtype's max/min for integers, True/False for bool."""
    if dtype == bool:
        return bool(largest)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.max if largest else info.min
    return np.inf if largest else -np.inf


class _ReduceMax(_Reduce):
    def reduce(self, x, axes, keepdims):
        x = widen(x)
        return _xp.amax(self.xp, x, axis=axes, keepdims=keepdims,
                        initial=_extreme(x.dtype, False))


class _ReduceMin(_Reduce):
    def reduce(self, x, axes, keepdims):
        x = widen(x)
        return _xp.amin(self.xp, x, axis=axes, keepdims=keepdims,
                        initial=_extreme(x.dtype, True))


@register("ReduceMax", versions=[1, 11, 12, 13])
class ReduceMax1(_ReduceMax):
    pass


@register("ReduceMax", versions=[18, 20])
class ReduceMax18(_ReduceMax):
    shape_inputs = (1,)

    axes_from_input = True


@register("ReduceMin", versions=[1, 11, 12, 13])
class ReduceMin1(_ReduceMin):
    pass


@register("ReduceMin", versions=[18, 20])
class ReduceMin18(_ReduceMin):
    shape_inputs = (1,)

    axes_from_input = True


class _ReduceL1(_Reduce):
    def reduce(self, x, axes, keepdims):
        xp = self.xp
        return _sum(xp, xp.abs(widen(x)), axes, keepdims)


@register("ReduceL1", versions=[1, 11, 13])
class ReduceL1_1(_ReduceL1):
    pass


@register("ReduceL1", versions=[18])
class ReduceL1_18(_ReduceL1):
    shape_inputs = (1,)

    axes_from_input = True


class _ReduceL2(_Reduce):
    def reduce(self, x, axes, keepdims):
        xp = self.xp
        x = widen(x)
        if x.dtype.kind in "iu":
            s = xp.sum(x.astype(np.float64) ** 2, axis=axes, keepdims=keepdims)
            return xp.trunc(xp.sqrt(s))
        return xp.sqrt(xp.sum(x * x, axis=axes, keepdims=keepdims))


@register("ReduceL2", versions=[1, 11, 13])
class ReduceL2_1(_ReduceL2):
    pass


@register("ReduceL2", versions=[18])
class ReduceL2_18(_ReduceL2):
    shape_inputs = (1,)

    axes_from_input = True


class _ReduceLogSum(_Reduce):
    def reduce(self, x, axes, keepdims):
        xp = self.xp
        x = widen(x)
        if x.dtype.kind in "iu":
            x = x.astype(np.float64)
        s = xp.sum(x, axis=axes, keepdims=keepdims)
        with np.errstate(divide="ignore", invalid="ignore"):
            return xp.log(s)


@register("ReduceLogSum", versions=[1, 11, 13])
class ReduceLogSum1(_ReduceLogSum):
    pass


@register("ReduceLogSum", versions=[18, 28])
class ReduceLogSum18(_ReduceLogSum):
    shape_inputs = (1,)

    axes_from_input = True


class _ReduceLogSumExp(_Reduce):
    def reduce(self, x, axes, keepdims):
        xp = self.xp
        x = widen(x)
        if x.dtype.kind in "iu":
            x = x.astype(np.float64)
        m = _xp.amax(xp, x, axis=axes, keepdims=True, initial=-np.inf)
        m = xp.where(xp.isfinite(m), m, xp.zeros((), x.dtype))
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            s = xp.sum(xp.exp(x - m), axis=axes, keepdims=True)
            out = xp.log(s) + m
        if not keepdims:
            out = xp.squeeze(out, axis=axes)
        return out


@register("ReduceLogSumExp", versions=[1, 11, 13])
class ReduceLogSumExp1(_ReduceLogSumExp):
    pass


@register("ReduceLogSumExp", versions=[18, 28])
class ReduceLogSumExp18(_ReduceLogSumExp):
    shape_inputs = (1,)

    axes_from_input = True


# --------------------------------------------------------------------------------------------
# ArgMax / ArgMin

class _ArgReduce(OpImpl):
    largest = True

    def setup(self):
        self.keepdims = bool(self.keepdims)
        self.last = bool(getattr(self, "select_last_index", 0) or 0)

    def run(self, data):
        xp = self.xp
        rank = data.ndim
        if rank == 0:
            return xp.zeros((), np.int64)
        axis = int(self.axis)
        if not -rank <= axis < rank:
            raise self.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
        axis %= rank
        x = widen(data)
        fn = xp.argmax if self.largest else xp.argmin
        if data.shape[axis] == 0:
            raise self.fail("cannot take ArgMax/ArgMin over an empty axis")
        if self.last:
            n = x.shape[axis]
            idx = (n - 1) - fn(xp.flip(x, axis=axis), axis=axis, keepdims=self.keepdims)
        else:
            idx = fn(x, axis=axis, keepdims=self.keepdims)
        return xp.asarray(idx, dtype=np.int64)


@register("ArgMax", versions=[1, 11, 12, 13])
class ArgMax(_ArgReduce):
    largest = True


@register("ArgMin", versions=[1, 11, 12, 13])
class ArgMin(_ArgReduce):
    largest = False


# --------------------------------------------------------------------------------------------
# Softmax family

def softmax(xp, x, axis: int, empty_rows_zero: bool = False):
    """Numerically stable softmax along `axis`, computed in `x`'s (widened) dtype. A row that
    is all -inf gives NaN, as the spec says, or zeros with `empty_rows_zero` (attention)."""
    out = _softmax_compiled(xp, x, axis, empty_rows_zero)
    if out is not None:
        return out
    m = xp.max(x, axis=axis, keepdims=True)
    m[~xp.isfinite(m)] = 0
    with np.errstate(invalid="ignore"):  # an all -inf (or NaN) row gives NaN, like the spec
        e = xp.subtract(x, m)  # a fresh array: the in-place steps below never touch `x`
        xp.exp(e, out=e)
        total = xp.sum(e, axis=axis, keepdims=True)
        if empty_rows_zero:
            total[total == 0] = 1
        e /= total
        return e


_SOFTMAX_BY_GEOMETRY = Lowering("by geometry", "compiled rows or columns for float32 where "
                                "large enough, else numpy: the shape is known in the run")


def _softmax_compiled(xp, x, axis, empty_rows_zero):
    """softmax by `_softmax_rows_loops` (numba) where it serves: float32 on the CPU, rows
    split among the run's threads; over another axis than the last, by
    `_softmax_columns_loops`. Else None."""
    if xp is not np or x.dtype != np.float32 or x.size < tuning.SOFTMAX_COMPILED_MIN:
        return None
    axis %= x.ndim
    if axis != x.ndim - 1:
        return _softmax_columns(x, axis, empty_rows_zero)
    kernel = _compiled.jit(_softmax_rows_loops, fastmath={"contract"})
    if kernel is None:
        return None
    rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    out = _tiles.empty(rows.shape, rows.dtype)
    _compiled.split_rows(kernel, rows.shape[0], rows, out, empty_rows_zero,
                         ns_per_row=tuning.SOFTMAX_NS_PER_VALUE * rows.shape[1],
                         piece=_softmax_rows_piece)
    return out.reshape(x.shape)


def _softmax_columns(x, axis, empty_rows_zero):
    """softmax over `axis`, not the last, of float32 x: as (P, A, Q) with A the axis, each
    piece SOFTMAX_COLUMNS of the Q columns of one p, the A values of a column in A rows of
    memory (a detector's DFL: (1, 16, 4, 8400) over axis 1; a segmentation's classes over
    NCHW's channels). numpy reduces such an axis in strided passes, several times slower."""
    kernel = _compiled.jit(_softmax_columns_loops, fastmath={"contract"})
    if kernel is None:
        return None
    P, A = math.prod(x.shape[:axis]), x.shape[axis]
    Q = x.size // (P * A)
    x3 = np.ascontiguousarray(x).reshape(P, A, Q)
    out = _tiles.empty((P, A, Q), np.float32)
    chunk = min(Q, tuning.SOFTMAX_COLUMNS)
    _compiled.split_rows(kernel, P * -(-Q // chunk), x3, out, empty_rows_zero, chunk,
                         ns_per_row=tuning.SOFTMAX_NS_PER_VALUE * A * chunk,
                         piece=_softmax_columns_piece)
    return out.reshape(x.shape)


def _softmax_columns_piece(block, r0, r1):  # pragma: no cover - numba
    """`_softmax_columns_loops`' piece function, its arguments from the block."""
    v = _compiled.array_at(block, (10,), np.int64)
    _softmax_columns_loops(_compiled.array_at(v[0], (v[1], v[2], v[3]), np.float32),
                           _compiled.array_at(v[4], (v[5], v[6], v[7]), np.float32),
                           v[8] != 0, v[9], r0, r1)


@_compiled.kernel_math(fastmath={"contract"})
def _softmax_columns_loops(x, out, empty_rows_zero, chunk, r0, r1):  # pragma: no cover
    """`_softmax_rows_loops`' steps over axis 1 of x (P, A, Q), for the pieces [r0, r1) of
    `chunk` columns of one p each: the columns' max over A (0 where not finite), e =
    exp(x - max) and its sum, in A order, then e times the reciprocal of the sum. Loops
    along the contiguous columns, which LLVM vectorises."""
    P, A, Q = x.shape
    chunks = (Q + chunk - 1) // chunk
    inf = np.float32(np.inf)
    m = np.empty(chunk, np.float32)
    total = np.empty(chunk, np.float32)
    for r in range(r0, r1):
        p, q0 = r // chunks, (r % chunks) * chunk
        n = min(chunk, Q - q0)
        for j in range(n):
            m[j] = -inf
            total[j] = np.float32(0)
        for a in range(A):
            row = x[p, a, q0:q0 + n]
            for j in range(n):
                m[j] = max(m[j], row[j])
        for j in range(n):
            if m[j] != m[j] or m[j] == inf or m[j] == -inf:
                m[j] = np.float32(0)
        for a in range(A):
            row, dst = x[p, a, q0:q0 + n], out[p, a, q0:q0 + n]
            for j in range(n):
                e = exp_float32(row[j] - m[j])
                dst[j] = e
                total[j] += e
        for j in range(n):
            if empty_rows_zero and total[j] == 0:
                total[j] = np.float32(1)
            total[j] = np.float32(1) / total[j]
        for a in range(A):
            dst = out[p, a, q0:q0 + n]
            for j in range(n):
                dst[j] = dst[j] * total[j]


def _softmax_rows_piece(block, r0, r1):  # pragma: no cover - numba
    """`_softmax_rows_loops`' piece function (ops/cpu/compiled.py: the helpers run its pieces
    without Python), its arguments rebuilt from the block `split_rows` made."""
    v = _compiled.array_at(block, (7,), np.int64)
    _softmax_rows_loops(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                        _compiled.array_at(v[3], (v[4], v[5]), np.float32), v[6] != 0, r0, r1)


@_compiled.kernel_math(fastmath={"contract"})
def _softmax_rows_loops(x, out, empty_rows_zero, r0, r1):  # pragma: no cover - numba
    """The numpy softmax's steps row by row over [r0, r1): the row's max (0 where it is not
    finite), e = exp(x - max), e times the reciprocal of sum(e). The max and the sum run in 8
    interleaved scalar accumulators, which LLVM keeps in registers and vectorises (the same
    order whatever the split; faster than 8 lanes in an array). A NaN is not carried by the
    max: its exp is NaN, and so the sum and the whole row, as with numpy's."""
    n = x.shape[1]
    n8 = n - n % 8
    inf = np.float32(np.inf)
    for i in range(r0, r1):
        row, dst = x[i], out[i]
        m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = -inf
        for j in range(0, n8, 8):
            m0 = max(m0, row[j])
            m1 = max(m1, row[j + 1])
            m2 = max(m2, row[j + 2])
            m3 = max(m3, row[j + 3])
            m4 = max(m4, row[j + 4])
            m5 = max(m5, row[j + 5])
            m6 = max(m6, row[j + 6])
            m7 = max(m7, row[j + 7])
        m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
        for j in range(n8, n):
            m = max(m, row[j])
        if m != m or m == inf or m == -inf:
            m = np.float32(0)
        for j in range(n):
            dst[j] = exp_float32(row[j] - m)
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0)
        for j in range(0, n8, 8):
            s0 += dst[j]
            s1 += dst[j + 1]
            s2 += dst[j + 2]
            s3 += dst[j + 3]
            s4 += dst[j + 4]
            s5 += dst[j + 5]
            s6 += dst[j + 6]
            s7 += dst[j + 7]
        total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        for j in range(n8, n):
            total += dst[j]
        if empty_rows_zero and total == 0:
            total = np.float32(1)
        inv = np.float32(1) / total
        for j in range(n):
            dst[j] = dst[j] * inv


def log_softmax(xp, x, axis: int):
    m = xp.max(x, axis=axis, keepdims=True)
    m[~xp.isfinite(m)] = 0
    with np.errstate(divide="ignore", invalid="ignore"):
        shifted = xp.subtract(x, m)
        lse = xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))
        shifted -= lse
        return shifted


def hardmax(xp, x, axis: int):
    if x.size == 0:
        return xp.zeros(x.shape, x.dtype)
    idx = xp.argmax(x, axis=axis, keepdims=True)
    out = xp.zeros(x.shape, x.dtype)
    xp.put_along_axis(out, idx, x.dtype.type(1), axis=axis)
    return out


class _SoftmaxBase(OpImpl):
    coerce_2d = False

    def fn(self, x, axis):  # pragma: no cover
        raise NotImplementedError

    def run(self, x):
        self.settle_lowering(x)
        xp = self.xp
        rank = x.ndim
        axis = int(self.axis)
        if rank == 0:
            if axis not in (0, -1):
                raise self.fail(f"axis {axis} is out of range for a scalar")
            return self.fn(widen(x).reshape(1), 0).reshape(()).astype(x.dtype, copy=False)
        lo = -rank
        hi = rank if self.coerce_2d else rank - 1
        if not lo <= axis <= hi:
            raise self.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
        if axis < 0:
            axis += rank
        if x.size == 0:
            return xp.zeros(x.shape, x.dtype)
        w = widen(x)
        if self.coerce_2d:
            rows = int(np.prod(x.shape[:axis], dtype=np.int64))
            out = self.fn(w.reshape(rows, -1), 1).reshape(x.shape)
        else:
            out = self.fn(w, axis)
        return out.astype(x.dtype, copy=False)


@register("Softmax", versions=[1, 11])
class Softmax1(_SoftmaxBase):
    coerce_2d = True

    def fn(self, x, axis):
        return softmax(self.xp, x, axis)

    def lower(self, inputs):
        """`_softmax_compiled`'s test: float32, and large enough."""
        x = inputs[0]
        if x is None or x.dtype != np.float32 or not x.static() or not x.shape:
            return PORTABLE if x is not None and x.dtype is not None else _SOFTMAX_BY_GEOMETRY
        if math.prod(x.shape) >= tuning.SOFTMAX_COMPILED_MIN:
            # coerced to 2-D, the softmax is over the last axis of the (rows, -1) matrix
            last = self.coerce_2d or int(self.axis) % len(x.shape) == len(x.shape) - 1
            return compiled_rows("softmax by rows" if last else "softmax by columns")
        return PORTABLE


@register("Softmax", versions=[13])
class Softmax13(Softmax1):
    coerce_2d = False


@register("LogSoftmax", versions=[1, 11])
class LogSoftmax1(_SoftmaxBase):
    coerce_2d = True

    def fn(self, x, axis):
        return log_softmax(self.xp, x, axis)


@register("LogSoftmax", versions=[13])
class LogSoftmax13(LogSoftmax1):
    coerce_2d = False


@register("Hardmax", versions=[1, 11])
class Hardmax1(_SoftmaxBase):
    coerce_2d = True

    def fn(self, x, axis):
        return hardmax(self.xp, x, axis)


@register("Hardmax", versions=[13])
class Hardmax13(Hardmax1):
    coerce_2d = False

"""Normalisation ops: BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, LpNormalization, MeanVarianceNormalization, LRN, Dropout.

Statistics are computed with keepdims reductions in the precision the spec asks for (stash_type,
float32 by default for the transformer norms), never with Python loops over elements.

With numba (ops/cpu/compiled.py), a float LayerNormalization with one output runs compiled
(`_layernorm_rows`): each row's mean, variance (summed in float64) and normalised, scaled and
shifted result in three passes over the row while it is in cache, where numpy makes seven
passes over the whole tensor.

InstanceNormalization and GroupNormalization of float32 run compiled the same way
(`_group_norm_rows`): one row a (sample, group), its statistics summed in float64 in a fixed
order, the rows shared by the run's threads; a channels-last input (a convolution's result)
is normalised in its layout. BatchNormalization in inference mode runs its
x * k + shift in one threaded pass (`_channel_affine_rows`) with numpy's bits, and
RMSNormalization of float32 by rows (`_rmsnorm_rows`) as LayerNormalization does.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import helper

from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops import _xp
from ember.ops._dtypes import is_narrow_float, widen
from ember.ops._layout import channels_last, pixel_rows
from ember.ops._lowering import compiled_rows, numba_serves
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register


def _stash_dtype(impl: OpImpl, x: np.ndarray) -> np.dtype:
    """The precision of stage one: stash_type (a TensorProto dtype), else float32 for low floats."""
    stash = getattr(impl, "stash_type", None)
    if stash is None:
        return np.dtype(np.float32) if x.dtype.itemsize < 4 else x.dtype
    if stash == 1:  # FLOAT, the default: no lookup
        return np.dtype(np.float32)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(stash)))
    except Exception:
        raise impl.fail(f"unsupported stash_type {stash}") from None


def _norm_axis(impl: OpImpl, axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < rank:
        raise impl.fail(f"axis {axis} out of range for rank {rank}")
    return a


def _mean_var(xp, x, axes: tuple[int, ...]):
    mean = xp.mean(x, axis=axes, keepdims=True)
    d = x - mean
    var = xp.mean(d * d, axis=axes, keepdims=True)
    return mean, d, var


def _apply(ufunc, y, p):
    """ufunc(y, p) (an `xp` ufunc), in y (a fresh array) when the result has y's shape and
    dtype."""
    if np.result_type(y.dtype, p.dtype) == y.dtype \
            and np.broadcast_shapes(y.shape, p.shape) == y.shape:
        return ufunc(y, p, out=y)
    return ufunc(y, p)


def _channel_shape(param, rank: int):
    """A per-channel vector (C,) shaped to broadcast against (N, C, D1, ...)."""
    return param.reshape((1, -1) + (1,) * (rank - 2))


# ----------------------------------------------------------------------------------------------
# BatchNormalization


def batchnorm_inference(xp, x, scale, b, mean, var, eps):
    """(x - mean) * scale / sqrt(var + eps) + b (parameters broadcastable to x) as
    x * k + (b - mean * k): one multiply into a fresh array and one add in place.

    float16 and bfloat16 run in float32, rounded once at the end as one op's result is: in the
    narrow type k, the shift, the product and the sum would each be rounded."""
    dtype = x.dtype
    if is_narrow_float(dtype):
        x, scale, b, mean, var, eps = (widen(xp.asarray(v))
                                       for v in (x, scale, b, mean, var, eps))
    k = scale / xp.sqrt(var + eps)
    shift = (b - mean * k).astype(x.dtype, copy=False)
    if xp is np and dtype == np.float32:
        y = _channel_affine_compiled(x, k.astype(x.dtype, copy=False), shift)
        if y is not None:
            return y
    y = xp.multiply(x, k.astype(x.dtype, copy=False))
    y += shift
    return y.astype(dtype, copy=False)


def _channel_affine_compiled(x, k, shift):
    """x * k + shift for float32 x (N, C, ...) and per-channel k, shift shaped (1, C, 1...)
    by `_channel_affine_rows`, a row a (sample, channel); None where it does not apply."""
    if x.dtype != np.float32 or x.ndim < 3 or x.size == 0 or k.dtype != np.float32 \
            or shift.dtype != np.float32 or k.size != x.shape[1] or shift.size != x.shape[1]:
        return None
    if channels_last(x):  # a convolution's result: pixel by pixel, in its layout
        kernel = _compiled.jit(_pixel_affine_rows)
        if kernel is None:
            return None
        rows = pixel_rows(x)
        y = _tiles.empty((x.shape[0],) + x.shape[2:] + (x.shape[1],))
        _compiled.split_rows(kernel, rows.shape[0], rows, np.ascontiguousarray(k.reshape(-1)),
                             np.ascontiguousarray(shift.reshape(-1)), y.reshape(rows.shape),
                             ns_per_row=tuning.CHANNEL_AFFINE_NS * rows.shape[1],
                             piece=_pixel_affine_piece)
        return y.transpose(0, x.ndim - 1, *range(1, x.ndim - 1))
    kernel = _compiled.jit(_channel_affine_rows)
    if kernel is None:
        return None
    rows = np.ascontiguousarray(x).reshape(x.shape[0] * x.shape[1], -1)
    y = _tiles.empty(rows.shape)
    _compiled.split_rows(kernel, rows.shape[0], rows, np.ascontiguousarray(k.reshape(-1)),
                         np.ascontiguousarray(shift.reshape(-1)), y,
                         ns_per_row=tuning.CHANNEL_AFFINE_NS * rows.shape[1],
                         piece=_channel_affine_piece)
    return y.reshape(x.shape)


def _channel_affine_piece(block, row0, row1):  # pragma: no cover - numba
    """`_channel_affine_rows`' piece function (ops/cpu/compiled.py), its arguments rebuilt
    from the block `split_rows` made."""
    v = _compiled.array_at(block, (10,), np.int64)
    _channel_affine_rows(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                         _compiled.array_at(v[3], (v[4],), np.float32),
                         _compiled.array_at(v[5], (v[6],), np.float32),
                         _compiled.array_at(v[7], (v[8], v[9]), np.float32), row0, row1)


@_compiled.kernel_math
def _channel_affine_rows(x, k, shift, y, row0, row1):  # pragma: no cover - numba
    """Rows [row0, row1) of y = x * k[c] + shift[c], x (N * C, spatial), row r of channel
    r % C. No fastmath: the product and the sum are rounded apart, as numpy's two passes do."""
    C = k.shape[0]
    for r in range(row0, row1):
        kc, sc = k[r % C], shift[r % C]
        xr, yr = x[r], y[r]
        for i in range(x.shape[1]):
            yr[i] = xr[i] * kc + sc


def _pixel_affine_piece(block, row0, row1):  # pragma: no cover - numba
    """`_pixel_affine_rows`' piece function (ops/cpu/compiled.py)."""
    v = _compiled.array_at(block, (10,), np.int64)
    _pixel_affine_rows(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                       _compiled.array_at(v[3], (v[4],), np.float32),
                       _compiled.array_at(v[5], (v[6],), np.float32),
                       _compiled.array_at(v[7], (v[8], v[9]), np.float32), row0, row1)


@_compiled.kernel_math
def _pixel_affine_rows(x, k, shift, y, row0, row1):  # pragma: no cover - numba
    """`_channel_affine_rows` over a channels-last image's pixels, x and y (pixels, C)."""
    for r in range(row0, row1):
        xr, yr = x[r], y[r]
        for c in range(x.shape[1]):
            yr[c] = xr[c] * k[c] + shift[c]


@register("BatchNormalization", versions=[1, 6, 7, 9])
class BatchNormalization1(OpImpl):
    """Inference form (spatial=1 per-channel, spatial=0 per-activation); the optional training
    outputs (mean, var, saved_mean, saved_var) are produced from the batch statistics."""

    def setup(self):
        self.spatial = getattr(self, "spatial", 1)
        if self.spatial is None:
            self.spatial = 1

    def lower(self, inputs):
        return _norm_lowering(inputs[0], 3, _BATCHNORM_WHY) if self.spatial else PORTABLE

    def _shape(self, p, x):
        if self.spatial:
            return _channel_shape(p, x.ndim)
        return p.reshape((1,) + p.shape)

    def run(self, x, scale, b, mean, var):
        self.settle_lowering(x)
        xp = self.xp
        dt = x.dtype
        eps = xp.asarray(self.epsilon, dtype=dt)
        s, bb = self._shape(scale, x), self._shape(b, x)
        m, v = self._shape(mean, x), self._shape(var, x)
        y = batchnorm_inference(xp, x, s, bb, m, v, eps)
        if self.n_outputs <= 1:
            return y
        axes = tuple(i for i in range(x.ndim) if i != 1) if self.spatial else (0,)
        bm = xp.mean(x, axis=axes)
        bv = xp.var(x, axis=axes)
        mom = self.momentum
        run_mean = (mean * mom + bm.reshape(mean.shape) * (1 - mom)).astype(mean.dtype)
        run_var = (var * mom + bv.reshape(var.shape) * (1 - mom)).astype(var.dtype)
        return (y, run_mean, run_var, bm.astype(dt).reshape(mean.shape),
                bv.astype(dt).reshape(var.shape))


@register("BatchNormalization", versions=[14, 15])
class BatchNormalization14(OpImpl):
    def lower(self, inputs):
        return PORTABLE if self.training_mode else _norm_lowering(inputs[0], 3, _BATCHNORM_WHY)

    def run(self, x, scale, b, mean, var):
        self.settle_lowering(x)
        xp = self.xp
        dt = x.dtype
        rank = x.ndim
        s, bb = _channel_shape(scale, rank), _channel_shape(b, rank)
        if not self.training_mode:
            m, v = _channel_shape(mean, rank), _channel_shape(var, rank)
            y = batchnorm_inference(xp, x, s, bb, m, v, xp.asarray(self.epsilon, dtype=v.dtype))
            if self.n_outputs > 1:
                return y, mean, var
            return y
        axes = (0,) + tuple(range(2, rank))
        bm = xp.mean(x, axis=axes, keepdims=True)
        d = x - bm
        bv = xp.mean(d * d, axis=axes, keepdims=True)
        y = d * (s.astype(dt, copy=False) / xp.sqrt(bv + xp.asarray(self.epsilon, dtype=dt))) \
            + bb.astype(dt, copy=False)
        y = y.astype(dt, copy=False)
        mom = xp.asarray(self.momentum, dtype=mean.dtype)
        one = xp.asarray(1, dtype=mean.dtype)
        run_mean = (mean * mom + bm.reshape(-1).astype(mean.dtype) * (one - mom)).astype(mean.dtype)
        run_var = (var * mom + bv.reshape(-1).astype(var.dtype) * (one - mom)).astype(var.dtype)
        return y, run_mean, run_var


_BATCHNORM_WHY = "batch norm by (sample, channel): x * k + shift in one pass, numpy's bits"
# where the graph declares neither x's dtype nor its rank: the first run settles it
_NORM_BY_DTYPE = Lowering("by geometry", "compiled rows for float32, else numpy: the input's "
                          "dtype and rank are known in the run")


def _unknown(x) -> bool:
    """Whether the plan knows too little of x (a Sketch) to choose a norm's kernel: then the
    first run chooses (`_NORM_BY_DTYPE`, `OpImpl.settle_lowering`)."""
    return x is None or x.dtype is None or x.ndim is None


def _norm_lowering(x, min_rank: int, why: str) -> Lowering:
    """The compiled rows (`why`) for float32 x of at least `min_rank` dims, numpy for others,
    or a choice left to the run where the plan does not know x's dtype or rank."""
    if _unknown(x):
        return _NORM_BY_DTYPE if numba_serves() else PORTABLE
    return compiled_rows(why) if x.dtype == np.float32 and x.ndim >= min_rank else PORTABLE


# ----------------------------------------------------------------------------------------------
# InstanceNormalization, LayerNormalization, GroupNormalization, RMSNormalization


@register("InstanceNormalization", versions=[1, 6, 22])
class InstanceNormalization(OpImpl):
    def lower(self, inputs):
        return _norm_lowering(inputs[0], 3, "instance norm by (sample, channel): float64 "
                              "statistics, one row a channel")

    def run(self, x, scale, b):
        self.settle_lowering(x)
        xp = self.xp
        dt = x.dtype
        if xp is np and x.ndim >= 3:
            c = x.shape[1]
            y = _group_norm_compiled(x, c, scale.reshape(c, 1) if scale.size == c else None,
                                     b.reshape(c, 1) if b.size == c else None, self.epsilon)
            if y is not None:
                return y
        work = x.astype(np.float32) if dt.itemsize < 4 else x
        axes = tuple(range(2, x.ndim))
        mean, d, var = _mean_var(xp, work, axes)
        inv = 1.0 / xp.sqrt(var + xp.asarray(self.epsilon, dtype=work.dtype))
        y = d * inv
        y = y * _channel_shape(scale, x.ndim).astype(work.dtype) \
            + _channel_shape(b, x.ndim).astype(work.dtype)
        return y.astype(dt, copy=False)


@register("LayerNormalization", versions=[17])
class LayerNormalization17(OpImpl):
    def lower(self, inputs):
        """`_layernorm_compiled`'s test, where the plan knows the dtypes: float32 / float64
        in and one output (the stash dtype the input's own)."""
        x = inputs[0]
        if x is not None and x.dtype in (np.float32, np.float64) and self.n_outputs == 1 \
                and np.dtype(_stash_dtype(self, x)) == x.dtype:
            return compiled_rows("layer norm by rows: one pass a row, no temporaries")
        return PORTABLE

    def run(self, x, scale, b=None):
        xp = self.xp
        dt = x.dtype
        axis = _norm_axis(self, self.axis, x.ndim)
        sd = _stash_dtype(self, x)
        if xp is np and self.n_outputs == 1 and sd == dt:
            y = _layernorm_compiled(x, axis, scale, b, self.epsilon)
            if y is not None:
                return y
        work = x.astype(sd, copy=False)
        axes = tuple(range(axis, x.ndim))
        mean, d, var = _mean_var(xp, work, axes)
        inv = xp.reciprocal(xp.sqrt(var + xp.asarray(self.epsilon, dtype=sd)))
        d *= inv  # d is a fresh array: normalise, scale and shift it in place
        y = _apply(xp.multiply, d.astype(dt, copy=False), scale)
        if b is not None:
            y = _apply(xp.add, y, b)
        y = y.astype(dt, copy=False)
        if self.n_outputs == 1:
            return y
        return y, mean, inv


def _layernorm_compiled(x, axis, scale, b, epsilon):
    """The compiled LayerNormalization of float x over axes [axis, ndim), or None where it
    does not apply: no numba, another dtype, or a scale / bias not of the normalised shape.
    (A decoder step normalises one row of 768 values: the checks are kept cheap.)"""
    norm_shape = x.shape[axis:]
    D = math.prod(norm_shape)
    if x.dtype not in (np.float32, np.float64) or D == 0 or x.size == 0 or \
            not _fits(scale, x.dtype, norm_shape, D) or \
            (b is not None and not _fits(b, x.dtype, norm_shape, D)):
        return None
    kernel = _compiled.jit(_layernorm_rows, fastmath={"reassoc", "contract"})
    if kernel is None:
        return None
    rows = x.reshape(-1, D)  # a copy only where x's layout needs one
    y = np.empty(rows.shape, x.dtype)
    bias = np.zeros(D, x.dtype) if b is None else b.reshape(D)
    _compiled.split_rows(kernel, rows.shape[0], rows, scale.reshape(D), bias,
                         float(epsilon), y, ns_per_row=tuning.LAYERNORM_NS * D,
                         piece=_LAYERNORM_PIECES[x.dtype == np.float32])
    return y.reshape(x.shape)


# `_layernorm_rows`' piece functions (ops/cpu/compiled.py: the helpers run its pieces without
# Python), one per dtype, the arguments rebuilt from the block `split_rows` made.
@_compiled.kernel_math
def _layernorm_arguments(block, dtype):  # pragma: no cover - numba
    v = _compiled.array_at(block, (11,), np.int64)
    f = _compiled.array_at(block, (11,), np.float64)
    return (_compiled.array_at(v[0], (v[1], v[2]), dtype),
            _compiled.array_at(v[3], (v[4],), dtype), _compiled.array_at(v[5], (v[6],), dtype),
            f[7], _compiled.array_at(v[8], (v[9], v[10]), dtype))


def _layernorm_piece32(block, row0, row1):  # pragma: no cover - numba
    _layernorm_rows(*_layernorm_arguments(block, np.float32), row0, row1)


def _layernorm_piece64(block, row0, row1):  # pragma: no cover - numba
    _layernorm_rows(*_layernorm_arguments(block, np.float64), row0, row1)


_LAYERNORM_PIECES = {True: _layernorm_piece32, False: _layernorm_piece64}


def _fits(param, dtype, norm_shape, D) -> bool:
    """Whether a scale or bias has x's dtype and the normalised shape, leading 1s allowed."""
    return param.dtype == dtype and param.size == D and (
        param.shape == norm_shape or np.broadcast_shapes(param.shape, norm_shape) == norm_shape)


@_compiled.kernel_math(fastmath={"reassoc", "contract"})
def _layernorm_rows(x, scale, bias, epsilon, y, row0, row1):  # pragma: no cover - numba
    """Rows [row0, row1) of y = (x - mean) / sqrt(var + epsilon) * scale + bias, x (R, D):
    mean and variance summed in float64, then the row normalised in x's dtype as numpy's
    kernel does (faster than in float64). A row's bits do not depend on how the rows
    are split (the reassociated sums are fixed by the compiled code and D)."""
    D = x.shape[1]
    stats = np.empty(2, x.dtype)  # mean and 1 / std, rounded to x's dtype
    for r in range(row0, row1):
        xr, yr = x[r], y[r]
        total = 0.0
        for k in range(D):
            total += np.float64(xr[k])
        mean = total / D
        squares = 0.0
        for k in range(D):
            d = np.float64(xr[k]) - mean
            squares += d * d
        stats[0] = mean
        stats[1] = 1.0 / np.sqrt(squares / D + epsilon)
        m, inv = stats[0], stats[1]
        for k in range(D):
            yr[k] = (xr[k] - m) * inv * scale[k] + bias[k]


def _group_norm_compiled(x, groups, scale, bias, epsilon):
    """The compiled Instance / GroupNormalization of float32 x (N, C, ...) in `groups` groups
    of C / groups channels, scale and bias per channel shaped (groups, C / groups); None
    where it does not apply (no numba, another dtype, parameters not of that shape)."""
    if x.dtype != np.float32 or x.size == 0 or scale is None or bias is None \
            or scale.dtype != np.float32 or bias.dtype != np.float32:
        return None
    if channels_last(x):
        return _group_norm_channels_last(x, groups, scale, bias, epsilon)
    kernel = _compiled.jit(_group_norm_rows, fastmath={"reassoc", "contract"})
    if kernel is None:
        return None
    rows = np.ascontiguousarray(x).reshape(x.shape[0] * groups, -1)
    y = _tiles.empty(rows.shape)
    _compiled.split_rows(kernel, rows.shape[0], rows, np.ascontiguousarray(scale),
                         np.ascontiguousarray(bias), float(epsilon), y,
                         ns_per_row=tuning.GROUPNORM_NS * rows.shape[1],
                         piece=_group_norm_piece)
    return y.reshape(x.shape)


def _group_norm_piece(block, row0, row1):  # pragma: no cover - numba
    """`_group_norm_rows`' piece function (ops/cpu/compiled.py), its arguments rebuilt from
    the block `split_rows` made."""
    v = _compiled.array_at(block, (13,), np.int64)
    f = _compiled.array_at(block, (13,), np.float64)
    _group_norm_rows(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                     _compiled.array_at(v[3], (v[4], v[5]), np.float32),
                     _compiled.array_at(v[6], (v[7], v[8]), np.float32), f[9],
                     _compiled.array_at(v[10], (v[11], v[12]), np.float32), row0, row1)


@_compiled.kernel_math(fastmath={"reassoc", "contract"})
def _group_norm_rows(x, scale, bias, epsilon, y, row0, row1):  # pragma: no cover - numba
    """Rows [row0, row1) of a group norm, x (N * G, K * L): row r is group r % G of a sample,
    its K channels of L values each; scale and bias (G, K). Mean and variance summed in
    float64 over the row (two passes, the row in cache), then each channel normalised as
    (x - mean) * (inv_std * scale) + bias in float32. A row's bits do not depend on the
    split: its sums run in the order the compiled loop and the row's length fix."""
    G, K = scale.shape
    D = x.shape[1]
    L = D // K
    stats = np.empty(2, np.float32)  # mean and 1 / std, rounded to float32
    for r in range(row0, row1):
        xr, yr = x[r], y[r]
        g = r % G
        total = 0.0
        for i in range(D):
            total += np.float64(xr[i])
        mean = total / D
        squares = 0.0
        for i in range(D):
            d = np.float64(xr[i]) - mean
            squares += d * d
        stats[0] = mean
        stats[1] = 1.0 / np.sqrt(squares / D + epsilon)
        m = stats[0]
        for k in range(K):
            ck = stats[1] * scale[g, k]
            bk = bias[g, k]
            # slices: an index `base + i` costs a wraparound test, and the loop its vectors
            xs, ys = xr[k * L:(k + 1) * L], yr[k * L:(k + 1) * L]
            for i in range(L):
                ys[i] = (xs[i] - m) * ck + bk


# A channels-last image's sums run over fixed blocks of this many pixels (the rows the threads
# share), then over the blocks in order: the same sums whatever the split.
_CHUNK_PIXELS = 256


def _group_norm_channels_last(x, groups, scale, bias, epsilon):
    """`_group_norm_compiled` of a channels-last x (ops/_layout.py: a 3x3 convolution's
    result), read and written in its layout: a group's values are strided there, so per-channel
    sums over blocks of pixels (`_channel_sums_rows`) replace the rows of `_group_norm_rows`,
    and the pixels are normalised in rows of C (`_channel_norm_rows`). The sums are of x minus
    a shift per (sample, group), the group's first value, in float64: the variance as
    E[d^2] - E[d]^2 then loses little. None without numba."""
    sums_kernel = _compiled.jit(_channel_sums_rows, fastmath={"contract"})
    norm_kernel = _compiled.jit(_channel_norm_rows, fastmath={"contract"})
    if sums_kernel is None or norm_kernel is None:
        return None
    n, c = x.shape[0], x.shape[1]
    k = c // groups
    rows = pixel_rows(x)  # (N * pixels, C), a view
    pixels = rows.shape[0] // n
    chunks = -(-pixels // _CHUNK_PIXELS)
    shift = np.repeat(rows[::pixels, ::k].astype(np.float64), k, axis=1)  # (N, C)
    sums = np.empty((n * chunks, 2, c), np.float64)
    _compiled.split_rows(sums_kernel, n * chunks, rows, shift, _CHUNK_PIXELS, chunks, sums,
                         ns_per_row=tuning.CHANNEL_AFFINE_NS * 2 * _CHUNK_PIXELS * c,
                         piece=_channel_sums_piece)
    totals = sums.reshape(n, chunks, 2, groups, k).sum(axis=(1, 4))  # (N, 2, G), in order
    count = pixels * k
    mean_d = totals[:, 0] / count
    var = np.maximum(totals[:, 1] / count - mean_d * mean_d, 0.0)
    mean = (mean_d + shift[:, ::k]).astype(np.float32)
    inv = (1.0 / np.sqrt(var + epsilon)).astype(np.float32)
    # per (sample, channel), as `_group_norm_rows` rounds them: mean and inv_std * scale
    means = np.repeat(mean, k, axis=1)
    factors = np.repeat(inv, k, axis=1) * scale.reshape(1, c)
    shifts = np.ascontiguousarray(np.broadcast_to(bias.reshape(1, c), (n, c)))
    y = _tiles.empty((n,) + x.shape[2:] + (c,))
    _compiled.split_rows(norm_kernel, rows.shape[0], rows, means, factors, shifts, pixels,
                         y.reshape(-1, c), ns_per_row=tuning.CHANNEL_AFFINE_NS * c,
                         piece=_channel_norm_piece)
    return y.transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


def _channel_sums_piece(block, row0, row1):  # pragma: no cover - numba
    """`_channel_sums_rows`' piece function (ops/cpu/compiled.py)."""
    v = _compiled.array_at(block, (12,), np.int64)
    _channel_sums_rows(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                       _compiled.array_at(v[3], (v[4], v[5]), np.float64), v[6], v[7],
                       _compiled.array_at(v[8], (v[9], v[10], v[11]), np.float64), row0, row1)


@_compiled.kernel_math(fastmath={"contract"})
def _channel_sums_rows(x, shift, chunk, chunks, sums, row0, row1):  # pragma: no cover - numba
    """Blocks [row0, row1) of a channels-last image's per-channel sums: block r covers pixels
    [j * chunk, (j + 1) * chunk) of sample r // chunks (j = r % chunks) of x (N * pixels, C);
    sums[r] = (sum of d, sum of d * d) per channel, d = x - shift[sample] in float64, the
    pixels added in order (vectorised across the channels)."""
    C = x.shape[1]
    pixels = x.shape[0] // shift.shape[0]
    for r in range(row0, row1):
        n = r // chunks
        p0 = n * pixels + (r - n * chunks) * chunk
        p1 = min(p0 + chunk, (n + 1) * pixels)
        s1, s2, sh = sums[r, 0], sums[r, 1], shift[n]
        for ci in range(C):
            s1[ci] = 0.0
            s2[ci] = 0.0
        for p in range(p0, p1):
            xp = x[p]
            for ci in range(C):
                d = np.float64(xp[ci]) - sh[ci]
                s1[ci] += d
                s2[ci] += d * d


def _channel_norm_piece(block, row0, row1):  # pragma: no cover - numba
    """`_channel_norm_rows`' piece function (ops/cpu/compiled.py)."""
    v = _compiled.array_at(block, (16,), np.int64)
    _channel_norm_rows(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                       _compiled.array_at(v[3], (v[4], v[5]), np.float32),
                       _compiled.array_at(v[6], (v[7], v[8]), np.float32),
                       _compiled.array_at(v[9], (v[10], v[11]), np.float32), v[12],
                       _compiled.array_at(v[13], (v[14], v[15]), np.float32), row0, row1)


@_compiled.kernel_math(fastmath={"contract"})
def _channel_norm_rows(x, means, factors, shifts, pixels, y, row0, row1):  # pragma: no cover
    """Pixels [row0, row1) of a channels-last norm, x and y (N * pixels, C): y = (x - mean) *
    factor + shift with the (sample, channel)'s mean, inv_std * scale and bias."""
    C = x.shape[1]
    for r in range(row0, row1):
        n = r // pixels
        xr, yr, m, f, b = x[r], y[r], means[n], factors[n], shifts[n]
        for ci in range(C):
            yr[ci] = (xr[ci] - m[ci]) * f[ci] + b[ci]


class _GroupNorm(OpImpl):
    per_channel_params = True

    def lower(self, inputs):
        """`_group_norm_compiled`'s test where the plan knows the dtypes: float32 in, the
        statistics' stash dtype float32 (the default)."""
        x = inputs[0]
        if not _unknown(x) and _stash_dtype(self, x) != np.float32:
            return PORTABLE
        return _norm_lowering(x, 2, "group norm by (sample, group): float64 statistics, one "
                              "row a group")

    def run(self, x, scale, b):
        self.settle_lowering(x)
        xp = self.xp
        dt = x.dtype
        n, c = x.shape[0], x.shape[1]
        g = int(self.num_groups)
        if g <= 0 or c % g:
            raise self.fail(f"num_groups {g} does not divide the {c} channels")
        sd = _stash_dtype(self, x)
        if xp is np and sd == np.float32 and scale.size == (c if self.per_channel_params
                                                            else g) and b.size == scale.size:
            per_channel = (scale, b) if self.per_channel_params else \
                (np.repeat(scale.reshape(g), c // g), np.repeat(b.reshape(g), c // g))
            y = _group_norm_compiled(x, g, *(p.reshape(g, c // g) for p in per_channel),
                                     self.epsilon)
            if y is not None:
                return y
        work = x.astype(sd, copy=False).reshape(n, g, -1)
        mean, d, var = _mean_var(xp, work, (2,))
        norm = (d / xp.sqrt(var + xp.asarray(self.epsilon, dtype=sd))).reshape(x.shape)
        norm = norm.astype(dt, copy=False)
        if not self.per_channel_params:
            scale = xp.repeat(scale, c // g)
            b = xp.repeat(b, c // g)
        y = norm * _channel_shape(scale, x.ndim) + _channel_shape(b, x.ndim)
        return y.astype(dt, copy=False)


@register("GroupNormalization", versions=[18])
class GroupNormalization18(_GroupNorm):
    per_channel_params = False  # scale and bias have one entry per group


@register("GroupNormalization", versions=[21])
class GroupNormalization21(_GroupNorm):
    per_channel_params = True


@register("RMSNormalization", versions=[23])
class RMSNormalization23(OpImpl):
    def lower(self, inputs):
        """`_rmsnorm_compiled`'s test where the plan knows the dtypes: float32 x and scale,
        float32 statistics (the default stash_type)."""
        x = inputs[0]
        scale = inputs[1] if len(inputs) > 1 else None
        if _unknown(x) or scale is None or scale.dtype is None:
            return _NORM_BY_DTYPE if numba_serves() else PORTABLE
        if x.dtype == np.float32 and scale.dtype == np.float32 \
                and _stash_dtype(self, x) == np.float32:
            return compiled_rows("RMS norm by rows: float64 sum of squares, one pass a row")
        return PORTABLE

    def run(self, x, scale):
        self.settle_lowering(x, scale)
        xp = self.xp
        axis = _norm_axis(self, self.axis, x.ndim)
        sd = _stash_dtype(self, x)
        if xp is np and sd == np.float32:
            y = _rmsnorm_compiled(x, axis, scale, self.epsilon)
            if y is not None:
                return y
        work = x.astype(sd, copy=False)
        axes = tuple(range(axis, x.ndim))
        ms = xp.mean(work * work, axis=axes, keepdims=True)
        norm = work / xp.sqrt(ms + xp.asarray(self.epsilon, dtype=sd))
        y = norm.astype(x.dtype, copy=False).astype(scale.dtype, copy=False) * scale
        return y.astype(scale.dtype, copy=False)


def _rmsnorm_compiled(x, axis, scale, epsilon):
    """The compiled RMSNormalization of float32 x over axes [axis, ndim), or None where it
    does not apply: no numba, another dtype, or a scale not of the normalised shape."""
    norm_shape = x.shape[axis:]
    D = math.prod(norm_shape)
    if x.dtype != np.float32 or D == 0 or x.size == 0 \
            or not _fits(scale, x.dtype, norm_shape, D):
        return None
    kernel = _compiled.jit(_rmsnorm_rows, fastmath={"reassoc", "contract"})
    if kernel is None:
        return None
    rows = np.ascontiguousarray(x).reshape(-1, D)
    y = _tiles.empty(rows.shape)
    _compiled.split_rows(kernel, rows.shape[0], rows, np.ascontiguousarray(scale).reshape(D),
                         float(epsilon), y, ns_per_row=tuning.LAYERNORM_NS * D,
                         piece=_rmsnorm_piece)
    return y.reshape(x.shape)


def _rmsnorm_piece(block, row0, row1):  # pragma: no cover - numba
    """`_rmsnorm_rows`' piece function (ops/cpu/compiled.py), its arguments rebuilt from the
    block `split_rows` made."""
    v = _compiled.array_at(block, (9,), np.int64)
    f = _compiled.array_at(block, (9,), np.float64)
    _rmsnorm_rows(_compiled.array_at(v[0], (v[1], v[2]), np.float32),
                  _compiled.array_at(v[3], (v[4],), np.float32), f[5],
                  _compiled.array_at(v[6], (v[7], v[8]), np.float32), row0, row1)


@_compiled.kernel_math(fastmath={"reassoc", "contract"})
def _rmsnorm_rows(x, scale, epsilon, y, row0, row1):  # pragma: no cover - numba
    """Rows [row0, row1) of y = x / sqrt(mean(x * x) + epsilon) * scale, x (R, D): the sum of
    squares in float64 (its order fixed by the compiled loop and D, whatever the split), the
    row scaled in float32."""
    D = x.shape[1]
    inv = np.empty(1, np.float32)
    for r in range(row0, row1):
        xr, yr = x[r], y[r]
        squares = 0.0
        for k in range(D):
            v = np.float64(xr[k])
            squares += v * v
        inv[0] = 1.0 / np.sqrt(squares / D + epsilon)
        f = inv[0]
        for k in range(D):
            yr[k] = xr[k] * f * scale[k]


# ----------------------------------------------------------------------------------------------
# LpNormalization, MeanVarianceNormalization, LRN


@register("LpNormalization", versions=[1, 22])
class LpNormalization(OpImpl):
    def setup(self):
        if self.p not in (1, 2):
            raise self.fail(f"p must be 1 or 2, got {self.p}")

    def run(self, x):
        xp = self.xp
        axis = _norm_axis(self, self.axis, x.ndim)
        w = x.astype(np.float32) if x.dtype.itemsize < 4 else x
        if self.p == 1:
            norm = xp.sum(xp.abs(w), axis=axis, keepdims=True)
        else:
            norm = xp.sqrt(xp.sum(w * w, axis=axis, keepdims=True))
        zero = norm == 0
        y = w / xp.where(zero, xp.ones_like(norm), norm)
        y = xp.where(zero, xp.zeros_like(y), y)
        return y.astype(x.dtype, copy=False)


@register("MeanVarianceNormalization", versions=[9, 13])
class MeanVarianceNormalization(OpImpl):
    def run(self, x):
        xp = self.xp
        rank = x.ndim
        axes = tuple(sorted({a + rank if a < 0 else a for a in self.axes}))
        work = x.astype(np.float32) if x.dtype.itemsize < 4 else x
        mean, d, var = _mean_var(xp, work, axes)
        y = d / (xp.sqrt(var) + xp.asarray(1e-9, dtype=work.dtype))
        return y.astype(x.dtype, copy=False)


@register("LRN", versions=[1, 13])
class LRN(OpImpl):
    def run(self, x):
        xp = self.xp
        size = int(self.size)
        c = x.shape[1]
        lo = (size - 1) // 2
        hi = size - 1 - lo  # ceil((size-1)/2)
        sq = (x * x).astype(np.float64 if x.dtype == np.float64 else np.float32)
        # Sum over the channel window [c-lo, c+hi] with a zero-padded cumulative sum.
        pad = [(0, 0)] * x.ndim
        pad[1] = (lo + 1, hi)
        cs = xp.cumsum(xp.pad(sq, pad), axis=1)
        upper = xp.take(cs, xp.arange(c) + lo + 1 + hi, axis=1)
        lower = xp.take(cs, xp.arange(c), axis=1)
        square_sum = upper - lower
        base = self.bias + (self.alpha / size) * square_sum
        y = x / base ** self.beta
        return y.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# Dropout


def _dropout_train(xp, impl: OpImpl, x, ratio: float, mask_dtype):
    rng = np.random.RandomState(impl.seed) if getattr(impl, "seed", None) is not None \
        else np.random.RandomState()
    mask = xp.asarray(rng.uniform(0, 1.0, x.shape) >= ratio)  # numpy's generator, on the host
    scale = 1.0 / (1.0 - ratio)
    y = (mask * x * scale).astype(x.dtype, copy=False)
    return y, mask.astype(mask_dtype)


@register("Dropout", versions=[1, 6])
class Dropout1(OpImpl):
    """Old form; mask has the input's type. Its is_test attribute defaults to training, which
    exporters left unset on inference graphs, so like other runtimes we run it as identity."""

    def run(self, x):
        if self.n_outputs > 1:
            return x, self.xp.ones(x.shape, dtype=x.dtype)
        return x


@register("Dropout", versions=[7])
class Dropout7(OpImpl):
    mask_dtype = None  # the input's type

    def run(self, x):
        if self.n_outputs > 1:
            return x, self.xp.ones(x.shape, dtype=self.mask_dtype or x.dtype)
        return x


@register("Dropout", versions=[10])
class Dropout10(Dropout7):
    mask_dtype = np.bool_


@register("Dropout", versions=[12, 13, 22])
class Dropout12(OpImpl):
    def run(self, x, ratio=None, training_mode=None):
        xp = self.xp
        r = 0.5 if ratio is None else float(_xp.to_host(xp, ratio).reshape(()))
        training = training_mode is not None and \
            bool(_xp.to_host(xp, training_mode).reshape(()))
        if not training or r == 0:
            if self.n_outputs > 1:
                return x, xp.ones(x.shape, dtype=np.bool_)
            return x
        if not 0 <= r < 1:
            raise self.fail(f"ratio must be in [0, 1), got {r}")
        y, mask = _dropout_train(xp, self, x, r, np.bool_)
        return (y, mask) if self.n_outputs > 1 else y

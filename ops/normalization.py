"""Normalisation ops: BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, LpNormalization, MeanVarianceNormalization, LRN, Dropout.

Statistics are computed with keepdims reductions in the precision the spec asks for (stash_type,
float32 by default for the transformer norms), never with Python loops over elements.

With numba (ops/cpu/compiled.py), a float LayerNormalization with one output runs compiled
(`_layernorm_rows`): each row's mean, variance (summed in float64) and normalised, scaled and
shifted result in three passes over the row while it is in cache, where numpy makes seven
passes over the whole tensor.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import helper

from ember.ops.cpu import compiled as _compiled, tuning
from ember.ops import _xp
from ember.ops._dtypes import is_narrow_float, widen
from ember.ops._lowering import compiled_rows
from ember.ops.registry import PORTABLE, OpImpl, register


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
    y = xp.multiply(x, k.astype(x.dtype, copy=False))
    y += shift
    return y.astype(dtype, copy=False)


@register("BatchNormalization", versions=[1, 6, 7, 9])
class BatchNormalization1(OpImpl):
    """Inference form (spatial=1 per-channel, spatial=0 per-activation); the optional training
    outputs (mean, var, saved_mean, saved_var) are produced from the batch statistics."""

    def setup(self):
        self.spatial = getattr(self, "spatial", 1)
        if self.spatial is None:
            self.spatial = 1

    def _shape(self, p, x):
        if self.spatial:
            return _channel_shape(p, x.ndim)
        return p.reshape((1,) + p.shape)

    def run(self, x, scale, b, mean, var):
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
    def run(self, x, scale, b, mean, var):
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


# ----------------------------------------------------------------------------------------------
# InstanceNormalization, LayerNormalization, GroupNormalization, RMSNormalization


@register("InstanceNormalization", versions=[1, 6, 22])
class InstanceNormalization(OpImpl):
    def run(self, x, scale, b):
        xp = self.xp
        dt = x.dtype
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


class _GroupNorm(OpImpl):
    per_channel_params = True

    def run(self, x, scale, b):
        xp = self.xp
        dt = x.dtype
        n, c = x.shape[0], x.shape[1]
        g = int(self.num_groups)
        if g <= 0 or c % g:
            raise self.fail(f"num_groups {g} does not divide the {c} channels")
        sd = _stash_dtype(self, x)
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
    def run(self, x, scale):
        xp = self.xp
        axis = _norm_axis(self, self.axis, x.ndim)
        sd = _stash_dtype(self, x)
        work = x.astype(sd, copy=False)
        axes = tuple(range(axis, x.ndim))
        ms = xp.mean(work * work, axis=axes, keepdims=True)
        norm = work / xp.sqrt(ms + xp.asarray(self.epsilon, dtype=sd))
        y = norm.astype(x.dtype, copy=False).astype(scale.dtype, copy=False) * scale
        return y.astype(scale.dtype, copy=False)


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

"""com.microsoft quantized contrib ops, with onnxruntime's semantics.

QuantizeLinear and DequantizeLinear (the com.microsoft versions: 8/16/4-bit, per-tensor or per
`axis`), the QLinear* element-wise, pooling, concatenation and softmax ops that
`onnxruntime.quantization.quantize_static` writes in the QOperator format, QGemm, and the
integer-matmul ops of dynamic quantisation (DynamicQuantizeMatMul, MatMulIntegerToFloat,
QAttention, QEmbedLayerNormalization, DynamicQuantizeLSTM).

Arithmetic follows onnxruntime's CPU kernels:
- integer products are exact: zero points are subtracted before the matmul, and the matmul runs
  on float64 operands holding small integers, whose sums are exact for any realistic K
  (|a - za| * |b - zb| <= 255 * 255, so a sum is exact below K = 1.3e11), which is the int32
  accumulation onnxruntime does without its wrap-around;
- scales combine in float32 in onnxruntime's order (for example a_scale * b_scale, then times
  the float32-converted accumulator), and requantisation is round half to even of the float32
  value, plus the zero point, saturated to the output type;
- the element-wise lookup-table ops (QLinearSigmoid, QLinearLeakyRelu) build onnxruntime's
  256-entry table (dequantise every code, apply the function in float32, quantise), so they are
  exact up to the accuracy of the float32 function.
onnxruntime's kernels are not all exact: some of its SIMD paths requantise in fixed point,
its logistic / tanh are polynomial approximations, and its float sums run in another order;
where that tips a value across a rounding boundary its result differs from the exact one by
one quantisation step (the tests allow exactly that, and say so; onnxruntime 1.32 on an AVX2
CPU matched these kernels exactly on the tests' data except where noted there).

Kernels compute over `xp = self.xp` (numpy on the CPU, cupy on CUDA). Scales and zero points
stay arrays (0-d, or shaped to broadcast), so no kernel reads a tensor on the host except
QEmbedLayerNormalization's index range check and DynamicQuantizeLSTM's sequence_lens (its
time-loop bound), both through `_xp.to_host`.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ember.ops import _integer as _int, _xp
from ember.ops._layout import channels_last, memory_order, moved
from ember.ops.microsoft.attention import attention_scores, weighted_values
from ember.ops.reduction import softmax
from ember.ops.registry import OpImpl, Sketch, register
from ember.ops._lowering import numba_serves, remembered_route
from ember.ops.cpu import qlinear as _qlinear
from ember.ops.cpu import tuning
from ember.ops.registry import PORTABLE, Lowering

_MS = "com.microsoft"

_INT4 = (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4))
_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))
# the quantised types of the com.microsoft QuantizeLinear / DequantizeLinear
_QTYPES = _INT8 + (np.dtype(np.int16), np.dtype(np.uint16)) + _INT4
_F32 = np.float32


def _int_range(dtype) -> tuple[int, int]:
    dtype = np.dtype(dtype)
    info = ml_dtypes.iinfo(dtype) if dtype in _INT4 else np.iinfo(dtype)
    return int(info.min), int(info.max)


def _saturate(xp, q, dtype):
    """Integer-valued float array `q` clipped to `dtype`'s range and cast to it."""
    dtype = np.dtype(dtype)
    lo, hi = _int_range(dtype)
    q = xp.clip(q, lo, hi)
    if dtype in _INT4:  # ml_dtypes' 4-bit types convert from a small integer type
        return q.astype(np.int8).astype(dtype)
    return q.astype(dtype)


def _quantize(xp, y, scale, zero_point, dtype):
    """onnxruntime's quantisation: round half to even of y / scale (float32), plus the zero
    point, saturated to `dtype`."""
    with np.errstate(all="ignore"):
        q = xp.rint(y / scale)
    if zero_point is not None:
        q = q + zero_point
    return _saturate(xp, q, dtype)


def _exact_matmul(xp, a, b):
    """The exact integer matmul of two integer-valued arrays (numpy matmul broadcasting), as
    float64: the operands are small integers, so float64 BLAS sums are exact (see the module
    docstring) and much faster than an integer matmul."""
    return xp.matmul(a.astype(np.float64), b.astype(np.float64))


def _ints(xp, t):
    """An integer tensor as int32 (a zero point, quantised data: exact for 4/8/16-bit)."""
    return t.astype(np.int64 if t.dtype.itemsize >= 4 else np.int32)


class _QOp(OpImpl):
    """Shared checks for the quantised ops."""

    def scalar(self, xp, t, what, dtype=_F32, default=None):
        """A per-tensor parameter (a scalar or a one-element 1-D tensor) as a 0-d array of
        `dtype`; `default` (or a failure when it is None) if the input is omitted."""
        if t is None:
            if default is None:
                raise self.fail(f"input {what} is required")
            return xp.asarray(default, dtype=dtype)
        if t.size != 1 or t.ndim > 1:
            raise self.fail(f"{what} must be a scalar or a one-element 1-D tensor, "
                            f"got shape {t.shape}")
        return t.reshape(()).astype(dtype)

    def zero_point(self, xp, t, what, dtype=None):
        """A per-tensor zero point as a 0-d int32 array (0 if omitted), checking its type."""
        if t is not None and dtype is not None and t.dtype != dtype:
            raise self.fail(f"{what} has type {t.dtype}, the data has {dtype}")
        return self.scalar(xp, t if t is None else _ints(xp, t), what, np.int32, default=0)

    def check_int8(self, x, what):
        if x.dtype not in _INT8:
            raise self.fail(f"{what} must be int8 or uint8, got {x.dtype}")


_COMPILED = Lowering("cpu.compiled", "8-bit element-wise loop compiled and split among the "
                     "threads, numpy's bits")
_BY_SIZE = Lowering("by geometry", "a compiled loop where the shapes suit it and the tensor is "
                    "large enough, else numpy: the shapes are known in the run")


def _compiled_lowering(x, types_ok: bool, size_ok=None) -> Lowering:
    """Plan time: the compiled loop where numba serves, the types suit it and the tensor (the
    Sketch x) is large enough; `size_ok(shape)` tests a known shape instead."""
    if x is None or not types_ok or not numba_serves():
        return PORTABLE
    if not x.static():
        return _BY_SIZE
    if size_ok is None:
        return _COMPILED if math.prod(x.shape) >= tuning.QLINEAR_COMPILED_MIN else PORTABLE
    return _COMPILED if size_ok(x.shape) else PORTABLE


def _compiled_serves(op, size: int, ok=True, minimum: int | None = None) -> bool:
    """Run time: whether a compiled loop serves `op`'s call over `size` values (numpy arrays,
    numba serving, at least `minimum`, and `ok`: its own conditions, a bool or a function
    asked last, on numpy arrays only); kept as what the run chose."""
    serves = op.xp is np and _qlinear.serves(size, minimum) and (ok() if callable(ok) else ok)
    op._chosen = _COMPILED if serves else PORTABLE
    return serves


# --------------------------------------------------------------------------------------------
# QuantizeLinear / DequantizeLinear (com.microsoft)


class _MsLinearQuant(_QOp):
    # onnxruntime's kernel reads `axis` with default 1; per-tensor parameters ignore it
    defaults = {"axis": 1}

    def per_axis(self, xp, p, shape, what, dtype):
        """A scale or zero point: 0-d for per-tensor, else a 1-D tensor shaped to broadcast
        along `axis`."""
        if p.ndim == 0 or (p.ndim == 1 and p.size == 1):
            return p.reshape(()).astype(dtype)
        if p.ndim != 1:
            raise self.fail(f"{what} must be a scalar or a 1-D tensor, got shape {p.shape}")
        rank = len(shape)
        axis = int(self.axis)
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank:
            raise self.fail(f"axis {self.axis} is out of range for input of rank {rank}")
        if p.shape[0] != shape[axis]:
            raise self.fail(f"{what} has {p.shape[0]} entries; input dimension {axis} is "
                            f"{shape[axis]}")
        view = [1] * rank
        view[axis] = p.shape[0]
        return p.astype(dtype).reshape(view)

    def parameter_axis(self, x, *params):
        """The axis that `per_axis` parameters run along, None where all are per tensor."""
        return int(self.axis) % x.ndim if any(p.ndim for p in params) else None


@register("QuantizeLinear", versions=[1], domain=_MS)
class MsQuantizeLinear(_MsLinearQuant):
    """y = saturate(round_half_even(x / y_scale) + y_zero_point); uint8 without a zero point.
    float16 inputs divide in float32."""

    def lower(self, inputs):
        x, zp = inputs[0], (inputs[2] if len(inputs) > 2 else None)
        dtype = np.dtype(np.uint8) if zp is None else zp.dtype
        return _compiled_lowering(x, x is not None and x.dtype == _F32 and dtype in _INT8)

    def run(self, x, y_scale, y_zero_point=None):
        xp = self.xp
        dtype = np.dtype(np.uint8) if y_zero_point is None else y_zero_point.dtype
        if dtype not in _QTYPES:
            raise self.fail(f"unsupported quantised type {dtype}")
        scale = self.per_axis(xp, y_scale, x.shape, "y_scale", _F32)
        zp = None if y_zero_point is None else \
            self.per_axis(xp, y_zero_point, x.shape, "y_zero_point", np.int32)
        if _compiled_serves(self, x.size, x.dtype == _F32 and dtype in _INT8):
            # a NaN quotient gives the zero point: NaN is zeroed before it is added below
            zero = np.zeros((), _F32) if zp is None else zp.astype(_F32)
            return _qlinear.quantize(x, scale.reshape(-1), zero.reshape(-1), dtype,
                                     self.parameter_axis(x, scale, zero), True)
        with np.errstate(all="ignore"):
            q = xp.rint(x.astype(_F32) / scale)
            q = xp.where(xp.isnan(q), 0, q)
        if zp is not None:
            q = q + zp
        return _saturate(xp, q, dtype)


@register("DequantizeLinear", versions=[1], domain=_MS)
class MsDequantizeLinear(_MsLinearQuant):
    """y = (x - x_zero_point) * x_scale, in the scale's type (float32 or float16, computed in
    float32); the subtraction is exact (int64 for int32 data)."""

    def lower(self, inputs):
        x, scale = inputs[0], inputs[1]
        return _compiled_lowering(x, x is not None and x.dtype in _INT8
                                  and scale is not None and scale.dtype == _F32)

    def run(self, x, x_scale, x_zero_point=None):
        xp = self.xp
        if x.dtype not in _QTYPES + (np.dtype(np.int32),):
            raise self.fail(f"unsupported quantised type {x.dtype}")
        if x_zero_point is not None and x_zero_point.dtype != x.dtype:
            raise self.fail(f"x_zero_point has type {x_zero_point.dtype}, x has {x.dtype}")
        if _compiled_serves(self, x.size, x.dtype in _INT8 and x_scale.dtype == _F32):
            zero = np.zeros((), _F32) if x_zero_point is None else \
                self.per_axis(xp, x_zero_point, x.shape, "x_zero_point", _F32)
            scale = self.per_axis(xp, x_scale, x.shape, "x_scale", _F32)
            return _qlinear.dequantize(x, scale.reshape(-1), zero.reshape(-1),
                                       self.parameter_axis(x, scale, zero))
        wide = np.int64 if x.dtype == np.int32 else np.int32
        diff = x.astype(wide)
        if x_zero_point is not None:
            diff = diff - self.per_axis(xp, x_zero_point, x.shape, "x_zero_point", wide)
        scale = self.per_axis(xp, x_scale, x.shape, "x_scale", _F32)
        return (diff.astype(_F32) * scale).astype(x_scale.dtype)


# --------------------------------------------------------------------------------------------
# QLinearAdd / QLinearMul


class _QLinearBinary(_QOp):
    threshold = "QLINEAR_COMPILED_MIN"   # the tuning value from which the compiled loop runs

    @property
    def compiled_min(self) -> int:
        return getattr(tuning, self.threshold)
    def lower(self, inputs):
        a, b = inputs[0], inputs[3]
        types_ok = a is not None and b is not None and a.dtype in _INT8 and b.dtype == a.dtype
        if types_ok and not b.static():
            return _BY_SIZE
        return _compiled_lowering(a, types_ok, lambda shape: _blocks(
            shape, b.shape, self.compiled_min) is not None)

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale,
            c_zero_point=None):
        params = (a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point)
        route = remembered_route(self, (a, b), params, lambda: self._route(a, b, *params))
        return route(a, b)

    def _parameters(self, a, b, a_scale, a_zero_point, b_scale, b_zero_point, c_scale,
                    c_zero_point):
        """The checked per-tensor scales (sa, sb, sc) and int32 zero points (za, zb, zc)."""
        xp = self.xp
        self.check_int8(a, "A")
        if b.dtype != a.dtype:
            raise self.fail(f"A and B must have the same type, got {a.dtype} and {b.dtype}")
        return (self.scalar(xp, a_scale, "A_scale"), self.scalar(xp, b_scale, "B_scale"),
                self.scalar(xp, c_scale, "C_scale"),
                self.zero_point(xp, a_zero_point, "A_zero_point", a.dtype),
                self.zero_point(xp, b_zero_point, "B_zero_point", a.dtype),
                self.zero_point(xp, c_zero_point, "C_zero_point", a.dtype))


@register("QLinearAdd", versions=[1], domain=_MS)
class QLinearAdd(_QLinearBinary):
    """C = (A_scale (A - A_zp) + B_scale (B - B_zp)) / C_scale + C_zp, with numpy broadcasting,
    rounded as onnxruntime's x64 kernel (MLAS, AVX2 with FMA) rounds it: with the ratios
    rA = A_scale / C_scale and rB = B_scale / C_scale, a fixed part C_zp - (rA A_zp + rB B_zp)
    (the first product fused), then fma(A, rA, fma(B, rB, fixed)) per element; where A alone
    is one value along the innermost axis, the kernel is called with A and B swapped. The sum
    in another order moves about one value in 2e5 near a half to the neighbouring code."""

    # numpy's emulated fused multiply-adds take many passes: the loop pays from fewer values
    threshold = "QLINEAR_ADD_COMPILED_MIN"

    def _route(self, a, b, a_scale, a_zero_point, b_scale, b_zero_point, c_scale,
               c_zero_point):
        xp = self.xp
        sa, sb, sc, za, zb, zc = self._parameters(a, b, a_scale, a_zero_point, b_scale,
                                                  b_zero_point, c_scale, c_zero_point)
        ra, rb = sa / sc, sb / sc
        za, zb, zc = (z.astype(_F32) for z in (za, zb, zc))
        swap = _innermost_scalar(a, b)   # the kernel is called with the operands swapped
        if swap:
            a, b, ra, rb, za, zb = b, a, rb, ra, zb, za
        fixed = zc - _fma32(xp, ra, za, rb * zb)
        order = memory_order((a, b)) if xp is np else None
        if order is not None:
            a, b = moved(a, order), moved(b, order)
        plan = _blocks(a.shape, b.shape, self.compiled_min)
        lo, hi = _int_range(a.dtype)
        if _compiled_serves(self, _size(plan), lambda: np.isfinite([ra, rb, fixed]).all(),
                            self.compiled_min):
            def kernel(a, b):
                return _qlinear.add(a, b, ra, rb, fixed, lo, hi, plan)
        else:
            def kernel(a, b):
                with np.errstate(all="ignore"):
                    total = _fma32(xp, a.astype(_F32), ra, _fma32(xp, b.astype(_F32), rb,
                                                                     fixed))
                return _saturate(xp, xp.rint(total), a.dtype)
        return _BinaryRoute(kernel, swap, order, np.broadcast_shapes(a.shape, b.shape))


class _BinaryRoute:
    """QLinearAdd's or QLinearMul's call worked out once (_QLinearBinary.run): the operands
    swapped where the kernel takes them so, their axes put in the memory order of a
    channels-last image among them (ops/_layout.py: the loops read it where it lies, and
    the result keeps its layout for the next 8-bit op), then `kernel` (a, b) -> C."""

    def __init__(self, kernel, swap: bool, order, shape):
        self.kernel, self.swap, self.order, self.shape = kernel, swap, order, shape
        self.back = None if order is None else tuple(int(i) for i in np.argsort(order))

    def __call__(self, a, b):
        if self.swap:
            a, b = b, a
        if self.order is not None:
            a, b = moved(a, self.order), moved(b, self.order)
        out = self.kernel(a, b).reshape(self.shape)
        return out if self.back is None else out.transpose(self.back)


def _blocks(a_shape, b_shape, minimum: int):
    """The compiled loops' (P, Q, R) blocks of A and B broadcast (qlinear.broadcast_blocks),
    where those serve and the result has at least `minimum` values; else None."""
    plan = _qlinear.broadcast_blocks(a_shape, b_shape)
    return plan if plan is not None and _size(plan) >= minimum else None


def _size(plan) -> int:
    return 0 if plan is None else math.prod(plan[0])


def _innermost_scalar(x, other) -> bool:
    """Whether `x` holds one value along the innermost axis of the broadcast result where
    `other` holds several: onnxruntime's broadcasting loop treats it as a scalar there."""
    inner = other.shape[-1] if other.ndim else 1
    return inner > 1 and (x.ndim == 0 or x.shape[-1] == 1)


@register("QLinearMul", versions=[1], domain=_MS)
class QLinearMul(_QLinearBinary):
    """C = (A - A_zp)(B - B_zp) A_scale B_scale / C_scale + C_zp; the integer product is exact."""

    def _route(self, a, b, a_scale, a_zero_point, b_scale, b_zero_point, c_scale,
               c_zero_point):
        sa, sb, sc, za, zb, zc = self._parameters(a, b, a_scale, a_zero_point, b_scale,
                                                  b_zero_point, c_scale, c_zero_point)
        order = memory_order((a, b)) if self.xp is np else None
        if order is not None:
            a, b = moved(a, order), moved(b, order)
        plan = _blocks(a.shape, b.shape, self.compiled_min)
        lo, hi = _int_range(a.dtype)
        with np.errstate(all="ignore"):
            multiplier = sa * sb / sc
        if _compiled_serves(self, _size(plan), lambda: np.isfinite(multiplier),
                            self.compiled_min):
            def kernel(a, b):
                return _qlinear.mul(a, b, za, zb, zc, multiplier, lo, hi, plan)
        else:
            def kernel(a, b):
                product = (a.astype(np.int32) - za) * (b.astype(np.int32) - zb)
                with np.errstate(all="ignore"):
                    value = product.astype(_F32) * multiplier
                return _quantize(self.xp, value, 1, zc, a.dtype)
        return _BinaryRoute(kernel, False, order, np.broadcast_shapes(a.shape, b.shape))


# --------------------------------------------------------------------------------------------
# Lookup-table activations: QLinearSigmoid, QLinearLeakyRelu


class _QLinearLookup(_QOp):
    """y = quantize(f(dequantize(x))) through onnxruntime's 256-entry table: every code is
    dequantised (x_scale * (code - x_zp) in float32), mapped by f in float32 and quantised."""

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        xp = self.xp
        self.check_int8(x, "X")
        sx = self.scalar(xp, x_scale, "X_scale")
        sy = self.scalar(xp, y_scale, "Y_scale")
        zx = self.zero_point(xp, x_zero_point, "X_zero_point", x.dtype)
        zy = self.zero_point(xp, y_zero_point, "Y_zero_point", x.dtype)
        codes = xp.arange(256, dtype=np.uint8).view(x.dtype)  # table index = the byte of x
        values = sx * (codes.astype(np.int32) - zx).astype(_F32)
        with np.errstate(all="ignore"):
            table = _quantize(xp, self.function(xp, values), sy, zy, x.dtype)
        if _compiled_serves(self, x.size):
            return _qlinear.lookup(x, table)
        return table[x.view(np.uint8)]

    def lower(self, inputs):
        x = inputs[0]
        return _compiled_lowering(x, x is not None and x.dtype in _INT8)


@register("QLinearSigmoid", versions=[1], domain=_MS)
class QLinearSigmoid(_QLinearLookup):
    @staticmethod
    def function(xp, v):
        return (1 / (1 + xp.exp(-v))).astype(_F32)


@register("QLinearLeakyRelu", versions=[1], domain=_MS)
class QLinearLeakyRelu(_QLinearLookup):
    defaults = {"alpha": 0.01}

    def function(self, xp, v):
        return xp.where(v >= 0, v, v * _F32(self.alpha))


# --------------------------------------------------------------------------------------------
# QLinearConcat


@register("QLinearConcat", versions=[1], domain=_MS)
class QLinearConcat(_QOp):
    """Inputs: Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per tensor. Each tensor
    is requantised to Y's parameters (identity where they are the same) and concatenated."""

    defaults = {"axis": None}

    def setup(self):
        if self.axis is None:
            raise self.fail("attribute 'axis' is required")
        if self.n_inputs < 5 or (self.n_inputs - 2) % 3:
            raise self.fail("inputs must be Y_scale, Y_zero_point and one or more "
                            f"(tensor, scale, zero point) triples; got {self.n_inputs} inputs")

    def run(self, y_scale, y_zero_point, *triples):
        xp = self.xp
        if y_zero_point is None:
            raise self.fail("input Y_zero_point is required")
        dtype = y_zero_point.dtype
        if dtype not in _INT8:
            raise self.fail(f"Y_zero_point must be int8 or uint8, got {dtype}")
        sy = self.scalar(xp, y_scale, "Y_scale")
        zy = self.zero_point(xp, y_zero_point, "Y_zero_point")
        parts = []
        for i in range(0, len(triples), 3):
            x, x_scale, x_zero_point = triples[i:i + 3]
            if x.dtype != dtype:
                raise self.fail(f"input {i // 3} has type {x.dtype}, Y has {dtype}")
            sx = self.scalar(xp, x_scale, f"scale of input {i // 3}")
            zx = self.zero_point(xp, x_zero_point, f"zero point of input {i // 3}", dtype)
            # s (x - zx) / s rounds back to x - zx exactly, so equal parameters copy
            value = sx * (x.astype(np.int32) - zx).astype(_F32)
            parts.append(_quantize(xp, value, sy, zy, dtype))
        rank = parts[0].ndim
        axis = int(self.axis) + rank if int(self.axis) < 0 else int(self.axis)
        if not 0 <= axis < max(rank, 1):
            raise self.fail(f"axis {self.axis} is out of range for rank {rank}")
        for i, p in enumerate(parts[1:], 1):
            if p.ndim != rank or any(p.shape[d] != parts[0].shape[d]
                                     for d in range(rank) if d != axis):
                raise self.fail(f"input {i} of shape {p.shape} does not match input 0 of "
                                f"shape {parts[0].shape} outside axis {axis}")
        return xp.concatenate(parts, axis=axis)


# --------------------------------------------------------------------------------------------
# Pooling: QLinearGlobalAveragePool, QLinearAveragePool


def _spatial_axes(rank: int, channels_last: bool) -> tuple[int, ...]:
    return tuple(range(1, rank - 1)) if channels_last else tuple(range(2, rank))


@register("QLinearGlobalAveragePool", versions=[1], domain=_MS)
class QLinearGlobalAveragePool(_QOp):
    """The exact integer sum over the spatial axes (NCHW, or NHWC with channels_last), less
    size * x_zp, times x_scale / (y_scale * size) in float32, requantised."""

    defaults = {"channels_last": 0}

    def run(self, x, x_scale, x_zero_point, y_scale, y_zero_point):
        xp = self.xp
        self.check_int8(x, "X")
        if x.ndim < 3:
            raise self.fail(f"input must have rank >= 3, got shape {x.shape}")
        axes = _spatial_axes(x.ndim, bool(self.channels_last))
        size = math.prod(x.shape[a] for a in axes)
        sx = self.scalar(xp, x_scale, "x_scale")
        sy = self.scalar(xp, y_scale, "y_scale")
        zx = self.zero_point(xp, x_zero_point, "x_zero_point", x.dtype)
        zy = self.zero_point(xp, y_zero_point, "y_zero_point", x.dtype)
        with np.errstate(all="ignore"):
            scale = sx / (sy * _F32(size))
        if _compiled_serves(self, x.size, lambda: np.isfinite(scale)):
            kept = [1 if d in axes else n for d, n in enumerate(x.shape)]
            last = bool(self.channels_last)
            if not last and xp is np and channels_last(x):   # read where it lies
                x, last = np.moveaxis(x, 1, -1), True
            return _qlinear.global_average(x, last, zx, scale, zy,
                                           *_int_range(x.dtype)).reshape(kept)
        acc = xp.sum(x.astype(np.int64), axis=axes, keepdims=True) - zx.astype(np.int64) * size
        with np.errstate(all="ignore"):
            return _quantize(xp, acc.astype(_F32) * scale, 1, zy, x.dtype)

    def lower(self, inputs):
        x = inputs[0]
        return _compiled_lowering(x, x is not None and x.dtype in _INT8
                                  and (x.ndim is None or x.ndim >= 3))


def _pool_geometry(op, in_sp, kernel, strides, pads, auto_pad, ceil_mode):
    """(output sizes, begin pads, padded extent at the end) of a window pool, as
    onnxruntime's PoolAttributes computes them (host ints)."""
    n = len(in_sp)
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        outs = [-(-i // s) for i, s in zip(in_sp, strides)]
        total = [max(0, (o - 1) * s + k - i) for o, s, k, i in zip(outs, strides, kernel, in_sp)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
        end = [t - b for t, b in zip(total, begin)]
    elif auto_pad in ("VALID", "NOTSET"):
        if auto_pad == "VALID" or pads is None:
            begin, end = [0] * n, [0] * n
        else:
            if len(pads) != 2 * n:
                raise op.fail(f"pads must have {2 * n} entries, got {len(pads)}")
            begin, end = list(pads[:n]), list(pads[n:])
        outs = []
        for i, k, s, b, e in zip(in_sp, kernel, strides, begin, end):
            span = i + b + e - k
            if span < 0:
                raise op.fail(f"kernel {kernel} is larger than the padded input {in_sp}")
            o = (-(-span // s) if ceil_mode else span // s) + 1
            if ceil_mode and (o - 1) * s >= i + b:  # the last window must start inside
                o -= 1
            outs.append(o)
    else:
        raise op.fail(f"unknown auto_pad '{auto_pad}'")
    reach = [max(0, (o - 1) * s + k - i - b) for o, s, k, i, b in zip(outs, strides, kernel,
                                                                       in_sp, begin)]
    return outs, begin, reach


@register("QLinearAveragePool", versions=[1], domain=_MS)
class QLinearAveragePool(_QOp):
    """Dequantise, average each window in float32, quantise (onnxruntime's order:
    round(y / y_scale + y_zp)). Windows are clipped to the input, and the divisor is the number
    of input elements in the window, or the whole kernel size with count_include_pad (as in
    onnxruntime's QLinear kernel). channels_last takes NHWC input and output."""

    defaults = {"auto_pad": "NOTSET", "ceil_mode": 0, "channels_last": 0,
                "count_include_pad": 0, "kernel_shape": None, "pads": None, "strides": None}

    def setup(self):
        if not self.kernel_shape:
            raise self.fail("attribute 'kernel_shape' is required")
        self.kernel = [int(k) for k in self.kernel_shape]
        n = len(self.kernel)
        self.steps = [int(s) for s in self.strides] if self.strides else [1] * n
        if len(self.steps) != n or min(self.steps) < 1 or min(self.kernel) < 1:
            raise self.fail(f"kernel_shape {self.kernel} and strides {self.steps} must be "
                            "positive and of equal length")

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        xp = self.xp
        self.check_int8(x, "X")
        n = len(self.kernel)
        if x.ndim != n + 2:
            raise self.fail(f"input of shape {x.shape} does not match kernel_shape "
                            f"{self.kernel}")
        sx = self.scalar(xp, x_scale, "x_scale")
        sy = self.scalar(xp, y_scale, "y_scale")
        zx = self.zero_point(xp, x_zero_point, "x_zero_point", x.dtype)
        zy = self.zero_point(xp, y_zero_point, "y_zero_point", x.dtype)
        last = bool(self.channels_last)
        if last:
            x = xp.moveaxis(x, -1, 1)
        in_sp = list(x.shape[2:])
        outs, begin, reach = _pool_geometry(self, in_sp, self.kernel, self.steps, self.pads,
                                            self.auto_pad, bool(self.ceil_mode))
        v = sx * (x.astype(np.int32) - zx).astype(_F32)
        widths = [(0, 0), (0, 0)] + list(zip(begin, reach))
        total = xp.pad(v, widths)  # zeros: padding adds nothing to a window's sum
        for d, (k, s, o) in enumerate(zip(self.kernel, self.steps, outs)):
            ax = d + 2
            acc = None
            for t in range(k):  # one strided slice per kernel tap
                sl = [slice(None)] * total.ndim
                sl[ax] = slice(t, t + (o - 1) * s + 1, s)
                acc = total[tuple(sl)] if acc is None else acc + total[tuple(sl)]
            total = acc
        if self.count_include_pad:
            count = float(math.prod(self.kernel))
        else:  # elements of the (clipped) window inside the input, per axis, multiplied
            count = np.ones([1] * (n + 2), np.float32)
            for d, (k, s, o, b, i) in enumerate(zip(self.kernel, self.steps, outs, begin,
                                                    in_sp)):
                start = np.arange(o) * s - b
                c = np.minimum(start + k, i) - np.maximum(start, 0)
                shape = [1] * (n + 2)
                shape[d + 2] = o
                count = count * c.astype(np.float32).reshape(shape)
            count = xp.asarray(count)
        with np.errstate(all="ignore"):
            y = total / count
            # onnxruntime rounds y / y_scale + y_zp in one go
            q = _saturate(xp, xp.rint(y / sy + zy.astype(_F32)), x.dtype)
        return xp.moveaxis(q, 1, -1) if last else q


# --------------------------------------------------------------------------------------------
# QLinearSoftmax


@register("QLinearSoftmax", versions=[1], domain=_MS)
class QLinearSoftmax(_QOp):
    """onnxruntime's table softmax. exp is tabulated per code distance from the row maximum,
    table[255 - d] = float32(exp((-d + shift) * x_scale)) in double, with
    shift = max(0, log(FLT_MAX / D) - 5) / x_scale keeping the row sum finite; then
    y = round(table * floor(1 / y_scale) / sum) + y_zp (float32), saturated. The input zero
    point cancels. `opset` < 13 normalises over all axes from `axis`, else over `axis` alone;
    `axis` defaults to -1 for every opset (onnxruntime fills the schema's default before its
    kernel's opset-dependent one could apply)."""

    defaults = {"opset": None, "axis": -1}

    def setup(self):
        if self.opset is None:
            raise self.fail("attribute 'opset' is required")
        self.old = int(self.opset) < 13
        self.softmax_axis = int(self.axis)

    def run(self, x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        xp = self.xp
        self.check_int8(x, "X")
        if x.size == 0:
            return xp.empty(x.shape, x.dtype)
        rank = x.ndim
        axis = self.softmax_axis + rank if self.softmax_axis < 0 else self.softmax_axis
        if not 0 <= axis < max(rank, 1):
            raise self.fail(f"axis {self.softmax_axis} is out of range for rank {rank}")
        sx = self.scalar(xp, x_scale, "X_scale", np.float64)
        sy = self.scalar(xp, y_scale, "y_scale")
        self.zero_point(xp, x_zero_point, "x_zero_point", x.dtype)
        zy = self.zero_point(xp, y_zero_point, "y_zero_point", x.dtype)
        if self.old:
            rows = x.reshape(math.prod(x.shape[:axis]), -1)
        else:
            rows = xp.moveaxis(x, axis, -1)
        d = rows.shape[-1]
        shift = max(0.0, math.log(float(np.finfo(np.float32).max) / d) - 5.0) / sx
        codes = xp.arange(256, dtype=np.float64)
        table = xp.exp((codes - 255 + shift) * sx).astype(_F32)
        xi = rows.astype(np.int32)
        e = table[xi - xp.max(xi, axis=-1, keepdims=True) + 255]
        total = xp.sum(e, axis=-1, keepdims=True, dtype=_F32)
        with np.errstate(all="ignore"):
            q = _saturate(xp, xp.rint(e * xp.floor(1 / sy) / total) + zy, x.dtype)
        if self.old:
            return q.reshape(x.shape)
        return xp.moveaxis(q, -1, axis)


# --------------------------------------------------------------------------------------------
# QGemm


@register("QGemm", versions=[1], domain=_MS)
class QGemm(_QOp):
    """Y = alpha a_scale b_scale ((A - a_zp)(B - b_zp) + C), C an int32 tensor broadcast to
    (M, N) and added to the exact integer accumulator. Without y_scale the output is float32;
    with y_scale and y_zero_point it is requantised to y_zero_point's type with the float32
    multiplier alpha * a_scale * b_scale / y_scale. b_scale / b_zero_point are per tensor or
    per column (N)."""

    defaults = {"alpha": 1.0, "transA": 0, "transB": 0}

    def lower(self, inputs):
        return _int.lowering(inputs[0], inputs[3])

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point=None, c=None,
            y_scale=None, y_zero_point=None):
        if y_zero_point is not None and a.ndim == 2:
            params = (a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale, y_zero_point)
            route = remembered_route(self, (a,), params,
                                     lambda: self._requantizing(a, *params))
            if route is not None:
                self._chosen = _int.INTEGER
                return route(np.ascontiguousarray(a.T if self.transA else a))
        return self._run(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale,
                         y_zero_point)

    def _requantizing(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale,
                      y_zero_point):
        """The pixel tiles' route with the requantisation in their epilogue (as `_run`
        computes it: C added to the int32 sums, the multiplier alpha * a_scale * b_scale /
        y_scale in float32), for a C of one value or one per column; else None (`_run`'s
        steps, and its errors)."""
        xp = self.xp
        if self.xp is not np or a.dtype not in _INT8 or b.dtype not in _INT8 or b.ndim != 2 \
                or y_scale is None or y_zero_point.dtype not in _INT8 \
                or (b_zero_point is not None and b_zero_point.dtype != b.dtype):
            return None
        a = a.T if self.transA else a
        b = b.T if self.transB else b
        (m, k), (k2, n) = a.shape, b.shape
        if k != k2 or (c is not None and (c.dtype != np.int32 or c.ndim > 2 or (
                c.size != 1 and c.shape[-1] != n) or c.size not in (1, n))):
            return None   # (a C per row and column: _run adds it)
        sa = self.scalar(xp, a_scale, "a_scale")
        za = self.zero_point(xp, a_zero_point, "a_zero_point", a.dtype)
        sb = self.column_param(xp, b_scale, n, "b_scale", _F32)
        zb = xp.asarray(0, dtype=np.int32) if b_zero_point is None else \
            self.column_param(xp, b_zero_point, n, "b_zero_point", np.int32)
        with np.errstate(all="ignore"):
            multiplier = _F32(self.alpha) * sa * sb / self.scalar(xp, y_scale, "y_scale")
        bias = np.zeros(n, np.int64) if c is None else np.broadcast_to(c.reshape(-1), (n,))
        return _int.requantizing_route(self, m, za, b, zb, bias,
                                       np.broadcast_to(multiplier, (n,)), y_zero_point)

    def _run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, c, y_scale,
             y_zero_point):
        xp = self.xp
        self.check_int8(a, "A")
        self.check_int8(b, "B")
        if a.ndim != 2 or b.ndim != 2:
            raise self.fail(f"A and B must be 2-D, got shapes {a.shape} and {b.shape}")
        if self.transA:
            a = a.T
        if self.transB:
            b = b.T
        (m, k), (k2, n) = a.shape, b.shape
        if k != k2:
            raise self.fail(f"inner dimensions differ: A is {m}x{k}, B is {k2}x{n}")
        sa = self.scalar(xp, a_scale, "a_scale")
        za = self.zero_point(xp, a_zero_point, "a_zero_point", a.dtype)
        sb = self.column_param(xp, b_scale, n, "b_scale", _F32)
        zb = xp.asarray(0, dtype=np.int32) if b_zero_point is None else \
            self.column_param(xp, b_zero_point, n, "b_zero_point", np.int32)
        if b_zero_point is not None and b_zero_point.dtype != b.dtype:
            raise self.fail(f"b_zero_point has type {b_zero_point.dtype}, B has {b.dtype}")
        acc = _int.product(self, a, za, b, zb)
        if c is not None:
            if c.dtype != np.int32:
                raise self.fail(f"C must be int32, got {c.dtype}")
            try:
                cb = xp.broadcast_to(c, (m, n))
            except ValueError:
                raise self.fail(f"C of shape {c.shape} does not broadcast to ({m}, {n})") \
                    from None
            acc = acc + cb
        multiplier = _F32(self.alpha) * sa * sb
        with np.errstate(all="ignore"):
            if y_scale is not None:
                multiplier = multiplier / self.scalar(xp, y_scale, "y_scale")
            y = acc.astype(_F32) * multiplier
            if y_zero_point is None:
                return y.astype(_F32)
            if y_zero_point.dtype not in _INT8:
                raise self.fail(f"y_zero_point must be int8 or uint8, got {y_zero_point.dtype}")
            zy = self.zero_point(xp, y_zero_point, "y_zero_point")
            return _quantize(xp, y, 1, zy, y_zero_point.dtype)

    def column_param(self, xp, p, n, what, dtype):
        if p.ndim == 0 or (p.ndim == 1 and p.size == 1):
            return p.reshape(()).astype(dtype)
        if p.ndim != 1 or p.shape[0] != n:
            raise self.fail(f"{what} must be a scalar or a 1-D tensor of {n} (per column), "
                            f"got shape {p.shape}")
        return p.astype(dtype)


# --------------------------------------------------------------------------------------------
# DynamicQuantizeMatMul, MatMulIntegerToFloat


def _dynamic_uint8_params(xp, a):
    """onnxruntime's dynamic uint8 parameters of a float tensor: the range [min, max]
    widened to hold 0, scale = (max - min) / 255 (1 for an all-zero range), zero point =
    round_half_even(clip(0 - min / scale, 0, 255)); as 0-d float32 and int32 arrays."""
    if a.size == 0:
        return xp.asarray(1, dtype=_F32), xp.asarray(0, dtype=np.int32)
    lo = xp.minimum(xp.min(a), _F32(0)).astype(_F32)
    hi = xp.maximum(xp.max(a), _F32(0)).astype(_F32)
    with np.errstate(all="ignore"):
        scale = xp.where(hi == lo, _F32(1), (hi - lo) / _F32(255)).astype(_F32)
        zp = xp.rint(xp.clip(_F32(0) - lo / scale, 0, 255)).astype(np.int32)
    return scale, zp


def _is_column_param(p_shape, b_shape) -> bool:
    """Whether a b_scale / b_zero_point of this shape is per tensor or per column of B (1-D of
    N for a 2-D B, or B's shape with 1 for K), the forms onnxruntime's matmul applies."""
    if math.prod(p_shape) == 1 and len(p_shape) <= 1:
        return True
    if len(b_shape) < 2:
        return False
    if len(p_shape) == 1:
        return len(b_shape) == 2 and p_shape[0] == b_shape[-1]
    return len(p_shape) == len(b_shape) and p_shape[-2] == 1 and \
        all(p == b for i, (p, b) in enumerate(zip(p_shape, b_shape)) if i != len(b_shape) - 2)


def _quant_column_param(op, xp, p, b_shape, what, dtype):
    """b_scale / b_zero_point of a matmul as an array broadcasting against the product:
    0-d per tensor, or per column of B (see _is_column_param)."""
    if p.ndim <= 1 and p.size == 1:
        return p.reshape(()).astype(dtype)
    if not _is_column_param(p.shape, b_shape):
        raise op.fail(f"{what} of shape {p.shape} is neither per tensor nor per column of B "
                      f"{tuple(b_shape)}")
    return p.astype(dtype)


class _MatMulIntegerToFloatBase(_QOp):
    def check_matmul(self, a, b):
        if a.ndim == 0 or b.ndim == 0:
            raise self.fail("A and B must have rank >= 1")
        ka = a.shape[-1]
        kb = b.shape[-2] if b.ndim >= 2 else b.shape[0]
        if ka != kb:
            raise self.fail(f"inner dimensions differ: A {a.shape}, B {b.shape}")

    def b_zero(self, xp, b, b_zero_point):
        """B's zero point checked, shaped to broadcast against B (None if omitted)."""
        self.check_int8(b, "B")
        if b_zero_point is None:
            return None
        if b_zero_point.dtype != b.dtype:
            raise self.fail(f"b_zero_point has type {b_zero_point.dtype}, B has {b.dtype}")
        zb = _quant_column_param(self, xp, b_zero_point, b.shape, "b_zero_point", np.int32)
        if b.ndim == 1 and zb.ndim:
            raise self.fail("a 1-D B takes a per-tensor b_zero_point")
        return zb

    def add_bias(self, xp, y, bias):
        if bias is None:
            return y
        if bias.ndim != 1 or bias.shape[0] != (y.shape[-1] if y.ndim else 1):
            raise self.fail(f"bias of shape {bias.shape} must be 1-D with B's {y.shape[-1]} "
                            "columns")
        return y + bias.astype(_F32)


@register("DynamicQuantizeMatMul", versions=[1], domain=_MS)
class DynamicQuantizeMatMul(_MatMulIntegerToFloatBase):
    """A (float32) is quantised to uint8 with onnxruntime's dynamic parameters (see
    _dynamic_uint8_params) over the whole tensor; Y = float32(exact (A_q - a_zp)(B - b_zp)) *
    (a_scale * b_scale) + bias, with numpy matmul broadcasting. A b_scale that is not per
    tensor or per column multiplies the biased result afterwards, as in onnxruntime."""

    def lower(self, inputs):  # A is quantised to uint8 first
        return _int.lowering(Sketch(inputs[0].shape, np.dtype(np.uint8)), inputs[1])

    def run(self, a, b, b_scale, b_zero_point=None, bias=None):
        xp = self.xp
        self.check_matmul(a, b)
        a = a.astype(_F32)
        scale, zp = _dynamic_uint8_params(xp, a)
        aq = _quantize(xp, a, scale, zp, np.uint8)
        acc = _int.product(self, aq, zp, b, self.b_zero(xp, b, b_zero_point))
        if _is_column_param(b_scale.shape, b.shape):
            sb = _quant_column_param(self, xp, b_scale, b.shape, "b_scale", _F32)
            return self.add_bias(xp, acc.astype(_F32) * (scale * sb), bias).astype(_F32)
        # a b_scale onnxruntime's matmul cannot apply per column scales the biased result
        y = self.add_bias(xp, acc.astype(_F32) * scale, bias)
        return (y * b_scale.astype(_F32)).astype(_F32)


@register("MatMulIntegerToFloat", versions=[1], domain=_MS)
class MatMulIntegerToFloat(_MatMulIntegerToFloatBase):
    """Y = float32(exact (A - a_zp)(B - b_zp)) * (a_scale * b_scale) + bias, in the scales'
    type (float16 computed in float32). As in onnxruntime, a non-scalar a_scale shaped like a
    column parameter is taken for b_scale (the fusion may swap them), and a per-row a_scale
    (or a b_scale onnxruntime's matmul cannot apply per column) scales the biased result
    afterwards."""

    def lower(self, inputs):
        return _int.lowering(inputs[0], inputs[1])

    def run(self, a, b, a_scale, b_scale, a_zero_point=None, b_zero_point=None, bias=None):
        xp = self.xp
        self.check_int8(a, "A")
        self.check_matmul(a, b)
        out_dtype = a_scale.dtype
        if a_scale.size != 1:
            if a_scale.ndim == 1 or a_scale.shape[-1] != 1:
                a_scale, b_scale = b_scale, a_scale
        elif b_scale.size != 1 and b_scale.ndim > 1 and b_scale.shape[-2] != 1:
            a_scale, b_scale = b_scale, a_scale
        za = self.zero_point(xp, a_zero_point, "a_zero_point", a.dtype)
        acc = _int.product(self, a, za, b, self.b_zero(xp, b, b_zero_point))
        y = acc.astype(_F32)
        a_scalar = a_scale.size == 1
        b_inner = _is_column_param(b_scale.shape, b.shape)
        sb = _quant_column_param(self, xp, b_scale, b.shape, "b_scale", _F32) if b_inner \
            else b_scale.astype(_F32)
        multiplier = a_scale.reshape(()).astype(_F32) if a_scalar else None
        if b_inner:
            multiplier = sb if multiplier is None else multiplier * sb
        if multiplier is not None:
            y = y * multiplier
        y = self.add_bias(xp, y, bias)
        if not a_scalar:
            y = y * a_scale.astype(_F32)
        if not b_inner:
            y = y * sb
        return y.astype(out_dtype)


# --------------------------------------------------------------------------------------------
# QAttention


@register("QAttention", versions=[1], domain=_MS)
class QAttention(_QOp):
    """com.microsoft Attention on quantised input and weights: QKV =
    float32(exact (input - i_zp)(weight - w_zp)) * (input_scale * weight_scale) + bias, then
    onnxruntime's CPU attention: scores = scale Q K^T plus an additive mask (masked positions
    get mask_filter_value, default -10000; with unidirectional, future positions get float32's
    lowest value instead, as onnxruntime measures), softmax, times V. mask_index: (B) end
    positions, (2B) end and start positions, (B, T) or (B, S, T) 0/1 masks; (B, 1) / (1, 1)
    are dummies when T > 1. `past` (2, B, N, P, H) is
    prepended to K and V; `present` returns them. float16 scales and bias run in float32."""

    defaults = {"num_heads": None, "unidirectional": 0, "scale": None,
                "mask_filter_value": None, "past_present_share_buffer": 0, "do_rotary": 0}

    def setup(self):
        if not self.num_heads or int(self.num_heads) <= 0:
            raise self.fail("attribute 'num_heads' is required and must be positive")
        if self.past_present_share_buffer:
            raise self.fail("past_present_share_buffer is not supported")
        if self.do_rotary:
            raise self.fail("do_rotary is not supported")

    def lower(self, inputs):
        return _int.lowering(inputs[0], inputs[1])

    def run(self, x, weight, bias, input_scale, weight_scale, mask_index=None,
            input_zero_point=None, weight_zero_point=None, past=None):
        xp = self.xp
        self.check_int8(x, "input")
        self.check_int8(weight, "weight")
        if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[2]:
            raise self.fail(f"input {x.shape} must be (batch, sequence, D) and weight "
                            f"{weight.shape} (D, 3 hidden)")
        batch, seq, _ = x.shape
        width = weight.shape[1]
        heads = int(self.num_heads)
        if width % 3 or (width // 3) % heads:
            raise self.fail(f"weight width {width} is not 3 * hidden with hidden divisible "
                            f"by {heads} heads")
        hidden = width // 3
        head = hidden // heads
        if bias.shape != (width,):
            raise self.fail(f"bias must have shape ({width},), got {bias.shape}")
        out_dtype = bias.dtype
        si = self.scalar(xp, input_scale, "input_scale")
        sw = _quant_column_param(self, xp, weight_scale, weight.shape, "weight_scale", _F32)
        zi = self.zero_point(xp, input_zero_point, "input_zero_point", x.dtype)
        zw = None
        if weight_zero_point is not None:
            if weight_zero_point.dtype != weight.dtype:
                raise self.fail(f"weight_zero_point has type {weight_zero_point.dtype}, "
                                f"weight has {weight.dtype}")
            zw = _quant_column_param(self, xp, weight_zero_point, weight.shape,
                                     "weight_zero_point", np.int32)
        acc = _int.product(self, x, zi, weight, zw)
        qkv = acc.astype(_F32) * (sw * si) + bias.astype(_F32)
        qkv = qkv.reshape(batch, seq, 3, heads, head).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        past_len = 0
        if past is not None:
            if past.ndim != 5 or past.shape[:3] != (2, batch, heads) or past.shape[4] != head:
                raise self.fail(f"past must have shape (2, {batch}, {heads}, P, {head}), got "
                                f"{past.shape}")
            past_len = past.shape[3]
            pk = past.astype(_F32)
            k = xp.concatenate([pk[0], k], axis=2)
            v = xp.concatenate([pk[1], v], axis=2)
        total = past_len + seq
        alpha = _F32(self.scale) if self.scale else _F32(1 / math.sqrt(head))
        # the float Attention's core: the products on the engine's threads (one thread's
        # BLAS call per head otherwise), the softmax by Softmax's compiled rows
        scores = attention_scores(xp, q, k, alpha)
        bias_mask = self.mask(xp, mask_index, batch, seq, total, past_len)
        if bias_mask is not None:
            scores += bias_mask[:, None]
        probs = softmax(xp, scores, -1)
        out = weighted_values(xp, probs, v).transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
        if self.n_outputs < 2:
            return out.astype(out_dtype)
        present = xp.stack([k, v]).astype(out_dtype)
        return out.astype(out_dtype), present

    def mask(self, xp, mask_index, batch, seq, total, past_len):
        """The additive mask (batch, seq, total) in float32, or None."""
        fill = _F32(-10000.0 if self.mask_filter_value is None else self.mask_filter_value)
        add = None
        if mask_index is not None:
            m = mask_index
            if m.dtype != np.int32:
                raise self.fail(f"mask_index must be int32, got {m.dtype}")
            pos = xp.arange(total, dtype=np.int32)
            if m.ndim == 1 and m.shape[0] in (batch, 2 * batch):
                masked = pos[None, :] >= m[:batch, None]
                if m.shape[0] == 2 * batch:
                    masked = masked | (pos[None, :] < m[batch:, None])
                masked = xp.broadcast_to(masked[:, None, :], (batch, seq, total))
            elif m.ndim == 2 and m.shape[1] == 1 and total != 1 and m.shape[0] in (1, batch):
                masked = None  # a dummy mask
            elif m.ndim == 2 and m.shape == (batch, total):
                masked = xp.broadcast_to((m == 0)[:, None, :], (batch, seq, total))
            elif m.ndim == 3 and m.shape == (batch, seq, total):
                masked = m == 0
            else:
                raise self.fail(f"mask_index of shape {m.shape} is not supported (expected "
                                f"({batch},), ({2 * batch},), ({batch}, {total}) or "
                                f"({batch}, {seq}, {total}))")
            if masked is not None:
                add = xp.where(masked, fill, _F32(0))
        if self.unidirectional:  # future positions get float32's lowest, over any mask
            future = (xp.arange(total)[None, :] > past_len + xp.arange(seq)[:, None])[None]
            lowest = _F32(np.finfo(np.float32).min)
            add = xp.where(future, lowest, _F32(0) if add is None else add)
        return add


# --------------------------------------------------------------------------------------------
# QEmbedLayerNormalization


def _sequential_sum(xp, v):
    """The float32 sum over the last axis, element after element (keepdims)."""
    return xp.cumsum(v, axis=-1, dtype=_F32)[..., -1:]


@register("QEmbedLayerNormalization", versions=[1], domain=_MS)
class QEmbedLayerNormalization(_QOp):
    """EmbedLayerNormalization over quantised tables: word_embedding[input_ids] +
    position_embedding[position] (+ segment_embedding[segment_ids]), each dequantised
    ((q - zp) * scale, float32), layer-normalised over the hidden axis with dequantised gamma
    and beta. mask_index_out counts the mask's ones per batch row (zeros without a mask), as
    onnxruntime's kernel does."""

    defaults = {"epsilon": 1e-12}

    def run(self, *inputs):
        xp = self.xp
        inputs = list(inputs) + [None] * (18 - len(inputs))
        (ids, seg_ids, word, pos, seg, gamma, beta, mask, word_s, pos_s, seg_s, gamma_s,
         beta_s, word_z, pos_z, seg_z, gamma_z, beta_z) = inputs[:18]
        for name, t in (("input_ids", ids), ("word_embedding", word),
                        ("position_embedding", pos), ("gamma", gamma), ("beta", beta)):
            if t is None:
                raise self.fail(f"input {name} is required")
        has_seg = seg_ids is not None
        if has_seg and (seg is None or seg_s is None):
            raise self.fail("segment_ids needs segment_embedding and its scale")
        if ids.ndim != 2:
            raise self.fail(f"input_ids must be (batch, sequence), got {ids.shape}")
        batch, seq = ids.shape
        hidden = word.shape[1]
        if pos.shape[0] < seq:
            raise self.fail(f"position_embedding has {pos.shape[0]} rows; the sequence is "
                            f"{seq} long")
        self.check_int8(word, "word_embedding")

        def deq(q, s, z, what):
            if z is not None and z.dtype != word.dtype:
                raise self.fail(f"{what} zero point has type {z.dtype}, the tables have "
                                f"{word.dtype}")
            scale = self.scalar(xp, s, f"{what} scale")
            zp = self.zero_point(xp, z, f"{what} zero point")
            return (q.astype(np.int32) - zp).astype(_F32) * scale

        def rows(table, index, what):
            bad = xp.any((index < 0) | (index >= table.shape[0]))
            if bool(_xp.to_host(xp, bad)):
                raise self.fail(f"{what} holds an index outside [0, {table.shape[0]})")
            return xp.take(table, index.astype(np.int64), axis=0)

        total = deq(rows(word, ids, "input_ids"), word_s, word_z, "word_embedding")
        total = total + deq(pos[:seq], pos_s, pos_z, "position_embedding")[None]
        if has_seg:
            total = total + deq(rows(seg, seg_ids, "segment_ids"), seg_s, seg_z,
                                "segment_embedding")
        # onnxruntime's kernel sums each row in order, in float32 (cumsum's order on numpy)
        size = _F32(total.shape[-1])
        mean = _sequential_sum(xp, total) / size
        centred = total - mean
        var = _sequential_sum(xp, centred * centred) / size
        norm = centred / xp.sqrt(var + _F32(self.epsilon))
        out = norm * deq(gamma, gamma_s, gamma_z, "gamma") + deq(beta, beta_s, beta_z, "beta")
        if out.shape[-1] != hidden:
            raise self.fail("gamma and beta must have the hidden size")
        if mask is not None:
            if mask.shape != (batch, seq):
                raise self.fail(f"mask must have shape ({batch}, {seq}), got {mask.shape}")
            mask_index = xp.sum(mask == 1, axis=1).astype(np.int32)
        else:
            mask_index = xp.zeros((batch,), dtype=np.int32)
        return out.astype(_F32), mask_index


# --------------------------------------------------------------------------------------------
# DynamicQuantizeLSTM


def _fma32(xp, a, b, c):
    """float32 fused multiply-add, correctly rounded: a * b is exact in float64, and the sum
    is rounded to odd there (nudged one ulp toward its lost part when inexact and even) so
    that the final rounding to float32 is not a double rounding."""
    prod = a.astype(np.float64) * xp.asarray(b, np.float64)
    c = xp.asarray(c, np.float64)
    total = prod + c
    back = total - prod
    lost = (prod - (total - back)) + (c - back)
    nudge = (lost != 0) & ((total.view(np.int64) & 1) == 0)
    toward = xp.where(lost > 0, np.inf, -np.inf)
    return xp.where(nudge, xp.nextafter(total, toward), total).astype(_F32)


def _mlas_rational(xp, x, bound, numerator, denominator):
    """MLAS's rational approximation x P(x^2) / Q(x^2) with x clamped to [-bound, bound],
    each Horner step one FMA, as its x64 FMA3 kernels evaluate it."""
    v = xp.clip(x.astype(_F32), _F32(-bound), _F32(bound))
    v2 = v * v

    def horner(coefficients):
        acc = _fma32(xp, v2, _F32(coefficients[0]), _F32(coefficients[1]))
        for c in coefficients[2:]:
            acc = _fma32(xp, acc, v2, _F32(c))
        return acc

    return horner(numerator) * v / horner(denominator)


# MLAS's (Eigen's) coefficients, highest power first
_LOGISTIC_P = (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05,
               8.51377133304701e-03, 2.48287947061529e-01)
_LOGISTIC_Q = (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06,
               1.70198817374094e-03, 1.16817656904453e-01, 9.93151921023180e-01)
_TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
           5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
           4.89352455891786e-03)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
           4.89352518554385e-03)


def _mlas_logistic(xp, x):
    """onnxruntime's LSTM sigmoid (MlasComputeLogistic, x64 FMA3 kernel: clamped below at 0
    only, so it can return 1 + 1 ulp); matched it bit for bit on 8M float32 values."""
    return xp.maximum(_mlas_rational(xp, x, 18.0, _LOGISTIC_P, _LOGISTIC_Q) + _F32(0.5),
                      _F32(0))


def _mlas_tanh(xp, x):
    """onnxruntime's LSTM tanh (MlasComputeTanh, x64 FMA3 kernel)."""
    return _mlas_rational(xp, x, 9.0, _TANH_P, _TANH_Q)


def _lstm_activation(xp, name, alpha, beta):
    """An ONNX RNN activation by name, over float32 arrays. Sigmoid and tanh are
    onnxruntime's approximations rather than the exact functions: the hidden state is
    requantised every step, so a 1-ulp difference in a gate can flip a code and grow."""
    key = name.lower()
    a = _F32(alpha)
    b = _F32(beta)
    table = {
        "sigmoid": lambda x: _mlas_logistic(xp, x),
        "tanh": lambda x: _mlas_tanh(xp, x),
        "relu": lambda x: xp.maximum(x, _F32(0)),
        "affine": lambda x: a * x + b,
        "leakyrelu": lambda x: xp.where(x >= 0, x, a * x),
        "thresholdedrelu": lambda x: xp.where(x > a, x, _F32(0)),
        "scaledtanh": lambda x: a * xp.tanh(b * x),
        "hardsigmoid": lambda x: xp.clip(a * x + b, 0, 1),
        "elu": lambda x: xp.where(x >= 0, x, a * (xp.exp(x) - 1)),
        "softsign": lambda x: x / (1 + xp.abs(x)),
        "softplus": lambda x: xp.logaddexp(x, _F32(0)),
    }
    return table.get(key)


# default (alpha, beta) of the activations that take them, as in the ONNX RNN ops
_ACT_DEFAULTS = {"affine": (1.0, 0.0), "leakyrelu": (0.01, 0.0), "thresholdedrelu": (1.0, 0.0),
                 "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}
_ACT_PARAMS = {"affine": 2, "leakyrelu": 1, "thresholdedrelu": 1, "scaledtanh": 2,
               "hardsigmoid": 2, "elu": 1}


@register("DynamicQuantizeLSTM", versions=[1], domain=_MS)
class DynamicQuantizeLSTM(_QOp):
    """An ONNX LSTM whose two weight matrices are quantised (W: [dirs, input, 4 hidden],
    R: [dirs, hidden, 4 hidden], gates i, o, f, c; scales per tensor [dirs] or per column
    [dirs, 4 hidden]; of a zero point only its first entry per direction is used, as in
    onnxruntime) and whose activations are quantised dynamically to uint8 before each product:
    X once per direction over its first max(sequence_lens) steps, the hidden state once per
    step over the whole batch (onnxruntime's single-threaded grouping; with several threads it
    quantises batch chunks separately). Gate clipping, input_forget, peepholes and the RNN
    activations are as in ONNX LSTM; rows past their sequence length stop and output zeros."""

    defaults = {"hidden_size": None, "direction": "forward", "activations": None,
                "activation_alpha": None, "activation_beta": None, "clip": None,
                "input_forget": 0}

    def setup(self):
        if not self.hidden_size or int(self.hidden_size) <= 0:
            raise self.fail("attribute 'hidden_size' is required and must be positive")
        direction = self.direction.decode() if isinstance(self.direction, bytes) else \
            (self.direction or "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            raise self.fail(f"unknown direction {direction!r}")
        self.dirs = 2 if direction == "bidirectional" else 1
        self.reverse = [direction == "reverse"] if self.dirs == 1 else [False, True]
        names = list(self.activations or []) or ["Sigmoid", "Tanh", "Tanh"] * self.dirs
        if len(names) != 3 * self.dirs:
            raise self.fail(f"expected {3 * self.dirs} activations, got {len(names)}")
        alphas = list(self.activation_alpha or [])
        betas = list(self.activation_beta or [])
        self.acts = []
        for name in names:
            key = name.lower()
            if _lstm_activation(np, key, 0, 0) is None:
                raise self.fail(f"unsupported activation {name!r}")
            da, db = _ACT_DEFAULTS.get(key, (0.0, 0.0))
            n_params = _ACT_PARAMS.get(key, 0)
            a = alphas.pop(0) if n_params >= 1 and alphas else da
            b = betas.pop(0) if n_params >= 2 and betas else db
            self.acts.append((key, a, b))
        self.clip_value = None if self.clip is None else float(self.clip)

    def clipped(self, xp, v):
        if self.clip_value is None:
            return v
        return xp.clip(v, _F32(-self.clip_value), _F32(self.clip_value))

    def quantized_product(self, xp, a, w, scale, zero):
        """float32 a (rows, K) times quantised w (K, N): a quantised to uint8 over all of
        its rows, exact integer product, times a_scale * w_scale (per column)."""
        sa, za = _dynamic_uint8_params(xp, a)
        aq = _quantize(xp, a, sa, za, np.uint8)
        acc = _exact_matmul(xp, aq.astype(np.int32) - za, w)
        return acc.astype(_F32) * (sa * scale)

    def weight(self, xp, w, scale, zero, d, rows, what):
        hidden4 = 4 * int(self.hidden_size)
        if w.ndim != 3 or w.shape[0] != self.dirs or w.shape[1] != rows or \
                w.shape[2] != hidden4:
            raise self.fail(f"{what} must have shape ({self.dirs}, {rows}, {hidden4}), got "
                            f"{w.shape}")
        self.check_int8(w, what)
        for p, name in ((scale, "scale"), (zero, "zero point")):
            if not (p.shape == (self.dirs,) or p.shape == (self.dirs, hidden4)):
                raise self.fail(f"{what} {name} must have shape ({self.dirs},) or "
                                f"({self.dirs}, {hidden4}), got {p.shape}")
        if zero.dtype != w.dtype:
            raise self.fail(f"{what} zero point has type {zero.dtype}, {what} has {w.dtype}")
        z = zero.reshape(self.dirs, -1)[d, 0].astype(np.int32)
        s = scale.reshape(self.dirs, -1)[d].astype(_F32)
        return w[d].astype(np.int32) - z, s

    def run(self, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None,
            p=None, w_scale=None, w_zero_point=None, r_scale=None, r_zero_point=None):
        xp = self.xp
        for t, name in ((w_scale, "W_scale"), (w_zero_point, "W_zero_point"),
                        (r_scale, "R_scale"), (r_zero_point, "R_zero_point")):
            if t is None:
                raise self.fail(f"input {name} is required")
        if x.ndim != 3:
            raise self.fail(f"X must be (sequence, batch, input), got {x.shape}")
        seq, batch, size = x.shape
        hidden = int(self.hidden_size)
        x = x.astype(_F32)
        if sequence_lens is None:
            lens = np.full(batch, seq, np.int64)
        else:  # a loop bound: the host must read it
            lens = _xp.to_host(xp, sequence_lens).astype(np.int64).reshape(-1)
            if lens.shape != (batch,) or lens.min(initial=0) < 0 or lens.max(initial=0) > seq:
                raise self.fail(f"sequence_lens must be {batch} lengths in [0, {seq}]")
        steps = int(lens.max(initial=0))
        lens_dev = xp.asarray(lens)
        ys = xp.zeros((seq, self.dirs, batch, hidden), _F32)
        y_h = xp.zeros((self.dirs, batch, hidden), _F32)
        y_c = xp.zeros((self.dirs, batch, hidden), _F32)
        output_sequence = self.n_outputs >= 1 and bool(self.node.outputs[0])
        for d in range(self.dirs):
            wq, ws = self.weight(xp, w, w_scale, w_zero_point, d, size, "W")
            rq, rs = self.weight(xp, r, r_scale, r_zero_point, d, hidden, "R")
            bias = None
            if b is not None:
                if b.shape != (self.dirs, 8 * hidden):
                    raise self.fail(f"B must have shape ({self.dirs}, {8 * hidden})")
                bd = b[d].astype(_F32)
                bias = bd[:4 * hidden] + bd[4 * hidden:]
            peep = None
            if p is not None:
                if p.shape != (self.dirs, 3 * hidden):
                    raise self.fail(f"P must have shape ({self.dirs}, {3 * hidden})")
                peep = p[d].astype(_F32)
            h = xp.zeros((batch, hidden), _F32) if initial_h is None else \
                initial_h[d].astype(_F32)
            c = xp.zeros((batch, hidden), _F32) if initial_c is None else \
                initial_c[d].astype(_F32)
            f_act, g_act, h_act = [_lstm_activation(xp, *self.acts[3 * d + i])
                                   for i in range(3)]
            # time index read at each step, per batch row (reversal within each length)
            t_idx = np.arange(steps)[:, None]
            if self.reverse[d]:
                t_idx = np.where(t_idx < lens[None, :], lens[None, :] - 1 - t_idx, t_idx)
            else:
                t_idx = np.broadcast_to(t_idx, (steps, batch))
            xs = x[xp.asarray(t_idx), xp.arange(batch)[None, :]]  # (steps, batch, input)
            gates_x = self.quantized_product(xp, xs.reshape(steps * batch, size), wq, ws, None)
            gates_x = gates_x.reshape(steps, batch, 4 * hidden)
            h_prev = h  # what the next product quantises (finished rows: see below)
            for step in range(steps):
                gates = gates_x[step] + self.quantized_product(xp, h_prev, rq, rs, None)
                if bias is not None:
                    gates = gates + bias
                gi, go, gf, gc = (gates[:, k * hidden:(k + 1) * hidden] for k in range(4))
                if peep is not None:
                    gi = gi + peep[:hidden] * c
                    gf = gf + peep[2 * hidden:] * c
                gi, gf, gc = (self.clipped(xp, v) for v in (gi, gf, gc))
                i_t = f_act(gi)
                f_t = (1 - i_t) if self.input_forget else f_act(gf)
                c_new = f_t * c + i_t * g_act(gc)
                if peep is not None:  # the output gate's peephole sees the new cell state
                    go = go + peep[hidden:2 * hidden] * c_new
                h_new = f_act(self.clipped(xp, go)) * h_act(c_new)
                live = (step < lens_dev)[:, None]
                c = xp.where(live, c_new, c)
                h = xp.where(live, h_new, h)
                out = xp.where(live, h_new, _F32(0))
                # onnxruntime quantises the step's output buffer next: zeros for finished
                # rows when Y is produced, else the hidden state they stopped with
                h_prev = out if output_sequence else h
                rows = xp.asarray(t_idx[step])
                ys[rows, d, xp.arange(batch)] = xp.where(live, out, ys[rows, d,
                                                                      xp.arange(batch)])
            y_h[d] = xp.where((lens_dev > 0)[:, None], h, _F32(0))
            y_c[d] = xp.where((lens_dev > 0)[:, None], c, _F32(0))
        return ys, y_h, y_c

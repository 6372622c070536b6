"""Activation functions: Relu, Sigmoid, Softplus, Gelu, Swish/SwiGLU and the parametrised units.

Multi-step formulas run in `widen(x)` (float32 for float16/bfloat16 inputs, else x's own dtype)
and are rounded to the input dtype once at the end. Float attributes are Python floats, which
numpy treats as weakly typed, so they never widen a float32 computation.
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops.cpu import compiled as _compiled, tuning
from ember.ops.cpu.compiled import exp_float32, tanh_float32
from ember.ops._dtypes import widen
from ember.ops.elementwise import (_ERF32_P, _ERF32_Q, back, blocks, erf, erf_float32_block,
                                   unary)
from ember.ops._lowering import compiled_rows
from ember.ops.registry import PORTABLE, OpImpl, register


def _float_op(formula):
    """A unary kernel fn(xp, x) evaluating `formula(xp, w)` on the widened input, cast back to
    x's dtype."""
    def fn(xp, x):
        with np.errstate(all="ignore"):
            return back(xp, formula(xp, widen(x)), x.dtype)
    return fn


def sigmoid(xp, x):
    """1 / (1 + exp(-x)) without overflow, keeping relative precision for very negative x."""
    e = xp.exp(-xp.abs(x))
    s = 1 / (1 + e)
    return xp.where(x >= 0, s, e * s)


def softplus(xp, x):
    """log(1 + exp(x)) without overflow."""
    return xp.logaddexp(x.dtype.type(0), x)


def gelu(xp, w, tanh: bool = False, out=None):
    """0.5 * w * (1 + erf(w / sqrt(2))), or with tanh's approximation, written into `out` (a
    fresh array if None; `w` itself is allowed), block by block."""
    if out is None:
        out = xp.empty(w.shape, w.dtype)
    elif not out.flags.c_contiguous:  # the blocks below are flat views of C-ordered memory
        out[...] = gelu(xp, w, tanh)
        return out
    if xp is np and not tanh and w.dtype == np.float32 and w.size >= tuning.GELU_COMPILED_MIN:
        kernel = _compiled.jit(_gelu_erf32_loops)
        if kernel is not None:  # numba: the same bits as _gelu_erf32_block, faster
            flat_out = out.reshape(-1)
            _compiled.split_rows(kernel, flat_out.size, np.ascontiguousarray(w).reshape(-1),
                                 flat_out, ns_per_row=tuning.GELU_NS)  # per element
            return out
    block = _gelu_tanh_block if tanh else \
        _gelu_erf32_block if w.dtype == np.float32 else _gelu_erf_block
    for w_block, out_block in blocks(xp, w, out):
        block(xp, w_block, out_block)
    return out


def _gelu_erf32_block(xp, w, out):
    half_one_plus_erf = w * np.float32(math.sqrt(0.5))
    erf_float32_block(xp, half_one_plus_erf, half_one_plus_erf)
    half_one_plus_erf *= np.float32(0.5)  # 0.5 * (1 + erf) == 0.5 + 0.5 * erf, exactly
    half_one_plus_erf += np.float32(0.5)
    xp.multiply(w, half_one_plus_erf, out=out)


# erf's float32 coefficients as scalars: numba freezes globals into the compiled code
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = (np.float32(c) for c in _ERF32_P)
_Q0, _Q1, _Q2, _Q3, _Q4 = (np.float32(c) for c in _ERF32_Q)


@_compiled.kernel_math
def sigmoid_float32(x):
    """`sigmoid`'s formula for one float32 (exp by exp_float32, within 3 ulp of numpy's)."""
    e = exp_float32(-abs(x))
    s = np.float32(1) / (np.float32(1) + e)
    return s if x >= np.float32(0) else e * s


_SQRT_HALF, _HALF, _FOUR = np.float32(math.sqrt(0.5)), np.float32(0.5), np.float32(4)


@_compiled.kernel_math
def gelu_erf_float32(w):
    """GELU (erf) of the float32 `w` by _gelu_erf32_block's operations, in its order and
    rounding (kernels compile it without contraction): the same bits."""
    z = w * _SQRT_HALF
    z = -_FOUR if z < -_FOUR else (_FOUR if z > _FOUR else z)  # NaN stays NaN, as in clip
    z2 = z * z
    num = ((((((_P0 * z2 + _P1) * z2 + _P2) * z2 + _P3) * z2 + _P4) * z2 + _P5) * z2
           + _P6) * z
    den = (((_Q0 * z2 + _Q1) * z2 + _Q2) * z2 + _Q3) * z2 + _Q4
    return w * ((num / den) * _HALF + _HALF)


_GELU_CUBIC, _SQRT_2_OVER_PI = np.float32(0.044715), np.float32(math.sqrt(2 / math.pi))


@_compiled.kernel_math
def gelu_tanh_float32(w):
    """GELU's tanh approximation of the float32 `w`, by _gelu_tanh_block's steps in its
    order; tanh_float32 is within 2 ulp of numpy's tanh, so the result may differ from the
    numpy block's in the last bits."""
    t = w * w
    t = t * w
    t = t * _GELU_CUBIC
    t = t + w
    t = t * _SQRT_2_OVER_PI
    t = tanh_float32(t) + np.float32(1)
    return (_HALF * w) * t


def _gelu_erf32_loops(x, out, lo, hi):  # pragma: no cover - numba
    """gelu_erf_float32 element by element over [lo, hi): the same bits as the numpy block,
    in one pass instead of ~20. Computed into a local buffer, then copied: `out` may be `x`
    (the fused ops' in-place epilogue), and a loop whose input and output overlap is not
    vectorised. The block's values are indexed from slices: an index `start + j` that
    numba cannot prove non-negative costs a wraparound test each, and the loop its vectors
    (3x slower)."""
    buf = np.empty(512, np.float32)
    for start in range(lo, hi, 512):
        n = min(512, hi - start)
        source, target = x[start:start + n], out[start:start + n]
        for j in range(n):
            buf[j] = gelu_erf_float32(source[j])
        for j in range(n):
            target[j] = buf[j]


def _gelu_erf_block(xp, w, out):
    xp.multiply(0.5 * w, 1 + erf(xp, w * math.sqrt(0.5)), out=out)


def _gelu_tanh_block(xp, w, out):
    t = w * w
    t *= w
    t *= 0.044715
    t += w
    t *= math.sqrt(2 / math.pi)
    xp.tanh(t, out=t)
    t += 1
    xp.multiply(0.5 * w, t, out=out)


def _relu(xp, x):
    return xp.maximum(x, xp.zeros((), x.dtype))


def _softsign(xp, w):
    return w / (1 + xp.abs(w))


def _hardswish(xp, w):
    return w * xp.clip(w / 6 + 0.5, 0, 1)


def _mish(xp, w):
    return w * xp.tanh(softplus(xp, w))


Relu      = unary("Relu",      [1, 6, 13, 14], _relu)
Sigmoid   = unary("Sigmoid",   [1, 6, 13],     _float_op(sigmoid))
Softplus  = unary("Softplus",  [1, 22],        _float_op(softplus))
Softsign  = unary("Softsign",  [1, 22],        _float_op(_softsign))
HardSwish = unary("HardSwish", [14, 22],       _float_op(_hardswish))
Mish      = unary("Mish",      [18, 22],       _float_op(_mish))


class _FloatActivation(OpImpl):
    """Base for activations with attributes: `formula(w)` on the widened input."""

    def formula(self, w):  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def run(self, x):
        with np.errstate(all="ignore"):
            return back(self.xp, self.formula(widen(x)), x.dtype)


@register("Elu", versions=[1, 6, 22])
class Elu(_FloatActivation):
    def formula(self, w):
        xp = self.xp
        return xp.where(w >= 0, w, self.alpha * xp.expm1(xp.minimum(w, 0)))


@register("Celu", versions=[12, 28])
class Celu(_FloatActivation):
    def setup(self):
        if self.alpha == 0:
            raise self.fail("alpha must not be 0")

    def formula(self, w):
        xp = self.xp
        return xp.maximum(w, 0) + xp.minimum(0, self.alpha * xp.expm1(w / self.alpha))


@register("Selu", versions=[1, 6, 22])
class Selu(_FloatActivation):
    def formula(self, w):
        xp = self.xp
        return self.gamma * xp.where(w > 0, w, self.alpha * xp.expm1(xp.minimum(w, 0)))


@register("LeakyRelu", versions=[1, 6, 16])
class LeakyRelu(_FloatActivation):
    def formula(self, w):
        return self.xp.where(w >= 0, w, self.alpha * w)


@register("ThresholdedRelu", versions=[10, 22])
class ThresholdedRelu(_FloatActivation):
    def formula(self, w):
        return self.xp.where(w > self.alpha, w, 0)


@register("HardSigmoid", versions=[1, 6, 22])
class HardSigmoid(_FloatActivation):
    def formula(self, w):
        return self.xp.clip(self.alpha * w + self.beta, 0, 1)


@register("Gelu", versions=[20])
class Gelu(_FloatActivation):
    def setup(self):
        approximate = self.approximate.decode() if isinstance(self.approximate, bytes) \
            else self.approximate
        if approximate not in ("none", "tanh"):
            raise self.fail(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.tanh = approximate == "tanh"

    def formula(self, w):
        return gelu(self.xp, w, self.tanh)

    def lower(self, inputs):
        """`gelu`'s test: the erf form of float32, large enough (known in the run)."""
        x = inputs[0]
        if not self.tanh and x is not None and x.dtype == np.float32:
            return compiled_rows("erf GELU, split among the threads, numpy's bits") \
                if not x.static() or math.prod(x.shape) >= tuning.GELU_COMPILED_MIN \
                else PORTABLE
        return PORTABLE


@register("Swish", versions=[24])
class Swish(_FloatActivation):
    def formula(self, w):
        return w * sigmoid(self.xp, self.alpha * w)


@register("SwiGLU", versions=[28])
class SwiGLU(OpImpl):
    """Y = Swish_alpha(A) * B, with A and B of identical shapes."""

    def run(self, a, b):
        if a.shape != b.shape:
            raise self.fail(f"A and B must have the same shape, got {a.shape} and {b.shape}")
        xp = self.xp
        with np.errstate(all="ignore"):
            wa = widen(a)
            return back(xp, wa * sigmoid(xp, self.alpha * wa) * widen(b), a.dtype)


@register("Shrink", versions=[9])
class Shrink(OpImpl):
    """x - bias where x > lambd, x + bias where x < -lambd, else 0 (any numeric type)."""

    def run(self, x):
        xp = self.xp
        w = widen(x) if x.dtype.kind not in "iu" else x.astype(np.float64)
        y = xp.where(w > self.lambd, w - self.bias,
                     xp.where(w < -self.lambd, w + self.bias, 0))
        return back(xp, y, x.dtype)


@register("PRelu", versions=[1, 6, 7, 9, 16])
class PRelu(OpImpl):
    """slope * x where x < 0, else x; slope broadcasts unidirectionally onto x."""

    def run(self, x, slope):
        if self.version < 7 and slope.ndim == 1 and slope.size > 1 and x.ndim > 2 \
                and slope.size == x.shape[1]:
            slope = slope.reshape((-1,) + (1,) * (x.ndim - 2))  # opset 1/6: per channel
        with np.errstate(all="ignore"):
            return self.xp.where(x < 0, x * slope, x).astype(x.dtype, copy=False)

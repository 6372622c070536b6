"""Elementwise ops: unary math, binary arithmetic / comparison / logic with numpy broadcasting,
bit operations, and the variadic Max/Min/Sum/Mean. Activations live in ops/activations.py.

Most ops are one numpy ufunc and are declared by one line in the tables below; ops with
attributes or semantics of their own (integer Div, Mod, Pow's mixed types, BitShift, Clip,
IsInf, Where, ...) are small classes.

Dtypes: outputs keep the input dtype (bool for comparisons and predicates). numpy computes
float16 and the ml_dtypes floats (bfloat16, float8s) elementwise by widening each value to
float32 and rounding the result back, so one ufunc on them is exact-rounded; multi-step formulas
widen explicitly with `widen()` and round once at the end.

Opset-1/6 binary ops carry `broadcast`/`axis` attributes: with `axis` set, B's shape matches a
contiguous run of A's dims starting at `axis` (B is reshaped with trailing 1s); without it,
B matches A's trailing dims, which is numpy broadcasting.
"""
from __future__ import annotations

import functools
import sys

import numpy as np

from ember.ops._dtypes import is_narrow_float, widen
from ember.ops.registry import OpImpl, register


# ------------------------------------------------------------------------------------ helpers

def back(xp, y, dtype: np.dtype):
    """`y` (a result computed on `widen`ed inputs) cast back to the op's output dtype."""
    return xp.asarray(y).astype(dtype, copy=False)


# Coefficients of the rational approximations of erf (|x| <= 1) and erfc (1 <= x < 8) from
# Cephes' ndtr.c (S. L. Moshier); relative error below 2e-16 in float64.
_ERF_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
          7.00332514112805075473e3, 5.55923013010394962768e4)
_ERF_U = (1.0, 3.35617141647503099647e1, 5.21357949780152679795e2, 4.59432382970980127987e3,
          2.26290000613890934246e4, 4.92673942608635921086e4)
_ERFC_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
           4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
           9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_ERFC_Q = (1.0, 1.32281951154744992508e1, 8.67072140885989742329e1, 3.54937778887819891062e2,
           9.75708501743205489753e2, 1.82390916687909736289e3, 2.24633760818710981792e3,
           1.65666309194161350182e3, 5.57535340817727675546e2)


def _poly(xp, coefs, x):
    """Horner evaluation of a polynomial (highest power first), in place, in x's dtype."""
    acc = xp.empty_like(x)
    acc.fill(coefs[0])
    for c in coefs[1:]:
        acc *= x
        acc += c
    return acc


def _erf_small(xp, z):  # |z| <= 1
    z2 = z * z
    y = _poly(xp, _ERF_T, z2)
    y *= z
    y /= _poly(xp, _ERF_U, z2)
    return y


def _erf_big(xp, z):  # |z| > 1 (and NaN, which propagates): sign(z) * (1 - erfc(|z|))
    a = xp.abs(z)
    xp.minimum(a, 8.0, out=a)  # erfc(8) ~ 1e-29: erf is +-1 to double precision beyond
    e = a * a
    xp.negative(e, out=e)
    xp.exp(e, out=e)
    e *= _poly(xp, _ERFC_P, a)
    e /= _poly(xp, _ERFC_Q, a)
    xp.subtract(1.0, e, out=e)
    return xp.copysign(e, z, out=e)


# float32: one odd/even rational approximation on [-4, 4] (erf is +-1 in float32 beyond), as
# Eigen and XLA use; relative error below 5e-7 everywhere, and no branches to gather.
_ERF32_P = np.array([-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                     -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                     -1.60960333262415e-02], np.float32)
_ERF32_Q = np.array([-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                     -7.37332916720468e-03, -1.42647390514189e-02], np.float32)


def _erf_float32(xp, x):
    out = xp.empty(x.shape, np.float32)
    for x_block, out_block in blocks(xp, x, out):
        erf_float32_block(xp, x_block, out_block)
    return out


def erf_float32_block(xp, x, out):
    """erf of a 1-D float32 block written into `out` (which may be `x` itself)."""
    z = xp.clip(x, np.float32(-4), np.float32(4))
    z2 = z * z
    num = _poly(xp, _ERF32_P, z2)
    num *= z
    return xp.divide(num, _poly(xp, _ERF32_Q, z2), out=out)


# Multi-step float formulas run over blocks of this many elements on the CPU: a block and the
# few temporaries of its formula stay in the core's L2 cache, so each of the formula's steps
# reads cache instead of memory (erf: ~25 steps; 3x faster than whole-array steps on BERT's
# GELU). On a GPU blocks would only multiply kernel launches: there one block is the array.
BLOCK = 1 << 15


def blocks(xp, x, out):
    """Matching 1-D blocks of `x` and `out` (same shape; `out` C-contiguous and writable)."""
    flat_in = xp.ascontiguousarray(x).reshape(-1)
    flat_out = out.reshape(-1)
    block = BLOCK if xp is np else max(flat_in.size, 1)
    for lo in range(0, flat_in.size, block):
        yield flat_in[lo:lo + block], flat_out[lo:lo + block]


def erf(xp, x):
    """Vectorised erf in x's dtype (float32 or float64), accurate to that dtype's precision."""
    x = xp.asarray(x)
    if x.ndim == 0:
        return erf(xp, x.reshape(1)).reshape(())
    if x.dtype == np.float32:
        return _erf_float32(xp, x)
    with np.errstate(all="ignore"):
        small = xp.abs(x) <= 1.0
        n = int(xp.count_nonzero(small))
        if n == small.size:
            return _erf_small(xp, x)
        if n == 0:
            return _erf_big(xp, x)
        out = xp.empty_like(x)
        out[small] = _erf_small(xp, x[small])
        big = ~small
        out[big] = _erf_big(xp, x[big])
    return out


def _legacy_align(self, a, b):
    """Opset-1/6 limited broadcasting: B aligned to A's dims starting at `axis`."""
    if getattr(self, "broadcast", 0) and self.axis is not None and b.ndim and a.ndim:
        axis = self.axis + a.ndim if self.axis < 0 else self.axis
        if not 0 <= axis <= a.ndim - b.ndim:
            raise self.fail(f"axis {self.axis} cannot align shape {b.shape} with {a.shape}")
        b = b.reshape(b.shape + (1,) * (a.ndim - axis - b.ndim))
    return a, b


def _not_broadcastable(op: OpImpl, *arrays):
    """The error for inputs whose shapes do not broadcast together, or None when they do (the
    ValueError a kernel raised was about something else)."""
    shapes = [tuple(np.shape(a)) for a in arrays if a is not None]
    try:
        np.broadcast_shapes(*shapes)
    except ValueError:
        return op.fail(f"input shapes {', '.join(map(str, shapes))} do not broadcast together")
    return None


def _broadcasting(run):
    """A kernel's `run`, failing with the op's own error when its inputs' shapes do not
    broadcast (numpy's ValueError would reach the user wrapped, in numpy's words). The error
    is raised outside the `except`, so it is not chained to numpy's."""
    @functools.wraps(run)
    def checked(self, *inputs):
        try:
            return run(self, *inputs)
        except ValueError:
            error = _not_broadcastable(self, *inputs)
            if error is None:
                raise
        raise error
    return checked


# ----------------------------------------------------------------------- table-driven classes

class Unary(OpImpl):
    """y = fn(x): `fn` is a numpy ufunc (which applies to cupy arrays too, by numpy's
    `__array_ufunc__`), or with `takes_xp` a function of (xp, x)."""
    fn = staticmethod(np.positive)
    takes_xp = False

    def run(self, x):
        return self.fn(self.xp, x) if self.takes_xp else self.fn(x)


class QuietUnary(Unary):
    """y = fn(x) for math that can leave its domain (log(0), sqrt(-1), ...): IEEE results,
    numpy's floating-point warnings silenced (np.errstate costs ~1us, so only here)."""

    def run(self, x):
        with np.errstate(all="ignore"):
            return self.fn(self.xp, x) if self.takes_xp else self.fn(x)


class Binary(OpImpl):
    """z = fn(a, b) with numpy (multidirectional) broadcasting; `fn` a ufunc, or with
    `takes_xp` a function of (xp, a, b). (No np.errstate here: it costs more than a small Add;
    the kernels that can divide by zero silence warnings themselves.)"""
    fn = staticmethod(np.add)
    takes_xp = False

    def run(self, a, b):
        # _broadcasting's check inlined: a try costs nothing until it catches, and this is
        # the hottest kernel there is
        try:
            return self.fn(self.xp, a, b) if self.takes_xp else self.fn(a, b)
        except ValueError:
            error = _not_broadcastable(self, a, b)
            if error is None:
                raise
        raise error


class LegacyBinary(Binary):
    """Opset-1/6 form of a binary op, with `broadcast` and `axis` attributes."""

    @_broadcasting
    def run(self, a, b):
        a, b = _legacy_align(self, a, b)
        return self.fn(self.xp, a, b) if self.takes_xp else self.fn(a, b)


class Variadic(OpImpl):
    """fn (a ufunc) folded over 1..N inputs with broadcasting (Max, Min, Sum)."""
    fn = staticmethod(np.add)

    @_broadcasting
    def run(self, *xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            raise self.fail("needs at least one input")
        if len(xs) == 1:
            return xs[0].copy()
        return functools.reduce(self.fn, xs)


def _declare(base: type, op: str, versions: list[int], fn, name: str) -> type:
    """A subclass of `base` computing `fn` (a numpy ufunc, or a function whose first
    parameter is the array namespace `xp`), registered for `op` at `versions`."""
    module = sys._getframe(2).f_globals.get("__name__", __name__)  # the declaring module
    cls = type(name, (base,), {"fn": staticmethod(fn), "takes_xp": not isinstance(fn, np.ufunc),
                               "__module__": module, "__qualname__": name,
                               "__doc__": base.__doc__})
    return register(op, versions)(cls)


def unary(op: str, versions: list[int], fn, quiet: bool = False) -> type:
    """Declare `op` as y = fn(x) (a ufunc, or fn(xp, x)); `quiet` silences numpy's
    floating-point warnings."""
    return _declare(QuietUnary if quiet else Unary, op, versions, fn, op)


def binary(op: str, versions: list[int], fn) -> type:
    """Declare `op` as z = fn(a, b) (a ufunc, or fn(xp, a, b)) with numpy broadcasting."""
    return _declare(Binary, op, versions, fn, op)


def legacy_binary(op: str, versions: list[int], fn) -> type:
    """Declare the opset-1/6 form of a binary op (`broadcast`/`axis` attributes)."""
    return _declare(LegacyBinary, op, versions, fn, f"{op}{versions[0]}")


def variadic(op: str, versions: list[int], fn) -> type:
    """Declare `op` as fn (a ufunc) folded over its 1..N inputs."""
    return _declare(Variadic, op, versions, fn, op)


# ------------------------------------------------------------------------------- unary math

def _float_erf(xp, x):
    if x.dtype in (np.float32, np.float64):
        return erf(xp, x)
    return back(xp, erf(xp, x.astype(np.float32)), x.dtype)


def _round(xp, x):  # np.round is a function, not a ufunc
    return xp.round(x)


Abs        = unary("Abs",        [1, 6, 13],  np.abs)
Neg        = unary("Neg",        [1, 6, 13],  np.negative)
Sign       = unary("Sign",       [9, 13],     np.sign)
Ceil       = unary("Ceil",       [1, 6, 13],  np.ceil)
Floor      = unary("Floor",      [1, 6, 13],  np.floor)
Round      = unary("Round",      [11, 22],    _round)  # halves to even, like ONNX
IsNaN      = unary("IsNaN",      [9, 13, 20], np.isnan)
Not        = unary("Not",        [1],         np.logical_not)
BitwiseNot = unary("BitwiseNot", [18],        np.invert)
Reciprocal = unary("Reciprocal", [1, 6, 13],  np.reciprocal, quiet=True)
Sqrt       = unary("Sqrt",       [1, 6, 13],  np.sqrt, quiet=True)
Exp        = unary("Exp",        [1, 6, 13],  np.exp, quiet=True)
Log        = unary("Log",        [1, 6, 13],  np.log, quiet=True)
Erf        = unary("Erf",        [9, 13],     _float_erf, quiet=True)
Sin        = unary("Sin",        [7, 22],     np.sin, quiet=True)
Cos        = unary("Cos",        [7, 22],     np.cos, quiet=True)
Tan        = unary("Tan",        [7, 22],     np.tan, quiet=True)
Asin       = unary("Asin",       [7, 22],     np.arcsin, quiet=True)
Acos       = unary("Acos",       [7, 22],     np.arccos, quiet=True)
Atan       = unary("Atan",       [7, 22],     np.arctan, quiet=True)
Sinh       = unary("Sinh",       [9, 22],     np.sinh, quiet=True)
Cosh       = unary("Cosh",       [9, 22],     np.cosh, quiet=True)
Tanh       = unary("Tanh",       [1, 6, 13],  np.tanh, quiet=True)
Asinh      = unary("Asinh",      [9, 22],     np.arcsinh, quiet=True)
Acosh      = unary("Acosh",      [9, 22],     np.arccosh, quiet=True)
Atanh      = unary("Atanh",      [9, 22],     np.arctanh, quiet=True)


@register("IsInf", versions=[10, 20])
class IsInf(OpImpl):
    def run(self, x):
        xp = self.xp
        if self.detect_positive and self.detect_negative:
            return xp.isinf(x)
        if self.detect_positive:
            return xp.isposinf(widen(x))
        if self.detect_negative:
            return xp.isneginf(widen(x))
        return xp.zeros(x.shape, dtype=bool)


# --------------------------------------------------------------------------------- arithmetic

def _div(xp, a, b):
    """Div: true division for floats; integers truncate toward zero (C semantics)."""
    with np.errstate(all="ignore"):  # x/0 gives inf/nan for floats, 0 for integers
        if a.dtype.kind not in "iu":
            return xp.divide(a, b)
        if a.dtype.kind == "u":
            return xp.floor_divide(a, b)
        # a - fmod(a, b) is an exact multiple of b of smaller magnitude than a: no overflow.
        return xp.floor_divide(a - xp.fmod(a, b), b)


def _pow(xp, x, y):
    """Pow: the output has the base's dtype whatever the exponent's (opset 12+)."""
    with np.errstate(all="ignore"):
        return _pow_kernel(xp, x, y)


def _pow_kernel(xp, x, y):
    if x.dtype.kind in "iu":
        if y.dtype.kind in "iu" and not (y < 0).any():
            return xp.power(x, y.astype(x.dtype, copy=False))
        # Non-integral or negative exponents: compute in float64, truncate like a C cast.
        return back(xp, xp.trunc(xp.power(x.astype(np.float64), y.astype(np.float64))),
                    x.dtype)
    if y.dtype != x.dtype:
        if is_narrow_float(x.dtype):
            return back(xp, xp.power(x.astype(np.float32), y.astype(np.float32)), x.dtype)
        y = y.astype(x.dtype)
    return xp.power(x, y)


Add = binary("Add", [7, 13, 14],     np.add)
Sub = binary("Sub", [7, 13, 14],     np.subtract)
Mul = binary("Mul", [7, 13, 14],     np.multiply)
Div = binary("Div", [7, 13, 14],     _div)
Pow = binary("Pow", [7, 12, 13, 15], _pow)

Add1 = legacy_binary("Add", [1, 6], np.add)
Sub1 = legacy_binary("Sub", [1, 6], np.subtract)
Mul1 = legacy_binary("Mul", [1, 6], np.multiply)
Div1 = legacy_binary("Div", [1, 6], _div)
Pow1 = legacy_binary("Pow", [1],    _pow)


@register("Mod", versions=[10, 13, 28])
class Mod(OpImpl):
    """fmod=0: result has the sign of B (Python/numpy %); fmod=1: sign of A (C fmod)."""

    def setup(self):
        if self.fmod not in (0, 1):
            raise self.fail(f"fmod must be 0 or 1, got {self.fmod}")

    @_broadcasting
    def run(self, a, b):
        xp = self.xp
        with np.errstate(all="ignore"):
            return xp.fmod(a, b) if self.fmod else xp.mod(a, b)


Max = variadic("Max", [1, 6, 8, 12, 13], np.maximum)
Min = variadic("Min", [1, 6, 8, 12, 13], np.minimum)
Sum = variadic("Sum", [1, 6, 8, 13],     np.add)


@register("Mean", versions=[1, 6, 8, 13])
class Mean(Variadic):
    def run(self, *xs):
        present = [x for x in xs if x is not None]
        total = super().run(*(widen(x) for x in present))  # Sum's checks and fold
        return back(self.xp, total / len(present), present[0].dtype)


@register("Clip", versions=[1, 6])
class Clip1(OpImpl):
    """Clip with `min`/`max` attributes (absent: unbounded)."""

    def run(self, x):
        xp = self.xp
        y = x
        with np.errstate(all="ignore"):  # the default bounds overflow float16 to +-inf
            if self.min is not None:
                y = xp.maximum(y, xp.asarray(self.min).astype(x.dtype))
            if self.max is not None:
                y = xp.minimum(y, xp.asarray(self.max).astype(x.dtype))
        return y if y is not x else x.copy()


@register("Clip", versions=[11, 12, 13])
class Clip(OpImpl):
    """Clip with optional scalar `min`/`max` inputs; min > max gives max everywhere."""

    def run(self, x, lo=None, hi=None):
        xp = self.xp
        y = x
        if lo is not None and lo.size:  # an empty tensor also means "no bound"
            y = xp.maximum(y, xp.asarray(lo, dtype=x.dtype).reshape(()))
        if hi is not None and hi.size:
            y = xp.minimum(y, xp.asarray(hi, dtype=x.dtype).reshape(()))
        return y if y is not x else x.copy()


# -------------------------------------------------------------------- comparison and logic

Equal          = binary("Equal",          [7, 11, 13, 19], np.equal)
Greater        = binary("Greater",        [7, 9, 13],      np.greater)
Less           = binary("Less",           [7, 9, 13],      np.less)
GreaterOrEqual = binary("GreaterOrEqual", [12, 16],        np.greater_equal)
LessOrEqual    = binary("LessOrEqual",    [12, 16],        np.less_equal)
And            = binary("And",            [7],             np.logical_and)
Or             = binary("Or",             [7],             np.logical_or)
Xor            = binary("Xor",            [7],             np.logical_xor)
BitwiseAnd     = binary("BitwiseAnd",     [18],            np.bitwise_and)
BitwiseOr      = binary("BitwiseOr",      [18],            np.bitwise_or)
BitwiseXor     = binary("BitwiseXor",     [18],            np.bitwise_xor)

Equal1   = legacy_binary("Equal",   [1], np.equal)
Greater1 = legacy_binary("Greater", [1], np.greater)
Less1    = legacy_binary("Less",    [1], np.less)
And1     = legacy_binary("And",     [1], np.logical_and)
Or1      = legacy_binary("Or",      [1], np.logical_or)
Xor1     = legacy_binary("Xor",     [1], np.logical_xor)


@register("BitShift", versions=[11, 28])
class BitShift(OpImpl):
    """Shifts by Y bits; Y < 0 or >= the bit width gives 0 (-1 for a right shift of a negative
    signed X, i.e. pure sign extension). Right shifts of signed types are arithmetic."""

    def setup(self):
        direction = self.direction.decode() if isinstance(self.direction, bytes) \
            else self.direction
        if direction not in ("LEFT", "RIGHT"):
            raise self.fail(f"direction must be 'LEFT' or 'RIGHT', got {direction!r}")
        self.left = direction == "LEFT"

    @_broadcasting
    def run(self, x, y):
        xp = self.xp
        bits = x.dtype.itemsize * 8
        out_of_range = (y >= bits) | (y < 0) if y.dtype.kind == "i" else y >= bits
        clipped = bool(out_of_range.any())
        safe = xp.where(out_of_range, 0, y).astype(x.dtype) if clipped else y
        z = xp.left_shift(x, safe) if self.left else xp.right_shift(x, safe)
        if clipped:
            if self.left or x.dtype.kind == "u":
                fill = xp.zeros((), x.dtype)
            else:
                fill = xp.where(x < 0, x.dtype.type(-1), x.dtype.type(0))
            z = xp.where(out_of_range, fill, z)
        return z


@register("Where", versions=[9, 16])
class Where(OpImpl):
    @_broadcasting
    def run(self, condition, x, y):
        return self.xp.where(condition, x, y)

"""OpenCL elementwise kernels: unary math, binary arithmetic / comparison / logic with numpy
broadcasting, variadic Max/Min/Sum/Mean, Pow, Mod, BitShift, Where, Clip, Cast/CastLike.

Every op runs through ONE generated kernel, `ew(be, expr, inputs, out_dtype)` (`be` the op's
backend instance, `self.device`): output element i is
`expr` evaluated on the inputs' values at their broadcast offsets. Before generating source, the
broadcast layout is simplified: size-1 output axes are dropped and adjacent axes that are
contiguous for every input are merged, then each input is classed as *full* (its offset is i),
*scalar* (offset 0) or *general* (offset computed from the merged dims and its strides,
baked into the source as constants, so the index arithmetic divides by constants, which
compilers turn into multiplications and vectorise: ~10x faster than divisor arguments on PoCL).
So a program for full/scalar inputs serves every shape; one with a broadcast input is built per
broadcast layout (once: programs are cached on disk).

Inputs are named a, b, c, ... in the expression and hold values of their *load* type (float
for float16, which is read with vload_half; otherwise the storage type unless a kernel asks for
another); `W` is the work type of the expression (by default the first input's load type).
Results are converted to the output dtype on store (bool stores `expr != 0`; float16 stores
with vstore_half_rte, round to nearest even like numpy). Helper functions (NaN-propagating
maxn/minn like np.maximum/np.minimum, numpy's mod, integer power, a stable sigmoid...) are
defined on W and included when the expression names them.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache

import numpy as np

from ember.ops import elementwise as E
from ember.ops import tensor as T
from ember.ops.opencl._common import C_TYPES, broadcast_strides, cached_table, kernel, launch
from ember.ops.registry import register

HALF = np.dtype(np.float16)
BOOL = np.dtype(np.bool_)
_KIND_DTYPES = {
    "f": frozenset(np.dtype(t) for t in (np.float32, np.float64, np.float16)),
    "i": frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)),
    "u": frozenset(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64)),
    "b": frozenset({BOOL}),
}
DEVICE_TYPES = frozenset().union(*_KIND_DTYPES.values())
_NAMES = "abcdefghjkmpqtuvwxyz"  # input value names in expressions (at most 20 inputs)
_LOCAL = 256


def kind(dtype) -> str:
    """'f' (float32/64/16), 'i' (signed), 'u' (unsigned), 'b' (bool), '' (not on the device)."""
    dtype = np.dtype(dtype)
    for k, types in _KIND_DTYPES.items():
        if dtype in types:
            return k
    return ""


def kinds_dtypes(kinds: str) -> frozenset:
    return frozenset().union(*(_KIND_DTYPES[k] for k in kinds))


def storage_type(dtype) -> str:
    dtype = np.dtype(dtype)
    return "half" if dtype == HALF else C_TYPES[dtype]


def load_type(dtype) -> str:
    dtype = np.dtype(dtype)
    return "float" if dtype == HALF else C_TYPES[dtype]


def lit(value, ctype: str = "W") -> str:
    """A C literal of float `value` converted to `ctype` (exact: hex floats)."""
    v = float(value)
    if math.isnan(v):
        text = "NAN"
    elif math.isinf(v):
        text = "INFINITY" if v > 0 else "-INFINITY"
    else:
        text = v.hex()
    return f"(({ctype}){text})"


def on_device(be, *xs) -> bool:
    """All of `xs` are device arrays of backend `be`, of a dtype the kernels handle."""
    return all(be.is_device_array(x) and x.dtype in DEVICE_TYPES for x in xs)


def pick(table: dict[str, str], dtype) -> str | None:
    """The expression of `table` (kinds -> expression) for `dtype`, or None."""
    k = kind(dtype)
    if not k:
        return None
    for kinds, expr in table.items():
        if k in kinds:
            return expr
    return None


# ------------------------------------------------------------------------------ helpers in C
# name -> (kinds -> definition on W); included when the expression calls name(...).
_HELPERS: dict[str, dict[str, str]] = {
    "maxn": {"f": "W maxn(W x, W y) { return (x > y || isnan(x)) ? x : y; }",
             "iub": "W maxn(W x, W y) { return x > y ? x : y; }"},
    "minn": {"f": "W minn(W x, W y) { return (x < y || isnan(x)) ? x : y; }",
             "iub": "W minn(W x, W y) { return x < y ? x : y; }"},
    "sigm": {"f": "W sigm(W x) { W e = exp(-fabs(x)); W s = (W)1 / ((W)1 + e); "
                  "return x >= 0 ? s : e * s; }"},
    "softplus": {"f": "W softplus(W x) { return maxn(x, (W)0) + log1p(exp(-fabs(x))); }"},
    # numpy's mod (sign of the divisor) and C's fmod for integers; x / 0 gives 0 like numpy
    "pymod": {"f": "W pymod(W x, W y) { W m = fmod(x, y); if (y == 0) return m; "
                   "if (m != 0) { if ((y < 0) != (m < 0)) m += y; } else m = copysign((W)0, y); "
                   "return m; }",
              "i": "W pymod(W x, W y) { if (y == 0 || y == -1) return 0; W m = x % y; "
                   "if (m != 0 && ((m < 0) != (y < 0))) m += y; return m; }",
              "u": "W pymod(W x, W y) { return y == 0 ? (W)0 : (W)(x % y); }"},
    "cmod": {"i": "W cmod(W x, W y) { return (y == 0 || y == -1) ? (W)0 : (W)(x % y); }",
             "u": "W cmod(W x, W y) { return y == 0 ? (W)0 : (W)(x % y); }"},
    # x rounded to float16 precision (to round intermediate float16 results like numpy)
    "rh": {"f": "W rh(W x) { ushort h; vstore_half_rte((float)x, 0, (half *)&h); "
                "return vload_half(0, (const half *)&h); }"},
    # integer power by squaring (wraps like numpy); negative exponents as C-truncated float64
    "ipow": {"iu": "W ipow(W x, long y) { if (y < 0) return (W)trunc(pow((double)x, (double)y)); "
                   "W r = 1; while (y) { if (y & 1) r *= x; x *= x; y >>= 1; } return r; }"},
}
_DEPS = {"softplus": ("maxn",)}


def _helpers(expr: str, work: str) -> str:
    wkind = {"float": "f", "double": "f"}.get(work, "u" if work.startswith("u") else "i")
    wanted: list[str] = []

    def want(name):
        for dep in _DEPS.get(name, ()):
            want(dep)
        if name not in wanted:
            wanted.append(name)

    for name in _HELPERS:
        if re.search(rf"\b{name}\(", expr):
            want(name)
    out = []
    for name in wanted:
        for kinds, code in _HELPERS[name].items():
            if wkind in kinds:
                out.append(code)
                break
    return "\n".join(out)


# ------------------------------------------------------------------------- the generic kernel

@lru_cache(maxsize=4096)
def _layout(out_shape: tuple[int, ...], in_shapes: tuple[tuple[int, ...], ...]):
    """(class of each input 'f'/'s'/'g', 64-bit indexing, the element count as a kernel
    argument, the merged dims and general inputs' strides to bake into the source, and the
    same layout as a table for the shape-generic kernel: merged dims, then every input's
    strides over them)."""
    n = math.prod(out_shape)
    strides = [broadcast_strides(s, out_shape) for s in in_shapes]
    dims: list[int] = []
    st: list[list[int]] = [[] for _ in in_shapes]
    for k, d in enumerate(out_shape):
        if d == 1:
            continue
        if dims and all(s[-1] == int(full[k]) * d for s, full in zip(st, strides)):
            dims[-1] *= d
            for s, full in zip(st, strides):
                s[-1] = int(full[k])
        else:
            dims.append(d)
            for s, full in zip(st, strides):
                s.append(int(full[k]))
    contiguous = [math.prod(dims[m + 1:]) for m in range(len(dims))]
    classes = tuple("f" if s == contiguous else "s" if not any(s) else "g" for s in st)
    wide = n >= 2 ** 31 or any(math.prod(s) >= 2 ** 31 for s in in_shapes)
    itype = np.int64 if wide else np.int32
    baked = (tuple(dims), tuple(tuple(s) for c, s in zip(classes, st) if c == "g")) \
        if "g" in classes else None
    table = np.asarray(dims + [v for s in st for v in s] or [1], itype)  # the generic kernel's
    return classes, wide, itype(n), baked, table


@lru_cache(maxsize=None)
def _bshape(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    return tuple(int(d) for d in np.broadcast_shapes(*shapes))


def _source(expr: str, in_dtypes, loads, out_dtype, work, classes, wide, baked) -> str:
    """The kernel's source. `baked` None: no general input; "table": every input general,
    its offset computed from a layout table argument (merged dims, then each input's strides;
    `nd_` dims), one program for every shape; else the merged dims and strides, baked in."""
    idx = "long" if wide else "int"
    out_dtype = np.dtype(out_dtype)
    params = [f"__global {storage_type(out_dtype)} *restrict out_"]
    params += [f"__global const {storage_type(d)} *restrict in{j}_"
               for j, d in enumerate(in_dtypes)]
    params.append(f"const {idx} n_")
    general = [j for j, c in enumerate(classes) if c == "g"]
    body = [f"const {idx} i_ = ({idx})get_global_id(0);", "if (i_ >= n_) return;"]
    if baked == "table":
        params += [f"__global const {idx} *restrict lay_", "const int nd_"]
        body.append(f"{idx} r_ = i_;" + "".join(f" {idx} o{j}_ = 0;" for j in general))
        body.append(f"for (int m_ = nd_ - 1; m_ >= 0; m_--) {{ const {idx} d_ = lay_[m_]; "
                    f"const {idx} c_ = m_ ? r_ % d_ : r_; r_ /= d_;"
                    + "".join(f" o{j}_ += c_ * lay_[{j + 1} * nd_ + m_];" for j in general)
                    + " }")
    elif general:
        dims, strides = baked
        body.append(f"{idx} r_ = i_, c_;" + "".join(f" {idx} o{j}_ = 0;" for j in general))
        for m in range(len(dims) - 1, -1, -1):
            step = "c_ = r_;" if m == 0 else f"c_ = r_ % {dims[m]}; r_ /= {dims[m]};"
            body.append(step + "".join(f" o{j}_ += c_ * {s[m]};"
                                       for j, s in zip(general, strides) if s[m]))
    for j, (d, lt, c) in enumerate(zip(in_dtypes, loads, classes)):
        off = {"f": "i_", "s": "0"}.get(c, f"o{j}_")
        value = f"vload_half({off}, in{j}_)" if d == HALF else f"in{j}_[{off}]"
        body.append(f"const {lt} {_NAMES[j]} = ({lt}){value};")
    if out_dtype == HALF:
        body.append(f"vstore_half_rte(({'double' if work == 'double' else 'float'})({expr}), "
                    "i_, out_);")
    elif out_dtype == BOOL:
        body.append(f"out_[i_] = (uchar)(({expr}) != 0);")
    else:
        body.append(f"out_[i_] = ({storage_type(out_dtype)})({expr});")
    helpers = _helpers(expr, work)
    return (f"typedef {work} W;\n{helpers}\n__kernel void ew({', '.join(params)}) {{\n  "
            + "\n  ".join(body) + "\n}\n")


# Per backend instance (`be.cache`): "ew.kernels", the kernels by signature and layout;
# "ew.layouts_seen", how often each broadcast layout has been met: a broadcast layout's own
# program (its dims baked in: ~10x faster index arithmetic on PoCL) is built when the layout
# comes back. Until then the signature's shape-generic program runs it, so a new shape compiles
# nothing.
_SPECIALISE_AFTER = 2


def ew(be, expr: str, inputs, out_dtype, *, work: str | None = None, loads=None,
       out_shape: tuple[int, ...] | None = None):
    """A new device array of backend `be`: `expr` (C, over input values a, b, c...) at every
    element of the inputs' broadcast shape (or `out_shape`, which the inputs must broadcast
    to)."""
    kernels = be.cache("ew.kernels")
    shapes = tuple(tuple(x.shape) for x in inputs)
    if out_shape is None:
        out_shape = _bshape(shapes)
    out = be.empty(out_shape, out_dtype)
    if out.size == 0:
        return out
    classes, wide, n, baked, table = _layout(tuple(out_shape), shapes)
    in_dtypes = tuple(x.dtype for x in inputs)
    loads = tuple(loads) if loads is not None else tuple(load_type(d) for d in in_dtypes)
    work = work or loads[0]
    key = (expr, in_dtypes, out.dtype, work, loads, classes, wide, baked)
    generic_key = (expr, in_dtypes, out.dtype, work, loads, ("g",) * len(inputs), wide, "table")
    if generic_key not in kernels:  # built with the first program of this signature, so a
        kernels[generic_key] = kernel(  # later shape never waits for a compile
            be, _source(expr, in_dtypes, loads, out.dtype, work, *generic_key[5:]), "ew")
    extra = ()
    if baked is not None and key not in kernels:
        layouts_seen = be.cache("ew.layouts_seen")
        seen = layouts_seen.get(key, 0) + 1
        layouts_seen[key] = seen
        if seen < _SPECIALISE_AFTER:  # a broadcast layout met for the first time
            key = generic_key
            extra = (cached_table(be, table), np.int32(len(table) // (len(inputs) + 1)))
    knl = kernels.get(key)
    if knl is None:
        knl = kernels[key] = kernel(
            be, _source(expr, in_dtypes, loads, out.dtype, work, classes, wide, baked), "ew")
    local = min(_LOCAL, be.device.max_work_group_size)
    launch(be, knl, -(-int(n) // local) * local, out, *inputs, n, *extra, local_size=(local,))
    return out


# ------------------------------------------------------------------------------ op classes

class UnaryCL:
    """Mixin over a CPU unary class: y = table[kind](a), or `expr(dtype)` for attributes."""
    table: dict[str, str] = {}
    bool_out = False

    def expr(self, dtype) -> str | None:
        return pick(self.table, dtype)

    def run(self, x):
        e = self.expr(x.dtype) if on_device(self.device, x) else None
        if e is None:
            return self.run_on_cpu(x)
        return ew(self.device, e, [x], BOOL if self.bool_out else x.dtype)


class BinaryCL:
    """Mixin over a CPU binary class: z = table[kind](a, b), same-dtype inputs, broadcasting
    (the opset-1/6 forms align B with `axis` first)."""
    table: dict[str, str] = {}
    bool_out = False

    def run(self, a, b):
        e = pick(self.table, a.dtype) if on_device(self.device, a, b) and a.dtype == b.dtype \
            else None
        if e is None:
            return self.run_on_cpu(a, b)
        if isinstance(self, E.LegacyBinary):
            a, b = E._legacy_align(self, a, b)
        return ew(self.device, e, [a, b], BOOL if self.bool_out else a.dtype)


def declare(mixin: type, op: str, cpu: type, table: dict[str, str], **extra) -> type:
    """Register `mixin` over CPU class `cpu` for its versions, with expression `table`."""
    cls = type(f"{cpu.__name__}CL", (mixin, cpu),
               {"table": table, "dtypes": kinds_dtypes("".join(table)), **extra})
    return register(op, cpu.versions, backend="opencl")(cls)


_F = "f"
UNARY = {
    "Abs": {"f": "fabs(a)", "i": "abs(a)", "u": "a"},
    "Neg": {"fiu": "-a"},
    "Sign": {"f": "(isnan(a) ? a : (W)((a > 0) - (a < 0)))", "i": "(W)((a > 0) - (a < 0))",
             "u": "(W)(a > 0)"},
    "Ceil": {_F: "ceil(a)"}, "Floor": {_F: "floor(a)"}, "Round": {_F: "rint(a)"},
    "Reciprocal": {_F: "(W)1 / a"}, "Sqrt": {_F: "sqrt(a)"}, "Exp": {_F: "exp(a)"},
    "Log": {_F: "log(a)"}, "Erf": {_F: "erf(a)"}, "Tanh": {_F: "tanh(a)"},
    "Sin": {_F: "sin(a)"}, "Cos": {_F: "cos(a)"}, "Tan": {_F: "tan(a)"},
    "Asin": {_F: "asin(a)"}, "Acos": {_F: "acos(a)"}, "Atan": {_F: "atan(a)"},
    "Sinh": {_F: "sinh(a)"}, "Cosh": {_F: "cosh(a)"}, "Asinh": {_F: "asinh(a)"},
    "Acosh": {_F: "acosh(a)"}, "Atanh": {_F: "atanh(a)"},
    "BitwiseNot": {"iu": "~a"},
    "IsNaN": {_F: "isnan(a)"}, "Not": {"b": "!a"},
}
_BOOL_OUT = {"IsNaN", "Not", "Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual",
             "And", "Or", "Xor"}

BINARY = {
    "Add": {"fiu": "a + b"}, "Sub": {"fiu": "a - b"}, "Mul": {"fiu": "a * b"},
    "Div": {"f": "a / b", "i": "(b == 0 ? (W)0 : b == -1 ? (W)(-a) : (W)(a / b))",
            "u": "(b == 0 ? (W)0 : (W)(a / b))"},
    "BitwiseAnd": {"iu": "a & b"}, "BitwiseOr": {"iu": "a | b"}, "BitwiseXor": {"iu": "a ^ b"},
    "Equal": {"fiub": "a == b"}, "Greater": {"fiu": "a > b"}, "Less": {"fiu": "a < b"},
    "GreaterOrEqual": {"fiu": "a >= b"}, "LessOrEqual": {"fiu": "a <= b"},
    "And": {"b": "a && b"}, "Or": {"b": "a || b"}, "Xor": {"b": "a != b"},
}

for _op, _table in UNARY.items():
    declare(UnaryCL, _op, getattr(E, _op), _table, bool_out=_op in _BOOL_OUT)

for _op, _table in BINARY.items():
    for _cpu in (getattr(E, _op), getattr(E, _op + "1", None)):
        if _cpu is not None:
            declare(BinaryCL, _op, _cpu, _table, bool_out=_op in _BOOL_OUT)


@register("IsInf", versions=E.IsInf.versions, backend="opencl")
class IsInfCL(UnaryCL, E.IsInf):
    dtypes = _KIND_DTYPES["f"]
    bool_out = True

    def expr(self, dtype):
        if kind(dtype) != "f":
            return None
        if self.detect_positive and self.detect_negative:
            return "isinf(a)"
        if self.detect_positive or self.detect_negative:
            return f"(isinf(a) && a {'>' if self.detect_positive else '<'} 0)"
        return "0"


class PowCL:
    """Pow: the base's dtype out, any numeric exponent dtype."""
    dtypes = kinds_dtypes("fiu")

    def run(self, x, y):
        be = self.device
        if not on_device(be, x, y) or kind(x.dtype) not in "fiu" or kind(y.dtype) not in "fiu":
            return self.run_on_cpu(x, y)
        if isinstance(self, E.LegacyBinary):
            x, y = E._legacy_align(self, x, y)
        w = load_type(x.dtype)
        if kind(x.dtype) == "f":
            return ew(be, "pow(a, b)", [x, y], x.dtype, loads=(w, w))
        if kind(y.dtype) == "f":
            return ew(be, "(W)trunc(pow((double)a, (double)b))", [x, y], x.dtype,
                      loads=(w, "double"))
        return ew(be, "ipow(a, b)", [x, y], x.dtype, loads=(w, "long"))


register("Pow", E.Pow.versions, backend="opencl")(type("PowCL", (PowCL, E.Pow), {}))
register("Pow", E.Pow1.versions, backend="opencl")(type("Pow1CL", (PowCL, E.Pow1), {}))


@register("Mod", versions=E.Mod.versions, backend="opencl")
class ModCL(E.Mod):
    dtypes = kinds_dtypes("fiu")

    def run(self, a, b):
        if not on_device(self.device, a, b) or a.dtype != b.dtype or kind(a.dtype) not in "fiu":
            return self.run_on_cpu(a, b)
        if self.fmod:
            return ew(self.device, "fmod(a, b)" if kind(a.dtype) == "f" else "cmod(a, b)",
                      [a, b], a.dtype)
        return ew(self.device, "pymod(a, b)", [a, b], a.dtype)


@register("BitShift", versions=E.BitShift.versions, backend="opencl")
class BitShiftCL(E.BitShift):
    dtypes = kinds_dtypes("iu")

    def run(self, x, y):
        if not on_device(self.device, x, y) or x.dtype != y.dtype or kind(x.dtype) not in "iu":
            return self.run_on_cpu(x, y)
        bits = x.dtype.itemsize * 8
        signed = kind(x.dtype) == "i"
        outside = f"(b < 0 || b >= {bits})" if signed else f"(b >= {bits})"
        if self.left:
            e = f"({outside} ? (W)0 : (W)(a << b))"
        else:
            fill = "(a < 0 ? (W)-1 : (W)0)" if signed else "(W)0"
            e = f"({outside} ? {fill} : (W)(a >> b))"
        return ew(self.device, e, [x, y], x.dtype)


def _variadic(op: str, fold) -> type:
    class VariadicCL(getattr(E, op)):
        dtypes = kinds_dtypes("f" if op == "Mean" else "fiu")

        def run(self, *xs):
            xs = [x for x in xs if x is not None]
            if not xs or len(xs) > len(_NAMES) or not on_device(self.device, *xs) \
                    or any(x.dtype != xs[0].dtype for x in xs) or xs[0].dtype not in self.dtypes:
                return self.run_on_cpu(*xs)
            return ew(self.device, fold(list(_NAMES[:len(xs)]), xs[0].dtype == HALF), xs,
                      xs[0].dtype)

    VariadicCL.__name__ = VariadicCL.__qualname__ = f"{op}CL"
    return register(op, getattr(E, op).versions, backend="opencl")(VariadicCL)


def _fold_call(fn):
    def fold(names, half):
        e = names[0]
        for n in names[1:]:
            e = f"{fn}({e}, {n})"
        return e
    return fold


MaxCL = _variadic("Max", _fold_call("maxn"))
MinCL = _variadic("Min", _fold_call("minn"))
def _sum(names, half):
    """a + b + ...; float16 rounds each partial sum (numpy adds pairwise in float16)."""
    e = names[0]
    for n in names[1:]:
        e = f"rh({e} + {n})" if half and n != names[-1] else f"{e} + {n}"
    return e


SumCL = _variadic("Sum", _sum)
MeanCL = _variadic("Mean", lambda names, half: f"({' + '.join(names)}) / (W){len(names)}")


@register("Where", versions=E.Where.versions, backend="opencl")
class WhereCL(E.Where):
    dtypes = DEVICE_TYPES

    def run(self, condition, x, y):
        if not on_device(self.device, condition, x, y) or x.dtype != y.dtype \
                or condition.dtype != BOOL:
            return self.run_on_cpu(condition, x, y)
        return ew(self.device, "a ? b : c", [condition, x, y], x.dtype, work=load_type(x.dtype))


@register("Clip", versions=E.Clip1.versions, backend="opencl")
class Clip1CL(E.Clip1):
    dtypes = kinds_dtypes("fiu")

    def run(self, x):
        if not on_device(self.device, x) or kind(x.dtype) not in "fiu":
            return self.run_on_cpu(x)
        e = "a"
        if self.min is not None:
            e = f"maxn({e}, {lit(self.min)})"
        if self.max is not None:
            e = f"minn({e}, {lit(self.max)})"
        return ew(self.device, e, [x], x.dtype)


@register("Clip", versions=E.Clip.versions, backend="opencl")
class ClipCL(E.Clip):
    dtypes = kinds_dtypes("fiu")

    def run(self, x, lo=None, hi=None):
        bounds = [v for v in (lo, hi) if v is not None]
        if not on_device(self.device, x, *bounds) or kind(x.dtype) not in "fiu" \
                or any(v.size > 1 for v in bounds):
            return self.run_on_cpu(x, lo, hi)
        inputs, e, w = [x], "a", load_type(x.dtype)
        for v, fn in ((lo, "maxn"), (hi, "minn")):
            if v is not None and v.size:
                e = f"{fn}({e}, {_NAMES[len(inputs)]})"
                inputs.append(v.reshape(()))
        return ew(self.device, e, inputs, x.dtype, loads=[w] * len(inputs),
                  out_shape=tuple(x.shape))


class CastCL:
    """Numeric -> numeric conversion (C conversions; bool is `!= 0`; float16 rounds to even)."""
    dtypes = DEVICE_TYPES

    def cast(self, x, to, *rest):
        to = np.dtype(to)
        if not on_device(self.device, x) or to not in DEVICE_TYPES:
            return self.run_on_cpu(x, *rest)
        if x.dtype == to:
            return x
        return ew(self.device, "a", [x], to)


for _cpu in (T.Cast, T.Cast19, T.Cast24):
    register("Cast", _cpu.versions, backend="opencl")(type(
        f"{_cpu.__name__}CL", (CastCL, _cpu), {"run": lambda self, x: self.cast(x, self.dtype)}))

for _cpu in (T.CastLike, T.CastLike19, T.CastLike24):
    register("CastLike", _cpu.versions, backend="opencl")(type(
        f"{_cpu.__name__}CL", (CastCL, _cpu),
        {"run": lambda self, x, target: self.cast(x, target.dtype, target)}))

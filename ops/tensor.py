"""Tensor creation and casting: Cast, CastLike, BitCast, Constant, ConstantOfShape, EyeLike, Range,
Identity, Shape, Size, Trilu.

`cast_array` is the one conversion routine (every ONNX type pair, float8 saturation, float8e8m0
rounding, strings); other op families import it rather than calling `astype` on exotic types.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from onnx import TensorProto

from ember import limits
from ember.ops.registry import OpImpl, register

# --------------------------------------------------------------------------------------------
# dtypes


def _dt(name: str) -> np.dtype | None:
    kind = getattr(ml_dtypes, name, None)
    return np.dtype(kind) if kind is not None else None


BFLOAT16 = _dt("bfloat16")
FLOAT8E4M3FN = _dt("float8_e4m3fn")
FLOAT8E4M3FNUZ = _dt("float8_e4m3fnuz")
FLOAT8E5M2 = _dt("float8_e5m2")
FLOAT8E5M2FNUZ = _dt("float8_e5m2fnuz")
FLOAT8E8M0 = _dt("float8_e8m0fnu")
FLOAT4E2M1 = _dt("float4_e2m1fn")
FLOAT6E2M3 = _dt("float6_e2m3fn")
FLOAT6E3M2 = _dt("float6_e3m2fn")
INT4, UINT4, INT2, UINT2 = _dt("int4"), _dt("uint4"), _dt("int2"), _dt("uint2")
STRING = np.dtype(object)

# float8 kinds whose out-of-range values are governed by `saturate`
FLOAT8_SATURATING = frozenset(d for d in (FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ)
                              if d is not None)
# integer types narrower than a byte (ml_dtypes, kind 'V')
SUBBYTE_INTS = frozenset(d for d in (INT4, UINT4, INT2, UINT2) if d is not None)
# float types numpy does not know natively (ml_dtypes, kind 'V')
ML_FLOATS = frozenset(d for d in (BFLOAT16, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2,
                                  FLOAT8E5M2FNUZ, FLOAT8E8M0, FLOAT4E2M1, FLOAT6E2M3, FLOAT6E3M2)
                      if d is not None)

_CODE_TO_DTYPE: dict[int, np.dtype] = {
    TensorProto.FLOAT: np.dtype(np.float32), TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.INT8: np.dtype(np.int8), TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.INT16: np.dtype(np.int16), TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT64: np.dtype(np.int64), TensorProto.STRING: STRING,
    TensorProto.BOOL: np.dtype(np.bool_), TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.DOUBLE: np.dtype(np.float64), TensorProto.UINT32: np.dtype(np.uint32),
    TensorProto.UINT64: np.dtype(np.uint64), TensorProto.COMPLEX64: np.dtype(np.complex64),
    TensorProto.COMPLEX128: np.dtype(np.complex128),
}
for _name, _dtype in (("BFLOAT16", BFLOAT16), ("FLOAT8E4M3FN", FLOAT8E4M3FN),
                      ("FLOAT8E4M3FNUZ", FLOAT8E4M3FNUZ), ("FLOAT8E5M2", FLOAT8E5M2),
                      ("FLOAT8E5M2FNUZ", FLOAT8E5M2FNUZ), ("UINT4", UINT4), ("INT4", INT4),
                      ("FLOAT4E2M1", FLOAT4E2M1), ("FLOAT8E8M0", FLOAT8E8M0), ("UINT2", UINT2),
                      ("INT2", INT2), ("FLOAT6E2M3", FLOAT6E2M3), ("FLOAT6E3M2", FLOAT6E3M2)):
    _code = getattr(TensorProto, _name, None)
    if _code is not None and _dtype is not None:
        _CODE_TO_DTYPE[_code] = _dtype


def onnx_dtype(code: int | str) -> np.dtype:
    """The numpy dtype of an ONNX TensorProto element type (code, or name as in Cast-1's `to`).

    Raises ValueError for an unknown or undefined type."""
    if isinstance(code, str):
        name = code.strip().upper()
        aliases = {"FLOAT32": "FLOAT", "FLOAT64": "DOUBLE", "HALF": "FLOAT16"}
        name = aliases.get(name, name)
        if name.startswith("TENSOR(") and name.endswith(")"):
            name = name[7:-1]
        try:
            code = TensorProto.DataType.Value(name)
        except ValueError:
            raise ValueError(f"unknown tensor type name '{code}'") from None
    dtype = _CODE_TO_DTYPE.get(int(code))
    if dtype is None:
        raise ValueError(f"unsupported tensor element type {code}")
    return dtype


def is_string(dtype: np.dtype) -> bool:
    return dtype == STRING or dtype.kind in "US"


def is_intlike(dtype: np.dtype) -> bool:
    """Integers of any width (including int4/int2 and friends) and bool."""
    return dtype.kind in "iub" or dtype in SUBBYTE_INTS


def is_floatlike(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype in ML_FLOATS


# --------------------------------------------------------------------------------------------
# casting


def cast_array(xp, x, to, saturate: bool = True, round_mode: str = "up"):
    """`x` converted to dtype `to` with ONNX Cast semantics, over the array namespace `xp`
    (numpy, or cupy for device arrays; strings and ml_dtypes exist on the host only).

    - float8 (E4M3FN, E4M3FNUZ, E5M2, E5M2FNUZ): round to nearest even; with `saturate`, values
      beyond the largest finite value (infinities included) clamp to it, otherwise they become
      NaN/Inf as the format allows.
    - float8e8m0: `round_mode` "up", "down" or "nearest"; `saturate` clamps to the finite range.
    - fixed point to narrower fixed point keeps the low bits (two's complement wrap).
    - strings parse plain and scientific notation and NaN/INF/+INF/-INF (case-insensitive);
      numbers format as the shortest representation that round-trips.
    The input is never modified; the result may be the input itself when no conversion is needed.
    """
    x = xp.asarray(x)
    to = np.dtype(to)
    src = x.dtype
    if is_string(to):
        return x if src == STRING else _to_strings(x)
    if is_string(src):
        x = _from_strings(x, to)
        src = x.dtype
    if src == to:
        return x
    if src.kind == "c" and to.kind != "c":
        x = x.real  # ONNX keeps the real part
        src = x.dtype
    with np.errstate(all="ignore"):
        if to == FLOAT8E8M0:
            return _to_e8m0(xp, _as_float32(x), saturate, round_mode)
        if to in FLOAT8_SATURATING and saturate:
            if src.kind == "f":
                xf = x
            elif src.kind in "iu" and src.itemsize == 8:
                xf = x.astype(np.float64)
            else:
                xf = _as_float32(x)
            limit = float(ml_dtypes.finfo(to).max)
            return xp.clip(xf, -limit, limit).astype(to)
        if src in ML_FLOATS and to.kind in "iu":
            # through float32 so NaN/out-of-range behave as they do for float32 inputs
            x = x.astype(np.float32)
        if src == np.bool_ and to.kind not in "iub":
            # bool -> float kinds go through uint8 so every ml_dtypes kind gets {0, 1}
            x = x.astype(np.uint8)
        try:
            return x.astype(to)
        except (TypeError, ValueError):
            pass
        # ml_dtypes lacks some direct conversions (int4 <-> uint2, e8m0 <-> float8, ...)
        if is_intlike(src) and is_intlike(to):
            mid = np.int64
        elif src == np.float64:
            mid = np.float64
        else:
            mid = np.float32 if not is_intlike(src) else np.float64
        return x.astype(mid).astype(to)


def _as_float32(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.float32:
        return x
    try:
        return x.astype(np.float32)
    except (TypeError, ValueError):
        mid = np.int64 if is_intlike(x.dtype) else np.float64
        return x.astype(mid).astype(np.float32)


def _to_e8m0(xp, x, saturate: bool, round_mode: str):
    """float32 -> float8e8m0 (a bare biased exponent: 2**(e-127), 0xFF is NaN)."""
    if round_mode not in ("up", "down", "nearest"):
        raise ValueError(f"round_mode must be 'up', 'down' or 'nearest', got '{round_mode}'")
    bits = xp.array(x, dtype=np.float32, order="C").view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32)
    mantissa = bits & 0x7FFFFF
    nan = (exponent == 0xFF) & (mantissa != 0)
    inf = (exponent == 0xFF) & (mantissa == 0)
    if round_mode == "up":
        exponent = exponent + (mantissa != 0)
    elif round_mode == "nearest":
        guard = (mantissa & 0x400000) != 0
        rest = (mantissa & 0x3FFFFF) != 0
        # ties (exactly 1.5 * 2**e) go up except for subnormal inputs
        exponent = exponent + (guard & (rest | (exponent > 0)))
    overflow = (exponent > 0xFE) & ~nan & ~inf
    if saturate:
        exponent = xp.where(overflow | inf, 0xFE, exponent)
    else:
        exponent = xp.where(overflow | inf | (x == 0), 0xFF, exponent)
    exponent = xp.where(nan, 0xFF, exponent)
    return exponent.astype(np.uint8).view(FLOAT8E8M0)


def _to_strings(x: np.ndarray) -> np.ndarray:
    """Host only: cupy has no string arrays."""
    src = x.dtype
    if src in ML_FLOATS:
        x = x.astype(np.float32)
    elif src in SUBBYTE_INTS:
        x = x.astype(np.int64)
    return x.astype(np.str_).astype(object)  # elements become Python str


_SPECIAL_FLOATS = {"nan": math.nan, "+nan": math.nan, "-nan": math.nan,
                   "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
                   "infinity": math.inf, "+infinity": math.inf, "-infinity": -math.inf}


def _from_strings(x: np.ndarray, to: np.dtype) -> np.ndarray:
    """Strings parsed into float64, or int64 when the target is an integer type and every
    string is an integer literal (so large 64-bit values survive). Host only."""
    text = np.asarray(x, dtype=object).astype(np.str_)
    text = np.asarray(np.char.strip(text)).reshape(text.shape)
    if to == np.bool_:
        lowered = np.char.lower(text)
        numeric = _parse_floats(np.where((lowered == "true") | (lowered == "false"), "0", text))
        return np.where(lowered == "true", True, np.where(lowered == "false", False, numeric != 0))
    if is_intlike(to):
        try:
            return text.astype(np.int64) if to != np.uint64 else text.astype(np.uint64)
        except (ValueError, OverflowError):
            pass
    return _parse_floats(text)


def _parse_floats(text: np.ndarray) -> np.ndarray:
    try:
        return text.astype(np.float64)
    except ValueError:
        pass
    flat = text.reshape(-1)
    out = np.empty(flat.shape, dtype=np.float64)
    for i, s in enumerate(flat.tolist()):  # slow path: only for unusual spellings
        key = s.lower()
        if key in _SPECIAL_FLOATS:
            out[i] = _SPECIAL_FLOATS[key]
        else:
            try:
                out[i] = float(s)
            except ValueError:
                out[i] = math.nan  # undefined by the spec
    return out.reshape(text.shape)


# --------------------------------------------------------------------------------------------
# Cast, CastLike, BitCast


class _CastBase(OpImpl):
    def _target(self, to) -> np.dtype:
        try:
            return onnx_dtype(to)
        except (ValueError, TypeError) as exc:
            raise self.fail(f"attribute 'to': {exc}") from None


@register("Cast", versions=[1, 6, 9, 13])
class Cast(_CastBase):
    """Cast-1 names the type as a string; 6+ use the TensorProto code. No saturate attribute."""

    def setup(self):
        if self.to is None:
            raise self.fail("attribute 'to' is required")
        self.dtype = self._target(self.to)

    def run(self, x):
        return cast_array(self.xp, x, self.dtype)


@register("Cast", versions=[19, 21, 23])
class Cast19(Cast):
    def run(self, x):
        return cast_array(self.xp, x, self.dtype, saturate=bool(self.saturate))


@register("Cast", versions=[24, 25, 28])
class Cast24(Cast):
    def setup(self):
        super().setup()
        if self.round_mode not in ("up", "down", "nearest"):
            raise self.fail("round_mode must be 'up', 'down' or 'nearest', "
                            f"got '{self.round_mode}'")

    def run(self, x):
        return cast_array(self.xp, x, self.dtype, saturate=bool(self.saturate),
                          round_mode=self.round_mode)


@register("CastLike", versions=[15])
class CastLike(OpImpl):
    def run(self, x, target_type):
        return cast_array(self.xp, x, target_type.dtype)


@register("CastLike", versions=[19, 21, 23])
class CastLike19(OpImpl):
    def run(self, x, target_type):
        return cast_array(self.xp, x, target_type.dtype, saturate=bool(self.saturate))


@register("CastLike", versions=[24, 25])
class CastLike24(OpImpl):
    def run(self, x, target_type):
        return cast_array(self.xp, x, target_type.dtype, saturate=bool(self.saturate),
                          round_mode=self.round_mode)


_BIT_WIDTH_4 = frozenset(d for d in (INT4, UINT4, FLOAT4E2M1) if d is not None)
_BIT_WIDTH_2 = frozenset(d for d in (INT2, UINT2) if d is not None)


def _bit_width(dtype: np.dtype) -> int:
    if dtype in _BIT_WIDTH_4:
        return 4
    if dtype in _BIT_WIDTH_2:
        return 2
    if dtype in (FLOAT6E2M3, FLOAT6E3M2):
        return 6
    return dtype.itemsize * 8


@register("BitCast", versions=[26])
class BitCast(_CastBase):
    def setup(self):
        self.dtype = self._target(self.to)
        if self.dtype == STRING:
            raise self.fail("cannot bit-cast to string")

    def run(self, x):
        if x.dtype == STRING:
            raise self.fail("cannot bit-cast a string tensor")
        if _bit_width(x.dtype) != _bit_width(self.dtype):
            raise self.fail(f"BitCast needs equal bit widths: {x.dtype} is {_bit_width(x.dtype)} "
                            f"bits, {self.dtype} is {_bit_width(self.dtype)}")
        if self.dtype == x.dtype:
            return x
        if not x.flags.c_contiguous:
            x = x.copy(order="C")
        if x.dtype.byteorder == ">" or (x.dtype.byteorder == "=" and np.little_endian is False):
            x = x.astype(x.dtype.newbyteorder("<"))
        return x.view(self.dtype)


# --------------------------------------------------------------------------------------------
# Constants


def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.flags.writeable:
        a = a.copy()
        a.flags.writeable = False
    return a


@register("Constant", versions=[1, 9, 11, 12, 13, 19, 21, 23, 24, 25])
class Constant(OpImpl):
    _KINDS = ("value", "sparse_value", "value_float", "value_floats", "value_int", "value_ints",
              "value_string", "value_strings")

    def setup(self):
        given = [k for k in self._KINDS if getattr(self, k, None) is not None]
        if len(given) != 1:
            raise self.fail("exactly one of the value attributes must be given, got "
                            f"{', '.join(given) or 'none'}")
        kind = given[0]
        v = getattr(self, kind)
        if kind in ("value", "sparse_value"):
            value = np.asarray(v)
        elif kind == "value_float":
            value = np.array(v, dtype=np.float32)
        elif kind == "value_floats":
            value = np.array(v, dtype=np.float32).reshape(-1)
        elif kind == "value_int":
            value = np.array(v, dtype=np.int64)
        elif kind == "value_ints":
            value = np.array(v, dtype=np.int64).reshape(-1)
        elif kind == "value_string":
            value = np.empty((), dtype=object)
            value[()] = v
        else:
            value = np.empty(len(v), dtype=object)
            value[:] = list(v)
        self.value_array = _readonly(value)

    def run(self):
        return self.value_array


def _shape_from(shape, op: OpImpl) -> tuple[int, ...]:
    shape = np.asarray(shape)
    if shape.dtype.kind not in "iu":
        raise op.fail(f"shape input must be an integer tensor, got {shape.dtype}")
    dims = tuple(int(d) for d in shape.reshape(-1))
    if any(d < 0 for d in dims):
        raise op.fail(f"shape {list(dims)} has a negative dimension")
    return dims


@register("ConstantOfShape", versions=[9, 20, 21, 23, 24, 25])
class ConstantOfShape(OpImpl):
    shape_inputs = (0,)

    def setup(self):
        if self.value is None:
            self.fill = np.zeros((), dtype=np.float32)
        else:
            v = np.asarray(self.value)
            if v.size != 1:
                raise self.fail(f"attribute 'value' must hold one element, got {v.size}")
            self.fill = v.reshape(())

    def run(self, shape):
        dims = _shape_from(shape, self)
        limits.check_shape(dims, self.fill.dtype)  # the shape is data: checked before filling
        return self.xp.full(dims, self.fill[()], dtype=self.fill.dtype)


@register("EyeLike", versions=[9, 22])
class EyeLike(OpImpl):
    def setup(self):
        self.out_dtype = None
        if self.dtype is not None and self.dtype != 0:
            try:
                self.out_dtype = onnx_dtype(self.dtype)
            except ValueError as exc:
                raise self.fail(f"attribute 'dtype': {exc}") from None

    def run(self, x):
        xp = self.xp
        if x.ndim != 2:
            raise self.fail(f"input must be 2-D, got shape {x.shape}")
        dtype = self.out_dtype if self.out_dtype is not None else x.dtype
        n, m = x.shape
        eye = xp.eye(n, m, k=int(self.k), dtype=np.uint8)
        return cast_array(xp, eye, dtype) if dtype != np.uint8 else eye


# --------------------------------------------------------------------------------------------
# Range


def _scalar(v, name: str, op: OpImpl) -> np.ndarray:
    v = np.asarray(v)
    if v.size != 1:
        raise op.fail(f"input '{name}' must be a scalar, got shape {v.shape}")
    return v.reshape(())


@register("Range", versions=[11])
class Range(OpImpl):
    shape_inputs = (0, 1, 2)

    stash_float = True

    def run(self, start, limit, delta):
        # start, limit and delta are shape inputs (host arrays); the result is made with xp
        xp = self.xp
        start = _scalar(start, "start", self)
        limit = _scalar(limit, "limit", self)
        delta = _scalar(delta, "delta", self)
        dtype = start.dtype
        if is_intlike(dtype) and dtype != np.bool_:
            s, l, d = int(start), int(limit), int(delta)
            if d == 0:
                raise self.fail("delta must not be zero")
            n = max(-((s - l) // d), 0)  # ceil((l - s) / d) with exact integers
            limits.check_shape((n,), np.int64)
            return (s + xp.arange(n, dtype=np.int64) * d).astype(dtype)
        s, l, d = (float(np.asarray(v, dtype=np.float64)) for v in (start, limit, delta))
        if d == 0:
            raise self.fail("delta must not be zero")
        n = max(int(math.ceil((l - s) / d)), 0) if math.isfinite((l - s) / d) else 0
        limits.check_shape((n,), np.float64)
        if dtype in (np.float16, BFLOAT16) and not self.stash_float:
            # accumulate in the input type: out[i] = out[i-1] + delta, sequentially on the host
            # (the inputs are host scalars; a device scan would round in another order)
            steps = np.full(n, delta, dtype=dtype)
            if n:
                steps[0] = start
            return xp.asarray(np.add.accumulate(steps, dtype=dtype) if n else steps)
        work = np.float64 if dtype == np.float64 else np.float32
        out = work(s) + xp.arange(n, dtype=work) * work(d)
        return out.astype(dtype, copy=False)


@register("Range", versions=[27])
class Range27(Range):
    shape_inputs = (0, 1, 2)

    def setup(self):
        self.stash_float = self.stash_type == TensorProto.FLOAT


# --------------------------------------------------------------------------------------------
# Identity, Shape, Size


@register("Identity", versions=[1, 13, 14, 16, 19, 21, 23, 24, 25])
class Identity(OpImpl):
    def run(self, x):
        return x


@register("Shape", versions=[1, 13])
class Shape(OpImpl):
    def run(self, x):
        return np.array(np.shape(x), dtype=np.int64)


@register("Shape", versions=[15, 19, 21, 23, 24, 25])
class Shape15(OpImpl):
    def run(self, x):
        shape = np.shape(x)
        rank = len(shape)
        start = 0 if self.start is None else int(self.start)
        end = rank if self.end is None else int(self.end)
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        return np.array(shape[start:end], dtype=np.int64)


@register("Size", versions=[1, 13, 19, 21, 23, 24, 25])
class Size(OpImpl):
    def run(self, x):
        return np.array(np.size(x), dtype=np.int64)


# --------------------------------------------------------------------------------------------
# Trilu


@register("Trilu", versions=[14])
class Trilu(OpImpl):
    shape_inputs = (1,)

    def run(self, x, k=None):
        if x.ndim < 2:
            raise self.fail(f"input must have rank >= 2, got shape {x.shape}")
        xp = self.xp
        kk = 0 if k is None else int(_scalar(k, "k", self))  # k: a shape input (host)
        n, m = x.shape[-2:]
        rows = xp.arange(n)[:, None]
        cols = xp.arange(m)[None, :]
        keep = (cols - rows >= kk) if self.upper else (cols - rows <= kk)
        zero = xp.zeros((), dtype=x.dtype) if x.dtype != STRING else np.array("", dtype=object)
        return xp.where(keep, x, zero)

"""Linear quantisation: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear.

Scales and zero points are per-tensor (a scalar or one-element tensor), per-axis (1-D, one per
index of `axis`) or blocked (same rank as the input, `block_size` consecutive elements along
`axis` sharing one entry). Kernels compute over `xp = self.xp` (numpy, or cupy on CUDA).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ember.ops import _xp
from ember.ops._lowering import numba_serves
from ember.ops.cpu import qlinear as _qlinear
from ember.ops.cpu import tuning
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register
from ember.ops.tensor import (SUBBYTE_INTS, cast_array, is_floatlike, is_intlike, onnx_dtype)


def _int_range(dtype: np.dtype) -> tuple[int, int]:
    info = ml_dtypes.iinfo(dtype) if dtype in SUBBYTE_INTS else np.iinfo(dtype)
    return int(info.min), int(info.max)


class _LinearQuantBase(OpImpl):
    """Shared attribute handling and scale/zero-point broadcasting."""

    def setup(self):
        # attributes a version's schema lacks (axis before 13, ...) are absent: use their defaults
        axis = getattr(self, "axis", None)
        self.q_axis = 1 if axis is None else int(axis)
        self.q_block = int(getattr(self, "block_size", 0) or 0)
        if self.q_block < 0:
            raise self.fail(f"block_size must be >= 0, got {self.q_block}")
        code = getattr(self, "output_dtype", 0) or 0
        try:
            self.q_output_dtype = onnx_dtype(code) if code else None
        except ValueError as exc:
            raise self.fail(f"attribute 'output_dtype': {exc}") from None

    def lower(self, inputs):
        """`compiled_axis`'s test at plan time, where the input's shape is known."""
        x = inputs[0]
        zero_point = inputs[2] if len(inputs) > 2 else None
        if x is None or not self.compiled_types(x.dtype, inputs[1], zero_point) \
                or not numba_serves():
            return PORTABLE
        if not x.static():
            return _BY_SIZE
        return _COMPILED if math.prod(x.shape) >= tuning.QLINEAR_COMPILED_MIN else PORTABLE

    def compiled_types(self, x_dtype, scale, zero_point) -> bool:  # pragma: no cover
        raise NotImplementedError

    def compiled_axis(self, x, scale, zero_point, names):
        """Where the compiled loop serves this call (numpy arrays, the types
        `compiled_types` takes, large enough, not blocked): (axis, scale, zero point), the
        parameters flat (one value, or one per index of axis; axis None per tensor), the
        zero point float32 (0 if omitted). Else None. Sets the lowering the run chose;
        `names` name the parameters in messages."""
        self._chosen = PORTABLE
        if self.xp is not np or self.q_block or not _qlinear.serves(x.size) \
                or not self.compiled_types(x.dtype, scale, zero_point):
            return None
        scale = self._broadcast(scale, x.shape, names[0])   # checks the shapes
        zero = np.zeros((), np.float32) if zero_point is None else \
            self._broadcast(zero_point, x.shape, names[1]).astype(np.float32)
        axis = None
        if scale.ndim or zero.ndim:
            axis = self.q_axis + x.ndim if self.q_axis < 0 else self.q_axis
        self._chosen = _COMPILED
        return axis, scale.reshape(-1), zero.reshape(-1)

    def _broadcast(self, p: np.ndarray, x_shape: tuple[int, ...], what: str) -> np.ndarray:
        """`p` (a scale or zero point) reshaped/repeated to broadcast against the input."""
        xp = self.xp
        p = xp.asarray(p)
        rank = len(x_shape)
        if p.ndim == 0 or (p.ndim == 1 and p.size == 1 and self.q_block == 0):
            return p.reshape(())
        axis = self.q_axis + rank if self.q_axis < 0 else self.q_axis
        if not 0 <= axis < rank:
            raise self.fail(f"axis {self.q_axis} is out of range for input of rank {rank}")
        if self.q_block == 0:
            if p.ndim != 1 or p.shape[0] != x_shape[axis]:
                raise self.fail(f"{what} of shape {p.shape} does not match input dimension "
                                f"{x_shape[axis]} on axis {axis} (per-axis quantisation needs a "
                                "1-D tensor of that length)")
            shape = [1] * rank
            shape[axis] = p.shape[0]
            return p.reshape(shape)
        # blocked
        if p.ndim != rank:
            raise self.fail(f"blocked quantisation needs {what} of rank {rank}, "
                            f"got shape {p.shape}")
        for i in range(rank):
            if i != axis and p.shape[i] != x_shape[i]:
                raise self.fail(f"{what} of shape {p.shape} does not match input shape {x_shape} "
                                f"outside axis {axis}")
        blocks = -(-x_shape[axis] // self.q_block)
        if p.shape[axis] != blocks:
            raise self.fail(f"{what} has {p.shape[axis]} entries on axis {axis}; input dimension "
                            f"{x_shape[axis]} with block_size {self.q_block} needs {blocks}")
        full = xp.repeat(p, self.q_block, axis=axis)
        if full.shape[axis] != x_shape[axis]:
            full = xp.take(full, xp.arange(x_shape[axis]), axis=axis)
        return full


_COMPILED = Lowering("cpu.compiled", "8-bit (de)quantisation of float32 per tensor or axis, "
                     "one compiled pass split among the threads, numpy's bits")
_BY_SIZE = Lowering("by geometry", "a compiled pass where the tensor is large enough, else "
                    "numpy: its size is known in the run")

# --------------------------------------------------------------------------------------------
# QuantizeLinear


class QuantizeLinear(_LinearQuantBase):
    def setup(self):
        super().setup()
        saturate = getattr(self, "saturate", None)
        self.q_saturate = True if saturate is None else bool(saturate)
        code = getattr(self, "precision", 0) or 0
        try:
            self.q_precision = onnx_dtype(code) if code else None
        except ValueError as exc:
            raise self.fail(f"attribute 'precision': {exc}") from None

    def run(self, x, y_scale, y_zero_point=None):
        xp = self.xp
        if y_zero_point is not None:
            out_dtype = y_zero_point.dtype
            if self.q_output_dtype is not None and self.q_output_dtype != out_dtype:
                raise self.fail(f"output_dtype {self.q_output_dtype} differs from the zero "
                                f"point's type {out_dtype}")
        else:
            out_dtype = self.q_output_dtype if self.q_output_dtype is not None \
                else np.dtype(np.uint8)
        fast = self.compiled_axis(x, y_scale, y_zero_point, ("y_scale", "y_zero_point")) \
            if out_dtype in (np.int8, np.uint8) else None
        if fast is not None:   # NaN gives 0, as below
            return _qlinear.quantize(x, fast[1], fast[2], out_dtype, fast[0], False)

        prec = self.q_precision if self.q_precision is not None else y_scale.dtype
        if not is_floatlike(prec) or prec == ml_dtypes.float8_e8m0fnu:
            prec = np.dtype(np.float32)  # integer (or exponent-only) scales divide in float
        work = np.float64 if prec == np.float64 else np.float32

        scale = self._broadcast(cast_array(xp, y_scale, prec), x.shape, "y_scale")
        with np.errstate(all="ignore"):
            q = cast_array(xp, x, prec) / scale
            q = q.astype(work, copy=False)
            if y_zero_point is not None:
                zp = self._broadcast(cast_array(xp, y_zero_point, work), x.shape,
                                     "y_zero_point")
            else:
                zp = None

            if is_intlike(out_dtype):
                lo, hi = _int_range(out_dtype)
                q = xp.rint(q)
                if zp is not None:
                    q = q + zp
                q = xp.clip(q, lo, hi)
                q = xp.where(xp.isnan(q), 0, q)
                if out_dtype in SUBBYTE_INTS:
                    return q.astype(np.int8).astype(out_dtype)
                return q.astype(out_dtype)
            # float8 / float4 / float6 targets: round-to-nearest-even in the cast
            if zp is not None:
                q = q + zp
            return cast_array(xp, q, out_dtype, saturate=self.q_saturate)

    def compiled_types(self, x_dtype, scale, zero_point) -> bool:
        """float32 in, a float32 scale dividing in float32, int8 / uint8 out (the zero
        point's type, or uint8 without one and without output_dtype)."""
        out = zero_point.dtype if zero_point is not None else self.q_output_dtype
        return x_dtype == np.float32 and scale is not None and scale.dtype == np.float32 \
            and self.q_precision in (None, np.float32) and (out is None and zero_point is None
                                                            or out in (np.int8, np.uint8))


@register("QuantizeLinear", versions=[10, 13])
class QuantizeLinear10(QuantizeLinear):
    """uint8/int8 only, float32 scale (13 adds per-axis via `axis`)."""


@register("QuantizeLinear", versions=[19])
class QuantizeLinear19(QuantizeLinear):
    """Adds float8 outputs with `saturate`; the scale has the input's type."""


@register("QuantizeLinear", versions=[21, 23, 24, 25, 28])
class QuantizeLinear21(QuantizeLinear):
    """Adds blocked quantisation, output_dtype, 16/4/2-bit outputs (23: precision, float4;
    24: float8e8m0 scales; 25: 2-bit; 28: float6)."""


# --------------------------------------------------------------------------------------------
# DequantizeLinear


class DequantizeLinear(_LinearQuantBase):
    def run(self, x, x_scale, x_zero_point=None):
        xp = self.xp
        if self.q_output_dtype is not None:
            out_dtype = self.q_output_dtype
        elif x_scale.dtype in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16):
            out_dtype = x_scale.dtype
        else:
            out_dtype = np.dtype(np.float32)
        if x_zero_point is not None and x_zero_point.dtype != x.dtype:
            raise self.fail(f"x_zero_point has type {x_zero_point.dtype}, x has {x.dtype}")
        fast = self.compiled_axis(x, x_scale, x_zero_point, ("x_scale", "x_zero_point"))
        if fast is not None:
            return _qlinear.dequantize(x, fast[1], fast[2], fast[0])
        work = np.float64 if out_dtype == np.float64 else np.float32
        scale = self._broadcast(cast_array(xp, x_scale, work), x.shape, "x_scale")
        if is_intlike(x.dtype) and x.dtype.itemsize >= 4:
            # 32-bit: subtract exactly before rounding to float
            diff = cast_array(xp, x, np.int64)
            if x_zero_point is not None:
                diff = diff - self._broadcast(cast_array(xp, x_zero_point, np.int64), x.shape,
                                              "x_zero_point")
            diff = diff.astype(work)
        else:
            diff = cast_array(xp, x, work)
            if x_zero_point is not None:
                diff = diff - self._broadcast(cast_array(xp, x_zero_point, work), x.shape,
                                              "x_zero_point")
        with np.errstate(all="ignore"):
            y = diff * scale
        return cast_array(xp, y, out_dtype)

    def compiled_types(self, x_dtype, scale, zero_point) -> bool:
        """int8 / uint8 in, float32 out by a float32 scale."""
        return x_dtype in (np.int8, np.uint8) and scale is not None \
            and scale.dtype == np.float32 and self.q_output_dtype in (None, np.float32)


@register("DequantizeLinear", versions=[10, 13])
class DequantizeLinear10(DequantizeLinear):
    """int8/uint8/int32 inputs, float32 output."""


@register("DequantizeLinear", versions=[19])
class DequantizeLinear19(DequantizeLinear):
    """Adds float8 inputs; the output has the scale's type."""


@register("DequantizeLinear", versions=[21, 23, 24, 25, 28])
class DequantizeLinear21(DequantizeLinear):
    """Adds blocked dequantisation and 16/4-bit inputs (23: output_dtype, float4; 24: float8e8m0
    scales; 25: 2-bit; 28: float6)."""


# --------------------------------------------------------------------------------------------
# DynamicQuantizeLinear


@register("DynamicQuantizeLinear", versions=[11])
class DynamicQuantizeLinear(OpImpl):
    """uint8 quantisation with scale and zero point computed from the data range (0 included)."""

    def lower(self, inputs):
        x = inputs[0]
        if x is None or x.dtype != np.float32 or not numba_serves():
            return PORTABLE
        if not x.static():
            return _BY_SIZE
        return _DYNAMIC_COMPILED if math.prod(x.shape) >= tuning.QLINEAR_COMPILED_MIN \
            else PORTABLE

    def run(self, x):
        xp = self.xp
        self._chosen = PORTABLE
        x = cast_array(xp, x, np.float32)
        if x.size:  # the range is read on the host: the scale and zero point are scalars
            lo, hi = _xp.to_host(xp, xp.stack([xp.min(x), xp.max(x)]))
            x_min = np.minimum(np.float32(0), lo)
            x_max = np.maximum(np.float32(0), hi)
        else:
            x_min = x_max = np.float32(0)
        # an all-zero input gives scale 1 (as onnxruntime does) rather than a zero scale
        scale = np.float32((x_max - x_min) / np.float32(255)) if x_max != x_min else np.float32(1)
        with np.errstate(all="ignore"):
            if not np.isfinite(scale):
                zero_point = np.float32(0)
                q = xp.zeros(x.shape, dtype=np.float32)
            else:
                zero_point = np.clip(np.rint((np.float32(0) - x_min) / scale), 0, 255)
                y = self.compiled(x, scale, zero_point)
                if y is not None:
                    return y, xp.array(scale, dtype=np.float32), \
                        xp.array(zero_point, dtype=np.uint8)
                q = xp.rint(x / scale) + zero_point
        y = xp.clip(q, 0, 255).astype(np.uint8)
        return y, xp.array(scale, dtype=np.float32), xp.array(zero_point, dtype=np.uint8)

    def compiled(self, x, scale, zero_point):
        """y by the compiled loop where it serves, else None. Its scale is finite and
        positive, so x is finite (its range is) and no quotient is NaN: the loop's
        saturation is numpy's clip."""
        if self.xp is not np or not (scale > 0) or not np.isfinite(zero_point) \
                or not _qlinear.serves(x.size):
            return None
        self._chosen = _DYNAMIC_COMPILED
        return _qlinear.quantize(x, np.float32(scale), np.float32(zero_point), np.uint8, None,
                                 False)


_DYNAMIC_COMPILED = Lowering("cpu.compiled", "the range by numpy, the quantisation in one "
                             "compiled pass split among the threads, numpy's bits")

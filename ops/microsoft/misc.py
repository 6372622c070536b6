"""More of onnxruntime's contrib ops (the "com.microsoft" domain, version 1), with onnxruntime's
semantics (its schemas and docs/ContribOperators.md; its CPU kernels' measured behaviour where
the documentation is silent):

    FusedGemm(A, B, C?)             activation(alpha op(A) op(B) + beta C)
    TransposeMatMul(A, B)           the old name of FusedMatMul
    FusedMatMulActivation(A, B)     activation(FusedMatMul(A, B))
    GatherND, Range, Trilu, Pad, ExpandDims, Unique, GridSample
                                    aliases of ONNX-standard ops (ember's kernels, with the
                                    contrib schemas' inputs, attributes and defaults)
    Inverse(X)                      batched matrix inverse
    Rfft(X), Irfft(X)               one-sided real FFT and its inverse
    QLinearConv(x, ...)             QLinearConv, with channels_last
    QLinearWhere(cond, X, ...)      Where over quantized tensors, requantized
    QLinearReduceMean(data, ...)    ReduceMean over quantized data, requantized
    MulInteger(A, A_zp?, B, B_zp?)  (A - A_zp) * (B - B_zp) as int32
    ReduceSumInteger(data)          exact int32 sums of 8-bit data
    MatMulInteger16(A, B)           int16 matmul, exact, int32 result
    NhwcMaxPool(x)                  MaxPool over channels-last (int8/uint8) data
    NhwcConv(X, W, B?)              Conv over channels-last data and (M, k..., C/g) weights
    GroupNorm(X, gamma, beta), SkipGroupNorm(X, gamma, beta, skip, bias?)
                                    group normalisation (channels-last by default), SiLU option
    BiasDropout, BitmaskDropout, BitmaskBiasDropout
                                    inference mode only (training_mode absent or false)
    SwiGLU(gate, up?), ScaledSiLU(X, scale?)
    CDist(A, B)                     pairwise distances (sqeuclidean, euclidean)
    ComplexMul(A, B), ComplexMulConj(A, B)
    MaxpoolWithMask(X, M)           onnxruntime's internal masked MaxPool, reproduced
    RelativePositionBias, GatedRelativePositionBias
    WordConvEmbedding, IsAllFinite, MurmurHash3, NGramRepeatBlock, CropAndResize,
    BifurcationDetector, TorchEmbedding
    DecoderMaskedMultiHeadAttention one decoding step of MHA (shared-buffer caches, beams,
                                    cross attention)

Each op's class docstring says where its semantics come from. Attributes have the contrib
schemas' defaults (`defaults` on each class: these ops have no ONNX schema). Narrow floats
(float16, bfloat16) compute in float32 and are rounded once; integer arithmetic is exact, and
requantization rounds half to even and saturates, as onnxruntime does.
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops import _xp
from ember.ops._dtypes import is_narrow_float, widen
from ember.ops.microsoft.fused import FusedMatMul
from ember.ops.conv import Conv, QLinearConv as _QLinearConv, auto_pads, ints, out_size
from ember.ops.image import GridSample as _GridSample
from ember.ops.indexing import GatherND11, Unique as _Unique
from ember.ops.linalg import Gemm7
from ember.ops.pool import MaxPool
from ember.ops.registry import OpImpl, register
from ember.ops.shape import Pad11, Unsqueeze13
from ember.ops.tensor import Range as _Range, Trilu as _Trilu

MS = "com.microsoft"


def _str(value) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def _float_input(op: OpImpl, x, name: str = "input"):
    if x.dtype.kind != "f" and not is_narrow_float(x.dtype):
        raise op.fail(f"{name} must be a float tensor, got {x.dtype}")


# ----------------------------------------------------------------------------------------------
# activations fused into FusedGemm / FusedMatMulActivation: onnxruntime's
# ElementWiseRangedTransform functors, each with the parameters it requires (read from the
# node's activation_alpha / activation_beta / activation_gamma; onnxruntime has no defaults
# for them and refuses a node that lacks one)

_ACTIVATION_PARAMS = {
    "Relu": (), "Sigmoid": (), "Tanh": (), "Softsign": (), "Softplus": (),
    "LeakyRelu": ("alpha",), "Elu": ("alpha",), "ThresholdedRelu": ("alpha",),
    "HardSigmoid": ("alpha", "beta"), "Selu": ("alpha", "gamma"),
    "ParametricSoftplus": ("alpha", "beta"), "ScaledTanh": ("alpha", "beta"),
}


def _activation_setup(op: OpImpl, allow_none: bool):
    """(name, {param: value}) from the node's activation attributes."""
    name = _str(op.activation)
    if not name:
        if allow_none:
            return "", {}
        raise op.fail("the activation attribute is required")
    if name not in _ACTIVATION_PARAMS:
        raise op.fail(f"unsupported activation {name!r} (onnxruntime takes "
                      f"{', '.join(sorted(_ACTIVATION_PARAMS))})")
    params = {}
    for p in _ACTIVATION_PARAMS[name]:
        value = getattr(op, "activation_" + p)
        if value is None:
            raise op.fail(f"activation {name} needs the attribute activation_{p}")
        params[p] = float(value)
    return name, params


def _activate(xp, y, name: str, p: dict):
    """`name`(y) for a float32/float64 array y (a new array or y itself)."""
    t = y.dtype.type
    if name == "Relu":
        return xp.maximum(y, 0)
    if name == "Sigmoid":  # exp(-|y|) never overflows; e / (1 + e) keeps the negative tail
        e = xp.exp(-xp.abs(y))
        return xp.where(y >= 0, 1, e) / (1 + e)
    if name == "Tanh":
        return xp.tanh(y)
    if name == "Softsign":
        return y / (1 + xp.abs(y))
    if name == "Softplus":
        with np.errstate(over="ignore"):
            return xp.maximum(y, 0) + xp.log1p(xp.exp(-xp.abs(y)))
    if name == "LeakyRelu":
        return xp.where(y >= 0, y, y * t(p["alpha"]))
    if name == "Elu":
        return xp.where(y >= 0, y, t(p["alpha"]) * xp.expm1(xp.minimum(y, 0)))
    if name == "ThresholdedRelu":
        return xp.where(y > t(p["alpha"]), y, 0).astype(y.dtype, copy=False)
    if name == "HardSigmoid":
        return xp.clip(y * t(p["alpha"]) + t(p["beta"]), 0, 1)
    if name == "Selu":
        neg = t(p["alpha"]) * xp.expm1(xp.minimum(y, 0))
        return t(p["gamma"]) * xp.where(y > 0, y, neg)
    if name == "ParametricSoftplus":  # alpha ln(1 + exp(beta y))
        z = y * t(p["beta"])
        with np.errstate(over="ignore"):
            return t(p["alpha"]) * (xp.maximum(z, 0) + xp.log1p(xp.exp(-xp.abs(z))))
    if name == "ScaledTanh":  # alpha tanh(beta y)
        return t(p["alpha"]) * xp.tanh(y * t(p["beta"]))
    return y


# ----------------------------------------------------------------------------------------------
# products


@register("FusedGemm", versions=[1], domain=MS)
class FusedGemm(Gemm7):
    """activation(alpha op(A) @ op(B) + beta C): Gemm plus onnxruntime's fused activation
    (activation, with activation_alpha / _beta / _gamma as the activation's attributes). The
    product and the activation run in float32 for float16 data, rounded once. onnxruntime
    refuses a node without an activation (its CPU kernel knows no empty one); ember runs it as
    plain Gemm."""

    defaults = {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0, "activation": None,
                "activation_alpha": None, "activation_beta": None, "activation_gamma": None}

    def setup(self):
        super().setup()
        self.act, self.act_params = _activation_setup(self, allow_none=True)

    def run(self, a, b, c=None):
        _float_input(self, a, "A")
        y = super().run(widen(a), widen(b), None if c is None else widen(c))
        return _activate(self.xp, y, self.act, self.act_params).astype(a.dtype, copy=False)


@register("TransposeMatMul", versions=[1], domain=MS)
class TransposeMatMul(FusedMatMul):
    """FusedMatMul's old name (onnxruntime runs both with one kernel): alpha op(A) @ op(B),
    without the transBatch attributes."""

    defaults = {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0, "transBatchB": 0}


@register("FusedMatMulActivation", versions=[1], domain=MS)
class FusedMatMulActivation(FusedMatMul):
    """activation(FusedMatMul(A, B)); onnxruntime has no CPU kernel (its schema only): the
    activation is one of FusedGemm's (the required `activation` attribute, parameters in
    activation_alpha / _beta / _gamma). `activation_axis` is accepted and unused: no
    element-wise activation has an axis."""

    defaults = {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0, "transBatchB": 0,
                "activation": None, "activation_alpha": None, "activation_beta": None,
                "activation_gamma": None, "activation_axis": None}

    def setup(self):
        self.act, self.act_params = _activation_setup(self, allow_none=False)

    def run(self, a, b):
        y = super().run(widen(a), widen(b))
        return _activate(self.xp, y, self.act, self.act_params).astype(a.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# aliases of ONNX-standard ops


@register("GatherND", versions=[1], domain=MS)
class GatherND(GatherND11):
    """ONNX GatherND-11 (no batch_dims); negative indices count from the end."""


@register("Range", versions=[1], domain=MS)
class Range(_Range):
    """ONNX Range, with `delta` optional (default 1)."""

    shape_inputs = (0, 1, 2)

    def run(self, start, limit, delta=None):
        if delta is None:
            delta = np.ones((), np.asarray(start).dtype)
        return super().run(start, limit, delta)


@register("Trilu", versions=[1], domain=MS)
class Trilu(_Trilu):
    """ONNX Trilu-14."""

    shape_inputs = (1,)
    defaults = {"upper": 1}


@register("Pad", versions=[1], domain=MS)
class Pad(Pad11):
    """ONNX Pad-11: `pads` 1-D (2 * rank) or 2-D (1, 2 * rank), `value` a scalar or one-value
    tensor; modes constant, reflect, edge."""

    shape_inputs = (1, 2)
    defaults = {"mode": "constant"}

    def setup(self):
        self.mode = _str(self.mode)
        super().setup()

    def run(self, x, pads, value=None):
        pads = np.asarray(pads)
        if pads.ndim == 2 and pads.shape[0] != 1 or pads.ndim > 2:
            raise self.fail(f"pads must be 1-D or of shape (1, 2 * rank), got {pads.shape}")
        return super().run(x, pads.reshape(-1), value)


@register("ExpandDims", versions=[1], domain=MS)
class ExpandDims(Unsqueeze13):
    """Unsqueeze at one axis (a scalar or one-value int32 input; negative counts from the
    end of the output)."""

    shape_inputs = (1,)

    def run(self, x, axis):
        axis = np.asarray(axis).reshape(-1)
        if axis.size != 1:
            raise self.fail(f"axis must hold one value, got {axis.size}")
        return super().run(x, axis)


@register("Unique", versions=[1], domain=MS)
class Unique(_Unique):
    """The unique values of a 1-D input in order of first occurrence, the index of
    each input element among them, and their counts."""

    defaults = {"axis": None, "sorted": 0}

    def run(self, x):
        if x.ndim != 1:
            raise self.fail(f"the input must be 1-D (as onnxruntime requires), got shape "
                            f"{tuple(x.shape)}")
        y, _first, inverse, counts = super().run(x)
        return y, inverse, counts


@register("GridSample", versions=[1], domain=MS)
class GridSample(_GridSample):
    """ONNX GridSample-16: 4-D input, modes bilinear / nearest / bicubic."""

    defaults = {"align_corners": 0, "mode": "bilinear", "padding_mode": "zeros"}


# ----------------------------------------------------------------------------------------------
# linear algebra and FFTs


@register("Inverse", versions=[1], domain=MS)
class Inverse(OpImpl):
    """The inverse of each matrix in a batch (..., n, n); float16 inverts in float32 (as
    onnxruntime's Eigen kernel does), rounded once."""

    def run(self, x):
        _float_input(self, x, "X")
        if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
            raise self.fail(f"X must be a batch of square matrices, got shape {tuple(x.shape)}")
        try:
            y = self.xp.linalg.inv(widen(x))
        except np.linalg.LinAlgError as exc:
            raise self.fail(f"a matrix is not invertible ({exc})") from None
        return y.astype(x.dtype, copy=False)


class _FFT(OpImpl):
    defaults = {"onesided": 1, "normalized": 0, "signal_ndim": 1}

    def setup(self):
        self.signal_ndim = int(self.signal_ndim)
        if not 1 <= self.signal_ndim <= 3:
            raise self.fail(f"signal_ndim must be 1, 2 or 3, got {self.signal_ndim}")
        if int(self.normalized):
            raise self.fail("normalized must be 0 (onnxruntime supports no normalisation)")


@register("Rfft", versions=[1], domain=MS)
class Rfft(_FFT):
    """The unnormalised forward FFT of a real signal over the last `signal_ndim` axes, as
    onnxruntime's (CUDA-only) kernel computes it with cuFFT: (..., n) -> (..., n // 2 + 1, 2)
    with onesided (the default), (..., n, 2) without; the trailing axis holds the real and
    imaginary parts. Computed in float64 and rounded once to the input's type."""

    def run(self, x):
        _float_input(self, x, "X")
        if x.ndim < self.signal_ndim:
            raise self.fail(f"signal_ndim {self.signal_ndim} exceeds the input rank {x.ndim}")
        xp = self.xp
        axes = tuple(range(x.ndim - self.signal_ndim, x.ndim))
        w = x.astype(np.float64)
        y = xp.fft.rfftn(w, axes=axes) if int(self.onesided) else xp.fft.fftn(w, axes=axes)
        return xp.stack([y.real, y.imag], axis=-1).astype(x.dtype)


@register("Irfft", versions=[1], domain=MS)
class Irfft(_FFT):
    """The inverse of Rfft over the `signal_ndim` axes before the trailing (real, imaginary)
    axis, normalised by the signal size. As in onnxruntime's cuFFT kernel, a last signal axis
    of m complex values gives 2 m - 1 real values (the odd-length signal whose one-sided
    spectrum has m entries). Only onesided input is supported."""

    defaults = {"onesided": 1, "normalized": 0, "signal_ndim": None}

    def setup(self):
        if self.signal_ndim is None:
            raise self.fail("the signal_ndim attribute is required")
        super().setup()
        if not int(self.onesided):
            raise self.fail("onesided must be 1 (only one-sided inverse FFTs are supported)")

    def run(self, x):
        _float_input(self, x, "X")
        if x.ndim < self.signal_ndim + 1 or x.shape[-1] != 2:
            raise self.fail(f"X must have {self.signal_ndim} signal axes and a trailing axis of "
                            f"2 (real, imaginary), got shape {tuple(x.shape)}")
        xp = self.xp
        w = x.astype(np.float64)
        z = w[..., 0] + 1j * w[..., 1]
        axes = tuple(range(z.ndim - self.signal_ndim, z.ndim))
        sizes = [z.shape[a] for a in axes[:-1]] + [2 * z.shape[-1] - 1]
        return xp.fft.irfftn(z, s=sizes, axes=axes).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# integer and quantized ops

_INT8 = (np.dtype(np.int8), np.dtype(np.uint8))


def _per_tensor(op: OpImpl, xp, t, what, dtype, default=None):
    """A per-tensor scale / zero point (a scalar or one-value tensor) as a 0-d array of
    `dtype`; `default` where the optional input is omitted."""
    if t is None:
        if default is None:
            raise op.fail(f"input {what} is required")
        return xp.asarray(default, dtype=dtype)
    if t.size != 1:
        raise op.fail(f"{what} must be a scalar or hold one value, got shape {tuple(t.shape)}")
    return t.reshape(()).astype(dtype)


def _requantize(xp, v, scale, zero_point, dtype):
    """onnxruntime's (MLAS) quantisation of float32 values: round half to even of v / scale,
    plus the zero point, saturated to `dtype`."""
    info = np.iinfo(dtype)
    with np.errstate(all="ignore"):
        q = xp.rint(v / scale)
    q += zero_point.astype(np.float32)
    return xp.clip(q, info.min, info.max).astype(dtype)


def _check_int8(op: OpImpl, x, what):
    if x.dtype not in _INT8:
        raise op.fail(f"{what} must be int8 or uint8, got {x.dtype}")


def _channels_first(xp, x):
    return xp.moveaxis(x, -1, 1)


def _channels_last(xp, y):
    return xp.ascontiguousarray(xp.moveaxis(y, 1, -1))


@register("QLinearConv", versions=[1], domain=MS)
class QLinearConv(_QLinearConv):
    """ONNX QLinearConv, plus `channels_last` (x and y in N, spatial..., C layout; the
    weights stay M, C/group, k...): the form onnxruntime's NHWC transformer writes."""

    defaults = {"channels_last": 0, "group": 1, "auto_pad": "NOTSET", "pads": None,
                "strides": None, "dilations": None, "kernel_shape": None}

    def run(self, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
            B=None):
        _check_int8(self, x, "x")
        _check_int8(self, w, "w")
        xp = self.xp
        last = bool(int(self.channels_last))
        if last:
            x = _channels_first(xp, x)
        y = super().run(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale,
                        y_zero_point, B)
        return _channels_last(xp, y) if last else y


@register("QLinearWhere", versions=[1], domain=MS)
class QLinearWhere(OpImpl):
    """Where(condition, X, Y) over quantized X and Y, requantized to (z_scale, z_zero_point):
    each selected value v of X becomes quantize(x_scale (v - x_zero_point)) with Z's
    parameters (onnxruntime builds a 256-entry table of exactly that; the same parameters
    copy). X, Y and Z share one 8-bit type."""

    def run(self, condition, x, x_scale, x_zero_point, y, y_scale, y_zero_point, z_scale,
            z_zero_point):
        xp = self.xp
        _check_int8(self, x, "X")
        dtype = x.dtype
        for t, what in ((y, "Y"), (x_zero_point, "x_zero_point"),
                        (y_zero_point, "y_zero_point"), (z_zero_point, "z_zero_point")):
            if t.dtype != dtype:
                raise self.fail(f"{what} has type {t.dtype}, X has {dtype}")
        zs = _per_tensor(self, xp, z_scale, "z_scale", np.float32)
        zz = _per_tensor(self, xp, z_zero_point, "z_zero_point", np.int32)

        def requant(v, scale, zp, what):
            s = _per_tensor(self, xp, scale, what + "_scale", np.float32)
            z = _per_tensor(self, xp, zp, what + "_zero_point", np.int32)
            deq = (v.astype(np.int32) - z).astype(np.float32) * s
            return _requantize(xp, deq, zs, zz, dtype)

        return xp.where(condition.astype(bool), requant(x, x_scale, x_zero_point, "x"),
                        requant(y, y_scale, y_zero_point, "y"))


def _axes(op: OpImpl, axes, rank: int):
    if axes is None or len(axes) == 0:
        return tuple(range(rank))
    out = []
    for a in axes:
        a = int(a)
        if not -rank <= a < rank:
            raise op.fail(f"axis {a} is out of range for rank {rank}")
        out.append(a % rank)
    if len(set(out)) != len(out):
        raise op.fail(f"axes {list(axes)} repeat an axis")
    return tuple(sorted(out))


@register("QLinearReduceMean", versions=[1], domain=MS)
class QLinearReduceMean(OpImpl):
    """quantize(ReduceMean(dequantize(data))) with per-tensor parameters (zero points default
    to 0). onnxruntime has no CPU kernel; the documented formula is computed as the exact
    integer sum of data - zero_point (int64), times data_scale / count in float32, then
    rounded half to even onto the reduced parameters. `axes` and `keepdims` are required by
    the schema (an empty axes list reduces over every axis)."""

    defaults = {"axes": None, "keepdims": None}

    def setup(self):
        if self.axes is None or self.keepdims is None:
            raise self.fail("the attributes axes and keepdims are required")

    def run(self, data, data_scale, data_zero_point=None, reduced_scale=None,
            reduced_zero_point=None):
        xp = self.xp
        _check_int8(self, data, "data")
        axes = _axes(self, self.axes, data.ndim)
        ds = _per_tensor(self, xp, data_scale, "data_scale", np.float32)
        dz = _per_tensor(self, xp, data_zero_point, "data_zero_point", np.int64, 0)
        rs = _per_tensor(self, xp, reduced_scale, "reduced_scale", np.float32)
        rz = _per_tensor(self, xp, reduced_zero_point, "reduced_zero_point", np.int64, 0)
        count = math.prod(data.shape[a] for a in axes)
        total = xp.sum(data.astype(np.int64) - dz, axis=axes, keepdims=bool(self.keepdims))
        mean = total.astype(np.float64) * ds.astype(np.float64) / max(count, 1)
        return _requantize(xp, mean.astype(np.float32), rs, rz, data.dtype)


@register("MulInteger", versions=[1], domain=MS)
class MulInteger(OpImpl):
    """(A - A_zero_point) * (B - B_zero_point) as int32, with numpy broadcasting and
    per-tensor zero points (default 0). onnxruntime has no CPU kernel: exact integer
    arithmetic is the oracle."""

    def run(self, a, a_zero_point=None, b=None, b_zero_point=None):
        xp = self.xp
        if b is None:
            raise self.fail("input B is required")
        _check_int8(self, a, "A")
        if b.dtype != a.dtype:
            raise self.fail(f"B has type {b.dtype}, A has {a.dtype}")
        za = _per_tensor(self, xp, a_zero_point, "A_zero_point", np.int32, 0)
        zb = _per_tensor(self, xp, b_zero_point, "B_zero_point", np.int32, 0)
        try:
            return (a.astype(np.int32) - za) * (b.astype(np.int32) - zb)
        except ValueError as exc:
            raise self.fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)}: {exc}") from None


@register("ReduceSumInteger", versions=[1], domain=MS)
class ReduceSumInteger(OpImpl):
    """The exact sum of 8-bit data over `axes` (required; empty: every axis), as int32."""

    defaults = {"axes": None, "keepdims": None}

    def setup(self):
        if self.axes is None or self.keepdims is None:
            raise self.fail("the attributes axes and keepdims are required")

    def run(self, data):
        _check_int8(self, data, "data")
        axes = _axes(self, self.axes, data.ndim)
        total = self.xp.sum(data.astype(np.int64), axis=axes, keepdims=bool(self.keepdims))
        return total.astype(np.int32)


@register("MatMulInteger16", versions=[1], domain=MS)
class MatMulInteger16(OpImpl):
    """A @ B of 16-bit integers with numpy matmul broadcasting, exact in int64 and wrapped to
    32 bits: int32 unless both operands are uint16 (then uint32)."""

    def run(self, a, b):
        for t, what in ((a, "A"), (b, "B")):
            if t.dtype not in (np.int16, np.uint16):
                raise self.fail(f"{what} must be int16 or uint16, got {t.dtype}")
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise self.fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)} are not aligned")
        out = np.uint32 if a.dtype == np.uint16 and b.dtype == np.uint16 else np.int32
        try:
            y = self.xp.matmul(a.astype(np.int64), b.astype(np.int64))
        except ValueError as exc:
            raise self.fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)}: {exc}") from None
        return y.astype(out)


# ----------------------------------------------------------------------------------------------
# channels-last convolution and pooling


@register("NhwcMaxPool", versions=[1], domain=MS)
class NhwcMaxPool(MaxPool):
    """MaxPool over (N, spatial..., C) int8 / uint8 data (onnxruntime's NHWC kernel); the
    result is channels-last too."""

    defaults = {"kernel_shape": None, "auto_pad": "NOTSET", "pads": None, "strides": None,
                "dilations": None, "ceil_mode": 0, "storage_order": 0}

    def setup(self):
        if self.kernel_shape is None:
            raise self.fail("the kernel_shape attribute is required")

    def run(self, x):
        _check_int8(self, x, "x")
        xp = self.xp
        return _channels_last(xp, super().run(_channels_first(xp, x)))


@register("NhwcConv", versions=[1], domain=MS)
class NhwcConv(Conv):
    """Conv over channels-last data: X (N, spatial..., C), W (M, k..., C/group) (the layout
    onnxruntime's fusion_nhwc_conv writes and its CUDA kernel reads), Y (N, spatial..., M).
    onnxruntime has no CPU kernel: the oracle is Transpose + Conv + Transpose."""

    defaults = {"group": 1, "auto_pad": "NOTSET", "pads": None, "strides": None,
                "dilations": None, "kernel_shape": None}

    def run(self, x, w, b=None):
        _float_input(self, x, "X")
        xp = self.xp
        if w.ndim != x.ndim:
            raise self.fail(f"W rank {w.ndim} does not match X rank {x.ndim}")
        wc = self.cached_weight(w, lambda a: xp.ascontiguousarray(_channels_first(xp, a)))
        y = super().run(_channels_first(xp, x), wc, b)
        return _channels_last(xp, y)


# ----------------------------------------------------------------------------------------------
# group normalisation


def _silu(xp, y):
    with np.errstate(over="ignore"):
        return y / (1 + xp.exp(-y))


class _GroupNormBase(OpImpl):
    defaults = {"epsilon": 1e-5, "groups": None, "activation": None, "channels_last": 1}

    def setup(self):
        if self.groups is None or self.activation is None:
            raise self.fail("the attributes groups and activation are required")
        self.groups = int(self.groups)
        self.activation = int(self.activation)
        if self.groups < 1:
            raise self.fail(f"groups must be positive, got {self.groups}")
        if self.activation not in (0, 1):
            raise self.fail(f"activation must be 0 (none) or 1 (SiLU), got {self.activation}")
        self.last = bool(int(self.channels_last))

    def normalize(self, s, gamma, beta, dtype):
        """Group-normalise the float32 (float64) sum `s` in its own layout; -> dtype."""
        xp = self.xp
        if s.ndim < 2:
            raise self.fail(f"X must have rank >= 2, got shape {tuple(s.shape)}")
        c = s.shape[-1] if self.last else s.shape[1]
        if c % self.groups:
            raise self.fail(f"{c} channels do not divide into {self.groups} groups")
        for t, what in ((gamma, "gamma"), (beta, "beta")):
            if t.size != c:
                raise self.fail(f"{what} has {t.size} values for {c} channels")
        n = s.shape[0]
        g = self.groups
        if self.last:  # (N, spatial..., C) -> (N, L, G, C/G): statistics over L and C/G
            v = s.reshape(n, -1, g, c // g)
            axes = (1, 3)
            shape = (1,) * (s.ndim - 1) + (c,)
        else:  # (N, C, spatial...) -> (N, G, C/G * L)
            v = s.reshape(n, g, -1)
            axes = (2,)
            shape = (1, c) + (1,) * (s.ndim - 2)
        mean = xp.mean(v, axis=axes, keepdims=True)
        d = v - mean
        var = xp.mean(d * d, axis=axes, keepdims=True)
        d *= 1 / xp.sqrt(var + s.dtype.type(np.float32(self.epsilon)))
        y = d.reshape(s.shape)
        y *= widen(gamma).reshape(shape).astype(s.dtype, copy=False)
        y += widen(beta).reshape(shape).astype(s.dtype, copy=False)
        if self.activation == 1:
            y = _silu(xp, y)
        return y.astype(dtype, copy=False)


@register("GroupNorm", versions=[1], domain=MS)
class GroupNorm(_GroupNormBase):
    """Group normalisation of X (channels-last by default: N, spatial..., C) with per-channel
    gamma and beta, then SiLU when activation = 1. onnxruntime has no CPU kernel (CUDA only);
    the statistics are the biased mean and variance over each group, in float32 for float16
    data, rounded once."""

    def run(self, x, gamma, beta):
        _float_input(self, x, "X")
        return self.normalize(widen(x), gamma, beta, x.dtype)


@register("SkipGroupNorm", versions=[1], domain=MS)
class SkipGroupNorm(_GroupNormBase):
    """GroupNorm of s = X + skip + bias, also returning s (output S). skip has X's shape, or
    (N, C) / (N, 1.., C) broadcast over the spatial axes; bias has C values. onnxruntime has no
    CPU kernel (CUDA only)."""

    def run(self, x, gamma, beta, skip, bias=None):
        _float_input(self, x, "X")
        xp = self.xp
        s = widen(x)
        c = x.shape[-1] if self.last else x.shape[1]
        if tuple(skip.shape) == tuple(x.shape):
            sk = widen(skip)
        elif skip.size == x.shape[0] * c and skip.shape[0] == x.shape[0]:
            shape = ((x.shape[0],) + (1,) * (x.ndim - 2) + (c,) if self.last
                     else (x.shape[0], c) + (1,) * (x.ndim - 2))
            sk = widen(skip).reshape(shape)
        else:
            raise self.fail(f"skip has shape {tuple(skip.shape)}; X has {tuple(x.shape)}")
        s = s + sk.astype(s.dtype, copy=False)
        if bias is not None:
            if bias.size != c:
                raise self.fail(f"bias has {bias.size} values for {c} channels")
            shape = (1,) * (x.ndim - 1) + (c,) if self.last else (1, c) + (1,) * (x.ndim - 2)
            s += widen(bias).reshape(shape).astype(s.dtype, copy=False)
        y = self.normalize(s, gamma, beta, x.dtype)
        return y, xp.asarray(s).astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# dropouts, in inference mode


class _InferenceDropout(OpImpl):
    defaults = {"seed": None}
    ratio_index = 1  # input indices of ratio and training_mode (relative to run's arguments)

    def check_inference(self, ratio, training_mode):
        if training_mode is None:
            return
        train = bool(_xp.to_host(self.xp, training_mode).reshape(-1)[0])
        if not train:
            return
        r = 0.5 if ratio is None else float(_xp.to_host(self.xp, ratio).reshape(-1)[0])
        if not 0.0 <= r < 1.0:
            raise self.fail(f"ratio {r} is outside [0, 1)")
        if r != 0.0:
            raise self.fail("training mode (random dropout) is not supported: ember runs "
                            "dropout in inference mode only")

    def biased(self, data, bias, residual):
        """data + bias (+ residual), in float32 for narrow floats, rounded once."""
        _float_input(self, data, "data")
        if tuple(bias.shape) != tuple(data.shape) and (
                bias.ndim != 1 or data.ndim == 0 or bias.shape[0] != data.shape[-1]):
            raise self.fail(f"bias has shape {tuple(bias.shape)}: it must be 1-D of the last "
                            f"dimension of data {tuple(data.shape)}, or data's shape")
        y = widen(data) + widen(bias)
        if residual is not None:
            if tuple(residual.shape) != tuple(data.shape):
                raise self.fail(f"residual has shape {tuple(residual.shape)}, data "
                                f"{tuple(data.shape)}")
            y += widen(residual)
        return y.astype(data.dtype, copy=False)

    def bitmask(self, n: int, full_words: bool):
        """The bit-packed keep-everything mask of n elements: ceil(n / 32) uint32 words. With
        `full_words` every bit is set (BitmaskDropout memsets the words), else only the n
        elements' bits (BitmaskBiasDropout's kernel sets one bit per element)."""
        xp = self.xp
        words = -(-n // 32)
        mask = xp.full((words,), 0xFFFFFFFF, dtype=np.uint32)
        if not full_words and n % 32:
            mask[-1] = np.uint32((1 << (n % 32)) - 1)
        return mask


@register("BiasDropout", versions=[1], domain=MS)
class BiasDropout(_InferenceDropout):
    """Dropout(data + bias) + residual in inference mode (training_mode absent or false, or
    ratio 0): output = data + bias + residual, mask all true. Training mode is refused."""

    def run(self, data, bias, residual=None, ratio=None, training_mode=None):
        self.check_inference(ratio, training_mode)
        y = self.biased(data, bias, residual)
        return y, self.xp.ones(data.shape, dtype=bool)


@register("BitmaskBiasDropout", versions=[1], domain=MS)
class BitmaskBiasDropout(_InferenceDropout):
    """BiasDropout with the mask bit-packed into ceil(n / 32) uint32 words (one bit per
    element, set: kept; the bits past the last element are 0)."""

    def run(self, data, bias, residual=None, ratio=None, training_mode=None):
        self.check_inference(ratio, training_mode)
        y = self.biased(data, bias, residual)
        return y, self.bitmask(int(math.prod(data.shape)), full_words=False)


@register("BitmaskDropout", versions=[1], domain=MS)
class BitmaskDropout(_InferenceDropout):
    """Dropout in inference mode: output = data, mask ceil(n / 32) uint32 words of all ones
    (onnxruntime memsets the whole words, the bits past the last element included)."""

    def run(self, data, ratio=None, training_mode=None):
        _float_input(self, data, "data")
        self.check_inference(ratio, training_mode)
        return data.copy(), self.bitmask(int(math.prod(data.shape)), full_words=True)


# ----------------------------------------------------------------------------------------------
# gated activations


@register("SwiGLU", versions=[1], domain=MS)
class SwiGLU(OpImpl):
    """Clamped SwiGLU, as onnxruntime's schema documents it (it has no CPU kernel):
    G = min(gate, limit), L = clip(up, -limit, limit) (no clamps when limit <= 0),
    output = G sigmoid(activation_alpha G) (L + activation_beta). Without `up`, gate holds
    both halves of its last axis (gate first). The arithmetic is float32, rounded once to T
    (with round_activation, G sigmoid(alpha G) is rounded to T first); where alpha G is
    below -87, G sigmoid(alpha G) = sign(G) exp(alpha G + log|G|), which float32 exp would
    underflow."""

    defaults = {"activation_alpha": 1.0, "activation_beta": 0.0, "limit": 0.0,
                "round_activation": 0}

    def run(self, gate, up=None):
        _float_input(self, gate, "gate")
        xp = self.xp
        dtype = gate.dtype
        g = widen(gate).astype(np.float32, copy=False)
        if up is None:
            d = gate.shape[-1] if gate.ndim else 0
            if d % 2:
                raise self.fail(f"without `up`, gate's last dimension ({d}) must be even")
            g, u = g[..., :d // 2], g[..., d // 2:]
        else:
            if tuple(up.shape) != tuple(gate.shape):
                raise self.fail(f"up has shape {tuple(up.shape)}, gate {tuple(gate.shape)}")
            u = widen(up).astype(np.float32, copy=False)
        limit = float(self.limit)
        if limit > 0:
            g = xp.minimum(g, np.float32(limit))
            u = xp.clip(u, np.float32(-limit), np.float32(limit))
        z = g * np.float32(self.activation_alpha)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            act = g / (1 + xp.exp(-z))
            tail = xp.sign(g) * xp.exp(z + xp.log(xp.abs(g)))
        act = xp.where(z < -87, tail, act)
        if int(self.round_activation):
            act = act.astype(dtype).astype(np.float32)
        beta = float(self.activation_beta)
        if beta != 0.0:
            u = u + np.float32(beta)
        return (act * u).astype(dtype, copy=False)


@register("ScaledSiLU", versions=[1], domain=MS)
class ScaledSiLU(OpImpl):
    """Z = T(s X), S = T(sigmoid(Z)), Y = T(Z S), each step computed in float32 and rounded
    to T as the schema prescribes (onnxruntime's CPU kernel); s is the scalar input when
    given, else alpha."""

    defaults = {"alpha": 1.0}

    def run(self, x, scale=None):
        _float_input(self, x, "X")
        xp = self.xp
        dtype = x.dtype
        if scale is None:
            s = xp.asarray(np.float32(self.alpha))
        else:
            if scale.ndim != 0:
                raise self.fail(f"scale must be a 0-D scalar (as onnxruntime requires), got "
                                f"shape {tuple(scale.shape)}")
            s = widen(scale).reshape(()).astype(np.float32)
        z = (widen(x).astype(np.float32, copy=False) * s).astype(dtype).astype(np.float32)
        e = xp.exp(-xp.abs(z))  # the sigmoid of |z|, mirrored for negative z
        sig = xp.where(z >= 0, 1 / (1 + e), e / (1 + e)).astype(dtype).astype(np.float32)
        return (z * sig).astype(dtype)


# ----------------------------------------------------------------------------------------------
# distances and complex products


@register("CDist", versions=[1], domain=MS)
class CDist(OpImpl):
    """Pairwise distances between the rows of A (M, K) and B (N, K): metric sqeuclidean (the
    default) or euclidean (the two onnxruntime's CPU kernel implements). float32 runs in
    float64, rounded once."""

    defaults = {"metric": "sqeuclidean"}

    def setup(self):
        self.metric = _str(self.metric)
        if self.metric not in ("sqeuclidean", "euclidean"):
            raise self.fail(f"unsupported metric {self.metric!r} (sqeuclidean, euclidean)")

    def run(self, a, b):
        _float_input(self, a, "A")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
            raise self.fail(f"A and B must be 2-D with equal columns, got {tuple(a.shape)} "
                            f"and {tuple(b.shape)}")
        xp = self.xp
        wa, wb = a.astype(np.float64), b.astype(np.float64)
        d = xp.sum(wa * wa, axis=1)[:, None] + xp.sum(wb * wb, axis=1)[None, :]
        d -= 2 * (wa @ wb.T)
        xp.maximum(d, 0, out=d)
        if self.metric == "euclidean":
            xp.sqrt(d, out=d)
        return d.astype(a.dtype)


class _ComplexProduct(OpImpl):
    conjugate = False

    def run(self, a, b):
        _float_input(self, a, "A")
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != 2 or b.shape[-1] != 2:
            raise self.fail(f"A and B must end in an axis of 2 (real, imaginary), got "
                            f"{tuple(a.shape)} and {tuple(b.shape)}")
        xp = self.xp
        wa, wb = widen(a), widen(b)
        ar, ai, br, bi = wa[..., 0], wa[..., 1], wb[..., 0], wb[..., 1]
        if self.conjugate:
            bi = -bi
        try:
            out = xp.stack([ar * br - ai * bi, ar * bi + ai * br], axis=-1)
        except ValueError as exc:
            raise self.fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)}: {exc}") from None
        return out.astype(a.dtype, copy=False)


@register("ComplexMul", versions=[1], domain=MS)
class ComplexMul(_ComplexProduct):
    """A * B of complex numbers stored as (..., 2) real / imaginary pairs, with numpy
    broadcasting of the leading axes (onnxruntime: CUDA only)."""


@register("ComplexMulConj", versions=[1], domain=MS)
class ComplexMulConj(_ComplexProduct):
    """A * conj(B) of complex numbers stored as (..., 2) pairs (onnxruntime: CUDA only)."""

    conjugate = True


# ----------------------------------------------------------------------------------------------
# relative position biases


@register("RelativePositionBias", versions=[1], domain=MS)
class RelativePositionBias(OpImpl):
    """T5's bucketed relative position bias, as onnxruntime's CUDA kernel computes it: for
    query i and key j, r = j - i; bidirectional: half the buckets each for r > 0 and r <= 0
    (|r|), else r > 0 counts as 0 and r <= 0 as -r; positions under max_exact = buckets / 2
    are exact, larger ones log-spaced up to max_distance (float32 logs, truncated). The bias
    table (num_buckets, num_heads) is read column-major (head h, bucket k at h * num_buckets
    + k), as onnxruntime does. query_length must equal key_length."""

    shape_inputs = (1, 2)
    defaults = {"is_bidirectional": 0, "max_distance": None}

    def setup(self):
        if self.max_distance is None or int(self.max_distance) <= 0:
            raise self.fail("max_distance is required and must be positive")
        self.max_distance = int(self.max_distance)

    def run(self, bias_table, query_length, key_length):
        xp = self.xp
        _float_input(self, bias_table, "bias_table")
        if bias_table.ndim != 2:
            raise self.fail(f"bias_table must be 2-D, got shape {tuple(bias_table.shape)}")
        q = int(np.asarray(query_length).reshape(-1)[0])
        k = int(np.asarray(key_length).reshape(-1)[0])
        if q != k:
            raise self.fail(f"query_length {q} must equal key_length {k} (self attention)")
        buckets, heads = bias_table.shape
        rel = np.arange(k)[None, :] - np.arange(q)[:, None]  # host index arithmetic
        base = np.zeros_like(rel)
        nb = buckets
        if int(self.is_bidirectional):
            nb //= 2
            base = np.where(rel > 0, nb, 0)
            n = np.abs(rel)
        else:
            n = np.where(rel > 0, 0, -rel)
        max_exact = nb // 2
        with np.errstate(divide="ignore", invalid="ignore"):
            large = (np.log(n.astype(np.float32) / np.float32(max_exact))
                     / np.log(np.float32(self.max_distance) / np.float32(max_exact))
                     * np.float32(nb - max_exact))
        large = max_exact + np.nan_to_num(large, nan=0, neginf=0).astype(np.int64)
        large = np.minimum(large, nb - 1)
        bucket = base + np.where(n < max_exact, n, large)
        index = np.arange(heads)[:, None, None] * buckets + bucket[None]
        flat = xp.reshape(bias_table, (-1,))
        return xp.take(flat, xp.asarray(index.reshape(-1))).reshape(1, heads, q, k)


@register("GatedRelativePositionBias", versions=[1], domain=MS)
class GatedRelativePositionBias(OpImpl):
    """The gated relative position bias of (TuLR-style) models, as onnxruntime's CUDA kernel
    computes it: q = (query_layer + query_bias) split into heads (B, H, S, head_size),
    v = q @ weight + bias (B, H, S, D), u and r the sigmoids of the sums of v's two halves,
    gate = u (r eco_a - 1) + 2, output = gate * rel_pos (B, H, S, S). Float32 arithmetic,
    rounded once. The packed form (token_offset) is not supported."""

    defaults = {"num_heads": None}

    def setup(self):
        if self.num_heads is None or int(self.num_heads) <= 0:
            raise self.fail("num_heads is required and must be positive")
        self.num_heads = int(self.num_heads)

    def run(self, query_layer, query_bias, rel_pos, weight, bias, eco_a, token_offset=None):
        xp = self.xp
        _float_input(self, query_layer, "query_layer")
        if token_offset is not None:
            raise self.fail("the packed form (token_offset) is not supported")
        if query_layer.ndim != 3 or query_layer.shape[2] % self.num_heads:
            raise self.fail(f"query_layer must be (batch, seq, num_heads * head_size), got "
                            f"{tuple(query_layer.shape)}")
        b, s, hidden = query_layer.shape
        h = self.num_heads
        hs = hidden // h
        if tuple(query_bias.shape) != (hidden,):
            raise self.fail(f"query_bias must have shape ({hidden},)")
        if tuple(rel_pos.shape) != (1, h, s, s):
            raise self.fail(f"rel_pos must have shape (1, {h}, {s}, {s}), got "
                            f"{tuple(rel_pos.shape)}")
        if weight.ndim != 2 or weight.shape[0] != hs or weight.shape[1] % 2 \
                or weight.shape[1] == 0:
            raise self.fail(f"weight must be ({hs}, D) with D even, got {tuple(weight.shape)}")
        d = weight.shape[1]
        if tuple(bias.shape) != (d,):
            raise self.fail(f"bias must have shape ({d},)")
        if tuple(eco_a.shape) != (1, h, 1, 1):
            raise self.fail(f"eco_a must have shape (1, {h}, 1, 1), got {tuple(eco_a.shape)}")
        f32 = np.float32
        q = (widen(query_layer).astype(f32) + widen(query_bias).astype(f32))
        q = q.reshape(b, s, h, hs).transpose(0, 2, 1, 3)
        v = xp.matmul(q, widen(weight).astype(f32)) + widen(bias).astype(f32)
        with np.errstate(over="ignore"):
            u = 1 / (1 + xp.exp(-xp.sum(v[..., :d // 2], axis=-1, keepdims=True)))
            r = 1 / (1 + xp.exp(-xp.sum(v[..., d // 2:], axis=-1, keepdims=True)))
        gate = u * (r * widen(eco_a).astype(f32) - 1) + 2
        return (gate * widen(rel_pos).astype(f32)).astype(query_layer.dtype)


# ----------------------------------------------------------------------------------------------
# small utilities


@register("IsAllFinite", versions=[1], domain=MS)
class IsAllFinite(OpImpl):
    """A bool scalar: whether every input is free of Inf and NaN (isinf_only: of Inf;
    isnan_only: of NaN)."""

    defaults = {"isinf_only": 0, "isnan_only": 0}

    def setup(self):
        if int(self.isinf_only) and int(self.isnan_only):
            raise self.fail("isinf_only and isnan_only cannot both be set")

    def run(self, *inputs):
        xp = self.xp
        ok = xp.asarray(True)
        for x in inputs:
            if x is None:
                continue
            _float_input(self, x, "input")
            w = widen(x)
            if int(self.isinf_only):
                bad = xp.isinf(w)
            elif int(self.isnan_only):
                bad = xp.isnan(w)
            else:
                bad = ~xp.isfinite(w)
            ok = ok & ~xp.any(bad)
        return xp.asarray(ok, dtype=bool).reshape(())


@register("TorchEmbedding", versions=[1], domain=MS)
class TorchEmbedding(OpImpl):
    """torch.nn.functional.embedding: rows of weight (N, M) at `indices` -> (*indices, M).
    padding_idx and scale_grad_by_freq only affect gradients; indices must lie in [0, N)."""

    def run(self, weight, indices, padding_idx=None, scale_grad_by_freq=None):
        xp = self.xp
        if weight.ndim != 2:
            raise self.fail(f"weight must be 2-D, got shape {tuple(weight.shape)}")
        idx = indices.astype(np.int64, copy=False)
        if idx.size and bool(_xp.to_host(xp, xp.any((idx < 0) | (idx >= weight.shape[0])))):
            raise self.fail(f"an index is outside [0, {weight.shape[0]})")
        return xp.take(weight, idx, axis=0)


@register("MurmurHash3", versions=[1], domain=MS)
class MurmurHash3(OpImpl):
    """MurmurHash3_x86_32 of each element's bytes (little-endian; 4 bytes for 32-bit types,
    8 for 64-bit ones, the UTF-8 bytes of a string) with `seed`; uint32 output when
    positive = 1, else the same bits as int32."""

    defaults = {"positive": 1, "seed": 0}

    _C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)

    @staticmethod
    def _rotl(xp, x, r: int):
        return (x << np.uint32(r)) | (x >> np.uint32(32 - r))

    def _mix_block(self, xp, h, k):
        k = k * self._C1
        k = self._rotl(xp, k, 15)
        k = k * self._C2
        h = h ^ k
        h = self._rotl(xp, h, 13)
        return h * np.uint32(5) + np.uint32(0xE6546B64)

    def _finish(self, xp, h, length):
        h = h ^ length
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))

    def run(self, x):
        xp = self.xp
        seed = np.uint32(int(self.seed) & 0xFFFFFFFF)
        if x.dtype == object or x.dtype.kind in "US":
            h = self._hash_strings(x)
            h = xp.asarray(h)
        elif x.dtype in (np.int32, np.uint32, np.float32, np.int64, np.uint64, np.float64):
            words = xp.ascontiguousarray(x).reshape(-1).view(np.uint32)
            words = words.reshape(x.size, x.dtype.itemsize // 4)
            h = xp.full((x.size,), seed, dtype=np.uint32)
            with np.errstate(over="ignore"):
                for j in range(words.shape[1]):  # one or two 4-byte blocks per element
                    h = self._mix_block(xp, h, words[:, j])
                h = self._finish(xp, h, np.uint32(x.dtype.itemsize))
            h = h.reshape(x.shape)
        else:
            raise self.fail(f"unsupported input type {x.dtype}")
        return h if int(self.positive) else h.view(np.int32)

    def _hash_strings(self, x):
        """Host strings: UTF-8 encoded, zero-padded to a common length, hashed block by block
        (a loop over 4-byte block positions, masked per string by its length)."""
        strings = np.asarray(x, dtype=object).reshape(-1)
        encoded = [str(s).encode("utf-8") if not isinstance(s, bytes) else s for s in strings]
        lengths = np.array([len(e) for e in encoded], dtype=np.int64)
        width = -(-int(lengths.max(initial=0)) // 4) * 4 or 4
        buf = np.zeros((len(encoded), width), dtype=np.uint8)
        for i, e in enumerate(encoded):  # copying the bytes out of the Python objects
            buf[i, :len(e)] = np.frombuffer(e, dtype=np.uint8)
        seed = np.uint32(int(self.seed) & 0xFFFFFFFF)
        h = np.full(len(encoded), seed, dtype=np.uint32)
        words = buf.view("<u4")
        nblocks = lengths // 4
        with np.errstate(over="ignore"):
            for j in range(words.shape[1]):
                full = j < nblocks
                h = np.where(full, self._mix_block(np, h, words[:, j]), h)
            tail_len = lengths % 4
            tail = words[np.arange(len(encoded)), np.minimum(nblocks, words.shape[1] - 1)]
            tail = tail & ((np.uint32(1) << (8 * tail_len).astype(np.uint32)) - np.uint32(1))
            k = tail * self._C1
            k = self._rotl(np, k, 15) * self._C2
            h = np.where(tail_len > 0, h ^ k, h)
            h = self._finish(np, h, lengths.astype(np.uint32))
        return h.reshape(np.shape(x))


@register("NGramRepeatBlock", versions=[1], domain=MS)
class NGramRepeatBlock(OpImpl):
    """Scores with -inf at every token that would repeat an n-gram of input_ids (batch,
    cur_len): where the n - 1 tokens starting at i equal the last n - 1 tokens, the token at
    i + n - 1 is banned (onnxruntime's CPU kernel)."""

    defaults = {"ngram_size": None}

    def setup(self):
        if self.ngram_size is None or int(self.ngram_size) <= 0:
            raise self.fail("ngram_size is required and must be positive")
        self.ngram_size = int(self.ngram_size)

    def run(self, input_ids, scores):
        xp = self.xp
        if input_ids.ndim != 2 or scores.ndim != 2 or scores.shape[0] != input_ids.shape[0]:
            raise self.fail(f"input_ids (batch, len) and scores (batch, vocab) expected, got "
                            f"{tuple(input_ids.shape)} and {tuple(scores.shape)}")
        out = scores.copy()
        b, length = input_ids.shape
        n = self.ngram_size
        if length + 1 < n or length - n + 1 <= 0:
            return out
        starts = length - n + 1  # candidate n-grams start at 0 .. length - n
        ids = input_ids.astype(np.int64)
        banned = xp.ones((b, starts), dtype=bool)
        for j in range(n - 1):  # compare each n-gram's first n - 1 tokens with the tail
            banned &= ids[:, j:j + starts] == ids[:, length + 1 - n + j][:, None]
        token = ids[:, n - 1:n - 1 + starts]
        if bool(_xp.to_host(xp, xp.any(banned & ((token >= scores.shape[1]) | (token < 0))))):
            raise self.fail(f"a banned token id is outside the vocabulary ({scores.shape[1]})")
        rows = xp.broadcast_to(xp.arange(b)[:, None], banned.shape)
        out[rows[banned], token[banned]] = -np.inf
        return out


@register("WordConvEmbedding", versions=[1], domain=MS)
class WordConvEmbedding(OpImpl):
    """Character-CNN word embeddings (onnxruntime's CPU kernel): for each word (a row of
    Sequence, int32 character ids; its length the count of positive ids, 0 when the first id
    is not positive) the characters' embeddings C[id] over max(length, window) positions are
    convolved (W (M, 1, window, E), stride 1, bias B), tanh'ed and max-pooled over the
    positions -> Y (words, M). Words of length 0 get 0 (onnxruntime leaves those rows
    unwritten)."""

    defaults = {"embedding_size": -1, "conv_window_size": -1, "char_embedding_size": -1}

    def run(self, sequence, w, b, c):
        xp = self.xp
        if sequence.ndim != 2 or w.ndim != 4 or c.ndim != 2:
            raise self.fail(f"Sequence (words, chars), W (M, 1, window, E) and C (ids, E) "
                            f"expected, got {tuple(sequence.shape)}, {tuple(w.shape)}, "
                            f"{tuple(c.shape)}")
        m, _, fw, e = w.shape
        checks = ((self.embedding_size, m, "embedding_size"),
                  (self.conv_window_size, fw, "conv_window_size"),
                  (self.char_embedding_size, c.shape[1], "char_embedding_size"))
        for attr, actual, what in checks:
            if int(attr) != -1 and int(attr) != actual:
                raise self.fail(f"{what} {int(attr)} does not match the weights ({actual})")
        if c.shape[1] != e:
            raise self.fail(f"C has embedding size {c.shape[1]}, W expects {e}")
        s, length = sequence.shape
        if fw > length:
            raise self.fail(f"conv window {fw} exceeds the word length {length}")
        ids = sequence.astype(np.int64)
        wl = xp.where(ids[:, 0] > 0, xp.sum(ids > 0, axis=1), 0)  # (S,)
        span = xp.maximum(wl, fw)  # positions looked up
        pos = xp.arange(length)
        looked = (pos[None, :] < span[:, None]) & (wl[:, None] > 0)
        emb = xp.take(c, xp.clip(ids, 0, c.shape[0] - 1), axis=0)  # (S, L, E)
        emb = xp.where(looked[..., None], emb, 0).astype(np.float32)
        windows = length - fw + 1
        wt = w.reshape(m, fw, e).astype(np.float32)
        conv = xp.zeros((s, windows, m), np.float32)
        for t in range(fw):  # the window's taps: one matmul each
            conv += xp.matmul(emb[:, t:t + windows], wt[:, t].T)
        conv = xp.tanh(conv + b.astype(np.float32))
        valid = xp.arange(windows)[None, :] < (span - fw + 1)[:, None]
        y = xp.max(xp.where(valid[..., None], conv, -np.inf), axis=1)
        return xp.where((wl > 0)[:, None], y, 0).astype(np.float32)


def _round_half_away(xp, v):
    """C's roundf: to nearest, halves away from zero (v - trunc(v) is exact)."""
    t = xp.trunc(v)
    return xp.where(xp.abs(v - t) >= 0.5, t + xp.sign(v), t)


@register("CropAndResize", versions=[1], domain=MS)
class CropAndResize(OpImpl):
    """TensorFlow's crop_and_resize over NCHW data (onnxruntime's CPU kernel): each roi
    [y1, x1, y2, x2] (normalised) of image batch_indices[r] sampled at crop_size points per
    axis, corner aligned (a single point samples the centre), bilinear or nearest (round half
    away from zero); points outside the image take extrapolation_value. Coordinates are
    float32, as onnxruntime computes them."""

    shape_inputs = (3,)
    defaults = {"extrapolation_value": 0.0, "mode": "bilinear"}

    def setup(self):
        self.mode = _str(self.mode)
        if self.mode not in ("bilinear", "nearest"):
            raise self.fail(f"unsupported mode {self.mode!r} (bilinear, nearest)")

    def _coords(self, xp, start, end, size: int, points: int):
        """(rois, points) float32 sample coordinates along one axis."""
        f32 = np.float32
        if points > 1:
            scale = (end - start) * f32(size - 1) / f32(points - 1)
            c = start[:, None] * f32(size - 1) + xp.arange(points, dtype=f32)[None, :] \
                * scale[:, None]
            c[:, 0] = start * f32(size - 1)
            c[:, -1] = end * f32(size - 1)
            return c
        mid = (0.5 * (start.astype(np.float64) + end.astype(np.float64)) * (size - 1))
        return mid.astype(f32)[:, None]

    def run(self, x, rois, batch_indices, crop_size):
        xp = self.xp
        _float_input(self, x, "X")
        crop = np.asarray(crop_size).reshape(-1)
        if np.ndim(crop_size) != 1 or crop.size != 2 or (crop <= 0).any():
            raise self.fail(f"crop_size must hold 2 positive values, got {crop.tolist()}")
        ph, pw = int(crop[0]), int(crop[1])
        if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4 or batch_indices.ndim != 1 \
                or batch_indices.shape[0] != rois.shape[0]:
            raise self.fail(f"X (N, C, H, W), rois (R, 4) and batch_indices (R,) expected, got "
                            f"{tuple(x.shape)}, {tuple(rois.shape)}, "
                            f"{tuple(batch_indices.shape)}")
        n, c, h, w = x.shape
        bi = batch_indices.astype(np.int64)
        if bi.size and bool(_xp.to_host(xp, xp.any((bi < 0) | (bi >= n)))):
            raise self.fail(f"a batch index is outside [0, {n})")
        r = widen(rois).astype(np.float32)
        ys = self._coords(xp, r[:, 0], r[:, 2], h, ph)  # (R, ph)
        xs = self._coords(xp, r[:, 1], r[:, 3], w, pw)  # (R, pw)
        inside = ((ys >= 0) & (ys <= h - 1))[:, :, None] & ((xs >= 0) & (xs <= w - 1))[:, None]
        img = widen(x).astype(np.float32)[bi]  # (R, C, H, W)
        rows = xp.arange(rois.shape[0])[:, None, None]
        if self.mode == "nearest":
            yi = xp.clip(_round_half_away(xp, ys), 0, h - 1).astype(np.int64)
            xi = xp.clip(_round_half_away(xp, xs), 0, w - 1).astype(np.int64)
            v = img[rows, :, yi[:, :, None], xi[:, None, :]]  # (R, ph, pw, C)
        else:
            y0 = xp.clip(xp.floor(ys), 0, h - 1)
            x0 = xp.clip(xp.floor(xs), 0, w - 1)
            y1 = xp.clip(xp.ceil(ys), 0, h - 1).astype(np.int64)
            x1 = xp.clip(xp.ceil(xs), 0, w - 1).astype(np.int64)
            ly = (ys - y0)[:, :, None, None]
            lx = (xs - x0)[:, None, :, None]
            y0, x0 = y0.astype(np.int64), x0.astype(np.int64)

            def at(yy, xx):
                return img[rows, :, yy[:, :, None], xx[:, None, :]]

            top = at(y0, x0) + (at(y0, x1) - at(y0, x0)) * lx
            bottom = at(y1, x0) + (at(y1, x1) - at(y1, x0)) * lx
            v = top + (bottom - top) * ly
        v = xp.where(inside[..., None], v, np.float32(self.extrapolation_value))
        return xp.ascontiguousarray(xp.moveaxis(v, -1, 1)).astype(x.dtype, copy=False)


@register("BifurcationDetector", versions=[1], domain=MS)
class BifurcationDetector(OpImpl):
    """Aggressive decoding's bifurcation detector (onnxruntime's CPU kernel), over 1-D int64
    token sequences read on the host: tokens = cur_tokens + pred_tokens up to and including
    the first one that differs from src_tokens[prev_suffix_match_idx:]; suffix_match_idx =
    the end in src_tokens of the unique occurrence of tokens' last n-gram, trying n =
    min_ngram_size .. max_ngram_size as onnxruntime does (stopping at the first n with no
    occurrence; -1 when the last tried n occurs more than once)."""

    defaults = {"min_ngram_size": 1, "max_ngram_size": 3}

    def setup(self):
        self.lo, self.hi = int(self.min_ngram_size), int(self.max_ngram_size)
        if self.lo <= 0 or self.hi < self.lo:
            raise self.fail(f"need 0 < min_ngram_size <= max_ngram_size, got {self.lo}, "
                            f"{self.hi}")

    @staticmethod
    def _occurrences(src: np.ndarray, gram: np.ndarray) -> np.ndarray:
        """Start indices of `gram` in `src` (sliding-window comparison)."""
        n = gram.size
        if n > src.size:
            return np.zeros(0, dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(src, n)
        return np.flatnonzero((windows == gram).all(axis=1))

    def run(self, src_tokens, cur_tokens, prev_suffix_match_idx, pred_tokens=None):
        xp = self.xp
        src = _xp.to_host(xp, src_tokens).astype(np.int64).reshape(-1)
        cur = _xp.to_host(xp, cur_tokens).astype(np.int64).reshape(-1)
        if pred_tokens is None:
            tokens = cur
        else:
            pred = _xp.to_host(xp, pred_tokens).astype(np.int64).reshape(-1)
            prev = int(_xp.to_host(xp, prev_suffix_match_idx).reshape(-1)[0])
            if not 0 <= prev <= src.size:
                raise self.fail(f"prev_suffix_match_idx {prev} is outside [0, {src.size}]")
            if pred.size != src.size + 1 - prev:
                raise self.fail(f"pred_tokens has {pred.size} tokens, expected "
                                f"{src.size + 1 - prev}")
            differ = np.flatnonzero(pred[:src.size - prev] != src[prev:])
            bifur = int(differ[0]) if differ.size else src.size - prev
            tokens = np.concatenate([cur, pred[:bifur + 1]])
        suffix = -1
        for n in range(self.lo, self.hi + 1):  # n-gram sizes (an attribute range)
            if n > tokens.size:
                break
            starts = self._occurrences(src, tokens[tokens.size - n:])
            if starts.size == 0:
                break
            suffix = int(starts[0]) + n
            if suffix >= src.size:
                break
            if starts.size > 1:
                suffix = -1
        out_idx = np.full(np.shape(prev_suffix_match_idx), suffix, dtype=np.int64)
        return xp.asarray(tokens), xp.asarray(out_idx)


@register("MaxpoolWithMask", versions=[1], domain=MS)
class MaxpoolWithMask(OpImpl):
    """onnxruntime's internal masked max pool, reproduced as its CPU kernel computes it: each
    window's max over X, where the scan along the last spatial axis of each window row stops
    at the first element whose mask value is 0 (in 2-D and 3-D the element at flat index 0
    is never checked); a window with no element scanned gives the lowest float. Channel c
    (of N * C) reads the mask from flat offset (c * spatial size) mod (mask N * mask C), as
    onnxruntime does (the usual mask has N = C = 1). float32 only."""

    defaults = {"kernel_shape": None, "pads": None, "strides": None, "auto_pad": "NOTSET",
                "storage_order": 0}

    def setup(self):
        if not self.kernel_shape:
            raise self.fail("the kernel_shape attribute is required")

    def run(self, x, mask):
        xp = self.xp
        if x.dtype != np.float32:
            raise self.fail(f"X must be float32, got {x.dtype}")
        n = x.ndim - 2
        if n < 1 or n > 3 or mask.ndim != x.ndim or tuple(mask.shape[2:]) != tuple(x.shape[2:]):
            raise self.fail(f"X (N, C, spatial) with 1-3 spatial axes and a mask of the same "
                            f"spatial shape expected, got {tuple(x.shape)} and "
                            f"{tuple(mask.shape)}")
        kernel = [int(k) for k in self.kernel_shape]
        if len(kernel) != n:
            raise self.fail(f"kernel_shape {kernel} does not match {n} spatial axes")
        strides = ints(self.strides, n, 1)
        in_sp = list(x.shape[2:])
        try:
            begin, end = auto_pads(self.auto_pad, in_sp, kernel, strides, [1] * n, self.pads)
        except ValueError as exc:
            raise self.fail(str(exc)) from None
        outs = out_size(in_sp, kernel, strides, [1] * n, begin, end)
        nc = x.shape[0] * x.shape[1]
        plane = math.prod(in_sp)
        # per axis: each output's clipped window start and tap count, and every tap's index
        taps = []
        for i in range(n):
            o = np.arange(outs[i])
            lo = o * strides[i] - begin[i]
            hi = np.minimum(lo + kernel[i], in_sp[i])
            lo = np.maximum(lo, 0)
            t = np.arange(kernel[i])
            idx = lo[:, None] + t[None, :]  # (out_i, k_i)
            taps.append((np.minimum(idx, in_sp[i] - 1), idx < hi[:, None]))
        # flat spatial index and validity of every (output position, tap): shape
        # (out_1, .., out_n, k_1, .., k_n)
        flat = np.zeros((), np.int64)
        valid = np.ones((), bool)
        sp_stride = [math.prod(in_sp[i + 1:]) for i in range(n)]
        for i, (idx, ok) in enumerate(taps):
            shape = [1] * (2 * n)
            shape[i], shape[n + i] = outs[i], kernel[i]
            flat = flat + idx.reshape(shape) * sp_stride[i]
            valid = valid & ok.reshape(shape)
        flat = np.broadcast_to(flat, tuple(outs) + tuple(kernel))
        valid = np.broadcast_to(valid, flat.shape)
        xs = x.reshape(nc, plane)
        offsets = (np.arange(nc, dtype=np.int64) * plane) % (mask.shape[0] * mask.shape[1])
        mflat = mask.reshape(-1)
        gather = xp.asarray(flat.reshape(-1))
        values = xp.take(xs, gather, axis=1).reshape((nc,) + flat.shape)
        mvals = xp.take(mflat, xp.asarray(offsets)[:, None] + gather[None, :])
        mvals = mvals.reshape((nc,) + flat.shape)
        checked = xp.asarray(flat > 0 if n > 1 else np.ones(flat.shape, bool))
        stop = (mvals == 0) & checked & xp.asarray(valid)
        # an element counts when it is valid and no element before it in its row stopped the
        # scan (the row: the last tap axis)
        seen = xp.cumsum(stop, axis=-1) == 0
        take = seen & xp.asarray(valid)
        lowest = np.float32(np.finfo(np.float32).min)
        y = xp.max(xp.where(take, values, lowest), axis=tuple(range(n + 1, 2 * n + 1)))
        return y.reshape(x.shape[:2] + tuple(outs))


# ----------------------------------------------------------------------------------------------
# decoder attention


@register("DecoderMaskedMultiHeadAttention", versions=[1], domain=MS)
class DecoderMaskedMultiHeadAttention(OpImpl):
    """One decoding step of multi-head attention (query length 1), as onnxruntime's CPU kernel
    runs it (float32):

    - self attention: key and value (B, 1, hidden), or packed into query (B, 1, 3 hidden)
      when both are omitted, plus `bias` (3 hidden) for the three projections; the past
      caches past_key / past_value (B, N, max_len, H) hold past_sequence_length steps
      (past_present_share_buffer = 1, which onnxruntime's kernel requires); the new key and
      value are written at that step of present_key / present_value (the caches' copies) and
      the step attends over past_sequence_length + 1 positions. With beam_width > 1,
      cache_indirection (batch, beam, max_len) says which beam's cache row each past step of
      each beam reads;
    - cross attention (no past caches, no present outputs): key and value are the encoder's
      (B, N, kv_len, H) projections.

    scores = scale q.k (scale default 1/sqrt(H)) + attention_bias (broadcast (B|1, N|1, 1,
    total)), plus mask_filter_value where mask_index (B, total) is 0; qk (output_qk) is the
    scores before the softmax."""

    shape_inputs = (7, 8)
    defaults = {"num_heads": None, "scale": 0.0, "mask_filter_value": -10000.0,
                "past_present_share_buffer": 0, "output_qk": 0}

    def setup(self):
        if self.num_heads is None or int(self.num_heads) <= 0:
            raise self.fail("num_heads is required and must be positive")
        self.heads = int(self.num_heads)

    def _split(self, x, what):
        """(B, 1, N * H) -> (B, N, 1, H)."""
        b, s, hidden = x.shape
        if s != 1:
            raise self.fail(f"{what} must have sequence length 1, got shape {tuple(x.shape)}")
        if hidden % self.heads:
            raise self.fail(f"{what} hidden size {hidden} is not a multiple of num_heads "
                            f"{self.heads}")
        return x.reshape(b, 1, self.heads, hidden // self.heads).transpose(0, 2, 1, 3)

    def run(self, query, key=None, value=None, mask_index=None, attention_bias=None,
            past_key=None, past_value=None, past_sequence_length=None, beam_width=None,
            cache_indirection=None, bias=None):
        xp = self.xp
        if query.dtype != np.float32:
            raise self.fail(f"query must be float32 (onnxruntime's CPU kernel), got "
                            f"{query.dtype}")
        if query.ndim != 3 or query.shape[1] != 1:
            raise self.fail(f"query must be (batch, 1, hidden), got {tuple(query.shape)}")
        b = query.shape[0]
        n = self.heads
        cross = past_key is None and key is not None and key.ndim == 4
        if cross and any(self.node.outputs[1:3]):
            raise self.fail("cross attention (no past caches) has no present outputs")
        if cross:
            if attention_bias is not None:
                raise self.fail("attention_bias is not supported with cross attention")
            hidden = query.shape[2]
            if bias is not None:
                query = query + bias.reshape(-1)[:hidden]
            q = self._split(query, "query")
            k, v = key, value
            if value is None or k.shape[:2] != (b, n) or v.shape[:2] != (b, n):
                raise self.fail(f"cross attention needs key and value (batch, {n}, kv_len, "
                                f"head_size)")
            present = None
            total = k.shape[2]
        else:
            if past_key is None or past_value is None:
                raise self.fail("self attention needs past_key and past_value")
            if not int(self.past_present_share_buffer):
                raise self.fail("self attention needs past_present_share_buffer = 1 (as "
                                "onnxruntime's kernel requires)")
            if key is None and value is None:  # packed QKV
                hidden = query.shape[2] // 3
                qkv = query if bias is None else query + bias.reshape(1, 1, -1)
                q_in, k_in, v_in = (qkv[..., :hidden], qkv[..., hidden:2 * hidden],
                                    qkv[..., 2 * hidden:])
            else:
                hidden = query.shape[2]
                q_in, k_in, v_in = query, key, value
                if bias is not None:
                    bias = bias.reshape(-1)
                    q_in = q_in + bias[:hidden]
                    k_in = k_in + bias[hidden:2 * hidden]
                    v_in = v_in + bias[2 * hidden:]
            q = self._split(q_in, "query")
            k_new, v_new = self._split(k_in, "key"), self._split(v_in, "value")
            max_len = past_key.shape[2]
            if past_key.shape != (b, n, max_len, q.shape[3]) or past_value.shape != past_key.shape:
                raise self.fail(f"past_key and past_value must be (batch, {n}, max_len, "
                                f"head_size), got {tuple(past_key.shape)} and "
                                f"{tuple(past_value.shape)}")
            if past_sequence_length is None:
                raise self.fail("past_sequence_length is required with a shared past buffer")
            past = int(np.asarray(past_sequence_length).reshape(-1)[0])
            if not 0 <= past < max_len:
                raise self.fail(f"past_sequence_length {past} leaves no room in a buffer of "
                                f"{max_len}")
            total = past + 1
            present_k, present_v = past_key.copy(), past_value.copy()
            present_k[:, :, past] = k_new[:, :, 0]
            present_v[:, :, past] = v_new[:, :, 0]
            present = (present_k, present_v)
            beams = 1 if beam_width is None else int(np.asarray(beam_width).reshape(-1)[0])
            k, v = present_k[:, :, :total], present_v[:, :, :total]
            if beams > 1:
                if cache_indirection is None:
                    raise self.fail("cache_indirection is required when beam_width > 1")
                if b % beams:
                    raise self.fail(f"batch {b} is not a multiple of beam_width {beams}")
                # step t < past of row (i, j) reads the cache row of beam indir[i, j, t]
                indir = cache_indirection.astype(np.int64).reshape(b // beams, beams, -1)
                rows = (xp.arange(b // beams)[:, None, None] * beams + indir[:, :, :past])
                rows = rows.reshape(b, past)
                steps = xp.arange(past)[None, :]
                k_past = present_k[rows, :, steps].transpose(0, 2, 1, 3)  # (B, N, past, H)
                v_past = present_v[rows, :, steps].transpose(0, 2, 1, 3)
                k = xp.concatenate([k_past, k_new], axis=2)
                v = xp.concatenate([v_past, v_new], axis=2)
        h = q.shape[3]
        scale = float(self.scale) or 1.0 / math.sqrt(h)
        scores = xp.matmul(q, xp.swapaxes(k, -1, -2)) * np.float32(scale)  # (B, N, 1, total)
        if attention_bias is not None:
            scores = scores + attention_bias[..., :total]
        if mask_index is not None:
            if mask_index.ndim != 2 or mask_index.shape[0] != b or mask_index.shape[1] < total:
                raise self.fail(f"mask_index must be (batch, total_sequence_length), got "
                                f"{tuple(mask_index.shape)}")
            keep = (mask_index[:, :total] != 0)[:, None, None, :]
            scores = scores + xp.where(keep, np.float32(0), np.float32(self.mask_filter_value))
        qk = scores
        peak = xp.max(scores, axis=-1, keepdims=True)
        e = xp.exp(scores - peak)
        probs = e / xp.sum(e, axis=-1, keepdims=True)
        out = xp.matmul(probs, v)  # (B, N, 1, H)
        out = out.transpose(0, 2, 1, 3).reshape(b, 1, n * v.shape[3]).astype(np.float32)
        if present is None:
            return out, None, None, qk.astype(np.float32)
        return out, present[0], present[1], qk.astype(np.float32)

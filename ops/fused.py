"""Ops the simplifier fuses into, in the domain "ai.ember" (version 1), with their CPU kernels.

    ai.ember::FusedConv(X, W, B?, Z?)      act(Conv(X, W, B) + Z): Conv attributes + activation
    ai.ember::FusedGemm(A, B, C?)          Gemm attributes (all given) + activation
    ai.ember::FusedMatMul(A, B, bias?, Z?) act(A @ B + bias + Z), bias over the last axis

Z, the residual, has exactly the shape of the result.

`activation` names the ONNX activation applied to the result ("Relu", "LeakyRelu", "Clip",
"Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Gelu"; "" for none) and `activation_params`
holds its float parameters in the ONNX attribute order (Clip: min, max; LeakyRelu: alpha;
HardSigmoid: alpha, beta; Gelu: 1.0 for the tanh approximation). The activation is applied in
place on the freshly computed product, as are the bias and the residual: fusion saves the
separate ops' allocations (and, for GELU, runs the formula block by block in cache).
"""
from __future__ import annotations

import numpy as np

from ember.ops.conv import Conv, _channels_last
from ember.ops.activations import gelu
from ember.ops.linalg import Gemm7, matmul
from ember.ops.registry import OpImpl, register

DOMAIN = "ai.ember"
ACTIVATIONS = ("", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish",
               "Gelu")


def activate_in_place(xp, y, name: str, params: list[float]) -> None:
    """y = `name`(y), written into y (a writable float array of namespace `xp`)."""
    t = y.dtype.type
    if not name:
        return
    if name == "Relu":
        xp.maximum(y, 0, out=y)
    elif name == "LeakyRelu":
        xp.copyto(y, y * t(params[0] if params else 0.01), where=y < 0)
    elif name == "Clip":
        lo, hi = (params + [-np.inf, np.inf][len(params):])[:2]
        xp.clip(y, lo, hi, out=y)
    elif name == "Sigmoid":
        with np.errstate(over="ignore"):
            xp.negative(y, out=y)
            xp.exp(y, out=y)
            y += 1
            xp.reciprocal(y, out=y)
    elif name == "Tanh":
        xp.tanh(y, out=y)
    elif name == "HardSigmoid":
        alpha, beta = (params + [0.2, 0.5][len(params):])[:2]
        y *= t(alpha)
        y += t(beta)
        xp.clip(y, 0, 1, out=y)
    elif name == "HardSwish":
        gate = y * t(1 / 6)
        gate += t(0.5)
        xp.clip(gate, 0, 1, out=gate)
        y *= gate
    elif name == "Gelu":
        gelu(xp, y, tanh=bool(params and params[0]), out=y)
    else:
        raise ValueError(f"unknown fused activation {name!r}")


def epilogue(xp, y, bias, z, activation: str, params: list[float]):
    """activation(y + bias + z), with `bias` broadcast over y's last axis and `z` of y's shape.

    On a fresh dense float `y` (the usual case: C-contiguous, or the channels-last view a
    CPU convolution returns) every step writes into y: no new arrays. Each step is one call
    over the whole array: for one or two passes that is faster than cache blocking (measured
    on ResNet-50's convolutions), while GELU, a long formula, blocks inside `gelu`. Anything
    else (integer products, a bias of another shape) takes steps that allocate.
    """
    row = None
    if bias is not None and y.ndim and bias.size == y.shape[-1] and y.ndim >= bias.ndim \
            and all(d == 1 for d in bias.shape[:-1]):
        row = bias.reshape(-1).astype(y.dtype, copy=False)
    # (cupy's flags have no `writeable`: device arrays are always writable)
    # a fresh dense result: C-ordered, or the channels-last view a CPU convolution returns
    dense = y.ndim and (y.flags.c_contiguous or _channels_last(y))
    if y.dtype.kind != "f" or not dense or not getattr(y.flags, "writeable", True) or \
            (bias is not None and row is None) or (z is not None and z.dtype != y.dtype):
        return _epilogue_whole(xp, y, bias, z, activation, params)
    if row is not None:
        y += row
    if z is not None:
        y += z
    activate_in_place(xp, y, activation, params)
    return y


def _epilogue_whole(xp, y, bias, z, activation, params):
    dtype = y.dtype
    if bias is not None:
        y = y + bias
    if z is not None:
        y = y + z
    work = y.astype(dtype if dtype.kind == "f" else np.float32)  # a copy we may write into
    activate_in_place(xp, work, activation, params)
    return work.astype(dtype, copy=False)


class _Activated(OpImpl):
    """Base of the fused ops: reads the activation attributes once, applies the epilogue over
    `self.xp`."""

    def _activation_setup(self):
        self.activation_name = getattr(self, "activation", "") or ""
        if isinstance(self.activation_name, bytes):
            self.activation_name = self.activation_name.decode()
        if self.activation_name not in ACTIVATIONS:
            raise self.fail(f"unknown activation {self.activation_name!r}")
        self.activation_args = [float(v) for v in (getattr(self, "activation_params", None)
                                                   or [])]

    def finish(self, y, bias=None, z=None):
        if z is not None and z.shape != y.shape:
            raise self.fail(f"residual Z has shape {z.shape}, the result {y.shape}")
        return epilogue(self.xp, y, bias, z, self.activation_name, self.activation_args)


@register("FusedConv", versions=[1], domain=DOMAIN)
class FusedConv(Conv, _Activated):
    def setup(self):
        super().setup()
        self._activation_setup()

    def run(self, x, w, b=None, z=None):
        return self.finish(super().run(x, w, b), z=z)


@register("FusedGemm", versions=[1], domain=DOMAIN)
class FusedGemm(Gemm7, _Activated):
    def setup(self):
        for name, default in (("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0)):
            if getattr(self, name, None) is None:
                setattr(self, name, default)
        super().setup()
        self._activation_setup()

    def run(self, a, b, c=None):
        return self.finish(super().run(a, b, c))


@register("FusedMatMul", versions=[1], domain=DOMAIN)
class FusedMatMul(_Activated):
    def setup(self):
        self._activation_setup()

    def run(self, a, b, bias=None, z=None):
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise self.fail(f"shapes {a.shape} and {b.shape} are not aligned")
        xp = self.xp
        return self.finish(xp.asarray(matmul(xp, a, b)), bias, z)  # vector . vector: a scalar

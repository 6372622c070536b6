"""Ops the simplifier fuses into, in the domain "ai.ember" (version 1), with their CPU kernels.

    ai.ember::FusedConv(X, W, B?, Z?)      act(Conv(X, W, B) + Z): Conv attributes + activation
    ai.ember::FusedGemm(A, B, C?)          Gemm attributes (all given) + activation
    ai.ember::FusedMatMul(A, B, bias?, Z?) act(A @ B + bias + Z), bias over the last axis

Z, the residual, has exactly the shape of the result.

`activation` names the ONNX activation applied to the result ("Relu", "LeakyRelu", "Clip",
"Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Gelu"; "" for none) and `activation_params`
holds its float parameters in the ONNX attribute order (Clip: min, max; LeakyRelu: alpha;
HardSigmoid: alpha, beta; Gelu: 1.0 for the tanh approximation). The activation is applied in
place on the freshly computed product, so fusion saves a pass over memory and an allocation.
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops.conv import Conv
from ember.ops.elementwise import erf
from ember.ops.linalg import Gemm7, matmul
from ember.ops.registry import OpImpl, register

DOMAIN = "ai.ember"
ACTIVATIONS = ("", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish",
               "Gelu")


def apply_activation(y: np.ndarray, name: str, params: list[float]) -> np.ndarray:
    """`name`(y), computed in place where the dtype allows."""
    if not name:
        return y
    if y.dtype.kind != "f":
        y = y.astype(np.float32)  # activations are defined on floats only
    if name == "Relu":
        return np.maximum(y, 0, out=y)
    if name == "LeakyRelu":
        alpha = params[0] if params else 0.01
        return np.where(y < 0, y * y.dtype.type(alpha), y)
    if name == "Clip":
        lo, hi = (params + [-np.inf, np.inf][len(params):])[:2]
        return np.clip(y, lo, hi, out=y)
    if name == "Sigmoid":
        return _sigmoid(y)
    if name == "Tanh":
        return np.tanh(y, out=y)
    if name == "HardSigmoid":
        alpha, beta = (params + [0.2, 0.5][len(params):])[:2]
        return np.clip(y * y.dtype.type(alpha) + y.dtype.type(beta), 0, 1)
    if name == "HardSwish":
        return y * np.clip(y * y.dtype.type(1 / 6) + y.dtype.type(0.5), 0, 1)
    if name == "Gelu":
        if params and params[0]:
            inner = y.dtype.type(math.sqrt(2 / math.pi)) * (y + y.dtype.type(0.044715) * y ** 3)
            return y.dtype.type(0.5) * y * (1 + np.tanh(inner))
        return y.dtype.type(0.5) * y * (1 + erf(y * y.dtype.type(math.sqrt(0.5))))
    raise ValueError(f"unknown fused activation {name!r}")


def _sigmoid(y: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.reciprocal(1 + np.exp(-y), out=y)


class _Activated:
    """Mixin: reads the activation attributes once."""

    def _activation_setup(self):
        self.activation_name = getattr(self, "activation", "") or ""
        if isinstance(self.activation_name, bytes):
            self.activation_name = self.activation_name.decode()
        if self.activation_name not in ACTIVATIONS:
            raise self.fail(f"unknown activation {self.activation_name!r}")
        self.activation_args = [float(v) for v in (getattr(self, "activation_params", None)
                                                   or [])]

    def activate(self, y):
        out = apply_activation(y, self.activation_name, self.activation_args)
        return out.astype(y.dtype, copy=False)


@register("FusedConv", versions=[1], domain=DOMAIN)
class FusedConv(Conv, _Activated):
    def setup(self):
        super().setup()
        self._activation_setup()

    def run(self, x, w, b=None, z=None):
        return self.activate(_add_residual(self, super().run(x, w, b), z))


@register("FusedGemm", versions=[1], domain=DOMAIN)
class FusedGemm(Gemm7, _Activated):
    def setup(self):
        for name, default in (("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0)):
            if getattr(self, name, None) is None:
                setattr(self, name, default)
        super().setup()
        self._activation_setup()

    def run(self, a, b, c=None):
        return self.activate(super().run(a, b, c))


@register("FusedMatMul", versions=[1], domain=DOMAIN)
class FusedMatMul(OpImpl, _Activated):
    def setup(self):
        self._activation_setup()

    def run(self, a, b, bias=None, z=None):
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise self.fail(f"shapes {a.shape} and {b.shape} are not aligned")
        y = matmul(a, b)
        if bias is not None:
            if y.dtype.kind == "f" and y.flags.writeable and \
                    np.broadcast_shapes(y.shape, bias.shape) == y.shape:
                y += bias.astype(y.dtype, copy=False)
            else:
                y = (y + bias).astype(a.dtype, copy=False)
        return self.activate(_add_residual(self, y, z))


def _add_residual(op: OpImpl, y: np.ndarray, z: np.ndarray | None) -> np.ndarray:
    if z is None:
        return y
    if z.shape != y.shape:
        raise op.fail(f"residual Z has shape {z.shape}, the result {y.shape}")
    if y.flags.writeable and y.dtype == z.dtype:
        y += z
        return y
    return (y + z).astype(y.dtype, copy=False)

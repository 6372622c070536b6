"""OpenCL activation kernels, through the generic elementwise kernel (ops/opencl/elementwise.py):
one C expression per op over the input value `a`, in the work type W (float for float16 and
float32, double for float64), attributes baked in as exact literals."""
from __future__ import annotations

import math

from ember.ops import activations as A
from ember.ops.opencl.elementwise import (UnaryCL, declare, ew, kind, kinds_dtypes, lit,
                                          load_type, on_device)
from ember.ops.registry import register

_F = "f"
# Activations without attributes: kinds -> expression.
SIMPLE = {
    "Relu": {"fi": "(a < 0 ? (W)0 : a)", "u": "a"},
    "Sigmoid": {_F: "sigm(a)"},
    "Softplus": {_F: "softplus(a)"},
    "Softsign": {_F: "a / ((W)1 + fabs(a))"},
    "HardSwish": {_F: "a * minn(maxn(a / (W)6 + (W)0.5, (W)0), (W)1)"},
    "Mish": {_F: "a * tanh(softplus(a))"},
}
for _op, _table in SIMPLE.items():
    declare(UnaryCL, _op, getattr(A, _op), _table)


class _AttrCL(UnaryCL):
    """Float activations whose expression uses attributes: `formula_cl()`."""
    dtypes = kinds_dtypes("f")

    def expr(self, dtype):
        return self.formula_cl() if kind(dtype) == "f" else None


def _attr(op: str, formula) -> type:
    cpu = getattr(A, op)
    cls = type(f"{op}CL", (_AttrCL, cpu), {"formula_cl": formula})
    return register(op, cpu.versions, backend="opencl")(cls)


EluCL = _attr("Elu", lambda s: f"(a >= 0 ? a : {lit(s.alpha)} * expm1(a))")
CeluCL = _attr("Celu", lambda s: f"maxn(a, (W)0) + minn((W)0, {lit(s.alpha)} * "
                                 f"expm1(a / {lit(s.alpha)}))")
SeluCL = _attr("Selu", lambda s: f"{lit(s.gamma)} * (a > 0 ? a : {lit(s.alpha)} * expm1(a))")
LeakyReluCL = _attr("LeakyRelu", lambda s: f"(a >= 0 ? a : {lit(s.alpha)} * a)")
ThresholdedReluCL = _attr("ThresholdedRelu", lambda s: f"(a > {lit(s.alpha)} ? a : (W)0)")
HardSigmoidCL = _attr("HardSigmoid", lambda s: f"minn(maxn({lit(s.alpha)} * a + {lit(s.beta)}, "
                                               "(W)0), (W)1)")
SwishCL = _attr("Swish", lambda s: f"a * sigm({lit(s.alpha)} * a)")
GeluCL = _attr("Gelu", lambda s: (
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation where tanh(u) is near -1
    f"a * sigm({lit(2 * math.sqrt(2 / math.pi))} * (a + {lit(0.044715)} * a * a * a))"
    if s.tanh else f"(W)0.5 * a * ((W)1 + erf(a * {lit(math.sqrt(0.5))}))"))


@register("Shrink", versions=A.Shrink.versions, backend="opencl")
class ShrinkCL(A.Shrink):
    """Floats in their work type; integers through double, truncated back like the CPU."""
    dtypes = kinds_dtypes("fiu")

    def run(self, x):
        if not on_device(self.device, x) or kind(x.dtype) not in "fiu":
            return self.run_on_cpu(x)
        w = load_type(x.dtype) if kind(x.dtype) == "f" else "double"
        lam, bias = self.lambd, self.bias
        e = (f"(a > {lit(lam)} ? a - {lit(bias)} : (a < {lit(-lam)} ? a + {lit(bias)} : (W)0))")
        return ew(self.device, e, [x], x.dtype, loads=(w,))


@register("PRelu", versions=A.PRelu.versions, backend="opencl")
class PReluCL(A.PRelu):
    dtypes = kinds_dtypes("fiu")

    def run(self, x, slope):
        if not on_device(self.device, x, slope) or x.dtype != slope.dtype \
                or kind(x.dtype) not in "fiu":
            return self.run_on_cpu(x, slope)
        if self.version < 7 and slope.ndim == 1 and slope.size > 1 and x.ndim > 2 \
                and slope.size == x.shape[1]:
            slope = slope.reshape((-1,) + (1,) * (x.ndim - 2))  # opset 1/6: per channel
        return ew(self.device, "a" if kind(x.dtype) == "u" else "(a < 0 ? a * b : a)",
                  [x, slope], x.dtype)


@register("SwiGLU", versions=A.SwiGLU.versions, backend="opencl")
class SwiGLUCL(A.SwiGLU):
    dtypes = kinds_dtypes("f")

    def run(self, a, b):
        if not on_device(self.device, a, b) or a.dtype != b.dtype or kind(a.dtype) != "f" \
                or a.shape != b.shape:
            return self.run_on_cpu(a, b)
        return ew(self.device, f"a * sigm({lit(self.alpha)} * a) * b", [a, b], a.dtype)

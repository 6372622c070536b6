"""Native CUDA kernels (cupy.ElementwiseKernel) for activations whose numpy form takes several
passes over memory (Sigmoid, Gelu, Erf, Elu, ...): one fused kernel each, float32/float64.
Other dtypes take the shared path (the CPU kernel's array code over cupy); plain one-ufunc ops
(Add, Exp, Tanh, comparisons...) are shared kernels too: a numpy ufunc on cupy arrays is one
cupy kernel already.

The kernel bodies are templated on T (cupy instantiates them per dtype); CUDA_SOURCES wraps each
body into a full __global__ function per dtype for the NVRTC compile test.
"""
from __future__ import annotations

import math

from ember.ops import activations as act
from ember.ops import elementwise as ew
from ember.ops.cuda._common import (FLOAT_TYPES, elementwise_kernel, elementwise_source,
                                    native_kernels, shared_class)
from ember.ops.registry import register

# float/double overloads of the math functions the bodies use (explicit, so T = float never
# computes in double).
PREAMBLE = r"""
__device__ __forceinline__ float e_exp(float v) { return expf(v); }
__device__ __forceinline__ double e_exp(double v) { return exp(v); }
__device__ __forceinline__ float e_expm1(float v) { return expm1f(v); }
__device__ __forceinline__ double e_expm1(double v) { return expm1(v); }
__device__ __forceinline__ float e_log1p(float v) { return log1pf(v); }
__device__ __forceinline__ double e_log1p(double v) { return log1p(v); }
__device__ __forceinline__ float e_erf(float v) { return erff(v); }
__device__ __forceinline__ double e_erf(double v) { return erf(v); }
__device__ __forceinline__ float e_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double e_tanh(double v) { return tanh(v); }
__device__ __forceinline__ float e_abs(float v) { return fabsf(v); }
__device__ __forceinline__ double e_abs(double v) { return fabs(v); }
template <typename T> __device__ __forceinline__ T e_sigmoid(T v) {
  T e = e_exp(-e_abs(v));
  T s = (T)1 / ((T)1 + e);
  return v >= (T)0 ? s : e * s;
}
"""

# name -> (ElementwiseKernel input params, body); scalar attributes are `T` by-value params.
KERNELS = {
    "Relu":        ("T x", "y = x < (T)0 ? (T)0 : x"),
    "Sigmoid":     ("T x", "y = e_sigmoid(x)"),
    "Erf":         ("T x", "y = e_erf(x)"),
    "Gelu":        ("T x", "y = (T)0.5 * x * ((T)1 + e_erf(x * (T)0.70710678118654752440))"),
    "GeluTanh":    ("T x", "y = (T)0.5 * x * ((T)1 + e_tanh((T)0.79788456080286535588 * "
                           "(x + (T)0.044715 * x * x * x)))"),
    "Softplus":    ("T x", "y = (x > (T)0 ? x : (T)0) + e_log1p(e_exp(-e_abs(x)))"),
    "HardSwish":   ("T x", "T h = x / (T)6 + (T)0.5; "
                           "y = x * (h < (T)0 ? (T)0 : (h > (T)1 ? (T)1 : h))"),
    "Mish":        ("T x", "T sp = (x > (T)0 ? x : (T)0) + e_log1p(e_exp(-e_abs(x))); "
                           "y = x * e_tanh(sp)"),
    "LeakyRelu":   ("T x, T alpha", "y = x >= (T)0 ? x : alpha * x"),
    "Elu":         ("T x, T alpha", "y = x >= (T)0 ? x : alpha * e_expm1(x)"),
    "Selu":        ("T x, T alpha, T gamma",
                    "y = gamma * (x > (T)0 ? x : alpha * e_expm1(x))"),
    "HardSigmoid": ("T x, T alpha, T beta",
                    "T h = alpha * x + beta; y = h < (T)0 ? (T)0 : (h > (T)1 ? (T)1 : h)"),
    "Swish":       ("T x, T alpha", "y = x * e_sigmoid(alpha * x)"),
}

_SCALARS = {"alpha", "gamma", "beta"}


def _full_source(name: str, ctype: str) -> str:
    params, body = KERNELS[name]
    arrays = ", ".join(p for p in params.split(", ") if p.split()[-1] not in _SCALARS)
    scalars = [p for p in params.split(", ") if p.split()[-1] in _SCALARS]
    src = elementwise_source(f"{name}_{ctype}", arrays, "T y", body + ";",
                             preamble=f"typedef {ctype} T;\n" + PREAMBLE)
    if scalars:  # by-value scalar parameters after the arrays
        src = src.replace(", long long n)", ", " + ", ".join(scalars) + ", long long n)")
    return src


CUDA_SOURCES = {f"{name}_{c}": _full_source(name, c) for name in KERNELS
                for c in ("float", "double")}


def _apply(name: str, x, *scalars):
    params, body = KERNELS[name]
    knl = elementwise_kernel(params, "T y", body, f"ember_{name}", PREAMBLE)
    return knl(x, *(x.dtype.type(s) for s in scalars))


def _native(xp, x) -> bool:
    return native_kernels(xp) and x.dtype in FLOAT_TYPES


def _kernel_class(cpu_cls, name, attrs=()):
    """A CUDA class for `cpu_cls` running kernel `name` with the node's float attributes."""
    def run(self, x):
        if not _native(self.xp, x):
            return super(cls, self).run(x)  # shared path (other dtypes, no CUDA C)
        return _apply(name, x, *(float(getattr(self, a)) for a in attrs))
    cls = type(f"{cpu_cls.__name__}CUDA", (shared_class(cpu_cls),),
               {"run": run, "__module__": __name__})
    return register(cpu_cls.op_type, versions=cpu_cls.versions, backend="cuda")(cls)


ReluCUDA = _kernel_class(act.Relu, "Relu")
SigmoidCUDA = _kernel_class(act.Sigmoid, "Sigmoid")
ErfCUDA = _kernel_class(ew.Erf, "Erf")
SoftplusCUDA = _kernel_class(act.Softplus, "Softplus")
HardSwishCUDA = _kernel_class(act.HardSwish, "HardSwish")
MishCUDA = _kernel_class(act.Mish, "Mish")
LeakyReluCUDA = _kernel_class(act.LeakyRelu, "LeakyRelu", ("alpha",))
EluCUDA = _kernel_class(act.Elu, "Elu", ("alpha",))
SeluCUDA = _kernel_class(act.Selu, "Selu", ("alpha", "gamma"))
HardSigmoidCUDA = _kernel_class(act.HardSigmoid, "HardSigmoid", ("alpha", "beta"))
SwishCUDA = _kernel_class(act.Swish, "Swish", ("alpha",))


@register("Gelu", versions=act.Gelu.versions, backend="cuda")
class GeluCUDA(shared_class(act.Gelu)):
    def run(self, x):
        if not _native(self.xp, x):
            return super().run(x)
        return _apply("GeluTanh" if self.tanh else "Gelu", x)


assert math.isclose(0.70710678118654752440, math.sqrt(0.5))
assert math.isclose(0.79788456080286535588, math.sqrt(2 / math.pi))

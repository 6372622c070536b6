"""OpenCL kernels of the ops the simplifier fuses into (ai.ember::FusedConv, FusedGemm,
FusedMatMul; semantics in ops/fused.py): act(product + bias + Z).

No separate pass over the result: the three ops run the device Conv / Gemm / MatMul kernels
(ops/opencl/conv.py, linalg.py), whose packed-GEMM epilogue adds the bias (as its C operand),
then the residual Z, and applies the activation to the accumulators in registers before the
one store; the direct kernel of small-group convolutions (depthwise) does the same at its
store. The activation is compiled in (`linalg.activation_source`: one short function per
activation, a program variant per dtype and activation actually used, cached in memory and on
disk); its parameters (LeakyRelu's alpha, Clip's bounds, HardSigmoid's alpha and beta) are
kernel arguments, so they add no variants. Gelu has two variants: the erf form, and the tanh
form (activation_params[0] != 0) written as x * sigmoid(2u) like the Gelu kernel.

What runs on the CPU instead (per call, through `run_on_cpu`, which applies the same
activation): dtypes other than float32/float64 (float16 included), mixed dtypes, empty inner
dimensions, 4-D+ convolutions, a FusedMatMul of two vectors, and a FusedMatMul bias that is
not a vector over the result's last axis (or a single value), which the CPU broadcasts.
"""
from __future__ import annotations

import numpy as np

from ember.ops.fused import DOMAIN, FusedConv, FusedGemm, FusedMatMul
from ember.ops.linalg import CachedPack
from ember.ops.opencl._common import FLOAT_TYPES
from ember.ops.opencl.conv import conv_device
from ember.ops.opencl.linalg import _GemmCL, _matmul_device, activation_code
from ember.ops.registry import register


@register("FusedConv", versions=[1], domain=DOMAIN, backend="opencl")
class FusedConvCL(FusedConv):
    dtypes = FLOAT_TYPES

    def setup(self):
        super().setup()
        self._wpack = CachedPack()  # packed weights, kept while W is the same constant
        self._act = activation_code(self.activation_name, self.activation_args)

    def run(self, x, w, b=None, z=None):
        y = conv_device(self, x, w, b, z, self._act)
        return self.run_on_cpu(x, w, b, z) if y is None else y


@register("FusedGemm", versions=[1], domain=DOMAIN, backend="opencl")
class FusedGemmCL(_GemmCL, FusedGemm):
    """The device Gemm with an activation in its epilogue. Its CPU fallback is FusedGemm's
    run, which applies the activation (FusedGemm comes after _GemmCL in the MRO, so the CPU
    kernel's own super() still reaches the CPU Gemm)."""

    def setup(self):
        super().setup()
        self.epilogue_activation = activation_code(self.activation_name, self.activation_args)


@register("FusedMatMul", versions=[1], domain=DOMAIN, backend="opencl")
class FusedMatMulCL(FusedMatMul):
    dtypes = FLOAT_TYPES

    def setup(self):
        super().setup()
        self._bpack = CachedPack()  # packed B, kept while it is the same constant
        self._act = activation_code(self.activation_name, self.activation_args)

    def run(self, a, b, bias=None, z=None):
        args = (a, b, bias, z)
        if a.dtype not in FLOAT_TYPES or any(v is not None and v.dtype != a.dtype
                                             for v in (b, bias, z)) \
                or a.ndim == 0 or b.ndim == 0 or (a.ndim == 1 and b.ndim == 1):
            return self.run_on_cpu(*args)
        if a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise self.fail(f"shapes {a.shape} and {b.shape} are not aligned")
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            raise self.fail(f"batch dimensions of {a.shape} and {b.shape} do not broadcast") \
                from None
        out_shape = tuple(batch) + tuple(a.shape[-2:-1]) + tuple(b.shape[-1:] if b.ndim > 1
                                                                 else ())
        if bias is not None:
            # the GEMM epilogue reads a bias that is one value or a vector over the last axis
            # (any leading size-1 axes that do not add dimensions); the CPU broadcasts the rest
            row = bias.size == out_shape[-1] and bias.ndim <= len(out_shape) and \
                all(d == 1 for d in bias.shape[:-1])
            if not row and bias.size != 1 or bias.ndim > len(out_shape):
                return self.run_on_cpu(*args)
        if z is not None and tuple(z.shape) != out_shape:
            raise self.fail(f"residual Z has shape {tuple(z.shape)}, the result {out_shape}")
        y = _matmul_device(self, a, b, bias, z, self._act)
        return self.run_on_cpu(*args) if y is None else y

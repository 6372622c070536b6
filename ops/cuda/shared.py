"""Shared CUDA kernels: the CPU kernels of these families, bound to cupy (see _common.py).

Where an op is plain array code, its CUDA kernel is the CPU kernel itself over the cupy array
namespace: elementwise math and activations, MatMul/Gemm/Einsum (cupy.matmul/einsum: cuBLAS),
reductions and softmax, normalisations, data movement (reshape, transpose, slice, concat,
gather/scatter, pad...), pooling and convolution, resize/grid-sample, RNNs, DFT/windows,
(de)quantisation, attention, and the simplifier's ai.ember fused Conv/Gemm/MatMul. Ops with a
native CUDA C kernel (the other modules in this package) are registered first and keep their
versions.

Every op of the listed families runs here except those in EXCLUDED (host-only semantics:
strings, random numbers, data-dependent output shapes computed with Python loops, ...).
"""
from __future__ import annotations

from ember.ops import (activations, attention, conv, elementwise, fused, image, indexing, linalg,
                       loss, normalization, pool, quantize, reduction, rnn, shape, signal, tensor)
from ember.ops.microsoft import attention as ms_attention
from ember.ops.microsoft import fused as ms_fused
from ember.ops.microsoft import lowbit as ms_lowbit
from ember.ops.microsoft import misc as ms_misc
from ember.ops.microsoft import quantized as ms_quantized
from ember.ops.cuda import conv as _native_conv  # noqa: F401  (native kernels register first)
from ember.ops.cuda import elementwise as _native_elementwise  # noqa: F401
from ember.ops.cuda._common import register_shared
from ember.ops.registry import OpImpl

FAMILIES = (elementwise, activations, linalg, reduction, normalization, shape, tensor, indexing,
            pool, conv, attention, loss, image, rnn, signal, quantize, fused,
            ms_attention, ms_fused, ms_lowbit, ms_misc, ms_quantized)

# Ops of those families that stay on the host.
EXCLUDED = frozenset({
    "Shape", "Size",            # metadata: the executor runs them on the host anyway
    "Constant",                 # values are made on the host and uploaded once
    "StringConcat",
    "Unique", "NonZero",        # data-dependent shapes from host-side loops
    "Dropout",                  # random masks use numpy's generator
    "BitCast",                  # reinterprets host bytes
    "ImageDecoder",
})

def _cpu_classes():
    for module in FAMILIES:
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, OpImpl) and value.op_type \
                    and value.backend == "cpu" and value.__module__ == module.__name__ \
                    and value.versions and value.op_type not in EXCLUDED:
                yield value


REGISTERED = []
for _cls in _cpu_classes():
    _new = register_shared(_cls)
    if _new is not None:
        REGISTERED.append(_new)

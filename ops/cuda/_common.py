"""Shared pieces of the CUDA kernels (cupy). Imports no cupy at module level: kernel modules must
import on machines without it, so the ops table can list what the backend supports.

Two kinds of CUDA kernels live in ops/cuda/:

* Shared kernels: where an op is plain array code, the CUDA kernel *is* the CPU kernel, bound at
  plan time to the cupy namespace: CPU kernels compute over `self.xp` (OpImpl.xp), numpy on the
  CPU and cupy here, and branch openly where cupy differs (ops/_xp.py). `shared_class(cpu_cls)`
  is a plain subclass that keeps the CPU class's shape inputs on the host and refuses, at plan
  time, dtypes cupy has no arrays of.
* Native kernels: CUDA C through cupy.RawKernel / cupy.ElementwiseKernel. Every CUDA C source is
  a module-level string listed in its module's `CUDA_SOURCES` dict ({name: full source}) so
  tests/devices/test_cuda_sources.py can compile all of them with NVRTC on machines without a GPU.
"""
from __future__ import annotations

import functools

import numpy as np

# dtypes that move to the device; everything else (strings, objects, ml_dtypes such as
# bfloat16 and the float8s) stays on the host and the kernels that meet it fall back to the CPU.
DEVICE_DTYPES = frozenset(np.dtype(t) for t in (
    np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.uint16, np.int32,
    np.uint32, np.int64, np.uint64, np.bool_, np.complex64, np.complex128))

FLOAT_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})
# numpy dtype -> CUDA C type, for templated kernels
C_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
           np.dtype(np.float16): "__half"}


def cupy():
    import cupy as cp
    return cp


def native_kernels(xp) -> bool:
    """Whether CUDA C kernels can run on the cupy module `xp`: False under the test suite's
    numpy stand-in for cupy (tests/_fake_cupy.py) unless it emulates them; the shared array code
    runs instead."""
    return not getattr(xp, "_EMBER_FAKE", False) or getattr(xp, "_EMBER_EMULATE_KERNELS", False)


# ---------------------------------------------------------------------------- shared kernels

class SharedKernel:
    """Mixin of the shared CUDA classes: the CPU class's own code, which computes over
    `self.xp` (cupy here, bound at plan time; see ops/_xp.py). The CPU class's shape inputs
    stay host arrays."""

    cpu_class: type = None  # type: ignore[assignment]

    @classmethod
    def refuses(cls, input_dtypes: list, output_dtypes: list = ()) -> str:
        # strings, objects and ml_dtypes (bfloat16, float8s, 4-bit ints) have no cupy arrays:
        # a node that reads or makes one is placed on the CPU

        for dtype in (*input_dtypes, *output_dtypes):
            if dtype is not None and dtype not in DEVICE_DTYPES:
                return f"dtype {dtype} (cupy has no such arrays)"
        return super().refuses(input_dtypes, output_dtypes)


def _uncached_weight(self, w, convert, *extra):
    """The conv family's weight cache keys on read-only numpy constants; device weights are
    converted per call (an on-device cast/reshape, usually a no-op)."""
    return convert(w)


def shared_class(cpu_cls: type, **extra) -> type:
    """A subclass of `cpu_cls` for the cuda backend, running its code over cupy (not
    registered)."""
    if hasattr(cpu_cls, "cached_weight"):
        extra.setdefault("cached_weight", _uncached_weight)
    extra.setdefault("host_inputs", cpu_cls.shape_inputs)
    return type(f"{cpu_cls.__name__}CUDA", (SharedKernel, cpu_cls),
                {"__module__": __name__, "cpu_class": cpu_cls, **extra})


def register_shared(cpu_cls: type, **extra) -> type | None:
    """Register `cpu_cls`'s code over cupy for the cuda backend, for every version it is
    registered at on the CPU that no native CUDA kernel already claims."""
    from ember.ops.registry import register, versions_registered

    taken = set(versions_registered(cpu_cls.domain, cpu_cls.op_type, "cuda"))
    versions = [v for v in cpu_cls.versions if v not in taken]
    if not versions:
        return None
    cls = shared_class(cpu_cls, **extra)
    return register(cpu_cls.op_type, versions=versions, domain=cpu_cls.domain,
                    backend="cuda")(cls)


def reset_kernels() -> None:
    """Forget compiled kernels (for tests that swap the `cupy` module)."""
    elementwise_kernel.cache_clear()
    raw_kernel.cache_clear()


# ------------------------------------------------------------------------- native kernels

def elementwise_source(name: str, in_params: str, out_params: str, body: str,
                       preamble: str = "") -> str:
    """An ElementwiseKernel's body wrapped into a full __global__ function (flat, contiguous
    arrays of the declared types; `i` the element index), the form NVRTC compiles in the
    sources test. cupy builds its own wrapper from the same parts at run time."""
    params, bind = [], []
    for decl in (p.strip() for p in (in_params + "," + out_params).split(",") if p.strip()):
        ctype, pname = decl.rsplit(" ", 1)
        if ctype.startswith("raw "):
            ctype = ctype[4:]
        params.append(f"{ctype}* __restrict__ {pname}_ptr")
        bind.append(f"{ctype}& {pname} = {pname}_ptr[i];")
    return (f"{preamble}\nextern \"C\" __global__ void {name}({', '.join(params)}, "
            f"long long n) {{\n  for (long long i = blockIdx.x * (long long)blockDim.x + "
            f"threadIdx.x; i < n; i += (long long)blockDim.x * gridDim.x) {{\n    "
            + "\n    ".join(bind) + f"\n    {body}\n  }}\n}}\n")


@functools.lru_cache(maxsize=None)
def elementwise_kernel(in_params: str, out_params: str, body: str, name: str,
                       preamble: str = ""):
    return cupy().ElementwiseKernel(in_params, out_params, body, name, preamble=preamble)


@functools.lru_cache(maxsize=None)
def raw_kernel(source: str, name: str):
    return cupy().RawKernel(source, name, options=("--std=c++14",))


def launch(knl, n: int, *args, block: int = 256) -> None:
    """Run RawKernel `knl` over `n` threads (1-D grid)."""
    grid = max(1, min((int(n) + block - 1) // block, 65535 * 16))
    knl((grid,), (block,), args)

"""Optional compiled CPU kernels: loop-shaped kernels compiled by numba where it is installed
(`pip install ember[fast]`), the numpy kernels serving where it is not, or with EMBER_NUMBA=0.

    kernel = jit(_my_loops)              # None without numba
    if kernel is not None:
        split_rows(kernel, rows, *args, ns_per_row=...)  # kernel(*args, row0, row1), threaded

A kernel is compiled on first use, once per argument types, and cached on disk by numba (next
to its source, or in numba's user-wide cache directory): a later process loads it (~0.5 s with
numba's import) instead of compiling it again (a few seconds). Kernels release the GIL and
compute each output element with the same expression whatever the split, so a run gives the
same bits on one thread or several.

Threads: `split_rows` cuts the rows into one piece per thread of the run in flight
(ember.runtime.threads) and runs them on a small pool of ours. numba's own `parallel=True`
loops were slower here: numba's workers and OpenBLAS's competed for the cores from one node
to the next. The pool's idle threads wait on a queue and use no CPU.

Math for kernels: `exp_float32` and `tanh_float32` are float32 functions that LLVM inlines
and vectorises in a kernel's loop (the C library's expf / tanhf are scalar calls, 5-30 ns each
here; these cost 2-4 ns an element, half of numpy's float32 exp / tanh). Plain Python
functions, callable from Python too; `jit` registers them with numba before it compiles a
kernel. Both are within 2 ulp of the correctly rounded result; exp_float32 flushes results
below 2**-124 (x < -86) to zero. Other modules declare such functions with `kernel_math`
(activations.py's float32 GELU, which the GELU kernel and the fused epilogue share).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

_OPTIONS = dict(cache=True, nogil=True, boundscheck=False, error_model="numpy")
_compiled: dict[Callable, Any] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def enabled() -> bool:
    return os.environ.get("EMBER_NUMBA", "1").lower() not in ("0", "", "false", "no")


def jit(loops: Callable, **options: Any) -> Any:
    """`loops` compiled by numba (lazily, per argument types), or None where numba is not
    installed or EMBER_NUMBA=0. Options beyond ember's defaults (fastmath=...) are numba's."""
    if loops not in _compiled:
        kernel = None
        if enabled():
            try:
                import numba
            except ImportError:
                numba = None
            if numba is not None:
                _register_math(numba)
                kernel = numba.njit(**_OPTIONS, **options)(loops)
        _compiled[loops] = kernel
    return _compiled[loops]


# A kernel is split among threads only where each piece has at least this much work. Below
# it, handing pieces to our pool costs more than it saves: after every BLAS product
# OpenBLAS's workers spin for up to ~0.1 ms (ember.runtime.threads) on the very cores our
# pool's threads would need, so a piece handed over right after a GEMM may wait that long.
# Measured on MobileNetV2 (2 cores, runs paired in two processes): splitting every kernel of
# at least 16k values, as before, was 10% slower than this; 60 us was 1-4% faster than
# 250 us on MobileNetV2 and UNet.
MIN_PIECE_NS = 60_000


def split_rows(kernel: Callable, rows: int, *args: Any, ns_per_row: float) -> None:
    """kernel(*args, row0, row1) over rows [0, rows): one piece per thread of the run in
    flight, but no more pieces than leave each MIN_PIECE_NS of work by the estimate
    `ns_per_row` (the kernel's time per row on one core, roughly); the calling thread does
    the first piece."""
    parts = max(1, min(_run_threads(), int(rows * ns_per_row // MIN_PIECE_NS)))
    if parts == 1:  # most calls: no lists, no pool
        kernel(*args, 0, rows)
        return
    bounds = [rows * i // parts for i in range(parts + 1)]
    jobs = [_thread_pool().submit(kernel, *args, bounds[i], bounds[i + 1])
            for i in range(1, parts)]
    kernel(*args, bounds[0], bounds[1])
    for job in jobs:
        job.result()


_threads: Any = None  # ember.runtime.threads


def _run_threads() -> int:
    global _threads
    if _threads is None:  # imported on first use: ember.runtime imports the ops
        from ember.runtime import threads
        _threads = threads
    return _threads.run_threads()


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1),
                                           thread_name_prefix="ember-kernel")
    return _pool


# ------------------------------------------------------------------ math for kernels
def float32_from_bits(bits):
    """The float32 whose bit pattern is the int32 `bits`."""
    return np.int32(bits).view(np.float32)


# exp: x = k ln2 + r (ln2 split in two for an exact k ln2), e^r by Cephes' expf polynomial on
# |r| <= ln2 / 2, 2^k built in the exponent bits (as 2^(k-1) * 2, so k = 128 stays finite).
_LOG2E, _LN2_HI, _LN2_LO = np.float32(1.4426950408889634), np.float32(0.693359375), \
    np.float32(-2.12194440e-4)
_E0, _E1, _E2, _E3, _E4, _E5 = (np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))
_ROUND = np.float32(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds to an integer
_EXP_LO, _EXP_HI = np.float32(-86.0), np.float32(88.72283)


def exp_float32(x):
    """e^x in float32: 0 below -86, inf above log(FLT_MAX), NaN kept."""
    v = min(max(x, _EXP_LO), _EXP_HI)
    k = (v * _LOG2E + _ROUND) - _ROUND
    r = (v - k * _LN2_HI) - k * _LN2_LO
    p = ((((_E0 * r + _E1) * r + _E2) * r + _E3) * r + _E4) * r + _E5
    y = p * (r * r) + r + np.float32(1)
    y = y * float32_from_bits((np.int32(k) + np.int32(126)) << np.int32(23)) * np.float32(2)
    y = np.float32(0) if x < _EXP_LO else y
    y = np.float32(np.inf) if x > _EXP_HI else y
    return x if x != x else y


# tanh: Cephes' tanhf polynomial below 0.625 (no cancellation near 0), 1 - 2 / (e^2x + 1) above
_T0, _T1, _T2, _T3, _T4 = (np.float32(c) for c in (
    -5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
    -3.33332819422e-1))


def tanh_float32(x):
    """tanh(x) in float32, NaN kept."""
    a = abs(x)
    z = x * x
    small = ((((_T0 * z + _T1) * z + _T2) * z + _T3) * z + _T4) * z * x + x
    large = np.float32(1) - np.float32(2) / (exp_float32(a + a) + np.float32(1))
    large = large if x >= np.float32(0) else -large
    return small if a < np.float32(0.625) else large


_math_registered = False
_kernel_math: list[Callable] = [exp_float32, tanh_float32]  # callable from kernels
_kernel_math_registered: set[Callable] = set()


def kernel_math(fn: Callable) -> Callable:
    """Declare the plain Python function `fn` callable from compiled kernels (as exp_float32
    is); it stays callable from Python. numba learns it before it compiles the next kernel."""
    with _lock:
        _kernel_math.append(fn)
    return fn


def _register_math(numba: Any) -> None:
    """Make the math above, and each `kernel_math` function, callable from compiled kernels;
    each once per process."""
    global _math_registered
    from numba.extending import register_jitable
    with _lock:
        if not _math_registered:
            from llvmlite import ir
            from numba.extending import intrinsic, overload

            @intrinsic
            def bitcast_int32_float32(typingctx, bits):
                def codegen(context, builder, signature, args):
                    return builder.bitcast(args[0], ir.FloatType())
                return numba.types.float32(numba.types.int32), codegen

            @overload(float32_from_bits)
            def _float32_from_bits(bits):
                return lambda bits: bitcast_int32_float32(np.int32(bits))

            _math_registered = True
        for fn in _kernel_math:
            if fn not in _kernel_math_registered:
                register_jitable(fn)
                _kernel_math_registered.add(fn)

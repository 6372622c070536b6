"""Float products on ember's kernel pool: OpenBLAS's GEMM called on pieces of the product.

    y = _blas.matmul(a, b)          # np.matmul's result; on the pool where it applies

Why: a run alternates BLAS products with ember's compiled kernels, and each had a thread pool
of its own: OpenBLAS's workers, then ember's helpers (ops/_compiled.py). Each sleeps shortly
after its own work, so each product and each split kernel first waited for a sleeping thread
to wake (on a 2-vCPU KVM guest, 120-180 us: a small product's whole time), and a pool that
spun longer took the core the other pool needed. With the products on ember's pool there is
one pool, awake for the whole run: OpenBLAS runs on one thread during runs
(ember.runtime.threads.enter), and a product of at least PIECE_MACS multiply-adds a piece is
cut into one piece per thread of the run (its batch items, rows, or columns in blocks of 16),
each one sgemm / dgemm call (sgemv / dgemv for one row or column) with the GIL released,
taken by the caller and the helpers (each call from Python: ~5 us). Smaller products,
stacks of matrices of fewer than PIECE_MACS multiply-adds each, and GEMVs of fewer than
_GEMV_MIN_VALUES values run whole on the calling thread (np.matmul).

Measured on 2 vCPUs (Zen 3 KVM), the median ratio of times to OpenBLAS's own threads over
12-20 blocks of runs alternated in one process (EMBER_POOL_PRODUCTS switched between blocks),
b1: ResNet-50 0.81x, DistilBERT 0.89x, MobileNetV2 0.91x, BERT-small 0.91x, LSTM+GRU 0.98x,
UNet 1.01x, GPT-2's decoder step 1.01x; b8: MobileNetV2 0.89x, the decoder step 0.99x. Paired
processes gave BERT-small 0.85x, ResNet-50 0.88x, the decoder step 1.03x at b1 and 0.92x at b8.
The decoder step at batch 1 gains nothing: its products are GEMVs of 0.6-2.4 M values
(memory-bound: OpenBLAS's two threads read them 1.2-1.5x faster than one, but a piece handed
to the pool starts 100-170 us late, from Python), so they run whole on one thread.

The pieces are a function of the shape and the session's thread count only, never of which
thread takes them, so a session gives the same bits run after run, from any number of caller
threads; a session with another thread count may round differently (as with OpenBLAS's own
threads: see tests/test_threads_cpu.py).

Off (np.matmul, OpenBLAS's own threads) outside runs, where numba is not installed (the
helpers then sleep between jobs), where no OpenBLAS with its CBLAS symbols is loaded (numpy's
is preferred), or with EMBER_POOL_PRODUCTS=0. Operands that are not float32 / float64 with
one unit stride each, broadcast batches and empty products go to np.matmul.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from typing import Any

import numpy as np

from ember.ops import _compiled

# A product is cut only where each piece has at least this many multiply-adds: OpenBLAS's own
# threshold for a second thread (65536 * GEMM_MULTITHREAD_THRESHOLD, see ops/linalg.py)
PIECE_MACS = 1 << 18
_COLUMN_BLOCK = 16     # column pieces start at multiples of this (whole vector registers)
# A GEMV (one row or one column) is cut only from this many matrix values: it reads each
# value once, so a piece of a smaller one takes less time than the pool's helper takes to
# start it from Python (100-170 us on 2 vCPUs, Zen 3 KVM: a GEMV of 768 x 3072 took 470-700 us
# cut in two, 430-500 on one thread, 280-460 on OpenBLAS's two threads); from it (GPT-2's LM
# head, 768 x 50257) cut in two 4.9-5.8 ms, on one thread 7.2-8.4, OpenBLAS's two 3.7-5.3.
_GEMV_MIN_VALUES = 1 << 22
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


class _Blas:
    """The GEMMs and GEMVs of one loaded OpenBLAS through ctypes (which releases the GIL
    during the call), and the count of runs in flight (products split only during runs:
    outside them OpenBLAS has its own threads)."""

    def __init__(self, dynlib: Any, prefix: str, suffix: str, in_flight: np.ndarray):
        index = ctypes.c_int64 if "64" in suffix else ctypes.c_int
        self.gemm, self.gemv, self.in_flight = {}, {}, in_flight
        for dtype, letter, scalar in ((np.float32, "s", ctypes.c_float),
                                      (np.float64, "d", ctypes.c_double)):
            gemm = getattr(dynlib, f"{prefix}cblas_{letter}gemm{suffix}")
            gemm.restype = None
            gemm.argtypes = [ctypes.c_int] * 3 + [index] * 3 + [
                scalar, ctypes.c_void_p, index, ctypes.c_void_p, index,
                scalar, ctypes.c_void_p, index]
            gemv = getattr(dynlib, f"{prefix}cblas_{letter}gemv{suffix}")
            gemv.restype = None
            gemv.argtypes = [ctypes.c_int] * 2 + [index] * 2 + [
                scalar, ctypes.c_void_p, index, ctypes.c_void_p, index,
                scalar, ctypes.c_void_p, index]
            self.gemm[np.dtype(dtype)], self.gemv[np.dtype(dtype)] = gemm, gemv


@functools.lru_cache(maxsize=1)
def _blas() -> _Blas | None:
    """numpy's OpenBLAS's GEMMs and GEMVs, or None where products stay with np.matmul (see
    the module's docstring)."""
    if os.environ.get("EMBER_POOL_PRODUCTS", "1").lower() in ("0", "", "false", "no"):
        return None
    if _compiled.jit(_compiled.wait_for_job) is None:  # no numba: helpers sleep between jobs
        return None
    from ember.runtime import threads
    libs = [lib for lib in threads.blas_libraries() if lib.raw]
    libs.sort(key=lambda lib: "numpy" not in str(getattr(lib.controller, "filepath", "")))
    for lib in libs:
        for prefix, suffix in threads.AFFIXES:
            if getattr(lib.dynlib, f"{prefix}cblas_sgemm{suffix}", None) is not None:
                try:
                    return _Blas(lib.dynlib, prefix, suffix, threads.in_flight)
                except AttributeError:  # an sgemm without the rest
                    break
    return None


def enabled() -> bool:
    """Whether products run on ember's pool (OpenBLAS then keeps one thread during runs)."""
    return _blas() is not None


def _matrix(x: np.ndarray) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of the last two axes of x for CBLAS, row-major."""
    rows, cols = x.shape[-2:]
    s0, s1 = x.strides[-2:]
    size = x.itemsize
    if s1 == size and s0 % size == 0 and s0 >= max(1, cols) * size:
        return _NO_TRANS, s0 // size
    if s0 == size and s1 % size == 0 and s1 >= max(1, rows) * size:
        return _TRANS, s1 // size
    return None


def _batch_stride(x: np.ndarray) -> int | None:
    """The stride (bytes) from one matrix of x to the next, its leading axes taken as one
    (0 if there is one matrix), or None where no single stride steps through them."""
    axes = [(n, s) for n, s in zip(x.shape[:-2], x.strides[:-2]) if n != 1]
    for (n, s), (n_in, s_in) in zip(axes, axes[1:]):
        if s != s_in * n_in:
            return None
    return axes[-1][1] if axes else 0


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """np.matmul(a, b, out=out) for CPU arrays, on the kernel pool where it applies."""
    blas = _blas()
    pieces = 1
    layouts = _layouts(a, b, out) if blas is not None and blas.in_flight[0] else None
    if layouts is not None:
        M, K = a.shape[-2:]
        N = b.shape[-1]
        lead = _lead(a, b)
        batch = math.prod(lead)
        pieces = min(_compiled.run_threads(), batch * M * N * K // PIECE_MACS)
        if batch == 1 and min(M, N) == 1 and M * N * K < _GEMV_MIN_VALUES:
            pieces = 1
        elif batch > 1 and M * N * K < PIECE_MACS:
            pieces = 1  # small matrices (a decoder step's attention): numpy loops over them in C
    if pieces <= 1:  # on one thread: numpy's call is the shortest way to BLAS
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    if out is None:
        out = np.empty(lead + (M, N), a.dtype)
    if batch > 1:
        axis, count = _BATCH, batch
    elif M >= N:  # cut the longer side: each piece packs all of the other operand
        axis, count = _ROWS, M
    else:
        axis, count = _COLUMNS, -(-N // _COLUMN_BLOCK)
    pieces = min(pieces, count)
    bounds = [count * i // pieces for i in range(pieces + 1)]
    if axis == _COLUMNS:
        bounds = [min(N, c * _COLUMN_BLOCK) for c in bounds]
    (ta, lda, sa), (tb, ldb, sb) = layouts
    product = (blas.gemm[a.dtype], blas.gemv[a.dtype], M, N, K,
               _address(a), ta, lda, sa, _address(b), tb, ldb, sb,
               _address(out), out.strides[-2] // out.itemsize, _batch_stride(out),
               a.itemsize, a.dtype.type(1), a.dtype.type(0))
    _compiled.split_rows(_run_pieces, pieces, *product, axis, bounds,
                         ns_per_row=_compiled.MIN_PIECE_NS)
    return out


def _address(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]  # x.ctypes.data costs ~5 us


def product(xp: Any, a, b):
    """xp.matmul(a, b), on the kernel pool where xp is numpy and it applies."""
    return matmul(a, b) if xp is np else xp.matmul(a, b)


def _lead(a: np.ndarray, b: np.ndarray) -> tuple[int, ...]:
    """The product's leading (batch) shape: both operands', or the one of a matrix by a
    stack of them (the matrix then has batch stride 0)."""
    return a.shape[:-2] if a.ndim > 2 else b.shape[:-2]


def _layouts(a, b, out) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
    """(transpose flag, leading dimension, batch stride) of a and of b, where the pieces can
    address a, b and out: float32 or float64, each matrix with one unit stride, the batches
    the same (or one side a single matrix), out not overlapping the operands, and nothing
    empty; None where they cannot."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.ndim < 2 \
            or b.ndim < 2 or a.dtype != b.dtype or a.dtype not in _DTYPES:
        return None
    if (a.ndim > 2 and b.ndim > 2 and a.shape[:-2] != b.shape[:-2]) \
            or a.shape[-1] != b.shape[-2] or 0 in a.shape or 0 in b.shape:
        return None
    matrix_a, matrix_b = _matrix(a), _matrix(b)
    stride_a, stride_b = _batch_stride(a), _batch_stride(b)
    if matrix_a is None or matrix_b is None or stride_a is None or stride_b is None:
        return None
    layouts = (*matrix_a, stride_a), (*matrix_b, stride_b)
    if out is None:
        return layouts
    if not (isinstance(out, np.ndarray) and out.dtype == a.dtype and out.flags.writeable
            and out.shape == _lead(a, b) + (a.shape[-2], b.shape[-1])
            and _matrix(out) == (_NO_TRANS, out.strides[-2] // out.itemsize)):
        return None
    stride = _batch_stride(out)
    one_matrix = out.size == out.shape[-2] * out.shape[-1]
    if stride is None or (stride == 0 and not one_matrix) or np.may_share_memory(out, a) \
            or np.may_share_memory(out, b):
        return None
    return layouts


_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_BATCH, _ROWS, _COLUMNS = range(3)


def _run_pieces(gemm, gemv, M, N, K, pa, ta, lda, sa, pb, tb, ldb, sb, pc, ldc, sc, size,
                one, zero, axis, bounds, p0, p1):
    """Pieces [p0, p1) of the product (pointers pa, pb, pc; batch strides sa, sb, sc in bytes;
    leading dimensions in elements): batch items, rows of a and the output, or columns of b
    and the output, as `bounds` cuts them along `axis`."""
    for p in range(p0, p1):
        lo, hi = bounds[p], bounds[p + 1]
        if axis == _BATCH:
            for i in range(lo, hi):
                _product(gemm, gemv, M, N, K, pa + i * sa, ta, lda, pb + i * sb, tb, ldb,
                         pc + i * sc, ldc, one, zero)
        elif axis == _ROWS:
            step = lda if ta == _NO_TRANS else 1
            _product(gemm, gemv, hi - lo, N, K, pa + lo * step * size, ta, lda, pb, tb, ldb,
                     pc + lo * ldc * size, ldc, one, zero)
        else:
            step = 1 if tb == _NO_TRANS else ldb
            _product(gemm, gemv, M, hi - lo, K, pa, ta, lda, pb + lo * step * size, tb, ldb,
                     pc + lo * size, ldc, one, zero)


def _product(gemm, gemv, M, N, K, pa, ta, lda, pb, tb, ldb, pc, ldc, one, zero):
    """C (M, N) = A (M, K) @ B (K, N), row-major with transpose flags: a GEMV where a side is
    one long (OpenBLAS's GEMM would pack all of the matrix for one row or column of work)."""
    if M == 1:  # C's row = B^T a's row
        incx = 1 if ta == _NO_TRANS else lda
        if tb == _NO_TRANS:
            gemv(_ROW_MAJOR, _TRANS, K, N, one, pb, ldb, pa, incx, zero, pc, 1)
        else:
            gemv(_ROW_MAJOR, _NO_TRANS, N, K, one, pb, ldb, pa, incx, zero, pc, 1)
    elif N == 1:  # C's column = A b's column
        incx = ldb if tb == _NO_TRANS else 1
        if ta == _NO_TRANS:
            gemv(_ROW_MAJOR, _NO_TRANS, M, K, one, pa, lda, pb, incx, zero, pc, ldc)
        else:
            gemv(_ROW_MAJOR, _TRANS, K, M, one, pa, lda, pb, incx, zero, pc, ldc)
    else:
        gemm(_ROW_MAJOR, ta, tb, M, N, K, one, pa, lda, pb, ldb, zero, pc, ldc)

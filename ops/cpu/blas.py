"""Float products on ember's kernel pool: OpenBLAS's GEMM called on pieces of the product.

    y = _blas.matmul(a, b)          # np.matmul's result; on the pool where it applies

Why: a run alternates BLAS products with ember's compiled kernels, and each had a thread pool
of its own: OpenBLAS's workers, then ember's helpers (ops/cpu/compiled.py). Each sleeps shortly
after its own work, so each product and each split kernel first waited for a sleeping thread
to wake (often a small product's whole time), and a pool that spun longer took the core the
other pool needed. With the products on ember's pool there is one pool, awake for the whole
run: OpenBLAS runs on one thread during runs (the engine's `enter`, ember.ops.cpu.engine),
and a product of at least PIECE_MACS multiply-adds a piece (ops/cpu/tuning.py) is cut into
one piece per thread of the run (its batch items, rows, or columns in blocks of 16), each one
sgemm / dgemm call (sgemv / dgemv for one row or column). Smaller products, stacks of
matrices of fewer than PIECE_MACS multiply-adds each, and GEMVs of fewer than GEMV_MIN_VALUES
values run whole on the calling thread (np.matmul).

How a product is cut depends on its shapes, strides, dtype and the thread count alone, so
it is decided once per such geometry (`_plan`, kept; a call then only fills in the three
addresses): deciding is slow beside a small product's own time, and a run repeats its shapes.

No Python between the pieces: the caller posts the product on the board (an int64 array of
its pointers, shape and cuts), and compiled code takes the pieces, on the caller's thread
and on each helper that is waiting for a job (the helpers watch the board while they spin,
GIL released: `wait_for_job_or_pieces`); CBLAS is called from compiled code through names
registered with LLVM. A helper handed a Python job instead needs the GIL back first, which
the caller holds until its own piece starts: it starts late by a small product's whole
time. The board carries the pieces of split compiled kernels too (ops/cpu/compiled.py's
piece functions: `run_pieces`).

The pieces are a function of the shape and the session's thread count only, never of which
thread takes them, so a session gives the same bits run after run, from any number of caller
threads; a session with another thread count may round differently (as with OpenBLAS's own
threads: see tests/cpu/test_threads_cpu.py).

Off (np.matmul, OpenBLAS's own threads) outside runs, where numba is not installed (the
helpers then sleep between jobs), where no OpenBLAS with 64-bit integers and its CBLAS symbols
is loaded (numpy 2's is one; numpy's is preferred), or with EMBER_POOL_PRODUCTS=0. Operands
that are not float32 / float64 with one unit stride each, broadcast batches and empty
products go to np.matmul.
"""
from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import numpy as np

from ember import config
from ember.ops.cpu import compiled as _compiled, threads as _threads, tiles as _tiles, tuning
from ember.ops.cpu.process import current

_address = _compiled.address  # an array's data pointer

_COLUMN_BLOCK = 16     # column pieces start at multiples of this (whole vector registers)
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


class _Blas:
    """One loaded OpenBLAS with 64-bit integers (numpy's): its GEMMs and GEMVs (ctypes
    function objects, whose addresses compiled code calls: _register_cblas)."""

    def __init__(self, dynlib: Any, prefix: str, suffix: str):
        self.gemm = {np.dtype(t): getattr(dynlib, f"{prefix}cblas_{letter}gemm{suffix}")
                     for t, letter in ((np.float32, "s"), (np.float64, "d"))}
        self.gemv = {np.dtype(t): getattr(dynlib, f"{prefix}cblas_{letter}gemv{suffix}")
                     for t, letter in ((np.float32, "s"), (np.float64, "d"))}


# Cached for the process, not kept by the engine: the library is the process's, and its
# functions are registered with LLVM under fixed names once per process (_register_cblas).
@functools.lru_cache(maxsize=1)
def _blas() -> _Blas | None:
    """numpy's OpenBLAS's GEMMs and GEMVs, or None where products stay with np.matmul (see
    the module's docstring)."""
    if not config.switch("EMBER_POOL_PRODUCTS", True):
        return None
    if _compiled.jit(_compiled.wait_for_job) is None:  # no numba: helpers sleep between jobs
        return None
    libs = [lib for lib in current().libraries() if lib.raw]
    libs.sort(key=lambda lib: "numpy" not in str(getattr(lib.controller, "filepath", "")))
    for lib in libs:
        for prefix, suffix in _threads.AFFIXES:
            if "64" in suffix and getattr(lib.dynlib, f"{prefix}cblas_sgemm{suffix}", None) \
                    is not None:
                try:
                    blas = _Blas(lib.dynlib, prefix, suffix)
                except AttributeError:  # an sgemm without the rest
                    break
                _register_cblas(blas)
                return blas
    return None


def enabled() -> bool:
    """Whether products run on ember's pool (OpenBLAS then keeps one thread during runs)."""
    return _blas() is not None


def in_run() -> bool:
    """Whether products go on the board now: enabled, and a run is in flight (products are
    cut only during runs: outside them OpenBLAS has its own threads)."""
    return _blas() is not None and bool(current().in_flight[0])


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """np.matmul(a, b, out=out) for CPU arrays, on the kernel pool where it applies."""
    plan = _plan_of(a, b, out)
    if plan is None:  # on one thread: numpy's call is the shortest way to BLAS
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    shape, fields = plan
    if out is None:
        out = _tiles.empty(shape, a.dtype)
    _on_board(_with_addresses(fields, a, b, out))
    return out


def product_fields(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray | None:
    """The board's fields (from _KIND on, addresses filled in) for out = a @ b where `matmul`
    would cut it into pieces on the board, else None: for a kernel that runs the pieces
    itself (`product_piece`) and does more on each (ops/_epilogue.py's epilogue)."""
    plan = _plan_of(a, b, out)
    return None if plan is None else _with_addresses(plan[1], a, b, out)


def _plan_of(a, b, out):
    """`_plan` for these operands during a run, or None (also where out overlaps them)."""
    if _blas() is None or not (engine := current()).in_flight[0] \
            or not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray) \
            or not (out is None or isinstance(out, np.ndarray)):
        return None
    plan = _plan(a.shape, a.strides, b.shape, b.strides, a.dtype, b.dtype,
                 None if out is None else (out.shape, out.strides, out.dtype),
                 engine.run_threads())
    if plan is not None and out is not None and (
            not out.flags.writeable or np.may_share_memory(out, a)
            or np.may_share_memory(out, b)):
        return None
    return plan


def _with_addresses(fields, a, b, out):
    product = fields.copy()
    product[_PA - _KIND] = _address(a)
    product[_PB - _KIND] = _address(b)
    product[_PC - _KIND] = _address(out)
    return product


@functools.lru_cache(maxsize=4096)
def _plan(a_shape, a_strides, b_shape, b_strides, a_dtype, b_dtype, out_geometry, threads):
    """How a product of these shapes, strides and dtypes is cut, decided once per geometry
    (a run repeats its shapes, and deciding is slow beside a small product's time): (out's
    shape, the board's
    fields from _KIND on with the three addresses 0), or None where np.matmul does it whole.
    `out_geometry` is out's (shape, strides, dtype), None for a new C-ordered out."""
    if a_dtype != b_dtype or a_dtype not in _DTYPES or len(a_shape) < 2 or len(b_shape) < 2:
        return None
    if (len(a_shape) > 2 and len(b_shape) > 2 and a_shape[:-2] != b_shape[:-2]) \
            or a_shape[-1] != b_shape[-2] or 0 in a_shape or 0 in b_shape:
        return None  # broadcast batches, a shape error, or nothing to compute
    M, K = a_shape[-2:]
    N = b_shape[-1]
    lead = a_shape[:-2] if len(a_shape) > 2 else b_shape[:-2]
    batch = math.prod(lead)
    pieces = min(threads, batch * M * N * K // tuning.PIECE_MACS)
    if batch == 1 and min(M, N) == 1 and M * N * K < tuning.GEMV_MIN_VALUES:
        return None  # a GEMV reads each value once from memory: a small one gains no thread
    if batch > 1 and M * N * K < tuning.PIECE_MACS:
        return None  # small matrices (a decoder step's attention): numpy loops over them in C
    if pieces <= 1:
        return None
    size = a_dtype.itemsize
    shape = lead + (M, N)
    if out_geometry is None:
        out_strides = tuple(size * math.prod(shape[i + 1:]) for i in range(len(shape)))
    else:
        out_shape, out_strides, out_dtype = out_geometry
        if out_dtype != a_dtype or out_shape != shape:
            return None
    matrix_a, matrix_b = _matrix(a_shape, a_strides, size), _matrix(b_shape, b_strides, size)
    stride_a, stride_b = _batch_stride(a_shape, a_strides), _batch_stride(b_shape, b_strides)
    stride_c = _batch_stride(shape, out_strides)
    if None in (matrix_a, matrix_b, stride_a, stride_b, stride_c) \
            or _matrix(shape, out_strides, size) != (_NO_TRANS, out_strides[-2] // size) \
            or (stride_c == 0 and batch > 1):
        return None
    (ta, lda), (tb, ldb) = matrix_a, matrix_b
    if batch > 1:
        axis, count = _BATCH, batch
    elif M >= N or (M >= tuning.ROWS_CUT_MIN_ROWS
                    and K * N * size <= tuning.ROWS_CUT_MAX_WEIGHT_BYTES):
        # rows: the longer side (each piece packs all of the other operand), or many rows by
        # small weights even where there are more columns: the ops around mostly cut rows
        # too (pixels, tokens), and the caller takes the first pieces, a helper the last (the
        # board), so each thread reads rows its own core wrote; cut into columns, every row's
        # halves came from both cores
        axis, count = _ROWS, M
    else:
        axis, count = _COLUMNS, -(-N // _COLUMN_BLOCK)
    pieces = min(pieces, count, _MAX_PIECES)
    bounds = [count * i // pieces for i in range(pieces + 1)]
    if axis == _COLUMNS:
        bounds = [min(N, c * _COLUMN_BLOCK) for c in bounds]
    fields = np.array([0 if a_dtype == np.float32 else 1, M, N, K, 0, ta, lda, stride_a,
                       0, tb, ldb, stride_b, 0, out_strides[-2] // size, stride_c, size, axis,
                       pieces, *bounds], np.int64)
    fields.flags.writeable = False
    return shape, fields


def _matrix(shape, strides, size) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of the last two axes for CBLAS, row-major."""
    rows, cols = shape[-2:]
    s0, s1 = strides[-2:]
    if s1 == size and s0 % size == 0 and s0 >= max(1, cols) * size:
        return _NO_TRANS, s0 // size
    if s0 == size and s1 % size == 0 and s1 >= max(1, rows) * size:
        return _TRANS, s1 // size
    return None


def _batch_stride(shape, strides) -> int | None:
    """The stride (bytes) from one matrix to the next, the leading axes taken as one (0 if
    there is one matrix), or None where no single stride steps through them."""
    axes = [(n, s) for n, s in zip(shape[:-2], strides[:-2]) if n != 1]
    for (n, s), (n_in, s_in) in zip(axes, axes[1:]):
        if s != s_in * n_in:
            return None
    return axes[-1][1] if axes else 0


def _on_board(product: np.ndarray) -> int:
    """Run `product` (the board's fields from _KIND on) on the engine's shared board, whose
    pieces the helpers take too; if another thread's product is on it, the same pieces on
    this thread alone (its own board: the same bits). Returns the pieces this thread ran."""
    post_and_run = _compiled.jit(_post_and_run)
    pool = current().pool
    if pool.board_lock.acquire(blocking=False):
        try:
            _compiled.rouse_helpers(pool.helpers())
            return post_and_run(pool.board, product)
        finally:
            pool.board_lock.release()
    board = getattr(pool.private, "board", None)
    if board is None:
        board = pool.private.board = new_board()
    return post_and_run(board, product)


def product(xp: Any, a, b):
    """xp.matmul(a, b), on the kernel pool where xp is numpy and it applies."""
    return matmul(a, b) if xp is np else xp.matmul(a, b)


def run_pieces(piece: int, block: np.ndarray, bounds: list[int]) -> int:
    """A split kernel's pieces on the board (ops/cpu/compiled.py's split_rows): the piece
    function at address `piece` on `block`, rows [bounds[i], bounds[i + 1]) each, taken by
    this thread and the helpers. Returns the pieces this thread ran."""
    product = _kernel_fields(piece, tuple(bounds)).copy()
    product[_PB - _KIND] = _address(block)
    return _on_board(product)


@functools.lru_cache(maxsize=4096)
def _kernel_fields(piece: int, bounds: tuple[int, ...]) -> np.ndarray:
    """The board's fields (from _KIND on) for a split kernel's pieces, the block's address
    0: made once per piece function and cut (a call repeats both)."""
    pieces = len(bounds) - 1
    product = np.zeros(_BOUNDS - _KIND + pieces + 1, np.int64)
    product[0] = _KERNEL
    product[_PA - _KIND] = piece
    product[_PIECES - _KIND] = pieces
    product[_BOUNDS - _KIND:] = bounds
    product.flags.writeable = False
    return product


_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_KERNEL = 2  # the board's kind for a split kernel's pieces (0, 1: float32, float64 products)
_BATCH, _ROWS, _COLUMNS = range(3)

# ------------------------------------------------------------------ the board
# A product's pieces are run by compiled code: the caller posts the product on the board (an
# int64 array the helpers watch while they wait for jobs, GIL released: `wait_for_job_or_pieces`)
# and takes pieces itself; each helper that is spinning takes pieces too, never entering
# Python. Fields: the generation (odd while the product is being written), the helpers reading
# it, the pieces claimed, the pieces done, then the product (_KIND ... _BOUNDS).
#
# The caller takes pieces from the first on, the helpers from the last back, until they meet:
# both counts in one int64 (`_CLAIMS`: from the front in the low 32 bits, from the back in the
# high), so one atomic add claims a piece and sees every claim before it. Kernels cut rows
# (pixels, tokens) into pieces in order, so the caller keeps to the first rows of every op and
# a helper to the last: the rows an op reads are mostly those its thread wrote in the op
# before, in its own core's cache. Taken in turn from one counter, a thread's rows changed
# from op to op, and reading another core's writes cost more than the turns saved.
(_GEN, _USERS, _CLAIMS, _DONE, _KIND, _M, _N, _K, _PA, _TA, _LDA, _SA, _PB, _TB, _LDB, _SB, _PC,
 _LDC, _SC, _SIZE, _AXIS, _PIECES, _BOUNDS) = range(23)
_MAX_PIECES = 256
_BACK_CLAIM, _FRONT_MASK = 1 << 32, (1 << 32) - 1
# where a product's fields (product_fields) hold its shape, addresses and cuts
M_FIELD, N_FIELD, A_FIELD, C_FIELD, BOUNDS_FIELD = (i - _KIND for i in (_M, _N, _PA, _PC,
                                                                      _BOUNDS))


def new_board() -> np.ndarray:
    """An empty board: the engine's shared one (ember.ops.cpu.engine.Pool, with the lock
    that keeps one product on it at a time), or a caller's own when that one is taken."""
    return np.zeros(_BOUNDS + _MAX_PIECES + 1, np.int64)


# CBLAS's functions as compiled code calls them (numba's ExternalFunction): set by _register_cblas
sgemm = dgemm = sgemv = dgemv = None


def _register_cblas(blas: _Blas) -> None:
    """Make the CBLAS functions above callable from compiled code: their addresses are
    registered with LLVM under fixed names, which compiled code calls (so numba's disk cache
    stays valid in another process, where the addresses differ)."""
    numba = _compiled._numba()
    import llvmlite.binding as llvm
    types = numba.types
    i32, i64, p = types.int32, types.int64, types.intp
    for dtype, scalar, letter in ((np.float32, types.float32, "s"),
                                  (np.float64, types.float64, "d")):
        for kind, fn, args in (
                ("gemm", blas.gemm[np.dtype(dtype)],
                 (i32, i32, i32, i64, i64, i64, scalar, p, i64, p, i64, scalar, p, i64)),
                ("gemv", blas.gemv[np.dtype(dtype)],
                 (i32, i32, i64, i64, scalar, p, i64, p, i64, scalar, p, i64))):
            name = f"ember_cblas_{letter}{kind}_ilp64"
            llvm.add_symbol(name, ctypes.cast(fn, ctypes.c_void_p).value)
            globals()[f"{letter}{kind}"] = types.ExternalFunction(name, types.void(*args))
    for fn in (_call, product_piece, _run_board, _join_board, _wait_for):
        _compiled.kernel_math(fn)


def _call(kind, M, N, K, pa, ta, lda, pb, tb, ldb, pc, ldc):
    """C (M, N) = A (M, K) @ B (K, N), row-major with transpose flags: a GEMV where a side is
    one long (OpenBLAS's GEMM would pack all of the matrix for one row or column of work)."""
    if M == 1 or N == 1:
        if M == 1:  # C's row = B^T a's row
            matrix, ld, x, incx, incy = pb, ldb, pa, 1 if ta == _NO_TRANS else lda, 1
            trans = _TRANS if tb == _NO_TRANS else _NO_TRANS
            rows, cols = (K, N) if tb == _NO_TRANS else (N, K)
        else:  # C's column = A b's column
            matrix, ld, x, incx, incy = pa, lda, pb, ldb if tb == _NO_TRANS else 1, ldc
            trans = ta
            rows, cols = (M, K) if ta == _NO_TRANS else (K, M)
        if kind == 0:
            sgemv(np.int32(_ROW_MAJOR), np.int32(trans), rows, cols, np.float32(1), matrix, ld,
                  x, incx, np.float32(0), pc, incy)
        else:
            dgemv(np.int32(_ROW_MAJOR), np.int32(trans), rows, cols, 1.0, matrix, ld, x, incx,
                  0.0, pc, incy)
    elif kind == 0:
        sgemm(np.int32(_ROW_MAJOR), np.int32(ta), np.int32(tb), M, N, K, np.float32(1), pa,
              lda, pb, ldb, np.float32(0), pc, ldc)
    else:
        dgemm(np.int32(_ROW_MAJOR), np.int32(ta), np.int32(tb), M, N, K, 1.0, pa, lda, pb,
              ldb, 0.0, pc, ldc)


def _run_board(board, from_back):
    """Take the board's pieces until none is left: a split kernel's (its piece function on
    them) or a product's (`product_piece`). The caller takes them from the first on, the
    helpers from the last back (`_CLAIMS`). Returns the number of pieces taken."""
    pieces = board[_PIECES]
    taken = 0
    while True:
        claims = _compiled.fetch_add(board, _CLAIMS, _BACK_CLAIM if from_back else 1)
        front, back = claims & _FRONT_MASK, claims >> 32
        if front + back >= pieces:
            return taken
        piece = pieces - 1 - back if from_back else front
        taken += 1
        lo, hi = board[_BOUNDS + piece], board[_BOUNDS + piece + 1]
        if board[_KIND] == _KERNEL:
            _compiled.call_piece(board[_PA], board[_PB], lo, hi)
        else:
            product_piece(board, _KIND, lo, hi)
        _compiled.fetch_add(board, _DONE, 1)


def product_piece(fields, at, lo, hi):
    """Piece [lo, hi) of the product whose board fields (from _KIND on) start at fields[at],
    each one CBLAS call: batch items, rows of a and the output, or columns of b and the
    output, as the bounds cut them. Returns the output's rows and columns it wrote, (r0, r1,
    c0, c1), of each matrix. Compiled code only."""
    o = at - _KIND
    kind, M, N, K = fields[o + _KIND], fields[o + _M], fields[o + _N], fields[o + _K]
    pa, ta, lda, sa = fields[o + _PA], fields[o + _TA], fields[o + _LDA], fields[o + _SA]
    pb, tb, ldb, sb = fields[o + _PB], fields[o + _TB], fields[o + _LDB], fields[o + _SB]
    pc, ldc, sc, size, axis = (fields[o + _PC], fields[o + _LDC], fields[o + _SC],
                               fields[o + _SIZE], fields[o + _AXIS])
    if axis == _BATCH:
        for i in range(lo, hi):
            _call(kind, M, N, K, pa + i * sa, ta, lda, pb + i * sb, tb, ldb, pc + i * sc, ldc)
        return 0, M, 0, N
    if axis == _ROWS:
        step = lda if ta == _NO_TRANS else 1
        _call(kind, hi - lo, N, K, pa + lo * step * size, ta, lda, pb, tb, ldb,
              pc + lo * ldc * size, ldc)
        return lo, hi, 0, N
    step = 1 if tb == _NO_TRANS else ldb
    _call(kind, M, hi - lo, K, pa, ta, lda, pb + lo * step * size, tb, ldb, pc + lo * size, ldc)
    return 0, M, lo, hi


def _join_board(board, seen):
    """A helper takes pieces of the product on the board if one was posted since generation
    `seen`; returns the generation it saw. It counts itself among the board's users before it
    reads the product, and the poster waits for no users before it writes the next one."""
    generation = _compiled.load_acquire(board, _GEN)
    if generation == seen or generation % 2 == 1:
        return seen
    _compiled.fetch_add(board, _USERS, 1)
    if _compiled.load_acquire(board, _GEN) == generation:
        _run_board(board, True)
    _compiled.fetch_add(board, _USERS, -1)
    return generation


def _post_and_run(board, product):
    """Post `product` (the fields from _KIND on) on the board, take its pieces with the
    helpers, and return once every piece is done: the number of pieces this thread ran."""
    generation = board[_GEN]
    _compiled.exchange(board, _GEN, generation + 1)  # odd: being written
    _wait_for(board, _USERS, 0)
    board[_KIND:_KIND + product.shape[0]] = product
    board[_CLAIMS] = 0
    board[_DONE] = 0
    _compiled.exchange(board, _GEN, generation + 2)
    taken = _run_board(board, False)
    _wait_for(board, _DONE, board[_PIECES])
    return taken


def _wait_for(board, field, value):
    """Spin until board[field] == value: the CPU's pause, then sched_yield (a helper that
    holds a piece may have lost its core to another process)."""
    spins = 0
    while _compiled.load_acquire(board, field) != value:
        spins += 1
        if spins < _compiled.SPINS_BEFORE_YIELD:
            _compiled.cpu_pause()
        else:
            _compiled.os_yield()


def wait_for_job_or_pieces(finished, posted, seen, runs, pauses, settle, linger, board):
    """A helper between jobs (as _compiled.wait_for_job), taking the pieces of the products
    posted on the board meanwhile; each product taken starts its wait anew. Once the last run
    in flight has returned it watches the board `linger` pauses more (LINGER_PAUSES,
    ops/cpu/tuning.py), then sleeps: a session run in a loop finds it awake at its first op,
    where a sleeping one is slow to wake and join and leaves that op to the caller."""
    _compiled.exchange(finished, 0, 1)
    generation = np.int64(-2)  # a product in progress is joined at once
    spins = 0
    idle = 0  # pauses since the last run in flight returned
    while _compiled.load_acquire(posted, 0) == seen:
        if _compiled.load_acquire(runs, 0) > 0:
            idle = 0
        else:
            idle += 1
            if idle > linger:
                break
        taken = _join_board(board, generation)
        if taken != generation:
            generation = taken
            spins = 0
            continue
        spins += 1
        if spins > pauses:
            return
        _compiled.cpu_pause()
    for _ in range(settle):
        _compiled.cpu_pause()


def helper_wait(board: np.ndarray):
    """The pool's helpers' wait between jobs where products run on the board (the pool's
    `board`), else None."""
    if _blas() is None:
        return None
    wait = _compiled.jit(wait_for_job_or_pieces)
    return lambda finished, posted, seen, runs, pauses, settle: wait(
        finished, posted, seen, runs, pauses, settle, tuning.LINGER_PAUSES, board)


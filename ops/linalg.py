"""Linear algebra: MatMul, Gemm, Einsum, Det, MatMulInteger, QLinearMatMul.

Float products go through np.matmul / np.einsum so BLAS does the work; narrow floats (float16,
bfloat16) are multiplied in float32 and cast back. Integer products of 8-bit operands run in
float64 BLAS, which is exact for them (|a*b| < 2**16, so sums stay exact below 2**53), then are
wrapped to int32 as the spec allows.

On the CPU, one row by a constant weight (MatMul's, Gemm's) runs as a compiled GEMV over the
weight packed once in column blocks (`_gemv_product`, ops/cpu/gemv.py), and products of 2-512
rows by a large constant weight (K at most 3072 from 17 rows; with AVX2, 2-16 rows) as
register tiles over the weight packed once (`_tiled_product`), both numba on an AVX-512 or
AVX2 CPU; elsewhere, products of 2-4 rows run as one GEMV per row where that is faster
(`_rows_faster`), and products of 4-12 rows by a large constant weight as dot products with
the rows of its transpose (`_dot_columns`, numba);
the products BLAS does go through ops/cpu/blas.py, which cuts them into pieces for ember's kernel
pool during runs (OpenBLAS then on one thread), or leaves them to OpenBLAS's threads.
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops import _integer as _int
from ember.ops.cpu import blas as _blas, compiled as _compiled, gemv as _gemv, tiles as _tiles
from ember.ops.cpu import tuning
from ember.ops._dtypes import is_narrow_float, widen
from ember.ops._lowering import remembered_route
from ember.ops.registry import Lowering, OpImpl, Sketch, register


def _magnitude(a) -> float:
    """max |a| as a Python float (0 for an empty array), read on the host; from the max and
    the min, so that an integer type's most negative value does not overflow abs."""
    return max(float(a.max()), -float(a.min())) if a.size else 0.0


def _int_matmul(xp, a, b):
    """Exact integer matmul of small-integer operands, as int64."""
    k = a.shape[-1] if a.ndim else 1
    if _magnitude(a) * _magnitude(b) * max(k, 1) < 2.0 ** 52:
        return xp.rint(xp.matmul(a.astype(np.float64), b.astype(np.float64))).astype(np.int64)
    return xp.matmul(a.astype(np.int64), b.astype(np.int64))


# Small float products on OpenBLAS's own threads (without numba, or with
# EMBER_POOL_PRODUCTS=0: ops/cpu/blas.py). Threads: OpenBLAS's own crossover to threads is
# kept, as two threads above it were never clearly slower on an idle machine, so no product
# is sent to one thread (while other processes hold the cores, a preempted worker holds up
# BLAS's static split: `threads=1` is the choice there). Shape: OpenBLAS's GEMM with 2-4 rows
# packs all of B for a few rows of work, so from the sizes in BY_ROW_KN (ops/cpu/tuning.py;
# 3 and 4 rows only where K <= N) one GEMV per row (with BLAS's threads) is faster: those
# products run by row (`_by_row`), a decoder step of batch 2-4.


def _by_row(a, b):
    """A 2- to 4-row product as one GEMV per row (CPU only)."""
    out = np.empty((a.shape[0], b.shape[1]), dtype=np.result_type(a, b))
    for i in range(a.shape[0]):  # 2 to 4 BLAS calls
        _blas.matmul(a[i:i + 1], b, out=out[i:i + 1])
    return out


def _rows_faster(a, b) -> bool:
    """Whether the numpy float product a @ b (2-D operands) runs faster by row (see above)."""
    if a.ndim != 2 or b.ndim != 2 or a.dtype.kind != "f":
        return False
    return _by_row_fits(*a.shape, b.shape[1])


def _by_row_fits(m, k, n) -> bool:
    return m in tuning.BY_ROW_KN and k * n >= tuning.BY_ROW_KN[m] and (m == 2 or k <= n)


# A few rows by a large constant weight (a decoder step at batch 4-12): OpenBLAS packs all of
# B, from memory, for a few rows of work. Dot products of the rows with the rows of the
# weight's transpose (kept from the first such run) read it once, split by columns among
# the session's threads: faster than OpenBLAS for the rows in DOT_ROWS and weights from
# DOT_MIN_KN (ops/cpu/tuning.py).
_DOT_FASTMATH = {"reassoc", "contract"}  # the sums over k reassociated: vectorised


@_compiled.kernel_math(fastmath=_DOT_FASTMATH, error_model="numpy")  # rnn's kernels call it
def dot_columns_loops(a, bt, out, n0, n1):
    """out[:, n] = a @ bt[n] for the columns n in [n0, n1), float32: two columns by four rows
    at a time (each load of a row of `a` serves two products), so each row of bt is read from
    memory once. An odd last column is computed twice, in both slots: the same expression."""
    m_rows, k_len = a.shape
    for n in range(n0, n1, 2):
        n2 = min(n + 1, n1 - 1)
        w, v = bt[n], bt[n2]
        m = 0
        while m + 4 <= m_rows:
            a0, a1, a2, a3 = a[m], a[m + 1], a[m + 2], a[m + 3]
            s0 = s1 = s2 = s3 = t0 = t1 = t2 = t3 = np.float32(0)
            for k in range(k_len):
                wk, vk = w[k], v[k]
                s0 += a0[k] * wk
                s1 += a1[k] * wk
                s2 += a2[k] * wk
                s3 += a3[k] * wk
                t0 += a0[k] * vk
                t1 += a1[k] * vk
                t2 += a2[k] * vk
                t3 += a3[k] * vk
            out[m, n], out[m + 1, n], out[m + 2, n], out[m + 3, n] = s0, s1, s2, s3
            out[m, n2], out[m + 1, n2], out[m + 2, n2], out[m + 3, n2] = t0, t1, t2, t3
            m += 4
        while m < m_rows:
            am = a[m]
            s0 = t0 = np.float32(0)
            for k in range(k_len):
                s0 += am[k] * w[k]
                t0 += am[k] * v[k]
            out[m, n], out[m, n2] = s0, t0
            m += 1


class CachedPack:
    """Remembers a packed (transposed, reordered, uploaded) operand while its source is the
    same constant array: a weight, on any backend.

    The three facts live in one tuple replaced in one assignment, so a thread never sees the
    source of one pack with the value of another."""

    def __init__(self):
        self._entry = (None, None, None)  # (source array, key, packed value)

    def get(self, src, key, make):
        cached_src, cached_key, value = self._entry
        if cached_src is src and cached_key == key:
            return value
        value = make()
        self._entry = (src, key, value)
        return value


def _transpose(b):
    bt = np.ascontiguousarray(b.T)
    bt.setflags(write=False)
    return bt


def _dot_fits(m, k, n, a_dtype, b_dtype) -> bool:
    return (m in tuning.DOT_ROWS and k * n >= tuning.DOT_MIN_KN
            and a_dtype == b_dtype == np.float32)


def _dot_columns(a, b, weight: CachedPack):
    """a @ b by `dot_columns_loops`, or None where it does not apply (or numba is absent);
    b's transpose is kept in `weight`, the first time a product of a few rows needs it (a
    model only ever run on many rows never pays its memory)."""
    m, k = a.shape
    n = b.shape[1]
    if not _dot_fits(m, k, n, a.dtype, b.dtype):
        return None
    kernel = _compiled.jit(dot_columns_loops, fastmath=_DOT_FASTMATH)
    if kernel is None:
        return None
    bt = weight.get(b, None, lambda: _transpose(b))
    out = np.empty((m, n), np.float32)
    _compiled.split_rows(kernel, n, np.ascontiguousarray(a), bt, out,
                         ns_per_row=tuning.DOT_NS_PER_MAC * m * k)
    return out


# The same few rows by a large constant weight as register tiles (ops/cpu/tiles.py; AVX-512):
# the weight packed once in blocks of 32 columns, each block's K x 32 values read in order
# and multiplied with 12 rows at a time (4 for the last few) in vector registers. They serve
# TILE_ROWS by weights from TILE_MIN_KN (ops/cpu/tuning.py): a decoder step's few rows
# (TILE_ANY_K_ROWS, any K, AVX2's narrower tiles included) and, on AVX-512, a transformer's
# projections at batch 1 where K is at most TILE_MAX_K, the weights then staying in cache
# between tiles; a batch's rows BLAS does as fast. One row stays a GEMV, which BLAS does
# faster than a tile computing 4 rows for 1. The cost is the packed copy kept beside each
# such weight. A weight wider than TILE_WIDE_N (a vocabulary) is tiled for TILE_WIDE_N_ROWS
# only: the tiles store their rows' 32 columns far apart, and with more rows OpenBLAS wins.


def _tiles_fit(m, k, n, a_dtype, b_dtype) -> bool:
    return (m in tuning.TILE_ROWS and k * n >= tuning.TILE_MIN_KN
            and a_dtype == b_dtype == np.float32
            and (n <= tuning.TILE_WIDE_N or m in tuning.TILE_WIDE_N_ROWS)
            and (m in tuning.TILE_ANY_K_ROWS or (k <= tuning.TILE_MAX_K and _tiles.WIDE)))


def _tiled_product(a, b, weight: CachedPack):
    """a @ b by register tiles, or None where they do not apply (or are not available); the
    packed b is kept in `weight`."""
    m, k = a.shape
    n = b.shape[1]
    if not _tiles_fit(m, k, n, a.dtype, b.dtype):
        return None
    kernel = _tiles.kernel()
    if kernel is None:
        return None
    packed, zeros = weight.get(b, "tiles", lambda: _tiles.pack(b, None))
    out = np.empty((m, n), np.float32)
    rows = np.arange(0, m * k, k, dtype=np.int64)   # row r starts at r * k
    band, bounds = _tiles.cut(1, m, m * k, k, 1, packed, out.nbytes)
    _tiles.run(kernel, np.ascontiguousarray(a).reshape(-1), m * k, rows, _ONE_TAP, k,
               packed, zeros, None, out, 1, band, bounds)
    return out


_ONE_TAP = np.zeros(1, np.int64)


# One row by a constant weight (a decoder step at batch 1): OpenBLAS's GEMV on the row-major
# weight reached about half the memory's bandwidth, the compiled GEMV (ops/cpu/gemv.py) on
# the weight packed once in column blocks nearly all of it (GEMV_ROWS, GEMV_MIN_KN:
# ops/cpu/tuning.py). The cost is the packed copy kept beside each such weight, in the one
# entry the tiles use too: a node run at one row and then at several packs again (once per
# switch, as a prefill followed by decoding steps does).


def _gemv_fits(m, k, n, a_dtype, b_dtype) -> bool:
    return (m in tuning.GEMV_ROWS and k * n >= tuning.GEMV_MIN_KN
            and a_dtype == b_dtype == np.float32)


def _gemv_product(a, b, weight: CachedPack):
    """a @ b by the compiled GEMV, or None where it does not apply (or is not available);
    the packed b is kept in `weight`."""
    m, k = a.shape
    n = b.shape[1]
    if not _gemv_fits(m, k, n, a.dtype, b.dtype):
        return None
    kernel = _gemv.kernel()
    if kernel is None:
        return None
    return _gemv.product(kernel, a, weight.get(b, "gemv", lambda: _gemv.pack(b)), n)


def float_matmul(xp, a, b, weight: CachedPack | None = None):
    """a @ b for float arrays by the fastest kernel that serves (the module docstring); a
    constant b's packed forms kept in `weight`."""
    shape = None
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous and a.shape[-1]:
        # [..., M, K] @ [K, N] as one [(...*M), K] GEMM: one large BLAS call instead of
        # one per batch entry
        shape = a.shape[:-1] + b.shape[-1:]
        a = a.reshape(-1, a.shape[-1])
    y = None
    if weight is not None and xp is np and a.ndim == 2 and b.ndim == 2:
        # CPU: 1-512 rows by a large constant weight
        y = _gemv_product(a, b, weight)
        if y is None:
            y = _tiled_product(a, b, weight)
        if y is None:
            y = _dot_columns(a, b, weight)
    if y is None:
        if (xp is np and a.ndim == 2 and 2 <= a.shape[0] <= 4 and b.ndim == 2
                and b.shape[0] * b.shape[1] >= tuning.BY_ROW_MIN_KN and _rows_faster(a, b)):
            y = _by_row(a, b)  # CPU: 2-4 rows, where one GEMV per row is faster
        elif xp is np and a.ndim == 2 and b.ndim == 2 and (
                a.shape[0] * b.shape[1] * a.itemsize >= _tiles.KEEP_FROM_BYTES):
            # a product of 32 MB or more into a kept buffer (_tiles.empty): allocated afresh
            # it page-faults at every run
            y = _blas.matmul(a, b, out=_tiles.empty((a.shape[0], b.shape[1]),
                                                    np.result_type(a.dtype, b.dtype)))
        elif xp is np:
            y = _blas.matmul(a, b)
        else:
            y = xp.matmul(a, b)
    return y if shape is None else y.reshape(shape)


def _blas_only(a_shape, b_shape, a_dtype, b_dtype, itemsize) -> bool:
    """Whether `float_matmul` (numpy, 2-D a and b of these shapes and dtypes, any `weight`)
    is `_blas.matmul(a, b)` whatever else holds: none of its own kernels' tests fits (not
    even where that kernel is then unavailable), no GEMV per row, no kept buffer. A caller
    that keeps this answer for a geometry calls `_blas.matmul` without the tests."""
    (m, k), n = a_shape, b_shape[1]
    return not (_gemv_fits(m, k, n, a_dtype, b_dtype) or _tiles_fit(m, k, n, a_dtype, b_dtype)
                or _dot_fits(m, k, n, a_dtype, b_dtype)
                or (2 <= m <= 4 and k * n >= tuning.BY_ROW_MIN_KN)
                or m * n * itemsize >= _tiles.KEEP_FROM_BYTES)


_PRODUCT_BY_GEOMETRY = Lowering("by geometry", "chosen per call from the product's rows: "
                                "a compiled GEMV, register tiles, dot products, a GEMV per row "
                                "or BLAS GEMM")


def product_lowering(a: Sketch | None, b: Sketch | None, constant_b: bool) -> Lowering:
    """The kernel `matmul` runs a @ b with, from what the plan knows of a and b (the same
    tests `float_matmul` makes on each call)."""
    if a is None or b is None or a.dtype is None or b.dtype is None:
        return _PRODUCT_BY_GEOMETRY
    if a.dtype.kind in "iu":
        return Lowering("numpy", "integer product: exact in float64 where int64 would overflow")
    if a.dtype.kind != "f" or is_narrow_float(a.dtype):
        return Lowering("numpy", "narrow float: computed in float32, rounded once")
    if not (a.static() and b.static()) or a.ndim < 2 or b.ndim != 2:
        return _PRODUCT_BY_GEOMETRY
    m, k, n = math.prod(a.shape[:-1]), a.shape[-1], b.shape[1]
    if constant_b and _gemv_fits(m, k, n, a.dtype, b.dtype) and _gemv.kernel() is not None:
        return Lowering("cpu.gemv", "one row by a constant weight: a GEMV over the weight "
                        "packed once in column blocks, split by columns")
    if constant_b and _tiles_fit(m, k, n, a.dtype, b.dtype) and _tiles.kernel() is not None:
        return Lowering("cpu.tiles-gemm", f"{m} rows by a constant weight: register tiles over "
                        "the weight packed once")
    if constant_b and _dot_fits(m, k, n, a.dtype, b.dtype) and _compiled.enabled():
        return Lowering("cpu.dot-columns", f"{m} rows by a large constant weight: dot products "
                        "with its kept transpose, split by columns")
    if 2 <= m <= 4 and _by_row_fits(m, k, n):
        return Lowering("numpy", "a GEMV per row: faster than one GEMM for 2-4 rows")
    if _blas.enabled():
        return Lowering("cpu.board-gemm", "BLAS GEMM, cut in pieces on the pool's board "
                        "where it is large enough (OpenBLAS at one thread in runs)")
    return Lowering("numpy", "numpy.matmul: BLAS with its own threads")


def matmul(xp, a, b, weight: CachedPack | None = None):
    """xp.matmul keeping the operand dtype, with narrow floats computed in float32. `weight`:
    b is a constant of the graph, whose transpose `weight` may keep (CPU, few rows)."""
    dtype = a.dtype
    if dtype.kind in "fc" and not is_narrow_float(dtype):
        return float_matmul(xp, a, b, weight)
    if dtype.kind in "iu":
        if dtype.itemsize <= 2:
            return _int_matmul(xp, a, b).astype(dtype)
        return xp.matmul(a, b)
    return xp.matmul(widen(a), widen(b)).astype(dtype)


# --------------------------------------------------------------------------------------------

def check_numeric(op: OpImpl, **inputs) -> None:
    """Each given input is a numeric tensor. The loader refuses other kinds where the graph
    fixes them (ember.importer.validate); a value whose kind only shows when the model runs (a
    sequence through an Identity, an If's branch, a string tensor) is refused here, before the
    product would fail on it."""
    for name, x in inputs.items():
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            kind = {list: "a sequence", dict: "a map", type(None): "an empty optional"}.get(
                type(x), type(x).__name__)
            raise op.fail(f"input {name} must be a tensor, got {kind}")
        if dtype == object:
            raise op.fail(f"input {name} must be a numeric tensor, got a string tensor")


@register("MatMul", versions=[1, 9, 13])
class MatMul(OpImpl):
    def setup(self):
        self._transposed = CachedPack()  # of a constant B, for products of a few rows

    def run(self, a, b):
        self.settle_lowering(a, b)
        if a.__class__ is not np.ndarray or b.__class__ is not np.ndarray \
                or a.dtype.kind == "O" or b.dtype.kind == "O":  # cheap first: products are hot
            check_numeric(self, A=a, B=b)
        if a.ndim == 0 or b.ndim == 0:
            raise self.fail("MatMul inputs must have rank >= 1")
        if a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
            raise self.fail(f"shapes {a.shape} and {b.shape} are not aligned")
        return matmul(self.xp, a, b, self._transposed if 1 in self.constant_inputs else None)

    def lower(self, inputs):
        return product_lowering(inputs[0], inputs[1], inputs[1] is not None
                                and inputs[1].value is not None)


class _Gemm(OpImpl):
    def setup(self):
        self.alpha = float(self.alpha)
        self.beta = float(self.beta)
        self.transA = bool(self.transA)
        self.transB = bool(self.transB)
        self._packed = CachedPack()  # of a constant B, as MatMul's
        # a constant B's transposed view, kept so that `_packed` finds the same array each run
        self._b_view = CachedPack()

    def lower(self, inputs):
        a, b = inputs[0], inputs[1]
        if a is not None and a.static() and self.transA:
            a = a._replace(shape=a.shape[::-1])
        if b is not None and b.static() and self.transB:
            b = b._replace(shape=b.shape[::-1])
        return product_lowering(a, b, b is not None and b.value is not None)

    def run(self, a, b, c=None):
        self.settle_lowering(a, b)
        kept = self.__dict__.get("_kept_float")
        if kept is not None and kept[1] is b and kept[2] is c and a.__class__ is np.ndarray \
                and kept[0] == (a.shape, a.dtype):
            # checked when it was kept: the product and C as then
            b, wc, blas_only = kept[3]
            a = a.T if self.transA else a
            y = _blas.matmul(a, b) if blas_only else float_matmul(np, a, b, self._packed)
            if self.alpha != 1.0:
                y *= y.dtype.type(self.alpha)
            if wc is not None:
                y += wc
            return y.astype(a.dtype, copy=False) if y.dtype != a.dtype else y
        xp = self.xp
        if a.__class__ is not np.ndarray or b.__class__ is not np.ndarray \
                or a.dtype.kind == "O" or b.dtype.kind == "O" or c is not None \
                and (c.__class__ is not np.ndarray or c.dtype.kind == "O"):
            check_numeric(self, A=a, B=b, **({} if c is None else {"C": c}))
        if a.ndim != 2 or b.ndim != 2:
            raise self.fail(f"Gemm needs 2-D A and B, got shapes {a.shape} and {b.shape}")
        dtype = a.dtype
        a_given, b_given = a, b
        if self.transA:
            a = a.T
        constant_b = 1 in self.constant_inputs
        if self.transB:
            b = self._b_view.get(b, None, lambda: b.T) if constant_b else b.T
        if a.shape[1] != b.shape[0]:
            raise self.fail(f"inner dimensions differ: {a.shape} x {b.shape}")
        if dtype.kind in "iu":
            y = matmul(xp, a, b)
            if self.alpha == 1.0 and (c is None or self.beta == 1.0):
                return y if c is None else (y + c).astype(dtype, copy=False)
            yf = self.alpha * y.astype(np.float64)  # non-unit factors: scale in float64
            if c is not None and self.beta != 0.0:
                yf += self.beta * c.astype(np.float64)
            return yf.astype(dtype)
        narrow = is_narrow_float(dtype)
        wa, wb = widen(a), widen(b)
        y = float_matmul(xp, wa, wb, self._packed if constant_b and not narrow else None)
        if self.alpha != 1.0:
            y *= y.dtype.type(self.alpha)
        wc = None
        if c is not None and self.beta != 0.0:
            wc = widen(c)
            if self.beta != 1.0:
                wc = wc * wc.dtype.type(self.beta)
            if not _broadcasts_to(wc.shape, y.shape):
                raise self.fail(f"C of shape {c.shape} does not broadcast to {y.shape}")
            y += wc
        if xp is np and constant_b and not narrow and _constant(b_given) and \
                (c is None or (2 in self.constant_inputs and _constant(c))):
            # the checks above, B's view and C scaled hold while A keeps its shape and dtype
            # and B and C are the same constants: a node's next calls skip them (one tuple,
            # replaced whole: threads sharing a session read the old or the new)
            blas_only = _blas_only(a.shape, b.shape, a.dtype, b.dtype, a.itemsize)
            self._kept_float = ((a_given.shape, dtype), b_given, c, (b, wc, blas_only))
        return y.astype(dtype, copy=False) if narrow or y.dtype != dtype else y


def _constant(x) -> bool:
    """A read-only numpy array: a constant of the plan (which marks them so)."""
    return isinstance(x, np.ndarray) and not x.flags.writeable


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to `target` unchanged (np.broadcast_shapes(target, shape)
    == target), in a few tuple steps where numpy's check costs microseconds a product."""
    return len(shape) <= len(target) and all(
        s == 1 or s == t for s, t in zip(shape[::-1], target[::-1]))


@register("Gemm", versions=[1, 6])
class Gemm1(_Gemm):
    """`broadcast` attribute: C either matches (M, N) exactly or is broadcast when set."""

    def run(self, a, b, c=None):
        check_numeric(self, A=a, B=b, **({} if c is None else {"C": c}))  # before the shapes
        if c is not None and not self.broadcast:
            m = a.shape[1] if self.transA else a.shape[0]
            n = b.shape[0] if self.transB else b.shape[1]
            if c.shape != (m, n) and c.size != 1:
                raise self.fail(f"C has shape {c.shape}, expected ({m}, {n}) without broadcast")
        return super().run(a, b, c)


@register("Gemm", versions=[7, 9, 11, 13])
class Gemm7(_Gemm):
    pass


# --------------------------------------------------------------------------------------------

@register("Einsum", versions=[12, 28])
class Einsum(OpImpl):
    def setup(self):
        eq = self.equation
        if isinstance(eq, bytes):
            eq = eq.decode()
        self.eq = eq.replace(" ", "")
        if not self.eq:
            raise self.fail("empty equation")

    def run(self, *inputs):
        xp = self.xp
        if not inputs:
            raise self.fail("Einsum needs at least one input")
        dtype = inputs[0].dtype
        work = [widen(x) for x in inputs]
        if dtype.kind in "iu" and dtype.itemsize < 8:
            work = [x.astype(np.int64) for x in work]
        try:
            out = xp.einsum(self.eq, *work, optimize=len(work) > 1)
        except ValueError as exc:
            raise self.fail(f"equation '{self.eq}': {exc}")
        return xp.asarray(out).astype(dtype, copy=False)


# --------------------------------------------------------------------------------------------

@register("Det", versions=[11, 22])
class Det(OpImpl):
    def run(self, x):
        if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
            raise self.fail(f"Det needs square matrices, got shape {x.shape}")
        xp = self.xp
        return xp.asarray(xp.linalg.det(widen(x))).astype(x.dtype, copy=False)


# --------------------------------------------------------------------------------------------

def _per_row(zp: np.ndarray, a: np.ndarray) -> np.ndarray:
    """A 1-D per-row zero point/scale of a 2-D-or-more `a` as a column for broadcasting."""
    if zp.ndim == 1 and zp.size > 1 and a.ndim >= 2:
        return zp.reshape(-1, 1)
    return zp


@register("MatMulInteger", versions=[10])
class MatMulInteger(OpImpl):
    def lower(self, inputs):
        return _int.lowering(inputs[0], inputs[1])

    def run(self, a, b, a_zero_point=None, b_zero_point=None):
        za = None if a_zero_point is None else _per_row(a_zero_point, a)
        return _int.product(self, a, za, b, b_zero_point).astype(np.int32, copy=False)


def _saturate_cast(xp, x, dtype: np.dtype):
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return xp.clip(xp.rint(x), info.min, info.max).astype(dtype)
    # float8 outputs (host arrays only: cupy has no float8): saturate to the finite range,
    # round to nearest
    import ml_dtypes

    finfo = ml_dtypes.finfo(dtype)
    return xp.clip(x, float(finfo.min), float(finfo.max)).astype(dtype)


@register("QLinearMatMul", versions=[10, 21])
class QLinearMatMul(OpImpl):
    def lower(self, inputs):
        return _int.lowering(inputs[0], inputs[3])

    def run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
        params = (a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point)
        route = remembered_route(self, (a,), params, lambda: self._requantizing(a, *params))
        if route is not None:
            self._chosen = _int.INTEGER
            K, N = b.shape
            rows = np.ascontiguousarray(a).reshape(-1, K)
            return route(rows).reshape(a.shape[:-1] + (N,))
        return self._run(a, *params)

    def _requantizing(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale,
                      y_zero_point):
        """The pixel tiles' route with the requantisation in their epilogue, as `_run`
        computes it for float32 scales, per tensor (b's: or per column) and a 2-D b; else
        None."""
        if self.xp is not np or a.dtype not in _int.BYTES or b.dtype != a.dtype or b.ndim != 2 \
                or a.ndim < 1 or a.shape[-1] != b.shape[0] \
                or any(p.dtype != np.float32 for p in (a_scale, b_scale, y_scale)) \
                or any(p.size != 1 for p in (a_scale, a_zero_point, y_scale, y_zero_point)) \
                or b_scale.size not in (1, b.shape[1]) or b_zero_point.dtype != b.dtype \
                or b_zero_point.size not in (1, b.shape[1]):
            return None
        N = b.shape[1]
        mult = a_scale.reshape(()) * b_scale.reshape(-1) / y_scale.reshape(())
        return _int.requantizing_route(self, math.prod(a.shape[:-1]), a_zero_point, b,
                                       b_zero_point.reshape(-1), np.zeros(N, np.int64),
                                       np.broadcast_to(mult, (N,)), y_zero_point)

    def _run(self, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
        xp = self.xp
        out_dtype = y_zero_point.dtype
        if a.dtype.kind in "iu" and b.dtype.kind in "iu":
            acc = _int.product(self, a, _per_row(a_zero_point, a), b, b_zero_point)
            acc = acc.astype(np.float64, copy=False)
        else:
            wa = a.astype(np.float32) - _per_row(a_zero_point.astype(np.float32), a)
            wb = b.astype(np.float32) - b_zero_point.astype(np.float32)
            acc = xp.matmul(wa.astype(np.float64), wb.astype(np.float64))
        # the requantization multiplier a_scale * b_scale / y_scale, in the scales' precision
        sdt = a_scale.dtype if a_scale.dtype in (np.float16, np.float32) else np.float32
        sa = _per_row(a_scale.astype(sdt), a)
        sy = _per_row(y_scale.astype(sdt), a)
        mult = sa * b_scale.astype(sdt) / sy
        zero_point = _per_row(y_zero_point, a)
        if out_dtype.kind in "iu":
            # as onnxruntime requantizes: float32(acc) times a float32 multiplier, rounded half
            # to even, then the zero point (in float64 one code in ~1e5 came out otherwise)
            y = xp.rint(acc.astype(np.float32) * mult.astype(np.float32))
            return _saturate_cast(xp, y + zero_point.astype(np.float32), out_dtype)
        y = acc * mult.astype(np.float64) + zero_point.astype(np.float64)
        return _saturate_cast(xp, y, out_dtype)

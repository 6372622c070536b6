"""The exact integer products the 8-bit ops share (MatMulInteger, QLinearMatMul, QGemm,
MatMulIntegerToFloat, DynamicQuantizeMatMul, QAttention, ConvInteger, QLinearConv): the CPU
engine's integer product (ops/cpu/integer.py) where it serves, else float64 BLAS products,
whose sums of small integers are exact too. Both give the same integers, so the ops' results
do not depend on which ran."""
from __future__ import annotations

import math

import numpy as np

from ember.ops._lowering import numba_serves
from ember.ops.cpu import compiled as _compiled, integer as _integer, tuning
from ember.ops.cpu import integer_tiles as _integer_tiles
from ember.ops.registry import PORTABLE, Lowering

BYTES = (np.dtype(np.int8), np.dtype(np.uint8))

INTEGER = Lowering("cpu.integer", "8-bit products summed in int32 by the CPU engine's "
                   "integer GEMM (AVX-512 VNNI, or compiled loops), weights packed once")


def lowering(a, b, rank: int = 2, group_rows: int | None = None) -> Lowering:
    """The plan's kernel for a product of 8-bit sketches a (..., K) by a constant b (K, N),
    or (rank 4) a convolution of a by the filters b, `group_rows` output channels a group
    (None: one group). An input whose type the plan does not know yet is 8-bit: these ops
    take no other."""
    if not numba_serves() or a.dtype not in BYTES + (None,) or b.dtype not in BYTES \
            or b.value is None or b.ndim != rank:
        return PORTABLE
    if group_rows is not None and group_rows < tuning.INT_GROUP_ROWS:
        return EXACT_FLOAT
    if rank == 4:
        return INTEGER
    if not a.static():
        return _BY_SIZE
    return INTEGER if _integer.worth(math.prod(a.shape[:-1]), b.shape[1], b.shape[0]) \
        else _SMALL


_BY_SIZE = Lowering("by geometry", "the integer product where the rows make enough work, "
                    "else the float64 product: the rows are known in the run")
_SMALL = Lowering("numpy", "a product too small to pay for packing: exact float64 products")
EXACT_FLOAT = Lowering("numpy", "the exact float product of the shifted 8-bit values (zero "
                       "points the integer product does not take, or another array library)")


def scalar(z) -> int | None:
    """A zero point given as None, a Python int or a one-value array, as an int; None where
    it is not one value."""
    if z is None:
        return 0
    z = np.asarray(z)
    return int(z.reshape(())) if z.size == 1 and z.ndim <= 1 else None


def columns(z, n: int) -> np.ndarray | None:
    """A zero point of b: one value, or one per column (N,), as (N,) int64; None otherwise."""
    one = scalar(z)
    if one is not None:
        return np.full(n, one, np.int64)
    z = np.asarray(z)
    return z.astype(np.int64) if z.shape == (n,) else None


def serves(op, a, za, b, zb) -> bool:
    """Whether the compiled product computes (a - za) @ (b - zb) here: numpy arrays of 8 bits,
    b 2-D, the zero points per tensor (and per column for b), enough work to pay."""
    if op.xp is not np or not _integer.enabled() or a.dtype not in BYTES \
            or b.dtype not in BYTES or b.ndim != 2 or a.ndim < 1 or a.shape[-1] != b.shape[0]:
        return False
    if scalar(za) is None or columns(zb, b.shape[1]) is None:
        return False
    return _integer.worth(math.prod(a.shape[:-1]), b.shape[1], b.shape[0])


def kept(op, name: str, key: tuple, make, zero=None, where=None):
    """`make()`, kept on the op under `name` while the arrays of `key` are the same read-only
    constants (weights are), `where` (a view's address, shape and strides) is the same and
    the zero points `zero` (an (N,) array the op may derive anew each run) hold the same
    values: packing is once per weight, not per run."""
    memo = op.__dict__.setdefault("_integer_kept", {})
    entry = memo.get(name)
    if entry is not None and len(entry[0]) == len(key) \
            and all(a is b for a, b in zip(entry[0], key)) and entry[1] == where \
            and (zero is None or np.array_equal(entry[2], zero)):
        return entry[3]
    value = make()
    if all(isinstance(a, np.ndarray) and not a.flags.writeable for a in key if a is not None):
        memo[name] = (key, where, zero, value)
    return value


def _pixel_product(op, rows, za: int, b, zb, out, **epilogue) -> None:
    """out (M, N) = (rows - za) @ (b - zb) as a 1x1 convolution of M pixels of K channels on
    the pixel tiles (ops/cpu/integer_tiles.py), b's columns its filters, packed once per
    constant: the rows are read where they lie (uint8, K a multiple of 4), with no blocks of
    columns to pad, so that one row costs a row's work. `epilogue`: Plan.run's (int32 sums
    by default; a requantisation into an 8-bit `out`)."""
    (M, K), N = rows.shape, b.shape[1]
    origin = b if b.base is None else b.base
    zero = columns(zb, N)
    weights = kept(op, "matmul", (origin,), lambda: _integer_tiles.ConvWeights(
        np.ascontiguousarray(b.T).reshape(N, K, 1, 1), zero), zero,
        (b.__array_interface__["data"][0], b.shape, b.strides))
    image = rows.reshape(1, 1, M, K).transpose(0, 3, 1, 2)
    # the plan of the last call, for the next of the same rows (a model's run after run);
    # one tuple, replaced whole: threads sharing the node read the old or the new
    signature = (M, rows.dtype, _compiled.run_threads())
    last = op.__dict__.get("_pixel_plan")
    if last is None or last[0] != signature or last[1] is not weights:
        last = op._pixel_plan = (signature, weights,
                                 _integer_tiles.Plan(weights, image, _POINTWISE, (1, M)))
    last[2].run(image, za, out.reshape(1, 1, M, N), **epilogue)


def requantizing_route(op, m: int, za, b, zb, bias, mult, y_zero_point):
    """A route for requantised products (QGemm, QLinearMatMul): route(rows), rows (m, K)
    C-ordered, gives sat(rint(float32((rows - za) @ (b - zb) + bias) * mult) + y_zero_point)
    in y_zero_point's type, onnxruntime's requantisation (int32 sums, wrapping as its do), in
    the pixel tiles' epilogue: no int32 product and float passes after it. bias (N,) int, mult
    (N,) float32. None where the integer product does not serve."""
    rows = np.empty((m, b.shape[0]), np.uint8)
    if not serves(op, rows, za, b, zb) or y_zero_point.dtype not in BYTES \
            or y_zero_point.size != 1:
        return None
    info = np.iinfo(y_zero_point.dtype)
    epilogue = dict(mode=_integer.REQUANTIZE, bias=np.asarray(bias, np.int64),
                    mult=np.asarray(mult, np.float32),
                    y_zero=float(y_zero_point.reshape(())), lo=info.min, hi=info.max)
    zero, dtype = scalar(za), y_zero_point.dtype

    def route(rows):
        out = np.empty((m, b.shape[1]), dtype)
        _pixel_product(op, rows, zero, b, zb, out, **epilogue)
        return out
    return route


_POINTWISE = ((1, 1), (1, 1), (1, 1), (0, 0), (0, 0))   # a 1x1 convolution's geometry


def product(op, a, za, b, zb):
    """(a - za) @ (b - zb), exact, for integer a (..., K) and b, with numpy's matmul
    broadcasting; zero points None, one value, or (for a 2-D b) one per column. int32 from
    the compiled product, else an integer-valued float64 array (exact: see the module
    docstring)."""
    xp = op.xp
    served = serves(op, a, za, b, zb)
    op._chosen = INTEGER if served else _SMALL   # what this run took, for sess.kernels
    if served:
        K, N = b.shape
        M = math.prod(a.shape[:-1])
        out = np.empty(a.shape[:-1] + (N,), np.int32)
        _pixel_product(op, np.ascontiguousarray(a).reshape(M, K), scalar(za), b, zb,
                       out.reshape(M, N))
        return out
    wa = a.astype(np.float64)
    if za is not None:
        wa -= xp.asarray(za).astype(np.float64)
    wb = b.astype(np.float64)
    if zb is not None:
        wb -= xp.asarray(zb).astype(np.float64)
    return xp.matmul(wa, wb)

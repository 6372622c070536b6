"""Epilogues of products: the bias, the residual and the activation applied in place to a
freshly computed product (by numpy, or by compiled loops in pieces on the run's threads), and
the routes of 1x1 convolutions of channels-last images that carry them in their pieces. The
fused ops (ops/fused.py) and Conv's routes (ops/conv.py) use them."""
from __future__ import annotations

import math

import numpy as np

from ember.ops.cpu import blas as _blas, compiled as _compiled, tiles as _tiles, tuning
from ember.ops._dtypes import is_narrow_float, widen
from ember.ops._layout import channels_last, pixel_rows, pixel_stride
from ember.ops.activations import (gelu, gelu_erf_float32, gelu_tanh_float32, sigmoid,
                                   sigmoid_float32)
from ember.ops.registry import Lowering

_address = _compiled.address  # an array's data pointer

ACTIVATIONS = ("", "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish",
               "Gelu", "Swish")


# the ONNX defaults of the activation parameters a fusion may leave out
_PARAMETER_DEFAULTS = {"LeakyRelu": [0.01], "Clip": [-np.inf, np.inf], "HardSigmoid": [0.2, 0.5],
                       "Swish": [1.0]}


def with_defaults(name: str, params: list[float]) -> list[float]:
    """`params` of activation `name`, the missing trailing ones filled with ONNX's defaults."""
    defaults = _PARAMETER_DEFAULTS.get(name, [])
    return list(params) + defaults[len(params):]


def activate_in_place(xp, y, name: str, params: list[float]) -> None:
    """y = `name`(y), written into y (a writable float array of namespace `xp`)."""
    if not name:
        return
    if is_narrow_float(y.dtype) and name != "Relu":
        # as the activation's own op computes it: in float32, rounded once (in float16,
        # GELU's 1 + erf(x) cancels and its erf overflows, and parameters would be rounded)
        wide = widen(y)
        activate_in_place(xp, wide, name, params)
        y[...] = wide
        return
    t = y.dtype.type
    if name == "Relu":
        xp.maximum(y, 0, out=y)
        return
    if name == "Sigmoid":
        with np.errstate(over="ignore"):
            xp.negative(y, out=y)
            xp.exp(y, out=y)
            y += 1
            xp.reciprocal(y, out=y)
        return
    if name == "Tanh":
        xp.tanh(y, out=y)
        return
    params = with_defaults(name, params)  # (the activations above have none)
    if name == "LeakyRelu":
        xp.copyto(y, y * t(params[0]), where=y < 0)
    elif name == "Clip":
        lo, hi = params[:2]
        xp.clip(y, lo, hi, out=y)
    elif name == "HardSigmoid":
        alpha, beta = params[:2]
        y *= t(alpha)
        y += t(beta)
        xp.clip(y, 0, 1, out=y)
    elif name == "HardSwish":
        gate = y * t(1 / 6)
        gate += t(0.5)
        xp.clip(gate, 0, 1, out=gate)
        y *= gate
    elif name == "Gelu":
        gelu(xp, y, tanh=bool(params and params[0]), out=y)
    elif name == "Swish":                  # y * sigmoid(alpha * y): SiLU where alpha is 1
        with np.errstate(over="ignore"):
            y *= sigmoid(xp, y * t(params[0]) if params[0] != 1 else y)
    else:
        raise ValueError(f"unknown fused activation {name!r}")


def epilogue(xp, y, bias, z, activation: str, params: list[float], channel_bias=None):
    """activation(y + bias + z), with `bias` broadcast over y's last axis (or `channel_bias`,
    a convolution's, over axis 1) and `z` of y's shape.

    On a fresh dense float `y` (the usual case: C-contiguous, or the channels-last view a
    CPU convolution returns) every step writes into y: no new arrays. Each step is one call
    over the whole array: for one or two passes that is faster than cache blocking on a
    convolution's output, while GELU, a long formula, blocks inside `gelu`. Anything
    else (integer products, a bias of another shape) takes steps that allocate.
    """
    row = channels = None
    if channel_bias is not None:
        channels = channel_bias.reshape(-1).astype(y.dtype, copy=False)
        bias = channels.reshape((-1,) + (1,) * (y.ndim - 2))     # over axis 1
    elif bias is not None and y.ndim and bias.size == y.shape[-1] and y.ndim >= bias.ndim \
            and all(d == 1 for d in bias.shape[:-1]):
        row = bias.reshape(-1).astype(y.dtype, copy=False)
    # (cupy's flags have no `writeable`: device arrays are always writable)
    # a fresh dense result: C-ordered, or the channels-last view a CPU convolution returns
    dense = y.ndim and (y.flags.c_contiguous or channels_last(y))
    if y.dtype.kind != "f" or not dense or not getattr(y.flags, "writeable", True) or \
            (bias is not None and row is None and channels is None) or \
            (z is not None and z.dtype != y.dtype):
        return _epilogue_whole(xp, y, bias, z, activation, params)
    if xp is np and _epilogue_compiled(y, row, z, activation, params, channels):
        return y
    if row is not None:
        y += row
    elif channels is not None:
        y += bias                                                 # the channels, broadcast
    if z is not None:
        y += z
    activate_in_place(xp, y, activation, params)
    return y


def _epilogue_whole(xp, y, bias, z, activation, params):
    dtype = y.dtype
    if bias is not None:
        y = y + bias
    if z is not None:
        y = y + z
    work = y.astype(dtype if dtype.kind == "f" else np.float32)  # a copy we may write into
    activate_in_place(xp, work, activation, params)
    return work.astype(dtype, copy=False)


# --- the compiled epilogue (numba, ops/cpu/compiled.py): bias, residual and activation in one
# pass over the product instead of one numpy pass each: a pass over a convolution's output is
# a trip through memory. Below EPILOGUE_MIN elements (ops/cpu/tuning.py) numpy's passes are
# as fast as a compiled call, but for GELU's (a pass for each step of its formula). The
# kernel does numpy's operations in numpy's order and rounding (no contraction), so it gives
# the same bits; but GELU's tanh form, whose float32 tanh (ops/cpu/compiled.py) is within 2
# ulp of numpy's.

_EPILOGUE_CODES = {"": 0, "Relu": 1, "LeakyRelu": 2, "Clip": 3, "HardSigmoid": 4,
                   "HardSwish": 5}
_GELU_CODES = (6, 7)     # GELU's erf form, its tanh approximation: float32 only
_SWISH_CODE = 8          # float32 only: exp by exp_float32 (compiled.py), within 3 ulp of numpy's
_SIGMOID_CODE = 9        # float32 only: sigmoid_float32, as the elementwise chains compute it
# long formulas (numpy computes each in several passes): compiled at any size
_FORMULA_CODES = (*_GELU_CODES, _SWISH_CODE, _SIGMOID_CODE)
_EPILOGUE_EMPTY = {t: (np.empty(0, t), np.empty((0, 0), t)) for t in (np.float32, np.float64)}


def _epilogue_compiled(y, row, z, activation: str, params: list[float], channels=None) -> bool:
    """activation(y + row + z), or with `channels` (one bias per channel, y's axis 1) for
    `row`, into y by the compiled kernel where it applies: a float32 / float64 `y` of at least
    EPILOGUE_MIN elements (GELU: any), C-ordered or channels-last, an activation it knows;
    `row` (over y's last axis) only on a C-ordered y. Returns whether it ran."""
    code = _epilogue_code(activation, params, y.dtype)
    if code is None or y.dtype.type not in _EPILOGUE_EMPTY or (
            y.size < tuning.EPILOGUE_MIN and code not in _FORMULA_CODES):
        return False
    if code == 0 and row is None and channels is None and z is None:
        return True                            # nothing to do
    kernel = _compiled.jit(epilogue_loops)
    if kernel is None:
        return False
    t = y.dtype.type
    (bias, no_residual), per_row = _EPILOGUE_EMPTY[t], False
    if y.flags.c_contiguous:
        order = tuple(range(y.ndim))
        if row is not None:
            rows = y.reshape(-1, y.shape[-1])
            bias = row
        elif channels is not None:             # a bias per row of pixels
            rows = y.reshape(y.shape[0] * y.shape[1], -1)
            bias, per_row = channels, True
        else:                                  # any rows: long ones
            rows = y.reshape(-1, _row_length(y.shape))
    elif row is None:
        order = (0, *range(2, y.ndim), 1)      # channels-last: the channels are the rows' axis
        if channels is not None:
            rows = y.transpose(order).reshape(-1, y.shape[1])
            bias = channels
        else:   # long rows of the memory: a row of a few channels would cost a loop each
            rows = y.transpose(order).reshape(-1, _row_length(y.transpose(order).shape))
    else:
        return False
    if z is not None and z.strides != y.strides:
        z = _in_layout_of(y, z)
    residual = no_residual if z is None else z.transpose(order).reshape(rows.shape)
    p0, p1 = loop_parameters(activation, params)
    ns = tuning.EPILOGUE_NS + (tuning.GELU_NS if code in _FORMULA_CODES else 0.0)
    _compiled.split_rows(kernel, rows.shape[0], rows, bias, per_row, residual, code, t(p0), t(p1),
                         ns_per_row=ns * rows.shape[1], piece=_EPILOGUE_PIECES[t])
    return True


# The epilogue's piece functions (ops/cpu/compiled.py: the helpers run their pieces without
# Python), one per dtype; `_epilogue_arguments` rebuilds the arguments.
@_compiled.kernel_math
def _epilogue_arguments(block, dtype):  # pragma: no cover
    """(y, bias, bias_per_row, z, code, p0, p1) from the block `split_rows` made."""
    v = _compiled.array_at(block, (12,), np.int64)
    f = _compiled.array_at(block, (12,), np.float64)
    return (_compiled.array_at(v[0], (v[1], v[2]), dtype),
            _compiled.array_at(v[3], (v[4],), dtype), v[5] != 0,
            _compiled.array_at(v[6], (v[7], v[8]), dtype), v[9], dtype(f[10]), dtype(f[11]))


def _epilogue_piece32(block, row0, row1):  # pragma: no cover
    epilogue_loops(*_epilogue_arguments(block, np.float32), row0, row1)


def _epilogue_piece64(block, row0, row1):  # pragma: no cover
    epilogue_loops(*_epilogue_arguments(block, np.float64), row0, row1)


_EPILOGUE_PIECES = {np.float32: _epilogue_piece32, np.float64: _epilogue_piece64}


def _epilogue_code(activation: str, params: list[float], dtype) -> int | None:
    """The kernel's code for `activation` (_EPILOGUE_CODES, _FORMULA_CODES), or None where the
    kernel does not have it."""
    if activation == "Gelu":
        return None if dtype != np.float32 else _GELU_CODES[bool(params and params[0])]
    if activation == "Swish":
        return None if dtype != np.float32 else _SWISH_CODE
    if activation == "Sigmoid":
        return None if dtype != np.float32 else _SIGMOID_CODE
    return _EPILOGUE_CODES.get(activation)


def loop_parameters(activation: str, params: list[float]) -> tuple[float, float]:
    """(p0, p1), `epilogue_loops`' parameters of `activation` (0 for unused ones; ReLU's
    upper bound inf, see `epilogue_loops`)."""
    p0, p1 = (with_defaults(activation, params) + [0.0, 0.0])[:2]
    return (p0, np.inf) if activation == "Relu" else (p0, p1)


def activation_in_loops(activation: str, params: list[float], dtype
                        ) -> tuple[int, float, float] | None:
    """(code, p0, p1) with which a kernel applies `activation` by `epilogue_loops` after
    its own bias, or None where the loops lack it (or for no activation)."""
    code = _epilogue_code(activation, params, dtype)
    return None if not code else (code, *loop_parameters(activation, params))


def _row_length(shape) -> int:
    """A row length for the kernel over C-ordered memory of `shape`: its trailing axes
    together, as few as make a row of 1024 values (rows of 7 or 49 values, a small
    feature map's, would cost a loop each)."""
    length = 1
    for d in reversed(shape):
        length *= d
        if length >= 1024:
            break
    return max(1, length)


def _in_layout_of(y, z):
    """z copied into y's memory layout (a residual laid out otherwise): the kernel reads both
    as the same rows."""
    out = np.empty_like(y)          # y's strides (numpy keeps the layout of a dense y)
    out[...] = z
    return out


@_compiled.kernel_math
def epilogue_loops(y, bias, bias_per_row, z, code, p0, p1, row0, row1):  # pragma: no cover
    """Rows [row0, row1) of y (rows, C) in place: y + bias if given, along each row (bias
    (C,)) or, with `bias_per_row`, bias[i % bias.size] over all of row i; + z (rows, C) if
    given; then activation `code` (_epilogue_code) with parameters p0, p1. Each step rounded
    as numpy's in-place ufuncs round it (activate_in_place). One loop per step over a row,
    which is in L1 by then: branch-free loops that LLVM vectorises (numba).

    No loop stores back, on one branch only, the value it loaded (ReLU as `0 if v <= 0 else
    v`): LLVM turns that into a store on the other branch, a masked vector store, which AMD's
    CPUs run slowly. So ReLU's loop clips to [0, p1] with p1 = inf, as Clip's does, and
    LeakyRelu multiplies every value, by 1 where it is not negative (exact)."""
    C = y.shape[1]
    one, zero, sixth, half = y.dtype.type(1), y.dtype.type(0), y.dtype.type(1 / 6), \
        y.dtype.type(0.5)
    for i in range(row0, row1):
        out = y[i]
        if bias.size and bias_per_row:
            b = bias[i % bias.size]
            for c in range(C):
                out[c] = out[c] + b
        elif bias.size:
            for c in range(C):
                out[c] = out[c] + bias[c]
        if z.size:
            for c in range(C):
                out[c] = out[c] + z[i, c]
        if code == 1:                                       # Relu (p1 = inf)
            for c in range(C):                              # np.maximum's: -0.0 -> 0.0
                v = out[c]
                v = zero if v <= zero else v
                out[c] = p1 if v > p1 else v
        elif code == 2:                                     # LeakyRelu(alpha = p0)
            for c in range(C):
                v = out[c]
                out[c] = v * (p0 if v < zero else one)
        elif code == 3:                                     # Clip(p0, p1)
            for c in range(C):
                v = out[c]
                v = p0 if v < p0 else v
                out[c] = p1 if v > p1 else v
        elif code == 4:                                     # HardSigmoid(alpha = p0, beta = p1)
            for c in range(C):
                v = out[c] * p0 + p1
                out[c] = zero if v < zero else (one if v > one else v)
        elif code == 5:                                     # HardSwish
            for c in range(C):
                v = out[c]
                gate = v * sixth + half
                gate = zero if gate < zero else (one if gate > one else gate)
                out[c] = v * gate
        elif code == 6:                                     # Gelu (erf), float32 only
            for c in range(C):
                out[c] = gelu_erf_float32(out[c])
        elif code == 7:                                     # Gelu (tanh), float32 only
            for c in range(C):
                out[c] = gelu_tanh_float32(out[c])
        elif code == 8:                                     # Swish(alpha = p0), float32 only
            for c in range(C):
                v = out[c]
                out[c] = v * sigmoid_float32(v * p0)
        elif code == 9:                                     # Sigmoid, float32 only
            for c in range(C):
                out[c] = sigmoid_float32(out[c])


# --- the epilogue in a product's pieces: where a fused op's result is one product on the board
# (a 1x1 convolution of a channels-last image: (pixels, channels) = (pixels, inputs) @
# (inputs, channels)), each piece of the product is finished (bias over its columns, residual,
# activation) right after its GEMM by the thread that computed it: no call and no pass of its
# own over the output. Same bits: the same kernel (epilogue_loops) over the same values.

def product_with_epilogue(a, b, out, bias, z, activation: str, params: list[float]):
    """How to compute out = activation(a @ b + bias + z) for 2-D a, b and a C-ordered out
    (bias over out's columns, z of out's shape) with the epilogue in the product's pieces on
    the board: (piece function's address, block, bounds) for `_blas.run_pieces`; None where
    the product is not cut on the board or the kernel lacks this epilogue."""
    code = _epilogue_code(activation, params, out.dtype)
    if code is None or a.ndim != 2 or b.ndim != 2 or out.dtype.type not in _EPILOGUE_EMPTY \
            or not out.flags.c_contiguous or any(
                v is not None and (v.dtype != out.dtype or not v.flags.c_contiguous)
                for v in (bias, z)) \
            or (z is not None and z.shape != out.shape) \
            or (bias is not None and bias.shape != (out.shape[1],)):
        return None
    product = _blas.product_fields(a, b, out)
    piece = None if product is None else _compiled.piece_address(
        _PRODUCT_EPILOGUE_PIECES[out.dtype.type])
    if piece is None:
        return None
    block = np.empty(_PRODUCT_HEAD + product.size, np.int64)
    p0, p1 = loop_parameters(activation, params)
    block[:_PRODUCT_HEAD] = (block.size, 0 if bias is None else _address(bias),
                             0 if z is None else _address(z), 0 if z is None else z.strides[0],
                             out.itemsize, code, 0, 0, _address(out), out.strides[0])
    block[6:8] = np.array([p0, p1], np.float64).view(np.int64)
    block[_PRODUCT_HEAD:] = product
    return piece, block, list(product[_blas.BOUNDS_FIELD:])


# the block's fields: its length, bias, residual and its row stride (bytes), the item size,
# the epilogue's code and parameters (float64 bits), the output and its row stride; then the
# product's fields (_blas.product_fields)
_Z_FIELD, _OUT_FIELD, _PRODUCT_HEAD = 2, 8, 10


@_compiled.kernel_math
def _product_epilogue(block, row0, row1, dtype):  # pragma: no cover
    """Piece [row0, row1) of the product in the block product_with_epilogue made, then the
    epilogue on the part of the output it wrote: whole rows at once, or row by row."""
    fields = _compiled.array_at(block, (1,), np.int64)[0]
    v = _compiled.array_at(block, (fields,), np.int64)
    f = _compiled.array_at(block, (fields,), np.float64)
    r0, r1, c0, c1 = _blas.product_piece(v, _PRODUCT_HEAD, row0, row1)
    bias_at, z_at, z_row, size, code, out_at, out_row = v[1], v[2], v[3], v[4], v[5], v[8], \
        v[9]
    width = c1 - c0
    bias = _compiled.array_at(bias_at + c0 * size, (width if bias_at else 0,), dtype)
    no_residual = _compiled.array_at(z_at, (0, 0), dtype)
    p0, p1 = dtype(f[6]), dtype(f[7])
    rows = 1
    if width * size == out_row and (z_at == 0 or z_row == out_row):   # whole rows: one block
        rows, r1 = r1 - r0, r0 + 1
    for r in range(r0, r1):
        y = _compiled.array_at(out_at + r * out_row + c0 * size, (rows, width), dtype)
        z = no_residual if z_at == 0 else \
            _compiled.array_at(z_at + r * z_row + c0 * size, (rows, width), dtype)
        epilogue_loops(y, bias, False, z, code, p0, p1, 0, rows)


def _product_epilogue_piece32(block, row0, row1):  # pragma: no cover
    _product_epilogue(block, row0, row1, np.float32)


def _product_epilogue_piece64(block, row0, row1):  # pragma: no cover
    _product_epilogue(block, row0, row1, np.float64)


_PRODUCT_EPILOGUE_PIECES = {np.float32: _product_epilogue_piece32,
                            np.float64: _product_epilogue_piece64}


def pointwise_route(x, wt, b, z, activation: str, params: list[float]) -> PointwiseRoute | None:
    """The route of a 1x1 convolution of the channels-last x by wt (C, M) (conv's
    pointwise_weights), then bias b, residual z and the activation, where its product goes
    on the board; else None."""
    route = PointwiseRoute(x, wt, b, z, activation, params)
    return route if route.plan is not None else None


class PointwiseRoute:
    """A 1x1 convolution of a channels-last image (conv.pointwise_cl_fits, stride 1, group 1)
    as one product with its epilogue in the product's pieces, worked out once for an input
    geometry: a run fills in three addresses and posts the pieces, without the convolution's
    own path around its product, whose cost adds up over a mobile network's many 1x1
    convolutions."""
    lowering = Lowering("cpu.board-gemm", "1x1 convolution of a channels-last image: one "
                        "product cut into pieces on the pool's board, the epilogue in its pieces")

    def __init__(self, x, wt, b, z, activation, params):
        N, C, *spatial = x.shape
        M = wt.shape[1]
        self.rows_shape = (N, *spatial, M)
        self.axes = (0, x.ndim - 1, *range(1, x.ndim - 1))   # back to (N, M, *spatial)
        bias = None if b is None else b.reshape(-1).astype(x.dtype)
        out = _tiles.empty((N * math.prod(spatial), M), x.dtype)
        self.plan = product_with_epilogue(pixel_rows(x), wt, out, bias, pixel_rows(z), activation,
                                          params)
        self.kept = (wt, bias)   # the block holds their addresses

    def run(self, x, z=None):
        piece, template, bounds = self.plan
        out = _tiles.empty((template[_PRODUCT_HEAD + _blas.M_FIELD],
                            template[_PRODUCT_HEAD + _blas.N_FIELD]), x.dtype)
        block = template.copy()
        block[_PRODUCT_HEAD + _blas.A_FIELD] = _address(x)
        block[_PRODUCT_HEAD + _blas.C_FIELD] = block[_OUT_FIELD] = _address(out)
        if z is not None:
            block[_Z_FIELD] = _address(z)
        _blas.run_pieces(piece, block, bounds)
        return out.reshape(self.rows_shape).transpose(self.axes)


# --- a 1x1 convolution as register tiles (ops/cpu/tiles.py) over its pixels: the weights packed
# once (OpenBLAS packs them again on every call), the bias and a clip in the tiles' stores, a
# residual and any other activation after each piece's rows, by the thread that wrote them.
# A piece is whole bands of tiles (every block of output channels of its pixels), so that
# the caller keeps to the first rows and a helper to the last, as the products' pieces do
# (ops/cpu/blas.py): the rows a thread reads next are the ones it wrote.

def tiles_pointwise_fits(x, w, b, group, strides, begin, end) -> bool:
    """Whether a 1x1 convolution of x by w (+ bias b) runs as `TilesPointwiseRoute` in runs:
    float32, a channels-last x (or a channel slice of one: `pixel_stride`), constant
    (read-only) weights and bias, group 1, stride 1, no pads, AVX-512, and conv's size
    rule."""
    return (x.dtype == np.float32 and x.ndim == 4 and group == 1 and w.shape[2:] == (1, 1)
            and not w.flags.writeable and (b is None or not b.flags.writeable)
            and all(s == 1 for s in strides) and not any(begin) and not any(end)
            and pixel_stride(x) is not None and _blas.in_run() and _tiles.kernel() is not None
            and tiles_pointwise_size(x, w))


def tiles_pointwise_size(x, w) -> bool:
    """Where the tiles beat OpenBLAS on 1x1 convolutions in runs: AVX-512 (AVX2's narrower
    tiles lose to OpenBLAS there)."""
    return _tiles.WIDE


def tiles_pointwise_route(x, w, bias, z, clamp, activation: str, params: list[float]
                          ) -> TilesPointwiseRoute | None:
    """The route of a 1x1 convolution that `tiles_pointwise_fits` (w (M, C, 1, 1) and bias
    constants), then the residual z and the activation (or the clip to `clamp`), where the
    epilogue kernel has the activation; else None."""
    M, C = w.shape[:2]
    packed, packed_bias = _tiles.pack(np.ascontiguousarray(w.reshape(M, C).T), bias)
    route = TilesPointwiseRoute(x, packed, packed_bias, M, z, clamp, activation, params)
    return route if route.plan is not None else None


class TilesPointwiseRoute:
    """A 1x1 convolution of a channels-last image (`tiles_pointwise_fits`) as register tiles,
    with its epilogue, worked out once for an input geometry: a run fills in the addresses
    and posts the pieces."""
    lowering = Lowering("cpu.tiles-pointwise", "1x1 convolution of a channels-last image by "
                        "register tiles, bias, residual and activation in their stores")

    def __init__(self, x, packed, packed_bias, M, z, clamp, activation, params):
        N, C, H, W = x.shape
        L = N * H * W
        blocks = packed.shape[0]
        tiles = -(-L // _tiles.ROWS)
        pieces = len(_compiled.row_bounds(tiles, blocks * _tiles.unit_ns(packed))) - 1
        band, units = _tiles.rows_split(tiles, blocks, _tiles.band_tiles(
            tiles, 1, L * C, C, 1, packed), pieces)
        self.bounds = [u // blocks for u in units]   # in tiles
        if z is None and (clamp is not None or not activation):   # no epilogue
            (lo, hi), code = clamp or (-np.inf, np.inf), -1
        else:
            (lo, hi), code = (-np.inf, np.inf), _epilogue_code(activation, params, x.dtype)
        self.plan = None if code is None else _compiled.piece_address(_tiles_pointwise_piece)
        p0, p1 = loop_parameters(activation, params)
        step = pixel_stride(x)   # C, or more for a channel slice of an image
        pixels = np.arange(L, dtype=np.int64) * step
        taps = np.zeros(1, np.int64)
        self.kept = (packed, packed_bias, pixels, taps)   # the block holds their addresses
        self.rows_shape, self.out_shape = (N, H, W, M), (L, M)
        self.template = np.zeros(_TILES_FIELDS, np.int64)
        extent = (L - 1) * step + C   # the values from the first pixel's to the last's end
        self.template[:] = (0, extent, _address(pixels), L, _address(taps), C, _address(packed),
                            blocks, _address(packed_bias), 0, 0, 0, M, band, 0, code or 0, 0, 0,
                            0)
        self.template[[9, 10, 16, 17]] = np.array([lo, hi, p0, p1], np.float64).view(np.int64)
        # rows may be streamed around the caches (_tiles.streams) where no epilogue reads them
        self.stream = code == -1

    def run(self, x, z=None):
        out = _tiles.empty(self.out_shape)
        block = self.template.copy()
        block[0], block[11] = _address(x), _address(out)
        block[18] = self.stream and _tiles.streams(out)
        if z is not None:
            block[14] = _address(z)
        _blas.run_pieces(self.plan, block, self.bounds)
        return out.reshape(self.rows_shape).transpose(0, 3, 1, 2)


_TILES_FIELDS = 19  # TilesPointwiseRoute's block: see its template


def _tiles_pointwise_piece(block, t0, t1):  # pragma: no cover
    """Tiles [t0, t1) (whole bands) of the 1x1 convolution in the block
    (TilesPointwiseRoute), then the epilogue on the rows they wrote (its code -1: none)."""
    v = _compiled.array_at(block, (_TILES_FIELDS,), np.int64)
    f = _compiled.array_at(block, (_TILES_FIELDS,), np.float64)
    L, C, blocks, M = v[3], v[5], v[7], v[12]
    out = _compiled.array_at(v[11], (L, M), np.float32)
    _tiles.conv_tiles_loops(
        _compiled.array_at(v[0], (v[1],), np.float32), v[1],
        _compiled.array_at(v[2], (L,), np.int64), _compiled.array_at(v[4], (1,), np.int64), C,
        _compiled.array_at(v[6], (blocks, C, _tiles.BLOCK), np.float32),
        _compiled.array_at(v[8], (blocks * _tiles.BLOCK,), np.float32),
        np.float32(f[9]), np.float32(f[10]), out, 1, v[13], v[18], t0 * blocks, t1 * blocks)
    if v[15] >= 0:
        residual = v[14] != 0
        z = _compiled.array_at(v[14], (L if residual else 0, M if residual else 0), np.float32)
        epilogue_loops(out, _compiled.array_at(v[8], (0,), np.float32), False, z, v[15],
                        np.float32(f[16]), np.float32(f[17]), t0 * _tiles.ROWS,
                        min(L, t1 * _tiles.ROWS))

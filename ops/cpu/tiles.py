"""CPU kernels whose inner loops are written as explicit vector code (LLVM IR through numba
intrinsics), where numba's loops over scalars did not vectorise well. A vector is LANES
float32 lanes (16 with AVX-512, 8 with AVX2; see HOST_LANES below).

* Register tiles (`conv_tiles_loops`, `tile`): a 2-D convolution, or a product of a few rows
  by a constant weight. A tile is R output pixels by BLOCK = 2 * LANES output channels, held
  in 2R vector accumulators. For each tap t of the window and each input channel c, the tile
  loads the BLOCK weights of (t, c), broadcasts each of its R pixels' input value
  x[pixel r + tap t, c], and adds the R x BLOCK products with fused multiply-adds; at the end
  it adds the bias, clips to [lo, hi] (ReLU, ReLU6) and stores R rows of the channels-last
  output. The input is read where it lies, a channels-last image padded once, by an offset
  per output pixel (`pixels`, the window's origin) plus an offset per tap (`taps`): no patch
  matrix is built, and strides, dilations and pads are only offsets. The weights are packed
  once per constant weight: (M / BLOCK blocks, T*C, BLOCK), a block's rows read in order.
* Depthwise pixels (`depthwise_pixels`): 4 output pixels by LANES channels, the window's 9,
  25 or 49 weights held in registers.
* Column blocks (`row_columns`, `columns_from_blocks`): h R for a recurrence's step, 4 rows
  by COLUMN_BLOCKS blocks of LANES columns of R packed in blocks, with no sum across a
  vector's lanes.

Why written by hand: LLVM's SLP pass left a register-blocked loop scalar, and OpenBLAS's
GEMM on the patch matrix ran ResNet-50's and UNet's convolutions well below the core's peak,
plus the patch copy, where the tiles run close to it. As intrinsics, the vector code is
compiled and cached on disk with the kernel that calls it (numba checks only that kernel's
file for changes: see ops/cpu/compiled.py).

The vector width is the CPU's, decided once at import (`HOST_LANES`): 16 float32 lanes with
AVX-512 (32 vector registers: tiles of 12 pixels), 8 with AVX2 and FMA (16 registers: tiles
of 6 pixels, as BLIS's Haswell kernel, and 2 column blocks at a time for a recurrence).
Without either, or without numba, BLAS and the numpy kernels serve.

The bits: each output is a sum in one fixed order, then + bias, whatever the tile or block
it falls in or the thread that runs it; a run gives the same bits on one thread or several.
"""
from __future__ import annotations

import importlib.util
import math
import sys

import numpy as np

from ember.ops.cpu import compiled as _compiled, memory as _memory, tuning
from ember.ops.cpu.process import current


def _host_lanes() -> int:
    """float32 lanes of the widest vectors this CPU computes on: 16 with AVX-512, 8 with AVX2
    and FMA, 0 without either or without numba (llvmlite reads the CPU: slow, so once)."""
    if importlib.util.find_spec("numba") is None:
        return 0
    import llvmlite.binding as llvm
    features = llvm.get_host_cpu_features()
    if features.get("avx512f", False):
        return 16
    return 8 if features.get("avx2", False) and features.get("fma", False) else 0


HOST_LANES = _host_lanes()
LANES = HOST_LANES or 16   # float32 lanes of one vector
BLOCK = 2 * LANES          # output channels per tile
# output pixels per tile: 2 * ROWS accumulators + 2 weight vectors + 1 broadcast value fill
# AVX-512's 32 vector registers with 12 (27), AVX2's 16 with 6 (15)
ROWS = 12 if LANES == 16 else 6
# the tile for what is left of an image's pixels; it divides ROWS, so that the last tiles of
# an image fill at most the ROWS rows of their scratch
SMALL_ROWS = 4 if LANES == 16 else 3
assert ROWS % SMALL_ROWS == 0
WIDE = LANES == 16         # AVX-512's width; the callers say where AVX2's tiles lose to BLAS
COLUMN_BLOCKS = 4 if WIDE else 2  # a recurrence's column blocks at a time (x 4 rows)
# The tiles prefetch the weights PREFETCH_AHEAD floats (ops/cpu/tuning.py) ahead of the row
# they read, into the first level: a tile reads its block's weights in one pass, and the first
# tile of a band reads them from memory (a layer's weights, evicted since the last run by the
# rest of the model's), where the hardware's prefetcher alone kept it waiting. A plain global:
# the tiles' IR generation (`_emit_tile`) reads it.
PREFETCH_AHEAD = tuning.PREFETCH_AHEAD
# the tiles' rate on one core (GF/s), for split_rows' estimate: AVX2's vectors are half-width
_CORE_GFLOPS = tuning.CORE_GFLOPS if WIDE else tuning.CORE_GFLOPS_AVX2


def tile(rows, image, base, taps, channels, packed, bias, lo, hi, out, at, ldc, width, stream):
    """The tile's semantics in numpy (the compiled kernel uses the intrinsic below): out's
    `rows` rows from flat index `at`, row stride `ldc`, their first `width` (at most 32)
    channels, are clip(sum over taps t and channels c of image[base[r] + taps[t] + c] *
    packed[t*C + c] + bias, lo, hi); the compiled stores leave the others untouched (masked
    stores). With `stream` (rows aligned to 64 bytes) whole rows are stored around the
    caches (non-temporal stores; `store_fence` after them)."""
    c = np.arange(channels)
    for r in range(rows):
        x = image[base[r] + taps[:, None] + c].reshape(-1)            # (T*C,)
        y = np.clip(x @ packed + bias, lo, hi)
        out[at + r * ldc:at + r * ldc + width] = y[:width]


def store_fence():
    """Order the non-temporal stores before it before any store after it (x86's sfence):
    a piece's streamed rows are in memory before it counts itself done. Compiled code."""


@_compiled.kernel_math
def conv_tiles_loops(image, image_size, pixels, taps, channels, packed, bias, lo, hi, out,
                     images, band, stream, u0, u1):
    """Units [u0, u1) of a convolution's output out (images * L, M), float32. The tiles of
    ROWS pixels, image after image, are taken in bands of `band` tiles; a unit is one tile
    by one column block, ordered by band, then block, then tile: a band's input stays in
    cache while each block of weights is applied to it in turn. `image` holds the padded
    images (channels-last, or an image's planes: ops/conv.py), `image_size` values apart;
    `pixels` (L,) each output pixel's window origin in an image; `taps` (T,) each tap's
    offset from it; `packed` (blocks, T * channels, BLOCK); `bias` (blocks * BLOCK,).

    One loop, no function taking arrays per unit: numba counts references to the arrays a
    function is handed, 16 atomic increments and decrements a unit, a large share of a small
    unit's time."""
    L = pixels.shape[0]
    M = out.shape[1]
    blocks = packed.shape[0]
    per_image = (L + ROWS - 1) // ROWS
    tiles = images * per_image
    flat = out.reshape(-1)
    base = np.empty(ROWS, np.int64)
    scratch = np.empty(ROWS * BLOCK, np.float32)
    u = 0  # the unit of (band, block, tile) below; [u0, u1) are run
    for first in range(0, tiles, band):
        in_band = min(band, tiles - first)
        if u + blocks * in_band <= u0:
            u += blocks * in_band
            continue
        for block in range(blocks):
            if u >= u1:
                return
            if u + in_band <= u0:
                u += in_band
                continue
            weights = packed[block]
            b = bias[block * BLOCK:(block + 1) * BLOCK]
            width = min(BLOCK, M - block * BLOCK)
            n, p = first // per_image, (first % per_image) * ROWS
            for _ in range(in_band):
                if u0 <= u < u1:  # pixels [p, p + ROWS) of image n by column block `block`
                    rows = min(ROWS, L - p)
                    at = (n * L + p) * M + block * BLOCK
                    origin = n * image_size
                    if rows == ROWS:
                        for r in range(ROWS):
                            base[r] = origin + pixels[p + r]
                        tile(ROWS, image, base, taps, channels, weights, b, lo, hi, flat, at,
                             M, width, stream)
                    else:  # an image's last pixels: tiles of SMALL_ROWS, in the scratch
                        for q in range(0, rows, SMALL_ROWS):
                            for r in range(SMALL_ROWS):
                                base[r] = origin + pixels[p + min(q + r, rows - 1)]
                            tile(SMALL_ROWS, image, base, taps, channels, weights, b, lo, hi,
                                 scratch, q * BLOCK, BLOCK, BLOCK, 0)
                        for r in range(rows):
                            for j in range(width):
                                flat[at + r * M + j] = scratch[r * BLOCK + j]
                u += 1
                p += ROWS
                if p >= L:
                    n, p = n + 1, 0
    if stream:
        store_fence()


def depthwise_pixels(pixels, taps_count, image, start, step, taps, weights, bias, lo, hi,
                     out, at, out_step, groups, rows, row_step, out_row_step, width):
    """The depthwise kernel's semantics in numpy (compiled: the intrinsic below): in each of
    `rows` rows (the i-th starting at start + i * row_step in the image, at + i *
    out_row_step in out), `groups` groups of `pixels` consecutive output pixels, the first
    `width` of LANES channels each (the others neither read nor written: an image's last
    channels, fewer than LANES); pixel q's value at out[at + q * out_step + lane] is
    clip(sum over the taps t of image[start + q * step + taps[t] + lane] * weights[t, lane]
    + bias[lane], lo, hi). weights and bias hold whole vectors."""
    lanes = np.arange(width)
    for i in range(rows):
        for q in range(pixels * groups):
            x = image[start + i * row_step + q * step + taps[:taps_count, None] + lanes]
            y = (x * weights.reshape(-1, LANES)[:taps_count, :width]).sum(axis=0) \
                + bias[:width]
            out[at + i * out_row_step + q * out_step + lanes] = np.clip(y, lo, hi)


@_compiled.kernel_math
def depthwise_segment(T, image, start, step, taps, w, b, lo, hi, out, at, out_step, pixels,
                      rows, row_step, out_row_step, width):
    """`pixels` consecutive output pixels in each of `rows` rows, one block of LANES
    channels, the first `width` of them (as `depthwise_pixels`), DEPTHWISE_PIXELS at a time,
    then one by one; T (the window's taps: 9, 25 or 49) picks the compiled intrinsic."""
    if T == 9:
        _depthwise_segment(9, image, start, step, taps, w, b, lo, hi, out, at, out_step,
                           pixels, rows, row_step, out_row_step, width)
    elif T == 25:
        _depthwise_segment(25, image, start, step, taps, w, b, lo, hi, out, at, out_step,
                           pixels, rows, row_step, out_row_step, width)
    else:
        _depthwise_segment(49, image, start, step, taps, w, b, lo, hi, out, at, out_step,
                           pixels, rows, row_step, out_row_step, width)


@_compiled.kernel_math
def _depthwise_segment(T, image, start, step, taps, w, b, lo, hi, out, at, out_step, pixels,
                       rows, row_step, out_row_step, width):
    groups = pixels // DEPTHWISE_PIXELS
    depthwise_pixels(DEPTHWISE_PIXELS, T, image, start, step, taps, w, b, lo, hi, out, at,
                     out_step, groups, rows, row_step, out_row_step, width)
    q = groups * DEPTHWISE_PIXELS
    if q < pixels:
        depthwise_pixels(1, T, image, start + q * step, step, taps, w, b, lo, hi, out,
                         at + q * out_step, out_step, pixels - q, rows, row_step,
                         out_row_step, width)


def row_columns(rows, blocks, h, P, j, G):
    """The recurrent product's semantics in numpy (compiled: the intrinsic below): for the
    `rows` rows b of h (K,) each and the column blocks j .. j + blocks of P (N / LANES, K,
    LANES), G[b, j * LANES:(j + blocks) * LANES] = h[b] @ those columns, the sum in k
    order."""
    for b in range(rows):
        for v in range(blocks):
            acc = np.zeros(LANES, np.float32)
            for k in range(P.shape[1]):
                acc += h[b, k] * P[j + v, k]
            G[b, (j + v) * LANES:(j + v + 1) * LANES] = acc


@_compiled.kernel_math
def columns_from_blocks(h, P, G, n0, n1):
    """G[:, n] = h @ W[:, n] for the columns n in [n0, n1), multiples of LANES, float32: h
    (batch, K), W (K, N) packed in column blocks P (N / LANES, K, LANES) (`pack_columns`),
    each block's K x LANES values read in order, 4 rows by COLUMN_BLOCKS blocks in vector
    registers at a time. Each output is the same sum in k order whichever block or thread
    computes it."""
    batch = h.shape[0]
    j1 = n1 // LANES
    b = 0
    while b < batch:
        rows = 4 if b + 4 <= batch else 1
        hb, Gb = h[b:b + rows], G[b:b + rows]
        j = n0 // LANES
        while j + COLUMN_BLOCKS <= j1:
            if rows == 4:
                row_columns(4, COLUMN_BLOCKS, hb, P, j, Gb)
            else:
                row_columns(1, COLUMN_BLOCKS, hb, P, j, Gb)
            j += COLUMN_BLOCKS
        while j < j1:
            if rows == 4:
                row_columns(4, 1, hb, P, j, Gb)
            else:
                row_columns(1, 1, hb, P, j, Gb)
            j += 1
        b += rows


def pack_columns(W: np.ndarray) -> np.ndarray:
    """W (K, N), N a multiple of LANES, as column blocks (N / LANES, K, LANES), aligned."""
    K, N = W.shape
    P = empty((N // LANES, K, LANES))
    P[...] = W.reshape(K, N // LANES, LANES).transpose(1, 0, 2)
    return P


def recurrence_by_rows(H: int) -> bool:
    """Whether a recurrence of H hidden units takes `columns_from_blocks` (numba, AVX-512 or
    AVX2, H a multiple of LANES, so each gate's chunk of units is whole blocks); registers
    the intrinsic for the kernels that call it."""
    numba = _compiled._numba() if _compiled.enabled() else None
    if numba is None:
        return False
    _register(numba)  # compiled into the recurrences either way
    return H % LANES == 0 and _vectors


DEPTHWISE_PIXELS = 4           # output pixels a depthwise step holds in registers
DEPTHWISE_TAPS = (9, 25, 49)   # the windows compiled: 3x3, 5x5, 7x7


def depthwise_kernel(loops):
    """`loops` (a depthwise kernel calling depthwise_segment) compiled, or None (as
    `kernel`)."""
    return _with_vectors(loops)


_vectors = HOST_LANES > 0  # whether the vector kernels serve (tests turn them off)


def kernel():
    """conv_tiles_loops compiled, or None: without numba, or on a CPU without AVX-512 or
    AVX2 (then BLAS serves)."""
    return _with_vectors(conv_tiles_loops)


def _with_vectors(loops):
    """`loops` compiled with the intrinsics registered, or None without numba or vectors."""
    numba = _compiled._numba() if _compiled.enabled() else None
    if numba is None or not _vectors:
        return None
    _register(numba)
    return _compiled.jit(loops)


# ------------------------------------------------------------------ the vector code
# Built with llvmlite as numba intrinsics, once numba is imported (it is optional: these
# classes and functions import nothing of it at module load).

class _Kit:
    """llvmlite's and numba's builders, and the types and constants of LANES float32 vectors,
    for the intrinsics below."""

    def __init__(self):
        from llvmlite import ir
        from numba.core import cgutils
        self.ir, self.cgutils = ir, cgutils
        self.f32, self.i32, self.i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        self.vec = ir.VectorType(self.f32, LANES)
        self.splat_mask = ir.Constant(ir.VectorType(self.i32, LANES), [0] * LANES)
        self.undef = ir.Constant(self.vec, ir.Undefined)

    def const(self, v):
        return self.ir.Constant(self.i64, v)

    def splat(self, builder, scalar):
        one = builder.insert_element(self.undef, scalar, self.ir.Constant(self.i32, 0))
        return builder.shuffle_vector(one, self.undef, self.splat_mask)


class _Vectors:
    """Vector IR for one intrinsic: `data(i)` the data pointer of array argument i, loads
    and stores of LANES floats at an element index, fused multiply-add, clip to [lo, hi] (a
    NaN stays NaN)."""

    def __init__(self, kit, context, builder, sig, args):
        ir, vec, i32 = kit.ir, kit.vec, kit.i32
        self.kit = kit
        self.builder, self._context, self._sig, self._args = builder, context, sig, args
        self._fma = kit.cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{LANES}f32")
        self._prefetch = kit.cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(),
                                                            i32, i32, i32]),
            "llvm.prefetch.p0i8")

    def array(self, i):
        return self._context.make_array(self._sig.args[i])(
            self._context, self.builder, self._args[i])

    def data(self, i):
        return self.array(i).data

    def _at(self, ptr, index):
        return self.builder.bitcast(self.builder.gep(ptr, [index]), self.kit.vec.as_pointer())

    def load(self, ptr, index):
        return self.builder.load(self._at(ptr, index), align=4)

    def store(self, value, ptr, index):
        self.builder.store(value, self._at(ptr, index), align=4)

    def prefetch(self, ptr, index):
        ir, i32 = self.kit.ir, self.kit.i32
        address = self.builder.bitcast(self.builder.gep(ptr, [index]),
                                       ir.IntType(8).as_pointer())
        self.builder.call(self._prefetch, [address, ir.Constant(i32, 0),
                                           ir.Constant(i32, 3), ir.Constant(i32, 1)])

    def fma(self, a, b, c):
        return self.builder.call(self._fma, [a, b, c])

    def stream(self, value, ptr, index):
        """A non-temporal store (the address aligned to a whole vector)."""
        store = self.builder.store(value, self._at(ptr, index), align=4 * LANES)
        store.set_metadata("nontemporal", self.builder.module.add_metadata(
            [self.kit.ir.Constant(self.kit.i32, 1)]))

    def lanes_below(self, count):
        """The mask of the lanes whose index is below `count` (an int64)."""
        ir, i32, i64 = self.kit.ir, self.kit.i32, self.kit.i64
        lanes = ir.Constant(ir.VectorType(i64, LANES), list(range(LANES)))
        one = self.builder.insert_element(ir.Constant(ir.VectorType(i64, LANES),
                                                      ir.Undefined), count,
                                          ir.Constant(i32, 0))
        counts = self.builder.shuffle_vector(one, one, self.kit.splat_mask)
        return self.builder.icmp_signed("<", lanes, counts)

    def masked_load(self, ptr, index, mask):
        """LANES floats at ptr[index] where `mask` is set (the others 0, not read)."""
        ir, vec, i32 = self.kit.ir, self.kit.vec, self.kit.i32
        load = self.kit.cgutils.get_or_insert_function(
            self.builder.module, ir.FunctionType(vec, [
                vec.as_pointer(), i32, ir.VectorType(ir.IntType(1), LANES), vec]),
            f"llvm.masked.load.v{LANES}f32.p0v{LANES}f32")
        return self.builder.call(load, [self._at(ptr, index), ir.Constant(i32, 4), mask,
                                        ir.Constant(vec, [0.0] * LANES)])

    def masked_store(self, value, ptr, index, mask):
        ir, vec, i32 = self.kit.ir, self.kit.vec, self.kit.i32
        store = self.kit.cgutils.get_or_insert_function(
            self.builder.module, ir.FunctionType(ir.VoidType(), [
                vec, vec.as_pointer(), i32, ir.VectorType(ir.IntType(1), LANES)]),
            f"llvm.masked.store.v{LANES}f32.p0v{LANES}f32")
        self.builder.call(store, [value, self._at(ptr, index), ir.Constant(i32, 4), mask])

    def clip(self, y, lo_v, hi_v):
        y = self.builder.select(self.builder.fcmp_ordered("<", y, lo_v), lo_v, y)
        return self.builder.select(self.builder.fcmp_ordered(">", y, hi_v), hi_v, y)


def _emit_tile(kit, R, context, builder, sig, args):
    """`tile`'s IR for R rows: 2R accumulators over the taps and channels, then bias, clip
    and R rows stored (streamed, through the caches, or masked for a block's last columns).
    A block of at most LANES columns (16 output channels, a layer's last block) takes a loop
    of R accumulators, one vector a row: the other half's multiply-adds would be discarded."""
    const = kit.const
    _, _, _, _, _, _, _, _, _, _, _, _, width, _ = args
    v = _Vectors(kit, context, builder, sig, args)
    with builder.if_else(builder.icmp_signed("<=", width, const(LANES))) as (narrow, wide):
        with narrow:
            _emit_tile_halves(kit, v, R, 1, builder, args)
        with wide:
            _emit_tile_halves(kit, v, R, 2, builder, args)
    return context.get_dummy_value()


def _emit_tile_halves(kit, v, R, halves, builder, args):
    """The tile's loop and stores over its first `halves` vectors of columns (1 or 2)."""
    ir, cgutils, const, splat = kit.ir, kit.cgutils, kit.const, kit.splat
    _, _, _, _, channels, _, _, lo, hi, _, at, ldc, width, stream = args
    image_p, base_p, taps_p = v.data(1), v.data(2), v.data(3)
    packed_p, bias_p, out_p = v.data(5), v.data(6), v.data(9)
    zero = ir.Constant(kit.vec, [0.0] * LANES)
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(halves * R)]
    origins = [builder.load(builder.gep(base_p, [const(r)])) for r in range(R)]
    with cgutils.for_range(builder, v.array(3).nitems) as tap:
        offset = builder.load(builder.gep(taps_p, [tap.index]))
        starts = [builder.add(o, offset) for o in origins]
        row0 = builder.mul(tap.index, builder.mul(channels, const(BLOCK)))
        with cgutils.for_range(builder, channels) as ch:
            row = builder.add(row0, builder.mul(ch.index, const(BLOCK)))
            for line in range(0, halves * LANES, 16):  # 16 floats: a cache line
                v.prefetch(packed_p, builder.add(row, const(PREFETCH_AHEAD + line)))
            w = [v.load(packed_p, builder.add(row, const(half * LANES)))
                 for half in range(halves)]
            for r in range(R):
                x = splat(builder, builder.load(
                    builder.gep(image_p, [builder.add(starts[r], ch.index)])))
                for half in range(halves):
                    acc = accs[halves * r + half]
                    builder.store(v.fma(x, w[half], builder.load(acc)), acc)
    lo_v, hi_v = splat(builder, lo), splat(builder, hi)
    results = []
    for half in range(halves):
        b = v.load(bias_p, const(half * LANES))
        for r in range(R):
            y = v.clip(builder.fadd(builder.load(accs[halves * r + half]), b), lo_v, hi_v)
            at_r = builder.add(at, builder.add(builder.mul(const(r), ldc),
                                               const(half * LANES)))
            results.append((half, y, at_r))
    _store_tile(kit, v, builder, results, out_p, width, stream)


def _store_tile(kit, v, builder, results, out_p, width, stream):
    """A tile's rows stored: whole (streamed or not), or a block's last columns (width <
    BLOCK) with masked stores, where a copy through a scratch tile cost a large share of a
    unit."""
    const = kit.const
    whole = builder.icmp_signed(">=", width, const(BLOCK))
    with builder.if_else(whole) as (full, part):
        with full:
            with builder.if_else(builder.icmp_signed("!=", stream, const(0))) as (
                    around, through):
                with around:
                    for _, y, at_r in results:
                        v.stream(y, out_p, at_r)
                with through:
                    for _, y, at_r in results:
                        v.store(y, out_p, at_r)
        with part:
            masks = [v.lanes_below(builder.sub(width, const(half * LANES)))
                     for half in range(1 + max(half for half, _, _ in results))]
            for half, y, at_r in results:
                v.masked_store(y, out_p, at_r, masks[half])


def _register_tiles(numba, kit, intrinsic, overload):
    """`tile` for ROWS and SMALL_ROWS rows, and `store_fence`."""
    types = numba.types

    def tile_intrinsic(R):
        @intrinsic
        def fma_tile(typingctx, rows, image, base, taps, channels, packed, bias, lo, hi,
                     out, at, ldc, width, stream):
            sig = types.void(rows, image, base, taps, types.int64, packed, bias,
                             types.float32, types.float32, out, types.int64, types.int64,
                             types.int64, types.int64)
            return sig, lambda context, builder, s, args: _emit_tile(kit, R, context, builder,
                                                                     s, args)
        return fma_tile

    tiles = {ROWS: tile_intrinsic(ROWS), SMALL_ROWS: tile_intrinsic(SMALL_ROWS)}

    @overload(tile)
    def _tile(rows, image, base, taps, channels, packed, bias, lo, hi, out, at, ldc,
              width, stream):
        R = getattr(rows, "literal_value", None)
        if R not in tiles:
            return None
        fma_tile = tiles[R]
        return (lambda rows, image, base, taps, channels, packed, bias, lo, hi, out, at,
                ldc, width, stream: fma_tile(
                    rows, image, base, taps, np.int64(channels), packed, bias,
                    np.float32(lo), np.float32(hi), out, np.int64(at), np.int64(ldc),
                    np.int64(width), np.int64(stream)))

    @intrinsic
    def sfence(typingctx):
        def codegen(context, builder, signature, args):
            fence = kit.cgutils.get_or_insert_function(
                builder.module, kit.ir.FunctionType(kit.ir.VoidType(), []),
                "llvm.x86.sse.sfence")
            builder.call(fence, [])
            return context.get_dummy_value()
        return types.void(), codegen

    overload(store_fence)(lambda: lambda: sfence())


def _emit_depthwise(kit, Q, T, context, builder, sig, args):
    """`depthwise_pixels`' IR for Q pixels by T taps: the T weight vectors in registers,
    each group of Q pixels a row summed tap by tap, then clipped and stored; a block of
    fewer than LANES channels (`width`) in a copy of the loops with masked loads and stores,
    so that whole blocks keep plain ones."""
    cgutils, const, splat = kit.cgutils, kit.const, kit.splat
    (_, _, _, start, step, _, _, _, lo, hi, _, at, out_step, groups, rows, row_step,
     out_row_step, width) = args
    v = _Vectors(kit, context, builder, sig, args)
    image_p, taps_p, w_p, bias_p, out_p = (v.data(i) for i in (2, 5, 6, 7, 10))
    w = [v.load(w_p, const(t * LANES)) for t in range(T)]
    offsets = [builder.load(builder.gep(taps_p, [const(t)])) for t in range(T)]
    b = v.load(bias_p, const(0))
    lo_v, hi_v = splat(builder, lo), splat(builder, hi)

    def loops(load, store):
        with cgutils.for_range(builder, rows) as r:
            row_in = builder.add(start, builder.mul(r.index, row_step))
            row_out = builder.add(at, builder.mul(r.index, out_row_step))
            with cgutils.for_range(builder, groups) as g:
                first = builder.mul(g.index, const(Q))
                src = builder.add(row_in, builder.mul(first, step))
                dst = builder.add(row_out, builder.mul(first, out_step))
                acc = [b] * Q
                for t in range(T):
                    tap = builder.add(src, offsets[t])
                    for q in range(Q):
                        x = load(image_p, builder.add(tap, builder.mul(const(q), step)))
                        acc[q] = v.fma(x, w[t], acc[q])
                for q in range(Q):
                    store(v.clip(acc[q], lo_v, hi_v), out_p,
                          builder.add(dst, builder.mul(const(q), out_step)))

    whole = builder.icmp_signed(">=", width, const(LANES))
    with builder.if_else(whole) as (plain, masked):
        with plain:
            loops(v.load, v.store)
        with masked:
            mask = v.lanes_below(width)
            loops(lambda p, i: v.masked_load(p, i, mask),
                  lambda value, p, i: v.masked_store(value, p, i, mask))
    return context.get_dummy_value()


def _register_depthwise(numba, kit, intrinsic, overload):
    """`depthwise_pixels` for DEPTHWISE_PIXELS and 1 pixels by each of DEPTHWISE_TAPS."""
    types = numba.types

    def depthwise_intrinsic(Q, T):
        @intrinsic
        def fma_depthwise(typingctx, pixels, taps_count, image, start, step, taps,
                          weights, bias, lo, hi, out, at, out_step, groups, rows,
                          row_step, out_row_step, width):
            sig = types.void(pixels, taps_count, image, types.int64, types.int64, taps,
                             weights, bias, types.float32, types.float32, out,
                             types.int64, types.int64, types.int64, types.int64,
                             types.int64, types.int64, types.int64)
            return sig, (lambda context, builder, s, args:
                         _emit_depthwise(kit, Q, T, context, builder, s, args))
        return fma_depthwise

    depthwise = {(Q, T): depthwise_intrinsic(Q, T)
                 for Q in (DEPTHWISE_PIXELS, 1) for T in DEPTHWISE_TAPS}

    @overload(depthwise_pixels)
    def _depthwise_pixels(pixels, taps_count, image, start, step, taps, weights, bias, lo,
                          hi, out, at, out_step, groups, rows, row_step, out_row_step,
                          width):
        key = (getattr(pixels, "literal_value", None),
               getattr(taps_count, "literal_value", None))
        if key not in depthwise:
            return None
        fma_depthwise = depthwise[key]
        return (lambda pixels, taps_count, image, start, step, taps, weights, bias, lo, hi,
                out, at, out_step, groups, rows, row_step, out_row_step, width: fma_depthwise(
                    pixels, taps_count, image, np.int64(start), np.int64(step), taps,
                    weights, bias, np.float32(lo), np.float32(hi), out, np.int64(at),
                    np.int64(out_step), np.int64(groups), np.int64(rows),
                    np.int64(row_step), np.int64(out_row_step), np.int64(width)))


def _emit_row_columns(kit, R, Q, context, builder, sig, args):
    """`row_columns`' IR for R rows by Q column blocks: R x Q accumulators over K, stored
    whole."""
    ir, cgutils, const, splat = kit.ir, kit.cgutils, kit.const, kit.splat
    j = args[4]
    v = _Vectors(kit, context, builder, sig, args)
    h_p, p_p, g_p = v.data(2), v.data(3), v.data(5)
    K = cgutils.unpack_tuple(builder, v.array(3).shape, 3)[1]  # C-ordered arrays
    h_stride = cgutils.unpack_tuple(builder, v.array(2).shape, 2)[1]
    g_stride = cgutils.unpack_tuple(builder, v.array(5).shape, 2)[1]
    block = builder.mul(K, const(LANES))                        # one block's values
    zero = ir.Constant(kit.vec, [0.0] * LANES)
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(R * Q)]
    first = builder.mul(j, block)
    with cgutils.for_range(builder, K) as k:
        row = builder.add(first, builder.mul(k.index, const(LANES)))
        w = [v.load(p_p, builder.add(row, builder.mul(const(q), block)))
             for q in range(Q)]
        for b in range(R):
            x = splat(builder, builder.load(builder.gep(
                h_p, [builder.add(builder.mul(const(b), h_stride), k.index)])))
            for q in range(Q):
                acc = accs[b * Q + q]
                builder.store(v.fma(x, w[q], builder.load(acc)), acc)
    for b in range(R):
        for q in range(Q):
            v.store(builder.load(accs[b * Q + q]), g_p, builder.add(
                builder.mul(const(b), g_stride),
                builder.mul(builder.add(j, const(q)), const(LANES))))
    return context.get_dummy_value()


def _register_row_columns(numba, kit, intrinsic, overload):
    """`row_columns` for 4 or 1 rows by COLUMN_BLOCKS or 1 blocks."""
    types = numba.types

    def row_columns_intrinsic(R, Q):
        @intrinsic
        def fma_row_columns(typingctx, rows, blocks, h, P, j, G):
            sig = types.void(rows, blocks, h, P, types.int64, G)
            return sig, (lambda context, builder, s, args:
                         _emit_row_columns(kit, R, Q, context, builder, s, args))
        return fma_row_columns

    by_rows = {(R, Q): row_columns_intrinsic(R, Q) for R in (4, 1) for Q in (COLUMN_BLOCKS, 1)}

    @overload(row_columns)
    def _row_columns(rows, blocks, h, P, j, G):
        key = (getattr(rows, "literal_value", None), getattr(blocks, "literal_value", None))
        if key not in by_rows:
            return None
        fma_row_columns = by_rows[key]
        return lambda rows, blocks, h, P, j, G: fma_row_columns(rows, blocks, h, P,
                                                                np.int64(j), G)


@_compiled.Once
def _register(numba) -> None:
    """The vector code as numba intrinsics behind `tile` (ROWS and SMALL_ROWS rows),
    `depthwise_pixels` (DEPTHWISE_PIXELS and 1 pixels by each of DEPTHWISE_TAPS) and
    `row_columns` (4 or 1 rows by COLUMN_BLOCKS or 1 blocks); once per process."""
    from numba.extending import intrinsic, overload
    kit = _Kit()
    _register_tiles(numba, kit, intrinsic, overload)
    _register_depthwise(numba, kit, intrinsic, overload)
    _register_row_columns(numba, kit, intrinsic, overload)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """np.empty(shape), its data aligned to a 64-byte cache line where it is large
    (ALIGN_FROM_BYTES, ops/cpu/tuning.py): a vector load that straddles two lines costs two
    (numpy aligns to 16 bytes). Small arrays stay plain: there the alignment saves less than
    it costs. Very large ones reuse a freed buffer (`_buffer`)."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    if size < tuning.ALIGN_FROM_BYTES:
        return np.empty(shape, dtype)
    buffer = _buffer(size + 64)
    return np.ndarray(shape, dtype, buffer, -_compiled.address(buffer) % 64)


# From 32 MB, glibc maps every allocation afresh (its mmap threshold stops there, where
# ember.ops.cpu.memory sets it) and unmaps it when freed, so each page faults again on its
# first write; with transparent huge pages each fault clears 2 MB, and in a virtual machine
# the kernel's time on them can exceed the kernels' own. So such buffers are kept, up to
# KEEP_BUFFER_BYTES of them (ops/cpu/tuning.py: a bound on the memory kept), and handed out
# again once nothing refers to them (numpy views hold their base: a buffer is free when only
# this list does).
# The list is the process's CPU engine's (`kept`, with `kept_lock`: ember.ops.cpu.engine), as
# glibc's heap is the process's. Not a tuning value: glibc's limit (ops/linalg.py reads it).
KEEP_FROM_BYTES = _memory.MMAP_THRESHOLD


def _keeping() -> bool:
    """Off with EMBER_KEEP_MEMORY=0, as glibc's thresholds (ember.ops.cpu.memory)."""
    return not _memory.opted_out()


def _buffer(nbytes: int) -> np.ndarray:
    """nbytes of uint8: a kept buffer no longer in use, of nbytes to 2 * nbytes, or a new
    one (kept if large)."""
    if nbytes < KEEP_FROM_BYTES or not _keeping():
        return np.empty(nbytes, np.uint8)
    engine = current()
    with engine.kept_lock:
        kept = engine.kept
        free = [i for i in range(len(kept)) if sys.getrefcount(kept[i]) == 2]  # list + arg
        for i in free:
            if nbytes <= kept[i].size <= 2 * nbytes:
                return kept[i]
        buffer = np.empty(nbytes, np.uint8)
        total = sum(b.size for b in kept) + nbytes
        dropped = []
        for i in free:   # the oldest free ones make room, if need be
            if total <= tuning.KEEP_BUFFER_BYTES:
                break
            total -= kept[i].size
            dropped.append(i)
        for i in reversed(dropped):
            del kept[i]
        if total <= tuning.KEEP_BUFFER_BYTES:
            kept.append(buffer)   # (else all in use: this one is not kept)
        return buffer


def pack(w_taps_last: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Weights (T*C, M) and bias (M,) as the tiles read them: (blocks, T*C, BLOCK) and
    (blocks*BLOCK,), zero-padded to whole blocks."""
    K, M = w_taps_last.shape
    blocks = -(-M // BLOCK)
    padded = np.zeros((K, blocks * BLOCK), np.float32)
    padded[:, :M] = w_taps_last
    packed = empty((blocks, K, BLOCK))
    packed[...] = padded.reshape(K, blocks, BLOCK).transpose(1, 0, 2)
    b = np.zeros(blocks * BLOCK, np.float32)
    if bias is not None:
        b[:M] = bias
    return packed, b


def band_tiles(tiles, images, image_size, channels, stride, packed) -> int:
    """The tiles of a band (conv_tiles_loops) for `tiles` tiles over `images` images of
    `image_size` values, `channels` values a tap, `stride` input pixels per output pixel.

    A band's input, about BAND_BYTES (ops/cpu/tuning.py), is read by every block of weights
    in turn, so it is sized to stay in a core's L2 cache beside one block of weights. But
    each band reads all the weights again, from memory where they are large: an input of at
    most ONE_BAND_BYTES is one band, and up to twice that where the weights are at least
    ONE_BAND_WEIGHTS_RATIO times the input."""
    input_bytes = images * image_size * 4
    one_band = tuning.ONE_BAND_BYTES
    if input_bytes <= one_band or (input_bytes <= 2 * one_band and packed.nbytes
                                   >= tuning.ONE_BAND_WEIGHTS_RATIO * input_bytes):
        return tiles
    return max(1, min(tiles, tuning.BAND_BYTES // (ROWS * stride * channels * 4)))


def unit_ns(packed) -> float:
    """A unit's time on one core, roughly (a tile by a block of the packed weights)."""
    return ROWS * BLOCK * packed.shape[1] * 2 / _CORE_GFLOPS


def cut(images, pixels, image_size, channels, stride, packed, out_bytes):
    """(band, bounds in units): how `run` takes a convolution's tiles on the run's threads,
    for `images` images of `pixels` output pixels and `image_size` values, `channels`
    values a tap, `stride` input pixels per output pixel and an output of `out_bytes`. A
    function of the geometry and the run's thread count only: a route decides it once."""
    blocks = packed.shape[0]
    tiles = images * math.ceil(pixels / ROWS)
    band = band_tiles(tiles, images, image_size, channels, stride, packed)
    bounds = _compiled.row_bounds(blocks * tiles, unit_ns(packed))
    pieces = len(bounds) - 1
    if pieces > 1 and packed.nbytes <= out_bytes * tuning.ROWS_SPLIT_WEIGHTS_RATIO:
        band, bounds = rows_split(tiles, blocks, band, pieces)
    return band, bounds


def run(compiled, image, image_size, pixels, taps, channels, packed, bias, clamp, out, images,
        band, bounds) -> None:
    """The whole convolution into out (images * L, M), cut as `cut` says."""
    lo, hi = clamp if clamp is not None else (-np.inf, np.inf)
    _compiled.run_rows(compiled, bounds, image, image_size, pixels, taps, channels, packed,
                       bias, np.float32(lo), np.float32(hi), out, images, band,
                       int(streams(out)), piece=_conv_tiles_piece)


def streams(out: np.ndarray) -> bool:
    """Whether the tiles stream their rows of out (rows, M) around the caches (non-temporal
    stores): from STREAM_FROM_BYTES (ops/cpu/tuning.py), as such an output does not stay in
    them for the next op anyway and a store through them first reads the line it writes from
    memory; and every vector a tile row stores aligned to a whole vector (a non-temporal
    vector store needs it)."""
    return (out.nbytes >= tuning.STREAM_FROM_BYTES and out.shape[1] % LANES == 0
            and _compiled.address(out) % 64 == 0)


def rows_split(tiles, blocks, band, pieces):
    """(band, bounds in units) for `pieces` pieces of whole bands of at most `band` tiles:
    `cut`'s split where the packed weights are at most ROWS_SPLIT_WEIGHTS_RATIO
    (ops/cpu/tuning.py) times the output's size. Each piece is every block of output
    channels for its pixels, so that each thread keeps to its own rows, as the products'
    pieces do (ops/cpu/blas.py); cut in blocks, each thread wrote part of every row."""
    band = min(band, -(-tiles // pieces))
    bands = -(-tiles // band)
    cuts = sorted({min(tiles, bands * i // pieces * band) for i in range(pieces + 1)})
    return band, [t * blocks for t in cuts]


def _conv_tiles_piece(block, u0, u1):  # pragma: no cover
    """conv_tiles_loops' piece function (ops/cpu/compiled.py: the helpers run its pieces
    without Python), its arguments from the block `split_rows` made."""
    v = _compiled.array_at(block, (22,), np.int64)
    f = _compiled.array_at(block, (22,), np.float64)
    conv_tiles_loops(_compiled.array_at(v[0], (v[1],), np.float32), v[2],
                     _compiled.array_at(v[3], (v[4],), np.int64),
                     _compiled.array_at(v[5], (v[6],), np.int64), v[7],
                     _compiled.array_at(v[8], (v[9], v[10], v[11]), np.float32),
                     _compiled.array_at(v[12], (v[13],), np.float32),
                     np.float32(f[14]), np.float32(f[15]),
                     _compiled.array_at(v[16], (v[17], v[18]), np.float32), v[19], v[20], v[21],
                     u0, u1)

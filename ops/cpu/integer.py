"""Integer products on the CPU engine: the exact int32 sums of 8-bit products that
MatMulInteger, QLinearMatMul, QGemm, MatMulIntegerToFloat, DynamicQuantizeMatMul, QAttention,
ConvInteger and QLinearConv compute, on AVX-512 VNNI's byte dot products where the CPU has
them (`vpdpbusd`: 64 multiply-adds of unsigned by signed bytes an instruction, four times a
float32 FMA's), and in plain compiled loops elsewhere.

This module holds what the integer kernels share (the signedness shifts, the weights' rows,
the epilogue modes) and two of them: a GEMM on packed patches, for grouped convolutions, and
a planar depthwise loop. Products and one-group convolutions run on the channels-last pixel
tiles of ops/cpu/integer_tiles.py.

The product is C[i, j] = sum_k (W[i, k] - zw[i]) (X[j, k] - zx), for a constant operand W
(the weights: a matmul's B transposed, a convolution's filters), int8, one row per output
channel, and a per-call operand X (the activations: a matmul's rows of A, a convolution's
patches), uint8. It is computed as the raw sum S = sum W X plus the zero points' terms,

    C = S - zx * sum_k W[i] - zw[i] * sum_k X[j] + K zw[i] zx,

with the weights' row sums taken once and the activations' as they are packed. The other
signednesses are shifted into these by 128, which moves the zero point with the values
(uint8 weights: W - 128, zw - 128; int8 activations: X + 128, zx + 128): the differences
W - zw and X - zx, and so C, are unchanged. Every sum is an exact integer (int32 holds
K * 255 * 128 for K below 65,000), so C is the same whatever the order, the kernel or the
thread count: bit for bit the integer product the ops define.

Layouts (`Weights`, `pack_patches`):
* the weights (rows, Kp) int8, Kp = K rounded up to 4, zero-padded;
* the activations packed in blocks of COLS = 32 columns: (blocks, Kp / 4, 32, 4) uint8, the
  4 bytes of consecutive k of a column side by side, as vpdpbusd reads them, zero-padded.

A tile is ROWS weight rows by 32 columns: for each 4 k, two 64-byte loads of the packed
activations, a 4-byte broadcast of each row's weights, and 2 * ROWS vpdpbusd into 2 * ROWS
accumulators (24 of AVX-512's 32 registers). The tile's sums go to a small scratch, and the
same loop then finishes them: the zero points' terms and the op's epilogue (`mode`):
int32 out; requantised to 8 bits (rint(float32(C + bias[i]) * mult[i]) + zy, saturated: as
onnxruntime's QLinearConv and QGemm); or float32 (float32(C) * mult[i] + fbias[i]).
"""
from __future__ import annotations

import importlib.util

import numpy as np

from ember.ops.cpu import compiled as _compiled, tuning

ROWS = 8   # weight rows a tile (16 accumulators: with 12, LLVM's unrolled loop spilled them)
COLS = 32   # activation columns a tile: two vectors of 16 int32 lanes

INT32, REQUANTIZE, FLOAT32 = 0, 1, 2   # the epilogue modes


def _host_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI and numba is installed (llvmlite reads the CPU:
    slow, so once at import)."""
    if importlib.util.find_spec("numba") is None:
        return False
    import llvmlite.binding as llvm
    features = llvm.get_host_cpu_features()
    return bool(features.get("avx512vnni", False) and features.get("avx512bw", False))


VNNI = _host_vnni()


def dot_tile(rows, weights, w_at, w_stride, packed, p_at, quads, scratch):
    """The tile's semantics: scratch[r * 32 + j] = sum over k < 4 * quads of
    weights[w_at + r * w_stride + k] (int8) * the packed activation of column j and k
    (uint8, block starting at packed[p_at]), for r < rows. Compiled: the VNNI intrinsic, or
    plain loops (both registered in `_register`)."""
    for r in range(rows):
        w = weights[w_at + r * w_stride:w_at + r * w_stride + 4 * quads].astype(np.int32)
        block = packed[p_at:p_at + quads * 4 * COLS].reshape(quads, COLS, 4)
        x = block.transpose(1, 0, 2).reshape(COLS, 4 * quads).astype(np.int32)
        scratch[r * COLS:(r + 1) * COLS] = x @ w


def int_gemm_loops(weights, w_stride, w_sum, w_zero, rows, packed, x_sum, x_zero, K, mode,
                   bias, mult, fbias, y_zero, lo, hi, out, rows_outer, u0, u1):
    """Units [u0, u1) of C = (W - w_zero)(X - x_zero)^T: a unit is a tile of ROWS weight rows
    by one block of COLS packed columns, numbered tile-major (`rows_outer`: each tile's
    weights stay in cache across the blocks) or block-major. Each unit's C[i, j] goes to
    out[i, j] through the epilogue `mode` (module docstring)."""
    blocks = packed.shape[0]
    quads = packed.shape[1]
    flat = packed.reshape(-1)
    columns = out.shape[1]
    tiles = (rows + ROWS - 1) // ROWS
    scratch = np.empty(ROWS * COLS, np.int32)
    for u in range(u0, u1):
        if rows_outer:
            t, b = u // blocks, u % blocks
        else:
            t, b = u % tiles, u // tiles
        r0 = t * ROWS
        nr = min(ROWS, rows - r0)
        p_at = b * quads * 4 * COLS
        if nr == ROWS:
            dot_tile(ROWS, weights, r0 * w_stride, w_stride, flat, p_at, quads, scratch)
        else:
            for r in range(nr):
                dot_tile(1, weights, (r0 + r) * w_stride, w_stride, flat, p_at, quads,
                         scratch[r * COLS:])
        c0 = b * COLS
        nc = min(COLS, columns - c0)
        for r in range(nr):
            i = r0 + r
            zw = w_zero[i]
            fixed = np.int64(K) * zw * x_zero - x_zero * np.int64(w_sum[i])
            s0 = r * COLS
            # one loop per case, the branches outside it, over slices from 0, so that LLVM
            # vectorises each
            sc, xs = scratch[s0:s0 + nc], x_sum[c0:c0 + nc]
            o = out[i, c0:c0 + nc]
            if mode == INT32:
                for j in range(nc):
                    o[j] = sc[j] + fixed - zw * xs[j]
            elif mode == REQUANTIZE:
                m, f = mult[i], fixed + bias[i]
                for j in range(nc):
                    y = np.rint(np.float32(sc[j] + f - zw * xs[j]) * m)
                    o[j] = min(max(y + y_zero, lo), hi)
            else:
                m, fb = mult[i], fbias[i]
                for j in range(nc):
                    o[j] = np.float32(sc[j] + fixed - zw * xs[j]) * m + fb


def pad_image_loops(x, flip, pad, top, left, image, sums, r0, r1):
    """Rows [r0, r1) of one image x (C, H, W) uint8 made channels-last and padded: image
    (Hp, Wp, Cp) uint8 holds x XOR flip inside, `pad` (the zero point, flipped) around it,
    and whatever in the Cp - C channels added to make whole 4-byte words (their weights are
    0); sums (Hp, Wp) each pixel's sum over its C channels."""
    C, H, W = x.shape
    Wp, Cp = image.shape[1], image.shape[2]
    for r in range(r0, r1):
        y = r - top
        if y < 0 or y >= H:
            for col in range(Wp):
                for c in range(Cp):
                    image[r, col, c] = pad
                sums[r, col] = C * np.int64(pad)
            continue
        for col in range(Wp):
            if col < left or col >= left + W:
                for c in range(Cp):
                    image[r, col, c] = pad
            else:
                for c in range(C, Cp):
                    image[r, col, c] = 0
        for c in range(C):
            for col in range(W):
                image[r, left + col, c] = x[c, y, col] ^ flip
        for col in range(Wp):
            if col < left or col >= left + W:
                sums[r, col] = C * np.int64(pad)
            else:
                t = np.int64(0)
                for c in range(C):
                    t += image[r, col, c]
                sums[r, col] = t


def pack_image_loops(image, image_sums, kh, kw, sh, sw, dh, dw, OW, P, packed, sums, b0, b1):
    """Blocks [b0, b1) of a convolution's patches from the padded channels-last image (as
    4-byte words: (Hp, Wp, Cq) uint32) into packed (blocks, kh * kw * Cq, COLS) uint32:
    column p = oy * OW + ox, word k = (i * kw + j) * Cq + c of the window; columns past P
    zero. sums[p]: the window's sum of image_sums."""
    Cq = image.shape[2]
    for b in range(b0, b1):
        for lane in range(COLS):
            p = b * COLS + lane
            if p >= P:
                for k in range(packed.shape[1]):
                    packed[b, k, lane] = 0
                continue
            oy, ox = p // OW, p % OW
            t = np.int64(0)
            for i in range(kh):
                y = oy * sh + i * dh
                for j in range(kw):
                    x = ox * sw + j * dw
                    k0 = (i * kw + j) * Cq
                    for c in range(Cq):
                        packed[b, k0 + c, lane] = image[y, x, c]
                    t += image_sums[y, x]
            sums[p] = t


def depthwise_planes_loops(x, x_zero, w, C, mode, bias, mult, y_zero, lo, hi, sh, sw, dh, dw,
                           ph, pw, out, p0, p1):
    """Planes [p0, p1) of a depthwise convolution (one input and one output channel a
    group), plane by plane, vectorised along the output's rows (`depthwise`'s choice for
    wide rows): x (N * C, H, W) 8-bit, w (C, kh, kw) int64 with its zero point taken, out
    (N * C, OH, OW). Each value is the exact int sum of (x - x_zero) * w over the window
    (padding counts x_zero: nothing), through the epilogue `mode` (module docstring). The
    padded plane is held as `sw` phases (phase q: its columns q, q + sw, ...), so that a tap
    reads one contiguous run of a phase whatever the stride."""
    H, W = x.shape[1], x.shape[2]
    kh, kw = w.shape[1], w.shape[2]
    OH, OW = out.shape[1], out.shape[2]
    Hp, Wp = (OH - 1) * sh + (kh - 1) * dh + 1, (OW - 1) * sw + (kw - 1) * dw + 1
    phases = np.zeros((sw, Hp, (Wp + sw - 1) // sw), np.int32)   # x - x_zero, zero padding
    acc = np.empty(OW, np.int32)             # exact: a window's sum is far below 2**31
    rows = min(H, Hp - ph)
    cols = min(W, Wp - pw)
    for p in range(p0, p1):
        c = p % C
        for r in range(rows):   # the border stays zero: only the image's place is written
            src = x[p, r]
            if sw == 1:
                dst = phases[0, r + ph, pw:pw + cols]
                for col in range(cols):
                    dst[col] = np.int32(src[col]) - x_zero
                continue
            for q in range(sw):   # phase q holds padded columns q + k * sw
                dst = phases[q, r + ph]
                k = max(0, (pw - q + sw - 1) // sw)
                col = k * sw + q - pw
                while col < cols:
                    dst[k] = np.int32(src[col]) - x_zero
                    k += 1
                    col += sw
        for oy in range(OH):
            acc[:] = 0
            for i in range(kh):
                row = oy * sh + i * dh
                for j in range(kw):
                    wv = np.int32(w[c, i, j])
                    at = j * dw
                    seg = phases[at % sw, row, at // sw:at // sw + OW]   # from 0: vectorised
                    for ox in range(OW):
                        acc[ox] += wv * seg[ox]
            o = out[p, oy]
            if mode == INT32:
                for ox in range(OW):
                    o[ox] = acc[ox]
            elif mode == REQUANTIZE:
                m, b = mult[c], bias[c]
                for ox in range(OW):
                    v = np.rint(np.float32(acc[ox] + b) * m)
                    o[ox] = min(max(v + y_zero, lo), hi)
            else:
                m, fb = mult[c], bias[c]
                for ox in range(OW):
                    o[ox] = np.float32(acc[ox]) * m + fb


def depthwise(x: np.ndarray, x_zero: int, w: np.ndarray, w_zero, strides, dilations, begin,
              out: np.ndarray, mode: int = INT32, bias=None, mult=None,
              y_zero: float = 0.0, lo: float = 0.0, hi: float = 0.0) -> None:
    """A depthwise 2-D convolution of planar x (N, C, H, W) by w (C, 1, kh, kw) into planar
    out (N, C, OH, OW), 8-bit with zero points (w_zero one or per channel), through the
    epilogue: plane by plane, vectorised along the output's rows, the planes shared among the
    run's threads (ops/conv.py takes rows of at least INT_DEPTHWISE_PLANE_WIDTH here; a
    channels-last image, or narrower rows, to integer_tiles.depthwise)."""
    N, C = x.shape[:2]
    kh, kw = w.shape[2:]
    taps = (w.reshape(C, kh, kw).astype(np.int64)
            - np.asarray(w_zero, np.int64).reshape(-1, 1, 1))
    bias = np.zeros(C, np.int64) if bias is None else bias
    mult = np.ones(C, np.float32) if mult is None else mult
    OH, OW = out.shape[2:]
    _compiled.split_rows(
        _kernels()[3], N * C, x.reshape(N * C, *x.shape[2:]), np.int32(x_zero), taps, C, mode,
        bias, mult, np.float32(y_zero), np.float32(lo), np.float32(hi), *strides, *dilations,
        *begin, out.reshape(N * C, OH, OW), ns_per_row=OH * OW * kh * kw * tuning.INT_DEPTHWISE_NS)


def enabled() -> bool:
    """Whether the compiled integer products serve (numba, not turned off)."""
    return _compiled.enabled() and _kernels() is not None


@_compiled.Once
def _kernels():
    """(gemm, pad_image, pack_image, depthwise_planes) compiled, or None without numba."""
    numba = _compiled._numba() if _compiled.enabled() else None
    if numba is None:
        return None
    _register(numba)
    return (_compiled.jit(int_gemm_loops), _compiled.jit(pad_image_loops),
            _compiled.jit(pack_image_loops), _compiled.jit(depthwise_planes_loops))


class Weights:
    """A constant weight operand packed once: `w` (rows, Kp) int8, its rows' sums and zero
    points (int64), K. From int8 or uint8 weights (rows, width) and a zero point per row or
    for all (uint8 shifted by 128: module docstring); K, the terms that count, is the width
    unless padding inside the rows (conv_weights) makes it less."""

    def __init__(self, w: np.ndarray, zero: np.ndarray | int, K: int | None = None):
        rows, width = w.shape
        K = width if K is None else K
        zero = np.broadcast_to(np.asarray(zero, np.int64).reshape(-1), (rows,))
        values = w.astype(np.int16)
        if w.dtype == np.uint8:
            values -= 128
            zero = zero - 128
        self.K, self.rows = K, rows
        self.w = np.zeros((rows, -(-width // 4) * 4), np.int8)
        self.w[:, :width] = values
        self.sums = values.sum(axis=1, dtype=np.int64)
        self.zero = np.ascontiguousarray(zero, np.int64)


def conv_weights(w: np.ndarray, zero) -> Weights:
    """A 2-D convolution's filters (M, C, kh, kw) as weight rows in pack_patches' order of k
    (tap-major, channels padded to whole 4-byte words with zero weights)."""
    M, C, kh, kw = w.shape
    Cp = -(-C // 4) * 4
    rows = np.zeros((M, kh, kw, Cp), w.dtype)
    rows[..., :C] = w.transpose(0, 2, 3, 1)
    if w.dtype == np.uint8:  # its padding channels must weigh 0 once shifted by 128
        rows[..., C:] = 128
    return Weights(rows.reshape(M, -1), zero, K=C * kh * kw)


def padded_image(x: np.ndarray, zero: int, kernel, strides, dilations, begin, end, outs):
    """One image x (C, H, W) made channels-last and padded for a 2-D convolution of that
    geometry: (Hp, Wp, Cp) uint8 (int8 flipped to uint8), the padding the zero point and the
    channels rounded up to whole 4-byte words; and each pixel's channel sum (Hp, Wp)."""
    pad_image = _kernels()[1]
    C, H, W = x.shape
    (kh, kw), (OH, OW) = kernel, outs
    (sh, sw), (dh, dw) = strides, dilations
    Hp = max(H + begin[0] + end[0], (OH - 1) * sh + (kh - 1) * dh + 1)
    Wp = max(W + begin[1] + end[1], (OW - 1) * sw + (kw - 1) * dw + 1)
    Cp = -(-C // 4) * 4
    flip = 0x80 if x.dtype == np.int8 else 0
    pad = np.uint8((int(zero) + flip) & 0xFF)
    image = np.empty((Hp, Wp, Cp), np.uint8)
    sums = np.empty((Hp, Wp), np.int64)
    _compiled.split_rows(pad_image, Hp, x.view(np.uint8), np.uint8(flip), pad, begin[0],
                         begin[1], image, sums, ns_per_row=Wp * Cp * tuning.INT_PACK_NS)
    return image, sums


def pack_patches(x: np.ndarray, zero: int, kernel, strides, dilations, begin, end, outs):
    """One image's (C, H, W) patches for a 2-D convolution (one group), packed for weights
    from conv_weights: (packed, sums, shift), shift 128 for int8 (added to the zero point).
    The image is padded once,
    channels-last (`padded_image`), so that each window's C channels are whole words read
    in a row."""
    pack_image = _kernels()[2]
    (kh, kw), (OH, OW) = kernel, outs
    (sh, sw), (dh, dw) = strides, dilations
    image, image_sums = padded_image(x, zero, kernel, strides, dilations, begin, end, outs)
    Hp, Wp, Cp = image.shape
    P, K = OH * OW, kh * kw * Cp
    blocks = -(-P // COLS)
    packed = np.empty((blocks, K // 4, COLS, 4), np.uint8)
    sums = np.empty(P, np.int64)
    _compiled.split_rows(pack_image, blocks, image.view(np.uint32).reshape(Hp, Wp, Cp // 4),
                         image_sums, kh, kw, sh, sw, dh, dw, OW, P,
                         packed.view(np.uint32).reshape(blocks, K // 4, COLS), sums,
                         ns_per_row=COLS * K * tuning.INT_PACK_NS)
    return packed, sums, 0x80 if x.dtype == np.int8 else 0


def product(weights: Weights, packed, sums, x_zero: int, out: np.ndarray, mode: int = INT32,
            bias=None, mult=None, fbias=None, y_zero: float = 0.0, lo: float = 0.0,
            hi: float = 0.0) -> None:
    """out[i, j] (C-contiguous rows) = the epilogue of C[i, j] (module docstring) for the
    packed patches (`pack_patches`; x_zero already shifted), on the run's threads. bias
    int64 (rows,), mult and fbias float32."""
    gemm = _kernels()[0]
    rows = weights.rows
    if bias is None:
        bias = np.zeros(rows, np.int64)
    if mult is None:
        mult = np.ones(rows, np.float32)
    if fbias is None:
        fbias = np.zeros(rows, np.float32)
    blocks, tiles = packed.shape[0], -(-rows // ROWS)
    rows_outer = weights.w.nbytes >= packed.nbytes
    unit_ns = ROWS * COLS * weights.w.shape[1] * tuning.INT_MAC_NS
    _compiled.split_rows(
        gemm, blocks * tiles, weights.w.reshape(-1), weights.w.shape[1], weights.sums,
        weights.zero, rows, packed, sums, np.int64(x_zero), weights.K, mode, bias, mult,
        fbias, np.float32(y_zero), np.float32(lo), np.float32(hi), out,
        rows_outer, ns_per_row=unit_ns)


def worth(M: int, N: int, K: int) -> bool:
    """Whether the compiled product pays for packing over the float64 BLAS product: from
    INT_MIN_MACS multiply-adds (tuning.py)."""
    return M * N * K >= tuning.INT_MIN_MACS


# ------------------------------------------------------------------ the compiled tile

def _emit_vnni_tile(R, context, builder, sig, args):
    """dot_tile's IR for R rows: 2R accumulators of 16 int32, vpdpbusd per 4 k."""
    from llvmlite import ir
    from numba.core import cgutils
    i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vec = ir.VectorType(i32, 16)
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec, vec]),
                                         "llvm.x86.avx512.vpdpbusd.512")

    def data(i):
        return context.make_array(sig.args[i])(context, builder, args[i]).data

    def byte_at(ptr, offset, kind):
        return builder.bitcast(builder.gep(builder.bitcast(ptr, i8.as_pointer()), [offset]),
                               kind.as_pointer())

    _, _, w_at, w_stride, _, p_at, quads, _ = args
    w_p, p_p, s_p = data(1), data(4), data(7)
    zero = ir.Constant(vec, [0] * 16)
    undef = ir.Constant(vec, ir.Undefined)
    splat_mask = ir.Constant(vec, [0] * 16)
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(2 * R)]
    rows_at = [builder.add(w_at, builder.mul(ir.Constant(i64, r), w_stride)) for r in range(R)]
    with cgutils.for_range(builder, quads) as q:
        k4 = builder.mul(q.index, ir.Constant(i64, 4))
        block = builder.add(p_at, builder.mul(q.index, ir.Constant(i64, 4 * COLS)))
        xs = [builder.load(byte_at(p_p, builder.add(block, ir.Constant(i64, 64 * h)), vec),
                           align=1) for h in range(2)]
        for r in range(R):
            word = builder.load(byte_at(w_p, builder.add(rows_at[r], k4), i32), align=1)
            w = builder.shuffle_vector(builder.insert_element(undef, word,
                                                              ir.Constant(i32, 0)),
                                       undef, splat_mask)
            for h in range(2):
                acc = accs[2 * r + h]
                builder.store(builder.call(dot, [builder.load(acc), xs[h], w]), acc)
    for r in range(R):
        for h in range(2):
            at = ir.Constant(i64, (r * COLS + 16 * h) * 4)
            builder.store(builder.load(accs[2 * r + h]), byte_at(s_p, at, vec), align=4)
    return context.get_dummy_value()


def _plain_tile(rows, weights, w_at, w_stride, packed, p_at, quads, scratch):
    """dot_tile in plain compiled loops, where the CPU has no VNNI."""
    for r in range(rows):
        at = w_at + r * w_stride
        for j in range(COLS):
            s = np.int32(0)
            for q in range(quads):
                x = p_at + (q * COLS + j) * 4
                for e in range(4):
                    s += np.int32(weights[at + 4 * q + e]) * np.int32(packed[x + e])
            scratch[r * COLS + j] = s


@_compiled.Once
def _register(numba) -> None:
    """dot_tile's compiled form: the VNNI intrinsic for ROWS and 1 rows, or plain loops."""
    from numba.extending import intrinsic, overload, register_jitable
    types = numba.types
    if not VNNI:
        plain = register_jitable(_plain_tile)

        @overload(dot_tile)
        def _plain(rows, weights, w_at, w_stride, packed, p_at, quads, scratch):
            return plain
        return

    def tile_intrinsic(R):
        @intrinsic
        def vnni_tile(typingctx, rows, weights, w_at, w_stride, packed, p_at, quads, scratch):
            sig = types.void(rows, weights, types.int64, types.int64, packed, types.int64,
                             types.int64, scratch)
            return sig, lambda context, builder, s, a: _emit_vnni_tile(R, context, builder, s,
                                                                       a)
        return vnni_tile

    tiles = {ROWS: tile_intrinsic(ROWS), 1: tile_intrinsic(1)}

    @overload(dot_tile)
    def _dot_tile(rows, weights, w_at, w_stride, packed, p_at, quads, scratch):
        R = getattr(rows, "literal_value", None)
        if R not in tiles:
            return None
        vnni_tile = tiles[R]
        return (lambda rows, weights, w_at, w_stride, packed, p_at, quads, scratch: vnni_tile(
            rows, weights, np.int64(w_at), np.int64(w_stride), packed, np.int64(p_at),
            np.int64(quads), scratch))

"""8-bit convolutions on channels-last images: QLinearConv's and ConvInteger's pixel tiles and
depthwise vectors, and the 8-bit products (MatMulInteger, QGemm...: ops/_integer.py), whose
rows are the pixels of a 1x1 convolution.

The integer GEMM (ops/cpu/integer.py) takes its activations packed: a convolution's patches
gathered into blocks of 32 columns, from a channels-last copy of a planar image, and its
result planar. Between the convolutions of a quantised CNN those copies cost more than the
products (MobileNetV2 int8: most of the run). Here the activations are read where they lie,
in a channels-last image, as the float register tiles read theirs (ops/cpu/tiles.py), and the
result is written channels-last, so that the next 8-bit convolution, QLinearAdd or pooling
reads it with no copy.

A tile is PIXELS output pixels by BLOCK = 32 output channels, in 2 * PIXELS vectors of 16
int32 sums. For each tap of the window and each 4 input channels, it loads the 32 channels'
4 weights (two 64-byte vectors of the packed weights), broadcasts each pixel's 4 input bytes
and adds with AVX-512 VNNI's `vpdpbusd` (unsigned input bytes by signed weights, 4 products
a lane). The input is a padded channels-last uint8 image (`Plan.image`: int8 flipped to
uint8 by 0x80, the padding the zero point, the channels rounded up to whole 4-byte words), or
the input itself where it already is one; each pixel's window is an offset (`pixels`) plus an
offset per tap (`taps`: a window row of kw pixels where the rows are undilated). Weights (M,
C, kh, kw) are packed once: (M / 32 blocks, kh * kw * Cp / 4, 32, 4) int8, zero rows and
channels where M and C are not multiples. A depthwise convolution (`depthwise_tile`) sums 8
pixels by 16 channels in float32, exactly (DEPTHWISE_EXACT_TAPS).

The sums are the exact integers C[i, p] = sum (W - zw[i]) (X - zx) as integer.py explains
(its signedness shifts, the zero points' terms, the epilogues: int32, requantised to 8 bits
as onnxruntime's, or float32), so the result is the same bit for bit whatever the tile, the
order of the units or the threads.
"""
from __future__ import annotations

import numpy as np

from ember.ops._layout import channels_last
from ember.ops.cpu import compiled as _compiled, integer as _integer, tiles as _tiles, tuning

PIXELS = 8   # output pixels a tile: 16 accumulators, 2 weight vectors and a broadcast in 32
# (an image's last pixels, fewer, take tiles of one pixel each)
BLOCK = 32   # output channels a tile: two vectors of 16 int32 lanes


def pixel_tile(R, mode, image, base, taps, T, quads, weights, w_at, rows, width, fixed,
               w_zero, sums, mult, fbias, c0, y_zero, lo, hi, out, out_at, ldo):
    """The tile's semantics, for R pixels by the BLOCK channels from c0: the exact sums
    S[r, j] = sum over taps t < T and k < 4 * quads of image[base[r] + taps[t] + k] (uint8)
    * the packed weight of channel j and k of tap t (int8, the block at weights[w_at]), then
    C = S + fixed[c0 + j] - w_zero[c0 + j] * sums[r] (int32, wrapping: exact wherever C
    fits) through the epilogue `mode` (integer.py; mult, fbias float32), the first `rows`
    pixels' first `width` channels stored at out[out_at + r * ldo + j]. Compiled: the VNNI
    intrinsic, or plain loops (`_register`)."""
    _plain_tile(R, mode, image, base, taps, T, quads, weights, w_at, rows, width, fixed, w_zero,
                sums, mult, fbias, c0, y_zero, lo, hi, out, out_at, ldo)


@_compiled.kernel_math
def conv_loops(image, image_size, C, Cp, pixels, taps, quads, weights, w_sum, w_zero, K, x_zero,
               need_sums, mode, bias, mult, fbias, y_zero, lo, hi, out, images, tiles_outer,
               u0, u1):
    """Units [u0, u1) of a convolution's channels-last output out (images * L, M): a unit is a
    tile of PIXELS output pixels of one image by one block of BLOCK channels, numbered
    tile-major (`tiles_outer`: a tile's input read once for every block) or block-major (a
    block's weights read once for every tile). `image` holds the images, `image_size` bytes
    apart; `pixels` (L,) each output pixel's window origin in an image and `taps` (T,) each
    tap's offset from it (bytes), a tap 4 * quads bytes of whole pixels of Cp bytes, C of
    them real channels. Each C[i, p] goes through
    the epilogue `mode` (integer.py) with the zero points' terms: x_zero (shifted), w_zero and
    w_sum (the weights' sums) per channel, K the terms of a sum, bias int64 added to C (modes
    INT32, REQUANTIZE) and fbias float32 (FLOAT32); the window's input sum is counted only
    where some w_zero is not 0 (`need_sums`)."""
    L = pixels.shape[0]
    M = out.shape[1]
    T = taps.shape[0]
    blocks = weights.shape[0]
    block_size = weights.shape[1] * weights.shape[2] * weights.shape[3]
    per_image = (L + PIXELS - 1) // PIXELS
    tiles = images * per_image
    flat_w = weights.reshape(-1)
    flat_out = out.reshape(-1)
    # the channels' terms, padded to whole blocks, as the tile's vectors read them
    Mp = blocks * BLOCK
    fixed = np.zeros(Mp, np.int32)
    zw = np.zeros(Mp, np.int32)
    ms = np.zeros(Mp, np.float32)
    fb = np.zeros(Mp, np.float32)
    for i in range(M):
        # wraps: exact modulo 2**32, as the int32 sums it meets
        fixed[i] = np.int32((K * w_zero[i] - w_sum[i]) * x_zero + bias[i])
        zw[i] = w_zero[i]
        ms[i] = mult[i]
        fb[i] = fbias[i]
    base = np.empty(PIXELS, np.int64)
    sums = np.zeros(PIXELS, np.int32)
    for u in range(u0, u1):
        if tiles_outer:
            t, b = u // blocks, u % blocks
        else:
            t, b = u % tiles, u // tiles
        n, p = t // per_image, (t % per_image) * PIXELS
        rows = min(PIXELS, L - p)
        for r in range(rows):
            base[r] = n * image_size + pixels[p + r]
        if need_sums:
            for r in range(rows):
                s = 0
                for k in range(T):
                    at = base[r] + taps[k]
                    for e in range(4 * quads):
                        if e % Cp < C:
                            s += image[at + e]
                sums[r] = s
        c0 = b * BLOCK
        width = min(BLOCK, M - c0)
        at = (n * L + p) * M + c0
        w_at = b * block_size
        if rows == PIXELS:
            if mode == _integer.INT32:
                pixel_tile(PIXELS, 0, image, base, taps, T, quads, flat_w, w_at, rows, width,
                           fixed, zw, sums, ms, fb, c0, y_zero, lo, hi, flat_out, at, M)
            elif mode == _integer.REQUANTIZE:
                pixel_tile(PIXELS, 1, image, base, taps, T, quads, flat_w, w_at, rows, width,
                           fixed, zw, sums, ms, fb, c0, y_zero, lo, hi, flat_out, at, M)
            else:
                pixel_tile(PIXELS, 2, image, base, taps, T, quads, flat_w, w_at, rows, width,
                           fixed, zw, sums, ms, fb, c0, y_zero, lo, hi, flat_out, at, M)
            continue
        # an image's last pixels (a product's few rows): a tile of one pixel each, as a tile
        # of PIXELS would compute its repeated pixels for nothing
        for r in range(rows):
            b1, s1, at1 = base[r:r + 1], sums[r:r + 1], at + r * M
            if mode == _integer.INT32:
                pixel_tile(1, 0, image, b1, taps, T, quads, flat_w, w_at, 1, width, fixed, zw,
                           s1, ms, fb, c0, y_zero, lo, hi, flat_out, at1, M)
            elif mode == _integer.REQUANTIZE:
                pixel_tile(1, 1, image, b1, taps, T, quads, flat_w, w_at, 1, width, fixed, zw,
                           s1, ms, fb, c0, y_zero, lo, hi, flat_out, at1, M)
            else:
                pixel_tile(1, 2, image, b1, taps, T, quads, flat_w, w_at, 1, width, fixed, zw,
                           s1, ms, fb, c0, y_zero, lo, hi, flat_out, at1, M)


@_compiled.kernel_math
def pad_images_loops(x, planar, flip, pad, top, left, whole, image, r0, r1):
    """Rows [r0, r1) of the padded images (N * Hp rows): image (N, Hp, Wp, Cp) uint8 holds
    the images x XOR `flip` in their place, `pad` around them, and 0 in the Cp - C channels
    added to make whole words (their weights are 0); not `whole`, only the images' own
    values are written (a kept image: the rest as an earlier call left it). x is
    C-contiguous, (N, C, H, W) if `planar` else (N, H, W, C): each read in its memory
    order."""
    N = x.shape[0]
    if planar:
        C, H, W = x.shape[1], x.shape[2], x.shape[3]
    else:
        H, W, C = x.shape[1], x.shape[2], x.shape[3]
    Hp, Wp, Cp = image.shape[1], image.shape[2], image.shape[3]
    # (explicit loops: numba's assignments to 2-D slices cost more than the rows' copies)
    for row in range(r0, r1):
        n, r = row // Hp, row % Hp
        y = r - top
        dst = image[n, r]
        flat = dst.reshape(-1)
        if y < 0 or y >= H:
            if whole:
                for i in range(Wp * Cp):
                    flat[i] = pad
            continue
        if whole:
            for i in range(left * Cp):
                flat[i] = pad
            for i in range((left + W) * Cp, Wp * Cp):
                flat[i] = pad
        if whole and C < Cp and not (planar and Cp == 4):   # (the words below write those)
            for col in range(left, left + W):
                for c in range(C, Cp):
                    dst[col, c] = 0
        if planar and Cp == 4:   # an image's colour planes: a pixel's bytes as one word
            words = flat.view(np.uint32)[left:left + W]
            flips = np.uint32(0)
            for c in range(C):
                flips |= np.uint32(flip) << np.uint32(8 * c)
            for col in range(W):
                words[col] = flips
            for c in range(C):   # plane by plane: the loops over a row vectorise
                src, shift = x[n, c, y], np.uint32(8 * c)
                for col in range(W):
                    words[col] ^= np.uint32(src[col]) << shift
        elif planar:
            for c in range(C):
                src = x[n, c, y]
                for col in range(W):
                    dst[left + col, c] = src[col] ^ flip
        elif C == Cp:   # whole rows of pixels: one run of W * C bytes
            src, out = x[n, y].reshape(-1), dst[left:left + W].reshape(-1)
            for i in range(W * C):
                out[i] = src[i] ^ flip
        else:
            src = x[n, y]
            for col in range(W):
                for c in range(C):
                    dst[left + col, c] = src[col, c] ^ flip


def depthwise_tile(R, mode, image, base, taps, T, weights, Cw, c0, rows, width, fixed,
                   mult, fbias, y_zero, lo, hi, out, out_at, ldo):
    """A depthwise tile's semantics, for R pixels by the 16 channels from c0: the sums
    S[r, j] = sum over taps t < T of image[base[r] + taps[t] + c0 + j] (uint8) *
    weights[t * Cw + c0 + j] (float32 holding integers: the filters less their zero
    points), then C = S + fixed[c0 + j] (int32, wrapping: exact wherever C fits) through the
    epilogue `mode` as pixel_tile's, the first `rows` pixels' first `width` channels stored
    at out[out_at + r * ldo + j]. The float32 sums are exact: DEPTHWISE_EXACT_TAPS. Compiled:
    AVX-512 vectors, or plain loops (`_register`)."""
    _plain_depthwise_tile(R, mode, image, base, taps, T, weights, Cw, c0, rows, width, fixed,
                          mult, fbias, y_zero, lo, hi, out, out_at, ldo)


@_compiled.kernel_math
def depthwise_loops(image, image_size, pixels, taps, weights, w_sum, x_zero, mode, bias, mult,
                    fbias, y_zero, lo, hi, out, images, u0, u1):
    """Units [u0, u1) of a depthwise convolution's channels-last output out (images * L, C)
    (one input and one output channel a group): a unit is DEPTHWISE_PIXELS output pixels of
    an image, all their channels, 16 at a time. `image`, `pixels` and `taps` as conv_loops';
    weights (T, Cw) float32, the filters less their zero points (Cw: C rounded up to 16,
    zeros past C), w_sum (C,) their sums over the window, for the input zero point's term."""
    L = pixels.shape[0]
    C = out.shape[1]
    T = taps.shape[0]
    Cw = weights.shape[1]
    per_image = (L + DEPTHWISE_PIXELS - 1) // DEPTHWISE_PIXELS
    flat_w = weights.reshape(-1)
    flat_out = out.reshape(-1)
    fixed = np.zeros(Cw, np.int32)   # the channels' terms, padded as the vectors read them
    ms = np.zeros(Cw, np.float32)
    fb = np.zeros(Cw, np.float32)
    for c in range(C):
        fixed[c] = np.int32(bias[c] - x_zero * w_sum[c])   # wraps: exact mod 2**32
        ms[c] = mult[c]
        fb[c] = fbias[c]
    base = np.empty(DEPTHWISE_PIXELS, np.int64)
    for u in range(u0, u1):
        n, p = u // per_image, (u % per_image) * DEPTHWISE_PIXELS
        rows = min(DEPTHWISE_PIXELS, L - p)
        for r in range(DEPTHWISE_PIXELS):   # an image's last unit repeats its last pixel
            base[r] = n * image_size + pixels[p + min(r, rows - 1)]
        at = (n * L + p) * C
        for c0 in range(0, C, 16):
            width = min(16, C - c0)
            if mode == _integer.INT32:
                depthwise_tile(DEPTHWISE_PIXELS, 0, image, base, taps, T, flat_w, Cw, c0, rows,
                               width, fixed, ms, fb, y_zero, lo, hi, flat_out, at + c0, C)
            elif mode == _integer.REQUANTIZE:
                depthwise_tile(DEPTHWISE_PIXELS, 1, image, base, taps, T, flat_w, Cw, c0, rows,
                               width, fixed, ms, fb, y_zero, lo, hi, flat_out, at + c0, C)
            else:
                depthwise_tile(DEPTHWISE_PIXELS, 2, image, base, taps, T, flat_w, Cw, c0, rows,
                               width, fixed, ms, fb, y_zero, lo, hi, flat_out, at + c0, C)


DEPTHWISE_PIXELS = 8   # output pixels a depthwise tile: 8 accumulators, a weight, an input
DEPTHWISE_EXACT_TAPS = (1 << 24) // (255 * 255)   # 258: windows up to 16 x 16


@_compiled.Once
def _kernels():
    """(conv_loops, pad_images_loops, depthwise_loops) compiled, or None without numba."""
    numba = _compiled._numba() if _compiled.enabled() else None
    if numba is None:
        return None
    _register(numba)
    return (_compiled.jit(conv_loops), _compiled.jit(pad_images_loops),
            _compiled.jit(depthwise_loops))


def enabled() -> bool:
    """Whether the pixel tiles serve (numba, not turned off)."""
    return _compiled.enabled() and _kernels() is not None


class ConvWeights:
    """A constant convolution weight (M, C, kh, kw), 8-bit, packed once for the tiles:
    `blocks` (ceil(M / 32), kh * kw * Cp / 4, 32, 4) int8 (Cp: C rounded up to 4), and per
    output channel its sum and zero point (int64, shifted as integer.Weights shifts them)."""

    def __init__(self, w: np.ndarray, zero):
        rows = _integer.conv_weights(w, zero)   # (M, kh * kw * Cp), tap-major, shifted
        M, width = rows.w.shape
        Mp = -(-M // BLOCK) * BLOCK
        packed = np.zeros((Mp, width), np.int8)
        packed[:M] = rows.w
        self.blocks = np.ascontiguousarray(
            packed.reshape(Mp // BLOCK, BLOCK, width // 4, 4).transpose(0, 2, 1, 3))
        self.sums, self.zero, self.K, self.M = rows.sums, rows.zero, rows.K, M
        self.need_sums = bool(np.any(self.zero))


class DepthwiseWeights:
    """A depthwise convolution's constant filters (C, 1, kh, kw), 8-bit, with their zero
    points (one or per channel) taken, as the depthwise tiles read them: `taps` (kh * kw,
    Cw) float32 (Cw: C rounded up to 16, zeros past C), and `sums` (C,) int64 over the
    window. `serves`: False for a window over DEPTHWISE_EXACT_TAPS taps, whose float32 sums
    could round (the planar loop takes those)."""

    def __init__(self, w: np.ndarray, zero):
        C, _, kh, kw = w.shape
        values = w.reshape(C, kh * kw).astype(np.int64) - np.asarray(zero, np.int64).reshape(-1, 1)
        self.serves = kh * kw <= DEPTHWISE_EXACT_TAPS
        self.taps = np.zeros((kh * kw, -(-C // 16) * 16), np.float32)
        self.taps[:, :C] = values.T
        self.sums = values.sum(axis=1)


class Plan:
    """An 8-bit convolution of images of one shape and layout by packed weights
    (ConvWeights, or DepthwiseWeights), worked out once: the channels-last image the tiles
    read (the input itself where it is one, else the geometry of a padded copy), the
    offsets of the output pixels' windows and of the taps, and the cut of the work among
    the threads. `run` writes out (N, OH, OW, M), C-contiguous.

    The input is read where it lies when it already is such an image: uint8, channels-last,
    C a multiple of 4, no padding (and not for the depthwise tiles, whose 16-byte vectors may
    read up to 15 bytes past a pixel: their copy has that slack after its last pixel)."""

    def __init__(self, weights, x: np.ndarray, geometry, outs):
        kernel, strides, dilations, begin, end = geometry
        N, C, H, W = x.shape
        (kh, kw), (OH, OW) = kernel, outs
        (sh, sw), (dh, dw) = strides, dilations
        Hp = max(H + begin[0] + end[0], (OH - 1) * sh + (kh - 1) * dh + 1)
        Wp = max(W + begin[1] + end[1], (OW - 1) * sw + (kw - 1) * dw + 1)
        Cp = -(-C // 4) * 4
        self.weights, self.begin = weights, begin
        self.depthwise = isinstance(weights, DepthwiseWeights)
        self.image_shape = (N, Hp, Wp, Cp)
        self.in_place = x.dtype == np.uint8 and x.transpose(0, 2, 3, 1).flags.c_contiguous \
            and C == Cp and (Hp, Wp) == (H, W) and not self.depthwise
        self.planar = not channels_last(x)   # the order of the padded copy's reads
        self.flip = 0x80 if x.dtype == np.int8 else 0
        rows = np.arange(OH, dtype=np.int64)[:, None] * (sh * Wp)
        self.pixels = (rows + np.arange(OW, dtype=np.int64) * sw).reshape(-1) * Cp
        if dw == 1 and not self.depthwise:   # a tap a window row: kw * Cp consecutive bytes
            self.taps, run = np.arange(kh, dtype=np.int64) * (dh * Wp * Cp), kw * Cp
        else:
            self.taps, run = (np.arange(kh, dtype=np.int64)[:, None] * (dh * Wp)
                              + np.arange(kw, dtype=np.int64) * dw).reshape(-1) * Cp, Cp
        self.quads = run // 4
        if self.depthwise:
            self.units = N * -(-OH * OW // DEPTHWISE_PIXELS)
            unit_ns = DEPTHWISE_PIXELS * C * kh * kw * tuning.INT_DEPTHWISE_NS
        else:
            self.units = weights.blocks.shape[0] * N * -(-OH * OW // PIXELS)
            unit_ns = PIXELS * BLOCK * self.taps.shape[0] * run * tuning.INT_MAC_NS
        self.bounds = _compiled.row_bounds(self.units, unit_ns)
        self.pad_bounds = _compiled.row_bounds(N * Hp, Wp * Cp * tuning.INT_PACK_NS)
        # tile-major where the image outweighs the weights: each read once into the cache
        self.tiles_outer = weights.blocks.nbytes < N * Hp * Wp * Cp if not self.depthwise \
            else False
        self.images: list[tuple[np.ndarray, int]] = []   # kept padded copies: (image, pad)

    def image(self, x: np.ndarray, zero: int) -> np.ndarray:
        """x as the tiles read it: its own channels-last memory, or a padded copy (int8
        flipped to uint8, the padding the zero point, 0 in the channels added), into a kept
        image where one is free whose padding is this zero point's (only x's values then
        copied; `keep` returns it), else a new one."""
        if self.in_place:
            return x.transpose(0, 2, 3, 1)
        pad = (int(zero) + self.flip) & 0xFF
        try:
            image, kept_pad = self.images.pop()   # atomic: threads sharing the plan
        except IndexError:
            image, kept_pad = None, None
        whole = kept_pad != pad
        if image is None:
            N, Hp, Wp, Cp = self.image_shape
            size = N * Hp * Wp * Cp
            # (16 bytes of slack after it: the depthwise vectors' reads past a last pixel)
            image = np.empty(size + 16, np.uint8)[:size].reshape(self.image_shape)
        source = x if self.planar else x.transpose(0, 2, 3, 1)
        if not source.flags.c_contiguous:   # neither layout: a strided view
            source = np.ascontiguousarray(source)
        _compiled.run_rows(_kernels()[1], self.pad_bounds, source.view(np.uint8),
                           self.planar, np.uint8(self.flip), np.uint8(pad), self.begin[0],
                           self.begin[1], whole, image, piece=_pad_piece)
        return image

    def keep(self, image: np.ndarray, zero: int) -> None:
        """Keep a padded copy `image` made for zero point `zero` for a next call (at most
        KEEP_IMAGE_BYTES an image): its padding stays, and allocating it again cost more
        than the copy (a fresh array's pages fault in on each write)."""
        if image.nbytes <= tuning.KEEP_IMAGE_BYTES and not self.in_place:
            self.images.append((image, (int(zero) + self.flip) & 0xFF))

    def run(self, x: np.ndarray, x_zero: int, out: np.ndarray, mode: int = _integer.INT32,
            bias=None, mult=None, fbias=None, y_zero: float = 0.0, lo: float = 0.0,
            hi: float = 0.0) -> None:
        """out (N, OH, OW, M) = the epilogue `mode` of the convolution of x (of the plan's
        shape and layout) on the run's threads: bias int64 (M,), mult and fbias float32 (M,),
        as integer.product's."""
        M = out.shape[3]
        bias = np.zeros(M, np.int64) if bias is None else bias
        mult = np.ones(M, np.float32) if mult is None else mult
        fbias = np.zeros(M, np.float32) if fbias is None else fbias
        image = self.image(x, x_zero)
        N, size = image.shape[0], image[0].size
        zero = np.int64(int(x_zero) + self.flip)
        limits = (np.float32(y_zero), np.float32(lo), np.float32(hi))
        w = self.weights
        if self.depthwise:
            _compiled.run_rows(_kernels()[2], self.bounds, image.reshape(-1), size, self.pixels,
                               self.taps, w.taps, w.sums, zero, mode, bias, mult, fbias,
                               *limits, out.reshape(-1, M), N,
                               piece=_DEPTHWISE_PIECES.get(out.dtype))
        else:
            _compiled.run_rows(_kernels()[0], self.bounds, image.reshape(-1), size, x.shape[1],
                               image.shape[3], self.pixels, self.taps, self.quads, w.blocks,
                               w.sums, w.zero, np.int64(w.K), zero, w.need_sums, mode, bias,
                               mult, fbias, *limits, out.reshape(-1, M), N, self.tiles_outer,
                               piece=_CONV_PIECES.get(out.dtype))
        self.keep(image, x_zero)


# ------------------------------------------------------------------ the kernels' pieces
# Piece functions (ops/cpu/compiled.py): the helpers run a kernel's pieces without Python,
# where a Python job would wait for the GIL; the arguments from the block run_rows made, one
# function per type of the output (or none, for the pad loop).

@_compiled.kernel_math
def _conv_piece(block, u0, u1, dtype):  # pragma: no cover - numba
    v = _compiled.array_at(block, (37,), np.int64)
    f = _compiled.array_at(block, (37,), np.float64)
    conv_loops(_compiled.array_at(v[0], (v[1],), np.uint8), v[2], v[3], v[4],
               _compiled.array_at(v[5], (v[6],), np.int64),
               _compiled.array_at(v[7], (v[8],), np.int64), v[9],
               _compiled.array_at(v[10], (v[11], v[12], v[13], v[14]), np.int8),
               _compiled.array_at(v[15], (v[16],), np.int64),
               _compiled.array_at(v[17], (v[18],), np.int64), v[19], v[20], v[21] != 0, v[22],
               _compiled.array_at(v[23], (v[24],), np.int64),
               _compiled.array_at(v[25], (v[26],), np.float32),
               _compiled.array_at(v[27], (v[28],), np.float32),
               np.float32(f[29]), np.float32(f[30]), np.float32(f[31]),
               _compiled.array_at(v[32], (v[33], v[34]), dtype), v[35], v[36] != 0, u0, u1)


@_compiled.kernel_math
def _depthwise_piece(block, u0, u1, dtype):  # pragma: no cover - numba
    v = _compiled.array_at(block, (27,), np.int64)
    f = _compiled.array_at(block, (27,), np.float64)
    depthwise_loops(_compiled.array_at(v[0], (v[1],), np.uint8), v[2],
                    _compiled.array_at(v[3], (v[4],), np.int64),
                    _compiled.array_at(v[5], (v[6],), np.int64),
                    _compiled.array_at(v[7], (v[8], v[9]), np.float32),
                    _compiled.array_at(v[10], (v[11],), np.int64), v[12], v[13],
                    _compiled.array_at(v[14], (v[15],), np.int64),
                    _compiled.array_at(v[16], (v[17],), np.float32),
                    _compiled.array_at(v[18], (v[19],), np.float32),
                    np.float32(f[20]), np.float32(f[21]), np.float32(f[22]),
                    _compiled.array_at(v[23], (v[24], v[25]), dtype), v[26], u0, u1)


def _pad_piece(block, r0, r1):  # pragma: no cover - numba
    v = _compiled.array_at(block, (16,), np.int64)
    pad_images_loops(_compiled.array_at(v[0], (v[1], v[2], v[3], v[4]), np.uint8), v[5] != 0,
                     np.uint8(v[6]), np.uint8(v[7]), v[8], v[9], v[10] != 0,
                     _compiled.array_at(v[11], (v[12], v[13], v[14], v[15]), np.uint8), r0, r1)


def _conv_piece_u8(block, u0, u1):  # pragma: no cover - numba
    _conv_piece(block, u0, u1, np.uint8)


def _conv_piece_i8(block, u0, u1):  # pragma: no cover - numba
    _conv_piece(block, u0, u1, np.int8)


def _conv_piece_i32(block, u0, u1):  # pragma: no cover - numba
    _conv_piece(block, u0, u1, np.int32)


def _depthwise_piece_u8(block, u0, u1):  # pragma: no cover - numba
    _depthwise_piece(block, u0, u1, np.uint8)


def _depthwise_piece_i8(block, u0, u1):  # pragma: no cover - numba
    _depthwise_piece(block, u0, u1, np.int8)


def _depthwise_piece_i32(block, u0, u1):  # pragma: no cover - numba
    _depthwise_piece(block, u0, u1, np.int32)


_CONV_PIECES = {np.dtype(np.uint8): _conv_piece_u8, np.dtype(np.int8): _conv_piece_i8,
                np.dtype(np.int32): _conv_piece_i32}
_DEPTHWISE_PIECES = {np.dtype(np.uint8): _depthwise_piece_u8,
                     np.dtype(np.int8): _depthwise_piece_i8,
                     np.dtype(np.int32): _depthwise_piece_i32}


# ------------------------------------------------------------------ the compiled tiles
# Built with llvmlite as numba intrinsics, once numba is imported (it is optional).

class _Ir:
    """llvmlite's builders for one intrinsic: its array arguments' data, byte and item
    addresses, splats, masked stores, and the tiles' shared epilogue."""

    def __init__(self, context, builder, sig, args):
        from llvmlite import ir
        from numba.core import cgutils
        self.ir, self.cgutils, self.builder = ir, cgutils, builder
        self._context, self._sig, self._args = context, sig, args
        self.i8, self.i32, self.i64, self.f32 = (ir.IntType(8), ir.IntType(32), ir.IntType(64),
                                                 ir.FloatType())
        self.ivec, self.fvec = ir.VectorType(self.i32, 16), ir.VectorType(self.f32, 16)

    def const(self, v):
        return self.ir.Constant(self.i64, v)

    def function(self, name, result, operands):
        return self.cgutils.get_or_insert_function(
            self.builder.module, self.ir.FunctionType(result, operands), name)

    def data(self, i):
        return self._context.make_array(self._sig.args[i])(self._context, self.builder,
                                                           self._args[i]).data

    def at_byte(self, ptr, offset, kind):
        b = self.builder
        return b.bitcast(b.gep(b.bitcast(ptr, self.i8.as_pointer()), [offset]),
                         kind.as_pointer())

    def at_item(self, ptr, index, kind):
        return self.builder.bitcast(self.builder.gep(ptr, [index]), kind.as_pointer())

    def splat(self, scalar):
        ir, b = self.ir, self.builder
        kind = ir.VectorType(scalar.type, 16)
        one = b.insert_element(ir.Constant(kind, ir.Undefined), scalar, ir.Constant(self.i32, 0))
        return b.shuffle_vector(one, one, ir.Constant(self.ivec, [0] * 16))

    def lanes_below(self, count):
        """The mask of the 16 lanes whose index is below `count` (an int64)."""
        lanes = self.ir.Constant(self.ir.VectorType(self.i64, 16), list(range(16)))
        return self.builder.icmp_signed("<", lanes, self.splat(count))

    def masked_store(self, value, ptr, index, mask):
        ir, kind = self.ir, value.type
        name = {"i32": "i32", "i8": "i8", "float": "f32"}[str(kind.element)]
        store = self.function(f"llvm.masked.store.v16{name}.p0v16{name}", ir.VoidType(),
                              [kind, kind.as_pointer(), self.i32,
                               ir.VectorType(ir.IntType(1), 16)])
        self.builder.call(store, [value, self.at_item(ptr, index, kind),
                                  ir.Constant(self.i32, 1), mask])

    def limits(self, y_zero, lo, hi):
        """The requantising epilogue's constants from y_zero, lo and hi (float32 holding
        integers): the splats of lo - y_zero and hi - y_zero (float) and of y_zero (int32)."""
        b = self.builder
        return (self.splat(b.fsub(lo, y_zero)), self.splat(b.fsub(hi, y_zero)),
                self.splat(b.fptosi(y_zero, self.i32)))

    def epilogue(self, mode, c, mult, fbias, limits, out_p, at, mask):
        """The 16 int32 sums `c` (C with the zero points' terms) through the epilogue `mode`
        (integer.py), stored at out_p[at] under `mask`: int32; requantised, rint(float32(c)
        * mult) + y_zero clipped to [lo, hi] (`limits`, from `limits()`) as 8 bits; or
        float32, float32(c) * mult + fbias. The clip comes before the rounding, to
        [lo - y_zero, hi - y_zero], and the rounding is the conversion's (to nearest even):
        the same integers, as both bounds are, in fewer instructions than rint, add and clip."""
        b = self.builder
        if mode == _integer.INT32:
            self.masked_store(c, out_p, at, mask)
            return
        y = b.fmul(b.sitofp(c, self.fvec), mult)
        if mode == _integer.FLOAT32:
            self.masked_store(b.fadd(y, fbias), out_p, at, mask)
            return
        low, high, y_zero = limits
        y = b.select(b.fcmp_ordered("<", y, low), low, y)
        y = b.select(b.fcmp_ordered(">", y, high), high, y)
        convert = self.function("llvm.x86.avx512.mask.cvtps2dq.512", self.ivec,
                                [self.fvec, self.ivec, self.ir.IntType(16), self.i32])
        q = b.call(convert, [y, self.ir.Constant(self.ivec, [0] * 16),
                             self.ir.Constant(self.ir.IntType(16), -1),
                             self.ir.Constant(self.i32, 4)])   # 4: the current rounding
        self.masked_store(b.trunc(b.add(q, y_zero), self.ir.VectorType(self.i8, 16)),
                          out_p, at, mask)


def _emit_vnni_tile(R, mode, context, builder, sig, args):
    """pixel_tile's IR for R pixels and the epilogue `mode`: 2R accumulators of 16 int32,
    vpdpbusd per 4 channels of a tap, then the epilogue, stored masked."""
    v = _Ir(context, builder, sig, args)
    ir, cgutils, const, ivec, fvec = v.ir, v.cgutils, v.const, v.ivec, v.fvec
    dot = v.function("llvm.x86.avx512.vpdpbusd.512", ivec, [ivec, ivec, ivec])
    (_, _, _, _, _, T, quads, _, w_at, rows, width, _, _, _, _, _, c0, y_zero, lo, hi, _,
     out_at, ldo) = args
    image_p, base_p, taps_p, w_p = v.data(2), v.data(3), v.data(4), v.data(7)
    fixed_p, zw_p, sums_p, mult_p, fbias_p, out_p = (v.data(11), v.data(12), v.data(13),
                                                     v.data(14), v.data(15), v.data(20))
    accs = [cgutils.alloca_once_value(builder, ir.Constant(ivec, [0] * 16))
            for _ in range(2 * R)]
    bases = [builder.load(builder.gep(base_p, [const(r)])) for r in range(R)]
    tap_bytes = builder.mul(quads, const(4 * BLOCK))
    with cgutils.for_range(builder, T) as t:
        offset = builder.load(builder.gep(taps_p, [t.index]))
        w_tap = builder.add(w_at, builder.mul(t.index, tap_bytes))
        starts = [builder.add(b, offset) for b in bases]
        with cgutils.for_range(builder, quads) as q:
            k4 = builder.mul(q.index, const(4))
            w_q = builder.add(w_tap, builder.mul(q.index, const(4 * BLOCK)))
            ws = [builder.load(v.at_byte(w_p, builder.add(w_q, const(64 * h)), ivec), align=1)
                  for h in range(2)]
            for r in range(R):
                x = v.splat(builder.load(v.at_byte(image_p, builder.add(starts[r], k4), v.i32),
                                         align=1))
                for h in range(2):
                    acc = accs[2 * r + h]
                    builder.store(builder.call(dot, [builder.load(acc), x, ws[h]]), acc)
    # C = S + fixed - zw * sums in int32 (wrapping), then the epilogue
    halves = []
    for h in range(2):
        ch = builder.add(c0, const(16 * h))
        halves.append((v.lanes_below(builder.sub(width, const(16 * h))),
                       builder.load(v.at_item(fixed_p, ch, ivec), align=4),
                       builder.load(v.at_item(zw_p, ch, ivec), align=4),
                       builder.load(v.at_item(mult_p, ch, fvec), align=4),
                       builder.load(v.at_item(fbias_p, ch, fvec), align=4)))
    limits = v.limits(y_zero, lo, hi)
    # the weights' zero points' term only where one is not 0 (per-channel int8 weights are
    # symmetric: the multiply would be most of a short sum's epilogue)
    zero_points = builder.or_(*[builder.bitcast(builder.icmp_signed("!=", zw, ir.Constant(
        ivec, [0] * 16)), ir.IntType(16)) for _, _, zw, _, _ in halves])
    weighted = builder.icmp_unsigned("!=", zero_points, ir.Constant(ir.IntType(16), 0))
    c_p = cgutils.alloca_once(builder, ivec)
    for r in range(R):
        with builder.if_then(builder.icmp_signed("<", const(r), rows)):
            row_at = builder.add(out_at, builder.mul(const(r), ldo))
            for h, (mask, fixed, zw, mult, fbias) in enumerate(halves):
                builder.store(builder.add(builder.load(accs[2 * r + h]), fixed), c_p)
                with builder.if_then(weighted):
                    total = v.splat(builder.load(builder.gep(sums_p, [const(r)])))
                    builder.store(builder.sub(builder.load(c_p), builder.mul(zw, total)), c_p)
                v.epilogue(mode, builder.load(c_p), mult, fbias, limits, out_p,
                           builder.add(row_at, const(16 * h)), mask)
    return context.get_dummy_value()


def _emit_depthwise_tile(R, mode, context, builder, sig, args):
    """depthwise_tile's IR for R pixels and the epilogue `mode`: R accumulators of 16
    float32 (exact integers), one fused multiply-add a pixel and tap, then C = S + fixed in
    int32 and the epilogue, stored masked."""
    v = _Ir(context, builder, sig, args)
    ir, cgutils, const, ivec, fvec = v.ir, v.cgutils, v.const, v.ivec, v.fvec
    fma = v.function("llvm.fma.v16f32", fvec, [fvec, fvec, fvec])
    (_, _, _, _, _, T, _, Cw, c0, rows, width, _, _, _, y_zero, lo, hi, _, out_at, ldo) = args
    image_p, base_p, taps_p, w_p = v.data(2), v.data(3), v.data(4), v.data(6)
    fixed_p, mult_p, fbias_p, out_p = v.data(11), v.data(12), v.data(13), v.data(17)
    bytes16 = ir.VectorType(v.i8, 16)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(fvec, [0.0] * 16))
            for _ in range(R)]
    starts = [builder.add(builder.load(builder.gep(base_p, [const(r)])), c0) for r in range(R)]
    with cgutils.for_range(builder, T) as t:
        offset = builder.load(builder.gep(taps_p, [t.index]))
        w = builder.load(v.at_item(w_p, builder.add(builder.mul(t.index, Cw), c0), fvec),
                         align=4)
        for r in range(R):
            x = builder.load(v.at_byte(image_p, builder.add(starts[r], offset), bytes16),
                             align=1)
            x = builder.uitofp(builder.zext(x, ivec), fvec)
            builder.store(builder.call(fma, [x, w, builder.load(accs[r])]), accs[r])
    mask = v.lanes_below(width)
    fixed = builder.load(v.at_item(fixed_p, c0, ivec), align=4)
    mult = builder.load(v.at_item(mult_p, c0, fvec), align=4)
    fbias = builder.load(v.at_item(fbias_p, c0, fvec), align=4)
    limits = v.limits(y_zero, lo, hi)
    for r in range(R):
        with builder.if_then(builder.icmp_signed("<", const(r), rows)):
            c = builder.add(builder.fptosi(builder.load(accs[r]), ivec), fixed)
            v.epilogue(mode, c, mult, fbias, limits, out_p,
                       builder.add(out_at, builder.mul(const(r), ldo)), mask)
    return context.get_dummy_value()


def _plain_depthwise_tile(R, mode, image, base, taps, T, weights, Cw, c0, rows, width, fixed,
                          mult, fbias, y_zero, lo, hi, out, out_at, ldo):
    """depthwise_tile in plain compiled loops, where the CPU has no AVX-512."""
    for r in range(rows):
        for j in range(width):
            s = np.float32(0)
            for t in range(T):
                s += np.float32(image[base[r] + taps[t] + c0 + j]) * weights[t * Cw + c0 + j]
            c = np.int32(np.int32(s) + fixed[c0 + j])
            at = out_at + r * ldo + j
            if mode == _integer.INT32:
                out[at] = c
            elif mode == _integer.REQUANTIZE:
                y = np.rint(np.float32(c) * mult[c0 + j]) + y_zero
                out[at] = min(max(y, lo), hi)
            else:
                out[at] = np.float32(c) * mult[c0 + j] + fbias[c0 + j]


def _plain_tile(R, mode, image, base, taps, T, quads, weights, w_at, rows, width, fixed,
                w_zero, sums, mult, fbias, c0, y_zero, lo, hi, out, out_at, ldo):
    """pixel_tile in plain compiled loops, where the CPU has no VNNI."""
    for r in range(rows):
        for j in range(width):
            s = np.int32(0)
            for t in range(T):
                x = base[r] + taps[t]
                w = w_at + t * quads * 4 * BLOCK + j * 4
                for q in range(quads):
                    for e in range(4):
                        s += np.int32(weights[w + q * 4 * BLOCK + e]) \
                            * np.int32(image[x + 4 * q + e])
            c = np.int32(s + fixed[c0 + j] - w_zero[c0 + j] * sums[r])
            at = out_at + r * ldo + j
            if mode == _integer.INT32:
                out[at] = c
            elif mode == _integer.REQUANTIZE:
                y = np.rint(np.float32(c) * mult[c0 + j]) + y_zero
                out[at] = min(max(y, lo), hi)
            else:
                out[at] = np.float32(c) * mult[c0 + j] + fbias[c0 + j]


@_compiled.Once
def _register(numba) -> None:
    """The tiles' compiled forms: pixel_tile on VNNI, depthwise_tile on AVX-512's vectors, for
    their pixel counts and each epilogue; plain loops elsewhere."""
    from numba.extending import intrinsic, overload, register_jitable
    types = numba.types
    i64, f32 = types.int64, types.float32

    def vnni_intrinsic(pixels, mode):
        @intrinsic
        def vnni_tile(typingctx, R, mode_, image, base, taps, T, quads, weights, w_at, rows,
                      width, fixed, w_zero, sums, mult, fbias, c0, y_zero, lo, hi, out,
                      out_at, ldo):
            sig = types.void(R, mode_, image, base, taps, i64, i64, weights, i64, i64, i64,
                             fixed, w_zero, sums, mult, fbias, i64, f32, f32, f32, out, i64,
                             i64)
            return sig, lambda context, builder, s, a: _emit_vnni_tile(pixels, mode, context,
                                                                       builder, s, a)
        return vnni_tile

    def depthwise_intrinsic(mode):
        @intrinsic
        def vector_tile(typingctx, R, mode_, image, base, taps, T, weights, Cw, c0, rows,
                        width, fixed, mult, fbias, y_zero, lo, hi, out, out_at, ldo):
            sig = types.void(R, mode_, image, base, taps, i64, weights, i64, i64, i64, i64,
                             fixed, mult, fbias, f32, f32, f32, out, i64, i64)
            return sig, lambda context, builder, s, a: _emit_depthwise_tile(
                DEPTHWISE_PIXELS, mode, context, builder, s, a)
        return vector_tile

    if _integer.VNNI:
        vnni = {(r, m): vnni_intrinsic(r, m) for r in (PIXELS, 1) for m in (0, 1, 2)}

        @overload(pixel_tile)
        def _pixel_tile(R, mode, image, base, taps, T, quads, weights, w_at, rows, width,
                        fixed, w_zero, sums, mult, fbias, c0, y_zero, lo, hi, out, out_at,
                        ldo):
            tile = vnni.get((getattr(R, "literal_value", None),
                             getattr(mode, "literal_value", None)))
            if tile is None:
                return None

            def call(R, mode, image, base, taps, T, quads, weights, w_at, rows, width, fixed,
                     w_zero, sums, mult, fbias, c0, y_zero, lo, hi, out, out_at, ldo):
                tile(R, mode, image, base, taps, np.int64(T), np.int64(quads), weights,
                     np.int64(w_at), np.int64(rows), np.int64(width), fixed, w_zero, sums,
                     mult, fbias, np.int64(c0), np.float32(y_zero), np.float32(lo),
                     np.float32(hi), out, np.int64(out_at), np.int64(ldo))
            return call
    else:
        plain = register_jitable(_plain_tile)

        @overload(pixel_tile)
        def _plain(R, mode, image, base, taps, T, quads, weights, w_at, rows, width, fixed,
                   w_zero, sums, mult, fbias, c0, y_zero, lo, hi, out, out_at, ldo):
            return plain

    if _tiles.HOST_LANES == 16:
        vectors = {m: depthwise_intrinsic(m) for m in (0, 1, 2)}

        @overload(depthwise_tile)
        def _depthwise_tile(R, mode, image, base, taps, T, weights, Cw, c0, rows, width, fixed,
                            mult, fbias, y_zero, lo, hi, out, out_at, ldo):
            tile = vectors.get(getattr(mode, "literal_value", None))
            if getattr(R, "literal_value", None) != DEPTHWISE_PIXELS or tile is None:
                return None

            def call(R, mode, image, base, taps, T, weights, Cw, c0, rows, width, fixed, mult,
                     fbias, y_zero, lo, hi, out, out_at, ldo):
                tile(R, mode, image, base, taps, np.int64(T), weights, np.int64(Cw),
                     np.int64(c0), np.int64(rows), np.int64(width), fixed, mult, fbias,
                     np.float32(y_zero), np.float32(lo), np.float32(hi), out,
                     np.int64(out_at), np.int64(ldo))
            return call
    else:
        plain_depthwise = register_jitable(_plain_depthwise_tile)

        @overload(depthwise_tile)
        def _plain_depthwise(R, mode, image, base, taps, T, weights, Cw, c0, rows, width,
                             fixed, mult, fbias, y_zero, lo, hi, out, out_at, ldo):
            return plain_depthwise

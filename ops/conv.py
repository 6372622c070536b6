"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv, Col2Im,
CausalConvWithState.

Every convolution is N-D (1-D, 2-D, 3-D, ...) and reduces to one of three kernels:

* pointwise (1x1, no padding): a plain matmul of the weights with the (strided) input (on
  the CPU, for one image with a large product, the register tiles below);
* im2col: a strided window view of the padded input copied once into the patch matrix, then a
  single GEMM (groups: one batched GEMM). The bias rides along as an extra weight column
  matched by a row of ones, so the GEMM writes the final result;
* many small groups (ResNeXt-like): the same im2col + batched GEMM, over chunks of groups
  sized to stay in cache (faster than a loop over kernel taps accumulating shifted slices);
* depthwise 2-D (one output channel per input channel), on the CPU: a channels-last kernel
  (np.einsum, or a compiled 3x3 loop where numba is installed) whose result stays
  channels-last, as do the 1x1 convolutions fed such an input (see "CPU kernels over
  channels-last memory" below);
* shifted GEMMs, on the CPU, for 2-D stride-1 convolutions over large images with few
  channels (UNet's layers): one GEMM per kernel tap over the channels-last padded input, with
  no patch matrix at all (see `_conv_shifted`);
* register tiles (ops/cpu/tiles.py), on the CPU, for 2-D float32 convolutions: one group
  (`_TiledRoute`), or groups of GROUPED_MIN_WIDTH channels and more a block of neighbouring
  groups at a time (`_GroupedRoute`).

ConvTranspose and Col2Im share the reverse: a matmul producing columns, then a scatter-add over
kernel taps (col2im). On the CPU a 2-D ConvTranspose of one group is instead one ordinary
convolution with a block of output channels per output phase (`_sub_pixel`). Integer convolutions run exactly through float64 BLAS (every int8/uint8
product and any realistic sum of them is exactly representable), then round to integers.

The geometry helpers here (padding, output sizes, padding an array) are shared with pool.py.
"""
from __future__ import annotations

import math

import numpy as np

from ember import limits
from ember.errors import EmberError
from ember.ops.cpu import blas as _blas, compiled as _compiled, tiles as _tiles, tuning
# as plain globals: conv_nd's im2col path reads the first two, a compiled kernel the third
from ember.ops.cpu.tuning import (IM2COL_CHUNK as _IM2COL_CHUNK,
                                  IMAGE_CHANNELS as _IMAGE_CHANNELS, DEPTHWISE_BAND_BYTES)
from ember.ops import _epilogue, _integer as _int, _xp
from ember.ops._epilogue import epilogue_loops
from ember.ops.cpu import integer as _integer, integer_tiles as _integer_tiles
from ember.ops._layout import channels_last
from ember.ops._lowering import remembered_route
from ember.ops.linalg import check_numeric
from ember.ops.registry import Lowering, OpImpl, register

# ----------------------------------------------------------------------------------------------
# shared geometry helpers

# Window attributes (kernel_shape, strides, dilations, pads...) above this are refused at load
# time: no real model has one, and with them every index product fits in an int64.
MAX_WINDOW_ATTRIBUTE = 2**31 - 1
# attribute -> (least value allowed, entries per spatial axis)
_WINDOW_ATTRIBUTES = {"kernel_shape": (1, 1), "strides": (1, 1), "dilations": (1, 1),
                      "pads": (-MAX_WINDOW_ATTRIBUTE, 2), "output_padding": (0, 1),
                      "output_shape": (0, 1)}


def check_window_attributes(op: OpImpl) -> None:
    """Load-time checks of a convolution's or pool's window attributes: every entry an int
    within bounds (kernel sizes, strides and dilations positive), and as many entries per
    spatial axis as kernel_shape has axes, where it is given. A kernel_shape of 2**40 is
    refused here rather than run."""
    kernel = getattr(op, "kernel_shape", None)
    axes = len(kernel) if kernel is not None and len(kernel) else None
    for name, (least, per_axis) in _WINDOW_ATTRIBUTES.items():
        values = getattr(op, name, None)
        if values is None or not len(values):
            continue
        try:
            values = [int(v) for v in values]
        except (TypeError, ValueError):
            raise op.fail(f"{name} must be a list of ints, got {values!r}") from None
        bad = [v for v in values if not least <= v <= MAX_WINDOW_ATTRIBUTE]
        if bad:
            bound = "positive" if least == 1 else "non-negative" if least == 0 else "bounded"
            raise op.fail(f"{name} {values}: each entry must be {bound} and at most "
                          f"{MAX_WINDOW_ATTRIBUTE}, got {bad[0]}")
        if axes is not None and name != "output_shape" and len(values) != per_axis * axes:
            raise op.fail(f"{name} has {len(values)} entries; kernel_shape {list(kernel)} "
                          f"needs {per_axis * axes}")


def remembered_geometry(op: OpImpl, key: tuple, resolve):
    """resolve(), remembered on `op` for the last `key` (the input shapes it depends on): a
    node sees the same shapes run after run, and resolving its attributes again is a
    noticeable share of a small node's time. The key and its value are one attribute,
    replaced whole, so threads sharing the op never pair a key with another key's value.
    Callers must not modify the value."""
    last = getattr(op, "_last_geometry", None)
    if last is not None and last[0] == key:
        return last[1]
    value = resolve()
    op._last_geometry = (key, value)
    return value


def ints(values, n: int, default: int) -> list[int]:
    """An attribute list of per-axis ints, or `default` on every axis when absent."""
    if values is None or len(values) == 0:
        return [default] * n
    return [int(v) for v in values]


def auto_pads(auto_pad, in_sp, kernel, strides, dilations, pads):
    """Resolve `auto_pad` (forward convolution / pooling): -> (pads_begin, pads_end)."""
    n = len(in_sp)
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for i in range(n):
            out = -(-in_sp[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_sp[i])
            small = total // 2
            b = small if auto_pad == "SAME_UPPER" else total - small
            begin.append(b)
            end.append(total - b)
        return begin, end
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    if auto_pad not in ("NOTSET", ""):
        raise ValueError(f"unknown auto_pad '{auto_pad}'")
    p = ints(pads, 2 * n, 0)
    return p[:n], p[n:]


def out_size(in_sp, kernel, strides, dilations, begin, end, ceil_mode=False):
    outs = []
    for i in range(len(in_sp)):
        span = in_sp[i] + begin[i] + end[i] - ((kernel[i] - 1) * dilations[i] + 1)
        if ceil_mode:
            o = -(-span // strides[i]) + 1
            # the last window must start inside the input or the left padding
            if (o - 1) * strides[i] >= in_sp[i] + begin[i]:
                o -= 1
        else:
            o = span // strides[i] + 1
        outs.append(max(o, 0))
    return outs


def pad_array(xp, x, begin, end, value=0):
    """`x` padded on its trailing len(begin) axes (negative amounts crop); a copy only if needed."""
    n = len(begin)
    if not any(begin) and not any(end):
        return x
    lead = x.ndim - n
    crop = tuple([slice(None)] * lead + [slice(max(0, -b), x.shape[lead + i] - max(0, -e))
                                         for i, (b, e) in enumerate(zip(begin, end))])
    x = x[crop]
    begin = [max(0, b) for b in begin]
    end = [max(0, e) for e in end]
    if not any(begin) and not any(end):
        return x
    shape = x.shape[:lead] + tuple(x.shape[lead + i] + begin[i] + end[i] for i in range(n))
    limits.check_shape(shape, x.dtype, "padded input")  # pads come from the model
    out = xp.empty(shape, x.dtype)
    # fill only the border slabs, then copy the interior once
    for i in range(n):
        ax = lead + i
        if begin[i]:
            idx = [slice(None)] * len(shape)
            idx[ax] = slice(0, begin[i])
            out[tuple(idx)] = value
        if end[i]:
            idx = [slice(None)] * len(shape)
            idx[ax] = slice(shape[ax] - end[i], shape[ax])
            out[tuple(idx)] = value
    inner = tuple([slice(None)] * lead + [slice(begin[i], begin[i] + x.shape[lead + i])
                                          for i in range(n)])
    out[inner] = x
    return out


def tap_slices(taps, strides, dilations, outs):
    """For each kernel tap (a tuple of per-axis offsets), the slices selecting its inputs."""
    return tuple(slice(t * d, t * d + (o - 1) * s + 1, s)
                 for t, s, d, o in zip(taps, strides, dilations, outs))


def compute_dtype(dtype):
    """The dtype arithmetic runs in: float64 stays, every other float goes to float32."""
    return np.float64 if dtype == np.float64 else np.float32


def _remembered(cache, key, make):
    """`make()`, kept in `cache` (conv_nd's per-weight dict, or None) under `key`: weights
    rearranged for a kernel are built once per constant weight."""
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _taps_last(w, cache):
    """w (M, C, kh, kw) as C-ordered (kh, kw, C, M), remembered: the shifted-GEMM and
    patch-row kernels' weights, a (C, M) matrix per tap."""
    return _remembered(cache, "taps-last", lambda: np.ascontiguousarray(w.transpose(2, 3, 1, 0)))


def _windows(xp, padded, kernel, strides, dilations, outs):
    """Read-only view (N, C, *kernel, *outs) of the padded input `padded` (N, C, *spatial)."""
    n = len(kernel)
    st = padded.strides
    shape = padded.shape[:2] + tuple(kernel) + tuple(outs)
    strides_ = st[:2] + tuple(st[2 + i] * dilations[i] for i in range(n)) \
        + tuple(st[2 + i] * strides[i] for i in range(n))
    return _xp.as_strided(xp, padded, shape, strides_)


# ----------------------------------------------------------------------------------------------
# forward convolution core


def conv_nd(xp, x, w, group, kernel, strides, dilations, begin, end, bias=None, cache=None,
            clamp=None):
    """Cross-correlation of x (N, C, *sp) with w (M, C/group, *kernel), plus `bias` (M,) if
    given; returns a fresh (N, M, *outs) array in x's dtype (float32 or float64 here).
    `clamp` (lo, hi) clips the result to [lo, hi]: only where `clamps_in_pass` says so, in the
    same pass.

    `cache` is a dict the caller keeps for as long as w and bias stay the same constants; the
    bias-augmented weight matrix is remembered there.
    """
    N = x.shape[0]
    M = w.shape[0]
    outs = out_size(x.shape[2:], kernel, strides, dilations, begin, end)
    limits.check_shape((N, M, *outs), x.dtype)
    if math.prod(outs) == 0 or N == 0 or M == 0:
        out = xp.zeros((N, M, *outs), x.dtype)
        return _add_bias(out, bias)
    if bias is not None:
        bias = bias.astype(x.dtype, copy=False).reshape(M)

    if xp is np and _depthwise_fast(x, w, group, kernel, begin, end):
        return _depthwise_cl(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp)
    if xp is np and _tiled_fits(x, w, group, begin, end):
        return _conv_tiled(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp)
    if xp is np and _grouped_fits(x, w, group, begin, end):
        return _GroupedRoute(x, w, group, kernel, strides, dilations, begin, outs, bias, cache,
                             clamp, keep_image=False).run(x)
    assert clamp is None, "a clamp only where clamps_in_pass"

    if math.prod(kernel) == 1 and not any(begin) and not any(end):
        return _conv_pointwise(xp, x, w, group, strides, outs, bias, cache)
    if xp is np and _shifted_fits(x, group, kernel, strides, dilations, begin, end, outs):
        return _conv_shifted(x, w, kernel, begin, end, outs, bias, cache)
    if xp is np and _patch_rows_fit(x, group, begin, end):
        return _conv_patch_rows(x, w, kernel, strides, dilations, begin, outs, bias, cache)
    return _conv_im2col(xp, x, w, group, kernel, strides, dilations, begin, end, outs, bias,
                        cache)


def _augmented_weights(xp, w, bias, group, width, dtype, cache):
    """w as (group, M/group, width + 1) with the bias as the extra column, remembered: matched
    by a row of ones in the patches, the GEMM then writes the biased result directly (no extra
    pass over the output). `width` is C/group times the kernel's size."""
    def make():
        Mg = w.shape[0] // group
        wa = xp.empty((group, Mg, width + 1), dtype)
        wa[:, :, :-1] = w.reshape(group, Mg, width)
        wa[:, :, -1] = bias.reshape(group, Mg)
        return wa
    return _remembered(cache, "aug", make)


def _conv_gemm(xp, wm, cols, group, out_shape):
    """wm (group, Mg, rows) times the patches cols (N, group, rows, L), as out_shape
    (N, M, *outs); one group is a plain matrix product, broadcast over N."""
    if group == 1:
        out = _blas.product(xp, wm[0], cols[:, 0])
    else:
        out = _blas.product(xp, wm, cols)
    return out.reshape(out_shape)


def _conv_pointwise(xp, x, w, group, strides, outs, bias, cache):
    """A 1x1 convolution without padding: a plain matmul over the (strided) pixels."""
    if xp is np and channels_last(x):   # (as pointwise_cl_fits says, past conv_nd's checks)
        return _pointwise_cl(x, w, group, strides, outs, bias, cache)
    N, C = x.shape[:2]
    M = w.shape[0]
    Cg, Mg = C // group, M // group
    L = math.prod(outs)
    if any(s != 1 for s in strides):
        x = x[(slice(None), slice(None)) + tuple(slice(0, (o - 1) * s + 1, s)
                                                for o, s in zip(outs, strides))]
    if bias is not None and (Mg > Cg or any(s != 1 for s in strides)):
        # copying the input (with a ones row) is cheaper than a pass over the output
        cols = xp.empty((N, group, Cg + 1, L), x.dtype)
        cols[:, :, :Cg].reshape((N, group, Cg) + tuple(outs))[...] = \
            x.reshape((N, group, Cg) + tuple(outs))
        cols[:, :, Cg] = 1
        wa = _augmented_weights(xp, w, bias, group, Cg, x.dtype, cache)
        return _conv_gemm(xp, wa, cols, group, (N, M, *outs))
    out = _conv_gemm(xp, w.reshape(group, Mg, Cg), x.reshape(N, group, Cg, L), group,
                     (N, M, *outs))
    return _add_bias(out, bias)


def _conv_im2col(xp, x, w, group, kernel, strides, dilations, begin, end, outs, bias, cache):
    """The general case: the padded input's windows copied into a patch matrix (with a ones
    row for the bias), then GEMMs."""
    N, C = x.shape[:2]
    M = w.shape[0]
    Cg, Mg = C // group, M // group
    K, L = math.prod(kernel), math.prod(outs)
    padded = pad_array(xp, x, begin, end)
    win = _windows(xp, padded, kernel, strides, dilations, outs)  # (N, C, *kernel, *outs)
    win = win.reshape((N, group, Cg) + tuple(kernel) + tuple(outs))
    rows = Cg * K + (bias is not None)
    wm = w.reshape(group, Mg, Cg * K) if bias is None else \
        _augmented_weights(xp, w, bias, group, Cg * K, x.dtype, cache)

    # im2col: the window view copied once into the patch matrix, then one GEMM (on a device,
    # always: the chunked loops of _im2col_chunked only pay off in a CPU's caches)
    if xp is not np or (N == 1 and (group == 1 or rows * L * group <= _IM2COL_CHUNK)):
        cols = xp.empty((N, group, rows, L), x.dtype)
        _fill_cols(xp, cols, win, bias is not None)
        if xp is np and group == 1 and C <= _IMAGE_CHANNELS and x.ndim == 4:
            # an image's first layer: the result channels-last, (L, M) = cols^T w^T (BLAS
            # reads both transposed), for the depthwise and pointwise kernels that follow
            out = _blas.matmul(cols[0, 0].T, wm[0].T)
            return out.reshape(N, *outs, M).transpose(0, 3, 1, 2)
        return _conv_gemm(xp, wm, cols, group, (N, M, *outs))
    return _im2col_chunked(win, wm, x.dtype, outs, bias is not None)


def _im2col_chunked(win, wm, dtype, outs, ones_row):
    """im2col on the CPU in cache-sized pieces: the windows win (N, group, C/group, *kernel,
    *outs) times wm (group, M/group, rows), written straight into the (N, M, *outs) result."""
    N, group = win.shape[:2]
    Mg, rows = wm.shape[1:]
    M, L = group * Mg, math.prod(outs)
    if group == 1:
        # a batch: one image at a time, reusing one patch matrix (a smaller working set)
        out = np.empty((N, M, L), dtype)
        cols = np.empty((1, 1, rows, L), dtype)
        for i in range(N):
            _fill_cols(np, cols, win[i:i + 1], ones_row)
            _blas.matmul(wm[0], cols[0, 0], out=out[i])
        return out.reshape(N, M, *outs)

    # many small groups (depthwise, ResNeXt-like): im2col + batched GEMM over chunks of groups
    # sized to stay in cache
    per = max(1, _IM2COL_CHUNK // (N * rows * L))
    out = np.empty((N, group, Mg, L), dtype)
    buf = np.empty((N, min(per, group), rows, L), dtype)
    for g0 in range(0, group, per):
        g1 = min(group, g0 + per)
        cols = buf[:, :g1 - g0]
        _fill_cols(np, cols, win[:, g0:g1], ones_row)
        _blas.matmul(wm[g0:g1], cols, out=out[:, g0:g1])
    return out.reshape(N, M, *outs)


# ----------------------------------------------------------------------------------------------
# CPU kernels over channels-last memory
#
# A depthwise convolution's work is a per-channel weighted sum of k*k shifted inputs; with the
# channels last in memory, np.einsum does it in one fused multiply-accumulate pass per tap
# whose inner loop runs along contiguous channels (stride 1: along whole contiguous rows of
# pixels x channels, the weights tiled along the row once), where the channels-first
# formulations cost two passes per tap (or an im2col copy plus one tiny GEMM per channel).
# Its result is returned channels-last: a (N, C, H, W) view of (N, H, W, C) memory.
# Pointwise convolutions keep such an input's layout (their GEMM reads it as a plain
# (N*H*W, C) matrix, transposes included, and writes (N*H*W, M)), so a chain of
# depthwise-separable blocks stays channels-last without a transposing copy between layers;
# every other kernel reads any strides.


def clamps_in_pass(xp, x, w, group, kernel, strides, dilations, begin, end) -> bool:
    """Whether conv_nd can clip this convolution's result (`clamp`) in its own pass over the
    output: the depthwise kernels' and the tiles' (with bias, the whole of a ReLU6 block's
    Conv + Clip), and the small 1-D convolutions computed directly."""
    return xp is np and (_depthwise_fast(x, w, group, kernel, begin, end)
                         or _tiled_fits(x, w, group, begin, end)
                         or _grouped_fits(x, w, group, begin, end)
                         or x.ndim == 3 and _direct_fits(x, w, group, out_size(
                             x.shape[2:], kernel, strides, dilations, begin, end)))


def _depthwise_fast(x, w, group, kernel, begin, end):
    """Whether the channels-last depthwise kernel runs this convolution: 2-D, one output
    channel per input channel (C > 1), no negative pads, float32 / float64."""
    C = x.shape[1]
    return (x.ndim == 4 and group == C and w.shape[0] == C and C > 1
            and min(begin) >= 0 and min(end) >= 0 and x.dtype in (np.float32, np.float64))


def _depthwise_cl(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp=None):
    N, C, H, W = x.shape
    (kh, kw), (sh, sw), (dh, dw), (Oh, Ow) = kernel, strides, dilations, outs
    route = _DepthwiseRoute.make(x, w, bias, clamp, kernel, strides, dilations, begin, outs,
                                 cache)
    if route is not None:
        return route.run(x)
    # Width tap j reads padded column sw*ow + j*dw = sw*(ow + dj) + ph: the padded input is
    # split by column phase ph (Q[ph][:, :, q] = padded column sw*q + ph, channels last), so
    # that every tap reads rows of Ow*C contiguous values; taps become (row tap, phase, dj),
    # the (phase, dj) pairs no tap has getting zero weights (none at stride 1).
    ndj = ((kw - 1) * dw) // sw + 1
    Wq = Ow + ndj - 1
    Hp = max(begin[0] + H, (Oh - 1) * sh + (kh - 1) * dh + 1)
    b0, b1 = begin
    Q = np.empty((sw, N, Hp, Wq, C), x.dtype)
    Q[:, :, :b0] = 0
    Q[:, :, b0 + H:] = 0
    xt = x.transpose(0, 2, 3, 1)                                   # (N, H, W, C), a view
    for ph in range(sw):
        lo = min(Wq, max(0, -(-(b1 - ph) // sw)))      # first q whose column is in the input
        hi = min(Wq, max(lo, -(-(b1 + W - ph) // sw)))
        rows = Q[ph, :, b0:b0 + H]
        rows[:, :, :lo] = 0
        rows[:, :, hi:] = 0
        if hi > lo:
            c0 = ph + sw * lo - b1
            rows[:, :, lo:hi] = xt[:, :, c0:c0 + sw * (hi - lo - 1) + 1:sw]
    def row_weights():
        wt = np.zeros((kh, sw, ndj, Ow, C), x.dtype)
        taps = w.reshape(C, kh, kw)
        for j in range(kw):
            wt[:, (j * dw) % sw, (j * dw) // sw] = taps[:, :, j].T[:, None, :]
        return wt.reshape(kh, sw, ndj, Ow * C)
    wt = _remembered(cache, ("dw-rows", Ow), row_weights)
    st = Q.strides
    win = np.lib.stride_tricks.as_strided(
        Q, (kh, sw, ndj, N, Oh, Ow * C),
        (st[2] * dh, st[0], st[3], st[1], st[2] * sh, st[4]), writeable=False)
    out = np.einsum("iabnhx,iabx->nhx", win, wt).reshape(N, Oh, Ow, C)
    if bias is not None:
        out += bias
    if clamp is not None:
        np.clip(out, *clamp, out=out)
    return out.transpose(0, 3, 1, 2)


_DEPTHWISE_VECTOR = Lowering("cpu.depthwise-vector", "one channel per group: AVX-512 vector "
                             "code over the channels-last image, the window's weights in registers")
_DEPTHWISE_LOOPS = Lowering("cpu.depthwise", "one channel per group: compiled loops over the "
                            "channels-last image")
_BY_GEOMETRY = Lowering("by geometry", "chosen at the first run of each input geometry: the "
                        "plan does not know the input's shape or the weights")
_BY_LAYOUT = Lowering("by layout", "1x1: register tiles or one product on the board where the "
                      "input arrives channels-last in a run, else conv_nd's product")
_CONV_ND = Lowering("numpy", "conv_nd: patches and BLAS products (a channels-last depthwise "
                    "einsum or one pointwise product where they apply)")


def _depthwise_vector_fits(x, kernel) -> bool:
    """Whether the depthwise vector code serves x: AVX-512, float32, a window it was
    compiled for (any channels: the last block of fewer than LANES runs masked)."""
    return (_tiles.WIDE and x.dtype == np.float32
            and math.prod(kernel) in _tiles.DEPTHWISE_TAPS)


def depthwise_activates(xp, x, w, group, kernel, begin, end) -> bool:
    """Whether the depthwise vector kernel runs this convolution and can apply an activation
    (a clamp of (lo, hi, code, p0, p1): `_epilogue.activation_in_loops`) to its rows while
    they are in cache, as FusedConv asks for its SiLU, HardSwish or GELU."""
    return xp is np and _depthwise_fast(x, w, group, kernel, begin, end) \
        and _depthwise_vector_fits(x, kernel) \
        and _tiles.depthwise_kernel(_depthwise_vector_rows) is not None


class _DepthwiseRoute:
    """A depthwise convolution of a channels-last image by a compiled kernel, with its bias
    and clip, worked out once for an input geometry and the run's thread count (Conv.route):
    a call allocates the output and runs the kernel's pieces, without conv_nd's way to the
    kernel, a large share of a small layer's time."""

    @classmethod
    def make(cls, x, w, bias, clamp, kernel, strides, dilations, begin, outs, cache):
        """The route, or None where no compiled kernel serves (numba not installed, or an
        activation in `clamp` (`depthwise_activates`) without the vector kernel)."""
        kh, kw = kernel
        vector = None
        if _depthwise_vector_fits(x, kernel):
            vector = _tiles.depthwise_kernel(_depthwise_vector_rows)
        compiled = vector or (_numba_depthwise3x3() if kh == kw == 3 else _numba_depthwise())
        if compiled is None or (vector is None and clamp is not None and len(clamp) > 2):
            return None
        return cls(x, w, bias, clamp, kernel, strides, dilations, begin, outs, cache, compiled,
                   vector is not None)

    def __init__(self, x, w, bias, clamp, kernel, strides, dilations, begin, outs, cache,
                 compiled, vector):
        N, C, H, W = x.shape
        (kh, kw), (sh, sw), (dh, dw), (Oh, Ow) = kernel, strides, dilations, outs
        wt = _remembered(cache, "dw-taps", lambda: np.ascontiguousarray(
            w.reshape(C, kh, kw).transpose(1, 2, 0)))
        # the vector kernel reads the bias in whole vectors: zeros past C
        Cb = -(-C // _tiles.LANES) * _tiles.LANES if vector else C
        self.b = np.zeros(Cb, x.dtype)
        if bias is not None:
            self.b[:C] = bias
        lo, hi = (x.dtype.type(v) for v in (clamp or (-np.inf, np.inf))[:2])
        self.geometry = (begin[0], begin[1], sh, sw, dh, dw, lo, hi)
        if vector:   # then the activation (code, p0, p1), a clamp's fields 2-4 (none: 0)
            code, p0, p1 = clamp[2:] if clamp is not None and len(clamp) > 2 else (0, 0, 0)
            self.geometry += (code, np.float32(p0), np.float32(p1))
        self.out_shape = (N, Oh, Ow, C)
        self.kernel = compiled
        self.lowering = _DEPTHWISE_VECTOR if vector else _DEPTHWISE_LOOPS
        if vector:
            self.weights = (*_vector_weights(wt, W, dh, dw, cache), wt)
            self.piece = _depthwise_vector_piece
            ns = tuning.DEPTHWISE_VECTOR_NS
        else:
            self.weights = (wt,)
            self.piece = _DEPTHWISE_PIECES[(kh, kw) == (3, 3), x.dtype == np.float32]
            ns = tuning.DEPTHWISE_TAP_NS
        # split by the input's size too: the layer before (a 1x1 convolution) wrote its rows
        # from both cores, and a thread reads the other core's half slowly
        self.bounds = _compiled.row_bounds(Oh, max(ns * kh * kw * N * Ow * C,
                                                   tuning.DEPTHWISE_INPUT_NS_PER_BYTE
                                                   * x.nbytes / Oh))

    def run(self, x):
        xt = x.transpose(0, 2, 3, 1)
        if not xt.flags.c_contiguous:
            xt = np.ascontiguousarray(xt)
        out = _tiles.empty(self.out_shape, x.dtype)
        _compiled.run_rows(self.kernel, self.bounds, xt, *self.weights, self.b, out,
                           *self.geometry, piece=self.piece)
        return out.transpose(0, 3, 1, 2)


# A small 1-D convolution (an audio model's streaming step: a few frames) computed directly:
# conv_nd's padding, patch matrix and BLAS call cost several times its arithmetic there.

def _direct_fits(x, w, group, outs) -> bool:
    """Whether `_DirectRoute` takes this convolution: 1-D, float32, one group, at most
    DIRECT_CONV_MACS multiply-adds, numba."""
    return x.ndim == 3 and x.dtype == np.float32 and group == 1 and w.dtype == np.float32 \
        and x.shape[0] * outs[0] * w.size <= tuning.DIRECT_CONV_MACS \
        and _compiled.jit(_direct_rows) is not None


_DIRECT = Lowering("cpu.direct", "a small 1-D convolution computed directly, the output "
                   "channels the vector lanes: no padding copy, patches or BLAS call")


class _DirectRoute:
    """A small 1-D convolution (`_direct_fits`) worked out once for an input geometry: the
    weights as (C, k, M), each output position's sum over its window's taps inside the input
    (the padding adds nothing), bias and clip; the result channels-last, a (N, M, L) view of
    (N, L, M) memory."""
    lowering = _DIRECT

    def __init__(self, x, w, b, clamp, kernel, strides, dilations, begin, outs, cache):
        N, M = x.shape[0], w.shape[0]
        self.w = _remembered(cache, "direct-taps", lambda: np.ascontiguousarray(
            w.transpose(1, 2, 0)))
        self.b = np.zeros(M, np.float32) if b is None else \
            np.ascontiguousarray(b, np.float32).reshape(M)
        lo, hi = clamp or (-np.inf, np.inf)
        self.geometry = (np.float32(lo), np.float32(hi), strides[0], dilations[0], begin[0])
        self.out_shape = (N, outs[0], M)
        self.bounds = _compiled.row_bounds(N * outs[0], w.size * tuning.DIRECT_NS_PER_MAC)

    def run(self, x):
        out = np.empty(self.out_shape, np.float32)
        _compiled.run_rows(_compiled.jit(_direct_rows), self.bounds, x, self.w, self.b,
                           *self.geometry, out)
        return out.transpose(0, 2, 1)


def _direct_rows(x, w, bias, lo, hi, stride, dilation, pad, out, r0, r1):
    """Rows [r0, r1) (n * Lo + l) of out (N, Lo, M): the sum over channels c and taps j
    inside x (N, C, L) of x[n, c, l * stride + j * dilation - pad] * w[c, j, :], plus the
    bias, clipped to [lo, hi] (a NaN kept), the channels innermost (vectorised)."""
    C, L = x.shape[1], x.shape[2]
    k, M = w.shape[1], w.shape[2]
    Lo = out.shape[1]
    acc = np.empty(M, np.float32)
    for row in range(r0, r1):
        n, l = row // Lo, row % Lo
        acc[:] = 0
        for c in range(C):
            for j in range(k):
                t = l * stride + j * dilation - pad
                if 0 <= t < L:
                    v, taps = x[n, c, t], w[c, j]
                    for m in range(M):
                        acc[m] += v * taps[m]
        o = out[n, l]
        for m in range(M):
            y = acc[m] + bias[m]
            y = lo if y < lo else y
            o[m] = hi if y > hi else y


class RouteMemo:
    """The route a convolution's last call ran, for a next call with the same inputs: the
    same read-only (constant) weight and bias arrays, x and z of the same shape, strides and
    dtype, in a run of as many threads. In a run, a convolution gets such inputs run after
    run, and working its route out again through the op's checks and the weights' cache is
    a noticeable share of a small node's time. Held as one tuple, replaced whole:
    threads sharing a session read either the old memo or the new one."""

    __slots__ = ("_last",)

    def __init__(self):
        self._last = None

    def route(self, x, w, b, z):
        """The remembered route for these inputs, or None."""
        last = self._last
        if last is None or last[1] is not w or last[2] is not b \
                or last[0] != _route_signature(x, z):
            return None
        return last[3]

    def remember(self, x, w, b, z, route) -> None:
        """Remember `route` for inputs like these, where w and b are constants (read-only
        numpy arrays: a writable weight may change between calls)."""
        if all(isinstance(a, np.ndarray) and not a.flags.writeable for a in (w, b)
               if a is not None):
            self._last = (_route_signature(x, z), w, b, route)


def _route_signature(x, z):
    return (x.shape, x.strides, x.dtype, None if z is None else (z.shape, z.strides, z.dtype),
            _compiled.run_threads(), _blas.in_run())


def route_key(x, clamp):
    """Where conv_nd's per-weight cache keeps the route of a convolution of x (and clamp):
    per input geometry, and the run's thread count and board (Conv.route)."""
    return ("conv-route", x.shape, x.strides, x.dtype, clamp, _compiled.run_threads(),
            _blas.in_run())


# The depthwise convolution as explicit vector code (ops/cpu/tiles.py; AVX-512, 3x3 / 5x5 /
# 7x7 windows, a last block of fewer than 16 channels masked): the pixels whose whole window
# lies inside the image, 4 output pixels by 16 channels at a time with the window's weights
# in registers; the border pixels as in `_depthwise_rows`. Outputs are allocated 64-byte aligned: a vector
# load across two cache lines is much slower. Not on AVX2, where LLVM vectorises the numba
# loops below to the same width and the vector code gains nothing.
#
# The inner pixels are taken in bands of output rows whose input rows fill at most
# DEPTHWISE_BAND_BYTES (ops/cpu/tuning.py), each band by every block of channels in turn:
# the band's input stays in cache for the next block, where a block at a time over the whole
# image would read the image from memory again for each block.


def _vector_weights(wt, W, dh, dw, cache):
    """(weights (ceil(C / LANES), T, LANES), zeros past C, and each tap's offset in a (H, W,
    C) image), kept."""
    kh, kw, C = wt.shape

    def make():
        blocks = -(-C // _tiles.LANES)
        whole = np.zeros((kh * kw, blocks * _tiles.LANES), np.float32)
        whole[:, :C] = wt.reshape(kh * kw, C)
        vectors = _tiles.empty((blocks, kh * kw, _tiles.LANES))
        vectors[...] = whole.reshape(kh * kw, blocks, _tiles.LANES).transpose(1, 0, 2)
        taps = (np.arange(kh, dtype=np.int64)[:, None] * (dh * W)
                + np.arange(kw, dtype=np.int64) * dw).reshape(-1) * C
        return vectors, taps
    return _remembered(cache, ("dw-vector", W), make)


@_compiled.kernel_math
def _depthwise_vector_rows(x4, vectors, taps, w3, b, out4, ph, pw, sh, sw, dh, dw, lo, hi,
                           code, p0, p1, row0, row1):  # pragma: no cover
    """As `_depthwise_rows` (rows [row0, row1) of every image), float32, `b` and `vectors`
    in whole vectors of LANES channels: the inner pixels by `_tiles.depthwise_segment`
    (the last block of fewer than LANES channels masked), the border ones by
    `_pixel_by_taps`, then the activation `code` (p0, p1; 0: none) by `epilogue_loops` on
    each band's rows, in cache."""
    N, H, W, C = x4.shape
    kh, kw = w3.shape[0], w3.shape[1]
    Oh, Ow = out4.shape[1], out4.shape[2]
    x, w, out = x4.reshape(-1), w3.reshape(-1), out4.reshape(-1)
    # the output rows and columns whose windows lie inside the image: [lo, hi) each
    top, left = min(Oh, (ph + sh - 1) // sh), min(Ow, (pw + sw - 1) // sw)
    bottom = max(top, min(Oh, (H - 1 - (kh - 1) * dh + ph) // sh + 1))
    right = max(left, min(Ow, (W - 1 - (kw - 1) * dw + pw) // sw + 1))
    band = max(1, DEPTHWISE_BAND_BYTES // (sh * W * C * x4.itemsize))  # output rows
    no_bias, no_residual = np.empty(0, np.float32), np.empty((0, 0), np.float32)
    for n in range(N):
        for r0 in range(row0, row1, band):
            r1 = min(row1, r0 + band)
            for oh in range(r0, r1):
                inner = top <= oh < bottom
                for ow in range(Ow):
                    if inner and left <= ow < right:
                        continue
                    o = np.uint64(((n * Oh + oh) * Ow + ow) * C)
                    _pixel_by_taps(x, w, b, out, o, n, oh * sh - ph, ow * sw - pw, dh, dw, lo,
                                   hi, x4.shape, kh, kw)
            a, z = max(r0, top), min(r1, bottom)
            if right > left and z > a:
                for block in range(vectors.shape[0]):
                    c0 = block * _tiles.LANES
                    _tiles.depthwise_segment(
                        kh * kw, x, ((n * H + a * sh - ph) * W + left * sw - pw) * C + c0,
                        sw * C, taps, vectors[block], b[c0:c0 + _tiles.LANES], lo, hi, out,
                        ((n * Oh + a) * Ow + left) * C + c0, C, right - left, z - a,
                        sh * W * C, Ow * C, min(_tiles.LANES, C - c0))
            if code:
                epilogue_loops(out4[n, r0:r1].reshape((r1 - r0) * Ow, C), no_bias, False,
                               no_residual, code, p0, p1, 0, (r1 - r0) * Ow)


def _depthwise_vector_piece(block, row0, row1):  # pragma: no cover
    """_depthwise_vector_rows' piece function (ops/cpu/compiled.py: the helpers run its pieces
    without Python), its arguments from the block `split_rows` made."""
    v = _compiled.array_at(block, (33,), np.int64)
    f = _compiled.array_at(block, (33,), np.float64)
    _depthwise_vector_rows(
        _compiled.array_at(v[0], (v[1], v[2], v[3], v[4]), np.float32),
        _compiled.array_at(v[5], (v[6], v[7], v[8]), np.float32),
        _compiled.array_at(v[9], (v[10],), np.int64),
        _compiled.array_at(v[11], (v[12], v[13], v[14]), np.float32),
        _compiled.array_at(v[15], (v[16],), np.float32),
        _compiled.array_at(v[17], (v[18], v[19], v[20], v[21]), np.float32),
        v[22], v[23], v[24], v[25], v[26], v[27], np.float32(f[28]), np.float32(f[29]),
        v[30], np.float32(f[31]), np.float32(f[32]), row0, row1)


# --- optional compiled depthwise kernels (numba: ops/cpu/compiled.py), one for 3x3 windows and
# one for any other: the einsum kernel above stays the fallback and the reference. The
# output rows are split among the run's threads.


def _numba_depthwise3x3():
    """The compiled 3x3 kernel (x, w, b, out, ph, pw, sh, sw, dh, dw, lo, hi, row0, row1),
    or None."""
    return _compiled.jit(_depthwise3x3_rows, fastmath={"contract"})


def _numba_depthwise():
    """The compiled kernel for any window (arguments as above), or None."""
    return _compiled.jit(_depthwise_rows, fastmath={"contract"})


# The depthwise kernels' piece functions (ops/cpu/compiled.py: the helpers run their pieces
# without Python), one per kernel and dtype; `_depthwise_arguments` rebuilds the arguments.
@_compiled.kernel_math
def _depthwise_arguments(block, dtype):  # pragma: no cover
    """(x, w, b, out, ph, pw, sh, sw, dh, dw, lo, hi) from the block `split_rows` made."""
    v = _compiled.array_at(block, (24,), np.int64)
    f = _compiled.array_at(block, (24,), np.float64)
    return (_compiled.array_at(v[0], (v[1], v[2], v[3], v[4]), dtype),
            _compiled.array_at(v[5], (v[6], v[7], v[8]), dtype),
            _compiled.array_at(v[9], (v[10],), dtype),
            _compiled.array_at(v[11], (v[12], v[13], v[14], v[15]), dtype),
            v[16], v[17], v[18], v[19], v[20], v[21], dtype(f[22]), dtype(f[23]))


def _depthwise3x3_piece32(block, row0, row1):  # pragma: no cover
    _depthwise3x3_rows(*_depthwise_arguments(block, np.float32), row0, row1)


def _depthwise3x3_piece64(block, row0, row1):  # pragma: no cover
    _depthwise3x3_rows(*_depthwise_arguments(block, np.float64), row0, row1)


def _depthwise_piece32(block, row0, row1):  # pragma: no cover
    _depthwise_rows(*_depthwise_arguments(block, np.float32), row0, row1)


def _depthwise_piece64(block, row0, row1):  # pragma: no cover
    _depthwise_rows(*_depthwise_arguments(block, np.float64), row0, row1)


_DEPTHWISE_PIECES = {(True, True): _depthwise3x3_piece32, (True, False): _depthwise3x3_piece64,
                     (False, True): _depthwise_piece32, (False, False): _depthwise_piece64}


@_compiled.kernel_math
def window3x3_offsets(shape, n, r0, q0, dh, dw):
    """The flat offsets in an image (N, H, W, C) = `shape` of a 3x3 window's nine taps, by
    rows (a: row 0, m: row 1, z: row 2) and columns 0-2, for the window at row r0, column
    q0 of image n, wholly inside it; unsigned, so that no negative-index wraparound hides
    the contiguous loads from LLVM."""
    N, H, W, C = shape
    a0 = np.uint64(((n * H + r0) * W + q0) * C)
    m0 = a0 + np.uint64(dh * W * C)
    z0 = m0 + np.uint64(dh * W * C)
    step = np.uint64(dw * C)                      # to the next column tap
    a1, m1, z1 = a0 + step, m0 + step, z0 + step
    return a0, a1, a1 + step, m0, m1, m1 + step, z0, z1, z1 + step


@_compiled.kernel_math(fastmath={"contract"})
def _depthwise3x3_rows(x4, w3, b, out4, ph, pw, sh, sw, dh, dw, lo, hi,
                       row0, row1):  # pragma: no cover
    """Output rows [row0, row1): out[n, oh, ow, c] = (sum over taps of x[n, r, q, c] *
    w[i, j, c]) + b[c], clamped to [lo, hi], channels last (x (N, H, W, C), w (3, 3, C), out
    (N, Oh, Ow, C)), r = oh*sh - ph + i*dh and q = ow*sw - pw + j*dw, taps outside x skipped.
    Pixels whose nine taps all lie inside x sum them in one expression over flat offsets
    (the channel loop vectorises and the sums stay in registers: with 19 separate row views
    LLVM gives up on the aliasing checks and the loop runs scalar; offsets are unsigned so
    that no negative-index wraparound hides the contiguous loads); the border pixels add
    their valid taps one at a time."""
    N, H, W, C = x4.shape
    Oh, Ow = out4.shape[1], out4.shape[2]
    x, w, out = x4.reshape(-1), w3.reshape(-1), out4.reshape(-1)
    uC = np.uint64(C)
    for n in range(N):
        for oh in range(row0, row1):
            r0 = oh * sh - ph
            for ow in range(Ow):
                q0 = ow * sw - pw
                o = np.uint64(((n * Oh + oh) * Ow + ow) * C)
                if r0 >= 0 and r0 + 2 * dh < H and q0 >= 0 and q0 + 2 * dw < W:
                    a0, a1, a2, m0, m1, m2, z0, z1, z2 = window3x3_offsets(
                        x4.shape, n, r0, q0, dh, dw)
                    for c in range(uC):
                        v = (x[a0 + c] * w[c] + x[a1 + c] * w[uC + c]
                             + x[a2 + c] * w[2 * uC + c] + x[m0 + c] * w[3 * uC + c]
                             + x[m1 + c] * w[4 * uC + c] + x[m2 + c] * w[5 * uC + c]
                             + x[z0 + c] * w[6 * uC + c] + x[z1 + c] * w[7 * uC + c]
                             + x[z2 + c] * w[8 * uC + c]) + b[c]
                        v = lo if v < lo else v
                        out[o + c] = hi if v > hi else v
                    continue
                _pixel_by_taps(x, w, b, out, o, n, r0, q0, dh, dw, lo, hi, x4.shape, 3, 3)


@_compiled.kernel_math
def _pixel_by_taps(x, w, b, out, o, n, r0, q0, dh, dw, lo, hi, shape, kh, kw):  # pragma: no cover
    """One output pixel of a depthwise kernel, at flat offset o of out: its taps inside the
    image (N, H, W, C) = `shape` added one at a time (x, w, out flat, as in
    `_depthwise3x3_rows`), then the bias and the clamp."""
    N, H, W, C = shape
    uC = np.uint64(C)
    for c in range(uC):
        out[o + c] = 0
    for i in range(kh):
        r = r0 + i * dh
        if r < 0 or r >= H:
            continue
        for j in range(kw):
            q = q0 + j * dw
            if q < 0 or q >= W:
                continue
            at = np.uint64(((n * H + r) * W + q) * C)
            tap = np.uint64((i * kw + j) * C)
            for c in range(uC):
                out[o + c] += x[at + c] * w[tap + c]
    for c in range(uC):
        v = out[o + c] + b[c]
        v = lo if v < lo else v
        out[o + c] = hi if v > hi else v


@_compiled.kernel_math(fastmath={"contract"})
def _depthwise_rows(x4, w3, b, out4, ph, pw, sh, sw, dh, dw, lo, hi,
                    row0, row1):  # pragma: no cover
    """As `_depthwise3x3_rows`, for any kh x kw window (w (kh, kw, C)). A pixel whose window
    lies inside x, with 5 or 7 taps a row (EfficientNet's 5x5, ConvNeXt's 7x7), adds one
    row of taps at a time, each row one expression over flat offsets (its sum in registers,
    faster than a tap at a time); the other pixels take their valid taps one at a time.
    Then the bias and the clamp."""
    N, H, W, C = x4.shape
    kh, kw = w3.shape[0], w3.shape[1]
    Oh, Ow = out4.shape[1], out4.shape[2]
    x, w, out = x4.reshape(-1), w3.reshape(-1), out4.reshape(-1)
    uC = np.uint64(C)
    rows_of_taps = kw == 5 or kw == 7
    for n in range(N):
        for oh in range(row0, row1):
            r0 = oh * sh - ph
            rows_inside = r0 >= 0 and r0 + (kh - 1) * dh < H
            for ow in range(Ow):
                q0 = ow * sw - pw
                o = np.uint64(((n * Oh + oh) * Ow + ow) * C)
                if not (rows_of_taps and rows_inside and q0 >= 0 and q0 + (kw - 1) * dw < W):
                    _pixel_by_taps(x, w, b, out, o, n, r0, q0, dh, dw, lo, hi, x4.shape, kh,
                                   kw)
                    continue
                step = np.uint64(dw * C)                  # to the next column tap
                for c in range(uC):
                    out[o + c] = 0
                for i in range(kh):
                    a0 = np.uint64(((n * H + r0 + i * dh) * W + q0) * C)
                    a1, t0 = a0 + step, np.uint64(i * kw * C)
                    a2, t1 = a1 + step, t0 + uC
                    a3, t2 = a2 + step, t1 + uC
                    a4, t3 = a3 + step, t2 + uC
                    t4 = t3 + uC
                    if kw == 5:
                        for c in range(uC):
                            out[o + c] += (x[a0 + c] * w[t0 + c] + x[a1 + c] * w[t1 + c]
                                           + x[a2 + c] * w[t2 + c] + x[a3 + c] * w[t3 + c]
                                           + x[a4 + c] * w[t4 + c])
                    else:
                        a5, t5 = a4 + step, t4 + uC
                        a6, t6 = a5 + step, t5 + uC
                        for c in range(uC):
                            out[o + c] += (x[a0 + c] * w[t0 + c] + x[a1 + c] * w[t1 + c]
                                           + x[a2 + c] * w[t2 + c] + x[a3 + c] * w[t3 + c]
                                           + x[a4 + c] * w[t4 + c] + x[a5 + c] * w[t5 + c]
                                           + x[a6 + c] * w[t6 + c])
                for c in range(uC):
                    v = out[o + c] + b[c]
                    v = lo if v < lo else v
                    out[o + c] = hi if v > hi else v


def pointwise_cl_fits(xp, x, w, group, kernel, begin, end) -> bool:
    """Whether conv_nd runs this convolution as `_pointwise_cl` (a 1x1 convolution of a
    channels-last x: one product, (pixels, C) @ pointwise_weights)."""
    return (xp is np and math.prod(kernel) == 1 and not any(begin) and not any(end)
            and channels_last(x) and not _depthwise_fast(x, w, group, kernel, begin, end)
            and not _tiled_fits(x, w, group, begin, end)
            and not _grouped_fits(x, w, group, begin, end))


def pointwise_weights(w, cache):
    """A 1x1 convolution's weights (M, C, 1, ...) as the C-ordered (C, M) matrix
    `_pointwise_cl` multiplies by (kept in conv_nd's per-weight `cache`)."""
    M = w.shape[0]
    return _remembered(cache, "pw-cl", lambda: np.ascontiguousarray(w.reshape(M, -1).T))


def _pointwise_cl(x, w, group, strides, outs, bias, cache):
    """1x1 convolution of a channels-last x, returned channels-last."""
    N, C = x.shape[:2]
    M = w.shape[0]
    if any(s != 1 for s in strides):
        x = x[(slice(None), slice(None)) + tuple(slice(0, (o - 1) * s + 1, s)
                                                for o, s in zip(outs, strides))]
    xt = x.transpose(0, *range(2, x.ndim), 1)          # (N, *outs, C), a view
    L = N * math.prod(outs)
    if group == 1 and bias is not None and C < M:
        # fewer inputs than outputs: the bias rides along as an extra weight row matched by a
        # column of ones (a copy of the smaller input instead of a pass over the output)
        def make():
            wa = np.empty((C + 1, M), x.dtype)
            wa[:C] = w.reshape(M, C).T
            wa[C] = bias
            return wa
        wa = _remembered(cache, "pw-cl-aug", make)
        xa = np.empty((L, C + 1), x.dtype)
        xa[:, :C].reshape(xt.shape)[...] = xt
        xa[:, C] = 1
        out = _blas.matmul(xa, wa, out=_tiles.empty((L, M), x.dtype))
        return out.reshape(N, *outs, M).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))
    if group == 1:
        # the weights as a C-ordered (C, M) matrix: BLAS runs short products (7x7, 14x14
        # images) faster from it than from the transposed view of w (M, C)
        wt = pointwise_weights(w, cache)
        # aligned to a cache line for the vector kernels that read it (a depthwise one next)
        out = _blas.matmul(xt.reshape(L, C), wt, out=_tiles.empty((L, M), x.dtype))
    else:
        Cg, Mg = C // group, M // group
        xg = xt.reshape(L, group, Cg).transpose(1, 0, 2)          # (G, L, Cg)
        wg = w.reshape(group, Mg, Cg).transpose(0, 2, 1)          # (G, Cg, Mg)
        # (G, L, Mg) from BLAS, then one copy into the channels-last (L, G*Mg) layout (a
        # transposed `out=` would send matmul to its loops without BLAS)
        out = np.ascontiguousarray(_blas.matmul(xg, wg).transpose(1, 0, 2)).reshape(L, M)
    if bias is not None:
        out += bias
    return out.reshape(N, *outs, M).transpose(0, x.ndim - 1, *range(1, x.ndim - 1))


# A 2-D convolution (group 1, float32) as register tiles over a channels-last padded image
# (ops/cpu/tiles.py): no patch matrix, the bias and a clip (ReLU, ReLU6) in the tiles' own
# stores, the result channels-last. With numba on an AVX-512 CPU it runs every such
# convolution with a window larger than 1x1 and no negative pads (AVX2: see below), faster
# than BLAS on patch rows and than the shifted GEMMs below. Elsewhere the kernels below
# serve. In runs, a 1x1 convolution of a channels-last image takes the tiles as a
# route of its own, its residual and activation in its pieces (_epilogue.TilesPointwiseRoute);
# conv_nd's path takes them for 1x1 ones only where `_pointwise_tiles_fit` says.
#
# On AVX2 the tiles are 6 pixels by 16 channels and serve sums of at most NARROW_TILES_MAX_K
# terms (taps x input channels): with longer sums each tile reads more of the weights again,
# and OpenBLAS on the patch matrix is faster.


def _tiled_fits(x, w, group, begin, end):
    # (fewer output channels than TILES_MIN_OUTPUTS, an RGB image or a mask out, leave most
    # of each tile's block of BLOCK channels unused: conv_nd's GEMMs are faster)
    return (x.ndim == 4 and group == 1 and x.dtype == np.float32
            and w.shape[0] >= tuning.TILES_MIN_OUTPUTS
            and (w.shape[2] * w.shape[3] > 1 or _pointwise_tiles_fit(x, w))
            and (_tiles.WIDE or w.shape[1] * w.shape[2] * w.shape[3]
                 <= tuning.NARROW_TILES_MAX_K)
            and min(begin) >= 0 and min(end) >= 0 and _tiles.kernel() is not None)


# conv_nd's 1x1 convolutions of one image (outside runs; in runs, see above) run as tiles
# where the product is large and the input channels many (POINTWISE_TILE_CHANNELS,
# POINTWISE_TILE_MIN_MACS): the tiles read weights packed once, where OpenBLAS packs them
# again on every call. Fewer channels, smaller products and batches stay with BLAS, whose
# blocking wins there; AVX-512 only, as AVX2's tiles lose to OpenBLAS on 1x1 convolutions.


def _pointwise_tiles_fit(x, w):
    lo, hi = tuning.POINTWISE_TILE_CHANNELS
    C, M = x.shape[1], w.shape[0]
    return (_tiles.WIDE and x.shape[0] == 1 and w.shape[2] * w.shape[3] == 1 and lo <= C < hi
            and x.shape[2] * x.shape[3] * C * M >= tuning.POINTWISE_TILE_MIN_MACS)


def _strided_pointwise_fits(x, w, group, strides, begin, end):
    """Whether a strided 1x1 convolution (a downsampling shortcut) runs as `_TiledRoute`:
    the tiles read every stride-th pixel where it lies, where the product needs a strided
    copy of the input first. As the 1x1 tiles in runs: AVX-512 (tiles_pointwise_size)."""
    return (x.ndim == 4 and group == 1 and x.dtype == np.float32
            and w.shape[2] * w.shape[3] == 1 and any(s > 1 for s in strides)
            and w.shape[0] >= tuning.TILES_MIN_OUTPUTS and min(begin) >= 0 and min(end) >= 0 and _tiles.WIDE
            and _tiles.kernel() is not None)


def _conv_tiled(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp):
    """Conv of x (N, C, H, W) by w (M, C, kh, kw), float32, by `_tiles`; returns the
    channels-last (N, M, Ho, Wo) view."""
    return _TiledRoute(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp,
                       keep_image=False).run(x)


class _TiledRoute:
    """A convolution by the tiles (`_tiled_fits`) worked out once for an input geometry
    (Conv.route): the packed weights, the tiles' offsets, the padded image's geometry, and
    the image itself kept between calls (at most KEEP_IMAGE_BYTES, ops/cpu/tuning.py; one per
    thread running the route at once). A call copies its input into the image and runs the
    tiles: a kept image's border, zeroed once, stays zero, where zeroing it (a value at each
    end of every row, each in a cache line of its own) and allocating it cost every call."""
    lowering = Lowering("cpu.tiles", "register tiles over the padded channels-last image: no "
                        "patch matrix, the weights packed once")

    def __init__(self, x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp,
                 keep_image=True):
        N, C, H, W = x.shape
        M = w.shape[0]
        (kh, kw), (sh, sw), (dh, dw), (Ho, Wo) = kernel, strides, dilations, outs
        # tall and wide enough for every window (the padding, and what ceil-like sizes reach)
        Hp = max(begin[0] + H, (Ho - 1) * sh + (kh - 1) * dh + 1)
        Wp = max(begin[1] + W, (Wo - 1) * sw + (kw - 1) * dw + 1)
        self.planar = planar = C <= _IMAGE_CHANNELS and dw == 1
        if planar:
            # An image (RGB, gray) is read in its planes: a tap is one window row of one
            # channel, kw contiguous values; padding copies whole rows. Made channels-last, its
            # 3 values a pixel would be written one by one
            self.packed, self.packed_bias = _remembered(
                cache, "tiles-planar",
                lambda: _tiles.pack(np.ascontiguousarray(w.reshape(M, C * kh * kw).T), bias))
            self.image_shape = (N, C, Hp, Wp)
            run, plane, channel_step = kw, C * Hp * Wp, 1
        else:
            self.packed, self.packed_bias = _remembered(cache, "tiles", lambda: _tiles.pack(
                _taps_last(w, None).reshape(kh * kw * C, M), bias))
            self.image_shape = (N, Hp, Wp, C)
            # Undilated, a window row's kw taps are kw * C contiguous values of the image, in
            # the packed weights' order: one tap of kw * C channels each (an image's 3
            # channels make runs of 21 values for a 7x7 window, not 7 runs of 3)
            run, plane, channel_step = (kw * C if dw == 1 else C), Hp * Wp * C, C

        def offsets():
            rows = np.arange(Ho, dtype=np.int64) * (sh * Wp)
            pixels = (rows[:, None] + np.arange(Wo, dtype=np.int64) * sw).reshape(-1)
            window_rows = np.arange(kh, dtype=np.int64) * (dh * Wp)
            if planar:  # (channel, window row)
                taps = np.arange(C, dtype=np.int64)[:, None] * (Hp * Wp) + window_rows
            else:       # (window row, column), channels-last
                columns = np.arange(kw if dw != 1 else 1, dtype=np.int64) * dw
                taps = (window_rows[:, None] + columns) * C
            return pixels * channel_step, taps.reshape(-1)
        self.pixels, self.taps = _remembered(cache, ("tile-offsets", planar, Hp, Wp, C, Ho, Wo),
                                             offsets)
        self.run_length, self.plane = run, plane
        self.begin, self.size, self.out_shape = begin, (H, W), (N, Ho, Wo, M)
        self.clamp = clamp
        self.cut = _tiles.cut(N, Ho * Wo, plane, run, sh * sw, self.packed, 4 * N * Ho * Wo * M)
        self.padded = (Hp, Wp) != (H, W)
        self.keep_image = keep_image and (4 * math.prod(self.image_shape)
                                          <= tuning.KEEP_IMAGE_BYTES)
        self.images: list[np.ndarray] = []   # kept padded images not in use
        # the input's rows as _pad_rows copies them into the image: (row length, the image's
        # row and plane lengths, the first row's start), and the rows' cut
        if planar:   # rows of W values, H of them a channel's plane
            self.pad_rows = (W, Wp, Hp * Wp, begin[0] * Wp + begin[1])
        else:        # rows of W * C values, H of them an image
            self.pad_rows = (W * C, Wp * C, Hp * Wp * C, (begin[0] * Wp + begin[1]) * C)
        self.pad_bounds = _compiled.row_bounds(N * C * H if planar else N * H,
                                               self.pad_rows[0] * tuning.PAD_NS_PER_VALUE)

    def run(self, x):
        layout = x if self.planar else x.transpose(0, 2, 3, 1)
        if not self.padded and layout.flags.c_contiguous:
            image = None   # x is the image: read where it lies
        else:
            image = self._padded(layout)
        out = _tiles.empty(self.out_shape)
        N, Ho, Wo, M = self.out_shape
        _tiles.run(_tiles.kernel(), (layout if image is None else image).reshape(-1),
                   self.plane, self.pixels, self.taps, self.run_length, self.packed,
                   self.packed_bias, self.clamp, out.reshape(N * Ho * Wo, M), N, *self.cut)
        if image is not None and self.keep_image:
            self.images.append(image)
        return out.transpose(0, 3, 1, 2)

    def _padded(self, layout):
        """The padded image of x (`layout`: x in the image's layout), a kept one if there is
        one free (its border is zero), else a new one."""
        try:
            image = self.images.pop()   # atomic: threads sharing the route take one each
        except IndexError:
            image = _tiles.empty(self.image_shape)
            if self.planar:
                image = _zero_border(image[..., None], self.begin, self.size)[..., 0]
            else:
                image = _zero_border(image, self.begin, self.size)
        (top, left), (H, W) = self.begin, self.size
        copy = _compiled.jit(_pad_rows)
        if copy is None or not layout.flags.c_contiguous:
            if self.planar:
                image[:, :, top:top + H, left:left + W] = layout
            else:
                image[:, top:top + H, left:left + W] = layout
            return image
        # the input's rows copied in on the run's threads, each the rows its core wrote
        length, row, plane, first = self.pad_rows
        _compiled.run_rows(copy, self.pad_bounds, layout.reshape(-1), image.reshape(-1), H,
                           length, plane, row, first, piece=_pad_rows_piece)
        return image


@_compiled.kernel_math
def _pad_rows(src, image, height, length, plane, row, first, row0, row1):  # pragma: no cover
    """Rows [row0, row1) of src (rows of `length` values, `height` of them a plane: an
    image's, or a channel's) into the padded image: src's row i at plane i // height, row
    i % height, its first value at `first` from the plane's start."""
    for i in range(row0, row1):
        at = first + (i // height) * plane + (i % height) * row
        image[at:at + length] = src[i * length:(i + 1) * length]


def _pad_rows_piece(block, row0, row1):  # pragma: no cover
    """_pad_rows' piece function (ops/cpu/compiled.py), its arguments from the block."""
    v = _compiled.array_at(block, (9,), np.int64)
    _pad_rows(_compiled.array_at(v[0], (v[1],), np.float32),
              _compiled.array_at(v[2], (v[3],), np.float32), v[4], v[5], v[6], v[7], v[8],
              row0, row1)


# A grouped 2-D convolution (RegNet's, ResNeXt's: groups of GROUPED_MIN_WIDTH output channels
# or more, float32) as the same register tiles, a run of them per span of neighbouring groups
# that fill one block of BLOCK output channels: the span's weights are block-diagonal (zero
# between groups), and its tiles read only the span's input channels, a contiguous run of
# each pixel's channels in the channels-last padded image. Narrow groups thus cost up to
# BLOCK / width times the multiply-adds, still far faster than im2col and one small GEMM
# per group, whose products (8 output channels) BLAS runs well below its peak.


def _grouped_fits(x, w, group, begin, end):
    """Whether `_GroupedRoute` runs this convolution: 2-D float32, several groups of at least
    GROUPED_MIN_WIDTH output channels (not depthwise), no negative pads, the tiles compiled,
    and on AVX2 sums a block's tiles run well (NARROW_TILES_MAX_K)."""
    if not (x.ndim == 4 and group > 1 and x.dtype == np.float32
            and w.shape[0] // group >= tuning.GROUPED_MIN_WIDTH
            and min(begin) >= 0 and min(end) >= 0):
        return False
    Mg, Cg = w.shape[0] // group, w.shape[1]
    span_channels = Cg * max(1, min(group, _tiles.BLOCK // Mg))
    return ((_tiles.WIDE or w.shape[2] * w.shape[3] * span_channels <= tuning.NARROW_TILES_MAX_K)
            and _tiles.kernel() is not None)


class _GroupedRoute(_TiledRoute):
    """A grouped convolution (`_grouped_fits`) by the tiles, worked out once for an input
    geometry (Conv.route): per span of groups its packed block-diagonal weights and bias; the
    padded image and its copy as `_TiledRoute`'s (kept between calls likewise). Each span's
    tiles write a (pixels, span's channels) block, copied into the channels-last result."""
    lowering = Lowering("cpu.tiles-grouped", "groups as register tiles over the padded "
                        "channels-last image, a block of neighbouring groups at a time with "
                        "block-diagonal weights")

    def __init__(self, x, w, group, kernel, strides, dilations, begin, outs, bias, cache, clamp,
                 keep_image=True):
        N, C, H, W = x.shape
        M = w.shape[0]
        Cg, Mg = C // group, M // group
        (kh, kw), (sh, sw), (dh, dw), (Ho, Wo) = kernel, strides, dilations, outs
        Hp = max(begin[0] + H, (Ho - 1) * sh + (kh - 1) * dh + 1)
        Wp = max(begin[1] + W, (Wo - 1) * sw + (kw - 1) * dw + 1)
        per = max(1, min(group, _tiles.BLOCK // Mg))   # groups a span
        self.spans = []
        for g0 in range(0, group, per):
            g1 = min(group, g0 + per)

            def packed(g0=g0, g1=g1):
                # (kh, kw, span's inputs, span's outputs), zero where a group's inputs do
                # not reach another group's outputs
                dense = np.zeros((kh, kw, (g1 - g0) * Cg, (g1 - g0) * Mg), np.float32)
                for g in range(g0, g1):
                    i, o = (g - g0) * Cg, (g - g0) * Mg
                    dense[:, :, i:i + Cg, o:o + Mg] = \
                        w[g * Mg:(g + 1) * Mg].transpose(2, 3, 1, 0)
                return _tiles.pack(dense.reshape(kh * kw * (g1 - g0) * Cg, -1),
                                   None if bias is None else bias[g0 * Mg:g1 * Mg])
            weights, span_bias = _remembered(cache, ("tiles-grouped", g0, g1), packed)
            cut = _tiles.cut(N, Ho * Wo, Hp * Wp * C, (g1 - g0) * Cg, sh * sw, weights,
                             4 * N * Ho * Wo * (g1 - g0) * Mg)
            self.spans.append((g0 * Cg, (g1 - g0) * Cg, g0 * Mg, g1 * Mg, weights, span_bias,
                               cut))

        def offsets():
            rows = np.arange(Ho, dtype=np.int64) * (sh * Wp)
            pixels = (rows[:, None] + np.arange(Wo, dtype=np.int64) * sw).reshape(-1)
            taps = (np.arange(kh, dtype=np.int64)[:, None] * (dh * Wp)
                    + np.arange(kw, dtype=np.int64) * dw)
            return pixels * C, taps.reshape(-1) * C
        self.pixels, self.taps = _remembered(cache, ("grouped-offsets", Hp, Wp, C, Ho, Wo),
                                             offsets)
        self.planar, self.plane = False, Hp * Wp * C
        self.begin, self.size, self.out_shape = begin, (H, W), (N, Ho, Wo, M)
        self.image_shape = (N, Hp, Wp, C)
        self.clamp = clamp
        self.padded = (Hp, Wp) != (H, W)
        self.keep_image = keep_image and 4 * math.prod(self.image_shape) <= tuning.KEEP_IMAGE_BYTES
        self.images: list[np.ndarray] = []
        self.pad_rows = (W * C, Wp * C, Hp * Wp * C, (begin[0] * Wp + begin[1]) * C)
        self.pad_bounds = _compiled.row_bounds(N * H, self.pad_rows[0] * tuning.PAD_NS_PER_VALUE)

    def run(self, x):
        layout = x.transpose(0, 2, 3, 1)
        if not self.padded and layout.flags.c_contiguous:
            image = None   # x is the image: read where it lies
        else:
            image = self._padded(layout)
        flat = (layout if image is None else image).reshape(-1)
        N, Ho, Wo, M = self.out_shape
        out = _tiles.empty((N * Ho * Wo, M))
        whole = len(self.spans) == 1
        for c0, channels, m0, m1, weights, span_bias, cut in self.spans:
            # the span's input channels start c0 values into each pixel
            target = out if whole else _tiles.empty((N * Ho * Wo, m1 - m0))
            _tiles.run(_tiles.kernel(), flat[c0:], self.plane, self.pixels, self.taps,
                       channels, weights, span_bias, self.clamp, target, N, *cut)
            if not whole:
                out[:, m0:m1] = target
        if image is not None and self.keep_image:
            self.images.append(image)
        return out.reshape(N, Ho, Wo, M).transpose(0, 3, 1, 2)


# A 2-D stride-1 convolution over a channels-last padded image P (Hp, Wp, C) is, with the
# output computed at every padded column (Ho x Wp pixels, the last Wp - Wo of each row thrown
# away), a sum over taps (i, j) of P's rows [i*Wp + j, i*Wp + j + Ho*Wp) as a (Ho*Wp, C)
# matrix, a contiguous slice of P, times the tap's (C, M) weights. So no patch matrix is
# built: im2col writes and reads C*kh*kw values per pixel, this reads the image kh*kw times
# from cache. It beats im2col on large images (SHIFTED_MIN_PIXELS) with a middling number of
# channels (SHIFTED_CHANNELS): with more, im2col's one large GEMM wins; with fewer, K = C is
# too short for BLAS. The taps accumulate over chunks of SHIFTED_CHUNK output pixels, a whole
# 128x128 image: smaller chunks mean more BLAS calls, each starting and stopping the threads.


def _shifted_fits(x, group, kernel, strides, dilations, begin, end, outs):
    lo, hi = tuning.SHIFTED_CHANNELS
    return (x.ndim == 4 and group == 1 and lo <= x.shape[1] <= hi and math.prod(kernel) > 1
            and all(s == 1 for s in strides) and all(d == 1 for d in dilations)
            and min(begin) >= 0 and min(end) >= 0
            and math.prod(outs) >= tuning.SHIFTED_MIN_PIXELS
            and x.dtype in (np.float32, np.float64))


def _conv_shifted(x, w, kernel, begin, end, outs, bias, cache):
    """Conv of x (N, C, H, W) by w (M, C, kh, kw), stride 1, as one GEMM per tap (see
    above); returns the channels-last (N, M, Ho, Wo) view that the channels-last kernels
    and the fused epilogue take as it is."""
    N, C, H, W = x.shape
    M = w.shape[0]
    (kh, kw), (Ho, Wo) = kernel, outs
    Hp, Wp = Ho + kh - 1, Wo + kw - 1
    taps = _taps_last(w, cache).reshape(kh * kw, C, M)
    offsets = [i * Wp + j for i in range(kh) for j in range(kw)]
    rows = Ho * Wp
    # the padded image, plus kw - 1 zero rows that the last tap reads past its end
    padded = np.zeros((Hp * Wp + kw - 1, C), x.dtype)
    image = padded[:Hp * Wp].reshape(Hp, Wp, C)
    out = np.empty((N, Ho, Wp, M), x.dtype)
    partial = np.empty((min(tuning.SHIFTED_CHUNK, rows), M), x.dtype)
    for n in range(N):
        image[begin[0]:begin[0] + H, begin[1]:begin[1] + W] = x[n].transpose(1, 2, 0)
        flat_out = out[n].reshape(rows, M)
        for r0 in range(0, rows, tuning.SHIFTED_CHUNK):
            r1 = min(rows, r0 + tuning.SHIFTED_CHUNK)
            acc, tmp = flat_out[r0:r1], partial[:r1 - r0]
            _blas.matmul(padded[r0:r1], taps[0], out=acc)
            for tap in range(1, len(offsets)):
                off = offsets[tap]
                _blas.matmul(padded[r0 + off:r1 + off], taps[tap], out=tmp)
                acc += tmp
            if bias is not None:
                acc += bias
    dense = np.ascontiguousarray(out[:, :, :Wo]) if Wp != Wo else out
    return dense.transpose(0, 3, 1, 2)


# A 2-D convolution over channels-last patch rows: each output pixel's row holds its window
# (kh, kw, C) as C-long contiguous runs copied from a channels-last padded image, and one
# GEMM (pixels, kh*kw*C) x (kh*kw*C, M) writes the channels-last result. The channels-first
# patch matrix (kh*kw*C, pixels) is copied one pixel at a time along each row, slower even
# counting this one's transposing copy of a channels-first input; with few channels
# (PATCH_ROWS_MIN_CHANNELS) the runs are too short, so the patch matrix keeps those (an
# image's 3 channels).


def _patch_rows_fit(x, group, begin, end):
    return (x.ndim == 4 and group == 1 and x.shape[1] >= tuning.PATCH_ROWS_MIN_CHANNELS
            and min(begin) >= 0 and min(end) >= 0 and x.dtype in (np.float32, np.float64))


def _conv_patch_rows(x, w, kernel, strides, dilations, begin, outs, bias, cache):
    """Conv of x (N, C, H, W) by w (M, C, kh, kw) over patch rows (see above); returns the
    channels-last (N, M, Ho, Wo) view."""
    N, C, H, W = x.shape
    M = w.shape[0]
    (kh, kw), (sh, sw), (dh, dw), (Ho, Wo) = kernel, strides, dilations, outs
    taps = _taps_last(w, cache).reshape(kh * kw * C, M)
    # tall and wide enough for every window (the padding, and what ceil-like sizes reach)
    Hp = max(begin[0] + H, (Ho - 1) * sh + (kh - 1) * dh + 1)
    Wp = max(begin[1] + W, (Wo - 1) * sw + (kw - 1) * dw + 1)
    padded = _zero_border(np.empty((Hp, Wp, C), x.dtype), begin, (H, W))
    st = padded.strides
    windows = np.lib.stride_tricks.as_strided(
        padded, (Ho, Wo, kh, kw, C), (st[0] * sh, st[1] * sw, st[0] * dh, st[1] * dw, st[2]),
        writeable=False)
    rows = np.empty((Ho, Wo, kh, kw, C), x.dtype)
    out = np.empty((N, Ho, Wo, M), x.dtype)
    for n in range(N):
        padded[begin[0]:begin[0] + H, begin[1]:begin[1] + W] = x[n].transpose(1, 2, 0)
        np.copyto(rows, windows)
        _blas.matmul(rows.reshape(Ho * Wo, -1), taps, out=out[n].reshape(Ho * Wo, M))
    if bias is not None:
        out += bias
    return out.transpose(0, 3, 1, 2)


def _zero_border(padded, begin, size):
    """`padded` (..., Hp, Wp, C) with zeros around the (H, W) interior at `begin`, which the
    caller fills (zeroing all of it is a measurable share of a CNN's run)."""
    (top, left), (H, W) = begin, size
    padded[..., :top, :, :] = 0
    padded[..., top + H:, :, :] = 0
    padded[..., top:top + H, :left, :] = 0
    padded[..., top:top + H, left + W:, :] = 0
    return padded


def _fill_cols(xp, cols, win, ones_row):
    """Copy the window view (N, G, Cg, *kernel, *outs) into the patch matrix (N, G, rows, L),
    with a last row of ones when `ones_row` (for the bias folded into the weights)."""
    N, G = cols.shape[:2]
    ck = cols.shape[2] - ones_row
    xp.copyto(cols[:, :, :ck].reshape(win.shape), win)
    if ones_row:
        cols[:, :, ck] = 1


def col2im_nd(xp, cols, out_sp, kernel, strides, dilations, begin, end):
    """Scatter-add cols (N, C, *kernel, *grid) into an image (N, C, *out_sp): the tap at grid
    position g lands at g*stride + tap*dilation - begin. Returns a new array in cols' dtype."""
    n = len(kernel)
    N, C = cols.shape[:2]
    grid = cols.shape[2 + n:]
    # the buffer spans [lo, hi) in padded coordinates; the output is [begin, begin + out_sp)
    full = [(g - 1) * s + (k - 1) * d + 1 if g > 0 else 0
            for g, s, k, d in zip(grid, strides, kernel, dilations)]
    lo = [min(0, b) for b in begin]
    hi = [max(f, b + o) for f, b, o in zip(full, begin, out_sp)]
    if any(o < 0 for o in out_sp):
        raise ValueError(f"the output shape {list(out_sp)} has a negative dimension")
    shape = (N, C) + tuple(h - l for h, l in zip(hi, lo))
    limits.check_shape(shape, cols.dtype)  # output_shape, strides and pads come from the model
    buf = xp.zeros(shape, cols.dtype)
    if all(g > 0 for g in grid):
        for taps in np.ndindex(*kernel):
            dst = tuple(slice(t * d - l, t * d - l + (g - 1) * s + 1, s)
                        for t, d, l, g, s in zip(taps, dilations, lo, grid, strides))
            buf[(slice(None), slice(None)) + dst] += cols[(slice(None), slice(None)) + taps]
    if list(buf.shape[2:]) == list(out_sp):
        return buf
    crop = tuple(slice(b - l, b - l + o) for b, l, o in zip(begin, lo, out_sp))
    return xp.ascontiguousarray(buf[(slice(None), slice(None)) + crop])


def _add_bias(out, b):
    if b is not None:
        out += b.reshape((1, -1) + (1,) * (out.ndim - 2)).astype(out.dtype, copy=False)
    return out


class _ConvBase(OpImpl):
    """Shared attribute handling for the forward convolutions."""

    def setup(self):
        self.group = int(self.group) if getattr(self, "group", None) is not None else 1
        if self.group < 1:
            raise self.fail(f"group must be positive, got {self.group}")
        check_window_attributes(self)
        self._weight = None  # (key, value) of cached_weight, one object: threads read it whole
        self._routes = RouteMemo()   # Conv.run's, without a clamp

    def group_rows(self, w) -> int | None:
        """Output channels a group, for the plan (None: one group, a depthwise convolution,
        or unknown)."""
        if self.group == 1 or w.shape is None or not isinstance(w.shape[0], int) \
                or w.shape[0] == self.group and w.shape[1] == 1:
            return None
        return w.shape[0] // self.group

    def geometry(self, x, w):
        """(kernel, strides, dilations, pads begin, pads end) for these input and weight."""
        if x.__class__ is not np.ndarray or w.__class__ is not np.ndarray \
                or "O" in (x.dtype.kind, w.dtype.kind):  # the cheap test first
            check_numeric(self, X=x, W=w)
        return remembered_geometry(self, (x.shape, w.shape), lambda: self._geometry(x, w))

    def _geometry(self, x, w):
        n = x.ndim - 2
        if n < 1:
            raise self.fail(f"input must have rank >= 3, got shape {x.shape}")
        if w.ndim != x.ndim:
            raise self.fail(f"weight rank {w.ndim} does not match input rank {x.ndim}")
        kernel = ints(getattr(self, "kernel_shape", None), n, 0)
        if getattr(self, "kernel_shape", None) is None or not len(self.kernel_shape):
            kernel = list(w.shape[2:])
        if list(w.shape[2:]) != kernel:
            raise self.fail(f"kernel_shape {kernel} does not match weight shape {w.shape}")
        if x.shape[1] != w.shape[1] * self.group or w.shape[0] % self.group:
            raise self.fail(f"input channels {x.shape[1]}, weight {w.shape} and group "
                            f"{self.group} do not fit together")
        strides = ints(getattr(self, "strides", None), n, 1)
        dilations = ints(getattr(self, "dilations", None), n, 1)
        try:
            begin, end = auto_pads(getattr(self, "auto_pad", "NOTSET"), x.shape[2:], kernel,
                                   strides, dilations, getattr(self, "pads", None))
        except ValueError as exc:
            raise self.fail(str(exc)) from None
        if len(strides) != n or len(dilations) != n or len(begin) != n:
            raise self.fail("strides/dilations/pads do not match the number of spatial axes")
        return kernel, strides, dilations, begin, end

    def weight_and_cache(self, w, b, dtype):
        """(w in `dtype`, C-ordered; conv_nd's `cache` for it), kept while w and b (a bias
        folded into the weights, or None) are the same constants."""
        xp = self.xp
        return self.cached_weight(w, lambda a: (xp.ascontiguousarray(a, dtype=dtype), {}), b)

    def cached_weight(self, w, convert, *extra):
        """`convert(w)`, remembered across runs while w (and the `extra` arrays it depends on)
        are the same read-only numpy constants (the CUDA kernels override this: device
        arrays have no read-only flag)."""
        key = (w,) + extra
        kept = self._weight
        if kept is not None and len(key) == len(kept[0]) \
                and all(a is b for a, b in zip(key, kept[0])):
            return kept[1]
        value = convert(w)
        if all(isinstance(a, np.ndarray) and not a.flags.writeable for a in key if a is not None):
            self._weight = (key, value)
        return value


@register("Conv", versions=[1, 11, 22])
class Conv(_ConvBase):
    def run(self, x, w, b=None, clamp=None, routes=None):
        """The convolution; `clamp` (lo, hi) clips the result where `clamps_in_pass` allows.
        The route taken is remembered in `routes` (FusedConv's, for its clamped calls), or
        without a clamp in the op's own memo."""
        if clamp is None:
            route = self._routes.route(x, w, b, None)
            if route is not None:
                return route.run(x)
        xp = self.xp
        kernel, strides, dilations, begin, end = self.geometry(x, w)
        dt = compute_dtype(x.dtype)
        # a bias computed at run time (writable; constants are read-only, and device arrays
        # don't say) is added afterwards: folding it into the weight matrix, conv_nd's way
        # with a constant bias, would copy the whole weight on every run
        late_bias = b is not None and getattr(b.flags, "writeable", True) and clamp is None
        wc, cache = self.weight_and_cache(w, None if late_bias else b, dt)
        xc = x.astype(dt, copy=False)
        route = self.route(xc, wc, None if late_bias else b, clamp, cache)
        self._chosen = _CONV_ND if route is None else route.lowering
        if route is not None:
            out = route.run(xc)
            if routes is None and clamp is None:
                routes = self._routes
            if routes is not None and not late_bias and xc is x:
                routes.remember(x, w, b, None, route)
        else:
            out = conv_nd(xp, xc, wc, self.group, kernel, strides, dilations, begin, end,
                          bias=None if late_bias else b, cache=cache, clamp=clamp)
        if late_bias:
            out = _add_bias(out, b.astype(dt, copy=False))
        return out.astype(x.dtype, copy=False)

    def lower(self, inputs):
        """The route `_new_route` will take, where the plan knows x's shape and the weights;
        a 1x1 convolution's route depends on its input's layout, seen at the first run."""
        x, w = inputs[0], inputs[1]
        if x is None or w is None or x.dtype not in (np.float32, np.float64) or x.ndim != 4:
            return _CONV_ND
        if w.value is None or not x.static():
            return _BY_GEOMETRY
        try:
            kernel, _, _, begin, end = self.geometry(x, w.value)
        except EmberError:  # the run says what is wrong
            return _CONV_ND
        if 0 in x.shape or not _compiled.enabled():
            return _CONV_ND
        if _depthwise_fast(x, w.value, self.group, kernel, begin, end):
            return _DEPTHWISE_VECTOR if _depthwise_vector_fits(x, kernel) else _DEPTHWISE_LOOPS
        if _grouped_fits(x, w.value, self.group, begin, end):
            return _GroupedRoute.lowering
        if math.prod(kernel) > 1:
            return _TiledRoute.lowering if _tiled_fits(x, w.value, self.group, begin, end) \
                else _CONV_ND
        return _BY_LAYOUT

    def route(self, x, w, b, clamp, cache):
        """The route of this convolution for x's geometry: its kernel's call worked out once
        (on the first call; kept in the weights' `cache`, which a new weight or bias array
        does not share), or None where conv_nd serves: a depthwise convolution by a compiled
        kernel, one of a larger window by the tiles, a 1x1 one of a channels-last image whose
        product goes on the board."""
        key = route_key(x, clamp)
        if key not in cache:
            cache[key] = self._new_route(x, w, b, clamp, cache)
        return cache[key]

    def _new_route(self, x, w, b, clamp, cache):
        if self.xp is not np or x.dtype not in (np.float32, np.float64):
            return None
        kernel, strides, dilations, begin, end = self.geometry(x, w)
        N, C, M = x.shape[0], x.shape[1], w.shape[0]
        outs = out_size(x.shape[2:], kernel, strides, dilations, begin, end)
        limits.check_shape((N, M, *outs), x.dtype)
        if 0 in (N, M, *outs):
            return None
        if _direct_fits(x, w, self.group, outs):
            return _DirectRoute(x, w, b, clamp, kernel, strides, dilations, begin, outs, cache)
        bias = None if b is None else b.astype(x.dtype, copy=False).reshape(M)
        if _depthwise_fast(x, w, self.group, kernel, begin, end):
            return _DepthwiseRoute.make(x, w, bias, clamp, kernel, strides, dilations, begin,
                                        outs, cache)
        if math.prod(kernel) > 1 and _tiled_fits(x, w, self.group, begin, end):
            return _TiledRoute(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp)
        if _grouped_fits(x, w, self.group, begin, end):
            return _GroupedRoute(x, w, self.group, kernel, strides, dilations, begin, outs, bias,
                                 cache, clamp)
        if _strided_pointwise_fits(x, w, self.group, strides, begin, end):
            return _TiledRoute(x, w, kernel, strides, dilations, begin, outs, bias, cache, clamp)
        if _epilogue.tiles_pointwise_fits(x, w, b, self.group, strides, begin, end):
            route = _epilogue.tiles_pointwise_route(x, w, bias, None, clamp, "", [])
            if route is not None:
                return route
        # a 1x1 convolution whose bias _pointwise_cl adds after its product (not folded into
        # the product: C < M), as the route's epilogue does: the same bits
        if clamp is None and _blas.in_run() and self.group == 1 and all(
                s == 1 for s in strides) and (b is None or C >= M) and pointwise_cl_fits(
                np, x, w, self.group, kernel, begin, end):
            return _epilogue.pointwise_route(x, pointwise_weights(w, cache), bias, None, "", [])
        return None


# Integers up to 2**24 are exact in float32: where no partial sum of a convolution can pass it,
# its float32 result is the exact integer sum whatever order the kernel adds in.
_FLOAT32_EXACT = 2 ** 24


def _exact_int_conv(xp, op, x, w, x_zp, w_zp):
    """Integer convolution (N, M, *outs): conv(x - x_zp, w - w_zp), exact integers held in a
    float array. It runs as a float convolution on the shifted values: float32 where every
    partial sum is bounded below 2**24 (the largest |x - x_zp| times a channel's sum of
    |w - w_zp|), else float64."""
    kernel, strides, dilations, begin, end = op.geometry(x, w)
    x_zero = 0.0
    if x_zp is not None:
        xz = xp.asarray(x_zp)
        if xz.size != 1:
            raise op.fail("x_zero_point must be a scalar")
        x_zero = float(xz.reshape(()))

    def prep(a):
        ws = a.astype(np.float64)
        if w_zp is not None:
            wz = xp.asarray(w_zp).astype(np.float64)
            if wz.size == 1:
                ws -= wz.reshape(())
            elif wz.size == a.shape[0]:
                ws -= wz.reshape((-1,) + (1,) * (a.ndim - 1))
            else:
                raise op.fail(f"w_zero_point has {wz.size} values for {a.shape[0]} channels")
        reach = float(xp.abs(ws).reshape(ws.shape[0], -1).sum(axis=1).max()) if ws.size else 0.0
        return ws, ws.astype(np.float32), reach

    ws64, ws32, reach = op.cached_weight(w, prep, w_zp)
    info = np.iinfo(x.dtype)
    exact32 = max(abs(info.min - x_zero), abs(info.max - x_zero)) * reach < _FLOAT32_EXACT
    dtype, ws = (np.float32, ws32) if exact32 else (np.float64, ws64)
    xs = x.astype(dtype)
    if x_zero:
        xs -= dtype(x_zero)
    return conv_nd(xp, xs, ws, op.group, kernel, strides, dilations, begin, end)


def _integer_conv_serves(op, x, w, x_zp, w_zp) -> bool:
    """Whether the CPU engine's integer product runs this convolution: a 2-D one of 8-bit
    numpy arrays, zero points per tensor (and per output channel for w), and groups of at
    least INT_GROUP_ROWS output channels (a depthwise convolution's one channel a group
    would leave the tiles empty)."""
    if op.xp is not np or x.ndim != 4 or w.ndim != 4 or not _integer.enabled() \
            or x.dtype not in _int.BYTES or w.dtype not in _int.BYTES:
        return False
    if _int.scalar(x_zp) is None or _int.columns(w_zp, w.shape[0]) is None:
        return False
    M, G = w.shape[0], op.group
    return x.shape[1] == w.shape[1] * G and M % G == 0 and (
        G == 1 or M // G >= tuning.INT_GROUP_ROWS or _depthwise(x, w, G))


def _depthwise(x, w, group) -> bool:
    """One input and one output channel a group."""
    return group == x.shape[1] == w.shape[0] and w.shape[1] == 1


_INT_TILES = Lowering("cpu.integer-tiles", "8-bit products in int32 on channels-last pixel "
                      "tiles (AVX-512 VNNI, or compiled loops): the input read where it lies, "
                      "the output channels-last for the next 8-bit op, weights packed once")
_INT_DEPTHWISE = Lowering("cpu.integer-depthwise", "by layout: a channels-last image (or narrow "
                          "rows) on channels-last vectors of 16 channels, output "
                          "channels-last; a planar one plane by plane")


def _integer_lowering(op, x, w) -> Lowering:
    """The plan's kernel for ConvInteger / QLinearConv of x by the filters w (sketches)."""
    chosen = _int.lowering(x, w, 4, op.group_rows(w))
    if chosen is not _int.INTEGER or op.group_rows(w) is not None:
        return chosen
    return _INT_TILES if op.group == 1 else _INT_DEPTHWISE


class _IntegerRoute:
    """An 8-bit convolution (ConvInteger, QLinearConv) by the CPU engine's integer products,
    worked out once for an input geometry and its constant parameters: the weights packed,
    the plan of the kernel (ops/cpu/integer_tiles.py's Plan), the epilogue's arrays
    (integer.product's). A call allocates the output and runs the kernel.

    One group, and a depthwise convolution of a channels-last image or of narrow rows, run
    on the channels-last kernels: the input read in either layout, the result channels-last
    (a view of (N, OH, OW, M) memory), as the next 8-bit op reads it with no copy. A planar
    depthwise image of wide rows goes plane by plane, grouped convolutions on the packed
    GEMM group by group, both planar."""

    def __init__(self, op, x, w, x_zp, w_zp, out_dtype, epilogue):
        geometry = op.geometry(x, w)
        kernel, strides, dilations, begin, end = geometry
        N, C, H, W = x.shape
        M, G = w.shape[0], op.group
        outs = out_size((H, W), kernel, strides, dilations, begin, end)
        limits.check_shape((N, M, *outs), out_dtype)
        zero = _int.columns(w_zp, M)
        self.x_zero, self.epilogue, self.dtype = _int.scalar(x_zp), epilogue, out_dtype
        self.planar_shape, self.cl_shape = (N, M, *outs), (N, *outs, M)
        self.plan = self.grouped = self.planes = None
        self.lowering = _INT_TILES if G == 1 else _int.INTEGER
        if 0 in self.planar_shape:
            return
        if _depthwise(x, w, G):
            self.lowering = _INT_DEPTHWISE
            taps = _int.kept(op, "depthwise", (w, w_zp),
                             lambda: _integer_tiles.DepthwiseWeights(w, zero))
            if taps.serves and (channels_last(x) or outs[1] < tuning.INT_DEPTHWISE_PLANE_WIDTH):
                self.plan = _integer_tiles.Plan(taps, x, geometry, outs)
            else:
                self.planes = (w, zero, strides, dilations, begin)
        elif G == 1:
            weights = _int.kept(op, "pixels", (w, w_zp),
                                lambda: _integer_tiles.ConvWeights(w, zero))
            self.plan = _integer_tiles.Plan(weights, x, geometry, outs)
        else:
            Mg = M // G
            self.grouped = (geometry, outs, G, _int.kept(op, "conv", (w, w_zp), lambda: [
                _integer.conv_weights(w[g * Mg:(g + 1) * Mg], zero[g * Mg:(g + 1) * Mg])
                for g in range(G)]))

    def __call__(self, x):
        if self.plan is not None:
            out = np.empty(self.cl_shape, self.dtype)
            self.plan.run(x, self.x_zero, out, **self.epilogue)
            return out.transpose(0, 3, 1, 2)
        out = np.empty(self.planar_shape, self.dtype)
        if self.planes is not None:
            _integer.depthwise(x, self.x_zero, *self.planes, out, **self.epilogue)
        elif self.grouped is not None:
            self._grouped(x, out)
        return out

    def _grouped(self, x, out):
        (kernel, strides, dilations, begin, end), outs, G, groups = self.grouped
        N, M = out.shape[:2]
        Mg, Cg, P = M // G, x.shape[1] // G, math.prod(outs)
        for n in range(N):
            for g in range(G):
                packed, sums, shift = _integer.pack_patches(
                    x[n, g * Cg:(g + 1) * Cg], self.x_zero, kernel, strides, dilations, begin,
                    end, outs)
                part = {k: v[g * Mg:(g + 1) * Mg] if isinstance(v, np.ndarray) else v
                        for k, v in self.epilogue.items()}
                _integer.product(groups[g], packed, sums, self.x_zero + shift,
                                 out[n, g * Mg:(g + 1) * Mg].reshape(Mg, P), **part)


@register("ConvInteger", versions=[10])
class ConvInteger(_ConvBase):
    def lower(self, inputs):
        return _integer_lowering(self, inputs[0], inputs[1])

    def run(self, x, w, x_zero_point=None, w_zero_point=None):
        route = remembered_route(self, (x,), (w, x_zero_point, w_zero_point), lambda: (
            _IntegerRoute(self, x, w, x_zero_point, w_zero_point, np.int32, {})
            if _integer_conv_serves(self, x, w, x_zero_point, w_zero_point) else None))
        if route is not None:
            self._chosen = route.lowering
            return route(x)
        self._chosen = _int.EXACT_FLOAT
        acc = _exact_int_conv(self.xp, self, x, w, x_zero_point, w_zero_point)
        # the accumulation wraps in 32 bits, as the spec allows
        return acc.astype(np.int64).astype(np.int32)


@register("QLinearConv", versions=[10])
class QLinearConv(_ConvBase):
    def lower(self, inputs):
        return _integer_lowering(self, inputs[0], inputs[3])

    def run(self, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
            B=None):
        params = (x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B)
        route = remembered_route(self, (x,), params, lambda: self._route(x, *params))
        if route is not None:
            self._chosen = route.lowering
            return route(x)
        xp = self.xp
        scale = self._scale(x_scale, w, w_scale, y_scale)
        self._chosen = _int.EXACT_FLOAT
        acc = _exact_int_conv(xp, self, x, w, x_zero_point, w_zero_point)
        if B is not None:  # the integer sum acc + B, exact in float64, then one float32 rounding
            acc = acc.astype(np.float64)
            acc += B.astype(np.float64).reshape((1, -1) + (1,) * (acc.ndim - 2))
        scale = scale.reshape((1, -1) + (1,) * (acc.ndim - 2)) if scale.size > 1 else scale[0]
        # onnxruntime's requantisation: float32(acc) times the float32 multiplier, rounded half
        # to even, plus the zero point, saturated
        y = acc.astype(np.float32, copy=False)  # conv_nd's result is fresh: written in place
        xp.multiply(y, scale, out=y)
        xp.rint(y, out=y)
        yzp = xp.asarray(y_zero_point)
        y += yzp.reshape(()).astype(np.float32)
        info = np.iinfo(yzp.dtype)
        xp.clip(y, info.min, info.max, out=y)
        return y.astype(yzp.dtype)

    def _scale(self, x_scale, w, w_scale, y_scale):
        """The requantisation's multipliers x_scale * w_scale / y_scale, float32: one, or one
        per output channel."""
        xp = self.xp
        ws = xp.asarray(w_scale, np.float32).reshape(-1)
        if ws.size not in (1, w.shape[0]):
            raise self.fail(f"w_scale has {ws.size} values for {w.shape[0]} channels")
        return (xp.asarray(x_scale, np.float32).reshape(()) * ws
                / xp.asarray(y_scale, np.float32).reshape(()))

    def _route(self, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
               B):
        """The integer kernels' route (_IntegerRoute), requantising as onnxruntime does;
        None where they do not serve."""
        scale = self._scale(x_scale, w, w_scale, y_scale)
        yzp = self.xp.asarray(y_zero_point)
        if not (_integer_conv_serves(self, x, w, x_zero_point, w_zero_point)
                and yzp.dtype in _int.BYTES and yzp.size == 1):
            return None
        M = w.shape[0]
        info = np.iinfo(yzp.dtype)
        epilogue = dict(mode=_integer.REQUANTIZE,
                        bias=np.zeros(M, np.int64) if B is None else B.astype(np.int64).reshape(M),
                        mult=np.broadcast_to(scale, (M,)).astype(np.float32),
                        y_zero=float(yzp.reshape(())), lo=info.min, hi=info.max)
        return _IntegerRoute(self, x, w, x_zero_point, w_zero_point, yzp.dtype, epilogue)


# ----------------------------------------------------------------------------------------------
# transposed convolution and col2im


@register("ConvTranspose", versions=[1, 11, 22])
class ConvTranspose(_ConvBase):
    def geometry(self, x_shape, w_shape):
        """(kernel, strides, dilations, pads begin, pads end, output spatial shape) for these
        input and weight shapes, resolving auto_pad, output_padding and output_shape."""
        return remembered_geometry(self, (tuple(x_shape), tuple(w_shape)),
                                   lambda: self._geometry(x_shape, w_shape))

    def _geometry(self, x_shape, w_shape):
        n = len(x_shape) - 2
        kernel = list(w_shape[2:])
        if getattr(self, "kernel_shape", None) is not None and len(self.kernel_shape):
            if [int(k) for k in self.kernel_shape] != kernel:
                raise self.fail(f"kernel_shape {list(self.kernel_shape)} does not match "
                                f"weight shape {tuple(w_shape)}")
        strides = ints(getattr(self, "strides", None), n, 1)
        dilations = ints(getattr(self, "dilations", None), n, 1)
        opad = ints(getattr(self, "output_padding", None), n, 0)
        in_sp = x_shape[2:]
        natural = [s * (i - 1) + op + (k - 1) * d + 1
                   for s, i, op, k, d in zip(strides, in_sp, opad, kernel, dilations)]
        auto_pad = getattr(self, "auto_pad", "NOTSET") or "NOTSET"
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        oshape = getattr(self, "output_shape", None)
        if oshape is not None and len(oshape):
            out_sp = [int(v) for v in oshape][-n:]
        elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out_sp = [i * s for i, s in zip(in_sp, strides)]
        else:
            out_sp = None
        if out_sp is not None:
            begin, end = [], []
            for i in range(n):
                total = natural[i] - out_sp[i]
                half = total // 2
                bgn = half if auto_pad == "SAME_UPPER" else total - half
                begin.append(bgn)
                end.append(total - bgn)
        else:
            if auto_pad == "VALID":
                begin, end = [0] * n, [0] * n
            else:
                p = ints(getattr(self, "pads", None), 2 * n, 0)
                begin, end = p[:n], p[n:]
            out_sp = [natural[i] - begin[i] - end[i] for i in range(n)]
        return kernel, strides, dilations, begin, end, out_sp

    def run(self, x, w, b=None):
        xp = self.xp
        n = x.ndim - 2
        if n < 1 or w.ndim != x.ndim:
            raise self.fail(f"bad input/weight ranks {x.shape}, {w.shape}")
        G = self.group
        N, C = x.shape[:2]
        if C != w.shape[0] or C % G:
            raise self.fail(f"input channels {C} do not match weight {w.shape} / group {G}")
        Mg = w.shape[1]
        M = Mg * G
        kernel, strides, dilations, begin, end, out_sp = self.geometry(x.shape, w.shape)
        in_sp = x.shape[2:]
        dt = compute_dtype(x.dtype)
        cache = self.cached_weight(w, lambda a: {})  # the rearranged weights, per kernel
        if xp is np and _tiles_without_overlap(x, G, kernel, strides, dilations, begin, end,
                                               out_sp):
            return self._tiles_channels_last(x, w, b, kernel, cache)
        if xp is np and _sub_pixel_fits(x, G, dilations, begin, end):
            self._chosen = _SUB_PIXEL
            return _sub_pixel(x, w, b, kernel, strides, begin, out_sp, cache)
        self._chosen = None
        K = math.prod(kernel)
        L = math.prod(in_sp)
        wt = _remembered(cache, "cols", lambda: xp.ascontiguousarray(
            w.astype(dt, copy=False).reshape(G, C // G, Mg * K).transpose(0, 2, 1)))
        xm = x.astype(dt, copy=False).reshape(N, G, C // G, L)
        cols = _blas.product(xp, wt, xm)  # (N, G, Mg*K, L)
        cols = cols.reshape((N, M) + tuple(kernel) + tuple(in_sp))
        out = col2im_nd(xp, cols, out_sp, kernel, strides, dilations, begin, end)
        _add_bias(out, b)  # col2im_nd's result is a fresh array of ours
        return out.astype(x.dtype, copy=False)

    def _tiles_channels_last(self, x, w, b, kernel, cache):
        """The upsampling ConvTranspose (stride = kernel, no padding: each input pixel writes
        its own kh x kw tile of the output) as one GEMM of the pixels (N*H*W, C), whatever
        x's layout, by the weights (C, kh*kw*M), and one copy of the tiles into place with
        the bias added. Returns the channels-last (N, M, Ho, Wo) view; col2im's scatter plus
        a pass for the bias take much longer."""
        N, C, H, W = x.shape
        M, (kh, kw) = w.shape[1], kernel
        wm = _remembered(cache, "tiles", lambda: np.ascontiguousarray(
            w.astype(x.dtype, copy=False).transpose(0, 2, 3, 1)).reshape(C, kh * kw * M))
        pixels = x.transpose(0, 2, 3, 1).reshape(N * H * W, C)  # a view when channels-last
        tiles = _blas.matmul(pixels, wm).reshape(N, H, W, kh, kw, M)
        out = np.empty((N, H, kh, W, kw, M), x.dtype)
        placed = tiles.transpose(0, 1, 3, 2, 4, 5)
        if b is None:
            np.copyto(out, placed)
        else:
            np.add(placed, b.astype(x.dtype, copy=False), out=out)
        return out.reshape(N, H * kh, W * kw, M).transpose(0, 3, 1, 2)


# A ConvTranspose of stride s (2-D, one group, undilated) is s*s ordinary convolutions, one
# per output phase (the output pixels (s*q + ry, s*q' + rx) before cropping the pads): the
# phase's pixels take the kernel taps ry + s*j of each axis only, from input pixel q - j, so
# the phase is a stride-1 convolution of the input by those taps, flipped, padded by their
# count less one. The phases are stacked as the output channels of one such convolution (a
# phase with fewer taps gets zero weights for the others), which runs on conv_nd's fast
# kernels (the tiles) with its bias; each phase's pixels are then written once into the
# channels-last result: no columns matrix and no scatter-add of overlapping taps (col2im).

_SUB_PIXEL = Lowering("cpu.sub-pixel", "one stride-1 convolution (conv_nd's kernels) with "
                      "an output channel block per output phase, interleaved into the "
                      "channels-last result")


def _sub_pixel_fits(x, group, dilations, begin, end):
    return (x.ndim == 4 and group == 1 and all(d == 1 for d in dilations)
            and min(begin) >= 0 and min(end) >= 0 and x.dtype in (np.float32, np.float64))


def _sub_pixel(x, w, b, kernel, strides, begin, out_sp, cache):
    """ConvTranspose of x (N, C, H, W) by w (C, M, kh, kw), `strides`, pads `begin` (and the
    end's, through `out_sp`), as one convolution with s*s phases (see above); returns the
    channels-last (N, M, *out_sp) view."""
    N, C, H, W = x.shape
    M = w.shape[1]
    (sh, sw), dt = strides, compute_dtype(x.dtype)
    phases = [(ry, rx) for ry in range(sh) for rx in range(sw)]
    taps = [-(-k // s) for k, s in zip(kernel, strides)]   # the most taps a phase has

    def stacked():
        """(s*s*M, C, *taps): phase (ry, rx)'s block is w's taps (ry + sh*j, rx + sw*i),
        flipped (the last tap first) and right-aligned, zero where a phase has fewer."""
        ws = np.zeros((len(phases), M, C, *taps), dt)
        for i, (ry, rx) in enumerate(phases):
            part = w[:, :, ry::sh, rx::sw].astype(dt).transpose(1, 0, 2, 3)[:, :, ::-1, ::-1]
            ws[i, :, :, taps[0] - part.shape[2]:, taps[1] - part.shape[3]:] = part
        return ws.reshape(len(phases) * M, C, *taps)
    weights = _remembered(cache, ("sub-pixel", dt), stacked)
    # a constant bias rides in the convolution (kept with its packed weights); one computed
    # in the run is added after
    late_bias = b is not None and getattr(b.flags, "writeable", True)
    bias = None if b is None else b.astype(dt, copy=False).reshape(M)
    # each phase's output pixels p = s*q + r - begin, for q in [q0, q0 + count)
    spans = []
    for ry, rx in phases:
        q0 = [-(-(bg - r) // s) for bg, r, s in zip(begin, (ry, rx), strides)]
        p0 = [s * q + r - bg for q, r, s, bg in zip(q0, (ry, rx), strides, begin)]
        count = [max(0, -(-(o - p) // s)) for o, p, s in zip(out_sp, p0, strides)]
        spans.append((q0, p0, count))
    last = [max([q[i] + c[i] for q, _, c in spans] + [1]) for i in range(2)]
    y = conv_nd(np, x.astype(dt, copy=False), weights, 1, taps, [1, 1], [1, 1],
                [t - 1 for t in taps], [max(0, n - i) for n, i in zip(last, (H, W))],
                bias=None if late_bias or bias is None else np.tile(bias, len(phases)),
                cache=cache.setdefault(("sub-pixel-cache", dt, None if late_bias else id(b)),
                                       {}))
    rows = y.transpose(0, 2, 3, 1)   # (N, Q, Q', s*s*M), channels-last: a view
    out = np.empty((N, *out_sp, M), dt)
    for i, (q0, p0, count) in enumerate(spans):
        if 0 not in count:
            out[:, p0[0]::sh, p0[1]::sw] = rows[:, q0[0]:q0[0] + count[0],
                                               q0[1]:q0[1] + count[1], i * M:(i + 1) * M]
    if late_bias:
        out += bias
    return out.astype(x.dtype, copy=False).transpose(0, 3, 1, 2)


def _tiles_without_overlap(x, group, kernel, strides, dilations, begin, end, out_sp):
    """Whether a ConvTranspose is the tiling upsampler `_tiles_channels_last` computes:
    2-D, one group, stride = kernel, no dilation, padding or output padding, float."""
    return (x.ndim == 4 and group == 1 and list(strides) == list(kernel)
            and all(d == 1 for d in dilations) and not any(begin) and not any(end)
            and list(out_sp) == [i * s for i, s in zip(x.shape[2:], strides)]
            and x.dtype in (np.float32, np.float64))


@register("Col2Im", versions=[18])
class Col2Im(OpImpl):
    shape_inputs = (1, 2)

    def setup(self):
        check_window_attributes(self)

    def run(self, x, image_shape, block_shape):
        image = [int(v) for v in np.asarray(image_shape).reshape(-1)]
        block = [int(v) for v in np.asarray(block_shape).reshape(-1)]
        n = len(image)
        if len(block) != n or x.ndim != 3:
            raise self.fail(f"input {x.shape}, image_shape {image}, block_shape {block} "
                            "do not fit together")
        if any(b < 1 for b in block) or any(d < 0 for d in image):
            raise self.fail(f"block_shape {block} must be positive and image_shape {image} "
                            f"non-negative")
        strides = ints(self.strides, n, 1)
        dilations = ints(self.dilations, n, 1)
        p = ints(self.pads, 2 * n, 0)
        # the window attributes' lengths follow image_shape, known only now
        for name, values, per_axis in (("strides", strides, 1), ("dilations", dilations, 1),
                                       ("pads", p, 2)):
            if len(values) != per_axis * n:
                raise self.fail(f"{name} has {len(values)} entries; the {n}-D image_shape "
                                f"needs {per_axis * n}")
        begin, end = p[:n], p[n:]
        K = math.prod(block)
        N, CK, L = x.shape
        if CK % K:
            raise self.fail(f"input channel dim {CK} is not a multiple of the block size {K}")
        grid = out_size(image, block, strides, dilations, begin, end)
        if math.prod(grid) != L:
            raise self.fail(f"input has {L} blocks, the geometry gives {grid}")
        dt = compute_dtype(x.dtype)
        cols = x.astype(dt, copy=False).reshape((N, CK // K) + tuple(block) + tuple(grid))
        out = col2im_nd(self.xp, cols, image, block, strides, dilations, begin, end)
        return out.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# deformable convolution


@register("DeformConv", versions=[19, 22])
class DeformConv(_ConvBase):
    def run(self, x, w, offset, b=None, mask=None):
        xp = self.xp
        kernel, strides, dilations, begin, end = self.geometry(x, w)
        n = len(kernel)
        N, C = x.shape[:2]
        sp = x.shape[2:]
        OG = int(self.offset_group) if getattr(self, "offset_group", None) else 1
        if C % OG:
            raise self.fail(f"channels {C} not divisible by offset_group {OG}")
        outs = out_size(sp, kernel, strides, dilations, begin, end)
        K, L, S = math.prod(kernel), math.prod(outs), math.prod(sp)
        if tuple(offset.shape) != (N, OG * K * n, *outs):
            raise self.fail(f"offset shape {offset.shape}, expected {(N, OG * K * n, *outs)}")
        dt = compute_dtype(x.dtype)
        off = offset.astype(dt, copy=False).reshape(N, OG, K, n, L)
        if mask is not None:
            if tuple(mask.shape) != (N, OG * K, *outs):
                raise self.fail(f"mask shape {mask.shape}, expected {(N, OG * K, *outs)}")
            msk = mask.astype(dt, copy=False).reshape(N, OG, K, L)
        xg = x.astype(dt, copy=False).reshape(N, OG, C // OG, S)
        # base sampling positions of each output pixel, per axis: (L,)
        grids = xp.meshgrid(*[xp.arange(o, dtype=dt) * s - bg
                              for o, s, bg in zip(outs, strides, begin)], indexing="ij")
        base = [g.reshape(-1) for g in grids]
        sp_strides = [math.prod(sp[i + 1:]) for i in range(n)]
        cols = xp.empty((N, OG, C // OG, K, L), dt)
        for t, taps in enumerate(np.ndindex(*kernel)):
            pos = [base[i] + taps[i] * dilations[i] + off[:, :, t, i] for i in range(n)]
            lo = [xp.floor(p) for p in pos]
            frac = [p - f for p, f in zip(pos, lo)]
            lo = [f.astype(np.int64) for f in lo]
            acc = None
            for corner in np.ndindex(*([2] * n)):
                wgt = None
                flat = None
                valid = None
                for i in range(n):
                    c = lo[i] + corner[i]
                    wi = frac[i] if corner[i] else 1 - frac[i]
                    ok = (c >= 0) & (c < sp[i])
                    wgt = wi if wgt is None else wgt * wi
                    valid = ok if valid is None else valid & ok
                    term = xp.clip(c, 0, sp[i] - 1) * sp_strides[i]
                    flat = term if flat is None else flat + term
                wgt = xp.where(valid, wgt, 0)  # (N, OG, L)
                vals = xp.take_along_axis(xg, flat[:, :, None, :], axis=3)  # (N, OG, Cog, L)
                contrib = vals * wgt[:, :, None, :]
                acc = contrib if acc is None else acc + contrib
            if mask is not None:
                acc *= msk[:, :, None, t, :]
            cols[:, :, :, t, :] = acc
        G = self.group
        M = w.shape[0]
        cols = cols.reshape(N, G, (C // G) * K, L)
        wm = self.cached_weight(w, lambda a: xp.ascontiguousarray(a, dtype=dt)) \
            .reshape(G, M // G, (C // G) * K)
        out = _blas.product(xp, wm, cols).reshape(N, M, *outs)
        _add_bias(out, b)  # a fresh array of ours
        return out.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# stateful causal depthwise 1-D convolution


@register("CausalConvWithState", versions=[27])
class CausalConvWithState(OpImpl):
    def setup(self):
        act = self.activation
        act = act.decode() if isinstance(act, bytes) else (act or "none")
        if act.lower() not in ("none", "silu", "swish"):
            raise self.fail(f"unknown activation '{act}'")
        self.act = act.lower()

    def run(self, x, weight, bias=None, past_state=None):
        xp = self.xp
        if x.ndim != 3 or weight.ndim != 3 or weight.shape[1] != 1 \
                or weight.shape[0] != x.shape[1]:
            raise self.fail(f"input {x.shape} and weight {weight.shape} do not fit together")
        B, C, L = x.shape
        k = weight.shape[2]
        dt = compute_dtype(x.dtype)
        if past_state is None:
            past = xp.zeros((B, C, k - 1), dt)
        else:
            if tuple(past_state.shape) != (B, C, k - 1):
                raise self.fail(f"past_state shape {past_state.shape}, expected {(B, C, k - 1)}")
            past = past_state.astype(dt, copy=False)
        full = xp.concatenate([past, x.astype(dt, copy=False)], axis=2)  # (B, C, k-1+L)
        w = weight.astype(dt, copy=False).reshape(C, k)
        out = full[:, :, 0:L] * w[:, 0, None]
        for j in range(1, k):
            out += full[:, :, j:j + L] * w[:, j, None]
        if bias is not None:
            out += bias.astype(dt, copy=False)[:, None]
        if self.act != "none":
            out = out / (1 + xp.exp(-out))
        present = full[:, :, L:].copy() if k > 1 else xp.zeros((B, C, 0), dt)
        return out.astype(x.dtype, copy=False), present.astype(x.dtype, copy=False)

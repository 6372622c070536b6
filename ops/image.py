"""Image and geometry ops: Resize, Upsample, GridSample, AffineGrid, RoiAlign, NonMaxSuppression,
ImageDecoder (through Pillow).

Resize is separable: for every resized axis we precompute, once per call, an (out_len, taps)
array of source indices and one of weights, then apply the axis with a few vectorised gathers.
The plans depend on shapes and attributes only: they are made on the host (numpy) and the
gathers run over the kernel's array namespace `xp`.

With numba (ops/cpu/compiled.py), a float32 NCHW resize of H and W only (nearest, linear or
cubic, every coordinate transformation but tf_crop_and_resize) runs compiled: one output row
a step, the rows shared by the run's threads (`_resize_rows`, `_resize_nearest_rows`), with
the numpy gathers' bits (the same plans, the same float32 products summed in the same order);
a channels-last input (a convolution's result) is resized in its layout, and so handed on.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ember import limits
from ember.ops import _xp
from ember.ops._layout import channels_last
from ember.ops._lowering import compiled_rows, numba_serves
from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register

# ----------------------------------------------------------------------------------------------
# Resize / Upsample: per-axis plans

_CT_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
             "asymmetric", "tf_half_pixel_for_nn", "tf_crop_and_resize")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil", "simple")


def _to_str(v):
    return v.decode() if isinstance(v, bytes) else v


def _source_coords(ct: str, in_len: int, out_len: int, scale: float,
                   roi_start: float, roi_end: float) -> np.ndarray:
    """x_original for every x_resized of one axis (float64, on the host)."""
    x = np.arange(out_len, dtype=np.float64)
    # Like the ONNX reference, align_corners and tf_crop_and_resize use the fractional target
    # length scale * in_len (it equals out_len whenever sizes were given).
    width = scale * in_len
    if abs(width - out_len) < 1e-6 * max(1, out_len):
        width = float(out_len)
    if ct == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if ct == "half_pixel_symmetric":
        adjustment = out_len / (scale * in_len)
        offset = (in_len / 2.0) * (1.0 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if ct == "pytorch_half_pixel":
        # (the reference tests the fractional length; the spec maps a single output to 0)
        return (x + 0.5) / scale - 0.5 if width != 1 else np.zeros(out_len)
    if ct == "align_corners":
        return x * ((in_len - 1) / (width - 1)) if width != 1 else np.zeros(out_len)
    if ct == "asymmetric":
        return x / scale
    if ct == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if ct == "tf_crop_and_resize":
        # The crop start is formed in float32, as the roi tensor is (so 0.1 * 5 is 0.5).
        start = float(np.float32(roi_start) * np.float32(in_len - 1))
        if width != 1:
            return start + x * ((roi_end - roi_start) * (in_len - 1) / (width - 1))
        return np.full(out_len, 0.5 * (roi_start + roi_end) * (in_len - 1))
    raise ValueError(ct)


def _cubic_kernel(xp, t, a: float):
    t = xp.abs(t)
    t2, t3 = t * t, t * t * t
    near = (a + 2) * t3 - (a + 3) * t2 + 1
    far = a * t3 - 5 * a * t2 + 8 * a * t - 4 * a
    return xp.where(t <= 1, near, xp.where(t < 2, far, 0.0))


def _axis_plan(mode: str, x: np.ndarray, in_len: int, scale: float, *, nearest_mode: str,
               cubic_a: float, exclude_outside: bool, antialias: bool):
    """(indices, weights) of shape (out_len, taps), host arrays; weights None for nearest
    (one tap)."""
    if mode == "nearest":
        if nearest_mode == "round_prefer_floor":
            idx = np.ceil(x - 0.5)
        elif nearest_mode == "round_prefer_ceil":
            idx = np.floor(x + 0.5)
        elif nearest_mode == "floor":
            idx = np.floor(x)
        elif nearest_mode == "ceil":
            idx = np.ceil(x)
        else:  # "simple": opset <= 10 Upsample/Resize
            idx = np.ceil(x) if scale < 1 else np.floor(x)
        return np.clip(idx, 0, in_len - 1).astype(np.intp)[:, None], None
    s = min(scale, 1.0) if antialias else 1.0
    left = np.floor(x)
    ratio = x - left
    if mode == "linear":
        start = int(math.floor(-1.0 / s) + 1)
        n = 2 - 2 * start
    else:
        start = int(math.floor(-2.0 / s) + 1)
        n = 2 - 2 * start
    offsets = np.arange(start, start + n, dtype=np.float64)
    args = (offsets[None, :] - ratio[:, None]) * s
    if mode == "linear":
        w = np.clip(1.0 - np.abs(args), 0.0, 1.0)
    else:
        w = _cubic_kernel(np, args, cubic_a)
    idx = left[:, None].astype(np.int64) + offsets.astype(np.int64)[None, :]
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= in_len), 0.0, w)
    total = w.sum(axis=1, keepdims=True)
    w = w / np.where(total == 0, 1.0, total)
    idx = np.clip(idx, 0, in_len - 1).astype(np.intp)
    # Drop taps that never carry weight (keeps the common 2/4-tap cases lean).
    keep = np.any(w != 0, axis=0)
    if not keep.all() and keep.any():
        idx, w = idx[:, keep], w[:, keep]
    return idx, w


def _work_dtype(dt: np.dtype) -> np.dtype:
    if dt == np.float64 or (dt.kind in "iu" and dt.itemsize >= 4):
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def _apply_axis(xp, data, axis: int, idx: np.ndarray, w, work_dt):
    """One axis of the resize: the gathers of plan (idx, w) (host arrays) over `data`."""
    if w is None:
        return xp.take(data, xp.asarray(idx[:, 0]), axis=axis)
    shape = [1] * data.ndim
    shape[axis] = idx.shape[0]
    idx = xp.asarray(idx)
    w = xp.asarray(w.astype(work_dt))
    acc = None
    for t in range(idx.shape[1]):
        term = xp.take(data, idx[:, t], axis=axis)
        if term.dtype != work_dt:
            term = term.astype(work_dt)
        term = term * w[:, t].reshape(shape)
        acc = term if acc is None else acc + term
    return acc


def _finish(xp, result, dt: np.dtype):
    if result.dtype == dt:
        return result
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return xp.clip(xp.rint(result), info.min, info.max).astype(dt)
    if dt == np.bool_:
        return result != 0
    return result.astype(dt)


def _skips_axis(ct: str, in_len: int, out_len: int, scale: float, rs: float, re: float) -> bool:
    """Whether resize_nd leaves an axis as it is (before making its plan)."""
    return out_len == in_len and scale == 1.0 and ct != "tf_half_pixel_for_nn" and (
        ct != "tf_crop_and_resize" or (rs == 0.0 and re == 1.0))


# ----------------------------------------------------------------------------------------------
# Resize: the compiled NCHW kernels

_RESIZE_COMPILED_WHY = "resize of H and W by output rows: numpy's plans and bits, threaded"
_RESIZE_BY_GEOMETRY = Lowering("by geometry", "compiled output rows for float32 NCHW where only "
                               "H and W are resized: the scales or the input are known in the run")


def resize_compiled_route(x, mode: str, ct: str) -> bool:
    """Whether `_resize_compiled` may serve an input like x (an array or a Sketch), leaving the
    scales aside: float32 of rank 4 and a mode and transformation it runs."""
    return x is not None and x.dtype == np.float32 and x.ndim == 4 \
        and mode in ("nearest", "linear", "cubic") and ct != "tf_crop_and_resize"


def resize_lowering(x, mode: str, ct: str, target) -> Lowering:
    """The plan's choice for a resize of x (a Sketch): compiled where `resize_compiled_route`
    holds and target(), the (output shape, scales) the plan can tell (None where only the run
    knows them), leaves N and C as they are."""
    if not numba_serves() or mode not in ("nearest", "linear", "cubic") \
            or ct == "tf_crop_and_resize":
        return PORTABLE
    if x is None or x.dtype is None or x.ndim is None:
        return _RESIZE_BY_GEOMETRY  # the graph does not declare them: the run tells
    if not resize_compiled_route(x, mode, ct):
        return PORTABLE
    try:
        known = target()
    except Exception:  # a malformed node: the run reports it
        known = None
    if known is None:
        return _RESIZE_BY_GEOMETRY
    return compiled_rows(_RESIZE_COMPILED_WHY) if _keeps_planes(x.shape, *known) else PORTABLE


def _keeps_planes(shape, out_shape, scales) -> bool:
    """Whether a resize leaves N and C as they are (a dim of `shape` None where unknown)."""
    return len(scales) == 4 and float(scales[0]) == 1.0 and float(scales[1]) == 1.0 \
        and all(o is None or o == d for o, d in zip(out_shape[:2], shape[:2]))


def _settle_resize(impl: OpImpl, x, out_shape, scales) -> None:
    """On a run after a plan that could not choose (`_RESIZE_BY_GEOMETRY`): what it chose."""
    if impl._lower_at_run:
        impl._lower_at_run = False
        served = resize_compiled_route(x, impl.mode, getattr(impl, "ct", "asymmetric")) \
            and _keeps_planes(x.shape, out_shape, scales) and x.size > 0 \
            and all(int(d) > 0 for d in out_shape)
        impl._chosen = compiled_rows(_RESIZE_COMPILED_WHY) if served else PORTABLE


@functools.lru_cache(maxsize=64)
def _compiled_plan(mode: str, ct: str, in_len: int, out_len: int, scale: float,
                   nearest_mode: str, cubic_a: float, exclude_outside: bool, antialias: bool):
    """One axis' plan for the compiled kernels: C-ordered int64 indices (out_len, taps) and
    float32 weights (None for nearest); an axis resize_nd skips is the identity (one tap of
    weight 1, which gives x's own bits). Read-only arrays, kept for the next call."""
    if _skips_axis(ct, in_len, out_len, scale, 0.0, 1.0):
        idx, w = np.arange(in_len, dtype=np.int64)[:, None], np.ones((in_len, 1))
    else:
        coords = _source_coords(ct, in_len, out_len, scale, 0.0, 1.0)
        idx, w = _axis_plan(mode, coords, in_len, scale, nearest_mode=nearest_mode,
                            cubic_a=cubic_a, exclude_outside=exclude_outside,
                            antialias=antialias)
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    idx.flags.writeable = False
    if mode == "nearest":
        return idx, None
    w = np.ascontiguousarray(w, dtype=np.float32)  # numpy's gathers multiply in float32 too
    w.flags.writeable = False
    return idx, w


def _resize_compiled(x, out_shape, scales, *, mode: str, ct: str, nearest_mode: str,
                     cubic_a: float, exclude_outside: bool, antialias: bool):
    """The resize of float32 x (N, C, H, W) to out_shape by the compiled kernels, or None
    where they do not serve (see `resize_compiled_route`; N and C resized; an empty axis)."""
    if not resize_compiled_route(x, mode, ct) or not _keeps_planes(x.shape, out_shape, scales) \
            or x.size == 0 or int(out_shape[2]) <= 0 or int(out_shape[3]) <= 0:
        return None
    nearest = mode == "nearest"
    last = channels_last(x)
    kernel = _compiled.jit(_RESIZE_KERNELS[nearest, last])
    if kernel is None:
        return None
    n, c, h, w = x.shape
    oh, ow = int(out_shape[2]), int(out_shape[3])
    options = (nearest_mode, float(cubic_a), bool(exclude_outside), bool(antialias))
    hidx, hw = _compiled_plan(mode, ct, h, oh, float(scales[2]), *options)
    widx, ww = _compiled_plan(mode, ct, w, ow, float(scales[3]), *options)
    if last:  # a convolution's channels-last image: resized in its layout, rows of C values
        pixels = x.transpose(0, 2, 3, 1)
        y = _tiles.empty((n, oh, ow, c))
        if nearest:
            _compiled.split_rows(kernel, n * oh, pixels, hidx[:, 0], widx[:, 0], y,
                                 ns_per_row=tuning.RESIZE_NS_PER_TAP * ow * c,
                                 piece=_resize_nearest_cl_piece)
        else:
            taps = (hidx.shape[1] * w + widx.shape[1] * ow) * c
            _compiled.split_rows(kernel, n * oh, pixels, hidx, hw, widx, ww, y,
                                 ns_per_row=tuning.RESIZE_NS_PER_TAP * taps,
                                 piece=_resize_cl_piece)
        return y.transpose(0, 3, 1, 2)
    planes = np.ascontiguousarray(x).reshape(n * c, h, w)
    y = _tiles.empty((n * c, oh, ow))
    if nearest:
        _compiled.split_rows(kernel, n * c * oh, planes, hidx[:, 0], widx[:, 0], y,
                             ns_per_row=tuning.RESIZE_NS_PER_TAP * ow,
                             piece=_resize_nearest_piece)
    else:
        taps = hidx.shape[1] * w + widx.shape[1] * ow  # a row's multiply-adds
        _compiled.split_rows(kernel, n * c * oh, planes, hidx, hw, widx, ww, y,
                             ns_per_row=tuning.RESIZE_NS_PER_TAP * taps, piece=_resize_piece)
    return y.reshape(n, c, oh, ow)


def _resize_piece(block, row0, row1):  # pragma: no cover - numba
    """`_resize_rows`' piece function (ops/cpu/compiled.py), its arguments rebuilt from the
    block `split_rows` made."""
    v = _compiled.array_at(block, (20,), np.int64)
    _resize_rows(_compiled.array_at(v[0], (v[1], v[2], v[3]), np.float32),
                 _compiled.array_at(v[4], (v[5], v[6]), np.int64),
                 _compiled.array_at(v[7], (v[8], v[9]), np.float32),
                 _compiled.array_at(v[10], (v[11], v[12]), np.int64),
                 _compiled.array_at(v[13], (v[14], v[15]), np.float32),
                 _compiled.array_at(v[16], (v[17], v[18], v[19]), np.float32), row0, row1)


def _resize_nearest_piece(block, row0, row1):  # pragma: no cover - numba
    """`_resize_nearest_rows`' piece function."""
    v = _compiled.array_at(block, (12,), np.int64)
    _resize_nearest_rows(_compiled.array_at(v[0], (v[1], v[2], v[3]), np.float32),
                         _compiled.array_at(v[4], (v[5],), np.int64),
                         _compiled.array_at(v[6], (v[7],), np.int64),
                         _compiled.array_at(v[8], (v[9], v[10], v[11]), np.float32),
                         row0, row1)


@_compiled.kernel_math
def _resize_rows(x, hidx, hw, widx, ww, y, row0, row1):  # pragma: no cover - numba
    """Output rows [row0, row1) of y (P, OH, OW), row r being row r % OH of plane r // OH:
    the H taps' weighted input rows summed into one row of W values, then each output value
    the W taps' weighted sum of it. resize_nd's order (H, then W, the taps in turn, each
    product rounded to float32 before it is added): no fastmath, so no fused multiply-adds."""
    oh, ow = y.shape[1], y.shape[2]
    w = x.shape[2]
    th, tw = hidx.shape[1], widx.shape[1]
    row = np.empty(w, np.float32)
    for r in range(row0, row1):
        p = r // oh
        oy = r - p * oh
        src = x[p, hidx[oy, 0]]
        wt = hw[oy, 0]
        for j in range(w):
            row[j] = src[j] * wt
        for t in range(1, th):
            src = x[p, hidx[oy, t]]
            wt = hw[oy, t]
            for j in range(w):
                row[j] = row[j] + src[j] * wt
        dst = y[p, oy]
        if tw == 2:  # bilinear: one expression, which LLVM vectorises with gathers
            for ox in range(ow):
                dst[ox] = row[widx[ox, 0]] * ww[ox, 0] + row[widx[ox, 1]] * ww[ox, 1]
        else:  # tap by tap over the whole row: loops LLVM vectorises, the same sums
            for ox in range(ow):
                dst[ox] = row[widx[ox, 0]] * ww[ox, 0]
            for t in range(1, tw):
                for ox in range(ow):
                    dst[ox] = dst[ox] + row[widx[ox, t]] * ww[ox, t]


@_compiled.kernel_math
def _resize_nearest_rows(x, hidx, widx, y, row0, row1):  # pragma: no cover - numba
    """Output rows [row0, row1) of a nearest resize: y[p, oy, ox] = x[p, hidx[oy], widx[ox]]."""
    oh, ow = y.shape[1], y.shape[2]
    for r in range(row0, row1):
        p = r // oh
        oy = r - p * oh
        src, dst = x[p, hidx[oy]], y[p, oy]
        for ox in range(ow):  # a uint64 index: no negative-index wraparound test per value
            dst[ox] = src[np.uint64(widx[ox])]


def _resize_cl_piece(block, row0, row1):  # pragma: no cover - numba
    """`_resize_channels_last_rows`' piece function."""
    v = _compiled.array_at(block, (22,), np.int64)
    _resize_channels_last_rows(
        _compiled.array_at(v[0], (v[1], v[2], v[3], v[4]), np.float32),
        _compiled.array_at(v[5], (v[6], v[7]), np.int64),
        _compiled.array_at(v[8], (v[9], v[10]), np.float32),
        _compiled.array_at(v[11], (v[12], v[13]), np.int64),
        _compiled.array_at(v[14], (v[15], v[16]), np.float32),
        _compiled.array_at(v[17], (v[18], v[19], v[20], v[21]), np.float32), row0, row1)


def _resize_nearest_cl_piece(block, row0, row1):  # pragma: no cover - numba
    """`_resize_nearest_channels_last_rows`' piece function."""
    v = _compiled.array_at(block, (14,), np.int64)
    _resize_nearest_channels_last_rows(
        _compiled.array_at(v[0], (v[1], v[2], v[3], v[4]), np.float32),
        _compiled.array_at(v[5], (v[6],), np.int64),
        _compiled.array_at(v[7], (v[8],), np.int64),
        _compiled.array_at(v[9], (v[10], v[11], v[12], v[13]), np.float32), row0, row1)


@_compiled.kernel_math
def _resize_channels_last_rows(x, hidx, hw, widx, ww, y, row0, row1):  # pragma: no cover
    """`_resize_rows` over channels-last images, x (N, H, W, C) and y (N, OH, OW, C): output
    row r is row r % OH of image r // OH, each pixel's C values computed together, with the
    same expression per value as `_resize_rows` (so the same bits)."""
    oh, ow = y.shape[1], y.shape[2]
    w, c = x.shape[2], x.shape[3]
    th, tw = hidx.shape[1], widx.shape[1]
    row = np.empty((w, c), np.float32)
    for r in range(row0, row1):
        n = r // oh
        oy = r - n * oh
        src = x[n, hidx[oy, 0]]
        wt = hw[oy, 0]
        for j in range(w):
            for ci in range(c):
                row[j, ci] = src[j, ci] * wt
        for t in range(1, th):
            src = x[n, hidx[oy, t]]
            wt = hw[oy, t]
            for j in range(w):
                for ci in range(c):
                    row[j, ci] = row[j, ci] + src[j, ci] * wt
        dst = y[n, oy]
        for ox in range(ow):
            first, wt = row[widx[ox, 0]], ww[ox, 0]
            out = dst[ox]
            for ci in range(c):
                out[ci] = first[ci] * wt
            for t in range(1, tw):
                tap, wt = row[widx[ox, t]], ww[ox, t]
                for ci in range(c):
                    out[ci] = out[ci] + tap[ci] * wt


@_compiled.kernel_math
def _resize_nearest_channels_last_rows(x, hidx, widx, y, row0, row1):  # pragma: no cover
    """`_resize_nearest_rows` over channels-last images: each output pixel's C values copied."""
    oh, ow, c = y.shape[1], y.shape[2], y.shape[3]
    for r in range(row0, row1):
        n = r // oh
        oy = r - n * oh
        src, dst = x[n, hidx[oy]], y[n, oy]
        for ox in range(ow):
            # an element loop: a slice assignment costs numba two views and a generic copy
            at = np.uint64(widx[ox])
            for ci in range(c):
                dst[ox, ci] = src[at, ci]


# (nearest, channels-last) -> the kernel
_RESIZE_KERNELS = {(False, False): _resize_rows, (True, False): _resize_nearest_rows,
                   (False, True): _resize_channels_last_rows,
                   (True, True): _resize_nearest_channels_last_rows}


def resize_nd(xp, x, out_shape, scales, *, mode: str, ct: str, nearest_mode: str,
              cubic_a: float = -0.75, exclude_outside: bool = False,
              extrapolation_value: float = 0.0, antialias: bool = False, roi=None):
    """Separable N-D resize. scales/out_shape/roi (starts, ends) cover every axis of x."""
    dt = x.dtype
    work_dt = _work_dtype(dt)
    if any(int(d) < 0 for d in out_shape):
        raise ValueError(f"the output shape {[int(d) for d in out_shape]} has a negative "
                         "dimension")
    # scales and sizes are data: the result (in the working type) is checked before any axis
    limits.check_shape(out_shape, work_dt if np.dtype(work_dt).itemsize > dt.itemsize else dt)
    if xp is np:
        y = _resize_compiled(x, out_shape, scales, mode=mode, ct=ct, nearest_mode=nearest_mode,
                             cubic_a=cubic_a, exclude_outside=exclude_outside,
                             antialias=antialias)
        if y is not None:
            return y
    result = x
    masks = []
    for axis in range(x.ndim):
        in_len, out_len, scale = x.shape[axis], int(out_shape[axis]), float(scales[axis])
        rs, re = (0.0, 1.0) if roi is None else (float(roi[0][axis]), float(roi[1][axis]))
        if _skips_axis(ct, in_len, out_len, scale, rs, re):
            continue
        if in_len == 0 or out_len == 0:
            shape = list(result.shape)
            shape[axis] = out_len
            result = xp.zeros(shape, dtype=result.dtype)
            continue
        coords = _source_coords(ct, in_len, out_len, scale, rs, re)
        idx, w = _axis_plan(mode, coords, in_len, scale, nearest_mode=nearest_mode,
                            cubic_a=cubic_a, exclude_outside=exclude_outside,
                            antialias=antialias)
        if ct == "tf_crop_and_resize":
            outside = (coords < 0) | (coords > in_len - 1)
            if outside.any():
                shape = [1] * x.ndim
                shape[axis] = out_len
                masks.append(outside.reshape(shape))
        if w is None and idx.shape[0] == in_len and np.array_equal(idx[:, 0], np.arange(in_len)):
            continue
        result = _apply_axis(xp, result, axis, idx, w, work_dt)
    if masks:
        mask = masks[0]
        for m in masks[1:]:
            mask = mask | m  # host arrays: the union is uploaded once
        result = xp.where(xp.asarray(mask), xp.asarray(extrapolation_value, dtype=result.dtype),
                          result)
    return _finish(xp, result, dt)


class _ResizeBase(OpImpl):
    def _check(self):
        self.mode = _to_str(self.mode)
        if self.mode == "bilinear":
            self.mode = "linear"
        if self.mode not in ("nearest", "linear", "cubic"):
            raise self.fail(f"unsupported mode '{self.mode}'")


@register("Resize", versions=[11, 13, 18, 19])
class Resize11(_ResizeBase):
    shape_inputs = (1, 2, 3)  # roi, scales, sizes

    def setup(self):
        self._check()
        self.ct = _to_str(self.coordinate_transformation_mode)
        if self.ct not in _CT_MODES:
            raise self.fail(f"unsupported coordinate_transformation_mode '{self.ct}'")
        self.nearest = _to_str(getattr(self, "nearest_mode", None) or "round_prefer_floor")
        if self.nearest not in _NEAREST_MODES[:4]:
            raise self.fail(f"unsupported nearest_mode '{self.nearest}'")
        self.policy = _to_str(getattr(self, "keep_aspect_ratio_policy", None) or "stretch")
        if self.policy not in ("stretch", "not_larger", "not_smaller"):
            raise self.fail(f"unsupported keep_aspect_ratio_policy '{self.policy}'")
        self.aa = bool(getattr(self, "antialias", 0) or 0) and self.mode != "nearest"

    def target(self, shape: tuple[int, ...], roi, scales, sizes):
        """(output shape, per-axis scales, roi as (starts, ends) or None) for an input of
        `shape`, from the scales or sizes input, `axes` and keep_aspect_ratio_policy."""
        r = len(shape)
        axes_attr = getattr(self, "axes", None)
        if axes_attr is None:
            axes = list(range(r))
        else:
            axes = [a + r if a < 0 else a for a in axes_attr]
            if any(not 0 <= a < r for a in axes) or len(set(axes)) != len(axes):
                raise self.fail(f"invalid axes {list(axes_attr)} for rank {r}")
        k = len(axes)
        if scales is not None and scales.size == 0:
            scales = None
        if sizes is not None and sizes.size == 0:
            sizes = None
        if (scales is None) == (sizes is None):
            raise self.fail("exactly one of 'scales' and 'sizes' must be given")
        full_scales = [1.0] * r
        out_shape = list(shape)
        if scales is not None:
            sc = np.asarray(scales).reshape(-1)
            if sc.size != k:
                raise self.fail(f"scales has {sc.size} entries, expected {k}")
            if np.any(sc.astype(np.float64) <= 0):
                raise self.fail("scales must be positive")
            for i, a in enumerate(axes):
                full_scales[a] = float(sc[i])
                out_shape[a] = int(np.float64(sc[i]) * shape[a])
        else:
            sz = np.asarray(sizes, dtype=np.int64).reshape(-1)
            if sz.size != k:
                raise self.fail(f"sizes has {sz.size} entries, expected {k}")
            ratios = [sz[i] / shape[a] if shape[a] else 1.0 for i, a in enumerate(axes)]
            if self.policy == "stretch":
                for i, a in enumerate(axes):
                    full_scales[a] = float(ratios[i])
                    out_shape[a] = int(sz[i])
            else:
                s = min(ratios) if self.policy == "not_larger" else max(ratios)
                for a in axes:
                    full_scales[a] = float(s)
                    out_shape[a] = int(math.floor(s * shape[a] + 0.5))
        roi_pair = None
        if self.ct == "tf_crop_and_resize":
            starts, ends = [0.0] * r, [1.0] * r
            if roi is not None and roi.size:
                rv = np.asarray(roi, dtype=np.float64).reshape(-1)
                if rv.size != 2 * k:
                    raise self.fail(f"roi has {rv.size} entries, expected {2 * k}")
                for i, a in enumerate(axes):
                    starts[a], ends[a] = rv[i], rv[k + i]
            roi_pair = (starts, ends)
        return out_shape, full_scales, roi_pair

    def lower(self, inputs):
        x = inputs[0]

        def known():
            values = [None if i >= len(inputs) or inputs[i] is None else inputs[i].value
                      for i in (1, 2, 3)]
            given = [v for v in values[1:] if v is not None and np.asarray(v).size]
            if not given or x.shape is None or not all(isinstance(d, int) for d in x.shape):
                return None  # the scales, the sizes or the input's shape come with the run
            out_shape, scales, _ = self.target(x.shape, *values)
            return out_shape, scales

        return resize_lowering(x, self.mode, self.ct, known)

    def options(self, roi_pair) -> dict:
        """The keyword arguments of resize_nd that come from the attributes."""
        return dict(mode=self.mode, ct=self.ct, nearest_mode=self.nearest,
                    cubic_a=float(self.cubic_coeff_a), exclude_outside=bool(self.exclude_outside),
                    extrapolation_value=float(self.extrapolation_value), antialias=self.aa,
                    roi=roi_pair)

    def run(self, x, roi=None, scales=None, sizes=None):
        out_shape, full_scales, roi_pair = self.target(x.shape, roi, scales, sizes)
        _settle_resize(self, x, out_shape, full_scales)
        return resize_nd(self.xp, x, out_shape, full_scales, **self.options(roi_pair))


def _upsample(impl: _ResizeBase, x: np.ndarray, scales) -> np.ndarray:
    sc = [float(s) for s in np.asarray(scales, dtype=np.float64).reshape(-1)]
    if len(sc) != x.ndim:
        raise impl.fail(f"scales has {len(sc)} entries, expected {x.ndim}")
    if any(s <= 0 for s in sc):
        raise impl.fail("scales must be positive")
    out_shape = [int(np.float64(s) * n) for s, n in zip(np.asarray(scales).reshape(-1), x.shape)]
    _settle_resize(impl, x, out_shape, sc)
    return resize_nd(impl.xp, x, out_shape, sc, mode=impl.mode, ct="asymmetric",
                     nearest_mode="simple")


@register("Resize", versions=[10])
class Resize10(_ResizeBase):
    shape_inputs = (1,)  # scales

    def setup(self):
        self._check()
        if self.mode == "cubic":
            raise self.fail("cubic mode needs Resize-11 or later")

    def lower(self, inputs):
        scales = inputs[1] if len(inputs) > 1 and inputs[1] is not None else None
        return self.lower_for(inputs[0], None if scales is None else scales.value)

    def lower_for(self, x, scales) -> Lowering:
        """The plan's choice for x (a Sketch) and scales (None where the run gives them)."""
        def known():
            if scales is None or x.shape is None:
                return None
            sc = [float(v) for v in np.asarray(scales, dtype=np.float64).reshape(-1)]
            return [None if not isinstance(d, int) else int(np.float64(s) * d)
                    for s, d in zip(sc, x.shape)], sc

        return resize_lowering(x, self.mode, "asymmetric", known)

    def run(self, x, scales):
        return _upsample(self, x, scales)


@register("Upsample", versions=[9, 10])
class Upsample9(Resize10):
    pass


@register("Upsample", versions=[7])
class Upsample7(Resize10):
    def lower(self, inputs):
        return self.lower_for(inputs[0], np.asarray(self.scales, dtype=np.float32))

    def run(self, x):
        return _upsample(self, x, np.asarray(self.scales, dtype=np.float32))


@register("Upsample", versions=[1])
class Upsample1(Resize10):
    def lower(self, inputs):
        return self.lower_for(inputs[0], np.array([1.0, 1.0, self.height_scale,
                                                   self.width_scale], dtype=np.float32))

    def run(self, x):
        if x.ndim != 4:
            raise self.fail("Upsample-1 takes a 4-D input")
        sc = np.array([1.0, 1.0, self.height_scale, self.width_scale], dtype=np.float32)
        return _upsample(self, x, sc)


# ----------------------------------------------------------------------------------------------
# GridSample, AffineGrid


def _reflect(xp, v, lo: float, hi: float):
    rng = hi - lo
    if rng <= 0:
        return xp.full_like(v, lo)
    below, above = v < lo, v > hi
    dx = xp.where(below, lo - v, xp.where(above, v - hi, 0))
    n = xp.floor(dx / rng)
    r = dx - n * rng
    even = (n % 2) == 0
    from_below = xp.where(even, lo + r, hi - r)
    from_above = xp.where(even, hi - r, lo + r)
    return xp.where(below, from_below, xp.where(above, from_above, v))


@register("GridSample", versions=[16, 20, 22])
class GridSample(OpImpl):
    def setup(self):
        mode = _to_str(self.mode)
        self.kind = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
        if self.kind not in ("nearest", "linear", "cubic"):
            raise self.fail(f"unsupported mode '{mode}'")
        self.pad = _to_str(self.padding_mode)
        if self.pad not in ("zeros", "border", "reflection"):
            raise self.fail(f"unsupported padding_mode '{self.pad}'")

    def run(self, x, grid):
        xp = self.xp
        n, c = x.shape[:2]
        dims = x.shape[2:]
        r = len(dims)
        if grid.shape[0] != n or grid.shape[-1] != r or grid.ndim != r + 2:
            raise self.fail(f"grid shape {grid.shape} does not match input shape {x.shape}")
        if self.version < 20 and r != 2:
            raise self.fail("GridSample-16 takes 4-D inputs")
        out_sp = grid.shape[1:-1]
        cdt = grid.dtype if grid.dtype in (np.float32, np.float64) else np.dtype(np.float32)
        g = grid.astype(cdt, copy=False).reshape(n, -1, r)
        m = g.shape[1]
        align = bool(self.align_corners)
        work_dt = _work_dtype(x.dtype)
        # Per spatial dim i (order D1..Dr), coordinate comes from grid[..., r-1-i].
        taps_per_dim = []
        for i, d in enumerate(dims):
            gi = g[:, :, r - 1 - i]
            if align:
                xc = (gi + 1) / 2 * (d - 1)
                lo, hi = 0.0, float(d - 1)
            else:
                xc = ((gi + 1) * d - 1) / 2
                lo, hi = -0.5, d - 0.5
            if self.kind == "nearest":
                xc = xp.rint(xc)
            out = (xc < lo) | (xc > hi)
            if self.pad == "border" and self.kind != "cubic":
                # (cubic clamps each of its four taps instead, as onnxruntime and torch do)
                xc = xp.where(out, xp.clip(xc, 0, d - 1), xc)
            elif self.pad == "reflection":
                xc = xp.where(out, _reflect(xp, xc, lo, hi), xc)
            if self.kind == "nearest":
                offs = [(xc.astype(np.int64), None)]
            else:
                base = xp.floor(xc)
                t = xc - base
                b = base.astype(np.int64)
                if self.kind == "linear":
                    offs = [(b, 1 - t), (b + 1, t)]
                else:
                    ws = [_cubic_kernel(xp, t + 1, -0.75), _cubic_kernel(xp, t, -0.75),
                          _cubic_kernel(xp, 1 - t, -0.75), _cubic_kernel(xp, 2 - t, -0.75)]
                    offs = [(b + k - 1, ws[k]) for k in range(4)]
            resolved = []
            for idx, w in offs:
                if self.pad == "zeros":
                    valid = (idx >= 0) & (idx < d)
                    idx = xp.clip(idx, 0, d - 1)
                    w = valid.astype(cdt) if w is None else xp.where(valid, w, 0)
                elif self.pad == "border":
                    idx = xp.clip(idx, 0, d - 1)
                else:
                    idx = xp.clip(_reflect(xp, idx.astype(np.float64), lo, hi).astype(np.int64),
                                  0, d - 1)
                resolved.append((idx, w))
            taps_per_dim.append(resolved)
        xf = x.reshape(n, c, -1)
        strides = np.cumprod((1,) + tuple(dims[::-1]))[:-1][::-1]
        acc = None
        for combo in np.ndindex(*[len(t) for t in taps_per_dim]):
            flat = xp.zeros((n, m), dtype=np.int64)
            weight = None
            for i, k in enumerate(combo):
                idx, w = taps_per_dim[i][k]
                flat += idx * int(strides[i])
                if w is not None:
                    weight = w if weight is None else weight * w
            vals = xp.take_along_axis(xf, flat[:, None, :], axis=2)
            if weight is not None:
                vals = vals.astype(work_dt, copy=False) * weight[:, None, :].astype(work_dt)
            acc = vals if acc is None else acc + vals
        return _finish(xp, acc, x.dtype).reshape((n, c) + tuple(out_sp))


@register("AffineGrid", versions=[20])
class AffineGrid(OpImpl):
    shape_inputs = (1,)

    def run(self, theta, size):
        xp = self.xp
        size = [int(s) for s in np.asarray(size).reshape(-1)]
        n = theta.shape[0]
        sp = size[2:]
        r = len(sp)
        if r not in (2, 3) or theta.shape[1:] != (r, r + 1):
            raise self.fail(f"theta shape {theta.shape} does not match size {size}")
        if any(k < 0 for k in sp):
            raise self.fail(f"size {size} has a negative dimension")
        dt = theta.dtype
        limits.check_shape((n,) + tuple(sp) + (r + 1,), np.float64)  # the size is data

        def lin(k):
            if self.align_corners:
                return xp.linspace(-1, 1, k) if k > 1 else xp.zeros(k)
            return (xp.arange(k, dtype=np.float64) * 2 + 1) / k - 1

        axes = [lin(k) for k in sp]  # D, H, W order
        mesh = xp.meshgrid(*axes, indexing="ij")
        coords = [m.astype(dt) for m in mesh[::-1]]  # x (W), y (H), z (D)
        base = xp.stack(coords + [xp.ones(tuple(sp), dtype=dt)], axis=-1)  # (*sp, r+1)
        base = base.reshape(-1, r + 1)
        out = xp.einsum("pk,njk->npj", base, theta)
        return out.reshape((n,) + tuple(sp) + (r,)).astype(dt, copy=False)


# ----------------------------------------------------------------------------------------------
# RoiAlign


def _roi_axis_samples(start: float, bin_size: float, out_len: int, grid: int, limit: int):
    """Bilinear taps for one axis: low/high indices and weights, shape (out_len, grid), host
    arrays (from one roi's geometry)."""
    p = np.arange(out_len, dtype=np.float64)[:, None]
    g = np.arange(grid, dtype=np.float64)[None, :]
    y = start + p * bin_size + (g + 0.5) * bin_size / grid
    invalid = (y < -1.0) | (y > limit)
    y = np.maximum(y, 0.0)
    low = np.floor(y).astype(np.int64)
    at_end = low >= limit - 1
    low = np.where(at_end, limit - 1, low)
    high = np.where(at_end, limit - 1, low + 1)
    y = np.where(at_end, low.astype(np.float64), y)
    ly = y - low
    hy = 1.0 - ly
    hy = np.where(invalid, 0.0, hy)
    ly = np.where(invalid, 0.0, ly)
    return low, high, hy, ly


@register("RoiAlign", versions=[10, 16, 22])
class RoiAlign(OpImpl):
    def setup(self):
        self.avg = _to_str(self.mode) == "avg"
        if _to_str(self.mode) not in ("avg", "max"):
            raise self.fail(f"unsupported mode '{self.mode}'")
        ct = _to_str(getattr(self, "coordinate_transformation_mode", None) or "output_half_pixel")
        if ct not in ("half_pixel", "output_half_pixel"):
            raise self.fail(f"unsupported coordinate_transformation_mode '{ct}'")
        self.half_pixel = ct == "half_pixel"
        if not math.isfinite(float(self.spatial_scale)):
            raise self.fail(f"spatial_scale must be finite, got {self.spatial_scale}")

    def run(self, x, rois, batch_indices):
        xp = self.xp
        n, c, h, w = x.shape
        oh, ow = int(self.output_height), int(self.output_width)
        k = rois.shape[0]
        dt = x.dtype
        work_dt = _work_dtype(dt)
        if oh < 1 or ow < 1:
            raise self.fail(f"output_height and output_width must be positive, got {oh}, {ow}")
        limits.check_shape((k, c, oh, ow), work_dt)
        out = xp.zeros((k, c, oh, ow), dtype=work_dt)
        scale = float(self.spatial_scale)
        off = 0.5 if self.half_pixel else 0.0
        # each roi's geometry (sample counts, tap positions) is worked out on the host
        bidx = _xp.to_host(xp, batch_indices).reshape(-1).astype(np.int64, copy=False)
        rv = _xp.to_host(xp, rois).astype(np.float64, copy=False)
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.isfinite(rv * scale).all()
        if not finite:  # a box at no place has samples at no index
            raise self.fail("rois (times spatial_scale) must be finite")
        for i in range(k):
            b = int(bidx[i])
            if not 0 <= b < n:
                raise self.fail(f"batch index {b} out of range")
            x1, y1, x2, y2 = rv[i] * scale - off
            rw, rh = x2 - x1, y2 - y1
            if not self.half_pixel:
                rw, rh = max(rw, 1.0), max(rh, 1.0)
            bh, bw = rh / oh, rw / ow
            sr = int(self.sampling_ratio)
            gh = sr if sr > 0 else int(math.ceil(rh / oh))
            gw = sr if sr > 0 else int(math.ceil(rw / ow))
            count = max(gh * gw, 1)
            limits.check_shape((oh * gh, ow * gw), work_dt)  # a huge box's adaptive samples
            yl, yh, why, wly = _roi_axis_samples(y1, bh, oh, gh, h)
            xl, xh, whx, wlx = _roi_axis_samples(x1, bw, ow, gw, w)
            img = x[b].astype(work_dt, copy=False)
            if self.avg:
                # Separable: out = Wy @ img @ Wx^T with the taps summed into dense matrices.
                wy = np.zeros((oh, h))
                rows = np.broadcast_to(np.arange(oh)[:, None], yl.shape)
                np.add.at(wy, (rows, yl), why)
                np.add.at(wy, (rows, yh), wly)
                wx = np.zeros((ow, w))
                cols = np.broadcast_to(np.arange(ow)[:, None], xl.shape)
                np.add.at(wx, (cols, xl), whx)
                np.add.at(wx, (cols, xh), wlx)
                out[i] = xp.einsum("ph,chw,qw->cpq", xp.asarray(wy.astype(work_dt)), img,
                                   xp.asarray(wx.astype(work_dt))) / count
            else:
                # max over samples of the largest weighted bilinear tap
                best = None
                for yi, wyv in ((yl, why), (yh, wly)):
                    for xi, wxv in ((xl, whx), (xh, wlx)):
                        v = img[:, xp.asarray(yi[:, :, None, None]),
                                xp.asarray(xi[None, None, :, :])]  # c,oh,gh,ow,gw
                        v = v * xp.asarray((wyv[:, :, None, None] * wxv[None, None, :, :])
                                           .astype(work_dt))
                        best = v if best is None else xp.maximum(best, v)
                out[i] = best.max(axis=(2, 4))
        return _finish(xp, out, dt)


# ----------------------------------------------------------------------------------------------
# NonMaxSuppression


@register("NonMaxSuppression", versions=[10, 11])
class NonMaxSuppression(OpImpl):
    shape_inputs = (2, 3, 4)  # the scalar limits

    def run(self, boxes, scores, max_output_boxes_per_class=None, iou_threshold=None,
            score_threshold=None):
        # a greedy, data-dependent selection loop: it runs on the host, on host copies of the
        # boxes and scores (a no-op on the CPU), and the selected indices go back to `xp`
        xp = self.xp
        boxes, scores = _xp.to_host(xp, boxes), _xp.to_host(xp, scores)
        max_out = 0 if max_output_boxes_per_class is None or max_output_boxes_per_class.size == 0 \
            else int(np.asarray(max_output_boxes_per_class).reshape(-1)[0])
        iou_t = 0.0 if iou_threshold is None or iou_threshold.size == 0 \
            else float(np.asarray(iou_threshold).reshape(-1)[0])
        score_t = None if score_threshold is None or score_threshold.size == 0 \
            else float(np.asarray(score_threshold).reshape(-1)[0])
        nb, nc, ns = scores.shape
        if boxes.shape[0] != nb or boxes.shape[1] != ns or boxes.shape[2] != 4:
            raise self.fail(f"boxes shape {boxes.shape} does not match scores {scores.shape}")
        selected = []
        if max_out > 0:
            bx = boxes.astype(np.float64)
            if self.center_point_box:
                xc, yc, bw, bh = bx[..., 0], bx[..., 1], bx[..., 2], bx[..., 3]
                y1, y2 = yc - bh / 2, yc + bh / 2
                x1, x2 = xc - bw / 2, xc + bw / 2
            else:
                y1 = np.minimum(bx[..., 0], bx[..., 2])
                y2 = np.maximum(bx[..., 0], bx[..., 2])
                x1 = np.minimum(bx[..., 1], bx[..., 3])
                x2 = np.maximum(bx[..., 1], bx[..., 3])
            area = (y2 - y1) * (x2 - x1)
            for b in range(nb):
                for c in range(nc):
                    sc = scores[b, c].astype(np.float64)
                    cand = np.arange(ns)
                    if score_t is not None:
                        cand = cand[sc[cand] > score_t]
                    order = cand[np.argsort(-sc[cand], kind="stable")]
                    picked = 0
                    while order.size and picked < max_out:
                        i = order[0]
                        selected.append((b, c, i))
                        picked += 1
                        rest = order[1:]
                        ih = np.maximum(0.0, np.minimum(y2[b, i], y2[b, rest])
                                        - np.maximum(y1[b, i], y1[b, rest]))
                        iw = np.maximum(0.0, np.minimum(x2[b, i], x2[b, rest])
                                        - np.maximum(x1[b, i], x1[b, rest]))
                        inter = ih * iw
                        union = area[b, i] + area[b, rest] - inter
                        iou = np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
                        order = rest[iou <= iou_t]
        return xp.asarray(np.array(selected, dtype=np.int64).reshape(-1, 3))


# ----------------------------------------------------------------------------------------------
# ImageDecoder: image codecs are Pillow's (the optional `image` extra); writing our own JPEG,
# PNG, WebP and JPEG 2000 decoders would be more code, slower and less robust.


@register("ImageDecoder", versions=[20])
class ImageDecoder(OpImpl):
    _PIL_MODES = {"RGB": "RGB", "BGR": "RGB", "Grayscale": "L"}

    def setup(self):
        self.fmt = _to_str(self.pixel_format)
        if self.fmt not in self._PIL_MODES:
            raise self.fail(f"unsupported pixel_format '{self.fmt}'")

    def run(self, encoded):
        import io

        from ember.errors import BackendUnavailableError

        try:
            from PIL import Image, UnidentifiedImageError
        except ImportError:
            raise BackendUnavailableError(
                "ImageDecoder needs Pillow: pip install 'ember[image]'") from None
        data = np.ascontiguousarray(encoded, dtype=np.uint8).tobytes()
        try:
            with Image.open(io.BytesIO(data)) as img:
                pixels = np.asarray(img.convert(self._PIL_MODES[self.fmt]))
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            # The spec: a stream that cannot be decoded gives an empty matrix.
            return np.zeros((0, 0, 1 if self.fmt == "Grayscale" else 3), dtype=np.uint8)
        if self.fmt == "Grayscale":
            return pixels[:, :, None]
        return np.ascontiguousarray(pixels[:, :, ::-1] if self.fmt == "BGR" else pixels)

"""Pooling: MaxPool (with Indices), AveragePool, LpPool, their Global forms, and MaxUnpool.

Windowed pools are N-D and separable: the window reduction (max or sum) runs one spatial axis at
a time, as a loop over that axis's kernel taps, each tap one strided slice combined into the
running result with a vectorised max / add; padding is never materialised (taps touch only the
outputs whose input lies inside the tensor). The first combine of an axis writes the new array
(no copy of a tap first), intermediate arrays keep the input's memory order (channels-last
data stays so), and on the CPU the last, contiguous axis runs over all rows laid end to end
(`_reduce_last_flat`: long SIMD loops instead of one short loop per row, and stride 2 as a
stride-1 pass plus one strided pick). MaxPool's Indices output uses a tap loop over the padded
input that remembers the winning tap. No loop ever runs over output pixels in numpy.

With numba (ops/cpu/compiled.py), a float 2-D MaxPool without Indices runs compiled instead
(`_maxpool2d`): one pass over the output, each window read where it lies in the input, where
the separable passes write and reread a whole intermediate array per axis.
"""
from __future__ import annotations

import math

import numpy as np

from ember import limits
from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops import _xp
from ember.ops._layout import channels_last
from ember.ops.conv import (auto_pads, check_window_attributes, compute_dtype, ints, out_size,
                            pad_array, remembered_geometry, tap_slices, window3x3_offsets)
from ember.ops._lowering import numba_serves
from ember.ops.registry import Lowering, PORTABLE, OpImpl, register


class _WindowPool(OpImpl):
    """Geometry shared by the windowed pools."""

    def setup(self):
        check_window_attributes(self)

    def geometry(self, x):
        """(kernel, strides, dilations, pads begin, pads end, effective end, output sizes)."""
        return remembered_geometry(self, x.shape, lambda: self._geometry(x))

    def _geometry(self, x):
        n = x.ndim - 2
        if n < 1:
            raise self.fail(f"input must have rank >= 3, got shape {x.shape}")
        kernel = ints(self.kernel_shape, n, 1)
        if len(kernel) != n:
            raise self.fail(f"kernel_shape {kernel} does not match input rank {x.ndim}")
        strides = ints(getattr(self, "strides", None), n, 1)
        dilations = ints(getattr(self, "dilations", None), n, 1)
        ceil_mode = bool(getattr(self, "ceil_mode", 0) or 0)
        in_sp = list(x.shape[2:])
        try:
            begin, end = auto_pads(getattr(self, "auto_pad", "NOTSET"), in_sp, kernel, strides,
                                   dilations, getattr(self, "pads", None))
        except ValueError as exc:
            raise self.fail(str(exc)) from None
        auto = getattr(self, "auto_pad", "NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else (auto or "NOTSET")
        outs = out_size(in_sp, kernel, strides, dilations, begin, end,
                        ceil_mode and auto in ("NOTSET", ""))
        limits.check_shape(x.shape[:2] + tuple(outs), x.dtype)  # pads and strides are data
        # pad far enough at the end for every window (ceil mode can reach past `end`)
        end_eff = [max(0, (o - 1) * s + (k - 1) * d + 1 - i - b) if o > 0 else e
                   for o, s, k, d, i, b, e in zip(outs, strides, kernel, dilations, in_sp, begin,
                                                  end)]
        return kernel, strides, dilations, begin, end, end_eff, outs

    @staticmethod
    def reduce_separable(xp, x, kernel, strides, dilations, begin, outs, combine, fill):
        """Window reduction (max or sum) of the unpadded input, one spatial axis at a time, so a
        k1 x k2 window costs k1 + k2 slice operations instead of k1 * k2. Padding is never
        materialised: each tap only touches the outputs whose input lies inside the tensor,
        and outputs no tap reaches keep `fill` (the reduction's identity)."""
        y, owned = x, False
        lead = x.ndim - len(kernel)
        for i, (k, s, d, o, b) in enumerate(zip(kernel, strides, dilations, outs, begin)):
            ax = lead + i
            n_in = y.shape[ax]
            shape = list(y.shape)
            shape[ax] = o
            limits.check_shape(shape, y.dtype, "intermediate window reduction")
            if ax == y.ndim - 1 and xp is np:
                flat = _reduce_last_flat(y, k, s, d, b, o, combine, fill)
                if flat is not None:
                    y, owned = flat, True
                    continue
            spans = []
            for t in _touching_taps(k, s, d, o, b, n_in):
                off = t * d - b  # input index of output 0's tap t
                lo = max(0, -(off // s) if off < 0 else 0)
                hi = min(o, (n_in - 1 - off) // s + 1) if n_in - 1 - off >= 0 else 0
                if hi > lo:
                    spans.append((lo, hi, off))
            full = next((sp for sp in spans if sp[0] == 0 and sp[1] == o), None)
            if full is not None:
                spans.remove(full)
                acc = _take(y, ax, full, s)  # a view: only ours if y was
                if spans:
                    # the first combine writes a new array (no copy of the full tap first):
                    # over the second tap's span, then the full tap's values outside it
                    lo, hi, off = spans.pop(0)
                    first = acc
                    acc, owned = xp.empty_like(y, shape=shape), True  # y's memory order
                    dst = [slice(None)] * y.ndim
                    dst[ax] = slice(lo, hi)
                    combine(first[tuple(dst)], _take(y, ax, (lo, hi, off), s),
                            out=acc[tuple(dst)])
                    for a0, a1 in ((0, lo), (hi, o)):
                        if a1 > a0:
                            dst[ax] = slice(a0, a1)
                            acc[tuple(dst)] = first[tuple(dst)]
            else:
                acc, owned = xp.full_like(y, fill, shape=shape), True
            for lo, hi, off in spans:
                dst = [slice(None)] * y.ndim
                dst[ax] = slice(lo, hi)
                view = acc[tuple(dst)]
                combine(view, _take(y, ax, (lo, hi, off), s), out=view)
            y = acc
        return y if owned else y.copy()

    @staticmethod
    def taps(kernel, strides, dilations, outs):
        for taps in np.ndindex(*kernel):
            yield taps, (slice(None), slice(None)) + tap_slices(taps, strides, dilations, outs)


def _touching_taps(k: int, s: int, d: int, o: int, b: int, n_in: int) -> range:
    """The taps of a k-tap window (stride s, dilation d, begin padding b, o outputs) that
    reach the input for at least one output: tap t reads input t*d - b + j*s for outputs j in
    [0, o). The others read only padding, so the loop skips them: with a kernel of 2**40 taps
    over a small input only the few taps that touch it run."""
    if o <= 0 or n_in <= 0:
        return range(0)
    first = max(0, -(-(b - (o - 1) * s) // d))  # t*d - b + (o-1)*s >= 0
    last = min(k - 1, (n_in - 1 + b) // d)     # t*d - b <= n_in - 1
    return range(first, last + 1)


def _reduce_last_flat(y, k, s, d, b, o, combine, fill):
    """The window reduction along y's last (contiguous) axis with every row laid end to end:
    each tap is one long contiguous slice of the flattened array (SIMD loops, not one short
    loop per row, and no strided reads at stride 2: the stride-1 result is computed, then
    every s-th column taken). Positions whose window crosses a row end are the few edge
    columns, recomputed one by one. None where this does not apply (the caller's per-axis
    loop then runs)."""
    n = y.shape[-1]
    o1 = (o - 1) * s + 1                     # stride-1 outputs covering the strided ones
    ua, ub = b, min(o1 - 1, n - 1 + b - (k - 1) * d)   # columns whose taps all lie in the row
    if k < 2 or o < 1 or b < 0 or o1 > n or ua > ub or not y.flags.c_contiguous or y.size == 0:
        return None
    R = y.size // n
    buf = np.empty(y.shape[:-1] + (n,), y.dtype)
    yf, bf = y.reshape(-1), buf.reshape(-1)
    start, length = ua, (R - 1) * n + ub - ua + 1
    out = bf[start:start + length]
    combine(yf[start - b:start - b + length], yf[start - b + d:start - b + d + length], out=out)
    for t in range(2, k):
        combine(out, yf[start - b + t * d:start - b + t * d + length], out=out)
    for u in list(range(0, ua)) + list(range(ub + 1, o1)):
        if u % s:
            continue  # not an output column
        cols = [u - b + t * d for t in range(k) if 0 <= u - b + t * d < n]
        col = buf[..., u]
        if not cols:
            col[...] = fill
            continue
        if len(cols) == 1:
            col[...] = y[..., cols[0]]
            continue
        combine(y[..., cols[0]], y[..., cols[1]], out=col)
        for c in cols[2:]:
            combine(col, y[..., c], out=col)
    if s == 1:
        return buf if o1 == n else buf[..., :o1]
    return np.ascontiguousarray(buf[..., :o1:s])


def _take(y, ax, span, s):
    """The inputs of outputs lo..hi-1 along axis `ax` for the tap whose offset is `off`."""
    lo, hi, off = span
    idx = [slice(None)] * y.ndim
    idx[ax] = slice(lo * s + off, (hi - 1) * s + off + 1, s)
    return y[tuple(idx)]


def _lowest(dtype):
    if dtype.kind == "f" or dtype.kind == "V" or dtype.name == "bfloat16":
        return -np.inf
    return np.iinfo(dtype).min


_MAXPOOL_COMPILED = Lowering("cpu.compiled", "compiled 2-D max pool by rows of output")


@register("MaxPool", versions=[1, 8, 10, 11, 12, 22])
class MaxPool(_WindowPool):
    def lower(self, inputs):
        x = inputs[0]
        if x is not None and x.ndim == 4 and x.dtype in _COMPILED_TYPES \
                and self.n_outputs == 1 and numba_serves():
            return Lowering("by layout", "compiled 2-D max pool: rows of a channels-last "
                            "input, or float planes at stride 2 (seen in the run); else numpy")
        return PORTABLE

    def run(self, x):
        xp = self.xp
        kernel, strides, dilations, begin, end, end_eff, outs = self.geometry(x)
        N, C = x.shape[:2]
        in_sp = x.shape[2:]
        want_idx = self.n_outputs > 1
        if xp is np and not want_idx and x.ndim == 4 and x.dtype in _COMPILED_TYPES:
            out = _maxpool2d(x, kernel, strides, dilations, begin, outs)
            self._chosen = PORTABLE if out is None else _MAXPOOL_COMPILED
            if out is not None:
                return out
        self._chosen = PORTABLE
        work = x if x.dtype.kind in "fiu" else x.astype(np.float32)
        if not want_idx:
            out = self.reduce_separable(xp, work, kernel, strides, dilations, begin, outs,
                                        np.maximum, _lowest(work.dtype))
            return out.astype(x.dtype, copy=False)
        if 0 in outs:  # no window: nothing to reduce (and no tap loop over a huge kernel)
            return xp.zeros((N, C, *outs), x.dtype), xp.zeros((N, C, *outs), np.int64)
        padded = pad_array(xp, work, begin, end_eff, _lowest(work.dtype))
        # with Indices: a tap loop remembering which tap won (the first one on ties)
        out = None
        best = None
        for t, (taps, sl) in enumerate(self.taps(kernel, strides, dilations, outs)):
            v = padded[sl]
            if out is None:
                out = v.copy()
                best = xp.zeros(out.shape, np.int64)
                continue
            better = v > out
            xp.copyto(out, v, where=better)
            best[better] = t
        if out is None:
            out = xp.zeros((N, C, *outs), work.dtype)
        out = out.astype(x.dtype, copy=False)
        # flat index (into the unpadded input) of each selected element
        tap_coords = xp.asarray(np.array(list(np.ndindex(*kernel)), np.int64)
                                .reshape(-1, len(kernel)))
        n = len(kernel)
        column_major = int(getattr(self, "storage_order", 0) or 0) == 1
        if column_major:
            sp_strides = [math.prod(in_sp[:i]) for i in range(n)]
        else:
            sp_strides = [math.prod(in_sp[i + 1:]) for i in range(n)]
        idx = xp.arange(N * C, dtype=np.int64).reshape(N, C, *([1] * n)) * math.prod(in_sp)
        idx = xp.broadcast_to(idx, out.shape).copy()
        for i in range(n):
            shape = [1] * (n + 2)
            shape[2 + i] = outs[i]
            pos = (xp.arange(outs[i], dtype=np.int64) * strides[i] - begin[i]).reshape(shape)
            if best is not None:
                pos = pos + tap_coords[best, i] * dilations[i]
            idx += pos * sp_strides[i]
        return out, idx


# ---------------------------------------------------------------- compiled 2-D MaxPool (numba)
# A max that lets NaN through as np.maximum does: a NaN tap replaces the running max, and a
# NaN running max stays. Windows wholly in the padding give -inf, as the numpy kernel's fill.


# the types of the compiled 2-D MaxPool: floats, and the 8-bit images of quantised CNNs
_COMPILED_TYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.uint8, np.int8))


def _maxpool2d(x, kernel, strides, dilations, begin, outs):
    """The compiled 2-D MaxPool of x (N, C, H, W), or None without numba (or for an 8-bit x
    not channels-last). A channels-last input gives a channels-last result (a (N, C, Oh, Ow)
    view); a float input of any other layout is read as contiguous planes."""
    N, C = x.shape[:2]
    (oh, ow), taps = outs, kernel[0] * kernel[1]
    geometry = (*kernel, *strides, *begin, *dilations)
    if channels_last(x):
        rows_kernel = _compiled.jit(_maxpool2d_channels_last_rows)
        if rows_kernel is None:
            return None
        out = _tiles.empty((N, oh, ow, C), x.dtype)
        _compiled.split_rows(rows_kernel, N * oh, x.transpose(0, 2, 3, 1), out, *geometry,
                             _lowest(x.dtype), ns_per_row=tuning.MAXPOOL_NS * ow * C * taps,
                             piece=_CHANNELS_LAST_PIECES.get(x.dtype.type))
        return out.transpose(0, 3, 1, 2)
    # planes: only stride 2 along the rows (CNNs' downsampling pools); at stride 1 numpy's
    # flat passes (_reduce_last_flat) are faster than this
    rows_kernel = _compiled.jit(_maxpool2d_plane_rows) \
        if strides[1] == 2 and x.dtype.kind == "f" else None
    if rows_kernel is None:
        return None
    planes = np.ascontiguousarray(x).reshape(N * C, *x.shape[2:])
    out = _tiles.empty((N * C, oh, ow), x.dtype)
    _compiled.split_rows(rows_kernel, N * C, planes, out, *geometry,
                         ns_per_row=tuning.MAXPOOL_NS * oh * ow * taps)
    return out.reshape(N, C, oh, ow)


@_compiled.kernel_math
def _max_or_nan(a, m):
    """m with tap a: a if it is larger or NaN (np.maximum's NaN; a tie keeps m, the earlier
    tap's)."""
    return a if (a > m or a != a) else m


@_compiled.kernel_math
def _maxpool2d_channels_last_rows(x4, out4, kh, kw, sh, sw, ph, pw, dh, dw, lowest, row0, row1
                                  ):  # pragma: no cover - numba
    """Rows [row0, row1) of out (N, Oh, Ow, C), n = row // Oh: the max over each window of
    x (N, H, W, C), `lowest` where a window lies wholly in the padding, the channel loop
    innermost (contiguous, vectorised). A 3x3 or 2x2 window
    wholly inside x is one expression over its taps' flat offsets (much faster than a running
    max per tap over row views, which LLVM leaves scalar); the other windows take their valid
    taps one at a time."""
    N, H, W, C = x4.shape
    Oh, Ow = out4.shape[1], out4.shape[2]
    x, out = x4.reshape(-1), out4.reshape(-1)
    uC = np.uint64(C)  # unsigned offsets: no negative-index wraparound in the loads
    for row in range(row0, row1):
        n, oh = row // Oh, row % Oh
        r0 = oh * sh - ph
        rows_inside = r0 >= 0 and r0 + (kh - 1) * dh < H
        for ow in range(Ow):
            q0 = ow * sw - pw
            o = np.uint64(((n * Oh + oh) * Ow + ow) * C)
            inside = rows_inside and q0 >= 0 and q0 + (kw - 1) * dw < W
            if inside and kh == 3 and kw == 3:
                a0, a1, a2, m0, m1, m2, z0, z1, z2 = window3x3_offsets(
                    x4.shape, n, r0, q0, dh, dw)
                for c in range(uC):
                    m = _max_or_nan(x[a1 + c], x[a0 + c])
                    m = _max_or_nan(x[a2 + c], m)
                    m = _max_or_nan(x[m0 + c], m)
                    m = _max_or_nan(x[m1 + c], m)
                    m = _max_or_nan(x[m2 + c], m)
                    m = _max_or_nan(x[z0 + c], m)
                    m = _max_or_nan(x[z1 + c], m)
                    out[o + c] = _max_or_nan(x[z2 + c], m)
                continue
            if inside and kh == 2 and kw == 2:   # a 3x3 window's first two rows and columns
                a0, a1, _, m0, m1, _, _, _, _ = window3x3_offsets(x4.shape, n, r0, q0, dh, dw)
                for c in range(uC):
                    m = _max_or_nan(x[a1 + c], x[a0 + c])
                    m = _max_or_nan(x[m0 + c], m)
                    out[o + c] = _max_or_nan(x[m1 + c], m)
                continue
            for c in range(uC):
                out[o + c] = lowest
            for i in range(kh):
                r = r0 + i * dh
                if r < 0 or r >= H:
                    continue
                for j in range(kw):
                    q = q0 + j * dw
                    if q < 0 or q >= W:
                        continue
                    at = np.uint64(((n * H + r) * W + q) * C)
                    for c in range(uC):
                        out[o + c] = _max_or_nan(x[at + c], out[o + c])


# The channels-last kernel's piece functions (ops/cpu/compiled.py: the helpers run its pieces
# without Python, where a Python job would wait for the GIL), one per dtype, the arguments
# from the block.
@_compiled.kernel_math
def _channels_last_piece(block, row0, row1, dtype):  # pragma: no cover - numba
    v = _compiled.array_at(block, (18,), np.int64)
    _maxpool2d_channels_last_rows(
        _compiled.array_at(v[0], (v[1], v[2], v[3], v[4]), dtype),
        _compiled.array_at(v[5], (v[6], v[7], v[8], v[9]), dtype),
        v[10], v[11], v[12], v[13], v[14], v[15], v[16], v[17], dtype(-np.inf), row0, row1)


def _channels_last_piece32(block, row0, row1):  # pragma: no cover - numba
    _channels_last_piece(block, row0, row1, np.float32)


def _channels_last_piece64(block, row0, row1):  # pragma: no cover - numba
    _channels_last_piece(block, row0, row1, np.float64)


_CHANNELS_LAST_PIECES = {np.float32: _channels_last_piece32, np.float64: _channels_last_piece64}


def _maxpool2d_plane_rows(x, out, kh, kw, sh, sw, ph, pw, dh, dw, row0, row1
                          ):  # pragma: no cover - numba
    """Planes [row0, row1) of out (P, Oh, Ow), stride sw == 2 along the rows: each output
    row gathers its taps one input row and one kernel column at a time, over the outputs
    that tap reaches inside x."""
    P, H, W = x.shape
    Oh, Ow = out.shape[1], out.shape[2]
    for p in range(row0, row1):
        for oh in range(Oh):
            o = out[p, oh]
            for k in range(Ow):
                o[k] = -np.inf
            for i in range(kh):
                r = oh * sh - ph + i * dh
                if r < 0 or r >= H:
                    continue
                xr = x[p, r]
                for j in range(kw):
                    off = j * dw - pw          # input column of output 0's tap
                    lo = 0 if off >= 0 else (sw - 1 - off) // sw
                    hi = min(Ow, (W - 1 - off) // sw + 1) if off <= W - 1 else 0
                    if hi <= lo:
                        continue
                    # loops from 0 over slices: numba then drops its negative-index checks
                    # and LLVM vectorises
                    src, dst = xr[lo * sw + off:], o[lo:hi]
                    for k in range(hi - lo):  # stride 2, a constant: LLVM vectorises
                        v, m = src[2 * k], dst[k]
                        m = v if v > m else m
                        dst[k] = v if v != v else m


@register("AveragePool", versions=[1, 7, 10, 11, 19, 22])
class AveragePool(_WindowPool):
    def run(self, x):
        xp = self.xp
        kernel, strides, dilations, begin, end, end_eff, outs = self.geometry(x)
        include_pad = bool(getattr(self, "count_include_pad", 0) or 0)
        total = _window_sum(xp, self, x, kernel, strides, dilations, begin, outs)
        total /= xp.asarray(_divisor(x.shape[2:], kernel, strides, dilations, begin, end, outs,
                                     include_pad, total.dtype))
        return total.astype(x.dtype, copy=False)


def _window_sum(xp, op, x, kernel, strides, dilations, begin, outs, power=None):
    dt = compute_dtype(x.dtype)
    a = x.astype(dt, copy=False)
    if power is not None:
        a = xp.abs(a)
        a = a * a if power == 2 else (a if power == 1 else a ** dt(power))
    return op.reduce_separable(xp, a, kernel, strides, dilations, begin, outs, np.add, 0)


def _divisor(in_sp, kernel, strides, dilations, begin, end, outs, include_pad, dtype):
    """Per-window element counts, as a broadcastable host array (windows are products of
    axes; it depends on the geometry only)."""
    div = np.ones((1, 1) + (1,) * len(outs), dtype)
    for i, (o, k, s, d, b, e) in enumerate(zip(outs, kernel, strides, dilations, begin, end)):
        starts = np.arange(o, dtype=np.int64) * s - b  # each window's first tap, in input
        # coordinates; its taps starts + t*d (t < k) inside [lo, hi) are counted in closed
        # form (no (o, k) array: k may be huge)
        lo, hi = (-b, in_sp[i] + e) if include_pad else (0, in_sp[i])
        first = np.maximum(0, -((starts - lo) // d))       # least t with starts + t*d >= lo
        last = np.minimum(k - 1, (hi - 1 - starts) // d)   # most t with starts + t*d < hi
        count = np.maximum(last - first + 1, 0)
        shape = [1] * (len(outs) + 2)
        shape[2 + i] = o
        div = div * np.maximum(count, 1).astype(dtype).reshape(shape)
    return div


@register("LpPool", versions=[1, 2, 11, 18, 22])
class LpPool(_WindowPool):
    def run(self, x):
        xp = self.xp
        kernel, strides, dilations, begin, end, end_eff, outs = self.geometry(x)
        p = float(self.p if self.p is not None else 2)
        total = _window_sum(xp, self, x, kernel, strides, dilations, begin, outs, power=p)
        out = xp.sqrt(total) if p == 2 else total ** total.dtype.type(1.0 / p)
        return out.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# global pools


def _spatial_axes(x):
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", versions=[1, 22])
class GlobalAveragePool(OpImpl):
    def run(self, x):
        xp = self.xp
        dt = compute_dtype(x.dtype)
        L = math.prod(x.shape[2:])
        if xp is not np or L == 0 or x.ndim < 3:
            out = x.astype(dt, copy=False).mean(axis=_spatial_axes(x), keepdims=True)
            return out.astype(x.dtype, copy=False)
        # one reduction over the pixels (a view for channels-first and channels-last memory
        # alike), then the division in place: no mean() wrapper passes
        s = np.add.reduce(x.reshape(x.shape[0], x.shape[1], L), axis=2, dtype=dt)
        np.divide(s, L, out=s)
        return s.reshape(x.shape[:2] + (1,) * (x.ndim - 2)).astype(x.dtype, copy=False)


@register("GlobalMaxPool", versions=[1, 22])
class GlobalMaxPool(OpImpl):
    def run(self, x):
        work = x if x.dtype.kind in "fiu" else x.astype(np.float32)
        return work.max(axis=_spatial_axes(x), keepdims=True).astype(x.dtype, copy=False)


@register("GlobalLpPool", versions=[1, 2, 22])
class GlobalLpPool(OpImpl):
    def run(self, x):
        xp = self.xp
        p = float(self.p if self.p is not None else 2)
        dt = compute_dtype(x.dtype)
        a = xp.abs(x.astype(dt, copy=False))
        if p == 2:
            out = xp.sqrt((a * a).sum(axis=_spatial_axes(x), keepdims=True))
        else:
            out = (a ** dt(p)).sum(axis=_spatial_axes(x), keepdims=True) ** dt(1.0 / p)
        return out.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# unpooling


@register("MaxUnpool", versions=[9, 11, 22])
class MaxUnpool(OpImpl):
    shape_inputs = (2,)

    def setup(self):
        check_window_attributes(self)

    def run(self, x, indices, output_shape=None):
        xp = self.xp
        n = x.ndim - 2
        if n < 1 or indices.shape != x.shape:
            raise self.fail(f"input {x.shape} and indices {indices.shape} do not fit together")
        kernel = ints(self.kernel_shape, n, 1)
        strides = ints(self.strides, n, 1)
        p = ints(self.pads, 2 * n, 0)
        N, C = x.shape[:2]
        default = [(i - 1) * s + k - p[a] - p[a + n]
                   for a, (i, s, k) in enumerate(zip(x.shape[2:], strides, kernel))]
        if output_shape is not None:
            target = [int(v) for v in np.asarray(output_shape).reshape(-1)]
            if len(target) == n:
                target = [N, C] + target
            if len(target) != n + 2:
                raise self.fail(f"output_shape {target} does not have rank {n + 2}")
        else:
            target = [N, C] + default
        if any(d < 0 for d in target):
            raise self.fail(f"the output shape {target} has a negative dimension")
        limits.check_shape(target, x.dtype)
        limits.check_shape([N, C] + default, x.dtype, "unpooled block")
        idx = indices.reshape(-1).astype(np.int64, copy=False)
        default_total = N * C * math.prod(default)
        if idx.size:
            # the index range decides the layout: read on the host (one transfer for both)
            lo, hi = (int(v) for v in _xp.to_host(xp, xp.stack([idx.min(), idx.max()])))
            if lo < 0 or hi >= max(default_total, math.prod(target)):
                raise self.fail("an index is out of range")
        if idx.size == 0 or hi < default_total:
            # indices address the unpooled shape implied by the attributes: scatter there,
            # then place that block at the start of the requested output shape
            buf = xp.zeros(default_total, x.dtype)
            buf[idx] = x.reshape(-1)
            buf = buf.reshape([N, C] + default)
            out = xp.zeros(target, x.dtype)
            common = tuple(slice(0, min(a, b)) for a, b in zip(target, buf.shape))
            out[common] = buf[common]
            return out
        out = xp.zeros(math.prod(target), x.dtype)
        out[idx] = x.reshape(-1)
        return out.reshape(target)

"""OpenCL data movement: Reshape, Flatten, Squeeze, Unsqueeze (views), Transpose, Slice, Concat,
Split, Expand, Tile, Pad, DepthToSpace, SpaceToDepth.

Data movement is type-agnostic: kernels are generated on the element byte size (uchar, ushort,
uint, ulong), so every device dtype moves natively. One generic strided-copy kernel (output
index -> input offset through per-axis strides, generated per rank) serves Transpose, Slice,
Split, Concat, Expand, Tile, Depth/SpaceToDepth and non-contiguous inputs: each op only
describes its input as a strided window (`_View`) on the input buffer. Adjacent axes that are
contiguous in both windows are merged first, so most copies run at rank 1-3.

Slice and Split reuse the CPU implementation on a *probe*: a numpy int8 array over a dummy
buffer with the input's shape and element strides. The CPU code only slices it (pointer
arithmetic, never a read), and the resulting view's shape, strides and data offset describe
the window to copy, with the CPU's exact semantics and error messages.
"""
from __future__ import annotations

import math

import numpy as np

from ember import limits
from ember.ops import shape as S
from ember.ops.opencl._common import kernel, launch
from ember.ops.registry import register

UINT = {1: "uchar", 2: "ushort", 4: "uint", 8: "ulong"}
NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class _View:
    """A strided window on a device buffer; offset and strides in elements."""
    __slots__ = ("buf", "off", "shape", "strides", "isz")

    def __init__(self, buf, off, shape, strides, isz):
        self.buf, self.off, self.shape, self.strides, self.isz = \
            buf, int(off), tuple(int(d) for d in shape), tuple(int(s) for s in strides), isz


def view(x) -> _View:
    isz = x.dtype.itemsize
    return _View(x.base_data, x.offset // isz, x.shape, [s // isz for s in x.strides], isz)


def on_device(be, *xs) -> bool:
    """All of `xs` are device arrays of backend `be` (or None)."""
    return all(x is None or be.is_device_array(x) for x in xs)


def index_type(*arrays_or_counts):
    """('int', np.int32) when every element offset fits 31 bits, else ('long', np.int64)."""
    big = 0
    for a in arrays_or_counts:
        if isinstance(a, _View):
            big = max(big, (a.buf.size // a.isz) if a.buf is not None else 0)
        elif hasattr(a, "size"):
            big = max(big, int(a.size))
        else:
            big = max(big, int(a))
    return ("long", np.int64) if big >= 2 ** 31 - 1 else ("int", np.int32)


def _decompose(rank: int, dims: str, body) -> str:
    """C lines splitting the flat index `g` into coordinates, innermost first; `body(k, c)`
    gives the line(s) using coordinate expression `c` of axis k. dims: the name prefix of the
    per-axis sizes (axis 0's size is never needed)."""
    lines = []
    for k in range(rank - 1, 0, -1):
        lines.append(f"{{ I c = g % {dims}{k}; g /= {dims}{k}; {body(k, 'c')} }}")
    lines.append(f"{{ I c = g; {body(0, 'c')} }}")
    return "\n  ".join(lines)


def _params(prefix: str, ks) -> str:
    return "".join(f", I {prefix}{k}" for k in ks)


_COPY = """
typedef {T} T; typedef {I} I;
__kernel void scopy(__global T* dst, __global const T* src, I doff, I soff{dims}{ss}{ds}) {{
  I i = (I)get_global_id(0), g = (I)get_global_id(1);
  soff += i * s{last}; doff += i * o{last};
  {body}
  dst[doff] = src[soff];
}}"""


_COPY_RANK = 4


def strided_copy(be, dst: _View, src: _View) -> None:
    """dst[...] = src[...] for two windows of the same shape (and element size) on buffers of
    backend `be`."""
    shape = dst.shape
    if any(d == 0 for d in shape):
        return
    merged: list[list[int]] = []
    for d, s, o in zip(shape, src.strides, dst.strides):
        if d == 1:
            continue
        if merged and merged[-1][1] == s * d and merged[-1][2] == o * d:
            merged[-1] = [merged[-1][0] * d, s, o]
        else:
            merged.append([d, s, o])
    # at least _COPY_RANK axes (size-1 ones in front), so that a shape that merges to fewer
    # axes (batch 1 after batch 8, say) reuses the same program
    merged = [[1, 0, 0]] * (_COPY_RANK - len(merged)) + merged
    r = len(merged)
    itype, npi = index_type(src, dst)
    # innermost axis on dimension 0 of the range (no division, coalesced), the others on 1
    src_text = _COPY.format(
        T=UINT[dst.isz], I=itype, dims=_params("d", range(1, r - 1)), ss=_params("s", range(r)),
        ds=_params("o", range(r)), last=r - 1, body="" if r == 1 else
        _decompose(r - 1, "d", lambda k, c: f"soff += {c} * s{k}; doff += {c} * o{k};"))
    args = [npi(m[0]) for m in merged[1:-1]] + [npi(m[1]) for m in merged] + \
        [npi(m[2]) for m in merged]
    launch(be, kernel(be, src_text, "scopy"),
           (merged[-1][0], math.prod(m[0] for m in merged[:-1])), dst.buf, src.buf,
           npi(dst.off), npi(src.off), *args)


def copy_window(be, src: _View, dtype):
    """A fresh C-contiguous device array of backend `be` holding the window `src`."""
    out = be.empty(src.shape, dtype)
    if out.size:
        strided_copy(be, view(out), src)
    return out


def contiguous(be, x):
    """`x` if C-contiguous, else a contiguous copy made by `be`'s strided-copy kernel."""
    if x.flags.c_contiguous or x.size == 0:
        return x
    return copy_window(be, view(x), x.dtype)


def _c_strides(shape) -> list[int]:
    strides, step = [0] * len(shape), 1
    for k in range(len(shape) - 1, -1, -1):
        strides[k] = step
        step *= shape[k]
    return strides


def probe(shape, strides=None) -> np.ndarray:
    """An int8 numpy array over a 1-byte dummy buffer with the given element strides: slicing
    it records offsets and strides without touching memory. Never read it."""
    base = np.zeros(1, np.int8)
    return np.lib.stride_tricks.as_strided(
        base, tuple(shape), tuple(_c_strides(shape) if strides is None else strides),
        writeable=False)


def from_probe(be, x, p: np.ndarray, v: np.ndarray):
    """Copy of the window of device array `x` (of backend `be`) that view `v` of probe `p`
    describes."""
    if x.size == 0 or v.size == 0:
        return be.empty(v.shape, x.dtype)
    xv = view(x)
    return copy_window(be, _View(xv.buf, xv.off + (v.ctypes.data - p.ctypes.data), v.shape,
                                 v.strides, xv.isz), x.dtype)


def _window(x, shape, strides, extra_off=0) -> _View:
    xv = view(x)
    return _View(xv.buf, xv.off + extra_off, shape, strides, xv.isz)


# ----------------------------------------------------------------------------- views

class _ViewOp:
    """Reshape-like ops: the output shape comes from the CPU kernel run on a contiguous
    probe; the result is a view of (a contiguous) x."""

    def run(self, x, *rest):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, *rest)
        shape = super().run(probe(x.shape), *rest).shape
        return contiguous(self.device, x).reshape(shape)


@register("Reshape", versions=S.Reshape1.versions, backend="opencl")
class Reshape1CL(_ViewOp, S.Reshape1):
    pass


@register("Reshape", versions=S.Reshape5.versions, backend="opencl")
class Reshape5CL(_ViewOp, S.Reshape5):
    host_inputs = (1,)


@register("Flatten", versions=S.Flatten.versions, backend="opencl")
class FlattenCL(_ViewOp, S.Flatten):
    pass


@register("Squeeze", versions=S.Squeeze1.versions, backend="opencl")
class Squeeze1CL(_ViewOp, S.Squeeze1):
    pass


@register("Squeeze", versions=S.Squeeze13.versions, backend="opencl")
class Squeeze13CL(_ViewOp, S.Squeeze13):
    host_inputs = (1,)


@register("Unsqueeze", versions=S.Unsqueeze1.versions, backend="opencl")
class Unsqueeze1CL(_ViewOp, S.Unsqueeze1):
    pass


@register("Unsqueeze", versions=S.Unsqueeze13.versions, backend="opencl")
class Unsqueeze13CL(_ViewOp, S.Unsqueeze13):
    host_inputs = (1,)


# ----------------------------------------------------------------------------- Transpose

@register("Transpose", versions=S.Transpose.versions, backend="opencl")
class TransposeCL(S.Transpose):
    def run(self, x):
        if not on_device(self.device, x):
            return self.run_on_cpu(x)
        perm = list(range(x.ndim))[::-1] if self.perm is None else list(self.perm)
        if sorted(S._norm_axes(self, perm, x.ndim)) != list(range(x.ndim)):
            raise self.fail(f"perm {perm} is not a permutation of the {x.ndim} axes")
        perm = [p % x.ndim for p in perm]
        if x.size == 0:
            return self.device.empty([x.shape[p] for p in perm], x.dtype)
        xv = view(x)
        return copy_window(self.device, _View(xv.buf, xv.off, [xv.shape[p] for p in perm],
                                              [xv.strides[p] for p in perm], xv.isz), x.dtype)


# ----------------------------------------------------------------------------- Slice / Split

class _ProbeOp:
    """Ops whose CPU kernel only slices x: run it on a probe, copy the windows it returns."""

    def run(self, x, *rest):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, *rest)
        p = probe(x.shape, view(x).strides if x.size else None)
        result = super().run(p, *rest)
        if isinstance(result, tuple):
            return tuple(from_probe(self.device, x, p, v) for v in result)
        return from_probe(self.device, x, p, result)


@register("Slice", versions=S.Slice1.versions, backend="opencl")
class Slice1CL(_ProbeOp, S.Slice1):
    pass


@register("Slice", versions=S.Slice10.versions, backend="opencl")
class Slice10CL(_ProbeOp, S.Slice10):
    host_inputs = (1, 2, 3, 4)


@register("Split", versions=S.Split1.versions, backend="opencl")
class Split1CL(_ProbeOp, S.Split1):
    host_inputs = (1,)


@register("Split", versions=S.Split2.versions, backend="opencl")
class Split2CL(_ProbeOp, S.Split2):
    pass


@register("Split", versions=S.Split13.versions, backend="opencl")
class Split13CL(_ProbeOp, S.Split13):
    host_inputs = (1,)


@register("Split", versions=S.Split18.versions, backend="opencl")
class Split18CL(_ProbeOp, S.Split18):
    host_inputs = (1,)


# ----------------------------------------------------------------------------- Concat

@register("Concat", versions=S.Concat.versions, backend="opencl")
class ConcatCL(S.Concat):
    def run(self, *xs):
        if not on_device(self.device, *xs):
            return self.run_on_cpu(*xs)
        xs = [x for x in xs if x is not None]
        if not xs:
            raise self.fail("no inputs")
        axis = S._norm_axis(self, 1 if self.axis is None else self.axis, xs[0].ndim)
        first = xs[0].shape
        for x in xs:
            if x.ndim != len(first) or any(a != b for k, (a, b) in enumerate(zip(x.shape, first))
                                           if k != axis) or x.dtype != xs[0].dtype:
                raise self.fail(f"inputs of shapes {[x.shape for x in xs]} cannot be "
                                f"concatenated on axis {axis}")
        shape = list(first)
        shape[axis] = sum(x.shape[axis] for x in xs)
        be = self.device
        out = be.empty(shape, xs[0].dtype)
        if out.size:
            ov = view(out)
            at = 0
            for x in xs:
                if x.size:
                    strided_copy(be, _View(ov.buf, at * ov.strides[axis], x.shape, ov.strides,
                                       ov.isz), view(x))
                at += x.shape[axis]
        return out


# ----------------------------------------------------------------------------- Expand / Tile

@register("Expand", versions=S.Expand.versions, backend="opencl")
class ExpandCL(S.Expand):
    host_inputs = (1,)

    def run(self, x, shape):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, shape)
        shape = S._ints(shape)
        try:
            target = np.broadcast_shapes(x.shape, tuple(shape))
        except ValueError:
            raise self.fail(f"cannot broadcast shape {x.shape} to {shape}") from None
        limits.check_shape(target, x.dtype)  # as the CPU kernel: before allocating
        if x.size == 0 or math.prod(target) == 0:
            return self.device.empty(target, x.dtype)
        xv = view(x)
        lead = len(target) - x.ndim
        strides = [0] * lead + [s if d != 1 else 0 for d, s in zip(x.shape, xv.strides)]
        return copy_window(self.device, _View(xv.buf, xv.off, target, strides, xv.isz), x.dtype)


def _tile(be, x, reps):
    """np.tile(x, reps) on backend `be` as one strided copy: the output viewed as (r0, d0, r1,
    d1, ...)."""
    out_shape = [d * r for d, r in zip(x.shape, reps)]
    limits.check_shape(out_shape, x.dtype)
    out = be.empty(out_shape, x.dtype)
    if out.size:
        xv = view(x)
        shape = [v for r, d in zip(reps, x.shape) for v in (r, d)]
        strides = [v for s in xv.strides for v in (0, s)]
        strided_copy(be, _View(view(out).buf, 0, shape, _c_strides(shape), xv.isz),
                     _View(xv.buf, xv.off, shape, strides, xv.isz))
    return out


@register("Tile", versions=S.Tile1.versions, backend="opencl")
class Tile1CL(S.Tile1):
    host_inputs = (1, 2)

    def run(self, x, tiles, axis):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, tiles, axis)
        axis = S._norm_axis(self, S._scalar_int(axis), x.ndim)
        reps = [1] * x.ndim
        reps[axis] = S._scalar_int(tiles)
        return _tile(self.device, x, reps)


@register("Tile", versions=S.Tile6.versions, backend="opencl")
class Tile6CL(S.Tile6):
    host_inputs = (1,)

    def run(self, x, repeats):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, repeats)
        reps = S._ints(repeats)
        if len(reps) != x.ndim:
            raise self.fail(f"repeats has {len(reps)} entries for a tensor of rank {x.ndim}")
        if any(r < 0 for r in reps):
            raise self.fail(f"negative repeats {reps}")
        return _tile(self.device, x, reps)


# ----------------------------------------------------------------------------- Pad

_PAD_MODES = {
    "constant": "if (c < 0 || c >= n{k}) {{ dst[gi] = value; return; }}",
    "edge": "c = c < 0 ? 0 : (c >= n{k} ? n{k} - 1 : c);",
    "wrap": "c %= n{k}; if (c < 0) c += n{k};",
    "reflect": "if (n{k} == 1) c = 0; else {{ I p = 2 * (n{k} - 1); c %= p; if (c < 0) c += p;"
               " if (c >= n{k}) c = p - c; }}",
}
_PAD = """
typedef {T} T; typedef {I} I;
__kernel void pad(__global T* dst, __global const T* src, I soff, T value{od}{n}{b}{s}) {{
  I i = (I)get_global_id(0), g = (I)get_global_id(1), gi = g * od{last} + i;
  {{ I c = i; {inner} }}
  {body}
  dst[gi] = src[soff];
}}"""


class _PadCL:
    def pad(self, x, pads, mode, value, axes=None):
        be = self.device
        rank = x.ndim
        axes = list(range(rank)) if axes is None else S._norm_axes(self, axes, rank)
        if len(pads) != 2 * len(axes):
            raise self.fail(f"pads {pads} should have {2 * len(axes)} entries")
        before, after = [0] * rank, [0] * rank
        for i, a in enumerate(axes):
            before[a], after[a] = pads[i], pads[i + len(axes)]
        xv = view(x) if x.size else None
        shape, off = list(x.shape), 0
        for a in range(rank):  # negative pads crop the input window
            lo, hi = -min(before[a], 0), -min(after[a], 0)
            if lo or hi:
                shape[a] = max(shape[a] - lo - hi, 0)
                off += lo * (xv.strides[a] if xv else 0)
                before[a], after[a] = max(before[a], 0), max(after[a], 0)
        if mode not in _PAD_MODES:
            raise self.fail(f"unknown mode '{mode}'")
        if mode != "constant":
            for a in range(rank):
                if (before[a] or after[a]) and shape[a] == 0:
                    raise self.fail(f"cannot {mode}-pad an empty axis {a}")
        out_shape = [d + b + e for d, b, e in zip(shape, before, after)]
        limits.check_shape(out_shape, x.dtype)
        out = be.empty(out_shape, x.dtype)
        if out.size == 0:
            return out
        if math.prod(shape) == 0:
            xv = _View(None, 0, shape, [0] * rank, x.dtype.itemsize)
        if rank == 0 or not any(before) and not any(after):
            strided_copy(be, view(out), _View(xv.buf, xv.off + off, shape, xv.strides, xv.isz))
            return out
        fill = np.asarray(0 if value is None else value).reshape(-1)
        fill = fill[0] if fill.size else 0
        isz = x.dtype.itemsize
        bits = np.asarray(fill).astype(x.dtype).reshape(1).view(NP_UINT[isz])[0]
        itype, npi = index_type(out, xv if xv.buf is not None else 0)
        def axis(k, c):
            return f"{c} -= b{k}; " + _PAD_MODES[mode].format(k=k) + f" soff += {c} * s{k};"

        src = _PAD.format(T=UINT[isz], I=itype, od=_params("od", range(1, rank)),
                          n=_params("n", range(rank)), b=_params("b", range(rank)),
                          s=_params("s", range(rank)), last=rank - 1,
                          inner=axis(rank - 1, "c"),
                          body="" if rank == 1 else _decompose(rank - 1, "od", axis))
        args = [npi(d) for d in out_shape[1:]] + [npi(d) for d in shape] + \
            [npi(b) for b in before] + [npi(s) for s in xv.strides]
        buf = xv.buf if xv.buf is not None else view(out).buf  # never read: all padding
        launch(be, kernel(be, src, "pad"), (out_shape[-1], out.size // out_shape[-1]),
               view(out).buf, buf, npi(xv.off + off), NP_UINT[isz](bits), *args)
        return out


@register("Pad", versions=S.Pad1.versions, backend="opencl")
class Pad1CL(_PadCL, S.Pad1):
    def run(self, x):
        if not on_device(self.device, x):
            return self.run_on_cpu(x)
        return self.pad(x, list(self.paddings), self.mode, self.value)


@register("Pad", versions=S.Pad2.versions, backend="opencl")
class Pad2CL(_PadCL, S.Pad2):
    def run(self, x):
        if not on_device(self.device, x):
            return self.run_on_cpu(x)
        return self.pad(x, list(self.pads), self.mode, self.value)


@register("Pad", versions=S.Pad11.versions, backend="opencl")
class Pad11CL(_PadCL, S.Pad11):
    host_inputs = (1, 2)

    def run(self, x, pads, constant_value=None):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, pads, constant_value)
        return self.pad(x, S._ints(pads), self.mode, constant_value)


@register("Pad", versions=S.Pad18.versions, backend="opencl")
class Pad18CL(_PadCL, S.Pad18):
    host_inputs = (1, 2, 3)

    def run(self, x, pads, constant_value=None, axes=None):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, pads, constant_value, axes)
        return self.pad(x, S._ints(pads), self.mode, constant_value,
                        None if axes is None else S._ints(axes))


@register("Pad", versions=S.Pad19.versions, backend="opencl")
class Pad19CL(Pad18CL, S.Pad19):
    pass


# ------------------------------------------------------------------ DepthToSpace / SpaceToDepth

@register("DepthToSpace", versions=S.DepthToSpace.versions, backend="opencl")
class DepthToSpaceCL(S.DepthToSpace):
    def run(self, x):
        if not on_device(self.device, x):
            return self.run_on_cpu(x)
        if x.ndim != 4:
            raise self.fail(f"input must be 4-D, got shape {x.shape}")
        bs = self.blocksize
        b, c, h, w = x.shape
        if c % (bs * bs):
            raise self.fail(f"channels {c} not divisible by blocksize^2 = {bs * bs}")
        out = self.device.empty((b, c // (bs * bs), h * bs, w * bs), x.dtype)
        if out.size:
            c2 = c // (bs * bs)
            sb, sc, sh, sw = view(x).strides
            if self._mode == "DCR":  # (b, bs1, bs2, c2, h, w) -> (b, c2, h, bs1, w, bs2)
                shape6 = (b, bs, bs, c2, h, w)
                st6 = (sb, bs * c2 * sc, c2 * sc, sc, sh, sw)
                perm = (0, 3, 4, 1, 5, 2)
            else:  # CRD: (b, c2, bs1, bs2, h, w) -> (b, c2, h, bs1, w, bs2)
                shape6 = (b, c2, bs, bs, h, w)
                st6 = (sb, bs * bs * sc, bs * sc, sc, sh, sw)
                perm = (0, 1, 4, 2, 5, 3)
            shape = [shape6[p] for p in perm]
            strided_copy(self.device,
                         _View(view(out).buf, 0, shape, _c_strides(shape), x.dtype.itemsize),
                         _window(x, shape, [st6[p] for p in perm]))
        return out


@register("SpaceToDepth", versions=S.SpaceToDepth.versions, backend="opencl")
class SpaceToDepthCL(S.SpaceToDepth):
    def run(self, x):
        if not on_device(self.device, x):
            return self.run_on_cpu(x)
        if x.ndim != 4:
            raise self.fail(f"input must be 4-D, got shape {x.shape}")
        bs = self.blocksize
        b, c, h, w = x.shape
        if h % bs or w % bs:
            raise self.fail(f"spatial size {h}x{w} not divisible by blocksize {bs}")
        out = self.device.empty((b, c * bs * bs, h // bs, w // bs), x.dtype)
        if out.size:
            sb, sc, sh, sw = view(x).strides
            shape6 = (b, c, h // bs, bs, w // bs, bs)
            st6 = (sb, sc, bs * sh, sh, bs * sw, sw)
            perm = (0, 3, 5, 1, 2, 4) if self._mode == "DCR" else (0, 1, 3, 5, 2, 4)
            shape = [shape6[p] for p in perm]
            strided_copy(self.device,
                         _View(view(out).buf, 0, shape, _c_strides(shape), x.dtype.itemsize),
                         _window(x, shape, [st6[p] for p in perm]))
        return out

"""OpenCL indexing kernels: Gather, GatherElements, ScatterND, TopK, Resize/Upsample, and the
Identity / Dropout (inference) pass-throughs.

Pure data movement (Gather, GatherElements, ScatterND without reduction, nearest Resize) is
generated on the element byte size, so every device dtype moves natively. Index inputs are
device int32/int64 arrays; negative indices wrap (out-of-range ones are clamped, never read
outside the buffer). Kernels that compare or compute (ScatterND reductions, TopK, linear/cubic
Resize) are generated per C type, float16 through vload_half/vstore_half.
"""
from __future__ import annotations

import math

import numpy as np

from ember import limits
from ember.ops import image as IM
from ember.ops import indexing as IX
from ember.ops import normalization as NO
from ember.ops import tensor as TE
from ember.ops.opencl._common import C_TYPES, kernel, launch
from ember.ops.opencl.shape import (NP_UINT, UINT, _decompose, _params, contiguous, copy_window,
                                    index_type, on_device, view)
from ember.ops.registry import register

HALF = np.dtype(np.float16)
INDEX_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long"}


def _off(x) -> int:
    """Element offset of a device array in its buffer."""
    return x.offset // x.dtype.itemsize


# ----------------------------------------------------------------------------- Gather

_GATHER = """
typedef {T} T; typedef {I} I; typedef {IX} IX;
__kernel void gather(__global T* out, __global const T* data, __global const IX* idx, I doff,
                     I n, I inner, I nidx) {{
  I g = (I)get_global_id(0);
  I i = g % inner, t = g / inner, j = t % nidx, o = t / nidx;
  long k = idx[j];
  if (k < 0) k += n;
  k = clamp(k, 0L, (long)n - 1);
  out[g] = data[doff + (o * n + (I)k) * inner + i];
}}"""


@register("Gather", versions=IX.Gather.versions, backend="opencl")
class GatherCL(IX.Gather):
    def run(self, data, indices):
        be = self.device
        if not on_device(be, data, indices) or indices.dtype not in INDEX_TYPES:
            return self.run_on_cpu(data, indices)
        axis = IX._norm_axis(self, self.axis, data.ndim)
        shape = data.shape[:axis] + indices.shape + data.shape[axis + 1:]
        out = be.empty(shape, data.dtype)
        if out.size == 0:
            return out
        if data.shape[axis] == 0:
            raise self.fail("gathering from an empty axis")
        data = contiguous(be, data)
        inner = math.prod(data.shape[axis + 1:])
        itype, npi = index_type(data.base_data.size // data.dtype.itemsize, out)
        src = _GATHER.format(T=UINT[data.dtype.itemsize], I=itype, IX=INDEX_TYPES[indices.dtype])
        launch(be, kernel(be, src, "gather"), out.size, out, data.base_data, indices,
               npi(_off(data)), npi(data.shape[axis]), npi(inner), npi(indices.size))
        return out


# ----------------------------------------------------------------------------- GatherElements

_GATHER_EL = """
typedef {T} T; typedef {I} I; typedef {IX} IX;
__kernel void gather_el(__global T* out, __global const T* data, __global const IX* idx, I doff,
                        I n{dims}{ss}) {{
  I g = (I)get_global_id(0), gi = g;
  {body}
  out[gi] = data[doff];
}}"""


@register("GatherElements", versions=IX.GatherElements.versions, backend="opencl")
class GatherElementsCL(IX.GatherElements):
    def run(self, data, indices):
        be = self.device
        if not on_device(be, data, indices) or indices.dtype not in INDEX_TYPES:
            return self.run_on_cpu(data, indices)
        axis = IX._norm_axis(self, self.axis, data.ndim)
        if indices.ndim != data.ndim:
            raise self.fail(f"indices rank {indices.ndim} differs from data rank {data.ndim}")
        if any(i > d for k, (i, d) in enumerate(zip(indices.shape, data.shape)) if k != axis):
            raise self.fail(f"indices shape {indices.shape} exceeds data shape {data.shape} "
                            f"outside axis {axis}")
        out = be.empty(indices.shape, data.dtype)
        if out.size == 0:
            return out
        if data.shape[axis] == 0:
            raise self.fail("gathering from an empty axis")
        dv, r = view(data), data.ndim

        def body(k, c):
            if k != axis:
                return f"doff += {c} * s{k};"
            return ("long v = idx[gi]; if (v < 0) v += n; v = clamp(v, 0L, (long)n - 1); "
                    f"doff += (I)v * s{k};")

        itype, npi = index_type(dv, out)
        src = _GATHER_EL.format(T=UINT[dv.isz], I=itype, IX=INDEX_TYPES[indices.dtype],
                                dims=_params("d", range(1, r)), ss=_params("s", range(r)),
                                body=_decompose(r, "d", body))
        launch(be, kernel(be, src, "gather_el"), out.size, out, dv.buf, indices, npi(dv.off),
               npi(data.shape[axis]), *[npi(d) for d in indices.shape[1:]],
               *[npi(s) for s in dv.strides])
        return out


# ----------------------------------------------------------------------------- ScatterND

_SCATTER_ND = """
typedef {T} T; typedef {I} I; typedef {IX} IX;
#define OP(a, b) ({op})
#define LOAD(i, p) {load}
#define STORE(v, i, p) {store}
__kernel void scatter_nd(__global T* out, __global const IX* idx, __global const T* upd,
                         I inner, I count{dims}{ss}) {{
#if REDUCE
  I i = (I)get_global_id(0);
  for (I n = 0; n < count; n++) {{
#else
  I g = (I)get_global_id(0), n = g / inner, i = g % inner;
  {{
#endif
    I off = i;
    {tuple}
#if REDUCE
    STORE(OP(LOAD(off, out), LOAD(n * inner + i, upd)), off, out);
#else
    out[off] = upd[g];
#endif
  }}
}}"""
_REDUCE_OPS = {"add": "a + b", "mul": "a * b", "max": "(a != a || a > b) ? a : b",
               "min": "(a != a || a < b) ? a : b"}


class _ScatterNDCL:
    def run(self, data, indices, updates):
        reduction = self._reduction()
        typed = reduction == "none" or data.dtype in C_TYPES and data.dtype != np.bool_ \
            or data.dtype == HALF
        be = self.device
        if not on_device(be, data, indices, updates) or indices.dtype not in INDEX_TYPES \
                or not typed or updates.dtype != data.dtype:
            return self.run_on_cpu(data, indices, updates)
        k = self.check_shapes(data, indices, updates)
        out = copy_window(be, view(data), data.dtype)
        count, inner = math.prod(indices.shape[:-1]), math.prod(data.shape[k:])
        if count == 0 or inner == 0:
            return out
        strides = [math.prod(data.shape[j + 1:]) for j in range(k)]
        tup = " ".join(f"{{ long v = idx[n * {k} + {j}]; if (v < 0) v += d{j}; "
                       f"v = clamp(v, 0L, (long)d{j} - 1); off += (I)v * s{j}; }}"
                       for j in range(k))
        itype, npi = index_type(out, updates)
        reduce = reduction != "none"
        half = reduce and data.dtype == HALF
        src = _SCATTER_ND.format(T=C_TYPES[data.dtype] if reduce and not half
                                 else UINT[data.dtype.itemsize], I=itype,
                                 load="vload_half(i, (__global half*)(p))" if half else "(p)[i]",
                                 store="vstore_half_rte(v, i, (__global half*)(p))" if half
                                 else "(p)[i] = (v)", IX=INDEX_TYPES[indices.dtype],
                                 op=_REDUCE_OPS.get(reduction, "b"), dims=_params("d", range(k)),
                                 ss=_params("s", range(k)), tuple=tup)
        knl = kernel(be, src, "scatter_nd", (f"-DREDUCE={int(reduce)}",))
        launch(be, knl, inner if reduce else count * inner, out, indices, updates, npi(inner),
               npi(count), *[npi(d) for d in data.shape[:k]], *[npi(s) for s in strides])
        return out


@register("ScatterND", versions=IX.ScatterND11.versions, backend="opencl")
class ScatterND11CL(_ScatterNDCL, IX.ScatterND11):
    pass


@register("ScatterND", versions=IX.ScatterND16.versions, backend="opencl")
class ScatterND16CL(_ScatterNDCL, IX.ScatterND16):
    pass


@register("ScatterND", versions=IX.ScatterND18.versions, backend="opencl")
class ScatterND18CL(_ScatterNDCL, IX.ScatterND18):
    pass


# ----------------------------------------------------------------------------- TopK

# Each element counts the elements of its row that order before it (NaN is the largest value,
# ties go to the lower index, as on the CPU) and, when its rank is below k, writes itself there.
_TOPK = """
typedef {T} T; typedef {I} I; typedef {V} V;
#define LOAD(p, i) ({load})
#define NAN_(a) ({isnan})
#define EQ(a, b) ((a) == (b) || (NAN_(a) && NAN_(b)))
#define GT(a, b) (NAN_(a) ? !NAN_(b) : (a) > (b))
#define LT(a, b) (NAN_(b) ? !NAN_(a) : (a) < (b))
__kernel void topk(__global T* vals, __global long* inds, __global const T* x, I xoff, I n,
                   I inner, I k) {{
  I g = (I)get_global_id(0);
  I i = g % inner, t = g / inner, e = t % n, o = t / n;
  __global const T* row = x + xoff + o * n * inner + i;
  V v = LOAD(row, e * inner);
  I rank = 0;
  for (I j = 0; j < n; j++) {{
    V u = LOAD(row, j * inner);
    if ({cmp}(u, v) || (j < e && EQ(u, v))) {{
      if (++rank >= k) return;
    }}
  }}
  vals[(o * k + rank) * inner + i] = row[e * inner];
  inds[(o * k + rank) * inner + i] = e;
}}"""
TOPK_MAX_ROW = 16384  # longer rows (O(n^2) work per row here) run on the CPU


class _TopKCL:
    host_inputs = (1,)

    def topk(self, x, k, axis, largest):
        be = self.device
        if not on_device(be, x) or (x.dtype not in C_TYPES and x.dtype != HALF) \
                or x.dtype == np.bool_:
            return None
        axis = IX._norm_axis(self, axis, x.ndim)
        n = x.shape[axis]
        if not 0 <= k <= n:
            raise self.fail(f"k = {k} is out of range for an axis of size {n}")
        if n > TOPK_MAX_ROW:
            return None
        shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
        vals, inds = be.empty(shape, x.dtype), be.empty(shape, np.int64)
        if vals.size == 0:
            return vals, inds
        x = contiguous(be, x)
        is_float = x.dtype.kind == "f"
        if x.dtype == HALF:
            t, v, load = "ushort", "float", "vload_half(i, (__global const half*)(p))"
        else:
            t = v = C_TYPES[x.dtype]
            load = "(p)[i]"
        itype, npi = index_type(x.base_data.size // x.dtype.itemsize)
        src = _TOPK.format(T=t, I=itype, V=v, load=load, isnan="isnan(a)" if is_float else "0",
                           cmp="GT" if largest else "LT")
        launch(be, kernel(be, src, "topk"), x.size, vals, inds, x.base_data, npi(_off(x)),
               npi(n), npi(math.prod(x.shape[axis + 1:])), npi(k))
        return vals, inds


@register("TopK", versions=IX.TopK1.versions, backend="opencl")
class TopK1CL(_TopKCL, IX.TopK1):
    host_inputs = ()

    def run(self, x):
        return self.topk(x, self.k, self.axis, True) or self.run_on_cpu(x)


@register("TopK", versions=IX.TopK10.versions, backend="opencl")
class TopK10CL(_TopKCL, IX.TopK10):
    def run(self, x, k):
        return self.topk(x, IX._scalar_int(k), self.axis, True) or self.run_on_cpu(x, k)


@register("TopK", versions=IX.TopK11.versions, backend="opencl")
class TopK11CL(_TopKCL, IX.TopK11):
    def run(self, x, k):
        return self.topk(x, IX._scalar_int(k), self.axis, bool(self.largest)) or \
            self.run_on_cpu(x, k)


# ----------------------------------------------------------------------------- Resize / Upsample

# Nearest: one N-D gather; tbl holds, per axis, the input element offset of each output
# coordinate (-1: outside the crop of tf_crop_and_resize, write the extrapolation value).
_RESIZE_NEAREST = """
typedef {T} T; typedef {I} I;
__kernel void resize_nearest(__global T* out, __global const T* src, __global const I* tbl,
                             I soff, T value{dims}{ts}) {{
  I g = (I)get_global_id(0), gi = g;
  {body}
  out[gi] = src[soff];
}}"""
# Linear / cubic (antialiased or not): one pass per resized axis, out[o, j, i] =
# sum_t w[j, t] * src[o, idx[j, t], i], in the work type W, as the CPU's separable plan.
_RESIZE_AXIS = """
#pragma OPENCL FP_CONTRACT OFF
typedef {TI} TI; typedef {TO} TO; typedef {W} W; typedef {I} I;
__kernel void resize_axis(__global TO* out, __global const TI* src, __global const int* idx,
                          __global const W* w, __global const uchar* outside, I soff, I in_len,
                          I out_len, I inner, I taps, W ext) {{
  I g = (I)get_global_id(0);
  I i = g % inner, t = g / inner, j = t % out_len, o = t / out_len;
  W acc = 0;
  if (outside[j]) acc = ext;
  else {{
    __global const TI* p = src + soff + o * in_len * inner + i;
    for (I q = 0; q < taps; q++) acc += ({load}) * w[j * taps + q];
  }}
  {store};
}}"""


def _load(dtype, work: str) -> str:
    if dtype == HALF:
        return "vload_half(idx[j * taps + q] * inner, (__global const half*)p)"
    return f"({work})p[idx[j * taps + q] * inner]"


def _store(dtype, work: str) -> tuple[str, str]:
    """(storage C type, store statement) of `acc` into out[g] as `dtype` (like CPU _finish)."""
    if dtype == HALF:
        return "ushort", "vstore_half_rte(acc, g, (__global half*)out)"
    if dtype == np.bool_:
        return "uchar", "out[g] = acc != 0"
    c = C_TYPES[dtype]
    if dtype.kind in "iu":
        return c, f"out[g] = convert_{c}_sat_rte(acc)"
    return c, f"out[g] = ({c})acc"


class _ResizeCL:
    _plans: dict | None = None  # per node: resize plans (with their device tables) by call key

    def resize(self, x, out_shape, scales, *, mode, ct, nearest_mode, cubic_a=-0.75,
               exclude_outside=False, extrapolation_value=0.0, antialias=False, roi=None):
        """IM.resize_nd on the device, or None where the CPU must do it."""
        if not on_device(self.device, x):
            return None
        out_shape = [int(d) for d in out_shape]
        if any(d < 0 for d in out_shape):
            return None  # the CPU kernel reports it
        limits.check_shape(out_shape, x.dtype)
        if math.prod(out_shape) == 0:
            return self.device.empty(out_shape, x.dtype)
        if x.size == 0:
            return None
        key = (x.shape, x.strides, x.dtype, tuple(out_shape), tuple(scales), mode, ct,
               nearest_mode, cubic_a, exclude_outside, antialias, extrapolation_value,
               None if roi is None else (tuple(roi[0]), tuple(roi[1])))
        if self._plans is None:
            self._plans = {}
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 16:
                self._plans.clear()
            plan = self._plans[key] = self._plan(x, out_shape, scales, mode, ct, nearest_mode,
                                                 cubic_a, exclude_outside, antialias, roi)
        if not plan:
            return x
        if mode == "nearest":
            return self._nearest(x, out_shape, plan, extrapolation_value)
        return self._separable(x, out_shape, plan, float(extrapolation_value))

    def _plan(self, x, out_shape, scales, mode, ct, nearest_mode, cubic_a, exclude_outside,
              antialias, roi):
        """[(axis, idx, w, outside)] for the axes that move, as in IM.resize_nd; for nearest
        the device table of input offsets, for the others per-axis device arrays."""
        be, plans = self.device, []
        for axis in range(x.ndim):
            in_len, out_len, scale = x.shape[axis], out_shape[axis], float(scales[axis])
            rs, re = (0.0, 1.0) if roi is None else (float(roi[0][axis]), float(roi[1][axis]))
            if out_len == in_len and scale == 1.0 and (ct != "tf_crop_and_resize" or (
                    rs == 0.0 and re == 1.0)) and ct != "tf_half_pixel_for_nn":
                continue
            coords = IM._source_coords(ct, in_len, out_len, scale, rs, re)
            idx, w = IM._axis_plan(mode, coords, in_len, scale, nearest_mode=nearest_mode,
                                   cubic_a=cubic_a, exclude_outside=exclude_outside,
                                   antialias=antialias)
            outside = (coords < 0) | (coords > in_len - 1) if ct == "tf_crop_and_resize" \
                else np.zeros(out_len, bool)
            if w is None and not outside.any() and idx.shape[0] == in_len and \
                    np.array_equal(idx[:, 0], np.arange(in_len)):
                continue
            plans.append((axis, idx, w, outside))
        if not plans or mode != "nearest":
            work = IM._work_dtype(x.dtype)
            return [(axis, idx.shape[1], be.to_device(np.ascontiguousarray(idx, np.int32)),
                     be.to_device(np.ascontiguousarray(w, work)),
                     be.to_device(outside.astype(np.uint8))) for axis, idx, w, outside in plans]
        xv = view(x)
        by_axis = {a: (idx[:, 0], outside) for a, idx, _, outside in plans}
        tables, starts = [], []
        for a in range(x.ndim):
            idx, outside = by_axis.get(a, (np.arange(out_shape[a]), None))
            t = idx.astype(np.int64) * xv.strides[a]
            if outside is not None:
                t[outside] = -1
            starts.append(sum(len(s) for s in tables))
            tables.append(t)
        itype, npi = index_type(xv, math.prod(out_shape))
        return [(be.to_device(np.concatenate(tables).astype(npi)), starts, itype, npi)]

    def _nearest(self, x, out_shape, plan, ext):
        (tbl, starts, itype, npi), = plan
        be = self.device
        xv, r = view(x), x.ndim
        out = be.empty(out_shape, x.dtype)
        src = _RESIZE_NEAREST.format(
            T=UINT[xv.isz], I=itype, dims=_params("d", range(1, r)), ts=_params("t", range(r)),
            body=_decompose(r, "d", lambda k, c: f"I v = tbl[t{k} + {c}]; if (v < 0) {{ "
                            f"out[gi] = value; return; }} soff += v;"))
        value = np.asarray(ext, dtype=x.dtype).reshape(1).view(NP_UINT[xv.isz])[0]
        launch(be, kernel(be, src, "resize_nearest"), out.size, out, xv.buf, tbl, npi(xv.off),
               value, *[npi(d) for d in out_shape[1:]], *[npi(s) for s in starts])
        return out

    def _separable(self, x, out_shape, plan, ext):
        be = self.device
        work = IM._work_dtype(x.dtype)
        wc = C_TYPES[work]
        cur, shape = contiguous(be, x), list(x.shape)
        for n, (axis, taps, idx, w, outside) in enumerate(plan):
            shape[axis] = out_shape[axis]
            out_dtype = x.dtype if n == len(plan) - 1 else work
            out = be.empty(shape, out_dtype)
            in_dtype = cur.dtype
            ti = "ushort" if in_dtype == HALF else ("uchar" if in_dtype == np.bool_
                                                    else C_TYPES[in_dtype])
            to, store = _store(out_dtype, wc)
            itype, npi = index_type(cur.base_data.size // cur.dtype.itemsize, out)
            src = _RESIZE_AXIS.format(TI=ti, TO=to, W=wc, I=itype, load=_load(in_dtype, wc),
                                      store=store)
            launch(be, kernel(be, src, "resize_axis"), out.size, out, cur.base_data, idx, w,
                   outside, npi(_off(cur)), npi(cur.shape[axis]), npi(out_shape[axis]),
                   npi(math.prod(shape[axis + 1:])), npi(taps), work.type(ext))
            cur = out
        return cur


@register("Resize", versions=IM.Resize11.versions, backend="opencl")
class Resize11CL(_ResizeCL, IM.Resize11):
    host_inputs = (1, 2, 3)

    def run(self, x, roi=None, scales=None, sizes=None):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, roi, scales, sizes)
        out_shape, full_scales, roi_pair = self.target(x.shape, roi, scales, sizes)
        out = self.resize(x, out_shape, full_scales, **self.options(roi_pair))
        return self.run_on_cpu(x, roi, scales, sizes) if out is None else out


class _UpsampleCL(_ResizeCL):
    def upsample(self, x, scales, *rest):
        if on_device(self.device, x):
            sc = [float(s) for s in np.asarray(scales, dtype=np.float64).reshape(-1)]
            if len(sc) != x.ndim:
                raise self.fail(f"scales has {len(sc)} entries, expected {x.ndim}")
            if any(s <= 0 for s in sc):
                raise self.fail("scales must be positive")
            out_shape = [int(np.float64(s) * n) for s, n in zip(np.asarray(scales).reshape(-1),
                                                                 x.shape)]
            out = self.resize(x, out_shape, sc, mode=self.mode, ct="asymmetric",
                              nearest_mode="simple")
            if out is not None:
                return out
        return self.run_on_cpu(x, *rest)


@register("Resize", versions=IM.Resize10.versions, backend="opencl")
class Resize10CL(_UpsampleCL, IM.Resize10):
    host_inputs = (1,)

    def run(self, x, scales):
        return self.upsample(x, scales, scales)


@register("Upsample", versions=IM.Upsample9.versions, backend="opencl")
class Upsample9CL(_UpsampleCL, IM.Upsample9):
    host_inputs = (1,)

    def run(self, x, scales):
        return self.upsample(x, scales, scales)


@register("Upsample", versions=IM.Upsample7.versions, backend="opencl")
class Upsample7CL(_UpsampleCL, IM.Upsample7):
    def run(self, x):
        return self.upsample(x, np.asarray(self.scales, dtype=np.float32))


@register("Upsample", versions=IM.Upsample1.versions, backend="opencl")
class Upsample1CL(_UpsampleCL, IM.Upsample1):
    def run(self, x):
        if x.ndim != 4:
            raise self.fail("Upsample-1 takes a 4-D input")
        return self.upsample(x, np.array([1.0, 1.0, self.height_scale, self.width_scale],
                                         dtype=np.float32))


# ----------------------------------------------------------------------------- Identity / Dropout

_FILL = "__kernel void fill(__global {T}* out, {T} v) {{ out[get_global_id(0)] = v; }}"


def ones(be, shape, dtype):
    """A device array of backend `be` filled with ones."""
    out = be.empty(shape, dtype)
    if out.size:
        isz = out.dtype.itemsize
        one = np.ones(1, dtype).view(NP_UINT[isz])[0]
        launch(be, kernel(be, _FILL.format(T=UINT[isz]), "fill"), out.size, out, one)
    return out


@register("Identity", versions=TE.Identity.versions, backend="opencl")
class IdentityCL(TE.Identity):
    pass  # returns its input (a device array stays on the device)


class _DropoutCL:
    def run(self, x, *rest):
        if not on_device(self.device, x):
            return self.run_on_cpu(x, *rest)
        training = len(rest) > 1 and rest[1] is not None and \
            bool(np.asarray(rest[1]).reshape(()))
        if training:
            ratio = 0.5 if rest[0] is None else float(np.asarray(rest[0]).reshape(()))
            if ratio != 0:
                return self.run_on_cpu(x, *rest)  # random masks: on the CPU
        if self.n_outputs > 1:
            mask_dtype = np.bool_ if self.version >= 10 else x.dtype
            return x, ones(self.device, x.shape, mask_dtype)
        return x


@register("Dropout", versions=NO.Dropout1.versions, backend="opencl")
class Dropout1CL(_DropoutCL, NO.Dropout1):
    pass


@register("Dropout", versions=NO.Dropout7.versions, backend="opencl")
class Dropout7CL(_DropoutCL, NO.Dropout7):
    pass


@register("Dropout", versions=NO.Dropout10.versions, backend="opencl")
class Dropout10CL(_DropoutCL, NO.Dropout10):
    pass


@register("Dropout", versions=NO.Dropout12.versions, backend="opencl")
class Dropout12CL(_DropoutCL, NO.Dropout12):
    host_inputs = (1, 2)

"""OpenCL normalisations: BatchNormalization (inference), LayerNormalization (with its Mean and
InvStdDev outputs), InstanceNormalization, GroupNormalization (18: per-group, 21: per-channel
scale/bias), RMSNormalization, LpNormalization.

The statistics ops share one kernel shape: the input seen as [rows, cols] (a LayerNorm row,
an instance's channel, a group), one work-group per row; the work-items stride the row and
combine partial sums by a tree in local memory. The variance is two-pass (the mean first,
then the mean squared deviation) in the stash precision, like the CPU kernels. The affine
step indexes scale/bias by a per-op expression in the row and column. BatchNormalization
(inference) is elementwise. float32/float64 run natively; other dtypes and training-mode
BatchNormalization run on the CPU.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ember.ops.normalization import (
    BatchNormalization1, BatchNormalization14, GroupNormalization18, GroupNormalization21,
    InstanceNormalization, LayerNormalization17, LpNormalization, RMSNormalization23,
    _norm_axis, _stash_dtype)
from ember.ops.opencl._common import FLOAT_TYPES, c_type, kernel, launch
from ember.ops.opencl.reduction import local_size, outer_n_inner, tree_code
from ember.ops.registry import register

_i64 = np.int64


# --------------------------------------------------------------------------------------------
# Row statistics + affine: LayerNorm, InstanceNorm, GroupNorm, RMSNorm

# How each op turns (row r, column j, params p0 p1) into the scale and bias indices.
_PARAM_INDEX = {
    "layer": ("j * p0", "j * p1"),            # p0/p1: 1, or 0 for a one-element scale/bias
    "rms": ("j * p0", "0"),
    "instance": ("r % p0", "r % p0"),         # p0: C
    "group": ("r % p0", "r % p0"),            # p0: G
    "group_channel": ("(r % p0) * p1 + j / (cols / p1)",) * 2,  # p0: G, p1: C/G
}


@lru_cache(maxsize=None)
def _rownorm_source(op: str, t: str, acc: str, has_bias: bool, stats: bool, ls: int) -> str:
    rms = op == "rms"
    si, bi = _PARAM_INDEX[op]
    if op == "instance":
        # all in ACC (== T), as the CPU kernel does
        affine = f"(T)(n * (ACC)scale[{si}] + (ACC)bias[{bi}])"
    else:
        # the normalised value is cast to T first, then scaled in T (LayerNorm, GroupNorm, RMS)
        affine = f"(T)n * scale[{si}]" + (f" + bias[{bi}]" if has_bias else "")
    stat_args = ", __global ACC *mean_out, __global ACC *inv_out" if stats else ""
    stat_write = "if (lid == 0) { mean_out[r] = mean; inv_out[r] = inv; }" if stats else ""
    if ls == 1:  # serial form: one work-item per row, no local memory
        head = "const long r = get_global_id(0); if (r >= rows) return; const int lid = 0;"
        tree = lambda name: ""  # noqa: E731
    else:
        head = "const long r = get_group_id(0); const int lid = get_local_id(0);\n" \
               "    __local ACC buf[LS];"
        tree = lambda name: tree_code(name, "ACC", "a + b")  # noqa: E731
    if rms:
        moments = f"""
    ACC s = 0;
    for (long j = lid; j < cols; j += LS) {{ const ACC v = (ACC)xr[j]; s += v * v; }}
    {tree('s')}
    const ACC mean = 0;
    const ACC inv = (ACC)1 / sqrt(s / (ACC)cols + eps);"""
    else:
        moments = f"""
    ACC s = 0;
    for (long j = lid; j < cols; j += LS) s += (ACC)xr[j];
    {tree('s')}
    const ACC mean = s / (ACC)cols;
    ACC q = 0;
    for (long j = lid; j < cols; j += LS) {{ const ACC d = (ACC)xr[j] - mean; q += d * d; }}
    {tree('q')}
    const ACC inv = (ACC)1 / sqrt(q / (ACC)cols + eps);"""
    return f"""
#define T {t}
#define ACC {acc}
#define LS {ls}
__kernel void rownorm(__global const T *x, __global T *y, __global const T *scale,
                      __global const T *bias{stat_args}, const long cols, const ACC eps,
                      const long p0, const long p1, const long rows) {{
    {head}
    __global const T *xr = x + r * cols; __global T *yr = y + r * cols;
    {moments}
    for (long j = lid; j < cols; j += LS) {{
        const ACC n = ((ACC)xr[j] - mean) * inv;
        yr[j] = {affine};
    }}
    {stat_write}
}}
"""


def rownorm(be, op: str, x, scale, bias, rows: int, cols: int, eps: float, acc_dtype,
            p0: int = 0, p1: int = 0, stats: bool = False):
    """Normalise device array `x` of backend `be` (contiguous, rows * cols elements) row by
    row; returns y (x's shape and dtype), plus (mean, inv_std) vectors of `rows` in acc_dtype
    with stats."""
    y = be.empty(tuple(x.shape), x.dtype)
    acc_dtype = np.dtype(acc_dtype)
    mean = inv = None
    if stats:
        mean, inv = be.empty((rows,), acc_dtype), be.empty((rows,), acc_dtype)
    if y.size == 0 or rows == 0:
        return y, mean, inv
    ls = local_size(be, cols)
    knl = kernel(be, _rownorm_source(op, c_type(x.dtype), c_type(acc_dtype), bias is not None,
                                     stats, ls), "rownorm")
    args = [x, y, scale, bias if bias is not None else scale]
    if stats:
        args += [mean, inv]
    launch(be, knl, rows * ls, *args, _i64(cols), acc_dtype.type(eps), _i64(p0), _i64(p1),
           _i64(rows), local_size=(ls,) if ls > 1 else None)
    return y, mean, inv


def _same_float(x, *others) -> bool:
    return x.dtype in FLOAT_TYPES and all(o is None or o.dtype == x.dtype for o in others)


def _strip(shape) -> tuple[int, ...]:
    shape = tuple(int(n) for n in shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _covers(p, norm_shape: tuple[int, ...], rank: int) -> bool:
    """Whether parameter `p` (scale/bias) is one element, or exactly the normalised axes
    (up to leading 1s), so the kernel can index it by column; else the CPU broadcasts it."""
    if p is None:
        return True
    if p.ndim > rank:
        return False
    return p.size == 1 or _strip(p.shape) == _strip(norm_shape)


@register("LayerNormalization", versions=LayerNormalization17.versions, backend="opencl")
class LayerNormalization17CL(LayerNormalization17):
    dtypes = FLOAT_TYPES

    def run(self, x, scale, b=None):
        axis = _norm_axis(self, self.axis, x.ndim)
        sd = _stash_dtype(self, x)
        norm_shape = tuple(x.shape[axis:])
        cols = int(np.prod(norm_shape, dtype=np.int64))
        if not _same_float(x, scale, b) or sd not in FLOAT_TYPES or cols == 0 \
                or not _covers(scale, norm_shape, x.ndim) or not _covers(b, norm_shape, x.ndim):
            return self.run_on_cpu(x, scale, b)
        rows = x.size // cols
        stats = self.n_outputs > 1
        y, mean, inv = rownorm(self.device, "layer", x, scale, b, rows, cols, self.epsilon, sd,
                               p0=int(scale.size != 1), p1=int(b is not None and b.size != 1),
                               stats=stats)
        if not stats:
            return y
        stat_shape = tuple(x.shape[:axis]) + (1,) * (x.ndim - axis)
        return y, mean.reshape(stat_shape), inv.reshape(stat_shape)


@register("InstanceNormalization", versions=InstanceNormalization.versions, backend="opencl")
class InstanceNormalizationCL(InstanceNormalization):
    dtypes = FLOAT_TYPES

    def run(self, x, scale, b):
        if not _same_float(x, scale, b) or x.ndim < 2:
            return self.run_on_cpu(x, scale, b)
        n, c = x.shape[0], x.shape[1]
        cols = int(np.prod(x.shape[2:], dtype=np.int64))
        if cols == 0 or scale.size != c or b.size != c:
            return self.run_on_cpu(x, scale, b)
        y, _, _ = rownorm(self.device, "instance", x, scale, b, n * c, cols, self.epsilon,
                          x.dtype, p0=c)
        return y


class _GroupNormCL:
    dtypes = FLOAT_TYPES

    def run(self, x, scale, b):
        n, c = x.shape[0], x.shape[1]
        g = int(self.num_groups)
        if g <= 0 or c % g:
            raise self.fail(f"num_groups {g} does not divide the {c} channels")
        sd = _stash_dtype(self, x)
        want = c if self.per_channel_params else g
        if not _same_float(x, scale, b) or sd not in FLOAT_TYPES or scale.size != want \
                or b.size != want:
            return self.run_on_cpu(x, scale, b)
        cols = x.size // (n * g) if n * g else 0
        spatial = int(np.prod(x.shape[2:], dtype=np.int64))
        if cols == 0 or spatial == 0:
            return self.run_on_cpu(x, scale, b)
        op = "group_channel" if self.per_channel_params else "group"
        y, _, _ = rownorm(self.device, op, x, scale, b, n * g, cols, self.epsilon, sd, p0=g,
                          p1=c // g)
        return y


@register("GroupNormalization", versions=GroupNormalization18.versions, backend="opencl")
class GroupNormalization18CL(_GroupNormCL, GroupNormalization18):
    pass


@register("GroupNormalization", versions=GroupNormalization21.versions, backend="opencl")
class GroupNormalization21CL(_GroupNormCL, GroupNormalization21):
    pass


@register("RMSNormalization", versions=RMSNormalization23.versions, backend="opencl")
class RMSNormalization23CL(RMSNormalization23):
    dtypes = FLOAT_TYPES

    def run(self, x, scale):
        axis = _norm_axis(self, self.axis, x.ndim)
        sd = _stash_dtype(self, x)
        norm_shape = tuple(x.shape[axis:])
        cols = int(np.prod(norm_shape, dtype=np.int64))
        if not _same_float(x, scale) or sd not in FLOAT_TYPES or cols == 0 \
                or not _covers(scale, norm_shape, x.ndim):
            return self.run_on_cpu(x, scale)
        y, _, _ = rownorm(self.device, "rms", x, scale, None, x.size // cols, cols,
                          self.epsilon, sd, p0=int(scale.size != 1))
        return y


# --------------------------------------------------------------------------------------------
# LpNormalization

@lru_cache(maxsize=None)
def _lp_source(t: str, p: int, ls: int) -> str:
    term = "fabs(v)" if p == 1 else "v * v"
    finish = "s" if p == 1 else "sqrt(s)"
    if ls:
        head = """const long o = get_group_id(0); const int lid = get_local_id(0);
    __local T buf[LS];
    __global const T *xr = x + o * n; __global T *yr = y + o * n;"""
        loop = "for (long j = lid; j < n; j += LS)"
        idx = "j"
        tree = tree_code("s", "T", "a + b")
    else:
        head = """const long g = get_global_id(0); if (g >= total) return;
    const long o = g / inner, i = g % inner;
    __global const T *xr = x + o * n * inner + i; __global T *yr = y + o * n * inner + i;"""
        loop = "for (long j = 0; j < n; ++j)"
        idx = "j * inner"
        tree = ""
    return f"""
#define T {t}
#define LS {max(ls, 1)}
__kernel void lpnorm(__global const T *x, __global T *y, const long n, const long inner,
                     const long total) {{
    {head}
    T s = 0;
    {loop} {{ const T v = xr[{idx}]; s += {term}; }}
    {tree}
    const T norm = {finish};
    {loop} yr[{idx}] = norm == 0 ? (T)0 : xr[{idx}] / norm;
}}
"""


@register("LpNormalization", versions=LpNormalization.versions, backend="opencl")
class LpNormalizationCL(LpNormalization):
    dtypes = FLOAT_TYPES

    def run(self, x):
        axis = _norm_axis(self, self.axis, x.ndim)
        if x.dtype not in self.dtypes:
            return self.run_on_cpu(x)
        be = self.device
        y = be.empty(tuple(x.shape), x.dtype)
        if y.size == 0:
            return y
        outer, n, inner = outer_n_inner(tuple(x.shape), axis)
        t = c_type(x.dtype)
        ls = local_size(be, n) if inner == 1 else 0
        if ls > 1:
            launch(be, kernel(be, _lp_source(t, int(self.p), ls), "lpnorm"), outer * ls, x, y,
                   _i64(n), _i64(1), _i64(outer), local_size=(ls,))
        else:
            launch(be, kernel(be, _lp_source(t, int(self.p), 0), "lpnorm"), outer * inner, x,
                   y, _i64(n), _i64(inner), _i64(outer * inner))
        return y


# --------------------------------------------------------------------------------------------
# BatchNormalization (inference)

@lru_cache(maxsize=None)
def _bn_source(t: str, pt: str) -> str:
    """y = (x - mean[c]) * (scale[c] / sqrt(var[c] + eps)) + b[c], c = (i / inner) % P.
    The parameters have C type `pt` (the inv factor is formed in it, then cast to T)."""
    return f"""
#define T {t}
#define P {pt}
__kernel void batchnorm(__global const T *x, __global T *y, __global const T *scale,
                        __global const T *bias, __global const P *mean, __global const P *var,
                        const long total, const long inner, const long np_, const P eps) {{
    const long i = get_global_id(0); if (i >= total) return;
    const long c = (i / inner) % np_;
    const T inv = (T)((P)scale[c] / sqrt(var[c] + eps));
    y[i] = (x[i] - (T)mean[c]) * inv + bias[c];
}}
"""


def _batchnorm(impl, x, scale, b, mean, var, spatial: bool):
    be = impl.device
    y = be.empty(tuple(x.shape), x.dtype)
    if y.size == 0:
        return y
    if spatial:
        c = x.shape[1] if x.ndim > 1 else 1
        inner = int(np.prod(x.shape[2:], dtype=np.int64))
        count = c
    else:  # per activation: parameters shaped like one sample
        inner = 1
        count = x.size // x.shape[0]
    if any(p.size != count for p in (scale, b, mean, var)):
        return None
    knl = kernel(be, _bn_source(c_type(x.dtype), c_type(var.dtype)), "batchnorm")
    launch(be, knl, y.size, x, y, scale, b, mean, var, _i64(y.size), _i64(max(inner, 1)),
           _i64(count), var.dtype.type(impl.epsilon))
    return y


@register("BatchNormalization", versions=BatchNormalization1.versions, backend="opencl")
class BatchNormalization1CL(BatchNormalization1):
    dtypes = FLOAT_TYPES

    def run(self, x, scale, b, mean, var):
        if self.n_outputs <= 1 and _same_float(x, scale, b, mean, var) and x.ndim >= 1:
            y = _batchnorm(self, x, scale, b, mean, var, bool(self.spatial))
            if y is not None:
                return y
        return self.run_on_cpu(x, scale, b, mean, var)


@register("BatchNormalization", versions=BatchNormalization14.versions, backend="opencl")
class BatchNormalization14CL(BatchNormalization14):
    dtypes = FLOAT_TYPES

    def run(self, x, scale, b, mean, var):
        if not self.training_mode and x.ndim >= 1 and _same_float(x, scale, b) \
                and mean.dtype in FLOAT_TYPES and var.dtype == mean.dtype:
            y = _batchnorm(self, x, scale, b, mean, var, True)
            if y is not None:
                return (y, mean, var) if self.n_outputs > 1 else y
        return self.run_on_cpu(x, scale, b, mean, var)

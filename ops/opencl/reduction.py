"""OpenCL reductions (ReduceSum .. ReduceLogSumExp), ArgMax/ArgMin, Softmax/LogSoftmax/Hardmax.

No transposes: the input is viewed through its kept and reduced axes. Size-1 axes are dropped
and neighbouring axes of the same kind merged, so the usual cases become [outer, R, inner]
(one reduced block) and the kernel's index arithmetic is a multiply; any other axis set runs
through the same kernel with a digit decomposition over the merged reduced axes.

Two launch shapes: when the innermost merged axis is reduced (rows: softmax/LayerNorm-style
reductions over the last axis) one work-group reduces one output, its work-items striding the
row (coalesced) and combining partials by a tree in local memory; otherwise (the innermost axis
is kept) one work-item per output loops over the reduced elements, neighbouring work-items
reading neighbouring addresses.

Numerics: float32 accumulates in float32 by tree (close to numpy's pairwise sums), float64 in
float64; softmax and log-sum-exp subtract the row maximum (a non-finite maximum counts as 0,
as on the CPU). float32/float64 run natively, other dtypes on the CPU.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ember.ops.opencl._common import FLOAT_TYPES, c_type, kernel, launch
from ember.ops.reduction import (
    ArgMax, ArgMin, Hardmax1, Hardmax13, LogSoftmax1, LogSoftmax13, ReduceL1_1, ReduceL1_18,
    ReduceL2_1, ReduceL2_18, ReduceLogSum1, ReduceLogSum18, ReduceLogSumExp1, ReduceLogSumExp18,
    ReduceMax1, ReduceMax18, ReduceMean1, ReduceMean18, ReduceMin1, ReduceMin18, ReduceProd1,
    ReduceProd18, ReduceSum1, ReduceSum13, ReduceSumSquare1, ReduceSumSquare18, Softmax1,
    Softmax13)
from ember.ops.registry import register

MAX_LOCAL = 256  # work-group size for row reductions (a power of two)
# Tests set this to run the GPU-style work-group kernels on a CPU device too.
FORCE_WORKGROUPS = False


# --------------------------------------------------------------------------------------------
# Shared helpers (also used by ops/opencl/normalization.py)

def local_size(be, n: int) -> int:
    """Work-group size for reducing rows of `n` elements on backend `be`: a power of two, at
    most MAX_LOCAL. On CPU devices (PoCL) 1: there a work-group runs on one thread anyway and
    its barriers cost more than they save, so each work-item reduces a whole row (row kernels
    then take their serial form, see _serial)."""
    if _cpu_device(be):
        return 1
    ls = 1
    while ls < n and ls < MAX_LOCAL:
        ls *= 2
    return ls


def _cpu_device(be) -> bool:
    return not FORCE_WORKGROUPS and be.cpu_device


def tree_code(name: str, acc: str, combine: str) -> str:
    """C statements reducing `name` over the work-group through `__local acc buf[LS]` (which
    the kernel declares) and leaving the result in `name` on every work-item. `combine` is an
    expression in a and b."""
    return f"""
    buf[lid] = {name};
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s_ = LS / 2; s_ > 0; s_ >>= 1) {{
        if (lid < s_) {{ {acc} a = buf[lid], b = buf[lid + s_]; buf[lid] = {combine}; }}
        barrier(CLK_LOCAL_MEM_FENCE);
    }}
    {name} = buf[0];
    barrier(CLK_LOCAL_MEM_FENCE);
"""


def outer_n_inner(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """`shape` seen as [outer, shape[axis], inner]."""
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    return outer, int(shape[axis]), inner


def _i64(v) -> np.int64:
    return np.int64(v)


def _merge(shape: tuple[int, ...], axes: tuple[int, ...]):
    """Kept and reduced axes of `shape` as (sizes, element strides) lists, outermost first,
    with size-1 axes dropped and neighbours of the same kind merged; and whether the innermost
    remaining axis is a reduced one."""
    strides, step = [0] * len(shape), 1
    for i in range(len(shape) - 1, -1, -1):
        strides[i] = step
        step *= shape[i]
    runs: list[list] = []  # [reduced?, size, stride]
    for i, n in enumerate(shape):
        if n == 1:
            continue
        red = i in axes
        if runs and runs[-1][0] == red and runs[-1][2] == n * strides[i]:
            runs[-1][1] *= n
            runs[-1][2] = strides[i]
        else:
            runs.append([red, n, strides[i]])
    kept = [(n, s) for red, n, s in runs if not red]
    reduced = [(n, s) for red, n, s in runs if red]
    last_reduced = bool(runs) and runs[-1][0]
    return kept, reduced, last_reduced


def _offset_code(var: str, index: str, prefix: str, n: int) -> str:
    """C code declaring `long var`, the element offset of flat `index` over the n merged axes
    with sizes {prefix}s{i} and strides {prefix}t{i}."""
    if n == 0:
        return f"long {var} = 0;"
    if n == 1:
        return f"long {var} = ({index}) * {prefix}t0;"
    lines = [f"long {var} = 0; {{ long q_ = {index};"]
    for i in range(n - 1, 0, -1):
        lines.append(f"{var} += (q_ % {prefix}s{i}) * {prefix}t{i}; q_ /= {prefix}s{i};")
    lines.append(f"{var} += q_ * {prefix}t0; }}")
    return " ".join(lines)


# --------------------------------------------------------------------------------------------
# Reductions

# op -> (identity, map(v), combine(a, b), finish(acc, R)); v, a, b and acc are ACC values.
_NAN_MAX = "((isnan(a) || a > b) ? a : b)"
_NAN_MIN = "((isnan(a) || a < b) ? a : b)"
_REDUCE_OPS = {
    "sum": ("0", "v", "a + b", "acc"),
    "mean": ("0", "v", "a + b", "acc / (ACC)R"),
    "max": ("-INFINITY", "v", _NAN_MAX, "acc"),
    "min": ("INFINITY", "v", _NAN_MIN, "acc"),
    "prod": ("1", "v", "a * b", "acc"),
    "l1": ("0", "fabs(v)", "a + b", "acc"),
    "l2": ("0", "v * v", "a + b", "sqrt(acc)"),
    "sumsquare": ("0", "v * v", "a + b", "acc"),
    "logsum": ("0", "v", "a + b", "log(acc)"),
    # log-sum-exp: a max pass (m), then sum(exp(v - m)); see _reduce_source
    "logsumexp": ("0", "exp(v - m)", "a + b", "log(acc) + m"),
}
# Integer and bool inputs: these ops run natively in the input type (sums and products wrap
# like numpy's with dtype=x.dtype; bool max/min are any/all).
INT_TYPES = frozenset(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                            np.uint32, np.int64, np.uint64))
_INT_OPS = {"sum": INT_TYPES, "prod": INT_TYPES, "sumsquare": INT_TYPES,
            "max": INT_TYPES | {np.dtype(np.bool_)}, "min": INT_TYPES | {np.dtype(np.bool_)}}


def _int_literal(v: int, dtype: np.dtype) -> str:
    if dtype.kind == "i" and v == np.iinfo(dtype).min:
        return f"({v + 1}L - 1)"
    return f"{v}{'UL' if dtype.kind == 'u' else 'L'}"


def _op_parts(op: str, dtype: np.dtype) -> tuple[str, str, str, str]:
    if dtype.kind == "f":
        return _REDUCE_OPS[op]
    if op in ("max", "min"):
        if dtype.kind == "b":
            ident = "0" if op == "max" else "1"
        else:
            info = np.iinfo(dtype)
            ident = _int_literal(int(info.min if op == "max" else info.max), dtype)
        return (f"(ACC){ident}", "v", "(a > b ? a : b)" if op == "max" else "(a < b ? a : b)",
                "acc")
    return {"sum": ("0", "v", "a + b", "acc"), "prod": ("1", "v", "a * b", "acc"),
            "sumsquare": ("0", "v * v", "a + b", "acc")}[op]


@lru_cache(maxsize=None)
def _reduce_source(op: str, dt: str, nk: int, nr: int, ls: int) -> str:
    """Kernel `reduce`: y[o] = op over the reduced elements of output o. ls == 0: one
    work-item per output; else one work-group of ls work-items per output. `dt`: the numpy
    dtype's str."""
    ctype = c_type(dt)
    init, fmap, combine, finish = _op_parts(op, np.dtype(dt))
    params = "".join(f", long ks{i}, long kt{i}" for i in range(nk)) + \
        "".join(f", long rs{i}, long rt{i}" for i in range(nr))
    if ls:
        head = "const long o = get_group_id(0); const int lid = get_local_id(0);\n" \
               "    __local ACC buf[LS];"
        loop = "for (long r = lid; r < R; r += LS)"
    else:
        head = "const long o = get_global_id(0); if (o >= O) return;"
        loop = "for (long r = 0; r < R; ++r)"
    read = f"{_offset_code('off', 'r', 'r', nr)} const ACC v = (ACC)x[base + off];"

    def tree(name, comb):
        return tree_code(name, "ACC", comb) if ls else ""

    pre = ""
    if op == "logsumexp":
        pre = f"""
    ACC m = -INFINITY;
    {loop} {{ {read} const ACC a = m, b = v; m = {_NAN_MAX}; }}
    {tree('m', _NAN_MAX)}
    if (!isfinite(m)) m = 0;"""
    return f"""
#define T {ctype}
#define ACC {ctype}
#define LS {max(ls, 1)}
__kernel void reduce(__global const T *x, __global T *y, const long O, const long R{params}) {{
    {head}
    {_offset_code('base', 'o', 'k', nk)}
    {pre}
    ACC acc = {init};
    {loop} {{ {read} const ACC a = acc, b = {fmap}; acc = {combine}; }}
    {tree('acc', combine)}
    if ({'lid == 0' if ls else '1'}) y[o] = (T)({finish});
}}
"""


@lru_cache(maxsize=None)
def _reduce_cols_source(op: str, dt: str, nk: int, nr: int, vec: int) -> str:
    """Kernel `reduce` for CPU devices when the innermost axis is kept: each work-item reduces
    `vec` neighbouring outputs along it, so every step reads `vec` contiguous elements (one
    work-item per output would walk a column, a cache line per element)."""
    ctype = c_type(dt)
    init, fmap, combine, finish = _op_parts(op, np.dtype(dt))
    params = "".join(f", long ks{i}, long kt{i}" for i in range(nk)) + \
        "".join(f", long rs{i}, long rt{i}" for i in range(nr))
    pre, mdecl = "", "const ACC m = 0; (void)m;"
    if op == "logsumexp":
        pre = f"""
    ACC ms[V];
    for (int u = 0; u < V; ++u) ms[u] = -INFINITY;
    for (long r = 0; r < R; ++r) {{
        {_offset_code('off', 'r', 'r', nr)} __global const T *p = x + base + off;
        for (int u = 0; u < cnt; ++u) {{ const ACC a = ms[u], b = (ACC)p[u]; ms[u] = {_NAN_MAX}; }}
    }}
    for (int u = 0; u < V; ++u) if (!isfinite(ms[u])) ms[u] = 0;"""
        mdecl = "const ACC m = ms[u];"
    step = f"const ACC v = (ACC)p[u]; {mdecl} const ACC a = accs[u], b = {fmap}; " \
           f"accs[u] = {combine};"
    return f"""
#define T {ctype}
#define ACC {ctype}
#define V {vec}
__kernel void reduce(__global const T *x, __global T *y, const long O, const long R{params}) {{
    const long K = ks{nk - 1}, chunks = (K + V - 1) / V;
    const long g = get_global_id(0); if (g >= (O / K) * chunks) return;
    const long c0 = (g % chunks) * V, o = (g / chunks) * K + c0;
    const int cnt = (int)min((long)V, K - c0);
    {_offset_code('base', 'o', 'k', nk)}
    {pre}
    ACC accs[V];
    for (int u = 0; u < V; ++u) accs[u] = {init};
    for (long r = 0; r < R; ++r) {{
        {_offset_code('off', 'r', 'r', nr)} __global const T *p = x + base + off;
        if (cnt == V) {{
            for (int u = 0; u < V; ++u) {{ {step} }}
        }} else {{
            for (int u = 0; u < cnt; ++u) {{ {step} }}
        }}
    }}
    for (int u = 0; u < cnt; ++u) {{ const ACC acc = accs[u]; {mdecl} y[o + u] = (T)({finish}); }}
}}
"""


COL_VECTOR = 16  # outputs per work-item in _reduce_cols_source


def reduce_device(be, x, axes: tuple[int, ...], op: str, out_shape: tuple[int, ...]):
    """Reduce device array `x` over sorted non-negative `axes` with `op` (a _REDUCE_OPS key),
    into a new device array of backend `be` of `out_shape` (its size is the number of kept
    elements)."""
    y = be.empty(out_shape, x.dtype)
    if y.size == 0:
        return y
    kept, reduced, last_reduced = _merge(tuple(x.shape), axes)
    R = int(np.prod([n for n, _ in reduced], dtype=np.int64))
    if x.size == 0:  # nothing to read (R == 0): every output is the identity
        kept, reduced, last_reduced, x = [(y.size, 0)], [], False, y
    ls = local_size(be, R) if last_reduced and R > 1 else 0
    ls = 0 if ls == 1 else ls
    knl = kernel(be, _reduce_source(op, x.dtype.str, len(kept), len(reduced), ls), "reduce")
    args = [a for n, s in kept + reduced for a in (_i64(n), _i64(s))]
    if ls:
        launch(be, knl, y.size * ls, x, y, _i64(y.size), _i64(R), *args, local_size=(ls,))
    elif not last_reduced and kept and kept[-1][0] > 1 and R > 1 and _cpu_device(be):
        k = kept[-1][0]
        knl = kernel(be, _reduce_cols_source(op, x.dtype.str, len(kept), len(reduced),
                                             COL_VECTOR), "reduce")
        launch(be, knl, y.size // k * -(-k // COL_VECTOR), x, y, _i64(y.size), _i64(R), *args)
    else:
        launch(be, knl, y.size, x, y, _i64(y.size), _i64(R), *args)
    return y


class _ReduceCL:
    """Mixin over a CPU reduction class: the same axes logic, a device kernel for floats."""

    op = ""
    dtypes = FLOAT_TYPES
    host_inputs = (1,)

    def run(self, data, axes=None):
        if data.dtype not in self.dtypes and data.dtype not in _INT_OPS.get(self.op, ()):
            return self.run_on_cpu(data, axes) if self.axes_from_input else self.run_on_cpu(data)
        rank = data.ndim
        axes = self.reduced_axes(rank, axes)
        if rank == 0:
            axes = ()
        if self.keepdims or rank == 0:
            out_shape = tuple(1 if i in axes else n for i, n in enumerate(data.shape))
        else:
            out_shape = tuple(n for i, n in enumerate(data.shape) if i not in axes)
        return reduce_device(self.device, data, axes, self.op, out_shape)


def _reduce_classes(op, cpu_classes):
    for cpu in cpu_classes:
        name = cpu.__name__ + "CL"
        cls = type(name, (_ReduceCL, cpu), {"op": op, "__module__": __name__})
        register(cpu.op_type, versions=cpu.versions, backend="opencl")(cls)
        globals()[name] = cls


_reduce_classes("sum", (ReduceSum1, ReduceSum13))
_reduce_classes("mean", (ReduceMean1, ReduceMean18))
_reduce_classes("max", (ReduceMax1, ReduceMax18))
_reduce_classes("min", (ReduceMin1, ReduceMin18))
_reduce_classes("prod", (ReduceProd1, ReduceProd18))
_reduce_classes("l1", (ReduceL1_1, ReduceL1_18))
_reduce_classes("l2", (ReduceL2_1, ReduceL2_18))
_reduce_classes("sumsquare", (ReduceSumSquare1, ReduceSumSquare18))
_reduce_classes("logsum", (ReduceLogSum1, ReduceLogSum18))
_reduce_classes("logsumexp", (ReduceLogSumExp1, ReduceLogSumExp18))


# --------------------------------------------------------------------------------------------
# ArgMax / ArgMin

def _better(largest: bool, last: bool, is_float: bool = True) -> str:
    """C condition: element (va, ia) beats the best so far (vb, ib). NaN beats everything
    (numpy's argmax/argmin return the first NaN); ties go to the lower (or, with
    select_last_index, the higher) index, so the reduction order is free."""
    cmp = ">" if largest else "<"
    tie = ">" if last else "<"
    if not is_float:
        return f"(va {cmp} vb || (va == vb && ia {tie} ib))"
    return (f"((isnan(va) && !isnan(vb)) || (!isnan(vb) && va {cmp} vb) || "
            f"((va == vb || (isnan(va) && isnan(vb))) && ia {tie} ib))")


def _argbest(better: str, ls: int) -> str:
    """C statements leaving in `bidx` the index of the best of the n elements of `row`: one
    work-group per row with a local-memory tree when `ls`, else serially with stride `inner`."""
    if not ls:
        return f"""
    T best = row[0]; long bidx = 0;
    for (long j = 1; j < n; ++j) {{
        const T va = row[j * inner], vb = best; const long ia = j, ib = bidx;
        if ({better}) {{ best = va; bidx = j; }}
    }}"""
    return f"""
    __local T bv[LS]; __local long bi[LS];
    T best = row[0]; long bidx = 0;
    for (long j = lid; j < n; j += LS) {{
        const T va = row[j], vb = best; const long ia = j, ib = bidx;
        if ({better}) {{ best = va; bidx = j; }}
    }}
    bv[lid] = best; bi[lid] = bidx;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = LS / 2; s > 0; s >>= 1) {{
        if (lid < s) {{
            const T va = bv[lid + s], vb = bv[lid]; const long ia = bi[lid + s], ib = bi[lid];
            if ({better}) {{ bv[lid] = va; bi[lid] = ia; }}
        }}
        barrier(CLK_LOCAL_MEM_FENCE);
    }}
    bidx = bi[0];"""


# Row addressing for x viewed as [outer, n, inner]: a work-group per row (inner == 1), or a
# work-item per (outer, inner) pair.
_ROW_PER_GROUP = "const long o = get_group_id(0); const int lid = get_local_id(0);\n" \
                 "    __global const T *row = x + o * n;"
_ROW_PER_ITEM = "const long g = get_global_id(0); if (g >= total) return;\n" \
                "    const long o = g / inner, i = g % inner;\n" \
                "    __global const T *row = x + o * n * inner + i;"


@lru_cache(maxsize=None)
def _arg_source(ctype: str, largest: bool, last: bool, ls: int, is_float: bool = True) -> str:
    """Kernel `argreduce` over x viewed as [outer, n, inner]: y[o*inner + i] = the index of the
    extreme along n."""
    head = _ROW_PER_GROUP if ls else _ROW_PER_ITEM
    store = "if (lid == 0) y[o] = bidx;" if ls else "y[g] = bidx;"
    return f"""
#define T {ctype}
#define LS {max(ls, 1)}
__kernel void argreduce(__global const T *x, __global long *y, const long n, const long inner,
                        const long total) {{
    {head}
    {_argbest(_better(largest, last, is_float), ls)}
    {store}
}}
"""


class _ArgCL:
    dtypes = FLOAT_TYPES | INT_TYPES | {np.dtype(np.bool_)}

    def run(self, data):
        rank = data.ndim
        if data.dtype not in self.dtypes or rank == 0:
            return self.run_on_cpu(data)
        axis = int(self.axis)
        if not -rank <= axis < rank:
            raise self.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
        axis %= rank
        if data.shape[axis] == 0:
            raise self.fail("cannot take ArgMax/ArgMin over an empty axis")
        shape = list(data.shape)
        if self.keepdims:
            shape[axis] = 1
        else:
            del shape[axis]
        be = self.device
        y = be.empty(tuple(shape), np.int64)
        if y.size == 0:
            return y
        outer, n, inner = outer_n_inner(tuple(data.shape), axis)
        fl = data.dtype.kind == "f"
        ls = local_size(be, n) if inner == 1 and n > 1 else 0
        if ls > 1:
            knl = kernel(be, _arg_source(c_type(data.dtype), self.largest, self.last, ls, fl),
                         "argreduce")
            launch(be, knl, outer * ls, data, y, _i64(n), _i64(inner), _i64(y.size),
                   local_size=(ls,))
        else:
            knl = kernel(be, _arg_source(c_type(data.dtype), self.largest, self.last, 0, fl),
                         "argreduce")
            launch(be, knl, y.size, data, y, _i64(n), _i64(inner), _i64(y.size))
        return y


@register("ArgMax", versions=ArgMax.versions, backend="opencl")
class ArgMaxCL(_ArgCL, ArgMax):
    pass


@register("ArgMin", versions=ArgMin.versions, backend="opencl")
class ArgMinCL(_ArgCL, ArgMin):
    pass


# --------------------------------------------------------------------------------------------
# Softmax / LogSoftmax / Hardmax

_SOFTMAX_OUT = {
    "logsoftmax": "(v - m) - log(s)",
}


@lru_cache(maxsize=None)
def _softmax_source(kind: str, ctype: str, ls: int) -> str:
    """Kernel `softmax` over x viewed as [outer, n, inner], along n. ls > 0: inner == 1, one
    work-group per row; ls == 0: one work-item per (outer, inner) column."""
    if kind == "hardmax":
        return _hardmax_source(ctype, ls)
    out = _SOFTMAX_OUT.get(kind, "")
    if ls:
        head = """const long o = get_group_id(0); const int lid = get_local_id(0);
    __local T buf[LS];
    __global const T *xr = x + o * n; __global T *yr = y + o * n;"""
        loop = "for (long j = lid; j < n; j += LS)"
        idx = "j"
    else:
        head = """const long g = get_global_id(0); if (g >= total) return;
    const long o = g / inner, i = g % inner;
    __global const T *xr = x + o * n * inner + i; __global T *yr = y + o * n * inner + i;"""
        loop = "for (long j = 0; j < n; ++j)"
        idx = "j * inner"
    tree_max = tree_code("m", "T", _NAN_MAX) if ls else ""
    if kind == "softmax":  # keep exp(v - m) in y, then divide: one exp per element
        pass2 = f"{loop} {{ const T e = exp(xr[{idx}] - m); yr[{idx}] = e; s += e; }}"
        pass3 = f"{loop} yr[{idx}] = yr[{idx}] / s;"
    else:
        pass2 = f"{loop} s += exp(xr[{idx}] - m);"
        pass3 = f"{loop} {{ const T v = xr[{idx}]; yr[{idx}] = {out}; }}"
    tree_sum = tree_code("s", "T", "a + b") if ls else ""
    return f"""
#define T {ctype}
#define LS {max(ls, 1)}
__kernel void softmax(__global const T *x, __global T *y, const long n, const long inner,
                      const long total) {{
    {head}
    T m = -INFINITY;
    {loop} {{ const T a = m, b = xr[{idx}]; m = {_NAN_MAX}; }}
    {tree_max}
    if (!isfinite(m)) m = 0;
    T s = 0;
    {pass2}
    {tree_sum}
    {pass3}
}}
"""


def _hardmax_source(ctype: str, ls: int) -> str:
    """Kernel `softmax` (the name the softmax family launches) writing Hardmax: one at the
    first index of each row's maximum, zero elsewhere."""
    head = _ROW_PER_GROUP if ls else _ROW_PER_ITEM
    yrow = "y + o * n" if ls else "y + o * n * inner + i"
    write = "for (long j = lid; j < n; j += LS) yr[j] = (T)(j == bidx);" if ls else \
        "for (long j = 0; j < n; ++j) yr[j * inner] = (T)(j == bidx);"
    return f"""
#define T {ctype}
#define LS {max(ls, 1)}
__kernel void softmax(__global const T *x, __global T *y, const long n, const long inner,
                      const long total) {{
    {head}
    __global T *yr = {yrow};
    {_argbest(_better(True, False), ls)}
    {write}
}}
"""


def softmax_device(be, x, axis: int, kind: str, coerce_2d: bool):
    """softmax/logsoftmax/hardmax of device array `x` of backend `be` along non-negative
    `axis` (over all the axes from `axis` on when coerce_2d)."""
    y = be.empty(tuple(x.shape), x.dtype)
    if y.size == 0:
        return y
    shape = tuple(x.shape)
    if coerce_2d:
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        n, inner = y.size // outer, 1
    else:
        outer, n, inner = outer_n_inner(shape, axis)
    ct = c_type(x.dtype)
    ls = local_size(be, n) if inner == 1 else 0
    if ls > 1:
        knl = kernel(be, _softmax_source(kind, ct, ls), "softmax")
        launch(be, knl, outer * ls, x, y, _i64(n), _i64(1), _i64(outer), local_size=(ls,))
    else:
        knl = kernel(be, _softmax_source(kind, ct, 0), "softmax")
        launch(be, knl, outer * inner, x, y, _i64(n), _i64(inner), _i64(outer * inner))
    return y


class _SoftmaxCL:
    dtypes = FLOAT_TYPES
    kind = "softmax"

    def run(self, x):
        if x.dtype not in self.dtypes:
            return self.run_on_cpu(x)
        rank = x.ndim
        axis = int(self.axis)
        if rank == 0:
            if axis not in (0, -1):
                raise self.fail(f"axis {axis} is out of range for a scalar")
            return softmax_device(self.device, x.reshape(1), 0, self.kind, False).reshape(())
        hi = rank if self.coerce_2d else rank - 1
        if not -rank <= axis <= hi:
            raise self.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
        if axis < 0:
            axis += rank
        return softmax_device(self.device, x, axis, self.kind, self.coerce_2d)


@register("Softmax", versions=Softmax1.versions, backend="opencl")
class Softmax1CL(_SoftmaxCL, Softmax1):
    pass


@register("Softmax", versions=Softmax13.versions, backend="opencl")
class Softmax13CL(_SoftmaxCL, Softmax13):
    pass


@register("LogSoftmax", versions=LogSoftmax1.versions, backend="opencl")
class LogSoftmax1CL(_SoftmaxCL, LogSoftmax1):
    kind = "logsoftmax"


@register("LogSoftmax", versions=LogSoftmax13.versions, backend="opencl")
class LogSoftmax13CL(_SoftmaxCL, LogSoftmax13):
    kind = "logsoftmax"


@register("Hardmax", versions=Hardmax1.versions, backend="opencl")
class Hardmax1CL(_SoftmaxCL, Hardmax1):
    kind = "hardmax"


@register("Hardmax", versions=Hardmax13.versions, backend="opencl")
class Hardmax13CL(_SoftmaxCL, Hardmax13):
    kind = "hardmax"

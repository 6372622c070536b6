"""OpenCL MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool.

Windowed pools run 1-D, 2-D and 3-D as 3-D (missing leading axes of size 1), one output element
per work-item; padding is never materialised (taps outside the input are skipped). Kernel
sizes, strides and dilations are compile-time constants. MaxPool's Indices output runs on the
CPU.
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops.opencl._common import FLOAT_TYPES, c_type, kernel, launch
from ember.ops.opencl.conv import _defines, as3d
from ember.ops.pool import AveragePool, GlobalAveragePool, GlobalMaxPool, MaxPool
from ember.ops.registry import register

_LOWEST = {np.dtype(np.float32): "-INFINITY", np.dtype(np.float64): "-INFINITY",
           np.dtype(np.int8): "-128", np.dtype(np.uint8): "0", np.dtype(np.int16): "-32768",
           np.dtype(np.uint16): "0", np.dtype(np.int32): "(-2147483647 - 1)",
           np.dtype(np.uint32): "0", np.dtype(np.int64): "(-9223372036854775807L - 1)",
           np.dtype(np.uint64): "0"}

_POOL = """
__kernel void pool(const int ID, const int IH, const int IW,
                   const int OD, const int OH, const int OW,
                   const int PD, const int PH, const int PW,
                   const int ED, const int EH, const int EW,
                   __global const T* restrict x, __global T* restrict y) {
  const int l = get_global_id(0), nc = get_global_id(1);
  const int L = OD * OH * OW;
  if (l >= L) return;
  const int zw = l % OW, q = l / OW;
  const int zh = q % OH, zd = q / OH;
  __global const T* xs = x + (long)nc * ID * IH * IW;
  const int d0 = zd * SD - PD, h0 = zh * SH - PH, w0 = zw * SW - PW;
#if IS_MAX
  T acc = LOWEST;
#else
  ACC acc = 0;
#endif
  for (int td = 0; td < KD; td++) {
    const int id = d0 + td * DD;
    if ((uint)id >= (uint)ID) continue;
    for (int th = 0; th < KH; th++) {
      const int ih = h0 + th * DH;
      if ((uint)ih >= (uint)IH) continue;
      __global const T* row = xs + ((long)id * IH + ih) * IW;
      for (int tw = 0; tw < KW; tw++) {
        const int iw = w0 + tw * DW;
        if ((uint)iw < (uint)IW) {
#if IS_MAX
          const T v = row[iw];
          acc = v > acc ? v : acc;
#else
          acc += row[iw];
#endif
        }
      }
    }
  }
#if IS_MAX
  y[(long)nc * L + l] = acc;
#else
  /* per-axis counts of taps inside [lo, hi): the input, or the input plus its pads */
  int cd = 0, ch = 0, cw = 0;
  for (int t = 0; t < KD; t++) { const int p = d0 + t * DD; cd += p >= -INC * PD && p < ID + INC * ED; }
  for (int t = 0; t < KH; t++) { const int p = h0 + t * DH; ch += p >= -INC * PH && p < IH + INC * EH; }
  for (int t = 0; t < KW; t++) { const int p = w0 + t * DW; cw += p >= -INC * PW && p < IW + INC * EW; }
  const ACC div = (ACC)max(cd, 1) * (ACC)max(ch, 1) * (ACC)max(cw, 1);
  y[(long)nc * L + l] = (T)(acc / div);
#endif
}

__kernel void global_pool(const int S, __global const T* restrict x, __global T* restrict y) {
  const int nc = get_global_id(0);
  __global const T* xs = x + (long)nc * S;
#if IS_MAX
  T acc = LOWEST;
  for (int i = 0; i < S; i++) { const T v = xs[i]; acc = v > acc ? v : acc; }
  y[nc] = acc;
#else
  ACC acc = 0;
  for (int i = 0; i < S; i++) acc += xs[i];
  y[nc] = (T)(acc / (ACC)S);
#endif
}
"""


def _pool_kernel(be, name, dtype, is_max, include_pad=False, kernel_=(1,), strides=(1,),
                 dilations=(1,)):
    dtype = np.dtype(dtype)
    acc = "double" if dtype == np.float64 else "float"
    src = (f"typedef {c_type(dtype)} T;\ntypedef {acc} ACC;\n#define IS_MAX {int(is_max)}\n"
           f"#define LOWEST {_LOWEST.get(dtype, '0')}\n#define INC {int(include_pad)}\n"
           + _defines(kernel_, strides, dilations) + _POOL)
    return kernel(be, src, name)


def _run_window(op, x, is_max):
    kernel_, strides, dilations, begin, end, end_eff, outs = op.geometry(x)
    be = op.device
    N, C = x.shape[:2]
    y = be.empty((N, C, *outs), x.dtype)
    L = math.prod(outs)
    if N * C == 0 or L == 0:
        return y
    include_pad = bool(getattr(op, "count_include_pad", 0) or 0)
    knl = _pool_kernel(be, "pool", x.dtype, is_max, include_pad, kernel_, strides, dilations)
    geo = as3d(x.shape[2:], 1) + as3d(outs, 1) + as3d(begin, 0) + as3d(end, 0)
    launch(be, knl, (L, N * C), *[np.int32(v) for v in geo], x, y)
    return y


@register("MaxPool", versions=MaxPool.versions, backend="opencl")
class MaxPoolCL(MaxPool):
    dtypes = frozenset(_LOWEST)

    def run(self, x):
        if x.dtype not in self.dtypes or self.n_outputs > 1 or not 1 <= x.ndim - 2 <= 3:
            return self.run_on_cpu(x)
        return _run_window(self, x, True)


@register("AveragePool", versions=AveragePool.versions, backend="opencl")
class AveragePoolCL(AveragePool):
    dtypes = FLOAT_TYPES

    def run(self, x):
        if x.dtype not in self.dtypes or not 1 <= x.ndim - 2 <= 3:
            return self.run_on_cpu(x)
        return _run_window(self, x, False)


def _run_global(op, x, is_max):
    if x.ndim < 3:
        return op.run_on_cpu(x)
    N, C = x.shape[:2]
    S = math.prod(x.shape[2:])
    be = op.device
    y = be.empty((N, C) + (1,) * (x.ndim - 2), x.dtype)
    if N * C == 0:
        return y
    if S == 0:
        return op.run_on_cpu(x)
    launch(be, _pool_kernel(be, "global_pool", x.dtype, is_max), (N * C,), np.int32(S), x, y)
    return y


@register("GlobalAveragePool", versions=GlobalAveragePool.versions, backend="opencl")
class GlobalAveragePoolCL(GlobalAveragePool):
    dtypes = FLOAT_TYPES

    def run(self, x):
        if x.dtype not in self.dtypes:
            return self.run_on_cpu(x)
        return _run_global(self, x, False)


@register("GlobalMaxPool", versions=GlobalMaxPool.versions, backend="opencl")
class GlobalMaxPoolCL(GlobalMaxPool):
    dtypes = frozenset(_LOWEST)

    def run(self, x):
        if x.dtype not in self.dtypes:
            return self.run_on_cpu(x)
        return _run_global(self, x, True)

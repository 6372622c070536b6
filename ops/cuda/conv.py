"""Native CUDA kernels for 2-D convolution and pooling (float32/float64, NCHW).

Conv: an im2col RawKernel gathers each output pixel's receptive field into a column matrix
(N, C*KH*KW, OH*OW); one batched cupy.matmul per call (cuBLAS) multiplies it by the grouped
weights. MaxPool/AveragePool: one thread per output element loops over its window. Other ranks,
dtypes and attribute combinations (MaxPool's Indices output) take the shared path: the CPU
kernels' array code over cupy (see _common.py).
"""
from __future__ import annotations

import numpy as np

from ember.ops import conv as cpu_conv
from ember.ops import fused as cpu_fused
from ember.ops import pool as cpu_pool
from ember.ops.cuda._common import (C_TYPES, FLOAT_TYPES, launch, native_kernels, raw_kernel,
                                    shared_class)
from ember.ops.registry import register

_IM2COL = r"""
extern "C" __global__ void im2col_{T}(
    const {T}* __restrict__ x, {T}* __restrict__ col, long long total,
    int C, int H, int W, int KH, int KW, int OH, int OW,
    int SH, int SW, int PH, int PW, int DH, int DW)
{
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)blockDim.x * gridDim.x) {
    long long r = idx;
    int ow = (int)(r % OW); r /= OW;
    int oh = (int)(r % OH); r /= OH;
    int kw = (int)(r % KW); r /= KW;
    int kh = (int)(r % KH); r /= KH;
    int c = (int)(r % C);
    long long n = r / C;
    int ih = oh * SH - PH + kh * DH;
    int iw = ow * SW - PW + kw * DW;
    {T} v = ({T})0;
    if (ih >= 0 && ih < H && iw >= 0 && iw < W)
      v = x[((n * C + c) * H + ih) * (long long)W + iw];
    col[idx] = v;
  }
}
"""

_POOL = r"""
extern "C" __global__ void pool2d_{T}(
    const {T}* __restrict__ x, {T}* __restrict__ y, long long total,
    int H, int W, int KH, int KW, int OH, int OW,
    int SH, int SW, int PH, int PW, int DH, int DW,
    int is_max, int lo_h, int hi_h, int lo_w, int hi_w)
{
  for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
       idx += (long long)blockDim.x * gridDim.x) {
    int ow = (int)(idx % OW);
    int oh = (int)((idx / OW) % OH);
    long long nc = idx / ((long long)OW * OH);
    const {T}* plane = x + nc * (long long)H * W;
    {T} acc = is_max ? -({T})INFINITY : ({T})0;
    int cnt_h = 0, cnt_w = 0;
    for (int kh = 0; kh < KH; ++kh) {
      int ih = oh * SH - PH + kh * DH;
      if (ih >= lo_h && ih < hi_h) ++cnt_h;
      if (ih < 0 || ih >= H) continue;
      for (int kw = 0; kw < KW; ++kw) {
        int iw = ow * SW - PW + kw * DW;
        if (iw < 0 || iw >= W) continue;
        {T} v = plane[ih * (long long)W + iw];
        if (is_max) { if (v > acc || v != v) acc = v; }
        else acc += v;
      }
    }
    if (!is_max) {
      for (int kw = 0; kw < KW; ++kw) {
        int iw = ow * SW - PW + kw * DW;
        if (iw >= lo_w && iw < hi_w) ++cnt_w;
      }
      acc /= ({T})(max(cnt_h, 1) * max(cnt_w, 1));
    }
    y[idx] = acc;
  }
}
"""

_HEADER = "#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n"


def _source(template: str, dtype) -> str:
    return _HEADER + template.replace("{T}", C_TYPES[np.dtype(dtype)])


CUDA_SOURCES = {f"{name}_{C_TYPES[np.dtype(t)]}": _source(src, t)
                for name, src in (("im2col", _IM2COL), ("pool2d", _POOL))
                for t in (np.float32, np.float64)}


def _kernel(name: str, dtype):
    ctype = C_TYPES[np.dtype(dtype)]
    return raw_kernel(CUDA_SOURCES[f"{name}_{ctype}"], f"{name}_{ctype}")


def _native(xp, x) -> bool:
    return native_kernels(xp) and x.ndim == 4 and x.dtype in FLOAT_TYPES and x.size > 0


# ----------------------------------------------------------------------------------------------

@register("Conv", versions=cpu_conv.Conv.versions, backend="cuda")
class ConvCUDA(shared_class(cpu_conv.Conv)):

    def run(self, x, w, b=None):
        if not (_native(self.xp, x) and w.dtype == x.dtype and (b is None or b.dtype == x.dtype)):
            return super().run(x, w, b)  # the CPU kernel's array code over cupy
        cp = self.xp
        kernel, strides, dilations, begin, end = cpu_conv.Conv.geometry(self, x, w)
        N, C, H, W = x.shape
        M = w.shape[0]
        G = int(self.group)
        KH, KW = kernel
        OH, OW = cpu_conv.out_size([H, W], kernel, strides, dilations, begin, end)
        if OH <= 0 or OW <= 0:
            return super().run(x, w, b)
        x = cp.ascontiguousarray(x)
        col = cp.empty((N, C * KH * KW, OH * OW), x.dtype)
        total = col.size
        launch(_kernel("im2col", x.dtype), total, x, col, np.int64(total),
               *(np.int32(v) for v in (C, H, W, KH, KW, OH, OW, strides[0], strides[1],
                                       begin[0], begin[1], dilations[0], dilations[1])))
        K = (C // G) * KH * KW
        wm = cp.ascontiguousarray(w).reshape(1, G, M // G, K)
        y = cp.matmul(wm, col.reshape(N, G, K, OH * OW))  # cuBLAS, batched over (N, G)
        y = y.reshape(N, M, OH, OW)
        if b is not None:
            y += b.reshape(1, M, 1, 1)
        return y


@register("FusedConv", versions=[1], domain=cpu_fused.DOMAIN, backend="cuda")
class FusedConvCUDA(ConvCUDA):
    """The native Conv above, then the fused epilogue (residual, activation) over cupy."""
    _activation_setup = cpu_fused.FusedConv._activation_setup
    finish = cpu_fused.FusedConv.finish

    def setup(self):
        super().setup()
        self._activation_setup()

    def run(self, x, w, b=None, z=None):
        return self.finish(super().run(x, w, b), z=z)


class _Pool2D:
    is_max = 0

    def run(self, x):
        if not _native(self.xp, x) or self.n_outputs > 1:
            return super().run(x)
        cp = self.xp
        kernel, strides, dilations, begin, end, end_eff, outs = \
            cpu_pool._WindowPool.geometry(self, x)
        N, C, H, W = x.shape
        OH, OW = outs
        if OH <= 0 or OW <= 0:
            return super().run(x)
        include_pad = bool(getattr(self, "count_include_pad", 0) or 0)
        if include_pad:
            bounds = (-begin[0], H + end[0], -begin[1], W + end[1])
        else:
            bounds = (0, H, 0, W)
        x = cp.ascontiguousarray(x)
        y = cp.empty((N, C, OH, OW), x.dtype)
        launch(_kernel("pool2d", x.dtype), y.size, x, y, np.int64(y.size),
               *(np.int32(v) for v in (H, W, kernel[0], kernel[1], OH, OW, strides[0],
                                       strides[1], begin[0], begin[1], dilations[0],
                                       dilations[1], self.is_max, *bounds)))
        return y


@register("MaxPool", versions=cpu_pool.MaxPool.versions, backend="cuda")
class MaxPoolCUDA(_Pool2D, shared_class(cpu_pool.MaxPool)):
    is_max = 1


@register("AveragePool", versions=cpu_pool.AveragePool.versions, backend="cuda")
class AveragePoolCUDA(_Pool2D, shared_class(cpu_pool.AveragePool)):
    is_max = 0

"""OpenCL kernels of onnxruntime's transformer hot-path contrib ops (com.microsoft): Attention,
MultiHeadAttention, GroupQueryAttention, SkipLayerNormalization, MatMulNBits, BiasGelu and
FastGelu. Semantics are the CPU kernels' (ops/microsoft/attention.py, fused.py,
lowbit.py), whose classes these subclass for attributes, defaults and validation.

What is reused:

* the packed GEMM of ops/opencl/linalg.py for every product (the QKV projection of Attention
  with its bias in the epilogue, Q K' scaled by alpha, P V, the MatMulNBits product with its
  bias), grouped-query heads folded into the GEMM rows as ops/opencl/attention.py does;
* the row kernel `attn_softmax` of ops/opencl/attention.py (additive float mask read through
  broadcast strides, causal / window / per-batch key-count limits computed from indices,
  softcap, the qk output at a chosen stage, fully masked rows give zeros);
* `rownorm` of ops/opencl/normalization.py (LayerNorm rows with mean / inv_std outputs) and the
  generic elementwise kernel (`ew`) for SkipLayerNormalization's sum;
* `activation_source` of ops/opencl/linalg.py (the CPU kernel's float32 erf, the tanh GELU as
  x * sigmoid(2u)) for BiasGelu and FastGelu.

New OpenCL C (the module-level sources below): `heads` (a strided copy of one head vector per
work item into a (B, N, S, H) layout, adding a per-head bias and applying the rotary
embedding on the way: splits packed QKV, MHA's bias, GQA's rotary), `kv_cache` (GQA's present
buffer: past rows, this step's rows at each batch entry's past length, zeros after),
`attn_bias` (Attention / MultiHeadAttention's padding mask as onnxruntime adds it:
mask_filter_value on masked keys, the lowest float32 on future keys under unidirectional,
plus attention_bias), `bias_act` (bias + GELU), `nbits_pack` (MatMulNBits' weight
dequantised straight into the GEMM's packed B panels, once per node) and `quant_a`
(accuracy_level 4: A rounded through int8 per sub-block, exactly as the CPU kernel does).

What runs on the CPU instead:

* refused at plan time (`refuses`, from the dtypes): inputs other than float32/float64
  (float16 and bfloat16: the GEMM and row kernels have no half-precision form), float inputs
  of differing dtypes, masks other than int32 (Attention's mask_index, MultiHeadAttention's
  key_padding_mask: onnxruntime's type), MatMulNBits with A other than float32 or scales /
  float zero points other than float32;
* decided once in setup() (`cpu_reason`, '' when native), each call then `run_on_cpu`:
  GroupQueryAttention with smooth_softmax=1 or a head_sink input (an extra logit in the
  softmax denominator the row kernel lacks) or with its qk output in qk_output=1 form (masked
  scores as 0, which the row kernel does not write);
* empty tensors (a zero batch, sequence or head size; MatMulNBits' omitted projection, a
  zero-sized B) call `run_on_cpu` per call.

This module's own kernels are launched with their scalar arguments typed once per kernel
object (`_launch`): pyopencl's untyped path for numpy scalars costs ~20 us per scalar here.

Host reads: GroupQueryAttention keeps seqlens_k, total_sequence_length and position_ids on the
host (`host_inputs`: validation, past lengths and rotary positions are computed there, as the
CPU kernel does); Attention / MultiHeadAttention read a 1-D mask_index (B or 2B int32 values)
back to check it is non-negative, as the CPU kernel does (once per mask array, however many
nodes read it).
"""
from __future__ import annotations

import math
import threading
import weakref
from functools import lru_cache

import numpy as np

from ember.ops.microsoft import attention as CA
from ember.ops.microsoft import fused as CF
from ember.ops.microsoft import lowbit as CL
from ember.ops.linalg import CachedPack
from ember.ops.opencl._common import (
    FLOAT_TYPES, cached_table, c_type, contiguous, kernel, launch)
from ember.ops.opencl.attention import _copy4d, _softmax_source, _strides
from ember.ops.opencl.elementwise import ew
from ember.ops.opencl.linalg import (
    activation_source, block_n, gemm_packed, pack_a, pack_b)
from ember.ops.opencl.normalization import rownorm
from ember.ops.opencl.reduction import local_size
from ember.ops.registry import register

_DOMAIN = "com.microsoft"
_i64, _i32 = np.int64, np.int32
_INT32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)
_MASK_NONE, _MASK_FLOAT = 0, 2  # the row kernel's mask kinds (ops/opencl/attention.py)

# --------------------------------------------------------------------------------------------
# OpenCL C

# One work item per (b, h, s) copies a head vector of D elements from a strided source into a
# strided destination, adding bias[h * D + d] (MultiHeadAttention's projection bias) and then
# rotating its first 2 * half features by the cos/sin rows of the position pos[b * p0 + s * p1]
# (GroupQueryAttention's do_rotary; interleaved pairs (2k, 2k+1) or halves (k, k + half)).
# FP_CONTRACT off: products and sums rounded one by one, as numpy computes them.
_HEADS_SOURCE = """
#pragma OPENCL FP_CONTRACT OFF
__kernel void heads(__global const T *src, __global T *dst, __global const T *bias,
                    __global const T *cosc, __global const T *sinc, __global const long *pos,
                    const long D, const long s_off, const long s0, const long s1,
                    const long s2, const long s3, const long d_off, const long d0,
                    const long d1, const long d2, const long d3, const long b_off,
                    const int has_bias, const long nrot, const int interleaved,
                    const long p0, const long p1) {
    const long i2 = get_global_id(0), i1 = get_global_id(1), i0 = get_global_id(2);
    __global const T *x = src + s_off + i0 * s0 + i1 * s1 + i2 * s2;
    __global T *y = dst + d_off + i0 * d0 + i1 * d1 + i2 * d2;
    __global const T *bb = bias + b_off + i1 * D;
    long d = 0;
    if (nrot > 0) {
        const long p = pos[i0 * p0 + i2 * p1];
        __global const T *c = cosc + p * nrot;
        __global const T *sn = sinc + p * nrot;
        for (long k = 0; k < nrot; ++k) {
            const long ia = interleaved ? 2 * k : k, ib = interleaved ? 2 * k + 1 : k + nrot;
            T a = x[ia * s3], b = x[ib * s3];
            if (has_bias) { a = a + bb[ia]; b = b + bb[ib]; }
            const T ca = c[k], sa = sn[k];
            y[ia * d3] = ca * a - sa * b;
            y[ib * d3] = sa * a + ca * b;
        }
        d = 2 * nrot;
    }
    for (; d < D; ++d) y[d * d3] = has_bias ? x[d * s3] + bb[d] : x[d * s3];
}
"""

# GroupQueryAttention's present buffer (B, Nkv, PL, D): row t of batch b is past row t while
# t < past_len[b], this step's row t - past_len[b] for the next S rows, zeros after.
_KV_CACHE_SOURCE = """
__kernel void kv_cache(__global const T *fresh, __global const T *past, __global T *dst,
                       __global const long *past_len, const long S, const long P,
                       const long PL, const long D, const long Nkv, const int has_past) {
    const long t = get_global_id(0), h = get_global_id(1), b = get_global_id(2);
    const long rel = t - past_len[b];
    __global T *y = dst + ((b * Nkv + h) * PL + t) * D;
    __global const T *x = 0;
    if (rel < 0) { if (has_past) x = past + ((b * Nkv + h) * P + t) * D; }
    else if (rel < S) x = fresh + ((b * Nkv + h) * S + rel) * D;
    if (x) for (long d = 0; d < D; ++d) y[d] = x[d];
    else for (long d = 0; d < D; ++d) y[d] = (T)0;
}
"""

# Attention / MultiHeadAttention: the additive bias (Bb, Hb, Sb, Tn) the row kernel adds to
# the scaled scores, as the CPU kernel forms it: the padding mask (MASK_KIND 1: key lengths
# mask[b]; 2: key ends mask[b] and starts mask[B + b]; 3: raw (B, Tn); 4: raw (B, S, Tn);
# 5: Megatron (B, 1, MA, MB) read at row past + i) gives `filter` on masked keys, the causal
# mask puts `lowest` on future keys except in the last query row, then attention_bias (strides
# a0 a1 a2 over (b, h, i), 1 over keys) is added.
_ATTN_BIAS_SOURCE = """
__kernel void attn_bias(__global T *out, __global const int *mask, __global const T *ab,
                        const long Hb, const long Sb, const long Tn, const long B,
                        const long MA, const long MB, const long past, const int causal,
                        const long L, const long a0, const long a1, const long a2,
                        const int has_ab, const T filter, const T lowest) {
    const long j = get_global_id(0), i = get_global_id(1), bh = get_global_id(2);
    const long b = bh / Hb, h = bh % Hb;
    T v = (T)0;
#if MASK_KIND == 1
    const int keep = j < (long)mask[b];
#elif MASK_KIND == 2
    const int keep = j < (long)mask[b] && j >= (long)mask[B + b];
#elif MASK_KIND == 3
    const int keep = mask[b * Tn + j] > 0;
#elif MASK_KIND == 4
    const int keep = mask[(b * MA + i) * Tn + j] > 0;
#elif MASK_KIND == 5
    const int keep = mask[(b * MA + past + i) * MB + j] > 0;
#endif
#if MASK_KIND
    if (!keep) v = filter;
#endif
    if (causal && j > i + past && i < L - 1) v = lowest;
    if (has_ab) v = v + ab[b * a0 + h * a1 + i * a2 + j];
    out[(bh * Sb + i) * Tn + j] = v;
}
"""

# y = act(x + bias[j]) over (rows, cols), one work item per element, act from
# linalg.activation_source (the float32 Gelu is the CPU kernel's erf approximation).
_BIAS_ACT_SOURCE = """
__kernel void bias_act(__global const T *x, __global const T *bias, __global T *y,
                       const long cols, const int has_bias) {
    const long j = get_global_id(0), r = get_global_id(1);
    const long i = r * cols + j;
    T v = x[i];
    if (has_bias) v = v + bias[j];
    y[i] = act(v, (T)0, (T)0);
}
"""

# MatMulNBits: the dequantised weight W (N, K), W[n][k] = (code(n, k) - zp(n, g)) * scale(n, g)
# with g = g_idx[k] or k / block, written straight into the GEMM's packed B panels (B = W',
# [N/RN][K][RN], zero padded), so the weight is read once and never laid out as (N, K).
# ZP_KIND 0: no zero points (2^(bits-1)); 1: packed uint8 (zb bytes a row); 2: float.
_NBITS_SOURCE = """
#pragma OPENCL FP_CONTRACT OFF
__kernel void nbits_pack(__global const uchar *B, __global const float *scales,
                         __global const uchar *zpu, __global const float *zpf,
                         __global const int *gidx, __global float *Bp, const int N,
                         const int K, const int kb, const int block, const int blob,
                         const int zb, const int has_g) {
    const int k = get_global_id(0), nb = get_global_id(1);
    const int per = 8 / BITS, mask = (1 << BITS) - 1;
    const int blk = k / block, t = k % block;
    const int g = has_g ? gidx[k] : blk;
    const int byte = t / per, shift = (t % per) * BITS;
    __global float *dst = Bp + ((long)nb * K + k) * RN;
    for (int j = 0; j < RN; ++j) {
        const int n = nb * RN + j;
        if (n >= N) { dst[j] = 0.0f; continue; }
        const int q = (B[((long)n * kb + blk) * blob + byte] >> shift) & mask;
#if ZP_KIND == 0
        const float z = (float)(1 << (BITS - 1));
#elif ZP_KIND == 1
        const float z = (float)((zpu[(long)n * zb + g / per] >> ((g % per) * BITS)) & mask);
#else
        const float z = zpf[(long)n * kb + g];
#endif
        dst[j] = ((float)q - z) * scales[(long)n * kb + g];
    }
}
"""

# accuracy_level 4: A rounded through int8 per sub-block of `sub` elements along K, as the CPU
# kernel does (scale max|a| / 127, codes rint(a * (127 / max|a|))), one work item per
# (row, sub-block). Built with correctly rounded division (the CPU's float32 division).
_QUANT_A_SOURCE = """
#pragma OPENCL FP_CONTRACT OFF
__kernel void quant_a(__global const float *a, __global float *out, const long K,
                      const long sub) {
    const long s = get_global_id(0), m = get_global_id(1);
    const long k0 = s * sub, k1 = min(K, k0 + sub);
    __global const float *x = a + m * K;
    __global float *y = out + m * K;
    float amax = 0.0f;
    for (long k = k0; k < k1; ++k) {
        const float v = fabs(x[k]);
        amax = (v > amax || isnan(v)) ? v : amax;
    }
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    const float back = amax / 127.0f;
    for (long k = k0; k < k1; ++k) y[k] = rint(x[k] * inv) * back;
}
"""


@lru_cache(maxsize=None)
def _typed(source: str, ctype: str, defines: tuple[tuple[str, object], ...] = ()) -> str:
    head = f"typedef {ctype} T;\n" + "".join(f"#define {k} {v}\n" for k, v in defines)
    return head + source


def _knl(be, source, name, dtype, defines=(), options=()):
    return kernel(be, _typed(source, c_type(dtype), tuple(defines)), name, tuple(options))


# --------------------------------------------------------------------------------------------
# Helpers

def _dtype_refusal(input_dtypes, same_float=(), int32=(), first=FLOAT_TYPES) -> str:
    """Why a node with these input dtypes (None: unknown or omitted) is not run natively: the
    first input must be one of `first`, the inputs at `same_float` of its dtype, those at
    `int32` int32; '' when it is."""
    dts = list(input_dtypes)
    x = dts[0] if dts else None
    if x is not None and x not in first:
        return f"dtype {x}"
    for i in same_float:
        d = dts[i] if i < len(dts) else None
        if d is not None and x is not None and d != x:
            return f"input {i} has dtype {d}, input 0 {x}"
        if d is not None and x is None and d not in first:
            return f"input {i} has dtype {d}"
    for i in int32:
        d = dts[i] if i < len(dts) else None
        if d is not None and d != _INT32:
            return f"input {i} has dtype {d} (int32 only)"
    return ""


def _dtypes_of(inputs):
    return [None if x is None else np.dtype(x.dtype) for x in inputs]


def _heads_copy(be, src, dst, shape, src_strides, dst_strides, src_off=0, dst_off=0,
                bias=None, bias_off=0, rotary=None):
    """dst[dst_off + (b,h,s,d).dst_strides] = src[src_off + (b,h,s,d).src_strides]
    (+ bias[bias_off + h * D + d]) over the 4-D `shape` (B, H, S, D), then rotated when
    `rotary` is (cos, sin, positions (int64 device table), p0, p1, interleaved)."""
    if math.prod(shape) == 0:
        return
    knl = _knl(be, _HEADS_SOURCE, "heads", src.dtype)
    if rotary is not None:
        cos, sin, pos, p0, p1, interleaved = rotary
        half = cos.shape[-1]
    else:
        cos = sin = pos = None
        half, p0, p1, interleaved = 0, 0, 0, False
    b, h, s, d = shape
    launch(be, knl, (s, h, b), src, dst, bias if bias is not None else src,
            cos if cos is not None else src, sin if sin is not None else src,
            pos if pos is not None else dst, _i64(d), _i64(src_off),
            *(_i64(v) for v in src_strides), _i64(dst_off), *(_i64(v) for v in dst_strides),
            _i64(bias_off), _i32(bias is not None), _i64(half), _i32(bool(interleaved)),
            _i64(p0), _i64(p1))


def _softmax_rows(be, scores, rows, n, q_len, heads, *, mask=None, mask_strides=(0, 0, 0, 0),
                  qk=None, qk_mode=-1, softcap=0.0, causal=False, left=-1, nonpad=None,
                  past_len=0):
    """The row kernel of ops/opencl/attention.py over `scores` (rows of n, in place): softcap,
    + mask (a float array read at b*ms0 + h*ms1 + i*ms2 + j, j < n), + the causal / window /
    per-batch key-count limits, softmax; `qk` gets the row at stage `qk_mode` (2: the biased
    scores, 3: the probabilities)."""
    dtype = scores.dtype
    ls = local_size(be, n)
    kind = _MASK_FLOAT if mask is not None else _MASK_NONE
    mode = qk_mode if qk is not None else -1
    knl = kernel(be, _softmax_source(c_type(dtype), c_type(dtype), kind, mode, ls,
                                     be.vector_bits), "attn_softmax")
    tp = dtype.type
    launch(be, knl, rows * ls, scores, qk if qk is not None else scores,
           contiguous(mask) if mask is not None else scores, _i64(rows), _i64(n), _i64(q_len),
           _i64(heads), *(_i64(s) for s in mask_strides), _i64(n if mask is not None else 0),
           tp(softcap), _i32(bool(causal)), _i64(left), _i64(-1),
           nonpad if nonpad is not None else scores, _i32(nonpad is not None), _i64(past_len),
           local_size=(ls,) if ls > 1 else None)


def _attend(be, q, k, v, k_rows, k_stride, scale, softmax_kw, want_qk=False):
    """softmax(scale * Q K' + ...) V on the device. q: contiguous (B, N, S, D); k, v: (B, Nkv,
    *, D) arrays whose batches (b, kv head) are k_stride elements apart, of which the first
    k_rows rows are attended. Returns (Y (B, N, S, Dv), qk or None)."""
    batch, heads, q_len, head = q.shape
    kv_heads, vdim = k.shape[1], v.shape[3]
    group = heads // kv_heads
    nb, rows = batch * kv_heads, group * q_len
    ids = np.arange(nb)
    dtype = q.dtype
    ap = pack_a(be, q, rows, head, head, 1, nb, rows * head, role="A")
    bp = pack_b(be, k, k_rows, head, 1, head, nb, k_stride, role="B")
    scores = gemm_packed(be, ap, bp, rows, k_rows, head, ids, ids, dtype, alpha=scale)
    qk = be.empty((batch, heads, q_len, k_rows), dtype) if want_qk else None
    _softmax_rows(be, scores, batch * heads * q_len, k_rows, q_len, heads, qk=qk,
                  **softmax_kw)
    ap = pack_a(be, scores, rows, k_rows, k_rows, 1, nb, rows * k_rows, role="A")
    bp = pack_b(be, v, vdim, k_rows, vdim, 1, nb, k_stride // head * vdim, role="B")
    y = gemm_packed(be, ap, bp, rows, vdim, k_rows, ids, ids, dtype)
    return y.reshape(batch, heads, q_len, vdim), qk


def _merge_heads(be, y):
    """(B, N, S, D) -> (B, S, N * D)."""
    batch, heads, q_len, d = y.shape
    out = be.empty((batch, q_len, heads * d), y.dtype)
    shape = (batch, q_len, heads, d)
    _copy4d(be, y, out, shape, (heads * q_len * d, d, q_len * d, 1), _strides(shape))
    return out


def _mask_strides(shape, target) -> tuple[int, ...]:
    """Element strides of a contiguous 4-D `shape` broadcast over `target` (0 on size-1 axes
    of target > 1)."""
    strides = _strides(shape)
    return tuple(0 if s == 1 and t != 1 else st for s, t, st in zip(shape, target, strides))


# --------------------------------------------------------------------------------------------
# Attention and MultiHeadAttention


class _PaddedAttentionCL:
    """What the device Attention and MultiHeadAttention share: the padding mask / causal mask /
    attention_bias as one additive bias, and the attention itself."""

    dtypes = FLOAT_TYPES
    cpu_reason = ""

    def _check_nonnegative(self, mask):
        """The CPU kernel's check of a 1-D mask_index, read back once per mask value: the
        nodes of a model share one mask array, so one read serves them all."""
        checked = self.device.cache("contrib.masks").setdefault(
            "nonnegative", weakref.WeakValueDictionary())  # id -> array, gone with the array
        if checked.get(id(mask)) is mask:
            return
        if int(self.device.to_host(mask).min()) < 0:
            raise self.fail("mask_index values must be non-negative")
        checked[id(mask)] = mask

    def _mask_kind(self, mask, batch, q_len, total, past, four_d):
        """(kind for attn_bias, MA, MB) of `mask` (None: no mask, also for the dummy 2-D mask),
        checked as the CPU kernel checks it (mask_format)."""
        if mask is None:
            return None
        form = self.mask_format(mask, batch, q_len, total, past, four_d)
        if form in ("ends", "ends_starts"):
            if mask.shape[0]:
                self._check_nonnegative(mask)
            return (1 if form == "ends" else 2), 0, 0
        if form == "keys":
            return 3, 0, 0
        if form == "queries_keys":
            return 4, q_len, 0
        return None if form is None else (5, mask.shape[2], mask.shape[3])

    def _bias_cl(self, mask, attention_bias, batch, q_len, total, past, dtype, four_d=False):
        """(bias, strides over (B, N, S, T)) for the row kernel, or (None, zeros)."""
        be = self.device
        n = self.num_heads
        kind = self._mask_kind(mask, batch, q_len, total, past, four_d)
        causal = self.unidirectional and q_len > 1
        ab = attention_bias
        if ab is not None and (ab.ndim != 4 or ab.shape[0] not in (1, batch) or ab.shape[1]
                               not in (1, n) or tuple(ab.shape[2:]) != (q_len, total)):
            raise self.fail(f"attention_bias must have shape (batch_size or 1, num_heads "
                            f"or 1, {q_len}, {total}), got {tuple(ab.shape)}")
        target = (batch, n, q_len, total)
        if kind is None and not causal:
            if ab is None:
                return None, (0, 0, 0, 0)
            ab = contiguous(ab)
            return ab, _mask_strides(tuple(ab.shape), target)
        bb = batch if kind is not None or (ab is not None and ab.shape[0] == batch) else 1
        hb = n if ab is not None and ab.shape[1] == n else 1
        sb = q_len if (causal or ab is not None or (kind or (0,))[0] in (4, 5)) else 1
        out = be.empty((bb, hb, sb, total), dtype)
        code, ma, mb = kind if kind is not None else (0, 0, 0)
        a_strides = (0, 0, 0)
        if ab is not None:
            ab = contiguous(ab)
            a_strides = _mask_strides(tuple(ab.shape), (bb, hb, sb, total))[:3]
        knl = _knl(be, _ATTN_BIAS_SOURCE, "attn_bias", dtype, (("MASK_KIND", code),))
        tp = dtype.type
        launch(be, knl, (total, sb, bb * hb), out,
                contiguous(mask) if kind is not None else out,
                ab if ab is not None else out, _i64(hb), _i64(sb), _i64(total), _i64(batch),
                _i64(ma), _i64(mb), _i64(past), _i32(causal), _i64(q_len),
                *(_i64(s) for s in a_strides), _i32(ab is not None),
                tp(self.mask_filter_value), tp(CA._LOWEST))
        return out, _mask_strides((bb, hb, sb, total), target)

    def _attention_cl(self, q, k, v, k_rows, k_stride, bias, bias_strides, want_qk):
        scale = self.scale or 1.0 / math.sqrt(q.shape[-1])
        return _attend(self.device, q, k, v, k_rows, k_stride, scale,
                       dict(mask=bias, mask_strides=bias_strides, qk_mode=2), want_qk)


@register("Attention", versions=[1], domain=_DOMAIN, backend="opencl")
class AttentionCL(_PaddedAttentionCL, CA.Attention):
    """The projection x @ weights + bias by the GEMM (bias in its epilogue), Q / K / V split
    into heads by strided copies (past rows copied first into the present buffer, which then
    serves as K and V), the attention as in `_attend`."""

    def setup(self):
        super().setup()
        self._wpack = CachedPack()  # the packed weights, kept while they are the same array

    @classmethod
    def refuses(cls, input_dtypes, output_dtypes=()):
        return _dtype_refusal(input_dtypes, same_float=(1, 2, 4, 5), int32=(3,))

    def run(self, x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
            past_sequence_length=None):
        args = (x, weights, bias, mask_index, past, attention_bias, past_sequence_length)
        if self.refuses(_dtypes_of(args[:6])) or x.size == 0 or weights.size == 0:
            return self.run_on_cpu(*args)
        dq, dk, dv = self.packed_sizes(x, weights, bias, past)
        width = weights.shape[1]
        n = self.num_heads
        for size in (dq, dv):  # dk == dq (checked in setup)
            if size % n:
                raise self.fail(f"hidden size {size} is not a multiple of {n} heads")
        be = self.device
        dtype = x.dtype
        batch, q_len, d_in = x.shape
        hq, hk, hv = dq // n, dk // n, dv // n
        want_present = self.n_outputs >= 2
        if want_present and dk != dv:
            raise self.fail("the present output needs equal K and V hidden sizes")
        past_len = 0
        if past is not None:
            if past.ndim != 5 or tuple(past.shape[:3]) != (2, batch, n) or past.shape[4] != hk:
                raise self.fail(f"past must have shape (2, {batch}, {n}, past_length, "
                                f"{hk}), got {tuple(past.shape)}")
            if dk != dv:
                raise self.fail("a past state needs equal K and V hidden sizes")
            past_len = past.shape[3]
        total = past_len + q_len

        # qkv (B*S, width) = x @ weights + bias
        m = batch * q_len
        ap = pack_a(be, contiguous(x), m, d_in, d_in, 1, role="A")
        bp = self._wpack.get(weights, (), lambda: pack_b(be, contiguous(weights), width, d_in,
                                                         width, 1))
        qkv = gemm_packed(be, ap, bp, m, width, d_in, [0], [0], dtype,
                          c=bias, cm=0, cn=1, beta=1.0 if bias is not None else 0.0)
        src = (q_len * width, 0, width, 1)  # (b, h, s, d) strides of a head in qkv

        def split(off, h, dst, dst_shape, dst_off=0):
            s = list(src)
            s[1] = h
            _heads_copy(be, qkv, dst, (batch, n, q_len, h), s, _strides(dst_shape), off,
                        dst_off)

        q = be.empty((batch, n, q_len, hq), dtype)
        split(0, hq, q, q.shape)
        # K and V: (B, N, T, H) each, past rows first; with a present output the two halves
        # of one (2, B, N, T, H) buffer (which dk == dv then, checked above)
        kshape, vshape = (batch, n, total, hk), (batch, n, total, hv)
        if want_present:
            kv = be.empty((2,) + kshape, dtype)
            targets = ((kv, 0), (kv, math.prod(kshape)))
        else:
            targets = ((be.empty(kshape, dtype), 0), (be.empty(vshape, dtype), 0))
        if past is not None:
            past = contiguous(past)
            pshape = (batch, n, past_len, hk)
            for part, (dst, base) in enumerate(targets):
                _heads_copy(be, past, dst, pshape, _strides(pshape), _strides(kshape),
                            part * math.prod(pshape), base)
        for (dst, base), off, h, shape in zip(targets, (dq, dq + dk), (hk, hv), (kshape, vshape)):
            split(off, h, dst, shape, base + past_len * h)
        k, v = (kv[0], kv[1]) if want_present else (targets[0][0], targets[1][0])
        bias_all, strides = self._bias_cl(mask_index, attention_bias, batch, q_len, total,
                                          past_len, dtype, four_d=True)
        y, _ = self._attention_cl(q, k, v, total, total * hk, bias_all, strides, False)
        y = _merge_heads(be, y)
        return (y, kv) if want_present else y


@register("MultiHeadAttention", versions=[1], domain=_DOMAIN, backend="opencl")
class MultiHeadAttentionCL(_PaddedAttentionCL, CA.MultiHeadAttention):
    """Every query / key / value layout becomes contiguous (B, N, S, H) arrays through strided
    copies that add the projection bias (past rows first, into the present outputs); the qk
    output is the row kernel's biased scores (stage 2), exactly what the CPU kernel returns."""

    @classmethod
    def refuses(cls, input_dtypes, output_dtypes=()):
        return _dtype_refusal(input_dtypes, same_float=(1, 2, 3, 5, 6, 7), int32=(4,))

    def run(self, query, key=None, value=None, bias=None, key_padding_mask=None,
            attention_bias=None, past_key=None, past_value=None, past_sequence_length=None,
            cache_indirection=None):
        args = (query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value,
                past_sequence_length, cache_indirection)
        self.refuse_unsupported(past_sequence_length, cache_indirection, past_key, past_value)
        if self.refuses(_dtypes_of(args[:8])) or any(
                x is not None and x.size == 0 for x in (query, key, value)):
            return self.run_on_cpu(*args)
        be = self.device
        dtype = query.dtype
        lay = self.kv_layout(*CA.shapes_of(query, key, value, bias, past_key, past_value))
        srcs = self._sources(lay, contiguous(query), key, value)
        if bias is not None:
            bias = contiguous(bias)
        batch, q_len, kv_len, past_len = lay.batch, lay.q_len, lay.kv_len, lay.past_len
        dq, dk, _ = lay.dims
        q = self._to_heads(srcs[0], batch, q_len, None, past_len, bias, 0, dtype)
        k = self._to_heads(srcs[1], batch, kv_len, past_key, past_len, bias, dq, dtype)
        v = self._to_heads(srcs[2], batch, kv_len, past_value, past_len, bias, dq + dk, dtype)
        mask_bias, strides = self._bias_cl(key_padding_mask, attention_bias, batch, q_len,
                                           lay.total, past_len, dtype)
        want_qk = self.n_outputs > 3
        y, qk = self._attention_cl(q, k, v, lay.total, lay.total * lay.heads[1], mask_bias,
                                   strides, want_qk)
        results = [_merge_heads(be, y)]
        if self.n_outputs > 1:
            results += [k, v]
        if want_qk:
            results.append(qk)
        return tuple(results) if len(results) > 1 else results[0]

    def _sources(self, lay, query, key, value):
        """(array, element offset, (b, h, s, d) strides, head size) of each of Q, K, V in their
        layout `lay` (checked by kv_layout; strides None: a (B, N, L, H) array as it is)."""
        n = self.num_heads
        (dq, dk, dv), (hq, hk, hv) = lay.dims, lay.heads
        s, kv_len = lay.q_len, lay.kv_len
        if lay.form == "packed_qkv":
            st = (s * n * 3 * hq, 3 * hq, n * 3 * hq, 1)
            return [(query, i * hq, st, hq) for i in range(3)]
        srcs = [(query, 0, (s * dq, hq, dq, 1), hq)]
        key = contiguous(key)
        if lay.form == "packed_kv":
            st = (kv_len * n * 2 * hk, 2 * hk, n * 2 * hk, 1)
            return srcs + [(key, 0, st, hk), (key, hk, st, hk)]
        value = contiguous(value)
        if lay.form == "split_heads":
            return srcs + [(key, 0, None, hk), (value, 0, None, hv)]
        return srcs + [(key, 0, (kv_len * dk, hk, dk, 1), hk),
                       (value, 0, (kv_len * dv, hv, dv, 1), hv)]

    def _to_heads(self, source, batch, length, past, past_len, bias, bias_off, dtype):
        """One of Q, K, V from its `_sources` entry as a contiguous (B, N, rows, H) array
        with its projection bias added: the past rows first (when `past` is given), then this
        step's `length` rows."""
        src, off, st, h = source
        if st is None:  # a (B, N, L, H) key / value, used as it is
            return src
        be = self.device
        shape = (batch, self.num_heads, past_len + length if past is not None else length, h)
        out = be.empty(shape, dtype)
        if past is not None:
            pshape = tuple(past.shape)
            _heads_copy(be, contiguous(past), out, pshape, _strides(pshape), _strides(shape))
        _heads_copy(be, src, out, (batch, self.num_heads, length, h), st, _strides(shape), off,
                    past_len * h if past is not None else 0, bias=bias, bias_off=bias_off)
        return out


# --------------------------------------------------------------------------------------------
# GroupQueryAttention


@register("GroupQueryAttention", versions=[1], domain=_DOMAIN, backend="opencl")
class GroupQueryAttentionCL(CA.GroupQueryAttention):
    """Q / K / V split into heads (rotated when do_rotary) by the `heads` copy, the present
    buffers written by `kv_cache`, then the attention over their first total_sequence_length
    rows with the row kernel's limits: per batch entry at most seqlens_k + 1 keys, the causal
    limit at the query's absolute position and the local window (a padded first prompt adds
    its key limit as a -inf mask instead, since its positions start at 0)."""

    dtypes = FLOAT_TYPES
    host_inputs = (5, 6, 9)  # seqlens_k, total_sequence_length, position_ids

    def setup(self):
        super().setup()
        inputs = self.node.inputs
        has_sink = len(inputs) > 11 and bool(inputs[11])
        if self.smooth or has_sink:
            self.cpu_reason = "an extra softmax logit (smooth_softmax / head_sink)"
        elif self.n_outputs > 3 and self.qk_mode == 1:
            self.cpu_reason = "qk_output=1 (masked scores as 0)"
        else:
            self.cpu_reason = ""

    @classmethod
    def refuses(cls, input_dtypes, output_dtypes=()):
        return _dtype_refusal(input_dtypes, same_float=(1, 2, 3, 4, 7, 8, 10))

    def run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
            total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
            attention_bias=None, head_sink=None, k_scale=None, v_scale=None, q_norm_weight=None,
            k_norm_weight=None, query_seqlens=None):
        args = (query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                cos_cache, sin_cache, position_ids, attention_bias, head_sink, k_scale,
                v_scale, q_norm_weight, k_norm_weight, query_seqlens)
        self.refuse_unsupported(k_scale, v_scale, q_norm_weight, k_norm_weight, query_seqlens)
        if self.cpu_reason or self.refuses(_dtypes_of(args[:11])) or \
                query.size == 0 or (key is not None and key.size == 0):
            return self.run_on_cpu(*args[:self.n_inputs])
        self.check_required(seqlens_k, total_sequence_length, past_key, past_value)
        be = self.device
        if query.ndim != 3:
            raise self.fail(f"query must be 3-D, got shape {tuple(query.shape)}")
        batch, q_len, _ = query.shape
        head, srcs = self._cl_sources(contiguous(query), key, value)

        # lengths, on the host, checked as the CPU kernel checks them
        total, kv_total, first_prompt, past_lens, past_buf, present_len = self.step_lengths(
            be.to_host(seqlens_k), total_sequence_length, past_key, past_value, batch, q_len,
            head)
        rotary = self._cl_rotary(cos_cache, sin_cache, position_ids, past_lens, first_prompt,
                                 batch, q_len, head) if self.do_rotary else None
        q, k, v = self._cl_heads(srcs, rotary, past_key, past_value, past_lens, past_buf,
                                 present_len, batch, q_len, head)
        mask, mask_strides, nonpad = self._cl_mask(attention_bias, kv_total, first_prompt,
                                                   batch, q_len, total, query.dtype)
        want_qk = self.n_outputs > 3
        if want_qk and self.qk_mode == 0:
            raise self.fail("the output_qk output needs qk_output=1 or 2")
        scale = self.scale or 1.0 / math.sqrt(head)
        kw = dict(mask=mask, mask_strides=mask_strides, qk_mode=3, softcap=self.softcap,
                  causal=bool(self.causal), left=self.window - 1 if self.window > 0 else -1,
                  nonpad=nonpad, past_len=0)
        y, qk = _attend(be, q, k, v, total, present_len * head, scale, kw, want_qk)
        results = (_merge_heads(be, y), k, v) + ((qk,) if want_qk else ())
        return results[:max(self.n_outputs, 1)]

    def _cl_sources(self, query, key, value):
        """(head size, srcs): (array, element offset, (b, h, s, d) strides) of each of Q, K, V
        in the contiguous 3-D query (packed QKV without key and value) or key and value."""
        n, nkv = self.num_heads, self.kv_num_heads
        batch, q_len, width = query.shape
        if key is None and value is None:  # packed QKV
            if width % (n + 2 * nkv):
                raise self.fail(f"packed QKV width {width} is not a multiple of num_heads + "
                                f"2 * kv_num_heads = {n + 2 * nkv}")
            head = width // (n + 2 * nkv)
            st = (q_len * width, head, width, 1)
            return head, [(query, 0, st), (query, n * head, st), (query, (n + nkv) * head, st)]
        if key is None or value is None:
            raise self.fail("key and value must be given together (or neither, packed QKV)")
        if key.ndim != 3 or value.ndim != 3 or key.shape[:2] != (batch, q_len) \
                or value.shape[:2] != (batch, q_len):
            raise self.fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                            f"({batch}, {q_len}, kv_hidden)")
        for what, x, h in (("query", query, n), ("key", key, nkv), ("value", value, nkv)):
            if x.shape[2] % h:
                raise self.fail(f"{what} hidden size {x.shape[2]} is not a multiple of {h} "
                                f"heads")
        head = width // n
        if key.shape[2] // nkv != head or value.shape[2] // nkv != head:
            raise self.fail("query, key and value head sizes differ")
        kw = key.shape[2]
        return head, [(query, 0, (q_len * width, head, width, 1)),
                      (contiguous(key), 0, (q_len * kw, head, kw, 1)),
                      (contiguous(value), 0, (q_len * kw, head, kw, 1))]

    def _cl_rotary(self, cos_cache, sin_cache, position_ids, past_lens, first_prompt, batch,
                   q_len, head):
        """The `rotary` argument of `_heads_copy`: the caches and a device table of the
        positions (B or 1, S), found on the host as the CPU kernel finds them."""
        be = self.device
        self.check_rotary_caches(cos_cache, sin_cache, head)
        ids = None if position_ids is None else np.asarray(be.to_host(position_ids))
        pos = self.rotary_positions(np, ids, past_lens, first_prompt, batch, q_len)
        self._check_positions(pos, cos_cache.shape[0])
        return (contiguous(cos_cache), contiguous(sin_cache),
                cached_table(be, np.ascontiguousarray(pos)),
                q_len if pos.shape[0] > 1 else 0, 1, self.interleaved)

    def _cl_heads(self, srcs, rotary, past_key, past_value, past_lens, past_buf, present_len,
                  batch, q_len, head):
        """(Q (B, N, S, H), present K, present V (B, Nkv, present_len, H)): this step's K and
        V split into heads (K rotated too), then written after each entry's past rows by
        `kv_cache`."""
        be = self.device
        nkv = self.kv_num_heads
        dtype = srcs[0][0].dtype
        q = be.empty((batch, self.num_heads, q_len, head), dtype)
        src, off, st = srcs[0]
        _heads_copy(be, src, q, q.shape, st, _strides(q.shape), off, rotary=rotary)
        past_table = cached_table(be, past_lens)
        presents = []
        for i, past in ((1, past_key), (2, past_value)):
            src, off, st = srcs[i]
            fresh = be.empty((batch, nkv, q_len, head), dtype)
            _heads_copy(be, src, fresh, fresh.shape, st, _strides(fresh.shape), off,
                        rotary=rotary if i == 1 else None)
            present = be.empty((batch, nkv, present_len, head), dtype)
            knl = _knl(be, _KV_CACHE_SOURCE, "kv_cache", dtype)
            launch(be, knl, (present_len, nkv, batch), fresh,
                   contiguous(past) if past is not None and past_buf else fresh, present,
                   past_table, _i64(q_len), _i64(past_buf), _i64(present_len), _i64(head),
                   _i64(nkv), _i32(past is not None and past_buf > 0))
            presents.append(present)
        return q, presents[0], presents[1]

    def _cl_mask(self, attention_bias, kv_total, first_prompt, batch, q_len, total, dtype):
        """(mask, mask_strides, nonpad) for the row kernel: the attention bias, plus the key
        limit as a -inf mask on a padded first prompt (its positions start at 0); otherwise
        the key limit goes as `nonpad`, the per-entry key count (top = kv_total - 1, query
        positions kv_total - S + i)."""
        be = self.device
        target = (batch, self.num_heads, q_len, total)
        mask, mask_strides = None, (0, 0, 0, 0)
        ab = attention_bias
        if ab is not None:
            if (ab.ndim != 4 or ab.shape[0] not in (1, batch)
                    or ab.shape[1] not in (1, self.num_heads)
                    or tuple(ab.shape[2:]) != (q_len, total)):
                raise self.fail(f"attention_bias must have shape (batch_size or 1, num_heads or "
                                f"1, {q_len}, {total}), got {tuple(ab.shape)}")
            mask = contiguous(ab)
        padded_prompt = bool(self.causal) and first_prompt and bool((kv_total != q_len).any())
        nonpad = None
        if padded_prompt:
            keys = np.where(np.arange(total)[None, :] < kv_total[:, None], 0.0, -np.inf)
            keys = be.to_device(keys.astype(dtype).reshape(batch, 1, 1, total))
            mask = keys if mask is None else ew(be, "a + b", [mask, keys], dtype)
        else:
            nonpad = cached_table(be, kv_total.astype(np.int64))
        if mask is not None:
            mask_strides = _mask_strides(tuple(mask.shape), target)
        return mask, mask_strides, nonpad


# --------------------------------------------------------------------------------------------
# SkipLayerNormalization, BiasGelu, FastGelu


@register("SkipLayerNormalization", versions=[1], domain=_DOMAIN, backend="opencl")
class SkipLayerNormalizationCL(CF.SkipLayerNormalization):
    """s = input + skip (+ bias) by the elementwise kernel (skip broadcast), then LayerNorm
    rows of s by `rownorm` in the statistics dtype; s is the input_skip_bias_sum output."""

    dtypes = FLOAT_TYPES

    @classmethod
    def refuses(cls, input_dtypes, output_dtypes=()):
        return _dtype_refusal(input_dtypes, same_float=(1, 2, 3, 4))

    def run(self, x, skip, gamma, beta=None, bias=None):
        args = (x, skip, gamma, beta, bias)
        if self.refuses(_dtypes_of(args)) or x.size == 0:
            return self.run_on_cpu(*args)
        CF._float_input(self, x)
        self._check(x, skip, gamma, beta, bias)
        be = self.device
        sd = CF._stats_dtype(x)
        terms = [x, skip] + ([bias] if bias is not None else [])
        s = ew(be, " + ".join("abc"[:len(terms)]), terms, x.dtype, out_shape=tuple(x.shape))
        hidden = x.shape[-1]
        rows = x.size // hidden
        outputs = self.node.outputs
        stats = any(len(outputs) > i and outputs[i] for i in (1, 2))
        y, mean, inv = rownorm(be, "layer", s, gamma, beta, rows, hidden,
                               float(np.float32(self.epsilon)), sd, p0=1,
                               p1=int(beta is not None), stats=stats)
        stat_shape = tuple(x.shape[:-1]) + (1,)
        if not stats:
            mean = inv = be.empty(stat_shape, sd)  # requested by no one (empty names)
        outs = [y, mean.reshape(stat_shape), inv.reshape(stat_shape), s]
        return tuple(outs[:max(self.n_outputs, 1)])


class _BiasActCL:
    """act(x + bias over the last axis) in one pass; `activation` names the code of
    linalg.activation_source ("Gelu": the erf form, "GeluTanh": the tanh form)."""

    dtypes = FLOAT_TYPES
    activation = ""

    @classmethod
    def refuses(cls, input_dtypes, output_dtypes=()):
        return _dtype_refusal(input_dtypes, same_float=(1,))

    def run(self, x, bias=None):
        if self.refuses(_dtypes_of((x, bias))) or x.size == 0 or x.ndim == 0:
            return self.run_on_cpu(x, bias)
        CF._float_input(self, x)
        if bias is not None:
            CF._bias_on_last_axis(self, x, bias, self.bias_name)
        be = self.device
        cols = x.shape[-1]
        y = be.empty(tuple(x.shape), x.dtype)
        source = activation_source(self.activation, x.dtype) + _BIAS_ACT_SOURCE
        launch(be, _knl(be, source, "bias_act", x.dtype), (cols, x.size // cols),
                contiguous(x), contiguous(bias) if bias is not None else x, y, _i64(cols),
                _i32(bias is not None))
        return y


@register("BiasGelu", versions=[1], domain=_DOMAIN, backend="opencl")
class BiasGeluCL(_BiasActCL, CF.BiasGelu):
    activation = "Gelu"
    bias_name = "B"


@register("FastGelu", versions=[1], domain=_DOMAIN, backend="opencl")
class FastGeluCL(_BiasActCL, CF.FastGelu):
    activation = "GeluTanh"
    bias_name = "bias"


# --------------------------------------------------------------------------------------------
# MatMulNBits


@register("MatMulNBits", versions=[1], domain=_DOMAIN, backend="opencl")
class MatMulNBitsCL(CL.MatMulNBits):
    """Y = A @ W' + bias by the packed GEMM, W dequantised once per node straight into packed
    B panels on the device (`nbits_pack`) and kept on the instance while B, scales, zero
    points and g_idx are the same device arrays (a plan's constants are: uploaded once);
    threads sharing the node wait for the one that builds it. With accuracy_level 4 (and no
    g_idx, no float zero points) A first goes through `quant_a`, as on the CPU."""

    dtypes = frozenset({_F32})

    def setup(self):
        super().setup()
        self._cl_lock = threading.Lock()
        self._cl_entry = None  # (B, scales, zero_points, g_idx, packed panels)

    @classmethod
    def refuses(cls, input_dtypes, output_dtypes=()):
        dts = list(input_dtypes) + [None] * 6
        if dts[0] is not None and dts[0] != _F32:
            return f"dtype {dts[0]}"
        if dts[2] is not None and dts[2] != _F32:
            return f"scales of dtype {dts[2]}"
        if dts[3] is not None and dts[3] not in (_F32, np.dtype(np.uint8)):
            return f"zero points of dtype {dts[3]}"
        if dts[5] is not None and dts[5] != _F32:
            return f"bias of dtype {dts[5]}"
        return ""

    def _panels(self, b, scales, zero_points, g_idx):
        entry = self._cl_entry
        key = (b, scales, zero_points, g_idx)
        if entry is not None and all(x is y for x, y in zip(entry[:4], key)):
            return entry[4]
        with self._cl_lock:
            entry = self._cl_entry
            if entry is not None and all(x is y for x, y in zip(entry[:4], key)):
                return entry[4]
            self._check_weights(b, scales, zero_points, g_idx)
            self._cl_entry = None  # release the old panels first
            panels = self._dequantize(b, scales, zero_points, g_idx)
            self._cl_entry = key + (panels,)
            return panels

    def _dequantize(self, b, scales, zero_points, g_idx):
        be = self.device
        n, k, kb = self.n, self.k, self.k_blocks
        rn = block_n(be, _F32)
        nb = -(-n // rn)
        panels = be.empty((nb * k * rn,), _F32)
        gidx = None
        if g_idx is not None:
            group = np.asarray(be.to_host(g_idx)).astype(np.int64)[:k]
            if group.size and (group.min() < 0 or group.max() >= kb):
                raise self.fail(f"g_idx values must lie in [0, {kb})")
            gidx = be.to_device(group.astype(np.int32))
        zp_kind, zb = 0, 0
        if zero_points is not None:
            zp_kind = 1 if zero_points.dtype == np.uint8 else 2
            zb = -(-kb * self.nbits // 8)
        defines = (("BITS", self.nbits), ("ZP_KIND", zp_kind), ("RN", rn))
        knl = _knl(be, _NBITS_SOURCE, "nbits_pack", _F32, defines)
        zp = contiguous(zero_points) if zero_points is not None else None
        launch(be, knl, (k, nb), contiguous(b), contiguous(scales),
                zp if zp_kind == 1 else panels, zp if zp_kind == 2 else panels,
                gidx if gidx is not None else panels, panels, _i32(n), _i32(k), _i32(kb),
                _i32(self.block), _i32(self.blob), _i32(zb), _i32(gidx is not None))
        return panels

    def run(self, a, b, scales, zero_points=None, g_idx=None, bias=None):
        args = (a, b, scales, zero_points, g_idx, bias)
        if self.refuses(_dtypes_of(args)):
            return self.run_on_cpu(*args)
        be = self.device
        if a.ndim < 1 or a.shape[-1] != self.k:
            raise self.fail(f"A's last dimension must be K={self.k}, got shape {a.shape}")
        if bias is not None and bias.shape != (self.n,):
            raise self.fail(f"bias must have shape ({self.n},), got {bias.shape}")
        lead = tuple(a.shape[:-1])
        m = math.prod(lead)
        if b.size == 0 or m == 0:  # an omitted projection: zeros, or the broadcast bias
            return self.run_on_cpu(*args)
        panels = self._panels(b, scales, zero_points, g_idx)
        a2 = contiguous(a).reshape(m, self.k)
        if self.int8 and g_idx is None and (zero_points is None or zero_points.dtype == np.uint8):
            quantized = be.empty((m, self.k), _F32)
            sub = self.a_block
            knl = kernel(be, _QUANT_A_SOURCE, "quant_a",
                         ("-cl-fp32-correctly-rounded-divide-sqrt",))
            launch(be, knl, (-(-self.k // sub), m), a2, quantized, _i64(self.k), _i64(sub))
            a2 = quantized
        ap = pack_a(be, a2, m, self.k, self.k, 1, role="A")
        y = gemm_packed(be, ap, panels, m, self.n, self.k, [0], [0], _F32,
                        c=contiguous(bias) if bias is not None else None, cm=0, cn=1,
                        beta=1.0 if bias is not None else 0.0)
        return y.reshape(lead + (self.n,))


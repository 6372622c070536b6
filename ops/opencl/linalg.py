"""OpenCL MatMul and Gemm, and the packed GEMM that Conv and ConvTranspose reuse.

The GEMM is register blocked over packed panels (the layout BLAS micro-kernels use):

* `packA` copies A (any strides: transposes are free) into panels of RM rows, [batch][M/RM][K][RM];
* `packB` copies B into panels of RN columns, [batch][N/RN][K][RN] (Conv's im2col kernel writes
  this layout directly);
* `gemm`: one work-item per RM x RN output block keeps RM x NV accumulators of VN-wide vectors
  in registers; per k it loads NV vectors of B and broadcasts RM scalars of A. Panels are zero
  padded, so the inner loop has no guards; only the final store is guarded at the edges.
  The epilogue applies alpha, and beta * C (any C broadcastable to (M, N): Gemm's C, a conv bias),
  then adds a residual Z of the output's layout and applies an activation (the ai.ember fused
  ops, ops/opencl/fused.py) to the accumulators before the single store: one pass over the
  output instead of the separate ops' passes. The activation is a compile-time choice (a few
  program variants, only those used get built); its parameters are kernel arguments.

Measured on PoCL (2-core AVX-512 CPU, 1024^3 float32, idle machine): this kernel with RM=8,
VN=16, NV=2 (8x32 blocks) ~180 GFLOP/s, numpy ~270; 6x32 160, 12x32 / 4x64 / 8x48 ~180 (8x32
pads small N least); an unrolled k loop no better; fixed 16x1 or 4x4 work-groups ~140.
VN follows the backend's `vector_bits`: 8 floats where PoCL compiles for a CPU it does not
model with AVX-512 (its LLVM 14 aborted on 16-float vectors for a Zen 4 it calls "znver3").
PoCL does *not* inline builtins such as fma()/mad()/vload16() here (each is a call in the hot
loop: 30 GFLOP/s), so the inner loop uses vector pointer loads and `c += a * b` (contracted to
FMA). A classic local-memory tiled kernel (16x16 / 32x32 tiles, 2x2 or 4x4 per work-item,
barriers) ran at under 1 GFLOP/s on PoCL (~40x slower than this one under the same load): on a
CPU device the packed panels in the cache play the role of local memory.
"""
from __future__ import annotations

import math
import threading
from functools import lru_cache

import numpy as np

from ember.ops.elementwise import _ERF32_P, _ERF32_Q
from ember.ops.linalg import CachedPack, Gemm1, Gemm7, MatMul
from ember.ops.opencl._common import FLOAT_TYPES, c_type, cached_table, kernel, launch
from ember.ops.registry import register

RM = 8  # rows of A per work-item block


def vec_width(be, dtype) -> int:
    """Width of the vectors the GEMM accumulates in on backend `be`: one register of
    `be.vector_bits` (float32 or float64; float16 is computed as float32)."""
    return be.vector_bits // (32 if np.dtype(dtype) == np.float32 else 64)


def block_n(be, dtype) -> int:
    """Columns of B per work-item block (RN) on backend `be`."""
    return 2 * vec_width(be, dtype)


# Activation code -> body of `X act(X x, T p0, T p1)`, for X the scalar type T or a vector type:
# OpenCL C applies the operators, the vector ternary and the math builtins per component, so one
# text serves both. NaN propagates like numpy's (the comparisons are false for NaN). The order
# of operations follows the CPU kernels in ops/fused.py.
ACTIVATION_BODIES = {
    "": "return x;",
    "Relu": "return x < (X)0 ? (X)0 : x;",
    "LeakyRelu": "return x < (X)0 ? x * p0 : x;",  # p0 = alpha
    # np.clip(x, lo, hi) is min(max(x, lo), hi): hi wins when lo > hi
    "Clip": "X t = x < (X)p0 ? (X)p0 : x; return t > (X)p1 ? (X)p1 : t;",
    # exp of a non-positive number only: no overflow for large |x|
    "Sigmoid": "X e = exp(-fabs(x)); X s = (X)1 / ((X)1 + e); return x >= (X)0 ? s : e * s;",
    "Tanh": "return tanh(x);",
    "HardSigmoid": "X t = x * p0 + p1; t = t < (X)0 ? (X)0 : t; return t > (X)1 ? (X)1 : t;",
    "HardSwish": "X g = x * SIXTH + (X)0.5; g = g < (X)0 ? (X)0 : g; g = g > (X)1 ? (X)1 : g; "
                 "return x * g;",
    "Gelu": "return (X)0.5 * x * ((X)1 + erf(x * SQRT_HALF));",  # float64; float32: below
    # 0.5 * (1 + tanh(u)) == sigmoid(2u), as in the Gelu kernel of ops/opencl/activations.py
    "GeluTanh": "X u = GELU_2C * (x + GELU_A * x * x * x); X e = exp(-fabs(u)); "
                "X s = (X)1 / ((X)1 + e); return x * (u >= (X)0 ? s : e * s);",
    # x * sigmoid(alpha x), p0 = alpha (SiLU: 1)
    "Swish": "X u = x * p0; X e = exp(-fabs(u)); X s = (X)1 / ((X)1 + e); "
             "return x * (u >= (X)0 ? s : e * s);",
}


def _literal(value: float) -> str:
    return f"((T){float(value).hex()})"  # exact


def _horner(coefs, var: str) -> str:
    acc = _literal(coefs[0])
    for c in coefs[1:]:
        acc = f"({acc} * {var} + {_literal(c)})"
    return acc


# float32 Gelu: the CPU kernel's erf (ops/elementwise.py: a rational approximation on [-4, 4],
# relative error < 5e-7) in the CPU kernel's order, 0.5 * (1 + erf) as 0.5 + 0.5 * erf. Plain
# arithmetic that stays in vector registers: on PoCL, erf() in the epilogue of a 1024^3 GEMM
# (17 ms) added ~14 ms, this ~1.5 ms (as much as Relu or Z alone).
_GELU32 = ("X z = x * SQRT_HALF; z = z < (X)-4 ? (X)-4 : z; z = z > (X)4 ? (X)4 : z; "
           "X z2 = z * z; X e = z * " + _horner(_ERF32_P, "z2") + " / "
           + _horner(_ERF32_Q, "z2") + "; return x * (e * (X)0.5 + (X)0.5);")


def activation_source(act: str, dtype, vector: str | None = None) -> str:
    """OpenCL C (after `typedef ... T`, T the C type of `dtype`) defining `T act(T x, T p0,
    T p1)` and, given a vector type name, `vector act_v(vector x, T p0, T p1)`, for activation
    code `act` (see `activation_code`)."""
    consts = (f"#define SIXTH {_literal(1 / 6)}\n#define SQRT_HALF {_literal(math.sqrt(0.5))}\n"
              f"#define GELU_2C {_literal(2 * math.sqrt(2 / math.pi))}\n"
              f"#define GELU_A {_literal(0.044715)}\n")
    body = _GELU32 if act == "Gelu" and np.dtype(dtype) == np.float32 else ACTIVATION_BODIES[act]
    out = [consts, f"T act(T x, const T p0, const T p1) {{ typedef T X; {body} }}"]
    if vector:
        out.append(f"{vector} act_v({vector} x, const T p0, const T p1) "
                   f"{{ typedef {vector} X; {body} }}")
    return "\n".join(out) + "\n"


def activation_code(name: str, params) -> tuple[str, float, float]:
    """(code for `activation_source`, p0, p1) for a fused op's activation name and parameters,
    with the defaults of ops/fused.py."""
    params = [float(v) for v in params or []]
    if name == "Gelu":
        return ("GeluTanh" if params and params[0] else "Gelu"), 0.0, 0.0
    defaults = {"LeakyRelu": [0.01], "Clip": [-math.inf, math.inf], "HardSigmoid": [0.2, 0.5],
                "Swish": [1.0]}
    full = (params + defaults.get(name, [])[len(params):] + [0.0, 0.0])[:2]
    return name, full[0], full[1]


@lru_cache(maxsize=None)
def _gemm_source(dtype, act: str, VN: int) -> str:
    """The GEMM kernel with activation `act` in its epilogue, accumulating in vectors of VN
    elements (packA/packB: `_pack_source`)."""
    T = c_type(dtype)
    NV = 2
    RN = VN * NV
    V = f"{T}{VN}"
    decl = "\n".join(f"  {V} c{i}_{j} = ({V})(0);" for i in range(RM) for j in range(NV))
    step = [f"    b{j} = bv[{j}];" for j in range(NV)]
    for i in range(RM):
        step.append(f"    a = ({V})(ap[{i}]);")
        step += [f"    c{i}_{j} += a * b{j};" for j in range(NV)]
    step = "\n".join(step)
    store = []
    for i in range(RM):
        for j in range(NV):
            store.append(f"  vstore{VN}(c{i}_{j}, {i * NV + j}, t);")
    store = "\n".join(store)
    fast = []  # whole block inside the output: vector stores, C (bias) per row or per element
    for i in range(RM):
        fast.append(f"    {{ __global T* o = out + (long)(m0 + {i}) * out_rs + n0;")
        fast.append(f"      __global const T* ci = Cin + (long)(m0 + {i}) * cm + n0 * cn;")
        fast.append(f"      __global const T* zi = zout + (long)(m0 + {i}) * N + n0;")
        fast.append(f"      const {V} cr = ({V})(c_row ? beta * ci[0] : (T)0);")
        for j in range(NV):
            fast.append(f"      {{ {V} v = ({V})(alpha) * c{i}_{j};")
            fast.append(f"        if (c_row) v += cr; else if (c_full) v += ({V})(beta) * "
                        f"vload{VN}({j}, ci);")
            fast.append(f"        if (has_z) v += vload{VN}({j}, zi);")
            if act:
                fast.append("        v = act_v(v, p0, p1);")
            fast.append(f"        vstore{VN}(v, {j}, o); }}")
        fast.append("    }")
    fast = "\n".join(fast)
    return f"""
#define RM {RM}
#define RN {RN}
typedef {T} T;
{activation_source(act, dtype, V) if act else ""}
/* Cout[bt] = alpha * Ap[aidx[bt]] @ Bp[bidx[bt]] (+ beta * Cin[m*cm + n*cn] when has_c)
   (+ Z[bt][m][n] when has_z, Z contiguous (batches, M, N)), then the activation */
__kernel void gemm(const int M, const int N, const int K,
                   __global const int* aidx, __global const int* bidx,
                   __global const T* restrict Ap, __global const T* restrict Bp,
                   __global T* restrict Cout, const T alpha,
                   __global const T* restrict Cin, const long cm, const long cn, const long cb,
                   const T beta,
                   const int has_c, const long out_rs,
                   __global const T* restrict Zin, const int has_z, const T p0, const T p1) {{
  const int mb = get_global_id(0), nb = get_global_id(1), bt = get_global_id(2);
  const int Mb = (M + RM - 1) / RM, Nb = (N + RN - 1) / RN;
  __global const T* ap = Ap + ((long)aidx[bt] * Mb + mb) * K * RM;
  __global const {V}* bv = (__global const {V}*)(Bp + ((long)bidx[bt] * Nb + nb) * K * RN);
{decl}
  {V} a; {" ".join(f"{V} b{j};" for j in range(NV))}
  for (int k = 0; k < K; k++) {{
{step}
    ap += RM; bv += {NV};
  }}
  const int m0 = mb * RM, n0 = nb * RN;
  if (has_c) Cin += (long)aidx[bt] * cb;
  __global T* out = Cout + (long)bt * M * out_rs;
  __global const T* zout = Zin + (long)bt * M * N;
  if (m0 + RM <= M && n0 + RN <= N && (!has_c || cn <= 1)) {{
    const int c_row = has_c && cn == 0, c_full = has_c && cn == 1;
{fast}
    return;
  }}
  T t[RM * RN];
{store}
  for (int i = 0; i < RM; i++) {{
    const int m = m0 + i;
    if (m >= M) break;
    for (int j = 0; j < RN; j++) {{
      const int n = n0 + j;
      if (n >= N) break;
      T v = alpha * t[i * RN + j];
      if (has_c) v += beta * Cin[m * cm + n * cn];
      if (has_z) v += zout[(long)m * N + n];
      out[(long)m * out_rs + n] = {"act(v, p0, p1)" if act else "v"};
    }}
  }}
}}
"""


@lru_cache(maxsize=None)
def _pack_source(dtype, RN: int) -> str:
    return f"""
#define RM {RM}
#define RN {RN}
typedef {c_type(dtype)} T;

__kernel void packA(const int M, const int K, const long sm, const long sk, const long sb,
                    __global const T* A, __global T* Ap) {{
  const int k = get_global_id(0), mb = get_global_id(1), bt = get_global_id(2);
  const int Mb = (M + RM - 1) / RM;
  __global const T* src = A + bt * sb + k * sk;
  __global T* dst = Ap + (((long)bt * Mb + mb) * K + k) * RM;
  for (int i = 0; i < RM; i++) {{
    const int m = mb * RM + i;
    dst[i] = m < M ? src[m * sm] : (T)0;
  }}
}}

__kernel void packB(const int N, const int K, const long sk, const long sn, const long sb,
                    __global const T* B, __global T* Bp) {{
  const int k = get_global_id(0), nb = get_global_id(1), bt = get_global_id(2);
  const int Nb = (N + RN - 1) / RN;
  __global const T* src = B + bt * sb + k * sk;
  __global T* dst = Bp + (((long)bt * Nb + nb) * K + k) * RN;
  if (sn == 1 && (nb + 1) * RN <= N) {{
    for (int j = 0; j < RN; j++) dst[j] = src[nb * RN + j];
  }} else {{
    for (int j = 0; j < RN; j++) {{
      const int n = nb * RN + j;
      dst[j] = n < N ? src[n * sn] : (T)0;
    }}
  }}
}}

"""


def gemm_kernels(be, dtype, act: str = ""):
    """packA, packB, and the GEMM with activation code `act` (a program per activation used),
    for backend `be`."""
    pack = _pack_source(dtype, block_n(be, dtype))
    return (kernel(be, pack, "packA"), kernel(be, pack, "packB"),
            kernel(be, _gemm_source(dtype, act, vec_width(be, dtype)), "gemm"))


def pack_a(be, a, M, K, sm, sk, batches=1, sb=0, role=None):
    """Panels of RM rows of A (element strides sm, sk; `batches` matrices sb apart), in a
    scratch buffer of `be` when `role` names one (else a fresh array, e.g. to cache)."""
    kA, _, _ = gemm_kernels(be, a.dtype)
    Mb = -(-M // RM)
    n = batches * Mb * K * RM
    ap = scratch(be, role, n, a.dtype) if role else be.empty((n,), a.dtype)
    launch(be, kA, (K, Mb, batches), np.int32(M), np.int32(K), np.int64(sm), np.int64(sk),
           np.int64(sb), a, ap)
    return ap


def pack_b(be, b, N, K, sk, sn, batches=1, sb=0, role=None):
    """Panels of RN columns of B (element strides sk, sn; `batches` matrices sb apart)."""
    _, kB, _ = gemm_kernels(be, b.dtype)
    RN = block_n(be, b.dtype)
    Nb = -(-N // RN)
    n = batches * Nb * K * RN
    bp = scratch(be, role, n, b.dtype) if role else be.empty((n,), b.dtype)
    launch(be, kB, (K, Nb, batches), np.int32(N), np.int32(K), np.int64(sk), np.int64(sn),
           np.int64(sb), b, bp)
    return bp


def scratch(be, role: str, size: int, dtype):
    """A reusable device buffer of backend `be`, of at least `size` elements, for temporaries
    (packed panels, patch matrices), as a 1-D array of exactly `size`. Safe because the queue
    is in order: a later kernel that overwrites it runs after every earlier reader. Saves
    allocating (and page-faulting, on a CPU device) megabytes per convolution. One set per
    backend instance and thread, so two threads running sessions cannot interleave their uses
    of one buffer."""
    buffers = be.cache("linalg.scratch")
    dtype = np.dtype(dtype)
    nbytes = max(int(size) * dtype.itemsize, 1)
    key = (role, threading.get_ident())
    buf = buffers.get(key)
    # bounds-checked mode: exactly `size`, so that the guard band sits right after it
    exact = be.guard is not None and buf is not None and buf.size != nbytes
    if buf is None or buf.size < nbytes or exact:
        if len(buffers) > 64:  # threads come and go
            buffers.clear()
        buf = be.guard(nbytes) if be.guard is not None else \
            be.cl.Buffer(be.context, be.cl.mem_flags.READ_WRITE, max(nbytes, 1 << 20))
        buffers[key] = buf
    return be.cl_array.Array(be.queue, (int(size),), dtype, data=buf)


def index_table(be, values) -> object:
    """A small int32 vector on `be`'s device, cached (batch index tables repeat every run)."""
    return cached_table(be, np.asarray([int(v) for v in values], np.int32))


def gemm_packed(be, ap, bp, M, N, K, aidx, bidx, dtype, out=None, alpha=1.0, c=None, cm=0,
                cn=0, beta=0.0, cb=0, out_row_stride=None, z=None, act=("", 0.0, 0.0)):
    """On backend `be`, output batches len(aidx): out[bt] = act(alpha * A[aidx[bt]] @
    B[bidx[bt]] (+ beta * C, offset by aidx[bt] * cb) (+ z[bt])), written into `out` (a fresh
    (batches, M, N) array when None). `z`, the residual, holds batches * M * N elements laid
    out like a contiguous (batches, M, N) output; `act` is (code, p0, p1) from
    `activation_code`."""
    code, p0, p1 = act
    _, _, kG = gemm_kernels(be, dtype, code)
    batches = len(aidx)
    if out is None:
        out = be.empty((batches, M, N), dtype)
    RN = block_n(be, dtype)
    tp = np.dtype(dtype).type
    launch(be, kG, (-(-M // RM), -(-N // RN), batches), np.int32(M), np.int32(N), np.int32(K),
           index_table(be, aidx), index_table(be, bidx), ap, bp, out, tp(alpha),
           c if c is not None else ap, np.int64(cm), np.int64(cn), np.int64(cb), tp(beta),
           np.int32(c is not None), np.int64(out_row_stride or N),
           z if z is not None else ap, np.int32(z is not None), tp(p0), tp(p1))
    return out


NO_ACTIVATION = ("", 0.0, 0.0)


def _matmul_device(op, a, b, bias=None, z=None, act=NO_ACTIVATION):
    """np.matmul semantics (1-D operands, broadcast batch dims) on the device, with the fused
    epilogue: act(a @ b + bias + z), `bias` a vector over the result's last axis or a single
    value, `z` of the result's shape (checked by the caller). None when K == 0 (the caller
    falls back). Runs on `op.device`."""
    be = op.device
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    a1, b1 = len(a_shape) == 1, len(b_shape) == 1
    if a1:
        a_shape = (1,) + a_shape
    if b1:
        b_shape = b_shape + (1,)
    M, K = a_shape[-2:]
    K2, N = b_shape[-2:]
    if K != K2:
        raise op.fail(f"shapes {a.shape} and {b.shape} are not aligned")
    try:
        batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise op.fail(f"batch dimensions of {a.shape} and {b.shape} do not broadcast") from None
    out_shape = tuple(batch) + ((M,) if not a1 else ()) + ((N,) if not b1 else ())
    nb = math.prod(batch)
    if nb == 0 or M == 0 or N == 0:
        return be.empty(out_shape, a.dtype)
    if K == 0:
        return None
    ba, bb = math.prod(a_shape[:-2]), math.prod(b_shape[:-2])
    ap = pack_a(be, a, M, K, K, 1, ba, M * K, role="A")
    if bb == 1:
        bp = op._bpack.get(b, (b_shape,), lambda: pack_b(be, b, N, K, N, 1))
    else:
        bp = pack_b(be, b, N, K, N, 1, bb, K * N, role="B")
    aidx = np.broadcast_to(np.arange(ba).reshape(a_shape[:-2]), batch)
    bidx = np.broadcast_to(np.arange(bb).reshape(b_shape[:-2]), batch)
    # the bias runs along the result's last axis: N, or M when b is a vector (its N is 1);
    # a single value is read for every element
    cm, cn = (0, 0) if bias is not None and bias.size == 1 else (1, 0) if b1 else (0, 1)
    out = gemm_packed(be, ap, bp, M, N, K, np.ravel(aidx), np.ravel(bidx), a.dtype,
                      c=bias, cm=cm, cn=cn, beta=1.0, z=z, act=act)
    return out.reshape(out_shape)


@register("MatMul", versions=MatMul.versions, backend="opencl")
class MatMulCL(MatMul):
    dtypes = FLOAT_TYPES

    def setup(self):
        super().setup()
        self._bpack = CachedPack()

    def run(self, a, b):
        if a.dtype not in self.dtypes or b.dtype != a.dtype or a.ndim == 0 or b.ndim == 0:
            return self.run_on_cpu(a, b)
        out = _matmul_device(self, a, b)
        return self.run_on_cpu(a, b) if out is None else out


class _GemmCL:
    """Gemm on the device; also the base of ai.ember::FusedGemm (ops/opencl/fused.py), which
    sets `epilogue_activation` and whose CPU fallback (run_on_cpu) applies its activation."""
    dtypes = FLOAT_TYPES
    epilogue_activation = NO_ACTIVATION  # (code, p0, p1) for gemm_packed

    def setup(self):
        super().setup()
        self._bpack = CachedPack()

    def run(self, a, b, c=None):
        if a.dtype not in self.dtypes or b.dtype != a.dtype or \
                (c is not None and c.dtype != a.dtype):
            return self.run_on_cpu(a, b, c)
        if isinstance(self, Gemm1) and c is not None and not self.broadcast:
            m = a.shape[1] if self.transA else a.shape[0]
            n = b.shape[0] if self.transB else b.shape[1]
            if tuple(c.shape) != (m, n) and c.size != 1:
                raise self.fail(f"C has shape {c.shape}, expected ({m}, {n}) without broadcast")
        if a.ndim != 2 or b.ndim != 2:
            raise self.fail(f"Gemm needs 2-D A and B, got shapes {a.shape} and {b.shape}")
        M, K = (a.shape[1], a.shape[0]) if self.transA else a.shape
        K2, N = (b.shape[1], b.shape[0]) if self.transB else b.shape
        if K != K2:
            raise self.fail(f"inner dimensions differ: {a.shape} x {b.shape}")
        if M == 0 or N == 0 or K == 0:
            return self.run_on_cpu(a, b, c)
        use_c = c is not None and self.beta != 0.0
        cm = cn = 0
        if use_c:
            cshape = tuple(c.shape)
            try:
                if np.broadcast_shapes((M, N), cshape) != (M, N):
                    raise ValueError
            except ValueError:
                raise self.fail(f"C of shape {cshape} does not broadcast to {(M, N)}") from None
            cs = [0, 0]
            if len(cshape) == 2:
                cs = [cshape[1] if cshape[0] != 1 else 0, 1 if cshape[1] != 1 else 0]
            elif len(cshape) == 1:
                cs = [0, 1 if cshape[0] != 1 else 0]
            cm, cn = cs
        be = self.device
        sm, sk = (1, M) if self.transA else (K, 1)
        ap = pack_a(be, a, M, K, sm, sk, role="A")
        skb, sn = (1, K) if self.transB else (N, 1)
        bp = self._bpack.get(b, (self.transB,), lambda: pack_b(be, b, N, K, skb, sn))
        out = gemm_packed(be, ap, bp, M, N, K, [0], [0], a.dtype, alpha=self.alpha,
                          c=c if use_c else None, cm=cm, cn=cn, beta=self.beta,
                          act=self.epilogue_activation)
        return out.reshape(M, N)


@register("Gemm", versions=Gemm1.versions, backend="opencl")
class Gemm1CL(_GemmCL, Gemm1):
    pass


@register("Gemm", versions=Gemm7.versions, backend="opencl")
class Gemm7CL(_GemmCL, Gemm7):
    pass

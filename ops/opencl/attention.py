"""OpenCL Attention (opset 23, 24, 25): scaled dot-product attention on the device.

The work is three steps over (batch, kv head) blocks, the same shape as the CPU kernel:

1. scores = scale * Q @ K^T with the packed GEMM of ops/opencl/linalg.py. GQA copies no K/V:
   query heads h of one kv head (h // group) are neighbours in a (B, Hq, L, D) layout, so they
   fold into the rows of one (B*Hkv) batched matmul of group*L rows.
2. one row kernel (`attn_softmax`) per score row: softcap, the additive bias (attn_mask, bool
   or float, broadcast by strides and padded with -inf past its length; causal, sliding
   window and nonpad_kv_seqlen limits computed from indices, never materialised), then a
   masked softmax in place (a row that is all -inf gives zeros, as on the CPU). It also writes
   the optional 4th output at the stage qk_matmul_output_mode selects.
3. Y = probs @ V, again a folded batched GEMM.

3-D inputs (B, S, H*D), past_key/past_value concatenation and the 3-D output layout are plain
strided copies (`copy4d`) into/out of contiguous (B, H, S, D) arrays: cheap next to the two
matmuls, and they let the GEMM's packing read uniform strides. present_key/present_value are
those contiguous arrays (or K/V themselves when already 4-D without a past).

Runs on the CPU instead (run_on_cpu, per call), because the GEMM and the row kernel are only
built for float32/float64:
* float16 / bfloat16 inputs (bfloat16 never reaches the device), or Q, K, V, past and a float
  mask of differing dtypes (the CPU kernel's mixed-dtype casts);
* softmax_precision float16/bfloat16 (the CPU rounds the scores to the narrow type first);
* empty dimensions, and masks that broadcast the scores to a larger shape (numpy semantics
  the CPU kernel reproduces; for an invalid model it raises the error).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ember.ops.attention import Attention23, Attention24, Attention25
from ember.ops.opencl._common import (
    FLOAT_TYPES, broadcast_strides, c_type, contiguous, kernel, launch)
from ember.ops.opencl.linalg import gemm_packed, pack_a, pack_b
from ember.ops.opencl.reduction import local_size, tree_code
from ember.ops.registry import register

_i64 = np.int64
# softmax_precision codes computed natively: the accumulation type of the row kernel
_NATIVE_PRECISION = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}
_MASK_NONE, _MASK_BOOL, _MASK_FLOAT = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Kernels

@lru_cache(maxsize=None)
def _copy_source(ctype: str) -> str:
    return f"""
typedef {ctype} T;
/* dst[d_off + i.d] = src[i.s] over the 4-D index space (n0, n1, n2, n3): one work-item per
   (i0, i1, i2) copies a run of n3 (a head vector), so there is no division per element. */
__kernel void copy4d(__global const T *src, __global T *dst, const long n3,
                     const long s0, const long s1, const long s2, const long s3,
                     const long d0, const long d1, const long d2, const long d3,
                     const long d_off) {{
    const long i2 = get_global_id(0), i1 = get_global_id(1), i0 = get_global_id(2);
    __global const T *x = src + i0 * s0 + i1 * s1 + i2 * s2;
    __global T *y = dst + d_off + i0 * d0 + i1 * d1 + i2 * d2;
    for (long i3 = 0; i3 < n3; ++i3) y[i3 * d3] = x[i3 * s3];
}}
"""


def _lanes(vw: int) -> list[str]:
    """OpenCL C component names of a vw-wide vector (.s0 .. .sf)."""
    return [f".s{k:x}" for k in range(vw)]


def _bias_pass(vw: int, mask: int, qk_mode: int) -> str:
    """C statements for pass 1 over the elements j .. j+vw-1 of a row (vw == 1: one element,
    any j; vw > 1: a whole vector, inside the mask's length): qk stages 0-2, softcap, bias,
    store back, running maximum `mv`. TV/IV: the vector types of T and IS."""
    tv, iv = ("T", "IS") if vw == 1 else ("TV", "IV")
    if vw == 1:
        load, store = "sr[j]", "sr[j] = v;"
        qk_store = "qr[j] = v;"
        bool_keep = "(j < mlen && mr[j * ms3])"
        float_mask = "(j < mlen ? mr[j * ms3] : (T)(-INFINITY))"
        jj = "(IS)j"
    else:
        load, store = f"vload{vw}(0, sr + j)", f"vstore{vw}(v, 0, sr + j);"
        qk_store = f"vstore{vw}(v, 0, qr + j);"
        bool_keep = f"(convert_IV(vload{vw}(0, mr + j)) != (IV)(0))"
        float_mask = f"vload{vw}(0, mr + j)"
        jj = "((IV)((IS)j) + IOTA)"
    mask_bias = {_MASK_NONE: "",
                 _MASK_BOOL: f"bias = {bool_keep} ? ({tv})(0) : ({tv})(-INFINITY);",
                 _MASK_FLOAT: f"bias = {float_mask};"}[mask]

    def qk(stage):
        return qk_store if qk_mode == stage else ""

    return f"""{{
        {tv} v = {load};
        {qk(0)}
        if (cap > 0) v = cap * tanh(v / cap);
        {qk(1)}
        if (has_bias) {{
            {tv} bias = ({tv})(0);
            {mask_bias}
            if (structural) {{
                const {iv} jv = {jj};
                bias = bias + ((jv >= lo && jv <= hi) ? ({tv})(0) : ({tv})(-INFINITY));
            }}
            v = v + bias;
        }}
        {qk(2)}
        {store}
        mv = (v > mv || v != v) ? v : mv;  /* a maximum that keeps NaN, as np.max does */
    }}"""


def _softmax_converters(ctype: str, acc: str):
    """(to_acc, to_t): C expressions converting `x` (w lanes wide) to ACC and back to T; the
    identity when the row accumulates in T itself."""
    if acc == ctype:
        return (lambda x, w: x), (lambda x, w: x)
    return ((lambda x, w: f"convert_{acc}{w}({x})" if w > 1 else f"(ACC)({x})"),
            (lambda x, w: f"convert_{ctype}{w}({x})" if w > 1 else f"(T)({x})"))


def _softmax_vector_passes(vw: int, mask: int, qk_mode: int, to_acc, to_t,
                           scalar: tuple[str, str, str]) -> tuple[str, str, str, str]:
    """(head, pass1, pass2, pass3) of the ls == 1 kernel: one work-item walks its row in
    vectors of VW, then the scalar statements `scalar` finish the tail."""
    scalar_pass1, scalar_pass2, scalar_pass3 = scalar
    head = "const long row = get_global_id(0); if (row >= rows) return;"
    hmax = " ".join(f"{{ const T x = mv4{c}; m1 = (x > m1 || x != x) ? x : m1; }}"
                    for c in _lanes(vw))
    hsum = " + ".join(f"sv{c}" for c in _lanes(vw))
    vload = f"vload{vw}(0, sr + j)"
    pass1 = f"""
    /* vectors while inside the mask's length (where its last stride is 1), then scalars */
    const long vend = {"min(n, mlen)" if mask else "n"};
    long j = 0;
    {{
        TV mv = (TV)(-INFINITY);
        for (; j + VW <= vend; j += VW) {_bias_pass(vw, mask, qk_mode)}
        const TV mv4 = mv;
        T m1 = -INFINITY;
        {hmax}
        {{ T mv = m1;
           for (; j < n; ++j) {scalar_pass1}
           m1 = mv; }}
        m = (ACC)m1;
    }}"""
    qk3v = f"vstore{vw}(p, 0, qr + j);" if qk_mode == 3 else ""
    pass2 = f"""
    {{
        ACCV sv = (ACCV)(0);
        for (j = 0; j + VW <= n; j += VW) {{
            const ACCV e = exp({to_acc(vload, vw)} - m);
            vstore{vw}({to_t("e", vw)}, 0, sr + j);
            sv += e;
        }}
        sum = {hsum};
        for (; j < n; ++j) {scalar_pass2}
    }}"""
    pass3 = f"""
    for (j = 0; j + VW <= n; j += VW) {{
        const TV p = {to_t(f"{to_acc(vload, vw)} / sum", vw)};
        vstore{vw}(p, 0, sr + j);
        {qk3v}
    }}
    for (; j < n; ++j) {scalar_pass3}"""
    return head, pass1, pass2, pass3


def _softmax_group_passes(scalar: tuple[str, str, str]) -> tuple[str, str, str, str, str, str]:
    """(head, pass1, pass2, pass3, tree_max, tree_sum) of the ls > 1 kernel: the work-group's
    items stride the row with the scalar statements, and trees in local memory combine them."""
    scalar_pass1, scalar_pass2, scalar_pass3 = scalar
    head = "const long row = get_group_id(0); const int lid = get_local_id(0);\n" \
           "    __local ACC buf[LS];"
    loop = "for (long j = lid; j < n; j += LS)"
    pass1 = f"""
    {{
        T mv = -INFINITY;
        {loop} {scalar_pass1}
        m = (ACC)mv;
    }}"""
    return (head, pass1, f"{loop} {scalar_pass2}", f"{loop} {scalar_pass3}",
            tree_code("m", "ACC", "((a > b || a != a) ? a : b)"),
            tree_code("sum", "ACC", "a + b"))


def _softmax_preamble(ctype: str, acc: str, mask: int, vw: int, ls: int) -> str:
    """The typedefs and #defines the `attn_softmax` kernel text is written against."""
    int_t = "long" if ctype == "double" else "int"  # same width as T: vector compares give it
    mtype = "uchar" if mask == _MASK_BOOL else "T"
    iota = ", ".join(str(k) for k in range(vw))
    return f"""
typedef {ctype} T;
typedef {ctype}{vw} TV;
typedef {int_t} IS;
typedef {int_t}{vw} IV;
typedef {acc} ACC;
typedef {acc}{vw} ACCV;
typedef {mtype} MT;
#define VW {vw}
#define LS {ls}
#define IOTA ((IV)({iota}))
#define convert_IV convert_{int_t}{vw}
"""


def _softmax_kernel(mask: int, head: str, pass1: str, tree_max: str, pass2: str,
                    tree_sum: str, pass3: str) -> str:
    """The `attn_softmax` kernel around its passes: the row's limits, then max, exp and sum,
    and the division, each pass followed by its work-group tree (if any)."""
    return f"""/* Row (b, h, i) of the scores s (rows = B*H*L rows of n): softcap, + bias, masked softmax,
   in place; qr gets the qk_matmul_output at the stage QK_MODE selects. The bias is added in
   the CPU kernel's order: the mask (-inf past its length mlen), then the structural limits,
   which all reduce to one allowed key interval [lo, hi] per row. */
__kernel void attn_softmax(__global T *s, __global T *qk, __global const MT *mask,
                           const long rows, const long n, const long L, const long H,
                           const long ms0, const long ms1, const long ms2, const long ms3,
                           const long mlen, const T cap, const int causal, const long left,
                           const long right, __global const long *nonpad, const int has_nonpad,
                           const long past_len) {{
    {head}
    const long i = row % L, bh = row / L, head = bh % H, batch = bh / H;
    /* the absolute position of query i; keys j with lo <= j <= hi pass the limits */
    long offset = past_len, top = n - 1, bottom = 0;
    if (has_nonpad) {{
        top = nonpad[batch] - 1;
        if (past_len == 0) offset = top + 1 - L;
    }}
    const long pos = i + offset;
    if (causal && pos < top) top = pos;
    if (right >= 0 && pos + right < top) top = pos + right;
    if (left >= 0 && pos - left > bottom) bottom = pos - left;
    /* clamped into [-1, n] so they fit IS */
    const IS hi = (IS)(top < -1 ? -1 : top > n ? n : top);
    const IS lo = (IS)(bottom > n ? n : bottom);
    const int structural = causal || left >= 0 || right >= 0 || has_nonpad;
    const int has_bias = {int(mask != _MASK_NONE)} || structural;
    __global T *sr = s + row * n;
    __global T *qr = qk + row * n;
    __global const MT *mr = mask + batch * ms0 + head * ms1 + i * ms2;
    ACC m, sum = 0;
    {pass1}
    {tree_max}
    if (!isfinite(m)) m = 0;
    {pass2}
    {tree_sum}
    if (sum == 0) sum = 1;  /* a fully masked row: zeros, not NaN */
    {pass3}
}}
"""


@lru_cache(maxsize=None)
def _softmax_source(ctype: str, acc: str, mask: int, qk_mode: int, ls: int,
                    vector_bits: int) -> str:
    """Kernel `attn_softmax` over the score rows (b, h, i) of length n.

    ls == 1 (CPU devices): one work-item per row, in vectors of VW elements (`vector_bits`
    wide: the backend's `vector_bits`; vload/vstore and
    a vector exp: PoCL calls a builtin per use, so one call per vector instead of per element
    makes the row ~3x faster), with a scalar tail. ls > 1: one work-group of ls work-items
    per row striding it, combining max and sum by trees in local memory (GPUs)."""
    wide = "double" in (ctype, acc)
    vw = vector_bits // (64 if wide else 32)
    to_acc, to_t = _softmax_converters(ctype, acc)
    qk3 = "qr[j] = p;" if qk_mode == 3 else ""
    scalar = (_bias_pass(1, mask, qk_mode),
              "{ const ACC e = exp((ACC)sr[j] - m); sr[j] = (T)e; sum += e; }",
              f"{{ const T p = (T)((ACC)sr[j] / sum); sr[j] = p; {qk3} }}")
    if ls == 1:
        head, pass1, pass2, pass3 = _softmax_vector_passes(vw, mask, qk_mode, to_acc, to_t,
                                                           scalar)
        tree_max = tree_sum = ""
    else:
        head, pass1, pass2, pass3, tree_max, tree_sum = _softmax_group_passes(scalar)
    return _softmax_preamble(ctype, acc, mask, vw, ls) + _softmax_kernel(
        mask, head, pass1, tree_max, pass2, tree_sum, pass3)


# --------------------------------------------------------------------------------------------
# Helpers

def _copy4d(be, src, dst, shape, src_strides, dst_strides, dst_offset=0) -> None:
    """dst[dst_offset + idx . dst_strides] = src[idx . src_strides] for idx over `shape` (4-D,
    element strides), on backend `be`."""
    if math.prod(shape) == 0:
        return
    knl = kernel(be, _copy_source(c_type(src.dtype)), "copy4d")
    launch(be, knl, (shape[2], shape[1], shape[0]), src, dst, _i64(shape[3]),
           *(_i64(v) for v in src_strides), *(_i64(v) for v in dst_strides), _i64(dst_offset))


def _strides(shape) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


class _AttentionCL:
    dtypes = FLOAT_TYPES

    # -- layout ------------------------------------------------------------------------------
    def _cl_view4d(self, x, heads, what):
        """(shape, element strides) of `x` seen as (B, H, S, D), as the CPU's _to_4d views it."""
        if x.ndim == 4:
            return tuple(x.shape), _strides(x.shape)
        b, s, heads, d = self.split_heads(x, heads, what)
        return (b, heads, s, d), (s * heads * d, d, heads * d, 1)

    def _cl_4d(self, x, heads, what):
        """`x` as a contiguous (B, H, S, D) device array (itself when it already is one)."""
        x = contiguous(x)
        shape, strides = self._cl_view4d(x, heads, what)
        if x.ndim == 4:
            return x
        out = self.device.empty(shape, x.dtype)
        _copy4d(self.device, x, out, shape, strides, _strides(shape))
        return out

    def _cl_present(self, x, past, heads, what):
        """concat(past, x) along the sequence axis, as a contiguous (B, H, P+S, D) array."""
        if past is None:
            return self._cl_4d(x, heads, what)
        x = contiguous(x)
        past = contiguous(past)
        shape, strides = self._cl_view4d(x, heads, what)
        b, h, s, d = shape
        if past.ndim != 4 or tuple(past.shape[:2]) != (b, h) or past.shape[3] != d:
            raise self.fail(f"past {what} of shape {past.shape} does not match {what} "
                            f"{(b, h, s, d)}")
        p = past.shape[2]
        out = self.device.empty((b, h, p + s, d), x.dtype)
        out_strides = _strides(out.shape)
        _copy4d(self.device, past, out, past.shape, _strides(past.shape), out_strides)
        _copy4d(self.device, x, out, shape, strides, out_strides, dst_offset=p * d)
        return out

    # -- run ---------------------------------------------------------------------------------
    def _cl_native(self, Q, K, V, attn_mask, past_key, past_value, nonpad):
        """Whether this call runs on the device (else on the CPU; see the module docstring)."""
        dt = Q.dtype
        if dt not in self.dtypes or K.dtype != dt or V.dtype != dt:
            return False
        if any(p is not None and p.dtype != dt for p in (past_key, past_value)):
            return False
        if attn_mask is not None and attn_mask.dtype not in (dt, np.dtype(np.bool_)):
            return False
        if nonpad is not None and nonpad.dtype != np.int64:
            return False
        if self.softmax_precision is not None and \
                self.softmax_precision not in _NATIVE_PRECISION:
            return False
        return all(x.size for x in (Q, K, V))

    def run(self, Q, K, V, attn_mask=None, past_key=None, past_value=None,
            nonpad_kv_seqlen=None):
        args = (Q, K, V, attn_mask, past_key, past_value, nonpad_kv_seqlen)
        if nonpad_kv_seqlen is not None and not self.has_nonpad:
            raise self.fail("nonpad_kv_seqlen is an input from opset 24 on")
        if (past_key is None) != (past_value is None):
            raise self.fail("past_key and past_value must be given together")
        if not self._cl_native(*args):
            return self.run_on_cpu(*args[:self.n_inputs])
        in3d = Q.ndim == 3
        q = self._cl_4d(Q, self.q_num_heads, "Q")
        k = self._cl_present(K, past_key, self.kv_num_heads, "K")
        v = self._cl_present(V, past_value, self.kv_num_heads, "V")
        batch, q_heads, q_len, head = q.shape
        kv_heads, total = k.shape[1], k.shape[2]
        past_len = past_key.shape[2] if past_key is not None else 0
        if q_heads % kv_heads:
            raise self.fail(f"q heads {q_heads} not a multiple of kv heads {kv_heads}")
        if k.shape[0] != batch or k.shape[3] != head or tuple(v.shape[:3]) != tuple(k.shape[:3]):
            raise self.fail(f"Q {q.shape}, K {k.shape} and V {v.shape} do not match")
        mask_info = self._cl_mask_layout(attn_mask, batch, q_heads, q_len, total)
        if mask_info is None:
            return self.run_on_cpu(*args[:self.n_inputs])

        be = self.device
        dtype = q.dtype
        vdim = v.shape[3]
        group = q_heads // kv_heads
        nb = batch * kv_heads  # GEMM batches; a batch's rows are its `group` query heads
        rows = group * q_len
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head)
        ids = np.arange(nb)

        # 1. scores (B*Hkv, group*L, T) == (B, Hq, L, T), scaled in the GEMM's epilogue
        ap = pack_a(be, q, rows, head, head, 1, nb, rows * head, role="A")
        bp = pack_b(be, k, total, head, 1, head, nb, total * head, role="B")
        scores = gemm_packed(be, ap, bp, rows, total, head, ids, ids, dtype, alpha=scale)

        # 2. softcap, bias, softmax in place; the 4th output at its stage
        want_qk = self.n_outputs > 3
        qk = be.empty((batch, q_heads, q_len, total), dtype) if want_qk else None
        self._cl_softmax(scores, qk, attn_mask, mask_info, batch * q_heads * q_len, total,
                         q_len, q_heads, past_len, nonpad_kv_seqlen)

        # 3. Y = probs @ V
        ap = pack_a(be, scores, rows, total, total, 1, nb, rows * total, role="A")
        bp = pack_b(be, v, vdim, total, vdim, 1, nb, total * vdim, role="B")
        y = gemm_packed(be, ap, bp, rows, vdim, total, ids, ids, dtype)
        if in3d:  # (B, Hq, L, Dv) -> (B, L, Hq*Dv)
            y4, y = y, be.empty((batch, q_len, q_heads * vdim), dtype)
            shape = (batch, q_len, q_heads, vdim)
            _copy4d(be, y4, y, shape, (q_heads * q_len * vdim, vdim, q_len * vdim, 1),
                    _strides(shape))
        else:
            y = y.reshape(batch, q_heads, q_len, vdim)
        results = [y, k, v]
        if want_qk:
            results.append(qk)
        return tuple(results[:max(self.n_outputs, 1)])

    def _cl_mask_layout(self, mask, batch, heads, q_len, total):
        """(kind, element strides over (B, H, L, Tm), Tm) for the row kernel, or None when
        the mask broadcasts the scores beyond (B, H, L, T) (left to the CPU kernel)."""
        if mask is None:
            return _MASK_NONE, (0, 0, 0, 0), 0
        kind = _MASK_BOOL if mask.dtype == np.bool_ else _MASK_FLOAT
        shape = tuple(mask.shape)
        if not shape:
            return None
        mlen = shape[-1]
        if mlen > total:
            raise self.fail(f"attn_mask last dimension {mlen} exceeds total sequence length "
                            f"{total}")
        target = (batch, heads, q_len, mlen)
        try:
            if len(shape) > 4 or np.broadcast_shapes(shape, target) != target:
                return None
        except ValueError:
            return None
        return kind, tuple(int(s) for s in broadcast_strides(shape, target)), mlen

    def _cl_softmax(self, scores, qk, mask, mask_info, rows, n, q_len, heads, past_len, nonpad):
        kind, ms, mlen = mask_info
        dtype = scores.dtype
        acc = _NATIVE_PRECISION[self.softmax_precision] if self.softmax_precision else dtype
        qk_mode = self.mode if qk is not None else -1
        be = self.device
        ls = local_size(be, n)
        knl = kernel(be, _softmax_source(c_type(dtype), c_type(acc), kind, qk_mode, ls,
                                         be.vector_bits), "attn_softmax")
        if mask is not None:
            mask = contiguous(mask)
        tp = dtype.type
        launch(be, knl, rows * ls, scores, qk if qk is not None else scores,
               mask if mask is not None else scores, _i64(rows), _i64(n), _i64(q_len),
               _i64(heads), *(_i64(s) for s in ms), _i64(mlen), tp(self.softcap),
               np.int32(self.is_causal), _i64(self.left), _i64(self.right),
               nonpad if nonpad is not None else scores, np.int32(nonpad is not None),
               _i64(past_len), local_size=(ls,) if ls > 1 else None)


@register("Attention", versions=[23], backend="opencl")
class Attention23CL(_AttentionCL, Attention23):
    pass


@register("Attention", versions=[24], backend="opencl")
class Attention24CL(_AttentionCL, Attention24):
    pass


@register("Attention", versions=[25], backend="opencl")
class Attention25CL(_AttentionCL, Attention25):
    pass

"""Attention family: Attention (23/24/25), RotaryEmbedding (23), LinearAttention (27),
ai.onnx.preview::FlexAttention (1).

Attention runs as batched matmuls over (batch, heads) with numpy broadcasting; narrow float
inputs (float16, bfloat16) are computed in float32 and cast back at the end. On the CPU, a
decoder step's few float32 query rows run as one compiled kernel instead (`_step`).
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops.cpu import blas as _blas, compiled as _compiled, tuning
from ember.ops._dtypes import is_narrow_float, work_dtype
from ember.ops.reduction import _softmax_rows_loops, softmax
from ember.ops.registry import PORTABLE, Lowering, OpImpl, register

# ONNX TensorProto data type codes accepted by softmax_precision
_PRECISION = {1: np.float32, 10: np.float16, 11: np.float64}


def _precision_dtype(code):
    if code == 16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_PRECISION[code])


def _narrow_round(xp, x, dtype):
    """`x` rounded to the narrow float `dtype`, as float32. cupy has no bfloat16 arrays: there
    the float32 bits are rounded to bfloat16's 16 high bits (to nearest even), NaN kept."""
    if xp is np or dtype != _precision_dtype(16):
        return x.astype(dtype).astype(np.float32)
    x = x.astype(np.float32)
    bits = x.view(np.uint32)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return xp.where(xp.isnan(x), x, bits.view(np.float32))


def _masked_softmax(xp, scores):
    """Softmax over the last axis; rows that are entirely -inf give zeros, not NaN."""
    return softmax(xp, scores, -1, empty_rows_zero=True)


# A decoder step's attention (ATTEND_MAX_ROWS query rows a kv head at most: ops/cpu/tuning.py)
# is a few hundred thousand multiply-adds, but as numpy and BLAS calls (a batched product for
# the scores, a softmax, another product) each call cost more than that work, and the
# products were cut among threads for microseconds of work each. `_step` computes, in one
# compiled call, for each (batch, kv head) unit the scores of its query rows, their softmax
# (the compiled Softmax's row loop) and the weighted sum of V's rows; the units are split
# among the run's threads. Each output is computed by one thread in a fixed order (the dot
# products' sums reassociated into vector lanes the same way on every call), so any thread
# count gives the same bits.
_STEP_FASTMATH = {"reassoc", "contract"}  # the sums over d in vector lanes: no NaN/inf flags
_NO_BIAS = np.zeros((1, 1, 1, 1), np.float32)


def _step(q, k, v, bias):
    """softmax(q @ k^T + bias) @ v per (batch, head) by `_step_loops`, float32: q (B, Hq, L,
    D) already scaled, k (B, Hkv, T, D), v (B, Hkv, T, Dv), Hq a multiple of Hkv, bias None or
    of up to 4 dimensions, each 1 or (B, Hq, L, T)'s. None where numba is absent or the bias
    is otherwise."""
    kernel = _compiled.jit(_step_loops, fastmath=_STEP_FASTMATH)
    if kernel is None:
        return None
    batch, q_heads, q_len, _ = q.shape
    kv_heads, total = k.shape[1], k.shape[2]
    if bias is not None:  # 4-D, each dimension whole or 1 (the kernel reads index 0 there)
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
        if bias.ndim != 4 or any(d not in (1, want) for d, want in
                                 zip(bias.shape, (batch, q_heads, q_len))) \
                or bias.shape[3] != total:
            return None
    out = np.empty((batch, q_heads, q_len, v.shape[3]), np.float32)
    rows = q_heads // kv_heads * q_len
    _compiled.split_rows(kernel, batch * kv_heads, np.ascontiguousarray(q),
                         np.ascontiguousarray(k), np.ascontiguousarray(v),
                         _NO_BIAS if bias is None else np.ascontiguousarray(bias, np.float32),
                         bias is not None, out,
                         ns_per_row=tuning.ATTEND_NS_PER_MAC * rows * total
                         * (q.shape[3] + v.shape[3]), piece=_step_piece)
    return out


def _step_piece(block, u0, u1):  # pragma: no cover - numba
    """`_step_loops`' piece function (ops/cpu/compiled.py: the helpers run its pieces
    without Python), its arguments rebuilt from the block `split_rows` made."""
    f = _compiled.array_at(block, (26,), np.int64)
    _step_loops(_compiled.array_at(f[0], (f[1], f[2], f[3], f[4]), np.float32),
                _compiled.array_at(f[5], (f[6], f[7], f[8], f[9]), np.float32),
                _compiled.array_at(f[10], (f[11], f[12], f[13], f[14]), np.float32),
                _compiled.array_at(f[15], (f[16], f[17], f[18], f[19]), np.float32),
                f[20] != 0,
                _compiled.array_at(f[21], (f[22], f[23], f[24], f[25]), np.float32), u0, u1)


@_compiled.kernel_math(fastmath=_STEP_FASTMATH)
def _step_loops(q, k, v, bias, has_bias, out, u0, u1):  # pragma: no cover - numba
    """The units [u0, u1), unit u the kv head u % Hkv of batch item u // Hkv: the scores of
    its query rows (its query heads by the query length) against each of the T keys, plus
    the bias, then their softmax (an all -inf row gives zeros), then each row's sum of V's
    rows weighted by them. Four keys (and four rows of V) at a time: each load of the query
    row (of the sums) serves four. Elements are indexed in full, no views taken in the
    loops: each view costs two atomic reference counts, a large share at a step's sizes."""
    q_heads, q_len = q.shape[1], q.shape[2]
    kv_heads, total, depth, width = k.shape[1], k.shape[2], k.shape[3], v.shape[3]
    group = q_heads // kv_heads
    rows = group * q_len
    scores = np.empty((rows, total), np.float32)
    probs = np.empty((rows, total), np.float32)  # apart from scores: the exp loop vectorises
    acc = np.empty(width, np.float32)
    for u in range(u0, u1):
        b, g = u // kv_heads, u % kv_heads
        for r in range(rows):
            h, i = g * group + r // q_len, r % q_len
            t = 0
            while t < total:
                t1, t2, t3 = min(t + 1, total - 1), min(t + 2, total - 1), min(t + 3, total - 1)
                s0 = s1 = s2 = s3 = np.float32(0)  # keys past T: the last again, unstored
                for d in range(depth):
                    x = q[b, h, i, d]
                    s0 += x * k[b, g, t, d]
                    s1 += x * k[b, g, t1, d]
                    s2 += x * k[b, g, t2, d]
                    s3 += x * k[b, g, t3, d]
                for j, s in enumerate((s0, s1, s2, s3)):
                    if t + j < total:
                        scores[r, t + j] = s + bias[b if bias.shape[0] > 1 else 0,
                                                    h if bias.shape[1] > 1 else 0,
                                                    i if bias.shape[2] > 1 else 0,
                                                    t + j] if has_bias else s
                t += 4
        _softmax_rows_loops(scores, probs, True, 0, rows)
        for r in range(rows):
            h, i = g * group + r // q_len, r % q_len
            for d in range(width):
                acc[d] = 0
            t = 0
            while t + 4 <= total:
                w0, w1, w2, w3 = probs[r, t], probs[r, t + 1], probs[r, t + 2], probs[r, t + 3]
                for d in range(width):
                    acc[d] += (w0 * v[b, g, t, d] + w1 * v[b, g, t + 1, d]) \
                        + (w2 * v[b, g, t + 2, d] + w3 * v[b, g, t + 3, d])
                t += 4
            for t in range(t, total):
                w0 = probs[r, t]
                for d in range(width):
                    acc[d] += w0 * v[b, g, t, d]
            for d in range(width):
                out[b, h, i, d] = acc[d]


_STEP = Lowering("cpu.attention-step", "a decoder step's few query rows: scores, softmax and "
                 "weighted sum in one compiled call, split by (batch, kv head)")
_BY_ROWS = Lowering("by geometry", "from the query rows a kv head in the run: one compiled "
                    "call for a decoder step's few, else BLAS products and a softmax by rows")


class _Attention(OpImpl):
    def lower(self, inputs):
        q, k, v = inputs[0], inputs[1], inputs[2]
        if q is not None and v is not None and self._step_serves(q.dtype, v.dtype):
            rows = self._rows_per_kv_head(q.shape, None if k is None else k.shape)
            if rows is None:
                return _BY_ROWS
            if rows <= tuning.ATTEND_MAX_ROWS:
                return _STEP
        if q is not None and q.dtype in (np.float32, np.float64) and _blas.enabled():
            return Lowering("cpu.board-gemm", "scores and weighted sums as BLAS products, cut "
                            "in pieces on the pool's board in runs; softmax by rows")
        return PORTABLE

    def _step_serves(self, q_dtype, v_dtype) -> bool:
        """Whether `_step` can run this node (given rows few enough): float32 Q and V, no
        softcap, no scores asked for, softmax in float32, on the CPU with numba."""
        return (q_dtype == v_dtype == np.float32 and self.softcap == 0 and self.n_outputs <= 3
                and self.softmax_precision in (None, 1) and self.xp is np
                and _compiled.enabled())

    def _rows_per_kv_head(self, q_shape, k_shape) -> int | None:
        """Query heads a kv head times the query length, from Q's and K's shapes (3-D with
        the heads attributes, or 4-D); None where a dimension is not known."""
        if q_shape is None or k_shape is None or len(q_shape) not in (3, 4):
            return None
        q_heads, q_len = (q_shape[1], q_shape[2]) if len(q_shape) == 4 \
            else (self.q_num_heads, q_shape[1])
        kv_heads = k_shape[1] if len(k_shape) == 4 else self.kv_num_heads
        if not all(isinstance(d, int) and d > 0 for d in (q_heads, q_len, kv_heads)) \
                or q_heads % kv_heads:
            return None
        return q_heads // kv_heads * q_len

    has_nonpad = False
    has_window = False

    def setup(self):
        self.is_causal = bool(self.is_causal)
        self.softcap = float(self.softcap or 0.0)
        mode = int(self.qk_matmul_output_mode or 0)
        if mode not in (0, 1, 2, 3):
            raise self.fail(f"qk_matmul_output_mode must be 0..3, got {mode}")
        self.mode = mode
        if self.softmax_precision is not None and self.softmax_precision not in (1, 10, 11, 16):
            raise self.fail(f"unsupported softmax_precision {self.softmax_precision}")
        self.left = int(getattr(self, "left_window_size", -1) if self.has_window else -1)
        self.right = int(getattr(self, "right_window_size", -1) if self.has_window else -1)

    def split_heads(self, x, heads, what) -> tuple[int, int, int, int]:
        """(batch, sequence, heads, head size) of a 3-D input (batch, sequence, hidden)."""
        if x.ndim != 3:
            raise self.fail(f"{what} must be 3-D or 4-D, got shape {x.shape}")
        if not heads:
            raise self.fail("3-D inputs need the q_num_heads and kv_num_heads attributes")
        b, s, hidden = x.shape
        if hidden % heads:
            raise self.fail(f"{what} hidden size {hidden} is not divisible by {heads} heads")
        return b, s, heads, hidden // heads

    def _to_4d(self, x, heads, what):
        if x.ndim == 4:
            return x
        return x.reshape(self.split_heads(x, heads, what)).transpose(0, 2, 1, 3)

    def run(self, Q, K, V, attn_mask=None, past_key=None, past_value=None,
            nonpad_kv_seqlen=None):
        self.settle_lowering(Q, K, V)
        xp = self.xp
        out_dtype = Q.dtype
        in3d = Q.ndim == 3
        q = self._to_4d(Q, self.q_num_heads, "Q")
        k = self._to_4d(K, self.kv_num_heads, "K")
        v = self._to_4d(V, self.kv_num_heads, "V")
        if nonpad_kv_seqlen is not None and not self.has_nonpad:
            raise self.fail("nonpad_kv_seqlen is an input from opset 24 on")
        if (past_key is None) != (past_value is None):
            raise self.fail("past_key and past_value must be given together")
        past_len = 0
        if past_key is not None:
            past_len = past_key.shape[2]
            k = xp.concatenate([past_key, k.astype(past_key.dtype, copy=False)], axis=2)
            v = xp.concatenate([past_value, v.astype(past_value.dtype, copy=False)], axis=2)
        present_k, present_v = k, v

        batch, q_heads, q_len, head = q.shape
        kv_heads, total = k.shape[1], k.shape[2]
        if q_heads % kv_heads:
            raise self.fail(f"q heads {q_heads} not a multiple of kv heads {kv_heads}")
        work = work_dtype(out_dtype)
        qw = q.astype(work, copy=False)
        kw = k.astype(work, copy=False)
        vw = v.astype(work_dtype(V.dtype), copy=False)
        # GQA without copying K/V: query head h uses kv head h // group, so the query heads of
        # one kv head are contiguous and fold into the sequence axis of one batched matmul.
        group = q_heads // kv_heads
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head)
        # the scale on Q alone (the spec's reference puts its root on Q and on K: the two
        # differ in the last bits): K, the long operand of a decoder step, is then not
        # copied to be scaled
        bias = self._bias(attn_mask, batch, q_len, total, past_len, nonpad_kv_seqlen, work)
        if group * q_len <= tuning.ATTEND_MAX_ROWS and kw.dtype == np.float32 \
                and self._step_serves(qw.dtype, vw.dtype):  # as `lower` chose
            y = _step(qw * work.type(scale), kw, vw, bias)
            if y is not None:
                return self._finish(y, in3d, out_dtype, present_k, present_v, None)
        qg = (qw * work.type(scale)).reshape(batch, kv_heads, group * q_len, head)
        scores = _blas.product(xp, qg, xp.swapaxes(kw, -1, -2)).reshape(
            batch, q_heads, q_len, total)
        qk_out = scores if self.mode == 0 else None
        if self.softcap > 0:
            cap = work.type(self.softcap)
            scores = cap * xp.tanh(scores / cap)
        if self.mode == 1:
            qk_out = scores

        if bias is not None:
            scores = scores + bias
        if self.mode == 2:
            qk_out = scores

        if self.softmax_precision is not None:
            sdt = _precision_dtype(self.softmax_precision)
            if is_narrow_float(sdt):  # rounded to the narrow type, computed in float32
                probs = _masked_softmax(xp, _narrow_round(xp, scores, sdt))
                probs = _narrow_round(xp, probs, sdt)
            else:
                probs = _masked_softmax(xp, scores.astype(sdt))
            probs = probs.astype(work)
        else:
            probs = _masked_softmax(xp, scores)
        if self.mode == 3:
            qk_out = probs

        y = _blas.product(xp, probs.reshape(batch, kv_heads, group * q_len, total), vw).reshape(
            batch, q_heads, q_len, vw.shape[-1])
        return self._finish(y, in3d, out_dtype, present_k, present_v, qk_out)

    def _finish(self, y, in3d, out_dtype, present_k, present_v, qk_out):
        """The outputs from y (batch, q heads, q length, head size): 3-D again where Q was."""
        if in3d:
            batch, _, q_len, _ = y.shape
            y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
        y = y.astype(out_dtype, copy=False)
        results = [y, present_k, present_v]
        if self.n_outputs > 3:
            results.append(qk_out.astype(out_dtype, copy=False))
        return tuple(results[:max(self.n_outputs, 1)])

    def _bias(self, attn_mask, batch, q_len, total, past_len, nonpad, work):
        """Additive bias broadcastable to (batch, heads, q_len, total), or None."""
        xp = self.xp
        neg = work.type(-np.inf)
        bias = None
        if attn_mask is not None:
            m = attn_mask
            if m.dtype == bool:
                m = xp.where(m, work.type(0), neg)
            else:
                m = m.astype(work)
            if m.shape[-1] < total:
                pad = [(0, 0)] * (m.ndim - 1) + [(0, total - m.shape[-1])]
                m = xp.pad(m, pad, constant_values=-np.inf)
            elif m.shape[-1] > total:
                raise self.fail(f"attn_mask last dimension {m.shape[-1]} exceeds total "
                                f"sequence length {total}")
            bias = m
        # structural constraints: causal, sliding window, non-padded kv length
        allowed = None
        rows = xp.arange(q_len).reshape(-1, 1)
        cols = xp.arange(total).reshape(1, -1)
        if nonpad is not None and past_len == 0:
            offset = xp.asarray(nonpad, np.int64).reshape(-1, 1, 1, 1) - q_len
        else:
            offset = past_len
        pos = rows + offset  # absolute query position(s)
        if self.is_causal:
            allowed = cols <= pos
        if self.left >= 0:
            a = cols >= pos - self.left
            allowed = a if allowed is None else allowed & a
        if self.right >= 0:
            a = cols <= pos + self.right
            allowed = a if allowed is None else allowed & a
        if nonpad is not None:
            a = cols < xp.asarray(nonpad, np.int64).reshape(-1, 1, 1, 1)
            allowed = a if allowed is None else allowed & a
        if allowed is not None:
            structural = xp.where(allowed, work.type(0), neg)
            bias = structural if bias is None else bias + structural
        return bias


@register("Attention", versions=[23])
class Attention23(_Attention):
    pass


@register("Attention", versions=[24])
class Attention24(_Attention):
    has_nonpad = True


@register("Attention", versions=[25])
class Attention25(_Attention):
    has_nonpad = True
    has_window = True


# --------------------------------------------------------------------------------------------

@register("RotaryEmbedding", versions=[23])
class RotaryEmbedding(OpImpl):
    def setup(self):
        self.interleaved = bool(self.interleaved)
        self.rot_dim = int(self.rotary_embedding_dim or 0)

    def run(self, x, cos_cache, sin_cache, position_ids=None):
        xp = self.xp
        shape = x.shape
        if x.ndim == 4:
            xs = x  # (B, H, S, D); caches broadcast as (B, 1, S, d/2)
            head_axis = 1
        elif x.ndim == 3:
            if not self.num_heads:
                raise self.fail("3-D input needs the num_heads attribute")
            b, s, hidden = shape
            if hidden % self.num_heads:
                raise self.fail(f"hidden size {hidden} not divisible by {self.num_heads} heads")
            xs = x.reshape(b, s, self.num_heads, hidden // self.num_heads)  # (B, S, H, D)
            head_axis = 2
        else:
            raise self.fail(f"input must be 3-D or 4-D, got shape {shape}")
        head = xs.shape[-1]
        rot = self.rot_dim or head
        if rot > head or rot % 2:
            raise self.fail(f"rotary_embedding_dim {rot} invalid for head size {head}")
        half = rot // 2
        if position_ids is not None:
            limit = cos_cache.shape[0]
            # (checked on the host: a device array's min/max would cost a transfer each)
            if isinstance(position_ids, np.ndarray) and position_ids.size and (
                    int(position_ids.min()) < 0
                                      or int(position_ids.max()) >= limit):
                raise self.fail(f"position_ids must lie in [0, {limit}) (the caches' rows), "
                                f"got values in [{int(position_ids.min())}, "
                                f"{int(position_ids.max())}]")
            cos = xp.take(cos_cache, position_ids, axis=0)
            sin = xp.take(sin_cache, position_ids, axis=0)
        else:
            cos, sin = cos_cache, sin_cache
        if cos.shape[-1] != half or sin.shape[-1] != half:
            raise self.fail(f"cos/sin caches have last dimension {cos.shape[-1]}, "
                            f"expected {half}")
        work = work_dtype(x.dtype)
        cos = xp.expand_dims(cos.astype(work, copy=False), head_axis)  # (B, 1, S, h) / (B, S, 1, h)
        sin = xp.expand_dims(sin.astype(work, copy=False), head_axis)
        xw = xs.astype(work, copy=False)
        xr = xw[..., :rot]
        if self.interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        else:
            x1, x2 = xr[..., :half], xr[..., half:]
        real = cos * x1 - sin * x2
        imag = sin * x1 + cos * x2
        out = xp.empty(xw.shape, work)
        if self.interleaved:
            out[..., 0:rot:2] = real
            out[..., 1:rot:2] = imag
        else:
            out[..., :half] = real
            out[..., half:rot] = imag
        out[..., rot:] = xw[..., rot:]
        return out.reshape(shape).astype(x.dtype, copy=False)


# --------------------------------------------------------------------------------------------

@register("LinearAttention", versions=[27])
class LinearAttention(OpImpl):
    """Recurrent linear attention, run step by step over the sequence (vectorised over batch
    and heads). The state S has shape (B, H_kv, d_k, d_v)."""

    _RULES = ("linear", "gated", "delta", "gated_delta")

    def setup(self):
        rule = self.update_rule
        if isinstance(rule, bytes):
            rule = rule.decode()
        if rule not in self._RULES:
            raise self.fail(f"unknown update_rule '{rule}'")
        self.rule = rule
        self.gated = rule in ("gated", "gated_delta")
        self.delta = rule in ("delta", "gated_delta")
        if not self.q_num_heads or not self.kv_num_heads or self.q_num_heads % self.kv_num_heads:
            raise self.fail("q_num_heads must be a positive multiple of kv_num_heads")

    def run(self, query, key, value, past_state=None, decay=None, beta=None):
        xp = self.xp
        if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise self.fail("query, key and value must be 3-D (B, T, H*D)")
        b, t, qh_dk = query.shape
        hq, hkv = self.q_num_heads, self.kv_num_heads
        dk = qh_dk // hq
        dv = value.shape[2] // hkv
        if key.shape[2] != hkv * dk:
            raise self.fail(f"key hidden size {key.shape[2]} != kv_num_heads * d_k")
        if self.gated and decay is None:
            raise self.fail(f"update_rule '{self.rule}' needs the decay input")
        if self.delta and beta is None:
            raise self.fail(f"update_rule '{self.rule}' needs the beta input")
        work = np.float64 if query.dtype == np.float64 else np.float32
        group = hq // hkv
        q = query.astype(work).reshape(b, t, hkv, group, dk)
        k = key.astype(work).reshape(b, t, hkv, dk)
        v = value.astype(work).reshape(b, t, hkv, dv)
        if past_state is not None:
            state = past_state.astype(work)  # copy: never write into the input
        else:
            state = xp.zeros((b, hkv, dk, dv), work)
        if decay is not None:
            g = decay.astype(work)
            if g.shape[2] == hkv * dk:
                g = xp.exp(g.reshape(b, t, hkv, dk, 1))
            elif g.shape[2] == hkv:
                g = xp.exp(g.reshape(b, t, hkv, 1, 1))
            else:
                raise self.fail(f"decay last dimension {g.shape[2]} must be H_kv*d_k or H_kv")
        if beta is not None:
            bt = beta.astype(work)
            if bt.shape[2] not in (hkv, 1):
                raise self.fail(f"beta last dimension {bt.shape[2]} must be H_kv or 1")
            bt = bt.reshape(b, t, bt.shape[2], 1, 1)
        scale = float(self.scale or 0.0) or 1.0 / math.sqrt(dk)
        out = xp.empty((b, t, hkv, group, dv), work)
        for i in range(t):
            kt, vt = k[:, i], v[:, i]  # (B, Hkv, dk), (B, Hkv, dv)
            if self.gated:
                state = state * g[:, i]
            if self.delta:
                pred = xp.einsum("bhkv,bhk->bhv", state, kt)
                update = bt[:, i] * (kt[..., :, None] * (vt - pred)[..., None, :])
            else:
                update = kt[..., :, None] * vt[..., None, :]
            state = state + update
            out[:, i] = xp.einsum("bhgk,bhkv->bhgv", q[:, i], state)
        out *= work(scale)
        state_dtype = past_state.dtype if past_state is not None else query.dtype
        return (out.reshape(b, t, hq * dv).astype(query.dtype, copy=False),
                state.astype(state_dtype, copy=False))


# --------------------------------------------------------------------------------------------

@register("FlexAttention", versions=[1], domain="ai.onnx.preview")
class FlexAttention(OpImpl):
    """Scaled dot-product attention with optional score_mod / prob_mod subgraphs."""

    def setup(self):
        if self.softmax_precision is not None and self.softmax_precision not in (1, 10, 11, 16):
            raise self.fail(f"unsupported softmax_precision {self.softmax_precision}")

    def _modify(self, graph, value, scope):
        xp = self.xp
        if graph is None:
            return value
        out = graph.run([value], scope)
        if len(out) != 1:
            raise self.fail("a modifier subgraph must produce exactly one output")
        result = xp.asarray(out[0])
        if result.shape != value.shape:
            result = xp.broadcast_to(result, value.shape)
        return result.astype(value.dtype, copy=False)

    def run(self, Q, K, V, scope=None):
        xp = self.xp
        if Q.ndim != 4 or K.ndim != 4 or V.ndim != 4:
            raise self.fail("Q, K and V must be rank-4 tensors")
        batch, q_heads, q_len, head = Q.shape
        kv_heads = K.shape[1]
        if kv_heads == 0 or q_heads % kv_heads:
            raise self.fail(f"q heads {q_heads} not a multiple of kv heads {kv_heads}")
        if self.softmax_precision is not None:
            sdt = _precision_dtype(self.softmax_precision)
        else:
            sdt = np.dtype(np.float64 if Q.dtype == np.float64 else np.float32)
        work = np.dtype(np.float64 if Q.dtype == np.float64 or sdt == np.float64 else np.float32)
        q = Q.astype(work, copy=False)
        k = K.astype(work, copy=False)
        v = V.astype(work, copy=False)
        group = q_heads // kv_heads
        if group > 1:
            k = xp.repeat(k, group, axis=1)
            v = xp.repeat(v, group, axis=1)
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(head)
        scores = _blas.product(xp, q, xp.swapaxes(k, -1, -2)) * work.type(scale)
        scores = self._modify(self.score_mod, scores.astype(sdt, copy=False), scope)
        probs = _masked_softmax(xp, scores.astype(np.float32) if is_narrow_float(sdt)
                                else scores)
        probs = self._modify(self.prob_mod, probs.astype(sdt, copy=False), scope)
        y = _blas.product(xp, probs.astype(work, copy=False), v)
        return y.astype(Q.dtype, copy=False)

"""com.microsoft attention contrib ops, with onnxruntime's semantics: Attention (packed QKV
projection), MultiHeadAttention, GroupQueryAttention, RotaryEmbedding and BiasSoftmax.

These are the ops onnxruntime's transformer optimizer fuses BERT/GPT-style subgraphs into. All
attention runs as batched matmuls over (batch, heads) in float32 (float64 for float64 inputs):
narrow floats (float16, bfloat16) are widened once and the outputs rounded once at the end.

Where onnxruntime's documentation is silent its CPU kernels' measured behaviour is followed:
- Attention / MultiHeadAttention: a padding mask adds `mask_filter_value` (default -10000) to
  the scaled scores of masked keys (so a fully masked row is a softmax over the raw scores). The
  causal mask of `unidirectional` (key t hidden from query row s when t > past_length + s) puts
  the lowest float32 there instead, and, as in onnxruntime, only when the query has more than
  one token and never in the last query row: no difference in self-attention, where that row
  sees every key anyway, but in cross-attention with more keys than queries the last row sees
  them all. The qk output holds the scores the softmax reads: scaled QK' plus masks and
  attention_bias.
- GroupQueryAttention: the query at absolute position p = past_b + s of batch b sees keys
  [0, min(p + 1, seqlens_k[b] + 1)) (with causal=0: [0, seqlens_k[b] + 1)), limited to
  (p - local_window_size, p] when a window is set; a row with no key left (a padded prompt row
  beyond the window) gives zeros. A call is the first prompt when total_sequence_length equals
  the query length (the past, if any, is ignored then); otherwise past_b = seqlens_k[b] + 1 -
  sequence_length. Rotary positions are past_b + s, or the position_ids input; in a first
  prompt onnxruntime reads only position_ids[0, 0] and uses position_ids[0, 0] + s for every
  batch entry. softcap applies to the scaled scores before attention_bias; head_sink adds one
  logit per head to the softmax denominator (smooth_softmax adds a zero logit, and is ignored
  when head_sink is given). present_key/present_value hold max(past buffer length,
  total_sequence_length) positions: the past rows, the new rows at past_b, zeros after.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ember.ops import _xp
from ember.ops._dtypes import work_dtype
from ember.ops.cpu import blas as _blas
from ember.ops.linalg import CachedPack, float_matmul
from ember.ops.reduction import softmax
from ember.ops.registry import OpImpl, register

_DOMAIN = "com.microsoft"
# The causal mask value of onnxruntime's Attention and MultiHeadAttention CPU kernels.
_LOWEST = float(np.finfo(np.float32).min)


def _as_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _softmax(xp, scores, extra=None):
    """Softmax over the last axis of float `scores` (not modified). `extra`, when
    given, is one more logit per row (broadcastable to scores[..., :1]) that joins the
    denominator only. Rows with no finite score give zeros, not NaN."""
    if extra is None:   # Softmax's kernel: on the CPU, compiled rows on the run's threads
        return softmax(xp, scores, -1, empty_rows_zero=True)
    m = xp.max(scores, axis=-1, keepdims=True)
    if extra is not None:
        m = xp.maximum(m, extra)
    m = xp.where(xp.isfinite(m), m, scores.dtype.type(0))
    with np.errstate(invalid="ignore", over="ignore"):
        e = xp.exp(scores - m)
        total = xp.sum(e, axis=-1, keepdims=True)
        if extra is not None:
            total = total + xp.exp(extra - m)
        total = xp.where(total == 0, total.dtype.type(1), total)
    return e / total


def _heads(x, heads, what, fail):
    """(B, S, heads * H) -> (B, heads, S, H)."""
    b, s, hidden = x.shape
    if heads <= 0 or hidden % heads:
        raise fail(f"{what} hidden size {hidden} is not a multiple of {heads} heads")
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _merge_heads(y):
    """(B, N, S, H) -> (B, S, N * H)."""
    b, n, s, h = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, s, n * h)


def attention_scores(xp, q, k, scale):
    """scale * Q K' for q (B, N, S, H) and k (B, Nkv, T, H), N a multiple of Nkv: the query
    heads of one kv head fold into the row axis of one batched matmul (no K copy)."""
    b, n, s, h = q.shape
    nkv, t = k.shape[1], k.shape[2]
    qg = q.reshape(b, nkv, (n // nkv) * s, h)
    scores = _blas.product(xp, qg, xp.swapaxes(k, -1, -2)).reshape(b, n, s, t)
    scores *= scores.dtype.type(scale)
    return scores


def weighted_values(xp, probs, v):
    """probs (B, N, S, T) x v (B, Nkv, T, Hv) -> (B, N, S, Hv)."""
    b, n, s, t = probs.shape
    nkv = v.shape[1]
    y = _blas.product(xp, probs.reshape(b, nkv, (n // nkv) * s, t), v)
    return y.reshape(b, n, s, v.shape[-1])


def _rotate(xp, x, cos, sin, interleaved):
    """Rotary embedding of the first 2 * cos.shape[-1] features of x (..., S, H); cos and sin
    broadcast against x[..., :half]. Returns a fresh array in x's dtype."""
    half = cos.shape[-1]
    rot = 2 * half
    xr = x[..., :rot]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    out = xp.empty(x.shape, x.dtype)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        out[..., 0:rot:2] = real
        out[..., 1:rot:2] = imag
    else:
        out[..., :half] = real
        out[..., half:rot] = imag
    out[..., rot:] = x[..., rot:]
    return out


class _PaddedAttention(OpImpl):
    """What Attention and MultiHeadAttention share: the key padding mask formats, the causal
    mask and the masked softmax."""

    def setup(self):
        self.num_heads = int(self.num_heads or 0)
        if self.num_heads <= 0:
            raise self.fail("num_heads must be a positive integer")
        self.unidirectional = bool(self.unidirectional)
        self.mask_filter_value = float(self.mask_filter_value)
        self.scale = float(self.scale or 0.0)

    def mask_format(self, mask, batch, q_len, total, past, four_d):
        """Which of onnxruntime's key padding mask formats `mask` has, its shape checked (every
        kernel of the op reads it so): "ends" (B,) or "ends_starts" (2B,) of mask_index, "keys"
        (B, T), "queries_keys" (B, S, T), "positions" (Megatron's (B, 1, max, max), rows by
        absolute query position), or None for onnxruntime's dummy 4-D-model mask (B or 1, 1)."""
        shape = tuple(mask.shape)
        if mask.ndim == 1:
            n = shape[0]
            if n == 3 * batch + 2:
                raise self.fail("key mask of shape (3 * batch_size + 2) (cumulated sequence "
                                "lengths) is not supported")
            if n not in (batch, 2 * batch):
                raise self.fail(f"1-D mask must have batch_size ({batch}) or 2 * batch_size "
                                f"elements, got {n}")
            return "ends" if n == batch else "ends_starts"
        if mask.ndim == 2:
            if shape == (batch, total):
                return "keys"
            if four_d and shape[1] == 1 and shape[0] in (1, batch):
                return None  # onnxruntime's dummy mask: no masking
            raise self.fail(f"2-D mask must have shape (batch_size, total_sequence_length)"
                            f" = {(batch, total)}, got {shape}")
        if mask.ndim == 3:
            if shape != (batch, q_len, total):
                raise self.fail(f"3-D mask must have shape (batch_size, sequence_length, "
                                f"total_sequence_length) = {(batch, q_len, total)}, got {shape}")
            return "queries_keys"
        if mask.ndim == 4 and four_d:
            if (shape[0] != batch or shape[1] != 1 or shape[2] < past + q_len
                    or shape[3] < total):
                raise self.fail(f"4-D mask must have shape (batch_size, 1, max_sequence_length,"
                                f" max_sequence_length) covering {past + q_len} query and "
                                f"{total} key positions, got {shape}")
            return "positions"
        raise self.fail(f"unsupported mask shape {shape}")

    def _key_mask(self, mask, batch, q_len, total, past, work, four_d):
        """The padding mask as an additive bias broadcastable to (B, 1, S, T), or None."""
        xp = self.xp
        form = self.mask_format(mask, batch, q_len, total, past, four_d)
        if form is None:
            return None
        cols = xp.arange(total)
        if form in ("ends", "ends_starts"):
            if int(_xp.to_host(xp, mask).min(initial=0)) < 0:
                raise self.fail("mask_index values must be non-negative")
            ends = mask[:batch].astype(np.int64).reshape(batch, 1)
            keep = cols.reshape(1, total) < ends
            if form == "ends_starts":
                starts = mask[batch:].astype(np.int64).reshape(batch, 1)
                keep &= cols.reshape(1, total) >= starts
            keep = keep.reshape(batch, 1, 1, total)
        elif form == "keys":
            keep = (mask > 0).reshape(batch, 1, 1, total)
        elif form == "queries_keys":
            keep = (mask > 0).reshape(batch, 1, q_len, total)
        else:
            keep = mask[:, :, past:past + q_len, :total] > 0
        return xp.where(keep, work.type(0), work.type(self.mask_filter_value))

    def _bias(self, mask, attention_bias, batch, q_len, total, past, work, four_d=False):
        """Padding mask, causal mask and attention_bias as one additive bias broadcastable to
        (B, N, S, T), or None."""
        xp = self.xp
        bias = None
        if mask is not None:
            bias = self._key_mask(mask, batch, q_len, total, past, work, four_d)
        if self.unidirectional and q_len > 1:
            rows = xp.arange(q_len).reshape(q_len, 1)
            future = xp.arange(total).reshape(1, total) > rows + past
            future &= rows < q_len - 1  # onnxruntime leaves the last row unmasked
            base = bias if bias is not None else work.type(0)
            bias = xp.where(future, work.type(_LOWEST), base)
        if attention_bias is not None:
            ab = attention_bias
            if (ab.ndim != 4 or ab.shape[0] not in (1, batch) or ab.shape[1] not in
                    (1, self.num_heads) or tuple(ab.shape[2:]) != (q_len, total)):
                raise self.fail(f"attention_bias must have shape (batch_size or 1, num_heads "
                                f"or 1, {q_len}, {total}), got {tuple(ab.shape)}")
            ab = ab.astype(work, copy=False)
            bias = ab if bias is None else bias + ab
        return bias

    def _attend(self, q, k, v, bias):
        """softmax(scale * Q K' + bias) V for BNSH q, k, v; also the pre-softmax scores."""
        scale = self.scale or 1.0 / math.sqrt(q.shape[-1])
        scores = attention_scores(self.xp, q, k, scale)
        if bias is not None:
            scores += bias
        probs = _softmax(self.xp, scores)
        return weighted_values(self.xp, probs, v), scores


@register("Attention", versions=[1], domain=_DOMAIN)
class Attention(_PaddedAttention):
    """Self-attention with one packed input projection: input (B, S, D_in) x weights
    (D_in, D_q + D_k + D_v) + bias; past (2, B, N, P, H) -> present (2, B, N, P + S, H)."""

    defaults = {"num_heads": 0, "unidirectional": 0, "mask_filter_value": -10000.0,
                "scale": 0.0, "qkv_hidden_sizes": None, "past_present_share_buffer": 0,
                "do_rotary": 0, "rotary_embedding_dim": 0}

    def setup(self):
        super().setup()
        if int(self.do_rotary or 0):
            raise self.fail("do_rotary is not supported (onnxruntime's CPU kernel refuses it "
                            "too)")
        sizes = self.qkv_hidden_sizes
        if sizes is not None:
            sizes = [int(s) for s in sizes]
            if len(sizes) != 3 or any(s <= 0 or s % self.num_heads for s in sizes):
                raise self.fail(f"qkv_hidden_sizes must be 3 positive multiples of num_heads, "
                                f"got {sizes}")
            if sizes[0] != sizes[1]:
                raise self.fail(f"Q and K hidden sizes differ: {sizes}")
        self.sizes = sizes
        self.share_buffer = bool(self.past_present_share_buffer)
        self._packed = CachedPack()  # the constant projection weight, packed for the CPU

    def packed_sizes(self, x, weights, bias, past) -> tuple[int, int, int]:
        """The Q, K and V widths of the packed weights, after checking the inputs' shapes
        against them (shared by the device kernels)."""
        if x.ndim != 3 or weights.ndim != 2 or weights.shape[0] != x.shape[2]:
            raise self.fail(f"input (batch, sequence, hidden) {tuple(x.shape)} and weights "
                            f"(hidden, q + k + v hidden) {tuple(weights.shape)} do not match")
        width = weights.shape[1]
        if self.sizes is None:
            if width % 3:
                raise self.fail(f"weights width {width} is not divisible by 3 (give "
                                f"qkv_hidden_sizes)")
            dq = dk = dv = width // 3
        else:
            dq, dk, dv = self.sizes
            if dq + dk + dv != width:
                raise self.fail(f"qkv_hidden_sizes {self.sizes} do not sum to the weights "
                                f"width {width}")
        if bias is not None and tuple(bias.shape) != (width,):
            raise self.fail(f"bias must have shape ({width},), got {tuple(bias.shape)}")
        if self.share_buffer and past is not None:
            raise self.fail("past_present_share_buffer with a past state is not supported")
        return dq, dk, dv

    def run(self, x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
            past_sequence_length=None):
        xp = self.xp
        dq, dk, dv = self.packed_sizes(x, weights, bias, past)
        n = self.num_heads
        for size in (dq, dv):
            if size % n:
                raise self.fail(f"hidden size {size} is not a multiple of {n} heads")
        out_dtype = x.dtype
        work = work_dtype(out_dtype)
        batch, q_len, _ = x.shape
        # the projection as MatMul's: on the CPU engine's threads, a constant weight packed
        # once (np.matmul runs on one thread during a run: BLAS then keeps one)
        constant = 1 in self.constant_inputs and weights.dtype == work
        qkv = float_matmul(xp, x.astype(work, copy=False), weights.astype(work, copy=False),
                           self._packed if constant else None)
        if bias is not None:
            qkv += bias.astype(work, copy=False)
        q = _heads(qkv[..., :dq], n, "Q", self.fail)
        k = _heads(qkv[..., dq:dq + dk], n, "K", self.fail)
        v = _heads(qkv[..., dq + dk:], n, "V", self.fail)
        past_len = 0
        if past is not None:
            want = (2, batch, n)
            if past.ndim != 5 or tuple(past.shape[:3]) != want or past.shape[4] != k.shape[3]:
                raise self.fail(f"past must have shape (2, {batch}, {n}, past_length, "
                                f"{k.shape[3]}), got {tuple(past.shape)}")
            if dk != dv:
                raise self.fail("a past state needs equal K and V hidden sizes")
            past_len = past.shape[3]
            pw = past.astype(work, copy=False)
            k = xp.concatenate([pw[0], k], axis=2)
            v = xp.concatenate([pw[1], v], axis=2)
        total = past_len + q_len
        bias_all = self._bias(mask_index, attention_bias, batch, q_len, total, past_len, work,
                              four_d=True)
        y, _ = self._attend(q, k, v, bias_all)
        y = _merge_heads(y).astype(out_dtype, copy=False)
        if self.n_outputs < 2:
            return y
        if dk != dv:
            raise self.fail("the present output needs equal K and V hidden sizes")
        present = xp.stack([k, v]).astype(out_dtype, copy=False)
        return y, present


def shapes_of(*arrays) -> list:
    """The shapes of `arrays` as tuples of ints (None for an omitted input)."""
    return [None if a is None else tuple(int(d) for d in a.shape) for a in arrays]


class MhaLayout(NamedTuple):
    """The query / key / value layout of one MultiHeadAttention call, checked
    (MultiHeadAttention.kv_layout): `form` is "packed_qkv" (query (B, S, N, 3, H), no key or
    value), "packed_kv" (key (B, L, N, 2, H), no value), "separate" (key and value (B, L, D))
    or "split_heads" (key and value (B, N, L, H), used as they are: no bias, no past); `dims`
    the hidden sizes (dq, dk, dv), `heads` the head sizes (dims // num_heads)."""
    form: str
    batch: int
    q_len: int
    kv_len: int  # the key rows of this call, past excluded
    past_len: int
    dims: tuple[int, int, int]
    heads: tuple[int, int, int]

    @property
    def total(self) -> int:
        return self.past_len + self.kv_len


@register("MultiHeadAttention", versions=[1], domain=_DOMAIN)
class MultiHeadAttention(_PaddedAttention):
    """Self/cross attention on projected inputs: query (B, S, D) or packed QKV (B, S, N, 3, H);
    key/value (B, L, D) (plus bias), packed KV (B, L, N, 2, H), or already split heads
    (B, N, L, H) (no bias, no past); past_key/past_value (B, N, P, H) -> present (B, N, P+L, H)."""

    defaults = {"num_heads": 0, "unidirectional": 0, "mask_filter_value": -10000.0,
                "scale": 0.0}

    # Checks every kernel of the op makes (the CPU's below, OpenCL's subclass), written once.

    def refuse_unsupported(self, past_sequence_length, cache_indirection, past_key, past_value):
        if past_sequence_length is not None or cache_indirection is not None:
            raise self.fail("past_sequence_length / cache_indirection (buffer sharing, beam "
                            "search) are not supported")
        if (past_key is None) != (past_value is None):
            raise self.fail("past_key and past_value must be given together")

    def kv_layout(self, query, key, value, bias=None, past_key=None,
                  past_value=None) -> MhaLayout:
        """The layout of the inputs whose shapes (tuples of ints, None when omitted: see
        `shapes_of`) are given, checked: query, then key / value, head sizes, bias, past."""
        n = self.num_heads
        if len(query) == 5:
            if key is not None or value is not None:
                raise self.fail("packed QKV query (B, S, N, 3, H) takes no key or value")
            if query[2] != n or query[3] != 3:
                raise self.fail(f"packed QKV must have shape (B, S, {n}, 3, H), got {query}")
            batch, q_len, _, _, head = query
            form, kv_len, dq, dk, dv = "packed_qkv", q_len, n * head, n * head, n * head
        elif len(query) == 3:
            batch, q_len, dq = query
            self._check_hidden("query", dq)
            if key is None:
                raise self.fail("key is required unless the query is packed QKV")
            form, kv_len, dk, dv = self._key_layout(query, key, value, past_key)
        else:
            raise self.fail(f"query must be 3-D or 5-D (packed QKV), got shape {query}")
        hq, hk, hv = dq // n, dk // n, dv // n
        if hq != hk:
            raise self.fail(f"query head size {hq} differs from key head size {hk}")
        if bias is not None and bias != (dq + dk + dv,):
            raise self.fail(f"bias must have shape ({dq + dk + dv},), got {bias}")
        past_len = 0
        if past_key is not None:
            if (len(past_key) != 4 or past_key[:2] != (batch, n) or past_key[3] != hk
                    or len(past_value) != 4 or past_value[:3] != past_key[:3]
                    or past_value[3] != hv):
                raise self.fail(f"past_key {past_key} / past_value {past_value} must be "
                                f"({batch}, {n}, P, H)")
            past_len = past_key[2]
        return MhaLayout(form, batch, q_len, kv_len, past_len, (dq, dk, dv), (hq, hk, hv))

    def _check_hidden(self, what, size):
        n = self.num_heads
        if n <= 0 or size % n:
            raise self.fail(f"{what} hidden size {size} is not a multiple of {n} heads")

    def _key_layout(self, query, key, value, past_key) -> tuple[str, int, int, int]:
        """(form, kv_len, dk, dv) of the key and value shapes beside a 3-D query shape."""
        n = self.num_heads
        batch = query[0]
        if len(key) == 5:
            if value is not None:
                raise self.fail("packed KV key (B, L, N, 2, H) takes no value")
            if key[0] != batch or key[2] != n or key[3] != 2:
                raise self.fail(f"packed KV must have shape ({batch}, L, {n}, 2, H), got {key}")
            return "packed_kv", key[1], n * key[4], n * key[4]
        if len(key) == 3:
            if value is None or len(value) != 3:
                raise self.fail("a 3-D key needs a 3-D value")
            if key[0] != batch or value[:2] != key[:2]:
                raise self.fail(f"key {key} and value {value} do not match the query {query}")
            self._check_hidden("key", key[2])
            self._check_hidden("value", value[2])
            return "separate", key[1], key[2], value[2]
        if len(key) == 4:
            if value is None or len(value) != 4:
                raise self.fail("a 4-D key (B, N, L, H) needs a 4-D value")
            if key[:2] != (batch, n) or value[:3] != key[:3]:
                raise self.fail(f"4-D key {key} / value {value} must be ({batch}, {n}, L, H)")
            if past_key is not None:
                raise self.fail("past_key/past_value cannot be used with a 4-D key")
            return "split_heads", key[2], n * key[3], n * value[3]
        raise self.fail(f"key must be 3-D, 4-D or 5-D, got shape {key}")

    def run(self, query, key=None, value=None, bias=None, key_padding_mask=None,
            attention_bias=None, past_key=None, past_value=None, past_sequence_length=None,
            cache_indirection=None):
        xp = self.xp
        self.refuse_unsupported(past_sequence_length, cache_indirection, past_key, past_value)
        lay = self.kv_layout(*shapes_of(query, key, value, bias, past_key, past_value))
        out_dtype = query.dtype
        work = work_dtype(out_dtype)
        q, k, v = self._split_heads(lay, query, key, value, work)
        if bias is not None:
            dq, dk, _ = lay.dims
            n = self.num_heads
            bw = bias.astype(work, copy=False)
            q = q + bw[:dq].reshape(n, 1, -1)
            if lay.form != "split_heads":
                k = k + bw[dq:dq + dk].reshape(n, 1, -1)
                v = v + bw[dq + dk:].reshape(n, 1, -1)
        if past_key is not None:
            k = xp.concatenate([past_key.astype(work, copy=False), k], axis=2)
            v = xp.concatenate([past_value.astype(work, copy=False), v], axis=2)
        bias_all = self._bias(key_padding_mask, attention_bias, lay.batch, lay.q_len, lay.total,
                              lay.past_len, work)
        y, scores = self._attend(q, k, v, bias_all)
        results = [_merge_heads(y).astype(out_dtype, copy=False)]
        if self.n_outputs > 1:
            results += [k.astype(out_dtype, copy=False), v.astype(out_dtype, copy=False)]
        if self.n_outputs > 3:
            results.append(scores.astype(out_dtype, copy=False))
        return tuple(results) if len(results) > 1 else results[0]

    def _split_heads(self, lay, query, key, value, work):
        """Q, K, V as (B, N, rows, H) arrays in the work dtype from their layout `lay`."""
        n = self.num_heads
        qw = query.astype(work, copy=False)
        if lay.form == "packed_qkv":
            return tuple(qw[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
        q = _heads(qw, n, "query", self.fail)
        kw = key.astype(work, copy=False)
        if lay.form == "packed_kv":
            return q, kw[:, :, :, 0].transpose(0, 2, 1, 3), kw[:, :, :, 1].transpose(0, 2, 1, 3)
        vw = value.astype(work, copy=False)
        if lay.form == "split_heads":
            return q, kw, vw
        return q, _heads(kw, n, "key", self.fail), _heads(vw, n, "value", self.fail)


@register("GroupQueryAttention", versions=[1], domain=_DOMAIN)
class GroupQueryAttention(OpImpl):
    """Grouped-query attention (causal unless causal=0: then every cached key of the batch
    entry is visible) with a KV cache in BNSH layout (see the module docstring for the
    position rules)."""

    defaults = {"num_heads": 0, "kv_num_heads": 0, "scale": 0.0, "softcap": 0.0,
                "local_window_size": -1, "do_rotary": 0, "rotary_interleaved": 0,
                "smooth_softmax": -1, "qk_output": 0, "causal": 1, "sliding_window_cache": 0,
                "k_quant_type": "NONE", "v_quant_type": "NONE", "kv_cache_bit_width": 0,
                "qk_norm_epsilon": 1e-6, "q_norm_epsilon": None, "k_norm_epsilon": None}
    # total_sequence_length sets the present outputs' length: shape data, kept on the host.
    shape_inputs = (6,)

    def setup(self):
        self.num_heads = int(self.num_heads or 0)
        self.kv_num_heads = int(self.kv_num_heads or 0)
        if self.num_heads <= 0 or self.kv_num_heads <= 0 or self.num_heads % self.kv_num_heads:
            raise self.fail(f"num_heads ({self.num_heads}) must be a positive multiple of "
                            f"kv_num_heads ({self.kv_num_heads})")
        self.causal = int(self.causal)
        if self.causal not in (0, 1):
            raise self.fail(f"causal must be 0 or 1, got {self.causal}")
        if int(self.sliding_window_cache or 0):
            raise self.fail("sliding_window_cache (window-sized KV buffers) is not supported")
        for name in ("k_quant_type", "v_quant_type"):
            if _as_str(getattr(self, name)).upper() != "NONE":
                raise self.fail(f"a quantized KV cache ({name}) is not supported")
        self.scale = float(self.scale or 0.0)
        self.softcap = float(self.softcap or 0.0)
        if self.softcap < 0:
            raise self.fail(f"softcap must be non-negative, got {self.softcap}")
        self.window = int(self.local_window_size)
        if not self.causal and self.window != -1:
            raise self.fail("local_window_size must be -1 when causal is 0")
        self.do_rotary = bool(self.do_rotary)
        self.interleaved = bool(self.rotary_interleaved)
        self.smooth = int(self.smooth_softmax) == 1
        self.qk_mode = int(self.qk_output or 0)
        if self.qk_mode not in (0, 1, 2):
            raise self.fail(f"qk_output must be 0, 1 or 2, got {self.qk_mode}")

    # Checks every kernel of the op makes (the CPU's below, OpenCL's subclass), written once.

    def refuse_unsupported(self, k_scale, v_scale, q_norm_weight, k_norm_weight, query_seqlens):
        for name, given in (("k_scale/v_scale", k_scale is not None or v_scale is not None),
                            ("q_norm_weight/k_norm_weight",
                             q_norm_weight is not None or k_norm_weight is not None),
                            ("query_seqlens", query_seqlens is not None)):
            if given:
                raise self.fail(f"the {name} input is not supported")

    def check_required(self, seqlens_k, total_sequence_length, past_key, past_value):
        if seqlens_k is None or total_sequence_length is None:
            raise self.fail("seqlens_k and total_sequence_length are required")
        if (past_key is None) != (past_value is None):
            raise self.fail("past_key and past_value must be given together")

    def step_lengths(self, seqlens_k, total_sequence_length, past_key, past_value, batch: int,
                     q_len: int, head: int):
        """(total, kv_total (B,), first_prompt, past_lens (B,), past_buf, present_len) of this
        step, checked: seqlens_k (host) + 1 keys for each batch entry, within
        total_sequence_length and the past buffers' length."""
        total = int(np.asarray(total_sequence_length).reshape(-1)[0])
        seqlens = np.asarray(seqlens_k).astype(np.int64).reshape(-1)
        if seqlens.shape[0] != batch:
            raise self.fail(f"seqlens_k must have {batch} elements, got {seqlens.shape[0]}")
        kv_total = seqlens + 1  # keys each batch entry sees after this step
        first_prompt = q_len == total
        past_lens = np.zeros(batch, np.int64) if first_prompt else kv_total - q_len
        past_buf = past_key.shape[2] if past_key is not None else 0
        nkv = self.kv_num_heads
        if past_key is not None:
            if (past_key.ndim != 4 or tuple(past_key.shape[:2]) != (batch, nkv)
                    or past_key.shape[3] != head or tuple(past_value.shape) !=
                    tuple(past_key.shape)):
                raise self.fail(f"past_key {tuple(past_key.shape)} / past_value "
                                f"{tuple(past_value.shape)} must be ({batch}, {nkv}, P, {head})")
        if (kv_total < 1).any() or (kv_total > total).any():
            raise self.fail(f"seqlens_k + 1 must lie in [1, total_sequence_length={total}], got "
                            f"{kv_total.tolist()}")
        if (past_lens < 0).any() or (past_lens > past_buf).any():
            raise self.fail(f"seqlens_k {seqlens.tolist()} do not fit sequence_length {q_len} and "
                            f"a past of {past_buf} positions")
        return total, kv_total, first_prompt, past_lens, past_buf, max(past_buf, total)

    def check_rotary_caches(self, cos_cache, sin_cache, head: int):
        if cos_cache is None or sin_cache is None:
            raise self.fail("do_rotary needs cos_cache and sin_cache")
        half = cos_cache.shape[-1]
        if cos_cache.ndim != 2 or tuple(sin_cache.shape) != tuple(cos_cache.shape) \
                or 2 * half > head:
            raise self.fail(f"cos_cache/sin_cache must be (max_sequence_length, <= "
                            f"{head // 2}), got {tuple(cos_cache.shape)}")

    def run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
            total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
            attention_bias=None, head_sink=None, k_scale=None, v_scale=None, q_norm_weight=None,
            k_norm_weight=None, query_seqlens=None):
        xp = self.xp
        self.refuse_unsupported(k_scale, v_scale, q_norm_weight, k_norm_weight, query_seqlens)
        self.check_required(seqlens_k, total_sequence_length, past_key, past_value)
        n = self.num_heads
        out_dtype = query.dtype
        work = work_dtype(out_dtype)
        if query.ndim != 3:
            raise self.fail(f"query must be 3-D, got shape {tuple(query.shape)}")
        batch, q_len, _ = query.shape
        q, k, v = self._split_qkv(query, key, value, work)
        head = q.shape[-1]

        total, kv_total, first_prompt, past_lens, past_buf, present_len = self.step_lengths(
            _xp.to_host(xp, seqlens_k), total_sequence_length, past_key, past_value, batch,
            q_len, head)
        past_d = xp.asarray(past_lens)  # (B,) on the device
        if self.do_rotary:
            q, k = self._rotate_qk(q, k, cos_cache, sin_cache, position_ids, past_d,
                                   first_prompt, work)
        k_all, v_all = self._presents(k, v, past_key, past_value, past_d, past_buf,
                                      present_len, work)

        # attention over the first `total` positions
        scores, qk_out = self._masked_scores(q, k_all[:, :, :total], attention_bias, past_d,
                                             kv_total, work)
        zero = work.type(0)
        extra = None
        if head_sink is not None:
            if tuple(head_sink.shape) != (n,):
                raise self.fail(f"head_sink must have shape ({n},), got {tuple(head_sink.shape)}")
            extra = head_sink.astype(work, copy=False).reshape(1, n, 1, 1)
        elif self.smooth:
            extra = zero
        probs = _softmax(xp, scores, extra)
        if self.qk_mode == 2:
            qk_out = probs
        y = weighted_values(xp, probs, v_all[:, :, :total])
        results = (_merge_heads(y).astype(out_dtype, copy=False),
                   k_all.astype(out_dtype, copy=False), v_all.astype(out_dtype, copy=False))
        if self.n_outputs > 3:
            if qk_out is None:
                raise self.fail("the output_qk output needs qk_output=1 or 2")
            results += (qk_out.astype(out_dtype, copy=False),)
        return results[:max(self.n_outputs, 1)]

    def _split_qkv(self, query, key, value, work):
        """Q (B, N, S, H), K and V (B, Nkv, S, H) in `work` from the 3-D query (packed QKV
        without key and value) or key and value, checked to share one head size."""
        n, nkv = self.num_heads, self.kv_num_heads
        batch, q_len, width = query.shape
        qw = query.astype(work, copy=False)
        if key is None and value is None:  # packed QKV
            if width % (n + 2 * nkv):
                raise self.fail(f"packed QKV width {width} is not a multiple of num_heads + "
                                f"2 * kv_num_heads = {n + 2 * nkv}")
            head = width // (n + 2 * nkv)
            q = _heads(qw[..., :n * head], n, "query", self.fail)
            k = _heads(qw[..., n * head:(n + nkv) * head], nkv, "key", self.fail)
            v = _heads(qw[..., (n + nkv) * head:], nkv, "value", self.fail)
        elif key is not None and value is not None:
            if key.ndim != 3 or value.ndim != 3 or key.shape[:2] != (batch, q_len) \
                    or value.shape[:2] != (batch, q_len):
                raise self.fail(f"key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                                f"({batch}, {q_len}, kv_hidden)")
            q = _heads(qw, n, "query", self.fail)
            k = _heads(key.astype(work, copy=False), nkv, "key", self.fail)
            v = _heads(value.astype(work, copy=False), nkv, "value", self.fail)
        else:
            raise self.fail("key and value must be given together (or neither, packed QKV)")
        head = q.shape[-1]
        if k.shape[-1] != head or v.shape[-1] != head:
            raise self.fail("query, key and value head sizes differ")
        return q, k, v

    def rotary_positions(self, xp, position_ids, past, first_prompt, batch, q_len):
        """Each query token's absolute position (B or 1, S), int64: past (B,) + its index, or
        position_ids ((B, S), or on a first prompt only its first entry, as the offset)."""
        steps = xp.arange(q_len, dtype=np.int64).reshape(1, q_len)
        if position_ids is None:
            return past.reshape(batch, 1) + steps
        if first_prompt:
            return position_ids.reshape(-1)[:1].astype(np.int64).reshape(1, 1) + steps
        if tuple(position_ids.shape) != (batch, q_len):
            raise self.fail(f"position_ids must have shape ({batch}, {q_len}), got "
                            f"{tuple(position_ids.shape)}")
        return position_ids.astype(np.int64)

    def _rotate_qk(self, q, k, cos_cache, sin_cache, position_ids, past_d, first_prompt, work):
        """q and k rotated at their absolute positions: past_d (B,) + step, or position_ids
        ((B, S), or only its first entry as the offset of a first prompt)."""
        xp = self.xp
        batch, _, q_len, head = q.shape
        self.check_rotary_caches(cos_cache, sin_cache, head)
        pos = self.rotary_positions(xp, position_ids, past_d, first_prompt, batch, q_len)
        self._check_positions(pos, cos_cache.shape[0])
        cos = xp.take(cos_cache.astype(work, copy=False), pos, axis=0)[:, None]
        sin = xp.take(sin_cache.astype(work, copy=False), pos, axis=0)[:, None]
        return _rotate(xp, q, cos, sin, self.interleaved), _rotate(xp, k, cos, sin,
                                                                   self.interleaved)

    def _presents(self, k, v, past_key, past_value, past_d, past_buf, present_len, work):
        """The present K and V (B, Nkv, present_len, H): per batch entry its past rows
        [0, past_b), this step's rows at [past_b, past_b + S), zeros after."""
        xp = self.xp
        batch, _, q_len, _ = k.shape
        slots = xp.arange(present_len, dtype=np.int64).reshape(1, present_len)
        rel = slots - past_d.reshape(batch, 1)  # (B, T_present): row index into the new K/V
        new_rows = ((rel >= 0) & (rel < q_len)).reshape(batch, 1, present_len, 1)
        old_rows = (rel < 0).reshape(batch, 1, present_len, 1)
        index = xp.clip(rel, 0, q_len - 1).reshape(batch, 1, present_len, 1)
        zero = work.type(0)

        def cache(new, past):
            rows = xp.take_along_axis(new, index, axis=2)
            out = xp.where(new_rows, rows, zero)
            if past is not None and past_buf:
                old = past.astype(work, copy=False)
                if past_buf < present_len:
                    old = xp.pad(old, [(0, 0), (0, 0), (0, present_len - past_buf), (0, 0)])
                out = xp.where(old_rows, old, out)
            return out

        return cache(k, past_key), cache(v, past_value)

    def _masked_scores(self, q, keys, attention_bias, past_d, kv_total, work):
        """(scores, qk_out) of q against keys (B, Nkv, total, H): scaled, softcapped, plus the
        attention bias, -inf outside each entry's keys and the causal / local window limits;
        qk_out is the scores with those masked as 0 when qk_output == 1, else None."""
        xp = self.xp
        batch, n, q_len, head = q.shape
        total = keys.shape[2]
        scale = self.scale or 1.0 / math.sqrt(head)
        scores = attention_scores(xp, q, keys, scale)
        if self.softcap > 0:
            cap = work.type(self.softcap)
            scores = xp.tanh(scores / cap) * cap
        if attention_bias is not None:
            ab = attention_bias
            if (ab.ndim != 4 or ab.shape[0] not in (1, batch) or ab.shape[1] not in (1, n)
                    or tuple(ab.shape[2:]) != (q_len, total)):
                raise self.fail(f"attention_bias must have shape (batch_size or 1, num_heads or "
                                f"1, {q_len}, {total}), got {tuple(ab.shape)}")
            scores += ab.astype(work, copy=False)
        rows = past_d.reshape(batch, 1, 1) + xp.arange(q_len, dtype=np.int64).reshape(1, q_len, 1)
        cols = xp.arange(total, dtype=np.int64).reshape(1, 1, total)
        allowed = cols < xp.asarray(kv_total).reshape(batch, 1, 1)
        if self.causal:
            allowed = allowed & (cols <= rows)
        if self.window > 0:
            allowed &= cols > rows - self.window
        allowed = allowed[:, None]  # (B, 1, S or 1, T)
        qk_out = xp.where(allowed, scores, work.type(0)) if self.qk_mode == 1 else None
        return xp.where(allowed, scores, work.type(-np.inf)), qk_out


    def _check_positions(self, pos, limit):
        host = _xp.to_host(self.xp, pos)
        if host.size and (host.min() < 0 or host.max() >= limit):
            raise self.fail(f"rotary positions must lie in [0, {limit}) (the cos/sin cache "
                            f"length), got [{host.min()}, {host.max()}]")


@register("RotaryEmbedding", versions=[1], domain=_DOMAIN)
class RotaryEmbedding(OpImpl):
    """com.microsoft RotaryEmbedding: input (B, S, D) or (B, N, S, H), position_ids (1,) (an
    offset) or (B, S), caches (max_sequence_length, rotary_dim / 2). Without num_heads the head
    size is the rotary dimension. is_packed_batching changes nothing for these layouts."""

    defaults = {"num_heads": 0, "rotary_embedding_dim": 0, "interleaved": 0,
                "is_packed_batching": 0, "scale": 1.0}

    def setup(self):
        self.num_heads = int(self.num_heads or 0)
        self.rot_dim = int(self.rotary_embedding_dim or 0)
        self.interleaved = bool(self.interleaved)
        if self.rot_dim and not self.num_heads:
            raise self.fail("rotary_embedding_dim needs the num_heads attribute")
        if self.rot_dim % 2 or self.rot_dim < 0 or self.num_heads < 0:
            raise self.fail(f"invalid rotary_embedding_dim {self.rot_dim} / num_heads "
                            f"{self.num_heads}")

    def run(self, x, position_ids, cos_cache, sin_cache):
        xp = self.xp
        if cos_cache.ndim != 2 or tuple(sin_cache.shape) != tuple(cos_cache.shape):
            raise self.fail(f"cos_cache and sin_cache must be equal 2-D shapes, got "
                            f"{tuple(cos_cache.shape)} / {tuple(sin_cache.shape)}")
        half = cos_cache.shape[1]
        rot = self.rot_dim or 2 * half
        if rot != 2 * half:
            raise self.fail(f"cos_cache last dimension {half} != rotary_embedding_dim / 2")
        if x.ndim == 4:
            batch, heads, seq, head = x.shape
            xs = x  # (B, N, S, H)
        elif x.ndim == 3:
            batch, seq, hidden = x.shape
            head = hidden // self.num_heads if self.num_heads else rot
            if head == 0 or hidden % head:
                raise self.fail(f"hidden size {hidden} is not a multiple of the head size {head}")
            xs = x.reshape(batch, seq, hidden // head, head).transpose(0, 2, 1, 3)
        else:
            raise self.fail(f"input must be 3-D or 4-D, got shape {tuple(x.shape)}")
        if rot > head:
            raise self.fail(f"rotary dimension {rot} exceeds the head size {head}")
        if position_ids.size == 1:
            pos = (position_ids.reshape(1, 1).astype(np.int64)
                   + xp.arange(seq, dtype=np.int64).reshape(1, seq))
        elif tuple(position_ids.shape) == (batch, seq):
            pos = position_ids.astype(np.int64)
        else:
            raise self.fail(f"position_ids must have shape (1,) or ({batch}, {seq}), got "
                            f"{tuple(position_ids.shape)}")
        host = _xp.to_host(xp, pos)
        if host.size and (host.min() < 0 or host.max() >= cos_cache.shape[0]):
            raise self.fail(f"position ids must lie in [0, {cos_cache.shape[0]}), got "
                            f"[{host.min()}, {host.max()}]")
        work = work_dtype(x.dtype)
        cos = xp.take(cos_cache.astype(work, copy=False), pos, axis=0)[:, None]  # (B|1,1,S,h)
        sin = xp.take(sin_cache.astype(work, copy=False), pos, axis=0)[:, None]
        out = _rotate(xp, xs.astype(work, copy=False), cos, sin, self.interleaved)
        if x.ndim == 3:
            out = out.transpose(0, 2, 1, 3).reshape(x.shape)
        return out.astype(x.dtype, copy=False)


@register("BiasSoftmax", versions=[1], domain=_DOMAIN)
class BiasSoftmax(OpImpl):
    """softmax(data + bias) over the dimensions from `axis` on. The bias holds whole softmax
    rows: with is_inner_broadcast it is shaped like data's leading dimensions with a block of
    middle dimensions (up to axis) broadcast (bias row i // repeat serves data row i),
    otherwise the outer dimensions are broadcast (bias row i % bias_rows)."""

    defaults = {"axis": 1, "is_inner_broadcast": 0}

    def setup(self):
        self.axis = int(self.axis)
        self.inner = bool(self.is_inner_broadcast)

    def run(self, data, bias):
        xp = self.xp
        rank = data.ndim
        if not -rank <= self.axis < rank:
            raise self.fail(f"axis {self.axis} out of range for rank {rank}")
        axis = self.axis % rank
        rows = math.prod(data.shape[:axis])
        width = math.prod(data.shape[axis:])
        if data.size == 0:
            return data.copy()
        bias_rows = bias.size // width
        if bias.size % width or bias_rows == 0 or rows % bias_rows:
            raise self.fail(f"bias shape {tuple(bias.shape)} does not broadcast against data "
                            f"{tuple(data.shape)} from axis {axis}")
        work = work_dtype(data.dtype)
        x = data.astype(work, copy=False)
        b = bias.astype(work, copy=False).reshape(bias_rows, width)
        if self.inner:
            s = x.reshape(bias_rows, rows // bias_rows, width) + b.reshape(bias_rows, 1, width)
        else:
            s = x.reshape(rows // bias_rows, bias_rows, width) + b.reshape(1, bias_rows, width)
        with np.errstate(invalid="ignore"):
            s -= xp.max(s, axis=-1, keepdims=True)
            xp.exp(s, out=s)
            s /= xp.sum(s, axis=-1, keepdims=True)
        return s.reshape(data.shape).astype(data.dtype, copy=False)

"""onnxruntime's fused transformer and convolution ops (the "com.microsoft" contrib domain, version
1), with onnxruntime's semantics (docs/ContribOperators.md, and its measured behaviour where the
documentation is silent):

    SkipLayerNormalization(input, skip, gamma, beta?, bias?)
        -> output, mean?, inv_std_var?, input_skip_bias_sum?
    SkipSimplifiedLayerNormalization(input, skip, gamma, bias?)     (the RMS form; mean is 0)
        -> output, mean?, inv_std_var?, input_skip_bias_sum?
    SimplifiedLayerNormalization(X, scale) -> Y, inv_std_var?        (RMS norm; default domain)
    EmbedLayerNormalization(input_ids, segment_ids?, word_embedding, position_embedding,
                            segment_embedding?, gamma, beta, mask?, position_ids?)
        -> output, mask_index?, embedding_sum?
    Gelu(X)                 0.5 X (1 + erf(X / sqrt 2))
    BiasGelu(A, B)          Gelu(A + B)
    FastGelu(X, bias?)      the tanh approximation of Gelu(X + bias)
    QuickGelu(X)            X sigmoid(alpha X)
    BiasAdd(X, bias, skip)  X + bias + skip
    BiasSplitGelu(X, bias)  left * Gelu(right), left | right = the halves of X + bias
    FusedMatMul(A, B)       alpha * op(A) @ op(B) (transA/transB, transBatchA/transBatchB)
    GemmFastGelu(X, W, bias?)   FastGelu(X @ W + bias)
    FusedConv(X, W, B?, Z?) activation(Conv(X, W, B) + Z)

onnxruntime registers SimplifiedLayerNormalization in the default ONNX domain only (a model
that puts it in com.microsoft does not load there), so it is registered at "" version 1: the ONNX
standard has no op of that name, so the registry picks version 1 under any opset.

Precision: on float16 / bfloat16 data every normalisation, GELU and product runs in float32 and
is rounded once to the output dtype (the sums that feed a normalisation are normalised
unrounded, as onnxruntime does; input_skip_bias_sum and embedding_sum are those sums rounded
once). GELU's exact form is ember's own Gelu kernel (ops/activations.py) over float32, as
onnxruntime computes it: in float32, 1 + erf(x) keeps about 4 significant digits at x = -3,
far below one float16 step of the output; the tanh forms use 1 + tanh(u) = 2 sigmoid(2u), which
has no cancellation. The statistics outputs (mean,
inv_std_var) are float32, as onnxruntime's schemas declare, except for float64 data.

Attributes have onnxruntime's defaults (these ops have no ONNX schema: `defaults` below).
"""
from __future__ import annotations

import math

import numpy as np

from ember.ops import _xp
from ember.ops._dtypes import is_narrow_float, widen
from ember.ops.activations import gelu
from ember.ops.conv import Conv
from ember.ops.registry import OpImpl, register

DOMAIN = "com.microsoft"

# ----------------------------------------------------------------------------------------------
# the normal CDF and the GELUs

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh(xp, w):
    """0.5 w (1 + tanh(sqrt(2/pi) (w + 0.044715 w^3))) in w's dtype, as w / (1 + exp(-2u)):
    1 + tanh(u) = 2 sigmoid(2u) keeps its relative precision for negative u."""
    u = w * w
    u *= 0.044715
    u += 1.0
    u *= w
    u *= -2.0 * _SQRT_2_OVER_PI
    with np.errstate(over="ignore"):  # very negative w: exp overflows and w / inf is -0
        xp.exp(u, out=u)
    u += 1.0
    return w / u


def _bias_on_last_axis(op: OpImpl, x, bias, name: str = "bias"):
    """`bias` (1-D, of x's last dimension) checked as onnxruntime checks it."""
    if bias.ndim != 1:
        raise op.fail(f"{name} must be 1-D, got shape {tuple(bias.shape)}")
    if x.ndim == 0 or bias.shape[0] != x.shape[-1]:
        raise op.fail(f"{name} has {bias.shape[0]} values; the input's last dimension is "
                      f"{x.shape[-1] if x.ndim else 'absent'}")
    return bias


def _float_input(op: OpImpl, x):
    if x.dtype.kind != "f" and not is_narrow_float(x.dtype):
        raise op.fail(f"expects a float tensor, got {x.dtype}")


@register("Gelu", versions=[1], domain=DOMAIN)
class Gelu(OpImpl):
    def run(self, x):
        _float_input(self, x)
        return gelu(self.xp, widen(x)).astype(x.dtype, copy=False)


@register("BiasGelu", versions=[1], domain=DOMAIN)
class BiasGelu(OpImpl):
    def run(self, a, b):
        _float_input(self, a)
        _bias_on_last_axis(self, a, b, "B")
        return gelu(self.xp, widen(a) + widen(b)).astype(a.dtype, copy=False)


@register("FastGelu", versions=[1], domain=DOMAIN)
class FastGelu(OpImpl):
    def run(self, x, bias=None):
        _float_input(self, x)
        w = widen(x)
        if bias is not None:
            w = w + widen(_bias_on_last_axis(self, x, bias))
        with np.errstate(invalid="ignore"):
            return _gelu_tanh(self.xp, w).astype(x.dtype, copy=False)


@register("QuickGelu", versions=[1], domain=DOMAIN)
class QuickGelu(OpImpl):
    defaults = {"alpha": 1.702}

    def run(self, x):
        _float_input(self, x)
        xp = self.xp
        w = widen(x)
        with np.errstate(over="ignore", invalid="ignore"):
            e = xp.exp(w * -float(self.alpha))
            e += 1.0
            return (w / e).astype(x.dtype, copy=False)


@register("BiasAdd", versions=[1], domain=DOMAIN)
class BiasAdd(OpImpl):
    def run(self, x, bias, skip):
        _bias_on_last_axis(self, x, bias)
        if tuple(skip.shape) != tuple(x.shape):
            raise self.fail(f"skip has shape {tuple(skip.shape)}, X {tuple(x.shape)}")
        y = widen(x) + widen(bias)
        y += widen(skip)
        return y.astype(x.dtype, copy=False)


@register("BiasSplitGelu", versions=[1], domain=DOMAIN)
class BiasSplitGelu(OpImpl):
    def run(self, x, bias):
        _float_input(self, x)
        _bias_on_last_axis(self, x, bias)
        d = x.shape[-1]
        if d % 2:
            raise self.fail(f"the last dimension ({d}) must be even to split in halves")
        w = widen(x) + widen(bias)
        half = d // 2
        gate = gelu(self.xp, w[..., half:])
        gate *= w[..., :half]
        return gate.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# products


def _matmul_checked(op: OpImpl, a, b):
    if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise op.fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)} are not aligned")
    try:
        return op.xp.matmul(a, b)
    except ValueError as exc:  # batch dimensions that do not broadcast
        raise op.fail(f"shapes {tuple(a.shape)} and {tuple(b.shape)}: {exc}") from None


@register("FusedMatMul", versions=[1], domain=DOMAIN)
class FusedMatMul(OpImpl):
    """alpha * A' @ B' with numpy matmul broadcasting. transBatchX moves X's first axis to
    just before its last one ((d0, b1.., bk, n) -> (b1.., bk, d0, n)); then transX swaps the
    last two axes (1-D operands are used as they are). onnxruntime 1.32 drops transA when
    the product has a single column (B a vector or N = 1: it reads A untransposed); ember
    computes the documented product there."""

    defaults = {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0, "transBatchB": 0}

    def _operand(self, x, trans_batch, trans):
        xp = self.xp
        if trans_batch and x.ndim >= 3:
            x = xp.moveaxis(x, 0, -2)
        if trans and x.ndim >= 2:
            x = xp.swapaxes(x, -1, -2)
        return x

    def run(self, a, b):
        _float_input(self, a)
        dtype = a.dtype
        a = self._operand(widen(a), self.transBatchA, self.transA)
        b = self._operand(widen(b), self.transBatchB, self.transB)
        y = self.xp.asarray(_matmul_checked(self, a, b))
        alpha = float(self.alpha)
        if alpha != 1.0:
            y = y * alpha
        return y.astype(dtype, copy=False)


@register("GemmFastGelu", versions=[1], domain=DOMAIN)
class GemmFastGelu(OpImpl):
    def run(self, x, w, bias=None):
        _float_input(self, x)
        y = self.xp.asarray(_matmul_checked(self, widen(x), widen(w)))
        if bias is not None:
            y = y + widen(_bias_on_last_axis(self, y, bias))
        with np.errstate(invalid="ignore"):
            return _gelu_tanh(self.xp, y).astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# FusedConv

# activation name -> number of activation_params it takes (onnxruntime requires exactly these)
CONV_ACTIVATIONS = {"": 0, "Relu": 0, "Tanh": 0, "Sigmoid": 0, "HardSwish": 0,
                    "LeakyRelu": 1, "Clip": 2, "HardSigmoid": 2}


def _activate(xp, y, name: str, params: tuple[float, ...]):
    """`name`(y) for onnxruntime's fused activations (a new array, in y's dtype)."""
    if name == "Relu":
        return xp.maximum(y, 0)
    if name == "Tanh":
        return xp.tanh(y)
    if name == "Sigmoid":
        with np.errstate(over="ignore"):
            return 1.0 / (1.0 + xp.exp(-y))
    if name == "LeakyRelu":
        return xp.where(y < 0, y * params[0], y)
    if name == "Clip":
        return xp.minimum(xp.maximum(y, params[0]), params[1])
    if name == "HardSigmoid":
        return xp.clip(y * params[0] + params[1], 0.0, 1.0)
    if name == "HardSwish":
        return y * xp.clip(y * (1.0 / 6.0) + 0.5, 0.0, 1.0)
    return y


@register("FusedConv", versions=[1], domain=DOMAIN)
class FusedConv(Conv):
    """activation(Conv(X, W, B) + Z): Conv's attributes plus `activation` (Relu, Tanh,
    Sigmoid, LeakyRelu, Clip, HardSigmoid, HardSwish; absent: none) and `activation_params`
    (LeakyRelu: alpha; Clip: min, max; HardSigmoid: alpha, beta). The residual Z, of the
    result's shape, is added before the activation. float16 runs in float32, rounded once."""

    defaults = {"activation": "", "activation_params": None, "group": 1, "auto_pad": "NOTSET",
                "pads": None, "strides": None, "dilations": None, "kernel_shape": None}

    def setup(self):
        super().setup()
        name = self.activation or ""
        self.activation_name = name.decode() if isinstance(name, bytes) else name
        if self.activation_name not in CONV_ACTIVATIONS:
            raise self.fail(f"unsupported activation {self.activation_name!r} (onnxruntime's "
                            f"FusedConv takes {', '.join(a for a in CONV_ACTIVATIONS if a)})")
        params = tuple(float(v) for v in (self.activation_params or ()))
        wanted = CONV_ACTIVATIONS[self.activation_name]
        if len(params) != wanted and (wanted or params):
            raise self.fail(f"activation {self.activation_name} takes {wanted} "
                            f"activation_params, got {len(params)}")
        self.activation_args = params

    def run(self, x, w, b=None, z=None):
        _float_input(self, x)
        y = super().run(widen(x), w, b)  # in float32 for float16 data: rounded once below
        if z is not None:
            if tuple(z.shape) != tuple(y.shape):
                raise self.fail(f"Z has shape {tuple(z.shape)}, the convolution "
                                f"{tuple(y.shape)}")
            y = y + widen(z).astype(y.dtype, copy=False)
        y = _activate(self.xp, y, self.activation_name, self.activation_args)
        return y.astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# normalisations


def _stats_dtype(x) -> np.dtype:
    """Where the statistics of a normalisation run: float64 data in float64, all else float32."""
    return np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)


def _layer_norm_last(xp, s, gamma, beta, epsilon: float, simplified: bool):
    """Normalise `s` (float32/float64) over its last axis: (normalised * gamma + beta, mean,
    inv_std) with the statistics keeping a trailing axis of 1. The simplified form is the RMS
    norm (no centring; mean is 0)."""
    eps = float(np.float32(epsilon))  # onnxruntime reads the attribute as a float32
    if simplified:
        mean = xp.zeros(s.shape[:-1] + (1,), s.dtype)
        d = s
        ms = xp.mean(s * s, axis=-1, keepdims=True)
    else:
        mean = xp.mean(s, axis=-1, keepdims=True)
        d = s - mean
        ms = xp.mean(d * d, axis=-1, keepdims=True)
    inv = 1.0 / xp.sqrt(ms + eps)
    y = d * inv
    y *= gamma.astype(s.dtype, copy=False)
    if beta is not None:
        y += beta.astype(s.dtype, copy=False)
    return y, mean, inv


class _SkipNorm(OpImpl):
    """Shared kernel of SkipLayerNormalization and SkipSimplifiedLayerNormalization."""

    simplified = False
    defaults = {"epsilon": 1e-12}

    def _check(self, x, skip, gamma, beta, bias):
        if x.ndim not in (2, 3):
            raise self.fail(f"input must be 2-D or 3-D, got shape {tuple(x.shape)}")
        if skip.ndim not in (2, 3):
            raise self.fail(f"skip must be 2-D or 3-D, got shape {tuple(skip.shape)}")
        if tuple(skip.shape[-2:]) != tuple(x.shape[-2:]) or (
                skip.ndim == 3 and (x.ndim == 2 or skip.shape[0] not in (1, x.shape[0]))):
            raise self.fail(f"skip of shape {tuple(skip.shape)} does not fit input "
                            f"{tuple(x.shape)} (same shape, batch 1, or no batch axis)")
        hidden = x.shape[-1]
        for name, p in (("gamma", gamma), ("beta", beta), ("bias", bias)):
            if p is not None and (p.ndim != 1 or p.shape[0] != hidden):
                raise self.fail(f"{name} must be 1-D of the hidden size {hidden}, got shape "
                                f"{tuple(p.shape)}")

    def _run(self, x, skip, gamma, beta, bias):
        _float_input(self, x)
        self._check(x, skip, gamma, beta, bias)
        sd = _stats_dtype(x)
        s = x.astype(sd, copy=False) + skip.astype(sd, copy=False)  # a fresh array
        if bias is not None:
            s += bias.astype(sd, copy=False)
        y, mean, inv = _layer_norm_last(self.xp, s, gamma, beta, self.epsilon, self.simplified)
        outs = [y.astype(x.dtype, copy=False), mean, inv]
        if self.n_outputs > 3:
            outs.append(s.astype(x.dtype, copy=False))
        return tuple(outs[:max(self.n_outputs, 1)])


@register("SkipLayerNormalization", versions=[1], domain=DOMAIN)
class SkipLayerNormalization(_SkipNorm):
    def run(self, x, skip, gamma, beta=None, bias=None):
        return self._run(x, skip, gamma, beta, bias)


@register("SkipSimplifiedLayerNormalization", versions=[1], domain=DOMAIN)
class SkipSimplifiedLayerNormalization(_SkipNorm):
    simplified = True

    def run(self, x, skip, gamma, bias=None):
        return self._run(x, skip, gamma, None, bias)


_STASH_DTYPES = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}


def _broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether an array of `shape` broadcasts (unidirectionally) to `target`."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(shape[::-1], target[::-1]))


@register("SimplifiedLayerNormalization", versions=[1])
class SimplifiedLayerNormalization(OpImpl):
    """RMS normalisation over axes [axis, rank): Y = X / sqrt(mean(X^2) + epsilon) * scale, in
    scale's dtype (onnxruntime's T/V split: X and scale may differ). Statistics run in float32
    (float64 for float64 data or stash_type 11); inv_std_var has the stash_type's dtype."""

    defaults = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}

    def setup(self):
        stash = int(self.stash_type)
        if stash not in _STASH_DTYPES:
            raise self.fail(f"stash_type {stash} is not supported (1: float32, 11: float64)")
        self.stash_dtype = _STASH_DTYPES[stash]

    def run(self, x, scale):
        _float_input(self, x)
        xp = self.xp
        rank = x.ndim
        axis = int(self.axis) + rank if int(self.axis) < 0 else int(self.axis)
        if not 0 <= axis < rank:
            raise self.fail(f"axis {self.axis} out of range for rank {rank}")
        inner = tuple(x.shape[axis:])
        if not _broadcasts_to(tuple(scale.shape), inner):
            raise self.fail(f"scale of shape {tuple(scale.shape)} does not broadcast to the "
                            f"normalised shape {inner}")
        sd = np.promote_types(_stats_dtype(x), self.stash_dtype)
        outer = tuple(x.shape[:axis])
        w = x.astype(sd, copy=False).reshape(outer + (-1,))
        ms = xp.mean(w * w, axis=-1, keepdims=True)
        inv = 1.0 / xp.sqrt(ms + float(np.float32(self.epsilon)))
        y = (w * inv).reshape(x.shape)
        y *= scale.astype(sd, copy=False)
        y = y.astype(scale.dtype, copy=False)
        if self.n_outputs < 2:
            return y
        inv = inv.reshape(outer + (1,) * (rank - axis)).astype(self.stash_dtype, copy=False)
        return y, inv


@register("EmbedLayerNormalization", versions=[1], domain=DOMAIN)
class EmbedLayerNormalization(OpImpl):
    """LayerNorm(word_embedding[input_ids] + position_embedding[position_ids] +
    segment_embedding[segment_ids]) * gamma + beta over the hidden axis. Positions default to
    0..S-1 per row; position_ids may be (B, S) or (1, S). mask_index[b] counts the 1s of
    mask[b] (0s when there is no mask), as onnxruntime's CPU kernel does; embedding_sum is the
    sum before normalisation. Any out-of-range id is an error, as in onnxruntime."""

    defaults = {"epsilon": 1e-12, "mask_index_type": 1}
    index_inputs = {0: (2, None, 0), 1: (4, None, 0), 8: (3, None, 0)}  # rows of the tables

    def _gather(self, table, ids, what: str):
        xp = self.xp
        if ids.dtype.kind not in "iu":
            raise self.fail(f"{what} ids must be integers, got {ids.dtype}")
        n = table.shape[0]
        if ids.size and _xp.to_host(xp, ((ids < 0) | (ids >= n)).any()):
            raise self.fail(f"a {what} id is out of range for the {n} rows of its embedding")
        return xp.take(table, ids.astype(np.int64, copy=False), axis=0)

    def run(self, input_ids, segment_ids, word_embedding, position_embedding,
            segment_embedding=None, gamma=None, beta=None, mask=None, position_ids=None):
        xp = self.xp
        if input_ids.ndim != 2:
            raise self.fail(f"input_ids must be 2-D (batch, sequence), got shape "
                            f"{tuple(input_ids.shape)}")
        batch, seq = input_ids.shape
        for name, table in (("word_embedding", word_embedding),
                            ("position_embedding", position_embedding),
                            ("segment_embedding", segment_embedding)):
            if table is not None and table.ndim != 2:
                raise self.fail(f"{name} must be 2-D, got shape {tuple(table.shape)}")
        _float_input(self, word_embedding)
        hidden = word_embedding.shape[1]
        for name, p in (("position_embedding", position_embedding),
                        ("segment_embedding", segment_embedding)):
            if p is not None and p.shape[1] != hidden:
                raise self.fail(f"{name} has hidden size {p.shape[1]}, word_embedding {hidden}")
        for name, p in (("gamma", gamma), ("beta", beta)):
            if p is None:
                raise self.fail(f"{name} is required")
            if p.ndim != 1 or p.shape[0] != hidden:
                raise self.fail(f"{name} must be 1-D of the hidden size {hidden}, got shape "
                                f"{tuple(p.shape)}")
        if (segment_ids is None) != (segment_embedding is None):
            raise self.fail("segment_ids and segment_embedding must be given together")
        for name, ids in (("segment_ids", segment_ids), ("mask", mask)):
            if ids is not None and tuple(ids.shape) != (batch, seq):
                raise self.fail(f"{name} has shape {tuple(ids.shape)}, input_ids "
                                f"{(batch, seq)}")
        if position_ids is None:
            positions = xp.arange(seq, dtype=np.int64).reshape(1, seq)
        else:
            if position_ids.ndim != 2 or position_ids.shape[1] != seq or \
                    position_ids.shape[0] not in (1, batch):
                raise self.fail(f"position_ids has shape {tuple(position_ids.shape)}; expected "
                                f"{(batch, seq)} or {(1, seq)}")
            positions = position_ids
        sd = _stats_dtype(word_embedding)
        s = self._gather(word_embedding, input_ids, "word").astype(sd, copy=False)
        s = s + self._gather(position_embedding, positions, "position").astype(sd, copy=False)
        if segment_ids is not None:
            s += self._gather(segment_embedding, segment_ids, "segment").astype(sd, copy=False)
        y, _, _ = _layer_norm_last(xp, s, gamma, beta, self.epsilon, simplified=False)
        dtype = word_embedding.dtype
        outs = [y.astype(dtype, copy=False)]
        if self.n_outputs > 1:
            if mask is None:
                outs.append(xp.zeros((batch,), np.int32))
            else:
                outs.append(xp.sum(mask == 1, axis=1, dtype=np.int32))
        if self.n_outputs > 2:
            outs.append(s.astype(dtype, copy=False))
        return tuple(outs) if len(outs) > 1 else outs[0]

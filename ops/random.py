"""Random generators: RandomUniform(Like), RandomNormal(Like), Bernoulli, Multinomial.

A node with a `seed` attribute owns a generator seeded once when the model is loaded, so a freshly
loaded model produces the same sequence of outputs run after run (successive runs of one
session draw successive values, as onnxruntime does). Without a seed, values come from fresh
OS entropy, unless EMBER_RANDOM_SEED is set: then unseeded nodes are seeded with it, for
reproducible runs (the tests set it).
"""
from __future__ import annotations

import numpy as np

from ember import config, limits
from ember.ops.registry import OpImpl, register
from ember.ops.tensor import STRING, cast_array, is_floatlike, onnx_dtype


def _generator(seed) -> np.random.Generator:
    if seed is None:
        fixed = config.text("EMBER_RANDOM_SEED")
        return np.random.default_rng(int(fixed) if fixed else None)
    seed = float(seed)
    if seed.is_integer() and seed >= 0:
        return np.random.default_rng(int(seed))
    # non-integral or negative seeds: use the float's bit pattern
    return np.random.default_rng(int(np.array(seed, dtype=np.float64).view(np.uint64)))


class _RandomOp(OpImpl):
    """Seeded generator plus output dtype resolution shared by the random ops."""

    default_dtype: int | None = 1  # float

    def setup(self):
        self.rng = _generator(self.seed)
        code = self.dtype if self.dtype is not None else self.default_dtype
        self.out_dtype = None
        if code is not None and code != 0:
            try:
                self.out_dtype = onnx_dtype(code)
            except ValueError as exc:
                raise self.fail(f"attribute 'dtype': {exc}") from None
            self.check_dtype(self.out_dtype)

    def check_dtype(self, dtype: np.dtype) -> None:
        if not is_floatlike(dtype):
            raise self.fail(f"dtype must be a floating-point type, got {dtype}")

    def like_dtype(self, x: np.ndarray) -> np.dtype:
        dtype = self.out_dtype if self.out_dtype is not None else x.dtype
        if dtype == STRING:
            raise self.fail("cannot generate random values of type string")
        return dtype


def _shape_attr(op: OpImpl) -> tuple[int, ...]:
    if op.shape is None:
        raise op.fail("attribute 'shape' is required")
    dims = tuple(int(d) for d in op.shape)
    if any(d < 0 for d in dims):
        raise op.fail(f"shape {list(dims)} has a negative dimension")
    return dims


def _uniform(rng: np.random.Generator, shape, low: float, high: float, dtype) -> np.ndarray:
    work = np.float64 if dtype == np.float64 else np.float32
    values = rng.random(shape, dtype=work) * work(high - low) + work(low)
    return cast_array(np, values, dtype)


def _normal(rng: np.random.Generator, shape, mean: float, scale: float, dtype) -> np.ndarray:
    work = np.float64 if dtype == np.float64 else np.float32
    values = rng.standard_normal(shape, dtype=work) * work(scale) + work(mean)
    return cast_array(np, values, dtype)


@register("RandomUniform", versions=[1, 22])
class RandomUniform(_RandomOp):
    def setup(self):
        super().setup()
        self.out_shape = _shape_attr(self)

    def run(self):
        limits.check_shape(self.out_shape, self.out_dtype)  # the shape attribute is unchecked
        return _uniform(self.rng, self.out_shape, self.low, self.high, self.out_dtype)


@register("RandomNormal", versions=[1, 22])
class RandomNormal(_RandomOp):
    def setup(self):
        super().setup()
        self.out_shape = _shape_attr(self)

    def run(self):
        limits.check_shape(self.out_shape, self.out_dtype)
        return _normal(self.rng, self.out_shape, self.mean, self.scale, self.out_dtype)


@register("RandomUniformLike", versions=[1, 22])
class RandomUniformLike(_RandomOp):
    default_dtype = None

    def run(self, x):
        return _uniform(self.rng, x.shape, self.low, self.high, self.like_dtype(x))


@register("RandomNormalLike", versions=[1, 22])
class RandomNormalLike(_RandomOp):
    default_dtype = None

    def run(self, x):
        return _normal(self.rng, x.shape, self.mean, self.scale, self.like_dtype(x))


@register("Bernoulli", versions=[15, 22])
class Bernoulli(_RandomOp):
    """1 with probability p (the input), else 0; the output type defaults to the input's."""

    default_dtype = None

    def check_dtype(self, dtype: np.dtype) -> None:
        if dtype == STRING:
            raise self.fail("dtype must be numeric or bool, got string")

    def run(self, p):
        dtype = self.like_dtype(p)
        # same draw as RandomUniformLike(p) followed by Less(u, p), the op's function body
        u = cast_array(np, self.rng.random(p.shape, dtype=np.float64 if p.dtype == np.float64
                                            else np.float32), p.dtype)
        return cast_array(np, u < p, dtype)


@register("Multinomial", versions=[7, 22])
class Multinomial(_RandomOp):
    """Samples class indices per batch row from unnormalised log-probabilities."""

    default_dtype = 6  # int32

    def check_dtype(self, dtype: np.dtype) -> None:
        if dtype not in (np.int32, np.int64):
            raise self.fail(f"dtype must be int32 or int64, got {dtype}")

    def run(self, x):
        if x.ndim != 2:
            raise self.fail(f"input must be [batch_size, class_size], got shape {x.shape}")
        n = int(self.sample_size)
        if n < 1:
            raise self.fail(f"sample_size must be positive, got {n}")
        limits.check_shape((x.shape[0], n), np.float64)
        logits = cast_array(np, x, np.float64)
        batch, classes = logits.shape
        out = np.zeros((batch, n), dtype=self.out_dtype)
        if classes == 0 or batch == 0:
            return out
        with np.errstate(all="ignore"):
            shifted = logits - np.max(logits, axis=1, keepdims=True)
            weights = np.exp(shifted)
            cdf = np.cumsum(weights, axis=1)
            cdf /= cdf[:, -1:]
        u = self.rng.random((batch, n))
        for b in range(batch):  # one searchsorted per row
            idx = np.searchsorted(cdf[b], u[b], side="right")
            out[b] = np.minimum(idx, classes - 1)
        return out

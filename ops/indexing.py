"""Indexing ops: Gather, GatherElements, GatherND, Scatter, ScatterElements, ScatterND,
TensorScatter, NonZero, OneHot, Compress, ReverseSequence, Unique, TopK, CumSum, CumProd."""
from __future__ import annotations

import numpy as np

from ember.ops.registry import OpImpl, register


# ----------------------------------------------------------------------------- helpers

def _norm_axis(op: OpImpl, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise op.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis + rank if axis < 0 else axis


def _scalar_int(value) -> int:
    return int(np.asarray(value).reshape(-1)[0])


def _fix_indices(op: OpImpl, indices: np.ndarray, dim) -> np.ndarray:
    """int64 indices with negatives wrapped; raises on out-of-range values.
    `dim` is a size or an array of sizes broadcastable to `indices`."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    if idx.size:
        bad = (idx < -np.asarray(dim)) | (idx >= np.asarray(dim))
        if bad.any():
            raise op.fail(f"index {int(idx[bad].reshape(-1)[0])} is out of bounds "
                          f"(dimension size {dim if np.ndim(dim) == 0 else list(np.ravel(dim))})")
        if (idx < 0).any():
            idx = np.where(idx < 0, idx + dim, idx)
    return idx


def _along_axis_index(indices: np.ndarray, axis: int) -> tuple:
    """Index tuple addressing data[i0, .., indices[i], .., in] for every position of indices."""
    grids = list(np.ogrid[tuple(slice(0, d) for d in indices.shape)]) if indices.ndim else []
    grids[axis] = indices
    return tuple(grids)


_REDUCERS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_into(op: OpImpl, out: np.ndarray, index: tuple, updates: np.ndarray,
                  reduction: str) -> np.ndarray:
    updates = np.asarray(updates).astype(out.dtype, copy=False)
    if reduction == "none":
        out[index] = updates
        return out
    ufunc = _REDUCERS.get(reduction)
    if ufunc is None:
        raise op.fail(f"unknown reduction '{reduction}'")
    try:
        ufunc.at(out, index, updates)
    except TypeError:  # dtypes without ufunc.at loops (ml_dtypes, bool): go through float64/int
        wide = np.float64 if out.dtype.kind not in "iub" else np.int64
        tmp = out.astype(wide)
        ufunc.at(tmp, index, updates.astype(wide))
        out[...] = tmp.astype(out.dtype)
    return out


# ----------------------------------------------------------------------------- Gather family

@register("Gather", versions=[1, 11, 13])
class Gather(OpImpl):
    def run(self, data, indices):
        axis = _norm_axis(self, self.axis, data.ndim)
        idx = _fix_indices(self, indices, data.shape[axis])
        return np.take(data, idx, axis=axis)


@register("GatherElements", versions=[11, 13])
class GatherElements(OpImpl):
    def run(self, data, indices):
        axis = _norm_axis(self, self.axis, data.ndim)
        if indices.ndim != data.ndim:
            raise self.fail(f"indices rank {indices.ndim} differs from data rank {data.ndim}")
        idx = _fix_indices(self, indices, data.shape[axis])
        return data[_along_axis_index(idx, axis)]


def _gather_nd(op: OpImpl, data: np.ndarray, indices: np.ndarray, b: int) -> np.ndarray:
    if indices.ndim < 1:
        raise op.fail("indices must have rank >= 1")
    k = indices.shape[-1]
    if not 0 <= b < min(data.ndim, indices.ndim):
        raise op.fail(f"batch_dims {b} out of range")
    if data.shape[:b] != indices.shape[:b]:
        raise op.fail(f"batch dimensions differ: {data.shape[:b]} vs {indices.shape[:b]}")
    if k > data.ndim - b:
        raise op.fail(f"index tuples of length {k} exceed the rank {data.ndim} - batch_dims {b}")
    batch = int(np.prod(data.shape[:b], dtype=np.int64))
    d = data.reshape((batch,) + data.shape[b:])
    idx = indices.reshape(batch, -1, k)
    idx = _fix_indices(op, idx, np.array(data.shape[b:b + k], dtype=np.int64))
    index = (np.arange(batch)[:, None],) + tuple(idx[..., j] for j in range(k))
    out = d[index]
    return out.reshape(indices.shape[:-1] + data.shape[b + k:])


@register("GatherND", versions=[11])
class GatherND11(OpImpl):
    def run(self, data, indices):
        return _gather_nd(self, data, indices, 0)


@register("GatherND", versions=[12, 13])
class GatherND12(OpImpl):
    def run(self, data, indices):
        return _gather_nd(self, data, indices, self.batch_dims)


# ----------------------------------------------------------------------------- Scatter family

class _ScatterElementsBase(OpImpl):
    def _reduction(self) -> str:
        return getattr(self, "reduction", None) or "none"

    def run(self, data, indices, updates):
        axis = _norm_axis(self, self.axis, data.ndim)
        if indices.shape != updates.shape:
            raise self.fail(f"indices shape {indices.shape} differs from updates shape "
                            f"{updates.shape}")
        if indices.ndim != data.ndim:
            raise self.fail(f"indices rank {indices.ndim} differs from data rank {data.ndim}")
        idx = _fix_indices(self, indices, data.shape[axis])
        return _scatter_into(self, data.copy(), _along_axis_index(idx, axis), updates,
                             self._reduction())


@register("Scatter", versions=[9, 11])
class Scatter(_ScatterElementsBase):
    pass


@register("ScatterElements", versions=[11, 13])
class ScatterElements11(_ScatterElementsBase):
    pass


@register("ScatterElements", versions=[16])
class ScatterElements16(_ScatterElementsBase):
    def setup(self):
        if self.reduction not in ("none", "add", "mul"):
            raise self.fail(f"unknown reduction '{self.reduction}'")


@register("ScatterElements", versions=[18])
class ScatterElements18(_ScatterElementsBase):
    def setup(self):
        if self.reduction not in ("none", "add", "mul", "max", "min"):
            raise self.fail(f"unknown reduction '{self.reduction}'")


class _ScatterNDBase(OpImpl):
    def _reduction(self) -> str:
        return getattr(self, "reduction", None) or "none"

    def check_shapes(self, data, indices, updates) -> int:
        """Validate the three shapes against each other; returns k, the index tuple length."""
        if indices.ndim < 1:
            raise self.fail("indices must have rank >= 1")
        k = indices.shape[-1]
        if k > data.ndim:
            raise self.fail(f"index tuples of length {k} exceed the data rank {data.ndim}")
        expected = indices.shape[:-1] + data.shape[k:]
        if updates.shape != expected:
            raise self.fail(f"updates shape {updates.shape}, expected {expected}")
        return k

    def run(self, data, indices, updates):
        k = self.check_shapes(data, indices, updates)
        idx = _fix_indices(self, indices.reshape(-1, k),
                           np.array(data.shape[:k], dtype=np.int64))
        upd = updates.reshape((idx.shape[0],) + data.shape[k:])
        index = tuple(idx[:, j] for j in range(k))
        return _scatter_into(self, data.copy(), index, upd, self._reduction())


@register("ScatterND", versions=[11, 13])
class ScatterND11(_ScatterNDBase):
    pass


@register("ScatterND", versions=[16])
class ScatterND16(_ScatterNDBase):
    def setup(self):
        if self.reduction not in ("none", "add", "mul"):
            raise self.fail(f"unknown reduction '{self.reduction}'")


@register("ScatterND", versions=[18])
class ScatterND18(_ScatterNDBase):
    def setup(self):
        if self.reduction not in ("none", "add", "mul", "max", "min"):
            raise self.fail(f"unknown reduction '{self.reduction}'")


@register("TensorScatter", versions=[24])
class TensorScatter(OpImpl):
    def setup(self):
        if self.mode not in ("linear", "circular"):
            raise self.fail(f"unknown mode '{self.mode}'")

    def run(self, past, update, write_indices=None):
        if past.ndim != update.ndim or past.ndim < 2:
            raise self.fail(f"past_cache {past.shape} and update {update.shape} must have the "
                            "same rank >= 2")
        axis = _norm_axis(self, self.axis, past.ndim)
        if axis == 0:
            raise self.fail("axis cannot be the batch axis")
        if any(p != u for i, (p, u) in enumerate(zip(past.shape, update.shape)) if i != axis):
            raise self.fail(f"update shape {update.shape} does not match past_cache "
                            f"{past.shape} outside axis {axis}")
        batch, cap, seq = past.shape[0], past.shape[axis], update.shape[axis]
        if write_indices is None:
            w = np.zeros(batch, dtype=np.int64)
        else:
            w = np.asarray(write_indices).astype(np.int64).reshape(-1)
            if w.shape[0] != batch:
                raise self.fail(f"write_indices has {w.shape[0]} entries for batch {batch}")
        pos = w[:, None] + np.arange(seq, dtype=np.int64)[None, :]
        if self.mode == "circular":
            pos %= cap
        elif seq and ((pos < 0).any() or (pos >= cap).any()):
            raise self.fail(f"writes past the end of the cache (size {cap})")
        out = past.copy()
        view = np.moveaxis(out, axis, 1)
        view[np.arange(batch)[:, None], pos] = np.moveaxis(update, axis, 1)
        return out


# ----------------------------------------------------------------------------- NonZero / OneHot / Compress

@register("NonZero", versions=[9, 13])
class NonZero(OpImpl):
    def run(self, x):
        if x.ndim == 0:
            return np.zeros((0, 1 if bool(x) else 0), dtype=np.int64)
        mask = x != 0 if x.dtype != object else x.astype(bool)
        return np.array(np.nonzero(mask), dtype=np.int64).reshape(x.ndim, -1)


class _OneHotBase(OpImpl):
    wrap_negative = True

    def run(self, indices, depth, values):
        depth = np.asarray(depth).reshape(-1)[0]
        depth = int(depth)
        if depth < 0:
            raise self.fail(f"depth must be non-negative, got {depth}")
        values = np.asarray(values).reshape(-1)
        if values.shape[0] != 2:
            raise self.fail(f"values must have 2 entries, got {values.shape[0]}")
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iub":
            idx = np.trunc(idx.astype(np.float64))
        idx = idx.astype(np.int64)
        if self.wrap_negative:
            idx = np.where(idx < 0, idx + depth, idx)
        rank = idx.ndim + 1
        axis = _norm_axis(self, self.axis, rank)
        hot = idx[..., None] == np.arange(depth, dtype=np.int64)
        hot = np.moveaxis(hot, -1, axis)
        return np.where(hot, values[1], values[0]).astype(values.dtype, copy=False)


@register("OneHot", versions=[9])
class OneHot9(_OneHotBase):
    wrap_negative = False


@register("OneHot", versions=[11, 28])
class OneHot11(_OneHotBase):
    pass


@register("Compress", versions=[9, 11, 28])
class Compress(OpImpl):
    def run(self, x, condition):
        cond = np.asarray(condition).reshape(-1).astype(bool)
        if self.axis is None:
            flat = x.reshape(-1)
            if cond.shape[0] > flat.shape[0]:
                raise self.fail("condition is longer than the input")
            return flat[:cond.shape[0]][cond]
        axis = _norm_axis(self, self.axis, x.ndim)
        if cond.shape[0] > x.shape[axis]:
            raise self.fail(f"condition of length {cond.shape[0]} is longer than axis "
                            f"{axis} ({x.shape[axis]})")
        return np.compress(cond, x, axis=axis)


# ----------------------------------------------------------------------------- ReverseSequence

@register("ReverseSequence", versions=[10, 28])
class ReverseSequence(OpImpl):
    def run(self, x, sequence_lens):
        if x.ndim < 2:
            raise self.fail(f"input must have rank >= 2, got {x.ndim}")
        batch_axis = _norm_axis(self, self.batch_axis, x.ndim)
        time_axis = _norm_axis(self, self.time_axis, x.ndim)
        if batch_axis == time_axis:
            raise self.fail("batch_axis and time_axis must differ")
        lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
        n_batch, n_time = x.shape[batch_axis], x.shape[time_axis]
        if lens.shape[0] != n_batch:
            raise self.fail(f"sequence_lens has {lens.shape[0]} entries for batch {n_batch}")
        if (lens < 0).any() or (lens > n_time).any():
            raise self.fail(f"sequence_lens {lens.tolist()} out of range [0, {n_time}]")
        t = np.arange(n_time, dtype=np.int64)[None, :]
        src = np.where(t < lens[:, None], lens[:, None] - 1 - t, t)  # (batch, time)
        moved = np.moveaxis(x, (batch_axis, time_axis), (0, 1))
        out = moved[np.arange(n_batch)[:, None], src]
        return np.ascontiguousarray(np.moveaxis(out, (0, 1), (batch_axis, time_axis)))


# ----------------------------------------------------------------------------- Unique

@register("Unique", versions=[11, 28])
class Unique(OpImpl):
    def run(self, x):
        if self.axis is None:
            data, axis = x.reshape(-1), None
        else:
            axis = _norm_axis(self, self.axis, x.ndim)
            data = x
        y, first, inverse, counts = np.unique(data, return_index=True, return_inverse=True,
                                              return_counts=True, axis=axis)
        inverse = inverse.reshape(-1)
        if not self.sorted:
            order = np.argsort(first, kind="stable")  # unique values by first occurrence
            rank = np.empty_like(order)
            rank[order] = np.arange(order.shape[0])
            y = np.take(y, order, axis=0 if axis is None else axis)
            first, counts, inverse = first[order], counts[order], rank[inverse]
        i64 = np.int64
        return (y, first.astype(i64), inverse.astype(i64), counts.astype(i64))


# ----------------------------------------------------------------------------- TopK

def _topk(op: OpImpl, x: np.ndarray, k: int, axis: int, largest: bool):
    axis = _norm_axis(op, axis, x.ndim)
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise op.fail(f"k = {k} is out of range for an axis of size {n}")
    if largest:
        # Stable ascending sort of the reversed axis, read backwards: descending values,
        # ties in ascending original index.
        rev = np.flip(x, axis=axis)
        order = np.argsort(rev, axis=axis, kind="stable")
        order = np.flip(order, axis=axis)
        idx = (n - 1) - np.take(order, np.arange(k), axis=axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
        idx = np.take(order, np.arange(k), axis=axis)
    idx = idx.astype(np.int64, copy=False)
    return np.take_along_axis(x, idx, axis=axis), idx


@register("TopK", versions=[1])
class TopK1(OpImpl):
    def run(self, x):
        return _topk(self, x, self.k, self.axis, True)


@register("TopK", versions=[10])
class TopK10(OpImpl):
    def run(self, x, k):
        return _topk(self, x, _scalar_int(k), self.axis, True)


@register("TopK", versions=[11, 24])
class TopK11(OpImpl):
    def run(self, x, k):
        return _topk(self, x, _scalar_int(k), self.axis, bool(self.largest))


# ----------------------------------------------------------------------------- CumSum / CumProd

def _cumulative(op: OpImpl, ufunc, identity, x: np.ndarray, axis, exclusive: int,
                reverse: int) -> np.ndarray:
    if x.ndim == 0:
        raise op.fail("input must have rank >= 1")
    axis = _norm_axis(op, _scalar_int(axis), x.ndim)
    # Narrow floats (float16, bfloat16 and other ml_dtypes) accumulate in float32.
    acc_dtype = x.dtype if x.dtype.kind in "biuc" or (x.dtype.kind == "f" and x.dtype.itemsize
                                                      >= 4) else np.dtype(np.float32)
    data = x.astype(acc_dtype, copy=False)
    if reverse:
        data = np.flip(data, axis=axis)
    out = ufunc.accumulate(data, axis=axis, dtype=acc_dtype)
    if exclusive:
        shifted = np.empty_like(out)
        head = [slice(None)] * x.ndim
        head[axis] = slice(0, 1)
        rest = [slice(None)] * x.ndim
        rest[axis] = slice(1, None)
        body = [slice(None)] * x.ndim
        body[axis] = slice(0, -1)
        shifted[tuple(head)] = identity
        shifted[tuple(rest)] = out[tuple(body)]
        out = shifted
    if reverse:
        out = np.flip(out, axis=axis)
    return np.ascontiguousarray(out).astype(x.dtype, copy=False)


@register("CumSum", versions=[11, 14])
class CumSum(OpImpl):
    def run(self, x, axis):
        return _cumulative(self, np.add, 0, x, axis, self.exclusive, self.reverse)


@register("CumProd", versions=[26])
class CumProd(OpImpl):
    def run(self, x, axis):
        return _cumulative(self, np.multiply, 1, x, axis, self.exclusive, self.reverse)

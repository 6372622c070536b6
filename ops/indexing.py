"""Indexing ops: Gather, GatherElements, GatherND, Scatter, ScatterElements, ScatterND,
TensorScatter, NonZero, OneHot, Compress, ReverseSequence, Unique, TopK, CumSum, CumProd.

Kernels compute over `xp = self.xp` (numpy, or cupy on CUDA); the inputs listed in a class's
`shape_inputs` (TopK's k, CumSum's axis, OneHot's depth and values) are host numpy arrays."""
from __future__ import annotations

import numpy as np

from ember import limits
from ember.ops import _xp
from ember.ops.registry import OpImpl, register


# ----------------------------------------------------------------------------- helpers

def _norm_axis(op: OpImpl, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise op.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis + rank if axis < 0 else axis


def _scalar_int(value) -> int:
    """A one-element shape input (host data) as a Python int."""
    return int(np.asarray(value).reshape(-1)[0])


_FEW_INDICES = 16  # up to this many indices, `_fix_indices` tries Python's checks first


def _fix_indices(xp, op: OpImpl, indices, dim):
    """int64 indices with negatives wrapped; raises on out-of-range values.
    `dim` is a size, or a tuple of sizes for the last axis of `indices`."""
    idx = xp.asarray(indices).astype(np.int64, copy=False)
    if xp is np and idx.size <= _FEW_INDICES and np.ndim(dim) == 0 \
            and all(0 <= i < dim for i in idx.ravel().tolist()):
        # a few indices in range (a token's embedding row, an element of a shape): checked
        # in Python, several times faster than the whole-array steps below on tiny arrays
        return idx
    if idx.size:
        size = xp.asarray(dim, dtype=np.int64)
        bad = (idx < -size) | (idx >= size)
        if _xp.to_host(xp, bad.any()):
            first = int(_xp.to_host(xp, idx[bad].reshape(-1)[0]))
            raise op.fail(f"index {first} is out of bounds "
                          f"(dimension size {dim if np.ndim(dim) == 0 else list(dim)})")
        if _xp.to_host(xp, (idx < 0).any()):
            idx = xp.where(idx < 0, idx + size, idx)
    return idx


def _along_axis_index(xp, indices, axis: int) -> tuple:
    """Index tuple addressing data[i0, .., indices[i], .., in] for every position of indices."""
    grids = list(xp.ogrid[tuple(slice(0, d) for d in indices.shape)]) if indices.ndim else []
    grids[axis] = indices
    return tuple(grids)


_REDUCERS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_into(xp, op: OpImpl, out, index: tuple, updates, reduction: str):
    updates = xp.asarray(updates).astype(out.dtype, copy=False)
    if reduction == "none":
        out[index] = updates
        return out
    ufunc = _REDUCERS.get(reduction)
    if ufunc is None:
        raise op.fail(f"unknown reduction '{reduction}'")
    if xp is not np:
        return _scatter_reduce(xp, ufunc, out, index, updates)
    try:
        ufunc.at(out, index, updates)
    except TypeError:  # dtypes without ufunc.at loops (ml_dtypes, bool): go through float64/int
        wide = np.float64 if out.dtype.kind not in "iub" else np.int64
        tmp = out.astype(wide)
        ufunc.at(tmp, index, updates.astype(wide))
        out[...] = tmp.astype(out.dtype)
    return out


def _scatter_reduce(xp, ufunc, out, index: tuple, updates):
    """`ufunc.at(out, index, updates)` without ufunc.at, which cupy has for add, maximum and
    minimum on some dtypes only: the updates are sorted by target, each run of equal targets
    is combined by a segmented scan (log2(n) whole-array steps), and every target then gets
    its run's total once. `index` holds non-negative int arrays addressing the leading
    len(index) axes of `out`; `updates` has their broadcast shape + the remaining axes."""
    lead = out.shape[:len(index)]
    keys = xp.zeros((), dtype=np.int64)
    for i, d in zip(index, lead):  # flat position in the leading axes
        keys = keys * d + i
    shape = updates.shape[:updates.ndim - (out.ndim - len(index))]
    keys = xp.broadcast_to(keys, shape).reshape(-1)
    n = keys.shape[0]
    if n == 0:
        return out
    values = updates.reshape((n, -1))
    order = xp.argsort(keys)
    keys, values = keys[order], values[order]
    step = 1
    while step < n:  # values[i] <- ufunc over its run's elements i-2*step+1 .. i
        same = (keys[step:] == keys[:-step])[:, None]
        values[step:] = xp.where(same, ufunc(values[:-step], values[step:]), values[step:])
        step *= 2
    last = xp.ones(n, dtype=bool)
    last[:-1] = keys[1:] != keys[:-1]
    flat = out.reshape((int(np.prod(lead, dtype=np.int64)), -1))
    targets = keys[last]
    flat[targets] = ufunc(flat[targets], values[last]).astype(out.dtype, copy=False)
    return flat.reshape(out.shape)


# ----------------------------------------------------------------------------- Gather family

@register("Gather", versions=[1, 11, 13])
class Gather(OpImpl):
    index_inputs = {1: (0, "axis", 0)}

    def run(self, data, indices):
        xp = self.xp
        if 1 in self.constant_inputs:
            # indices that are a constant of the plan: checked once per data shape, kept as
            # one (shape, (axis, indices)) pair, which racing threads at worst both make
            kept = self.__dict__.get("_kept_index")
            if kept is None or kept[0] != data.shape:
                kept = self._kept_index = (data.shape, self._checked(xp, data, indices))
            axis, idx = kept[1]
        else:
            axis, idx = self._checked(xp, data, indices)
        return xp.take(data, idx, axis=axis)

    def _checked(self, xp, data, indices):
        axis = _norm_axis(self, self.axis, data.ndim)
        return axis, _fix_indices(xp, self, indices, data.shape[axis])


@register("GatherElements", versions=[11, 13])
class GatherElements(OpImpl):
    index_inputs = {1: (0, "axis", 0)}

    def run(self, data, indices):
        axis = _norm_axis(self, self.axis, data.ndim)
        if indices.ndim != data.ndim:
            raise self.fail(f"indices rank {indices.ndim} differs from data rank {data.ndim}")
        xp = self.xp
        idx = _fix_indices(xp, self, indices, data.shape[axis])
        return data[_along_axis_index(xp, idx, axis)]


def _gather_nd(xp, op: OpImpl, data, indices, b: int):
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
    idx = _fix_indices(xp, op, idx, data.shape[b:b + k])
    index = (xp.arange(batch)[:, None],) + tuple(idx[..., j] for j in range(k))
    out = d[index]
    return out.reshape(indices.shape[:-1] + data.shape[b + k:])


@register("GatherND", versions=[11])
class GatherND11(OpImpl):
    def run(self, data, indices):
        return _gather_nd(self.xp, self, data, indices, 0)


@register("GatherND", versions=[12, 13])
class GatherND12(OpImpl):
    def run(self, data, indices):
        return _gather_nd(self.xp, self, data, indices, self.batch_dims)


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
        xp = self.xp
        idx = _fix_indices(xp, self, indices, data.shape[axis])
        return _scatter_into(xp, self, data.copy(), _along_axis_index(xp, idx, axis), updates,
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
        xp = self.xp
        k = self.check_shapes(data, indices, updates)
        idx = _fix_indices(xp, self, indices.reshape(-1, k), data.shape[:k])
        upd = updates.reshape((idx.shape[0],) + data.shape[k:])
        index = tuple(idx[:, j] for j in range(k))
        return _scatter_into(xp, self, data.copy(), index, upd, self._reduction())


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
        xp = self.xp
        batch, cap, seq = past.shape[0], past.shape[axis], update.shape[axis]
        if write_indices is None:
            w = xp.zeros(batch, dtype=np.int64)
        else:
            w = xp.asarray(write_indices).astype(np.int64).reshape(-1)
            if w.shape[0] != batch:
                raise self.fail(f"write_indices has {w.shape[0]} entries for batch {batch}")
        pos = w[:, None] + xp.arange(seq, dtype=np.int64)[None, :]
        if self.mode == "circular":
            pos %= cap
        elif seq and _xp.to_host(xp, (pos < 0).any() | (pos >= cap).any()):
            raise self.fail(f"writes past the end of the cache (size {cap})")
        out = past.copy()
        view = xp.moveaxis(out, axis, 1)
        view[xp.arange(batch)[:, None], pos] = xp.moveaxis(update, axis, 1)
        return out


# ----------------------------------------------------------------------------- NonZero / OneHot / Compress

@register("NonZero", versions=[9, 13])
class NonZero(OpImpl):
    def run(self, x):
        xp = self.xp
        if x.ndim == 0:
            return xp.zeros((0, 1 if bool(_xp.to_host(xp, x)) else 0), dtype=np.int64)
        mask = x != 0 if x.dtype != object else x.astype(bool)
        return xp.stack(xp.nonzero(mask)).astype(np.int64, copy=False).reshape(x.ndim, -1)


class _OneHotBase(OpImpl):
    wrap_negative = True

    def run(self, indices, depth, values):
        # depth and values are shape inputs (host arrays); indices is tensor data
        xp = self.xp
        depth = np.asarray(depth).reshape(-1)[0]
        depth = int(depth)
        if depth < 0:
            raise self.fail(f"depth must be non-negative, got {depth}")
        limits.check_shape(tuple(indices.shape) + (depth,), np.asarray(values).dtype)
        values = np.asarray(values).reshape(-1)
        if values.shape[0] != 2:
            raise self.fail(f"values must have 2 entries, got {values.shape[0]}")
        idx = xp.asarray(indices)
        if idx.dtype.kind not in "iub":
            idx = xp.trunc(idx.astype(np.float64))
        idx = idx.astype(np.int64)
        if self.wrap_negative:
            idx = xp.where(idx < 0, idx + depth, idx)
        rank = idx.ndim + 1
        axis = _norm_axis(self, self.axis, rank)
        hot = idx[..., None] == xp.arange(depth, dtype=np.int64)
        hot = xp.moveaxis(hot, -1, axis)
        return xp.where(hot, values[1], values[0]).astype(values.dtype, copy=False)


@register("OneHot", versions=[9])
class OneHot9(_OneHotBase):
    shape_inputs = (1, 2)

    wrap_negative = False


@register("OneHot", versions=[11, 28])
class OneHot11(_OneHotBase):
    shape_inputs = (1, 2)

    pass


@register("Compress", versions=[9, 11, 28])
class Compress(OpImpl):
    def run(self, x, condition):
        xp = self.xp
        cond = xp.asarray(condition).reshape(-1).astype(bool)
        if self.axis is None:
            flat = x.reshape(-1)
            if cond.shape[0] > flat.shape[0]:
                raise self.fail("condition is longer than the input")
            return flat[:cond.shape[0]][cond]
        axis = _norm_axis(self, self.axis, x.ndim)
        if cond.shape[0] > x.shape[axis]:
            raise self.fail(f"condition of length {cond.shape[0]} is longer than axis "
                            f"{axis} ({x.shape[axis]})")
        return xp.compress(cond, x, axis=axis)


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
        xp = self.xp
        lens = xp.asarray(sequence_lens).astype(np.int64).reshape(-1)
        n_batch, n_time = x.shape[batch_axis], x.shape[time_axis]
        if lens.shape[0] != n_batch:
            raise self.fail(f"sequence_lens has {lens.shape[0]} entries for batch {n_batch}")
        if _xp.to_host(xp, (lens < 0).any() | (lens > n_time).any()):
            raise self.fail(f"sequence_lens {_xp.to_host(xp, lens).tolist()} out of range "
                            f"[0, {n_time}]")
        t = xp.arange(n_time, dtype=np.int64)[None, :]
        src = xp.where(t < lens[:, None], lens[:, None] - 1 - t, t)  # (batch, time)
        moved = xp.moveaxis(x, (batch_axis, time_axis), (0, 1))
        out = moved[xp.arange(n_batch)[:, None], src]
        return xp.ascontiguousarray(xp.moveaxis(out, (0, 1), (batch_axis, time_axis)))


# ----------------------------------------------------------------------------- Unique

@register("Unique", versions=[11, 28])
class Unique(OpImpl):
    def run(self, x):
        xp = self.xp
        if self.axis is None:
            data, axis = x.reshape(-1), None
        else:
            axis = _norm_axis(self, self.axis, x.ndim)
            data = x
        y, first, inverse, counts = xp.unique(data, return_index=True, return_inverse=True,
                                              return_counts=True, axis=axis)
        inverse = inverse.reshape(-1)
        if not self.sorted:
            order = _stable_argsort(xp, first)  # unique values by first occurrence
            rank = xp.empty_like(order)
            rank[order] = xp.arange(order.shape[0])
            y = xp.take(y, order, axis=0 if axis is None else axis)
            first, counts, inverse = first[order], counts[order], rank[inverse]
        i64 = np.int64
        return (y, first.astype(i64), inverse.astype(i64), counts.astype(i64))


# ----------------------------------------------------------------------------- TopK

def _stable_argsort(xp, a, axis: int = -1):
    """`np.argsort(a, axis, kind="stable")`; cupy's argsort is always stable and accepts no
    `kind`."""
    if xp is np:
        return np.argsort(a, axis=axis, kind="stable")
    return xp.argsort(a, axis=axis)


def _topk(xp, op: OpImpl, x, k: int, axis: int, largest: bool):
    axis = _norm_axis(op, axis, x.ndim)
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise op.fail(f"k = {k} is out of range for an axis of size {n}")
    if largest:
        # Stable ascending sort of the reversed axis, read backwards: descending values,
        # ties in ascending original index.
        rev = xp.flip(x, axis=axis)
        order = _stable_argsort(xp, rev, axis=axis)
        order = xp.flip(order, axis=axis)
        idx = (n - 1) - xp.take(order, xp.arange(k), axis=axis)
    else:
        order = _stable_argsort(xp, x, axis=axis)
        idx = xp.take(order, xp.arange(k), axis=axis)
    idx = idx.astype(np.int64, copy=False)
    return xp.take_along_axis(x, idx, axis=axis), idx


@register("TopK", versions=[1])
class TopK1(OpImpl):
    def run(self, x):
        return _topk(self.xp, self, x, self.k, self.axis, True)


@register("TopK", versions=[10])
class TopK10(OpImpl):
    shape_inputs = (1,)

    def run(self, x, k):
        return _topk(self.xp, self, x, _scalar_int(k), self.axis, True)


@register("TopK", versions=[11, 24])
class TopK11(OpImpl):
    shape_inputs = (1,)

    def run(self, x, k):
        return _topk(self.xp, self, x, _scalar_int(k), self.axis, bool(self.largest))


# ----------------------------------------------------------------------------- CumSum / CumProd

def _cumulative(xp, op: OpImpl, accumulate, identity, x, axis, exclusive: int, reverse: int):
    """`accumulate` is xp.cumsum or xp.cumprod (numpy's add/multiply.accumulate; cupy's
    ufuncs have no accumulate); `axis` is a shape input (host)."""
    if x.ndim == 0:
        raise op.fail("input must have rank >= 1")
    axis = _norm_axis(op, _scalar_int(axis), x.ndim)
    # Narrow floats (float16, bfloat16 and other ml_dtypes) accumulate in float32.
    acc_dtype = x.dtype if x.dtype.kind in "biuc" or (x.dtype.kind == "f" and x.dtype.itemsize
                                                      >= 4) else np.dtype(np.float32)
    data = x.astype(acc_dtype, copy=False)
    if reverse:
        data = xp.flip(data, axis=axis)
    out = accumulate(data, axis=axis, dtype=acc_dtype)
    if exclusive:
        shifted = xp.empty_like(out)
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
        out = xp.flip(out, axis=axis)
    return xp.ascontiguousarray(out).astype(x.dtype, copy=False)


@register("CumSum", versions=[11, 14])
class CumSum(OpImpl):
    shape_inputs = (1,)

    def run(self, x, axis):
        return _cumulative(self.xp, self, self.xp.cumsum, 0, x, axis, self.exclusive,
                           self.reverse)


@register("CumProd", versions=[26])
class CumProd(OpImpl):
    shape_inputs = (1,)

    def run(self, x, axis):
        return _cumulative(self.xp, self, self.xp.cumprod, 1, x, axis, self.exclusive,
                           self.reverse)

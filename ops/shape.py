"""Data movement and shape ops: Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Expand, Tile,
Concat, Split, Slice, Pad, DepthToSpace, SpaceToDepth, CenterCropPad.

Ops that only reinterpret the layout (Reshape, Flatten, Squeeze, Unsqueeze, Slice) return
views of their input; kernels never write into their inputs, so sharing memory is safe.
Kernels compute over `xp = self.xp` (numpy, or cupy on CUDA); shape data (shapes, axes, pads,
repeats: each class's `shape_inputs`) are host numpy arrays on every backend.
"""
from __future__ import annotations

import math

import numpy as np

from ember import limits
from ember.ops.cpu import compiled as _compiled, tiles as _tiles, tuning
from ember.ops._layout import as_run, channels_last, memory_order, memory_span, pixel_stride
from ember.ops.registry import Lowering, PORTABLE, OpImpl, register


# ----------------------------------------------------------------------------- helpers

def _ints(value) -> list[int]:
    """A shape/axes/pads tensor (a shape input: host data) or attribute list, as a list of
    Python ints."""
    if value is None:
        return []
    return [int(v) for v in np.asarray(value).reshape(-1)]


def _scalar_int(value) -> int:
    return int(np.asarray(value).reshape(-1)[0])


def _norm_axis(op: OpImpl, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise op.fail(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis + rank if axis < 0 else axis


def _norm_axes(op: OpImpl, axes, rank: int) -> list[int]:
    out = [_norm_axis(op, int(a), rank) for a in axes]
    if len(set(out)) != len(out):
        raise op.fail(f"repeated axes {list(axes)}")
    return out


_MEMO_MAX = 64  # keys remembered per node; a dynamic axis may bring a new one every run


def _remembered(op: OpImpl, key, make, *args):
    """make(*args), remembered on `op` per `key` (an input's shape and whatever else decides
    the result): for work that depends on nothing else, so that a node does it once per
    geometry rather than once per run. Racing threads at worst both make it."""
    memo = op.__dict__.get("_memo")
    if memo is None or len(memo) > _MEMO_MAX:
        memo = op._memo = {}
    value = memo.get(key)
    if value is None:
        value = memo[key] = make(*args)
    return value


def _fixed_inputs(op: OpImpl) -> bool:
    """Whether every input of `op` after the first that the node gives is a constant of the
    plan (OpImpl.constant_inputs, set once the plan has bound the op): what they decide is
    then fixed per shape of the first."""
    fixed = op.__dict__.get("_inputs_fixed")
    if fixed is None:
        fixed = op._inputs_fixed = all(i in op.constant_inputs
                                       for i in range(1, op.n_inputs) if op.node.inputs[i])
    return fixed


# ----------------------------------------------------------------------------- Reshape

class _ViewOp(OpImpl):
    """Reshape, Squeeze, Unsqueeze: the input as a view with other dims. When what says the
    dims is an attribute, or an input (index 1) that is a constant of the plan, the dims
    depend on the input's shape alone, so they are worked out once per shape and remembered."""

    _dims_in_attributes = False  # the opset-1/11 forms: axes or shape as attributes

    def _view(self, x, dims_of, param=None):
        """x reshaped to `dims_of(x.shape, param)`, remembered per shape where the dims are
        fixed for the plan (`_remembered`)."""
        if not (self._dims_in_attributes or 1 in self.constant_inputs):
            return x.reshape(dims_of(x.shape, param))
        return x.reshape(_remembered(self, x.shape, _dims_tuple, dims_of, x.shape, param))


def _dims_tuple(dims_of, shape, param) -> tuple[int, ...]:
    return tuple(dims_of(shape, param))


def _reshape_dims(op: OpImpl, in_shape: tuple, shape: list[int], allowzero: int) -> list[int]:
    new = list(shape)
    rank, size = len(in_shape), math.prod(in_shape)
    if not allowzero:
        for i, d in enumerate(new):
            if d == 0:
                if i >= rank:
                    raise op.fail(f"shape {shape}: a 0 at position {i} copies a dimension the "
                                  f"input (rank {rank}) does not have")
                new[i] = in_shape[i]
    if new.count(-1) > 1:
        raise op.fail(f"shape {shape} has more than one -1")
    if any(d < -1 for d in new):
        raise op.fail(f"shape {shape} has a negative dimension")
    # products in Python ints: an int64 product of hostile dims wraps around (2 * (2**63-1)
    # is -2) and would pass the checks
    if -1 in new:
        known = math.prod(d for d in new if d != -1)
        if known == 0 or size % known:
            raise op.fail(f"cannot reshape a tensor of shape {in_shape} to {shape}")
        new[new.index(-1)] = size // known
    if math.prod(new) != size:
        raise op.fail(f"cannot reshape a tensor of shape {in_shape} to {shape}")
    return new


@register("Reshape", versions=[1])
class Reshape1(_ViewOp):
    _dims_in_attributes = True

    def setup(self):
        if self.shape is None:
            raise self.fail("Reshape-1 needs the 'shape' attribute")

    def run(self, x):
        return self._view(x, self._dims)

    def _dims(self, in_shape, _):
        return _reshape_dims(self, in_shape, list(self.shape), 0)


@register("Reshape", versions=[5, 13, 14, 19, 21, 23, 24, 25])
class Reshape5(_ViewOp):
    shape_inputs = (1,)

    def setup(self):
        self._allowzero = int(getattr(self, "allowzero", 0) or 0)

    def run(self, x, shape):
        return self._view(x, self._dims, shape)

    def _dims(self, in_shape, shape):
        return _reshape_dims(self, in_shape, _ints(shape), self._allowzero)


# ----------------------------------------------------------------------------- Flatten

@register("Flatten", versions=[1, 9, 11, 13, 21, 23, 24, 25])
class Flatten(OpImpl):
    def run(self, x):
        axis = self.axis
        if not -x.ndim <= axis <= x.ndim:
            raise self.fail(f"axis {axis} is out of range for a tensor of rank {x.ndim}")
        if axis < 0:
            axis += x.ndim
        outer = int(np.prod(x.shape[:axis], dtype=np.int64))
        inner = int(np.prod(x.shape[axis:], dtype=np.int64))
        return x.reshape(outer, inner)


# ----------------------------------------------------------------------------- Squeeze / Unsqueeze

def _squeeze_dims(op: OpImpl, in_shape: tuple, axes) -> list[int]:
    if axes is None or len(axes) == 0:  # no axes (or an empty list): drop every 1-sized dim
        return [d for d in in_shape if d != 1]
    axes = _norm_axes(op, axes, len(in_shape))
    for a in axes:
        if in_shape[a] != 1:
            raise op.fail(f"cannot squeeze axis {a} of size {in_shape[a]}")
    return [d for i, d in enumerate(in_shape) if i not in axes]


def _unsqueeze_dims(op: OpImpl, in_shape: tuple, axes) -> list[int]:
    out_rank = len(in_shape) + len(axes)
    axes = set(_norm_axes(op, axes, out_rank))
    dims = iter(in_shape)
    return [1 if i in axes else next(dims) for i in range(out_rank)]


@register("Squeeze", versions=[1, 11])
class Squeeze1(_ViewOp):
    _dims_in_attributes = True

    def run(self, x):
        return self._view(x, self._dims)

    def _dims(self, in_shape, _):
        return _squeeze_dims(self, in_shape, self.axes)


@register("Squeeze", versions=[13, 21, 23, 24, 25])
class Squeeze13(_ViewOp):
    shape_inputs = (1,)

    def run(self, x, axes=None):
        return self._view(x, self._dims, axes)

    def _dims(self, in_shape, axes):
        return _squeeze_dims(self, in_shape, None if axes is None else _ints(axes))


@register("Unsqueeze", versions=[1, 11])
class Unsqueeze1(_ViewOp):
    _dims_in_attributes = True

    def run(self, x):
        return self._view(x, self._dims)

    def _dims(self, in_shape, _):
        return _unsqueeze_dims(self, in_shape, self.axes or [])


@register("Unsqueeze", versions=[13, 21, 23, 24, 25])
class Unsqueeze13(_ViewOp):
    shape_inputs = (1,)

    def run(self, x, axes):
        return self._view(x, self._dims, axes)

    def _dims(self, in_shape, axes):
        return _unsqueeze_dims(self, in_shape, _ints(axes))


# ----------------------------------------------------------------------------- Transpose

@register("Transpose", versions=[1, 13, 21, 23, 24, 25])
class Transpose(OpImpl):
    def setup(self):
        # what can be checked before the rank is known: perm holds each of 0..len(perm)-1
        # once (the ONNX spec allows no negative entries)
        if self.perm is not None:
            perm = list(self.perm)
            if not all(isinstance(p, (int, np.integer)) for p in perm) or \
                    sorted(perm) != list(range(len(perm))):
                raise self.fail(f"perm {perm} is not a permutation of 0..{len(perm) - 1}")

    def run(self, x):
        if self.perm is None:
            perm = list(range(x.ndim))[::-1]
        else:
            perm = list(self.perm)
            if len(perm) != x.ndim:
                raise self.fail(f"perm {perm} has {len(perm)} entries for a tensor of rank "
                                f"{x.ndim}")
        y = x.transpose(perm)
        if y.flags.c_contiguous and y.ndim:
            # already laid out so (a channels-last kernel's result taken to NHWC): a view,
            # as Reshape's results are
            return y
        if self.xp is np and channels_last(y):
            # NHWC taken back to NCHW (ConvNeXt's blocks): the channels-last view the CPU
            # convolutions return and take as they are, and elementwise ops keep
            return y
        if x.ndim >= 2 and perm == list(range(x.ndim - 2)) + [x.ndim - 1, x.ndim - 2]:
            return swap_last_axes(self.xp, x)
        if self.xp is np:
            kept = _in_source_order(self, x, y, perm)
            if kept is not None:
                return kept
        return y.copy()  # copy() keeps 0-d arrays 0-d


def _in_source_order(op, x, y, perm):
    """The transpose y of x copied into memory in x's order of axes, where x is dense in an
    order other than C's (a channels-last image, or a view of one) and the permutation moves
    only its innermost axes in memory, those taking their places in y's own order: a channel
    shuffle (Reshape, Transpose, Reshape) of a channels-last image stays channels-last, where
    a C-ordered copy made it planar and the convolutions after it left their fast routes.
    None otherwise (a transpose of attention's heads keeps its C-ordered copy, which the
    products after it read best), or without numba. Worked out once per geometry of x."""
    if x.flags.c_contiguous:
        return None
    plan = _remembered(op, (x.shape, x.strides, x.dtype), _source_order_plan, x, y, perm)
    if not plan:
        return None
    memory, back, rows = plan
    source = y.transpose(memory)   # y's values in the copy's order: a gather of x's memory
    out = _tiles.empty(source.shape, source.dtype)
    # numpy's copy ran an inner loop per pair of a shuffle's values: several times slower
    _compiled.jit(_gather_rows)(source.reshape(rows), out.reshape(rows), 0, rows[0])
    return out.transpose(back)


def _source_order_plan(x, y, perm):
    """(the copy's axes of y in memory order, the transpose back, its three-axis shape) for
    `_in_source_order`, or False (remembered too: the C-ordered copy serves)."""
    order = memory_order((x,))
    if order is None or _compiled.jit(_gather_rows) is None:
        return False
    moved = [axis for i, axis in enumerate(perm) if axis != i]
    if set(moved) != set(order[len(order) - len(moved):]):
        return False   # not a reordering of the innermost axes (a shuffle of the channels)
    theirs = iter(sorted(perm.index(axis) for axis in moved))   # y's axes, in y's order
    memory = [next(theirs) if axis in moved else perm.index(axis) for axis in order]
    rows = _three_axes(y.transpose(memory))
    if rows is None:
        return False
    return tuple(memory), tuple(int(a) for a in np.argsort(memory)), rows


def _three_axes(view) -> tuple[int, int, int] | None:
    """A shape of at most three axes `view` reshapes to without a copy (its size-1 axes
    dropped, neighbours that are one run of memory merged; leading ones of size 1 added), or
    None where it takes more."""
    shape, strides = [], []
    for n, st in zip(view.shape, view.strides):
        if n == 1:
            continue
        if shape and strides[-1] == n * st:
            shape[-1] *= n
            strides[-1] = st
        else:
            shape.append(n)
            strides.append(st)
    if len(shape) > 3:
        return None
    return tuple([1] * (3 - len(shape)) + shape)


@_compiled.kernel_math
def _gather_rows(source, out, row0, row1):  # pragma: no cover - numba
    """out[r] = source[r] for rows [row0, row1) of a strided 3-axis `source`, the inner loop
    along whichever of the last two axes reads memory in order (a shuffle's 2 groups are
    the short one)."""
    if source.strides[1] <= source.strides[2]:
        for r in range(row0, row1):
            for j in range(source.shape[2]):
                for i in range(source.shape[1]):
                    out[r, i, j] = source[r, i, j]
    else:
        for r in range(row0, row1):
            for i in range(source.shape[1]):
                for j in range(source.shape[2]):
                    out[r, i, j] = source[r, i, j]


def swap_last_axes(xp, x):
    """x with its last two axes swapped, as a new C-contiguous array. numpy's copy of a
    transposed view reads one element per cache line on large matrices; copying a band of
    rows (TRANSPOSE_BLOCK) at a time is much faster on a large weight (an unsimplified model
    transposes its weights on every run). The banded copy is a CPU cache optimisation: other
    namespaces copy the whole view at once."""
    rows, cols = x.shape[-2:] if x.ndim >= 2 else (0, 0)
    block = tuning.TRANSPOSE_BLOCK
    if xp is not np or rows < 2 * block or cols < 2 * block:
        return xp.swapaxes(x, -1, -2).copy()
    out = np.empty(x.shape[:-2] + (cols, rows), x.dtype)
    for lo in range(0, rows, block):
        band = x[..., lo:lo + block, :]
        out[..., lo:lo + block] = np.swapaxes(band, -1, -2)
    return out


# ----------------------------------------------------------------------------- Expand / Tile

@register("Expand", versions=[8, 13])
class Expand(OpImpl):
    shape_inputs = (1,)

    def run(self, x, shape):
        shape = _ints(shape)
        if any(d < 0 for d in shape):
            raise self.fail(f"shape {shape} has a negative dimension")
        target = _broadcast_or_none(x.shape, tuple(shape))
        if target is None:  # raised here, not in an except: the error is ours, not numpy's
            raise self.fail(f"cannot broadcast shape {x.shape} to {shape}")
        limits.check_shape(target, x.dtype)
        if target == x.shape:
            return x.copy()
        return self.xp.broadcast_to(x, target).copy()


def _broadcast_or_none(*shapes) -> tuple | None:
    """The shape `shapes` broadcast to, or None where they do not broadcast."""
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        return None


@register("Tile", versions=[1])
class Tile1(OpImpl):
    shape_inputs = (1,)

    def run(self, x, tiles, axis):
        axis = _norm_axis(self, _scalar_int(axis), x.ndim)
        reps = [1] * x.ndim
        reps[axis] = _scalar_int(tiles)
        if reps[axis] < 0:
            raise self.fail(f"negative tiles {reps[axis]}")
        return _tile(self, x, reps)


@register("Tile", versions=[6, 13])
class Tile6(OpImpl):
    shape_inputs = (1,)

    def run(self, x, repeats):
        reps = _ints(repeats)
        if len(reps) != x.ndim:
            raise self.fail(f"repeats has {len(reps)} entries for a tensor of rank {x.ndim}")
        if any(r < 0 for r in reps):
            raise self.fail(f"negative repeats {reps}")
        return _tile(self, x, reps)


def _tile(op: OpImpl, x, reps: list[int]):
    limits.check_shape([d * r for d, r in zip(x.shape, reps)], x.dtype)
    return op.xp.tile(x, reps)


# ----------------------------------------------------------------------------- Concat

_CONCAT_CHANNELS_LAST = Lowering("cpu.compiled", "written channels-last, two float32 inputs "
                                 "pixel by pixel on the threads")


@register("Concat", versions=[1, 4, 11, 13])
class Concat(OpImpl):
    def lower(self, inputs):
        if inputs and all(x is not None and x.ndim == 4 for x in inputs) \
                and int(self.axis) in (1, -3):
            return Lowering("by layout", "channels-last inputs concatenated channels-last "
                            "(two float32 ones pixel by pixel on the threads); else numpy")
        return PORTABLE

    def run(self, *xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            raise self.fail("no inputs")
        axis = 1 if self.axis is None else self.axis
        axis = _norm_axis(self, axis, xs[0].ndim)
        pixels = self.xp is np and axis == 1 and _mostly_channels_last(xs)
        self._chosen = _CONCAT_CHANNELS_LAST if pixels else PORTABLE
        if pixels:
            return _concat_channels_last(xs)
        try:
            return self.xp.concatenate(xs, axis=axis)
        except ValueError as exc:
            raise self.fail(f"inputs of shapes {[x.shape for x in xs]} cannot be "
                            f"concatenated on axis {axis}: {exc}") from None


def _mostly_channels_last(xs) -> bool:
    """Whether 4-D images concatenated along their channels are mostly channels-last views
    (the CPU convolutions' results, or channel slices of one: a Split's parts), with
    matching shapes and one dtype."""
    first = xs[0]
    if first.ndim != 4 or any(x.ndim != 4 or x.dtype != first.dtype or
                              x.shape[0] != first.shape[0] or x.shape[2:] != first.shape[2:]
                              for x in xs):
        return False
    return 2 * sum(x.size for x in xs if _pixels_apart(x)) >= sum(x.size for x in xs)


def _pixels_apart(x) -> bool:
    """Whether x's pixels each hold their channels in a run, evenly spaced, and not also a
    planar image (one channel, or one pixel)."""
    return not x.flags.c_contiguous and pixel_stride(x) is not None


def _concat_channels_last(xs):
    """The channel concatenation written channels-last, returned as a (N, C, H, W) view: each
    input whose pixels hold their channels in a run (`_pixels_apart`) is copied pixel by
    pixel on the run's threads, each thread its own rows (`_copy_pixels`), where numpy's
    channels-first result made a transposing copy of it (UNet's skip connections, a C2f
    block's Split parts and bottlenecks); any other input by numpy."""
    N, _, H, W = xs[0].shape
    out = _tiles.empty((N, H, W, sum(x.shape[1] for x in xs)), xs[0].dtype)
    rows = out.reshape(N * H * W, -1)
    kernel = _compiled.jit(_copy_pixels) if xs[0].dtype == np.float32 else None
    c0 = 0
    for x in xs:
        step = pixel_stride(x) if kernel is not None and not x.flags.c_contiguous else None
        if step is None:
            out[..., c0:c0 + x.shape[1]] = x.transpose(0, 2, 3, 1)
        else:   # x's memory from its first value to its last, as one run
            _compiled.split_rows(kernel, rows.shape[0], as_run(x, memory_span(x)), step,
                                 x.shape[1], rows, c0,
                                 ns_per_row=tuning.CONCAT_NS_PER_VALUE * x.shape[1],
                                 piece=_copy_pixels_piece)
        c0 += x.shape[1]
    return out.transpose(0, 3, 1, 2)


# numpy's copy into the channels of a channels-last result runs one short inner loop per
# pixel: this kernel copies a pixel's channels in one go.


@_compiled.kernel_math
def _copy_pixels(src, step, width, out, c0, row0, row1):  # pragma: no cover - numba
    """Pixels [row0, row1) of out (pixels, C), its channels [c0, c0 + width): pixel r's
    `width` values at src[r * step] on."""
    for r in range(row0, row1):
        # loops over slices indexed from 0: an index numba cannot prove non-negative keeps
        # the loop scalar (slice assignment costs a call a row)
        values, dst = src[r * step:r * step + width], out[r, c0:c0 + width]
        for c in range(width):
            dst[c] = values[c]


def _copy_pixels_piece(block, row0, row1):  # pragma: no cover - numba
    """_copy_pixels' piece function (ops/cpu/compiled.py), its arguments from the block."""
    v = _compiled.array_at(block, (8,), np.int64)
    _copy_pixels(_compiled.array_at(v[0], (v[1],), np.float32), v[2], v[3],
                 _compiled.array_at(v[4], (v[5], v[6]), np.float32), v[7], row0, row1)


# ----------------------------------------------------------------------------- Split

def _split(op: OpImpl, x: np.ndarray, axis: int, sizes: list[int] | None, n: int):
    axis = _norm_axis(op, axis, x.ndim)
    dim = x.shape[axis]
    if sizes is None:
        if dim % n:
            raise op.fail(f"axis of size {dim} cannot be split into {n} equal parts")
        sizes = [dim // n] * n
    else:
        if len(sizes) != n:
            raise op.fail(f"split {sizes} has {len(sizes)} entries for {n} outputs")
        if sum(sizes) != dim or any(s < 0 for s in sizes):
            raise op.fail(f"split {sizes} does not add up to the axis size {dim}")
    bounds = np.cumsum([0] + list(sizes))
    index = [slice(None)] * x.ndim
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        index[axis] = slice(int(lo), int(hi))
        parts.append(x[tuple(index)])
    return tuple(parts)


@register("Split", versions=[1])
class Split1(OpImpl):
    shape_inputs = (1,)

    def run(self, x, split=None):
        sizes = _ints(split) if split is not None else (list(self.split) if self.split else None)
        return _split(self, x, self.axis or 0, sizes, self.n_outputs)


@register("Split", versions=[2, 11])
class Split2(OpImpl):
    shape_inputs = (1,)

    def run(self, x):
        return _split(self, x, self.axis, list(self.split) if self.split else None,
                      self.n_outputs)


@register("Split", versions=[13])
class Split13(OpImpl):
    shape_inputs = (1,)

    def run(self, x, split=None):
        sizes = _ints(split) if split is not None and np.size(split) else None
        return _split(self, x, self.axis, sizes, self.n_outputs)


@register("Split", versions=[18])
class Split18(OpImpl):
    shape_inputs = (1,)

    def setup(self):
        # the spec ties num_outputs to the node's outputs; checked here, so a hostile 2**31
        # never becomes a list of 2**31 split sizes
        if self.num_outputs is not None and self.num_outputs != self.n_outputs:
            raise self.fail(f"num_outputs is {self.num_outputs} but the node has "
                            f"{self.n_outputs} output(s); they must be equal")

    def run(self, x, split=None):
        if split is not None and np.size(split):
            if self.num_outputs is not None:
                raise self.fail("both the 'split' input and 'num_outputs' are given")
            return _split(self, x, self.axis, _ints(split), self.n_outputs)
        n = self.num_outputs if self.num_outputs is not None else self.n_outputs
        axis = _norm_axis(self, self.axis, x.ndim)
        dim = x.shape[axis]
        chunk = -(-dim // n)
        sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
        return _split(self, x, axis, sizes, n)


# ----------------------------------------------------------------------------- Slice

def _slice(op: OpImpl, x: np.ndarray, starts, ends, axes, steps) -> np.ndarray:
    return x[_slice_index(op, x.shape, starts, ends, axes, steps)]


def _slice_index(op: OpImpl, shape: tuple[int, ...], starts, ends, axes, steps) -> tuple:
    """The index tuple that takes Slice's view of a tensor of `shape`."""
    starts, ends = _ints(starts), _ints(ends)
    if len(starts) != len(ends):
        raise op.fail(f"starts {starts} and ends {ends} differ in length")
    axes = list(range(len(starts))) if axes is None else _ints(axes)
    steps = [1] * len(starts) if steps is None else _ints(steps)
    if not len(axes) == len(steps) == len(starts):
        raise op.fail("starts, ends, axes and steps differ in length")
    axes = _norm_axes(op, axes, len(shape))
    index = [slice(None)] * len(shape)
    for a, start, end, step in zip(axes, starts, ends, steps):
        dim = shape[a]
        if step == 0:
            raise op.fail("a step of 0")
        if start < 0:
            start += dim
        if end < 0:
            end += dim
        if step > 0:
            start = min(max(start, 0), dim)
            end = min(max(end, 0), dim)
            index[a] = slice(start, end, step)
        else:
            start = min(max(start, 0), dim - 1)
            end = min(max(end, -1), dim - 1)
            index[a] = slice(start, end if end >= 0 else None, step)
    return tuple(index)


@register("Slice", versions=[1])
class Slice1(OpImpl):
    def run(self, x):  # the bounds are attributes: the index is fixed per input shape
        return x[_remembered(self, x.shape, _slice_index, self, x.shape, self.starts,
                             self.ends, self.axes, None)]


@register("Slice", versions=[10, 11, 13])
class Slice10(OpImpl):
    shape_inputs = (1, 2, 3, 4)

    def run(self, x, starts, ends, axes=None, steps=None):
        if not _fixed_inputs(self):
            return _slice(self, x, starts, ends, axes, steps)
        # bounds that are constants of the plan: converting them to ints was most of the
        # kernel's time, so the index is worked out once per input shape
        return x[_remembered(self, x.shape, _slice_index, self, x.shape, starts, ends, axes,
                             steps)]


# ----------------------------------------------------------------------------- Pad

def _pad(xp, op: OpImpl, x, pads: list[int], mode: str, value, axes=None):
    """`value` is a host value (an attribute, or the constant_value shape input)."""
    rank = x.ndim
    axes = list(range(rank)) if axes is None else _norm_axes(op, axes, rank)
    if len(pads) != 2 * len(axes):
        raise op.fail(f"pads {pads} should have {2 * len(axes)} entries")
    n = len(axes)
    before, after = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        before[a], after[a] = pads[i], pads[i + n]
    # Negative pads crop.
    if any(p < 0 for p in before + after):
        index = tuple(slice(-min(b, 0), x.shape[i] + min(e, 0) if x.shape[i] + min(e, 0) > 0
                            else 0) for i, (b, e) in enumerate(zip(before, after)))
        x = x[index]
        before = [max(b, 0) for b in before]
        after = [max(e, 0) for e in after]
    if not any(before) and not any(after):
        return x.copy()
    shape = tuple(d + b + e for d, b, e in zip(x.shape, before, after))
    limits.check_shape(shape, x.dtype)  # pads are data: checked before padding
    if mode == "constant":
        if value is None:
            fill = "" if x.dtype == object else 0
        else:
            fill = np.asarray(value).reshape(-1)
            fill = fill[0] if fill.size else ("" if x.dtype == object else 0)
        fill = np.asarray(fill).astype(x.dtype)[()] if x.dtype != object else fill
        out = xp.full(shape, fill, dtype=x.dtype)
        out[tuple(slice(b, b + d) for b, d in zip(before, x.shape))] = x
        return out
    if mode in ("reflect", "edge", "wrap"):
        for a in range(rank):
            if (before[a] or after[a]) and x.shape[a] == 0:
                raise op.fail(f"cannot {mode}-pad an empty axis {a}")
        if xp is np:
            for a, index in _remembered(op, (x.shape, tuple(before), tuple(after), mode),
                                        _pad_indices, x.shape, before, after, mode):
                x = x.take(index, axis=a)
            return x
        for a in range(rank):
            if mode == "reflect" and (before[a] or after[a]) and x.shape[a] == 1:
                mode_a = "edge"  # reflecting a single element repeats it
                x = xp.pad(x, [(before[a], after[a]) if i == a else (0, 0)
                               for i in range(rank)], mode=mode_a)
                before[a] = after[a] = 0
        return xp.pad(x, list(zip(before, after)), mode=mode)
    raise op.fail(f"unknown mode '{mode}'")


def _pad_indices(shape: tuple[int, ...], before: list[int], after: list[int],
                 mode: str) -> tuple[tuple[int, np.ndarray], ...]:
    """For a reflect, edge or wrap pad: (axis, source index of each output position) per
    padded axis, so that the pad is a gather along each (np.take: a few microseconds where
    np.pad takes tens on a small tensor). The indices are np.pad's own, of an arange: the
    same rule, pads longer than the axis included; reflecting a single element repeats it."""
    return tuple(
        (a, np.pad(np.arange(n), (b, e), mode="edge" if mode == "reflect" and n == 1 else mode))
        for a, (n, b, e) in enumerate(zip(shape, before, after)) if b or e)


def _fixed_pad(shape: tuple[int, ...], pads, mode: str):
    """For a reflect, edge or wrap pad by pads that are constants of the plan: `_pad`'s
    gathers (`_pad_indices`) and the output's shape, worked out once per input shape; False
    where `_pad` has more to do (pads that crop or pad nothing, an empty axis, pads of the
    wrong length: its errors), so that it runs as it is."""
    pads = _ints(pads)
    rank = len(shape)
    if len(pads) != 2 * rank or any(p < 0 for p in pads) or not any(pads) or \
            any((pads[a] or pads[a + rank]) and shape[a] == 0 for a in range(rank)):
        return False
    before, after = pads[:rank], pads[rank:]
    out = tuple(d + b + e for d, b, e in zip(shape, before, after))
    return out, _pad_indices(shape, before, after, mode)


def _gathered(x, gathers):
    """`_pad`'s reflect, edge or wrap pad by `_fixed_pad`'s gathers: the same takes."""
    shape, indices = gathers
    limits.check_shape(shape, x.dtype)  # against the running session's cap, as `_pad` does
    for a, index in indices:
        x = x.take(index, axis=a)
    return x


@register("Pad", versions=[1])
class Pad1(OpImpl):
    def run(self, x):
        return _pad(self.xp, self, x, list(self.paddings), self.mode, self.value)


@register("Pad", versions=[2])
class Pad2(OpImpl):
    def run(self, x):
        return _pad(self.xp, self, x, list(self.pads), self.mode, self.value)


@register("Pad", versions=[11, 13])
class Pad11(OpImpl):
    shape_inputs = (1, 2, 3)

    def setup(self):
        if self.mode not in ("constant", "reflect", "edge"):
            raise self.fail(f"unknown mode '{self.mode}'")

    def run(self, x, pads, constant_value=None):
        if self.mode != "constant" and self.xp is np and _fixed_inputs(self):
            gathers = _remembered(self, x.shape, _fixed_pad, x.shape, pads, self.mode)
            if gathers:
                return _gathered(x, gathers)
        return _pad(self.xp, self, x, _ints(pads), self.mode, constant_value)


@register("Pad", versions=[18])
class Pad18(Pad11):
    shape_inputs = (1, 2, 3)

    def run(self, x, pads, constant_value=None, axes=None):
        if axes is None and self.mode != "constant" and self.xp is np and _fixed_inputs(self):
            gathers = _remembered(self, x.shape, _fixed_pad, x.shape, pads, self.mode)
            if gathers:
                return _gathered(x, gathers)
        return _pad(self.xp, self, x, _ints(pads), self.mode, constant_value,
                    None if axes is None else _ints(axes))


@register("Pad", versions=[19, 21, 23, 24, 25])
class Pad19(Pad18):
    shape_inputs = (1, 2, 3)

    def setup(self):
        if self.mode not in ("constant", "reflect", "edge", "wrap"):
            raise self.fail(f"unknown mode '{self.mode}'")


# ----------------------------------------------------------------------------- DepthToSpace / SpaceToDepth

def _depth_to_space(op: OpImpl, x: np.ndarray, bs: int, mode: str) -> np.ndarray:
    if x.ndim != 4:
        raise op.fail(f"input must be 4-D, got shape {x.shape}")
    b, c, h, w = x.shape
    if c % (bs * bs):
        raise op.fail(f"channels {c} not divisible by blocksize^2 = {bs * bs}")
    if mode == "DCR":
        tmp = x.reshape(b, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        tmp = x.reshape(b, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        raise op.fail(f"unknown mode '{mode}'")
    return tmp.reshape(b, c // (bs * bs), h * bs, w * bs)


def _space_to_depth(op: OpImpl, x: np.ndarray, bs: int, mode: str) -> np.ndarray:
    if x.ndim != 4:
        raise op.fail(f"input must be 4-D, got shape {x.shape}")
    b, c, h, w = x.shape
    if h % bs or w % bs:
        raise op.fail(f"spatial size {h}x{w} not divisible by blocksize {bs}")
    tmp = x.reshape(b, c, h // bs, bs, w // bs, bs)
    if mode == "DCR":
        tmp = tmp.transpose(0, 3, 5, 1, 2, 4)
    elif mode == "CRD":
        tmp = tmp.transpose(0, 1, 3, 5, 2, 4)
    else:
        raise op.fail(f"unknown mode '{mode}'")
    return tmp.reshape(b, c * bs * bs, h // bs, w // bs)


class _BlockOp(OpImpl):
    def setup(self):
        if self.blocksize <= 0:
            raise self.fail(f"blocksize must be positive, got {self.blocksize}")
        mode = getattr(self, "mode", None) or "DCR"
        if mode not in ("DCR", "CRD"):
            raise self.fail(f"unknown mode '{mode}'")
        self._mode = mode


@register("DepthToSpace", versions=[1, 11, 13, 28])
class DepthToSpace(_BlockOp):
    def run(self, x):
        return _depth_to_space(self, x, self.blocksize, self._mode)


@register("SpaceToDepth", versions=[1, 13, 28])
class SpaceToDepth(_BlockOp):
    def run(self, x):
        return _space_to_depth(self, x, self.blocksize, self._mode)


# ----------------------------------------------------------------------------- CenterCropPad

@register("CenterCropPad", versions=[18])
class CenterCropPad(OpImpl):
    shape_inputs = (1,)

    def run(self, x, shape):
        target = _ints(shape)
        axes = list(range(x.ndim)) if self.axes is None else _norm_axes(self, self.axes, x.ndim)
        if len(target) != len(axes):
            raise self.fail(f"shape {target} has {len(target)} entries for {len(axes)} axes")
        out_shape = list(x.shape)
        src = [slice(None)] * x.ndim
        dst = [slice(None)] * x.ndim
        for a, t in zip(axes, target):
            d = x.shape[a]
            out_shape[a] = t
            if t < d:
                start = (d - t) // 2
                src[a] = slice(start, start + t)
            elif t > d:
                start = (t - d) // 2
                dst[a] = slice(start, start + d)
        if any(t < 0 for t in target):
            raise self.fail(f"shape {target} has a negative dimension")
        limits.check_shape(out_shape, x.dtype)
        out = self.xp.zeros(out_shape, dtype=x.dtype)
        out[tuple(dst)] = x[tuple(src)]
        return out

"""Consecutive layout ops merged: Transpose(Transpose(x)) is one Transpose (or none), a
Reshape of a Reshape / Flatten / Squeeze / Unsqueeze reshapes x directly, an Unsqueeze of an
Unsqueeze is one Unsqueeze, and a scalar Gather after a Transpose gathers from x."""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, alias, drop_dead, squeeze_axes

_RESHAPE_LIKE = {"Reshape", "Flatten", "Squeeze", "Unsqueeze"}


def _permutation(perm) -> list[int] | None:
    """`perm` as a list if it is a permutation of 0..n-1, else None: a malformed Transpose is
    left alone, for the op's own check to report."""
    if not isinstance(perm, (list, tuple)) or \
            not all(isinstance(p, (int, np.integer)) for p in perm):
        return None
    perm = [int(p) for p in perm]
    return perm if sorted(perm) == list(range(len(perm))) else None


def merge_transposes(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for outer in index.live("Transpose"):
        inner = index.single_use_producer(outer.inputs[0], "Transpose")
        p2 = _permutation(outer.attrs.get("perm"))
        p1 = _permutation(inner.attrs.get("perm")) if inner else None
        if inner is None or p1 is None or p2 is None or len(p1) != len(p2):
            continue
        perm = [p1[i] for i in p2]  # out[i] = mid[p2[i]] = x[p1[p2[i]]]
        if perm == sorted(perm):
            if alias(graph, index, outer.outputs[0], inner.inputs[0]):
                index.kill(inner, outer)
                changed = True
            continue
        index.set_inputs(outer, [inner.inputs[0]])  # later aliases rename through the index
        outer.attrs = dict(outer.attrs, perm=perm)
        index.kill(inner)
        changed = True
    drop_dead(graph, index)
    return changed


def merge_reshapes(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for outer in index.live("Reshape"):
        if outer.version < 5 or len(outer.inputs) != 2:
            continue
        inner = index.producer.get(outer.inputs[0])
        if inner is None or inner.domain or inner.op_type not in _RESHAPE_LIKE or \
                index.single_use_producer(outer.inputs[0]) is None:
            continue
        target = index.constant(outer.inputs[1])
        # 0 in the target copies a dimension of the *intermediate*; with the inner op gone
        # it would copy x's instead, so only targets without 0 are merged.
        if target is None or (target == 0).any():
            continue
        outer.inputs = [inner.inputs[0], outer.inputs[1]]
        index.kill(inner)
        changed = True
    drop_dead(graph, index)
    return changed


def merge_unsqueezes(graph: Graph, ctx: Context) -> bool:
    """Unsqueeze(Unsqueeze(x, first), second) -> Unsqueeze(x, both), the first's axes moved to
    where its new dimensions end up (dynamic dimensions stay dynamic, unlike a Reshape)."""
    index = GraphIndex(graph)
    changed = False
    for outer in index.live("Unsqueeze"):
        inner = index.single_use_producer(outer.inputs[0], "Unsqueeze")
        rank = index.rank(inner.inputs[0]) if inner is not None else None
        first = squeeze_axes(inner, index) if inner is not None else None
        second = squeeze_axes(outer, index)
        if rank is None or not first or not second:  # (Unsqueeze needs axes)
            continue
        axes = merged_unsqueeze_axes(first, second, rank)
        if axes is None:
            continue
        index.hand_over_read(inner.inputs[0], inner, outer)
        if outer.version >= 13:
            outer.inputs = [inner.inputs[0],
                            index.add_constant(outer.inputs[1], np.array(axes, np.int64))]
        else:
            outer.inputs = [inner.inputs[0]]
            outer.attrs = dict(outer.attrs, axes=axes)
        index.kill(inner)
        changed = True
    drop_dead(graph, index)
    return changed


def merged_unsqueeze_axes(first: list[int], second: list[int], rank: int) -> list[int] | None:
    """The axes of one Unsqueeze of a rank-`rank` tensor doing what Unsqueeze `first`, then
    Unsqueeze `second`, do; None for axes out of range or repeated (the op's to report)."""
    middle, final = rank + len(first), rank + len(first) + len(second)
    if not all(-middle <= a < middle for a in first) or \
            not all(-final <= a < final for a in second):
        return None
    first, second = {a % middle for a in first}, {a % final for a in second}
    if len(first) + len(second) != final - rank:
        return None
    # the intermediate's dimensions fill the final positions `second` leaves free, in order
    middle_positions = [p for p in range(final) if p not in second]
    return sorted(second | {middle_positions[a] for a in first})


def gather_through_transpose(graph: Graph, ctx: Context) -> bool:
    """Gather(Transpose(x, perm), scalar index, axis=a) -> Gather(x, index, axis=perm[a]) when
    the axes left over are then already in order (picking the last step of a sequence after
    a batch/time swap)."""
    index = GraphIndex(graph)
    changed = False
    for gather in index.live("Gather"):
        transpose = index.single_use_producer(gather.inputs[0], "Transpose")
        indices = index.constant(gather.inputs[1])
        perm = _permutation(transpose.attrs.get("perm")) if transpose is not None else None
        axis = gather.attrs.get("axis", 0)
        if not perm or indices is None or indices.ndim != 0 or \
                not isinstance(axis, (int, np.integer)) or not -len(perm) <= axis < len(perm):
            continue
        axis = int(axis) % len(perm)
        source_axis = perm[axis]
        left = [p - (p > source_axis) for i, p in enumerate(perm) if i != axis]
        if left != sorted(left):
            continue
        gather.inputs = [transpose.inputs[0], gather.inputs[1]]
        gather.attrs = dict(gather.attrs, axis=source_axis)
        gather.attr_types = dict(gather.attr_types, axis=AttributeProto.INT)
        index.kill(transpose)
        changed = True
    drop_dead(graph, index)
    return changed

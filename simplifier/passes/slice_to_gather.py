"""Squeeze(Slice(x, i:i+1 along one axis), that axis) -> Gather(x, i, axis): one element along
an axis taken in one op instead of two (torch exports `qkv[0]`, `qkv[1]`, `qkv[2]` of a packed
projection this way)."""
from __future__ import annotations

import numpy as np
from onnx import AttributeProto

from ember.ir import Graph, Node
from ember.simplifier.context import Context
from ember.simplifier.graph import GraphIndex, drop_dead, squeeze_axes


def slice_squeeze_to_gather(graph: Graph, ctx: Context) -> bool:
    index = GraphIndex(graph)
    changed = False
    for squeeze in index.live("Squeeze"):
        sliced = index.single_use_producer(squeeze.inputs[0], "Slice") if squeeze.inputs else None
        taken = single_element_slice(sliced, index) if sliced is not None else None
        if taken is None:
            continue
        axis, position = taken
        if squeezed_axes(squeeze, index) != [axis]:
            continue
        position_name = index.add_constant("gather_index", np.array(position, np.int64))
        gather = Node("Gather", "", ctx.opset(""), [sliced.inputs[0], position_name],
                      [squeeze.outputs[0]], attrs={"axis": axis},
                      attr_types={"axis": AttributeProto.INT}, name=squeeze.name)
        graph.nodes.append(gather)
        index.kill(sliced, squeeze)
        changed = True
    drop_dead(graph, index)
    return changed


def single_element_slice(node: Node, index: GraphIndex) -> tuple[int, int] | None:
    """(axis, position) when a Slice keeps exactly one element along one axis, with step 1:
    its constant start and end resolved against the axis' static size as Slice does (negative
    values count from the end, then both are clamped to [0, size])."""
    if node.version < 10 or len(node.inputs) < 3 or len(node.outputs) != 1:
        return None  # Slice-1 has attributes; not worth a second reader
    shape = index.static_shape(node.inputs[0])
    starts, ends, axes, steps = (index.constant(n) if n else None
                                 for n in (node.inputs[1:] + ["", ""])[:4])
    if shape is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if len(node.inputs) > 3 and node.inputs[3] and (axes is None or axes.size != 1):
        return None
    if len(node.inputs) > 4 and node.inputs[4] and (steps is None or steps.size != 1 or
                                                    int(steps.reshape(-1)[0]) != 1):
        return None
    axis = int(axes.reshape(-1)[0]) if axes is not None else 0
    if not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    size = shape[axis]

    def resolve(bound: int) -> int:
        return min(max(bound + size if bound < 0 else bound, 0), size)

    start, end = resolve(int(starts.reshape(-1)[0])), resolve(int(ends.reshape(-1)[0]))
    return (axis, start) if end - start == 1 else None


def squeezed_axes(node: Node, index: GraphIndex) -> list[int] | None:
    """The axes a Squeeze removes, non-negative; with no axes given, those of static size 1."""
    shape = index.static_shape(node.inputs[0])
    if shape is None:
        return None
    axes = squeeze_axes(node, index, default=[i for i, d in enumerate(shape) if d == 1])
    if axes is None:
        return None
    if not all(-len(shape) <= a < len(shape) for a in axes):
        return None
    return sorted({int(a) % len(shape) for a in axes})
